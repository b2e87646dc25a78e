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


@pytest.mark.parametrize("no,d", [(512, 128), (130, 32), (3072, 768)])
def test_f16_hi_chunks_are_the_one_product_rings_chunks(no, d):
    """project_mma.cu F16_TERMS 1 reads chunk (pass p, k-chunk c) as the contiguous 8 KiB at
    (p * D / 32 + c) * 8192 bytes, row n = fp16(W[p BN + n, 32 c : 32 c + 32]), zero past
    NO."""
    from triattn_cupy import _configs

    bn, bk = _configs.PROJECT_MMA_HI_CHUNK
    assert bk == 32 and bn * bk * 2 == 8192  # the ring's 8 KiB stages
    w = np.random.default_rng(0).standard_normal((no, d)).astype(np.float32) * 300
    got = _gpu.f16_hi_chunks(w)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    flat = got.reshape(-1).view(np.float16)
    chunks = d // bk
    for p in range(-(-no // bn)):
        for c in range(chunks):
            chunk = flat[(p * chunks + c) * bn * bk:][:bn * bk].reshape(bn, bk)
            want = np.zeros((bn, bk), np.float16)
            part = w[p * bn:(p + 1) * bn, c * bk:(c + 1) * bk].astype(np.float16)
            want[:part.shape[0]] = part
            assert np.array_equal(chunk, want), (p, c)


def test_f16_hi_chunks_need_d_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        _gpu.f16_hi_chunks(np.ones((128, 48), np.float32))


def _worst_case_rows(w, gamma, rng):
    """LayerNorm-normalised rows n (|n|_2 = sqrt(D); the mean need not be 0 for the bound)
    reaching each column's bound, n = +-sqrt(D) u with u the unit vector along gamma * W[c]
    (zero where that is zero), and 256 random rows."""
    import math

    D = w.shape[1]
    u = w * gamma
    norms = np.linalg.norm(u, axis=1, keepdims=True)
    u = np.divide(u, norms, out=np.zeros_like(u), where=norms > 0)
    return np.concatenate([math.sqrt(D) * u, -math.sqrt(D) * u, rng.standard_normal((256, D))])


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
@pytest.mark.parametrize("D,h", [(128, 4), (64, 2), (96, 3)])
def test_f16x3_scales_keep_q_k_v_inside_fp16(D, h, magnitude):
    """The fp32 mode's fp16 split: powers of two that put every value of q (with its
    log2(e)/sqrt(d)), k and v at or below F16X3_TOP, for any input; with LayerNorm rows
    chosen to reach each column's bound (n parallel to gamma * W[c]) and random rows, and
    the largest values not far below the top (no needless loss to fp16's subnormals)."""
    import math

    import triattn_cupy as ta

    base = ta.random_weights(D, h, seed=5)
    params = {k: (v * np.float32(magnitude) if k.split(".")[0] in ("query", "key", "value")
                  else v) for k, v in base.params.items()}
    weights = ta.Weights(D, h, base.layer_norm_eps, params)
    scales = _gpu.f16x3_scales(weights)
    gamma, beta = params["layer_norm.weight"].astype(np.float64), params["layer_norm.bias"]
    rng = np.random.default_rng(1)
    for (name, factor), s in zip((("query", _gpu.LOG2E / math.sqrt(D // h)), ("key", 1.0),
                                  ("value", 1.0)), scales):
        assert s == 2.0 ** round(math.log2(s))
        w, b = params[f"{name}.weight"].astype(np.float64), params[f"{name}.bias"]
        n = _worst_case_rows(w, gamma, rng)
        values = ((n * gamma + beta) @ w.T + b) * factor * s
        top = np.abs(values).max()
        assert top <= _gpu.F16X3_TOP
        assert top > _gpu.F16X3_TOP / 4  # the worst case reaches within a factor 2 of the scale step


def test_f16x3_scales_of_zero_weights_are_one():
    import triattn_cupy as ta

    base = ta.random_weights(32, 2, seed=5)
    params = {k: np.zeros_like(v) if k.split(".")[0] in ("query", "key", "value") else v
              for k, v in base.params.items()}
    assert _gpu.f16x3_scales(ta.Weights(32, 2, base.layer_norm_eps, params)) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("qk,bias", [(1.0, 1.0), (1e-4, 1.0), (1e3, 1.0), (1.0, 1e4), (1.0, 0.0)])
def test_f16_biased_scales_keep_the_scaled_bias_inside_fp16(qk, bias):
    """The tf32 mode's one fp16 product (F16X1) accumulates S onto the pair bias stored
    times s_b = s_q s_k: every bias value (worst-case LayerNorm rows) times s_b stays at or
    below F16X3_TOP; s_q, s_k never exceed f16x3's (q and k stay inside fp16) and come down
    only as far as the bias needs (within a factor 4 of the top)."""
    import triattn_cupy as ta

    D, h = 128, 4
    base = ta.random_weights(D, h, seed=6)
    params = {k: (v * np.float32(qk) if k.split(".")[0] in ("query", "key") else
                  v * np.float32(bias) if k.startswith("bias_proj") else v)
              for k, v in base.params.items()}
    weights = ta.Weights(D, h, base.layer_norm_eps, params)
    qkv = _gpu.f16x3_scales(weights)
    s_q, s_k, s_v, s_b = _gpu.f16_biased_scales(weights, qkv)
    assert s_b == s_q * s_k and s_v == qkv[2]
    assert s_q <= qkv[0] and s_k <= qkv[1] and s_q / s_k in (qkv[0] / qkv[1], 2 * qkv[0] / qkv[1])
    gamma, beta = params["layer_norm.weight"].astype(np.float64), params["layer_norm.bias"]
    wb = params["bias_proj.weight"].astype(np.float64)
    n = _worst_case_rows(wb, gamma, np.random.default_rng(3))
    top = np.abs((n * gamma + beta) @ wb.T).max() * _gpu.LOG2E * s_b
    assert top <= _gpu.F16X3_TOP
    if s_b < qkv[0] * qkv[1]:  # brought down for the bias: no further than needed
        assert top > _gpu.F16X3_TOP / 4


def test_f16_split_chunks_hold_each_row_as_fp16_hi_then_lo():
    """project_mma.cu F16_TERMS reads each 16-value chunk row as 16 fp16 hi then 16 lo:
    hi + lo within ~2^-22 of the value (relative to the chunk's largest), same bytes."""
    chunks = np.random.default_rng(2).standard_normal((2, 3, 128, 16)).astype(np.float32) * 300
    split = _gpu.f16_split_chunks(chunks)
    assert split.shape == chunks.shape and split.dtype == np.float32
    halves = split.view(np.uint16).reshape(2, 3, 128, 32)
    hi = halves[..., :16].view(np.float16).astype(np.float64)
    lo = halves[..., 16:].view(np.float16).astype(np.float64)
    assert np.array_equal(hi, chunks.astype(np.float16).astype(np.float64))
    assert np.abs(hi + lo - chunks).max() <= 2.0 ** -21 * np.abs(chunks).max()


@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 3e3])
def test_f16_projection_scales_bound_layernorm_outputs_and_weights(magnitude):
    """a_scale keeps every LayerNorm output (|n|_2 <= sqrt(D) per row) and w_scale every
    scaled weight at or below F16X3_TOP, each within a factor 2 of it."""
    import math

    import triattn_cupy as ta

    D, h = 64, 2
    base = ta.random_weights(D, h, seed=8)
    params = {k: (v * np.float32(magnitude) if k.startswith("layer_norm") else v)
              for k, v in base.params.items()}
    weights = ta.Weights(D, h, base.layer_norm_eps, params)
    qkv = _gpu.f16x3_scales(weights)
    scales = _gpu.f16_projection_scales(weights, (*qkv, 1.0))
    a_scale, w_scale = scales.a, scales.w
    gamma, beta = params["layer_norm.weight"], params["layer_norm.bias"]
    top = (math.sqrt(D) * np.abs(gamma) + np.abs(beta)).max() * a_scale
    assert _gpu.F16X3_TOP / 2 < top <= _gpu.F16X3_TOP
    rows = np.concatenate([params[f"{n}.weight"] * s for n, s in
                           zip(("query", "key", "value", "gate"), (*qkv, 1.0))])
    w_top = max(np.abs(rows).max(), np.abs(params["bias_proj.weight"]).max()) * w_scale
    assert _gpu.F16X3_TOP / 2 < w_top <= _gpu.F16X3_TOP
    out_w_top = np.abs(params["out_proj.weight"]).max() * scales.out_w
    assert _gpu.F16X3_TOP / 2 < out_w_top <= _gpu.F16X3_TOP
    # (g * o: scaled per block by the out projection itself, load_gated_tile_f16)
