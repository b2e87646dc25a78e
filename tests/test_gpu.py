"""The GPU pipeline against the float64 NumPy reference (which tests/test_reference.py
holds to the PyTorch spec). Skipped with a reason where there is no GPU.

Every output buffer is poisoned with NaN before the launch (explicit `out=`, or the memory
pool refilled with NaN so fresh allocations start poisoned), and `rel_l2` fails on any NaN.
"""
from __future__ import annotations

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu, reference
from helpers import rel_l2, spec_forward, spec_model

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-5
TOLERANCE = {"fp32": FP32_TOL, "tf32": 1e-3, "bf16": 5e-3}  # rel L2 against float64
# (D, h) for head dims 8, 16, 32, 64, 128 and two that are not powers of two.
SHAPES_DH = [(32, 4), (64, 4), (128, 4), (128, 2), (128, 1), (96, 4), (40, 2)]
SWEEP_N = list(range(1, 71)) + [97, 130, 200, 257]


@pytest.fixture
def cp():
    import cupy

    return cupy


def poison_pool(cp, nbytes=64 << 20):
    """Fill freed pool memory with NaN, so an element a kernel forgets to write is NaN."""
    junk = cp.full(nbytes // 4, np.nan, np.float32)
    del junk  # back to the pool, still holding NaN


def make_mask(rng, B, N, kind="bool", fully_masked_rows=True):
    keep = rng.random((B, N, N)) > 0.25
    if fully_masked_rows and N > 1:
        keep[:, rng.integers(N), :] = False  # a query (b, j) with every key masked
    if kind == "bool":
        return keep
    if kind == "int":
        return keep.astype(np.int32) * rng.integers(1, 5, keep.shape).astype(np.int32)
    if kind in ("int8", "uint8", "int16", "int64", "float16"):
        return keep.astype(kind)
    if kind == "float":
        return keep * rng.uniform(0.5, 2.0, keep.shape)  # nonzero float = keep
    raise ValueError(kind)


def check_against_reference(cp, rng, B, N, D, h, *, mask_kind="bool", fully_masked="zero",
                            batched=True, precision="fp32", route=None):
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = rng.standard_normal((B, N, N, D)).astype(np.float32) * 2 + 0.5
    mask = None if mask_kind is None else make_mask(rng, B, N, mask_kind)
    if not batched:
        pair, mask = pair[0], (None if mask is None else mask[0])
    expected = reference.triangle_attention(pair, mask, weights, fully_masked=fully_masked)
    out = cp.full(pair.shape, np.nan, np.float32)
    got = ta.triangle_attention(cp.asarray(pair), None if mask is None else cp.asarray(mask),
                                weights, fully_masked=fully_masked, out=out,
                                precision=precision, route=route)
    assert got is out
    got = got.get()
    if mask is not None and fully_masked == "nan":
        fully = ~np.asarray(mask != 0).any(axis=-1)            # [B?, N] queries j
        fully = np.broadcast_to(fully[..., None, :, None], got.shape)
        assert np.array_equal(np.isnan(got), fully), "NaN exactly at fully-masked queries"
        err = rel_l2(got, expected, where=~fully) if (~fully).any() else 0.0
    else:
        err = rel_l2(got, expected)
    assert err <= TOLERANCE[precision], f"{precision} B={B} N={N} D={D} h={h}: rel L2 {err:.3g}"
    return err


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("N", SWEEP_N)
def test_sweep_n(cp, rng, N, precision):
    """Every N 1..70 and a few large ones, cycling B, head dims, mask kinds and policies."""
    D, h = SHAPES_DH[N % len(SHAPES_DH)]
    B = 1 + N % 3
    mask_kind = ("bool", "int", "float", None)[N % 4]
    policy = ("zero", "nan")[(N // 4) % 2]
    poison_pool(cp)
    check_against_reference(cp, rng, B, N, D, h, mask_kind=mask_kind, fully_masked=policy,
                            precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("head_dim", ta.gpu.checks.supported_head_dims())
def test_every_head_dim(cp, rng, head_dim, precision):
    h = 2 if head_dim * 2 <= ta.gpu.tiles.MAX_PAIR_DIM else 1
    check_against_reference(cp, rng, 2, 37, head_dim * h, h, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("D,h", [(384, 4), (768, 6)])
def test_wide_pair_dim(cp, rng, D, h, precision):
    """D above 320 takes the 64-row projection blocks (shared memory)."""
    check_against_reference(cp, rng, 1, 23, D, h, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("D,h,N", [(384, 12, 131), (768, 24, 130)])
def test_wide_pair_dim_on_the_wgmma_path(cp, rng, D, h, N, precision):
    """Head dim 32 past N = 128 at a wide D: the wgmma attention (on an H100/H200) with the
    64-row projection blocks that write its tiles (and 2 weight stages at D = 768); odd
    and even N take the two V^T store paths."""
    poison_pool(cp)
    check_against_reference(cp, rng, 1, N, D, h, fully_masked="nan", precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_ffma_route_of_older_gpus(cp, rng, precision):
    """GPUs before sm_80 take the FFMA projections (project_ffma.cu) and attention in fp32 in
    every mode (the route "ffma"); forced here, since this GPU takes tensor cores."""
    for B, N, D, h in [(1, 17, 64, 4), (2, 45, 128, 4), (1, 23, 384, 4), (1, 140, 128, 4)]:
        check_against_reference(cp, rng, B, N, D, h, fully_masked="nan", precision=precision,
                                route="ffma")


# Every route of the table, forced on this GPU where it can run it (the sm_80 routes with
# the sm_80 tile tables too): the one forward of each against float64, at sizes off the
# tiles, B = 2, with fully masked queries.
_ROUTE_CASES = [(name, precision) for name in gpu.routes.ROUTES
                for precision in gpu.routes.route_parts(name)["precisions"]]


@pytest.mark.parametrize("name,precision", _ROUTE_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("tables", ["", "@sm_80"])
def test_every_route_forced(cp, rng, name, precision, tables):
    attention = gpu.routes.route_parts(name)["attention"]
    if tables and not attention.startswith("mma"):
        pytest.skip("the sm_80 tile tables shape the mma.sync attention only")
    tiles = gpu.routes.route_parts(name)["project"] == "persistent"
    D = 128 if tiles or attention.startswith("wgmma") else 64
    h = D // 32 if attention.startswith("wgmma") or tiles else 4
    cc = int(cp.cuda.Device().compute_capability)
    if attention.startswith("wgmma") and cc != 90:
        pytest.skip("wgmma runs on compute capability 9.0 only")
    if attention != "ffma" and cc < 80:
        pytest.skip("tensor cores need compute capability 8.0")
    for B, N in [(2, 45), (1, 200)]:
        check_against_reference(cp, rng, B, N, D, h, fully_masked="nan", precision=precision,
                                route=name + tables)


def test_shared_memory_limits_of_one_kernel_across_sizes(cp, rng):
    """One compiled kernel serves several D: a smaller launch must not lower the shared
    memory limit a larger one needs (a cached-handle bug seen on the H200)."""
    for D in (256, 64, 256):
        check_against_reference(cp, rng, 2, 184, D, 4)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("B", [1, 2, 3])
@pytest.mark.parametrize("D,h", [(64, 4), (128, 4), (128, 1)])
def test_batches_and_sizes(cp, rng, B, D, h, precision):
    for N in (17, 64, 113):
        check_against_reference(cp, rng, B, N, D, h, fully_masked="nan", precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("mask_kind", ["bool", "int", "int8", "uint8", "int16", "int64",
                                       "float16", "float", None])
def test_mask_dtypes(cp, rng, mask_kind, precision):
    """Each precision's projection kernel reads the mask in its own dtype."""
    check_against_reference(cp, rng, 2, 29, 64, 4, mask_kind=mask_kind, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_unbatched(cp, rng, precision):
    check_against_reference(cp, rng, 1, 45, 128, 4, batched=False, fully_masked="nan",
                            precision=precision)
    check_against_reference(cp, rng, 1, 45, 128, 4, batched=False, mask_kind=None,
                            precision=precision)


def test_zero_policy_gives_out_bias(cp, rng):
    weights = ta.random_weights(64, 4, seed=3)
    N = 23
    pair = cp.asarray(rng.standard_normal((2, N, N, 64)).astype(np.float32))
    mask = cp.ones((2, N, N), bool)
    mask[1, 5, :] = False
    mask[0, :, 7] = False  # a masked key everywhere: ordinary masking, not fully masked
    out = ta.triangle_attention(pair, mask, weights).get()
    np.testing.assert_array_equal(
        out[1, :, 5], np.broadcast_to(weights["out_proj.bias"], (N, 64)))
    assert np.isfinite(out).all()


def test_fully_masked_everything(cp):
    weights = ta.random_weights(32, 4, seed=4)
    pair = cp.random.standard_normal((1, 9, 9, 32), dtype=np.float32)
    mask = cp.zeros((1, 9, 9), np.float32)
    zero = ta.triangle_attention(pair, mask, weights).get()
    np.testing.assert_array_equal(zero, np.broadcast_to(weights["out_proj.bias"], zero.shape))
    assert np.isnan(ta.triangle_attention(pair, mask, weights, fully_masked="nan").get()).all()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("view", ["transposed", "sliced_D", "strided_D", "reversed"])
def test_non_contiguous_pair(cp, rng, view, precision):
    """Strided and misaligned rows: the projections' scalar-load path (x_vec = 0) in each
    precision's kernel."""
    B, N, D, h = 2, 31, 64, 4
    weights = ta.random_weights(D, h, seed=5)
    base = cp.asarray(rng.standard_normal((B, N, N, 2 * D)).astype(np.float32))
    pair = {"transposed": base[..., :D].transpose(0, 2, 1, 3),
            "sliced_D": base[..., 3:3 + D],
            "strided_D": base[..., ::2],
            "reversed": base[:, ::-1, :, D:]}[view]
    assert not pair.flags.c_contiguous
    mask = cp.asarray(make_mask(rng, B, N)).transpose(0, 2, 1)  # a non-contiguous mask too
    poison_pool(cp)
    got = ta.triangle_attention(pair, mask, weights, precision=precision)
    expected = reference.triangle_attention(pair.get(), mask.get(), weights)
    assert rel_l2(got, expected) <= TOLERANCE[precision]


def test_class_api_and_repeat_calls(cp, rng):
    weights = ta.random_weights(128, 4, seed=6)
    module = ta.TriangleAttention(weights)
    pair = rng.standard_normal((1, 40, 40, 128)).astype(np.float32)
    expected = reference.triangle_attention(pair, None, weights)
    first = module(cp.asarray(pair))
    second = module(cp.asarray(pair))
    assert rel_l2(first, expected) <= FP32_TOL
    cp.testing.assert_array_equal(first, second)  # deterministic: no atomics, fixed order


def test_from_hdf5(cp, rng, tmp_path):
    hdf5 = pytest.importorskip("triattn_cupy.hdf5")
    weights = ta.random_weights(64, 2, seed=7)
    path = tmp_path / "w.h5"
    hdf5.save_weights(weights, path)
    module = ta.TriangleAttention.from_hdf5(path)
    pair = rng.standard_normal((2, 11, 11, 64)).astype(np.float32)
    assert rel_l2(module(cp.asarray(pair)), reference.triangle_attention(pair, None, weights)) <= FP32_TOL


def test_torch_tensor_input(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    weights = ta.random_weights(64, 4, seed=8)
    pair = torch.randn(2, 19, 19, 64, device="cuda")
    mask = torch.rand(2, 19, 19, device="cuda") > 0.2
    got = ta.triangle_attention(pair, mask, weights)
    expected = reference.triangle_attention(pair.cpu().numpy(), mask.cpu().numpy(), weights)
    assert rel_l2(got, expected) <= FP32_TOL


def _torch_in_precision(torch, weights, pair, mask, precision):
    """The spec module on the GPU the way PyTorch runs it in `precision`: fp32 (no TF32),
    fp32 with TF32 matmuls (the legacy allow_tf32 flag, as the benchmark's
    ref_eager_tf32), or weights and inputs in bfloat16."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = spec_model(weights, dtype).cuda()
    flag = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        with torch.no_grad():
            out = model(torch.from_numpy(pair).to("cuda", dtype),
                        torch.from_numpy(mask.astype(np.float32)).to("cuda", dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag
    return out.float().cpu().numpy()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_error_within_twice_pytorch_in_the_same_precision(cp, rng, precision):
    """Issue 6: each mode's error against float64 is no worse than twice the error of the
    spec module run by PyTorch in the same precision, on the same inputs. 1x160x128x4:
    past N = 128 with head dim 32, where every mode takes the wgmma attention (fp32 as
    fp16 split products, f16x3); 1x300x128x4 further on."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    for B, N, D, h in [(1, 64, 128, 4), (2, 75, 64, 4), (1, 40, 128, 2), (2, 33, 96, 4),
                       (1, 160, 128, 4), (1, 300, 128, 4)]:
        weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
        pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
        mask = make_mask(rng, B, N, fully_masked_rows=False)
        expected = spec_forward(weights, pair, mask)
        ours = ta.triangle_attention(cp.asarray(pair), cp.asarray(mask), weights,
                                     precision=precision).get()
        theirs = _torch_in_precision(torch, weights, pair, mask, precision)
        ours_err, torch_err = rel_l2(ours, expected), rel_l2(theirs, expected)
        print(f"{precision} {B}x{N}x{D}x{h}: ours {ours_err:.3g}, PyTorch {torch_err:.3g}, "
              f"ratio {ours_err / torch_err:.2f}")
        assert ours_err <= 2 * torch_err, (precision, (B, N, D, h), ours_err, torch_err)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("gate_bias", [-20.0, -70.0])
def test_saturated_gates_with_no_out_bias(cp, rng, precision, gate_bias):
    """Every gate near 0 (gate bias -20: g ~ 2e-9; -70: g ~ 4e-31) and no out bias, past
    N = 128 at head dim 32: the output is (g o) Wo, tiny, and every mode must still hold
    its bound. The fp16 out projections (F16_TERMS) once scaled g o by a power of two fixed
    from the weights (|g o| <= max |v|), which left it among fp16's subnormals at -20, and
    the tf32 mode's fp16 gate flushed to 0 (tf32 1.0, fp32 2.7e-2,
    bf16 2.7e-2): now each block scales its own g o (load_gated_tile_f16) and tiles_f16
    keeps the gate in fp32. At -70 the block's scale passes 2^110, and the product of its
    inverse and Wo's unscale fell below fp32's range (relative error 1 in every mode):
    the two are now applied one after the other."""
    base = ta.random_weights(64, 2, seed=int(rng.integers(1 << 31)))
    params = dict(base.params)
    params["gate.bias"] = np.full_like(params["gate.bias"], gate_bias)
    params["out_proj.bias"] = np.zeros_like(params["out_proj.bias"])
    weights = ta.Weights(base.pair_dim, base.num_heads, base.layer_norm_eps, params)
    pair = rng.standard_normal((1, 136, 136, 64)).astype(np.float32) * 2 + 0.5
    mask = make_mask(rng, 1, 136, fully_masked_rows=False)
    expected = reference.triangle_attention(pair, mask, weights)
    got = ta.triangle_attention(cp.asarray(pair), cp.asarray(mask), weights,
                                precision=precision).get()
    err = rel_l2(got, expected)
    print(f"{precision} saturated gates (bias {gate_bias}): rel L2 {err:.3g}")
    assert err <= TOLERANCE[precision], (precision, gate_bias, err)


# ---- the fp32 mode's projections on their own (project_mma.cu F16_TERMS 3, rows_fp32) ----

PROJECTION_TOL = 3e-7  # rel L2 of each stored part against float64 (emulated: ~1.1e-7)
# The pair bias is one dot product per (key, head) whose terms cancel (|bias| well below the
# sum of |xn_d Wb_d|), so its relative error runs higher; at N = 1 it is 2h values (seen:
# 4.5e-7 at D = 40, h = 2)
BIAS_TOL = 1e-6


def _format0_forward(cp, rng, B, N, D, h):
    """A forward in fp32 mode whose projections write rows_fp32 (the route mma_f16x3_ffma:
    any head dim), its scratch and output filled with NaN; the weights, pair (host
    float32) and keep mask (fully masked queries, and on N > 2 a key masked for every
    query) with it."""
    from triattn_cupy.gpu.device_weights import DeviceWeights
    from triattn_cupy.gpu.forward import Forward

    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
    keep = make_mask(rng, B, N)
    if N > 2:
        keep[:, :, rng.integers(N)] = False  # a key masked for every query
    if not keep.any():  # (N = 1: both pairs' one key masked, 1 in 16) something to compare
        keep[0, 0, 0] = True
    dw = DeviceWeights(weights, cp.cuda.runtime.getDevice())
    if cp.cuda.Device().compute_capability < "80":
        pytest.skip("this GPU takes the FFMA projections (compute capability below 8.0)")
    fwd = Forward(dw, cp.asarray(pair), cp.asarray(keep), "zero", None, "fp32",
                  route="mma_f16x3_ffma")
    assert fwd.layout == gpu.layouts.ROWS_FP32 and fwd.plan.project_f16
    for array in (fwd.qkvg, fwd.bias, fwd.out):  # (the bias is float32 in rows_fp32)
        array.fill(np.nan)
    return weights, pair, keep, fwd


def _projected_float64(weights, pair, keep):
    """What ln_qkvg_project stores in rows_fp32, in float64 from the float32 pair: q (times
    log2(e)/sqrt(d)), k, v and the gate [M, D] each, and the pair bias [B, h, N, N] in
    log2(e) units, -inf where the mask drops (b, j, k)."""
    p = {k: v.astype(np.float64) for k, v in weights.params.items()}
    B, N, D = pair.shape[0], pair.shape[1], weights.pair_dim
    xn = reference.layer_norm(pair.astype(np.float64).reshape(-1, D), p["layer_norm.weight"],
                              p["layer_norm.bias"], weights.layer_norm_eps)   # [M, D]

    def linear(name):
        return xn @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    log2e = np.log2(np.e)
    parts = {"q": linear("query") * (log2e / np.sqrt(weights.head_dim)), "k": linear("key"),
             "v": linear("value"), "gate": reference._sigmoid(linear("gate"))}
    bias = np.moveaxis((xn @ p["bias_proj.weight"].T).reshape(B, N, N, -1), -1, 1) * log2e
    parts["bias"] = np.where(keep[:, None], bias, -np.inf)                  # [B, h, N, N]
    return parts


@pytest.mark.parametrize("D,h", [(64, 4), (128, 4), (40, 2)])
@pytest.mark.parametrize("N", [1, 17, 128])
def test_fp32_projection_parts_against_float64(cp, rng, monkeypatch, N, D, h):
    """ln_qkvg_project of the fp32 mode writing rows_fp32 (fp16 hi + lo products,
    F16_TERMS 3): q, k, v, the gate and the pair bias,
    each within PROJECTION_TOL of float64, -inf exactly where the mask drops a key and on
    the padded keys [N, npk), nothing left unwritten (NaN-filled scratch). B = 2; N = 1,
    17 and 128 give 2, 578 and 32768 rows (partial and whole 128-row blocks); D = 40 has
    a partial 16-wide k chunk (dpad 48)."""
    B = 2
    errors = {}
    for f16_split in (True,):
        weights, pair, keep, fwd = _format0_forward(cp, rng, B, N, D, h)
        fwd.project()
        qkvg = fwd.qkvg.get()
        bias = fwd.bias.get()                                               # [B, h, N, npk]
        want = _projected_float64(weights, pair, keep)
        got = {name: qkvg[:, c * D:(c + 1) * D] for c, name in enumerate(("q", "k", "v", "gate"))}
        assert np.isneginf(bias[..., N:]).all(), "padded keys must be -inf"
        got["bias"] = bias[..., :N]
        masked = np.isneginf(want["bias"])
        assert np.array_equal(np.isneginf(got["bias"]), masked), "-inf exactly where masked"
        errors[f16_split] = {
            name: rel_l2(got[name], want[name], where=~masked if name == "bias" else None)
            for name in want}
    print(f"{B}x{N}x{D}x{h} fp32 projection rel L2, fp16 hi + lo: "
          + ", ".join(f"{k} {v:.3g}" for k, v in errors[True].items()))
    for name, err in errors[True].items():
        assert err <= (BIAS_TOL if name == "bias" else PROJECTION_TOL), (name, err, errors)


@pytest.mark.parametrize("D,h", [(64, 4), (128, 4), (40, 2)])
@pytest.mark.parametrize("N", [1, 17, 128])
def test_fp32_out_projection_against_float64(cp, rng, monkeypatch, N, D, h):
    """gated_out_project of the fp32 mode reading rows_fp32 (o fp32 over q, the gate at
    [3D, 4D); fp16 hi + lo products ): out = (g o) Wo^T + bo from the g
    and o the earlier stages left, within PROJECTION_TOL of float64 (out = bo exactly
    where a query is fully masked: o = 0 there)."""
    weights, pair, keep, fwd = _format0_forward(cp, rng, 2, N, D, h)
    fwd.project()
    fwd.attention()
    o = fwd.attention_output().get().astype(np.float64)
    g = fwd.qkvg.get()[:, 3 * D:].astype(np.float64)
    fwd.out_project()
    out = fwd.out.get().reshape(-1, D)
    p = weights.params
    want = (g * o) @ p["out_proj.weight"].astype(np.float64).T + p["out_proj.bias"]
    err = rel_l2(out, want)
    print(f"2x{N}x{D}x{h} fp32 out projection rel L2 {err:.3g}")
    assert err <= PROJECTION_TOL, err
    fully = np.broadcast_to((~keep.any(axis=-1))[:, None, :], (2, N, N)).reshape(-1)
    assert np.array_equal(out[fully], np.broadcast_to(p["out_proj.bias"], out[fully].shape))


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_sizes_past_the_wgmma_thresholds(cp, rng, precision):
    """Head dim 32 at N = 293 and 321, where every mode takes the wgmma attention on an
    H100/H200 (from N = 129: gpu.routes.WGMMA_ABOVE_N; elsewhere the mma.sync kernels):
    tile-straddling N, B > 1, fully masked queries under both policies."""
    poison_pool(cp)
    check_against_reference(cp, rng, 1, 293, 128, 4, fully_masked="nan", precision=precision)
    check_against_reference(cp, rng, 2, 321, 128, 4, mask_kind="int", precision=precision)


def _plan_kernels(module):
    return {plan.attention_kernel.name for plan in module._dw.plans.values()}


@pytest.fixture(params=["wgmma_f16s", "wgmma_f16s_slots"], ids=["rows2D", "slot_rows"])
def f16s_route(request):
    """The f16s attention reading tiles_f16 (rows of 2D words), or tiles_f16_slots (the
    gate in bf16 in each head's slot) where project_wgmma.cu runs."""
    return request.param


@pytest.mark.parametrize("N", [129, 200, 257])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("policy", ["zero", "nan"])
def test_bf16_s16_against_float64(cp, rng, f16s_route, B, N, policy):
    """The bf16 mode with S in fp16 (attention_wgmma_f16s) against float64 at bf16's
    threshold: head dim 32 past N = 128 (the wgmma path), N off the 64-key and 128-query
    tiles, B = 2, a fully masked query under both policies, and a query whose first key
    tile is all masked but a later key is not (its running max restarts from -inf)."""
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma attention runs on compute capability 9.0 only")
    D, h = 128, 4
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = rng.standard_normal((B, N, N, D)).astype(np.float32) * 2 + 0.5
    mask = make_mask(rng, B, N)
    j = (int(rng.integers(N)) + 1) % N
    mask[:, j, :64] = False
    mask[:, j, 64 + int(rng.integers(N - 64))] = True
    expected = reference.triangle_attention(pair, mask, weights, fully_masked=policy)
    module = ta.TriangleAttention(weights)
    poison_pool(cp)
    got = module(cp.asarray(pair), cp.asarray(mask), fully_masked=policy,
                 precision="bf16", route=f16s_route).get()
    assert _plan_kernels(module) == {"attention_wgmma_f16s"}
    plan, = module._dw.plans.values()
    assert plan.layout == (ta.gpu.layouts.TILES_F16_SLOTS if f16s_route.endswith("slots")
                           else ta.gpu.layouts.TILES_F16)
    fully = np.broadcast_to(~mask.any(axis=-1)[:, None, :, None], got.shape)
    if policy == "nan":
        assert np.array_equal(np.isnan(got), fully), "NaN exactly at fully-masked queries"
    err = rel_l2(got, expected, where=~fully)
    print(f"bf16 f16s B={B} N={N} {policy}: rel L2 {err:.3g}")
    assert err <= TOLERANCE["bf16"], (B, N, policy, err)
    if policy == "zero":
        assert np.isfinite(got).all()
        assert rel_l2(got, expected) <= TOLERANCE["bf16"]


def test_bf16_s16_error_within_twice_pytorch_bf16(cp, rng, f16s_route):
    """Issue 6's bound for the bf16 mode on f16s: no worse than twice PyTorch's bf16 error
    on the same inputs, at the wgmma path's sizes (head dim 32, N > 128)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma attention runs on compute capability 9.0 only")
    for B, N, D, h in [(1, 160, 128, 4), (1, 300, 128, 4), (2, 200, 64, 2)]:
        # (slot rows at D = 128 only: elsewhere f16s reads tiles_f16)
        route = f16s_route if D == 128 else "wgmma_f16s"
        weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
        pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
        mask = make_mask(rng, B, N, fully_masked_rows=False)
        expected = spec_forward(weights, pair, mask)
        module = ta.TriangleAttention(weights)
        ours = module(cp.asarray(pair), cp.asarray(mask), precision="bf16", route=route).get()
        plan, = module._dw.plans.values()
        assert plan.attention_kernel.name == "attention_wgmma_f16s"
        theirs = _torch_in_precision(torch, weights, pair, mask, "bf16")
        ours_err, torch_err = rel_l2(ours, expected), rel_l2(theirs, expected)
        print(f"bf16 f16s {B}x{N}x{D}x{h}: ours {ours_err:.3g}, PyTorch {torch_err:.3g}, "
              f"ratio {ours_err / torch_err:.2f}")
        assert ours_err <= 2 * torch_err, ((B, N, D, h), ours_err, torch_err)


@pytest.mark.parametrize("N,D,aligned,expected", [
    (ta.gpu.routes.F16S_SLOTS_FROM_N - 1, 128, True, ("attention_wgmma_bf16", "TILES_BF16")),
    (ta.gpu.routes.F16S_SLOTS_FROM_N, 128, True, ("attention_wgmma_f16s", "TILES_F16_SLOTS")),
    (ta.gpu.routes.F16S_SLOTS_FROM_N, 64, True, ("attention_wgmma_bf16", "TILES_BF16")),
    (ta.gpu.routes.F16S_SLOTS_FROM_N, 128, False, ("attention_wgmma_f16s", "TILES_F16_SLOTS")),
    (ta.gpu.routes.F16S_FROM_N, 64, True, ("attention_wgmma_f16s", "TILES_F16")),
    (ta.gpu.routes.F16S_FROM_N, 128, False, ("attention_wgmma_f16s", "TILES_F16_SLOTS"))])
def test_bf16_default_route_by_n_and_layout(cp, N, D, aligned, expected):
    """The bf16 mode's default kernel and layout (head dim 32, the wgmma path): f16s on
    slot rows from F16S_SLOTS_FROM_N where project_wgmma.cu writes the projections (D =
    128), on tiles_f16 from F16S_FROM_N elsewhere (another D), the bf16 variant below. A
    pair viewed one channel off is read from an aligned copy: the same route as aligned."""
    module = ta.TriangleAttention(ta.random_weights(D, D // 32, seed=0))
    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma attention runs on compute capability 9.0 only")
    store = cp.zeros((1, N, N, D + (0 if aligned else 1)), np.float32)
    pair = store if aligned else store[..., 1:]
    module(pair, precision="bf16")
    plan, = module._dw.plans.values()
    assert (plan.attention_kernel.name, plan.layout) == (
        expected[0], getattr(gpu.layouts, expected[1]))


def test_large_n_memory_and_spot_rows(cp, rng):
    """B=1, N=2048, D=128 runs; scratch stays under 5x the input; sampled rows are exact."""
    B, N, D, h = 1, 2048, 128, 4
    weights = ta.random_weights(D, h, seed=9)
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
    mask = cp.ones((B, N, N), bool)
    mask[:, :, -N // 10:] = False  # 10% padding
    mask[:, -N // 10:, :] = False
    module = ta.TriangleAttention(weights)
    held_before = pool.total_bytes()
    out = module(pair, mask)
    cp.cuda.Device().synchronize()
    # Everything the pool had to hold beyond input, mask and output bounds the peak.
    extra = pool.total_bytes() - held_before - out.nbytes
    assert extra < 5 * pair.nbytes, f"scratch {extra / pair.nbytes:.2f}x the input"
    rows = [0, 1, 1000, N - 1]
    pair_h, mask_h = pair.get(), mask.get()
    expected = reference.triangle_attention(pair_h, mask_h, weights, rows=rows)
    assert rel_l2(out[:, rows], expected) <= FP32_TOL


# ---- errors ----------------------------------------------------------------------------

@pytest.fixture
def small(cp):
    weights = ta.random_weights(32, 4, seed=10)
    return weights, cp.zeros((1, 5, 5, 32), np.float32) + 1


def test_error_host_array(small):
    weights, pair = small
    with pytest.raises(TypeError, match=r"pair is a NumPy \(host\) array.*cupy.asarray"):
        ta.triangle_attention(pair.get(), None, weights)


def test_error_dtype(small):
    weights, pair = small
    with pytest.raises(TypeError, match=r"pair must be float32, float16 or bfloat16 .*got float64"):
        ta.triangle_attention(pair.astype("float64"), None, weights)


def test_error_rank_and_dim(small, cp):
    weights, pair = small
    with pytest.raises(ValueError, match=r"pair must have shape \(B, N, N, D\).*2 dimensions"):
        ta.triangle_attention(pair[0, 0], None, weights)
    with pytest.raises(ValueError, match="pair_dim 32; got 16"):
        ta.triangle_attention(pair[..., :16], None, weights)
    with pytest.raises(ValueError, match="square"):
        ta.triangle_attention(cp.zeros((1, 5, 4, 32), np.float32), None, weights)


def test_error_mask(small, cp):
    weights, pair = small
    with pytest.raises(ValueError, match=r"mask must have shape \(1, 5, 5\).*got \(5, 5\)"):
        ta.triangle_attention(pair, cp.ones((5, 5)), weights)
    with pytest.raises(TypeError, match="mask must be bool, integer or float.*complex"):
        ta.triangle_attention(pair, cp.ones((1, 5, 5), np.complex64), weights)
    with pytest.raises(TypeError, match="mask is a NumPy"):
        ta.triangle_attention(pair, np.ones((1, 5, 5)), weights)


def test_error_policy_and_out(small, cp):
    weights, pair = small
    with pytest.raises(ValueError, match="precision must be one of"):
        ta.triangle_attention(pair, None, weights, precision="fp16")
    with pytest.raises(ValueError, match="fully_masked must be one of"):
        ta.triangle_attention(pair, None, weights, fully_masked="ignore")
    with pytest.raises(ValueError, match="out must be a C-contiguous float32"):
        ta.triangle_attention(pair, None, weights, out=cp.empty((1, 5, 5, 16), np.float32))


def test_error_unsupported_head_dim():
    with pytest.raises(ValueError, match="head dimension.*multiple of 4.*got 36/6 = 6"):
        ta.TriangleAttention(ta.random_weights(36, 6))
    with pytest.raises(ValueError, match="at most 128.*got 264/2 = 132"):
        ta.TriangleAttention(ta.random_weights(264, 2))


def test_error_other_device(cp):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    weights = ta.random_weights(32, 4)
    module = ta.TriangleAttention(weights, device=0)
    with cp.cuda.Device(1):
        pair = cp.zeros((1, 3, 3, 32), np.float32)
    with pytest.raises(ValueError, match="pair is on GPU 1 but the weights are on GPU 0"):
        module(pair)
    pair0 = cp.ones((1, 3, 3, 32), np.float32)
    with cp.cuda.Device(1):  # the current device differs from the module's
        out = module(pair0)
    assert out.device.id == 0
