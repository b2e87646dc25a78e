"""Kernel arguments that need no GPU to check: scalars converted once and reused, the
projection weights' chunk layout."""
import numpy as np
import pytest

from triattn_cupy import _gpu

pytest.importorskip("cupy")


def test_scalar_arguments_are_cached_per_type_and_value():
    assert _gpu._i32(7) is _gpu._i32(7)
    assert _gpu._i32(7) is not _gpu._i64(7)  # same value, another width
    assert _gpu._f32(0.5) is _gpu._f32(0.5)
    assert _gpu._i32(np.int64(7)) is _gpu._i32(7)  # NumPy and Python ints alike


def test_scalar_arguments_keep_their_type():
    from cupy.cuda.function import CNumpyArray

    for arg in (_gpu._i32(3), _gpu._i64(-(1 << 40)), _gpu._f32(1e-5)):
        assert isinstance(arg, CNumpyArray)


@pytest.mark.parametrize("no,d", [(512, 128), (4, 4), (130, 20), (3072, 768)])
def test_weight_chunks_are_the_rings_chunks_in_order(no, d):
    """project_mma.cu reads chunk (pass p, k-chunk c) of W as the contiguous block at
    (p * chunks + c) * BN * BK, [BN rows][BK columns], zero past NO and D."""
    from triattn_cupy import _configs

    bn, bk = _configs.PROJECT_MMA_CHUNK
    w = np.random.default_rng(0).standard_normal((no, d)).astype(np.float32)
    flat = _gpu.weight_chunks(w).reshape(-1)
    chunks = -(-d // bk)
    for p in range(-(-no // bn)):
        for c in range(chunks):
            got = flat[(p * chunks + c) * bn * bk:][:bn * bk].reshape(bn, bk)
            want = np.zeros((bn, bk), np.float32)
            part = w[p * bn:(p + 1) * bn, c * bk:(c + 1) * bk]
            want[:part.shape[0], :part.shape[1]] = part
            assert np.array_equal(got, want), (p, c)
