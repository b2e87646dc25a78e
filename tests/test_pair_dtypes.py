"""The pair read and the output written in float16 or bfloat16 (the projections'
PAIR_DTYPE): every route forced, both nodes, no mask, a row mask and a pair mask, against
the float64 NumPy backend on the pair rounded to that type first. CPU tests: the argument
checks and the plan keys; the rest is marked gpu.

Tolerance: the route's own (float32 I/O, tests/test_gpu.py TOLERANCE) plus the rounding of
the output to the pair's type (relative L2: 2^-8 for bfloat16, 2^-11 for float16). Every
`out` starts as NaN, `rel_l2` fails on any NaN, and at rows left without a key the NaN
of fully_masked="nan" must come out exactly there.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu, reference
from helpers import rel_l2

ROUNDING = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
DTYPES = tuple(ROUNDING)


def _bfloat16():
    return pytest.importorskip("ml_dtypes", reason="ml_dtypes names bfloat16 for NumPy").bfloat16


def host_dtype(name):
    return _bfloat16() if name == "bfloat16" else np.float16


def _fake_array(dtype, shape=(2, 3, 3, 4), c_contiguous=True):
    return types.SimpleNamespace(dtype=np.dtype(dtype), shape=shape,
                                 flags=types.SimpleNamespace(c_contiguous=c_contiguous))


# ---- CPU: argument checks and plan keys ----

def test_pair_dtype_from_the_array_or_the_caller():
    check = gpu.checks.check_pair_dtype
    assert check(np.float32, None) == "float32"
    assert check(np.float16, None) == "float16"
    assert check(np.dtype(_bfloat16()), None) == "bfloat16"
    for carrier in (np.uint16, np.int16):
        assert check(carrier, "bfloat16") == "bfloat16"
    with pytest.raises(TypeError, match="pair must be float32, float16 or bfloat16.*float64"):
        check(np.float64, None)
    with pytest.raises(TypeError, match="pair must be float32, float16 or bfloat16.*uint16"):
        check(np.uint16, None)  # bfloat16 bits only when the caller says so
    with pytest.raises(TypeError, match="pair must be float16 for pair_dtype='float16'; got "
                                        "uint16"):
        check(np.uint16, "float16")
    with pytest.raises(ValueError, match="pair_dtype must be one of"):
        check(np.float32, "float64")


def test_out_must_have_the_pairs_dtype():
    shape = (2, 3, 3, 4)
    gpu.checks.check_out(_fake_array(np.float16), shape, "float16")
    gpu.checks.check_out(_fake_array(np.int16), shape, "bfloat16")
    gpu.checks.check_out(_fake_array(_bfloat16()), shape, "bfloat16")
    gpu.checks.check_out(_fake_array(np.int16), shape, "bfloat16", bfloat16=True)
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float16 array \(the "
                                         r"pair's dtype\) of shape \(2, 3, 3, 4\); got float32"):
        gpu.checks.check_out(_fake_array(np.float32), shape, "float16")
    with pytest.raises(ValueError, match="out must be a C-contiguous float32 .* got "
                                         r"bfloat16 \(torch\)"):
        gpu.checks.check_out(_fake_array(np.int16), shape, "float32", bfloat16=True)
    with pytest.raises(ValueError, match="c_contiguous=False"):
        gpu.checks.check_out(_fake_array(np.float16, c_contiguous=False), shape, "float16")
    with pytest.raises(ValueError, match=r"got float16 \(2, 3, 3, 8\)"):
        gpu.checks.check_out(_fake_array(np.float16, (2, 3, 3, 8)), shape, "float16")


def test_a_torch_bfloat16_tensor_is_taken_as_its_bits():
    torch = pytest.importorskip("torch")
    tensor = torch.tensor([1.0, -2.5, 3.0e38], dtype=torch.bfloat16)
    bits, was_bfloat16 = gpu.checks.bfloat16_bits(tensor)
    assert was_bfloat16 and bits.dtype == torch.int16
    assert bits.data_ptr() == tensor.data_ptr()  # the same memory, no copy
    expected = np.array([1.0, -2.5, 3.0e38], _bfloat16()).view(np.int16)
    assert np.array_equal(bits.numpy(), expected)
    for other in (torch.zeros(2), torch.zeros(2, dtype=torch.float16), np.zeros(2)):
        assert gpu.checks.bfloat16_bits(other) == (other, False)
    assert gpu.checks.bfloat16_dtype(np.dtype(np.int16)) == np.dtype(_bfloat16())


def test_plan_keys_name_a_16_bit_pair_and_the_conventions():
    pair = types.SimpleNamespace(shape=(1, 8, 8, 64), strides=(8192, 1024, 128, 2),
                                 data=types.SimpleNamespace(ptr=1 << 20))
    PlanKey = gpu.launch_plan.PlanKey
    key = PlanKey.of(pair, None, "fp32", False)
    assert PlanKey.of(pair, None, "fp32", False, pair_dtype="float32") == key
    assert key.pair_dtype == "float32" and not key.out_transposed and not key.row_mask
    f16 = PlanKey.of(pair, None, "fp32", False, pair_dtype="float16")
    assert f16 != key and f16._replace(pair_dtype="float32") == key
    ending = PlanKey.of(pair, None, "fp32", False, out_transposed=True, pair_dtype="bfloat16")
    assert (ending.out_transposed, ending.row_mask, ending.pair_dtype) == (True, False,
                                                                           "bfloat16")


# ---- GPU ----

@pytest.fixture
def cp():
    import cupy

    return cupy


def _to_device(cp, host, dtype):
    """A host array rounded to `dtype` as the GPU array the API takes (bfloat16: CuPy's
    array of ml_dtypes.bfloat16, over its bits)."""
    if dtype == "bfloat16":
        return cp.asarray(host.view(np.uint16)).view(_bfloat16())
    return cp.asarray(host)


def _poisoned(cp, shape, dtype):
    """An output buffer of `dtype` full of NaN (filled as its bits: CuPy runs no kernel on
    ml_dtypes' bfloat16)."""
    nan = int(np.array(np.nan, host_dtype(dtype)).view(np.uint16))
    return cp.full(shape, nan, cp.uint16).view(host_dtype(dtype))


def _host(got):
    """A GPU result on the host in its own 16-bit type (copied as its bits)."""
    return got.view(cp_module().uint16).get().view(got.dtype)


def cp_module():
    import cupy

    return cupy


def check_dtype(cp, rng, B, N, D, h, dtype, *, route=None, precision="fp32",
                mask_layout="pair", node="starting", masked=True, pair_form=None,
                weights=None):
    """One GPU forward with the pair and out in `dtype` against the float64 NumPy backend
    on the same rounded pair; returns the rel L2 error."""
    from test_gpu import TOLERANCE, poison_pool
    from test_gpu_conventions import convention_mask

    if weights is None:
        weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(host_dtype(dtype))
    mask = convention_mask(rng, B, N, "random") if masked else None
    conventions = dict(mask_layout=mask_layout, node=node)
    expected = reference.triangle_attention(pair.astype(np.float64), mask, weights,
                                            fully_masked="nan", **conventions)
    dead = np.isnan(expected)
    d_pair = _to_device(cp, pair, dtype)
    if pair_form is not None:
        d_pair = pair_form(d_pair)
    poison_pool(cp)
    out = _poisoned(cp, pair.shape, dtype)
    got = ta.triangle_attention(d_pair, None if mask is None else cp.asarray(mask), weights,
                                fully_masked="nan", out=out, precision=precision,
                                route=route, **conventions)
    assert got is out and got.dtype == out.dtype
    got = _host(got).astype(np.float64)
    assert np.array_equal(np.isnan(got), dead), "NaN exactly at the rows without keys"
    err = rel_l2(got, expected, where=~dead)
    tol = TOLERANCE[precision] + ROUNDING[dtype]
    assert err <= tol, (f"{route or 'default'} {precision} {dtype} {mask_layout}/{node} "
                        f"masked={masked} B={B} N={N} D={D} h={h}: rel L2 {err:.3g} > {tol:.3g}")
    return err


def _route_cases():
    """Each route once, in its first precision, per 16-bit type."""
    return [(name, gpu.routes.route_parts(name)["precisions"][0], dtype)
            for name in gpu.routes.ROUTES for dtype in DTYPES]


def _route_shape(cp, name):
    from test_gpu_conventions import _route_shape, _skip_unless_runs

    _skip_unless_runs(cp, name)
    return _route_shape(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name,precision,dtype", _route_cases(), ids=lambda x: str(x))
def test_every_route_reads_and_writes_16_bits(cp, rng, name, precision, dtype):
    """Both nodes x no mask, the row mask and the pair mask (rows left without keys), B = 2,
    N = 61 (no tile's multiple); then B = 1, N = 200 at the ending node."""
    D, h = _route_shape(cp, name)
    for node in ("starting", "ending"):
        for mask_layout, masked in (("pair", False), ("row", True), ("pair", True)):
            check_dtype(cp, rng, 2, 61, D, h, dtype, route=name, precision=precision,
                        mask_layout=mask_layout, node=node, masked=masked)
    check_dtype(cp, rng, 1, 200, D, h, dtype, route=name, precision=precision,
                mask_layout="row", node="ending")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", gpu.checks.PRECISIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_default_routes(cp, rng, dtype, precision):
    """The routes each mode takes by default: small and past the wgmma threshold, D = 128
    (the persistent projections) and 64."""
    for B, N, D, h in ((2, 45, 64, 4), (1, 200, 128, 4), (1, 400, 128, 4)):
        check_dtype(cp, rng, B, N, D, h, dtype, precision=precision)


def _strided(cp, pair):
    """The pair as a non-contiguous view: every other channel of a wider array (built on
    its bits: CuPy runs no kernel on ml_dtypes' bfloat16)."""
    wide = cp.zeros(pair.shape[:-1] + (2 * pair.shape[-1],), cp.uint16)
    wide[..., ::2] = pair.view(cp.uint16)
    return wide[..., ::2].view(pair.dtype)


def _offset(cp, pair):
    """The pair one element off a 16-byte boundary (rows not aligned)."""
    flat = cp.zeros(pair.size + 1, cp.uint16)
    view = flat[1:].reshape(pair.shape)
    view[...] = pair.view(cp.uint16)
    return view.view(pair.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", [_strided, _offset], ids=["channel_stride", "unaligned"])
def test_non_contiguous_pairs(cp, rng, dtype, form):
    """Views read as they are or through an aligned copy in their own type, on the default
    route and on a persistent projection's (D = 128)."""
    for route in (None, "wgmma_f16x3_persistent"):
        if route and int(cp.cuda.Device().compute_capability) != 90:
            continue
        check_dtype(cp, rng, 2, 70, 128, 4, dtype, route=route,
                    pair_form=lambda p: form(cp, p))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_too_short_for_vector_loads(cp, rng, dtype):
    """D = 36: 72-byte rows are never 16-byte aligned, read by scalar loads in place."""
    for route in (None, "ffma", "mma_tf32_ffma"):
        check_dtype(cp, rng, 2, 33, 36, 3, dtype, route=route,
                    precision="fp32" if route != "mma_tf32_ffma" else "tf32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_result_dtype_and_out_errors(cp, rng, dtype):
    """Without `out` the result has the pair's dtype; an `out` of another dtype is a
    ValueError naming the argument, the dtype expected and the one given."""
    weights = ta.random_weights(64, 4, seed=3)
    pair = _to_device(cp, rng.standard_normal((1, 20, 20, 64)).astype(host_dtype(dtype)),
                      dtype)
    got = ta.triangle_attention(pair, None, weights)
    assert got.dtype == pair.dtype and got.shape == pair.shape
    assert np.isfinite(_host(got).astype(np.float64)).all()
    for wrong in (cp.zeros(pair.shape, cp.float32),
                  cp.zeros(pair.shape, cp.float16 if dtype == "bfloat16" else cp.int16)):
        with pytest.raises(ValueError, match=f"out must be a C-contiguous {dtype} array"):
            ta.triangle_attention(pair, None, weights, out=wrong)
    with pytest.raises(ValueError, match="out must be a C-contiguous float32 array"):
        ta.triangle_attention(cp.zeros(pair.shape, cp.float32), None, weights,
                              out=cp.zeros(pair.shape, pair.dtype))


@pytest.mark.gpu
def test_torch_bfloat16_tensors_in_and_out(cp, rng):
    """A torch bfloat16 CUDA tensor as the pair and as `out`, written in place; the result
    the same bits as the CuPy bfloat16 array's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    weights = ta.random_weights(128, 4, seed=5)
    host = rng.standard_normal((2, 40, 40, 128)).astype(_bfloat16())
    pair = torch.from_numpy(host.view(np.int16)).cuda().view(torch.bfloat16)
    out = torch.full(pair.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    got = ta.triangle_attention(pair, None, weights, out=out)
    torch.cuda.synchronize()
    mine = ta.triangle_attention(_to_device(cp, host, "bfloat16"), None, weights)
    mine = mine.view(cp.int16).get()
    assert np.array_equal(out.view(torch.int16).cpu().numpy(), mine)
    assert np.array_equal(got.view(cp.int16).get(), mine)
    fresh = ta.triangle_attention(pair, None, weights)
    assert fresh.dtype == np.dtype(_bfloat16())


@pytest.mark.gpu
def test_forward_takes_bfloat16_bits_and_an_allocator(cp, rng):
    """The torch layer's contract: int16 bits with pair_dtype="bfloat16", memory from
    `allocate` (kept alive by the Forward and the result), nothing from the pool."""
    weights = ta.random_weights(128, 4, seed=7)
    module = ta.TriangleAttention(weights)
    host = rng.standard_normal((1, 150, 150, 128)).astype(_bfloat16())
    bits = cp.asarray(host.view(np.int16))
    taken = []

    def allocate(nbytes):
        memory = cp.cuda.alloc(nbytes)  # an object with .ptr, held by the caller's pool
        taken.append(nbytes)
        return memory

    strided = _offset(cp, bits)  # an aligned copy is needed: from `allocate` too
    forward = gpu.forward.Forward(module._dw, strided, None, "zero", None, "bf16",
                          pair_dtype="bfloat16", allocate=allocate)
    got = forward.run()
    assert got.dtype == np.int16 and len(taken) == 3  # the copy, the scratch, the result
    expected = module(_to_device(cp, host, "bfloat16"), precision="bf16")
    assert np.array_equal(got.get(), expected.view(cp.int16).get())
