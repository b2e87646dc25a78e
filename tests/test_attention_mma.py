"""The tensor-core attention kernels (kernels/attention_mma.cu) against the FFMA kernel
(kernels/attention_ffma.cu) on the same inputs: the pipeline's projection stage fills qkvg and
bias, then each kernel runs on its own copy and the q slots (where o is written) are
compared. Skipped with a reason where there is no GPU.

Thresholds (relative L2 against the fp32 FFMA output): 3xTF32 1e-5, TF32 2e-3, bf16 1e-2.
Sizes miss the 64-query and 64/32-key tiles (1, 7, 65, 130); the masks hold fully masked
queries (NaN or 0 by policy, positions must match exactly) and a query whose first key
tile is fully masked but later keys are not (the running max restarts from -inf).
"""
from __future__ import annotations

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu
from helpers import rel_l2

pytestmark = pytest.mark.gpu

# f16s (the bf16 mode's option: S in fp16) held to bf16's
TOL = {"tf32x3": 1e-5, "tf32": 2e-3, "bf16": 1e-2, "f16x3": 1e-5, "f16": 2e-3, "f16s": 1e-2}
MMA_VARIANTS = list(gpu.kernel_configs.ATTENTION_MMA_VARIANTS)  # (f16 and f16s are wgmma only; f16x3 both)
HEAD_DIMS = [8, 16, 24, 32, 64, 128]
SIZES_N = [1, 7, 64, 65, 130]


@pytest.fixture
def cp():
    import cupy

    return cupy


def _mask(rng, B, N):
    keep = rng.random((B, N, N)) > 0.25
    if N > 1:
        keep[:, rng.integers(N), :] = False  # a query (b, j) with every key masked
    if N > 64:
        j = rng.integers(N)
        keep[:, j, :64] = False  # every key of the first tile(s) masked, later keys not
        keep[:, j, 64 + rng.integers(N - 64)] = True
    return keep


def _run_both(cp, rng, B, N, head_dim, variant, policy, tiles=None, launch=None):
    """(q slots after the FFMA kernel, q slots after the mma kernel, and for each whether
    the attention left every other column of qkvg as the projection wrote it), the q
    slots on the host. Each kernel gets its own forward on the same inputs: the
    projection stores k and v in the form its attention kernel reads (fp32 for FFMA,
    TF32-rounded or packed bf16 for the tensor cores); q and the bias are the same."""
    from triattn_cupy.gpu.device_weights import DeviceWeights
    from triattn_cupy.gpu.forward import Forward

    h = 2
    weights = ta.random_weights(head_dim * h, h, seed=int(rng.integers(1 << 31)))
    dw = DeviceWeights(weights, cp.cuda.runtime.getDevice())
    pair = cp.asarray(rng.standard_normal((B, N, N, head_dim * h)).astype(np.float32) * 2 + 0.5)
    mask = cp.asarray(_mask(rng, B, N))

    def run(launch):
        fwd = Forward(dw, pair, mask, policy, None, attention=launch)
        fwd.project()
        projected = fwd.qkvg.view(cp.uint32).copy()  # bits: unwritten columns may be NaN
        fwd.attention()  # reads q from the q slots, writes o over it
        # o's words: [0, D), or in 16 bits each head's first 16 (O16 formats, whose head
        # slots hold the gate after them in tiles_bf16)
        o_words = np.zeros(projected.shape[1], bool)
        if fwd.layout.o16:
            for head in range(fwd.H):
                o_words[32 * head:32 * head + 16] = True
        else:
            o_words[:fwd.D] = True
        rest = cp.asarray(np.flatnonzero(~o_words))
        rest_kept = bool((fwd.qkvg.view(cp.uint32)[:, rest] == projected[:, rest]).all())
        return fwd.attention_output().get(), rest_kept

    ref, ref_kept = run(gpu.kernel_configs.attention_ffma_launch(head_dim))
    got, got_kept = run(launch or gpu.kernel_configs.attention_mma_launch(head_dim, variant, tiles))
    return ref, got, ref_kept, got_kept


@pytest.mark.parametrize("variant", MMA_VARIANTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("N", SIZES_N)
@pytest.mark.parametrize("B", [1, 2])
def test_mma_matches_ffma(cp, rng, B, N, head_dim, variant):
    if head_dim not in gpu.tiles.attention_mma_head_dims(variant):
        pytest.skip(f"{variant} takes the FFMA kernel at d={head_dim}")
    _check_against_ffma(cp, rng, B, N, head_dim, variant, None)


# The fp32 mode's mma.sync attention (attention_mma_f16x3, fp16 split products) where the
# shared grid above does not reach: N = 2, 17 (one partial 32-key tile), 128 (whole tiles,
# the small-N shapes: the benchmark's 2x128x64x4 at d = 16), B = 3, both policies (by N +
# B), head dims with a half-zero last k-step (d % 16 == 8: 8, 24, 40), and the tiles the
# table picks for sm_80 as well (run here on whatever GPU there is).
@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("head_dim", [8, 16, 24, 32, 40, 64])
@pytest.mark.parametrize("N", [2, 17, 128])
def test_f16x3_mma_matches_ffma_at_more_sizes(cp, rng, N, head_dim, cc):
    tiles = gpu.tiles.attention_mma_tiles(head_dim, "f16x3", N, cc)
    _check_against_ffma(cp, rng, 3, N, head_dim, "f16x3", tiles)


def _attention_float64(qkvg, bias, B, N, H, d):
    """The attention stage in float64 from what the projection wrote (rows_fp32): qkvg [M, 4D]
    (q pre-scaled by log2 e / sqrt(d)), bias [B, H, N, NPK] (log2 e units, -inf where
    masked); o [M, D], 0 for fully masked queries."""
    D = H * d
    x = qkvg.reshape(B, N, N, 4 * D)
    q, k, v = (x[..., c * D:(c + 1) * D].reshape(B, N, N, H, d) for c in range(3))
    s = np.einsum("bijhc,bikhc->bhijk", q, k) + bias[:, :, None, :, :N]  # [B, H, i, j, k]
    m = s.max(axis=-1, keepdims=True)
    fully = m == -np.inf
    p = np.exp2(s - np.where(fully, 0.0, m))
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhijk,bikhc->bijhc", p / np.where(fully, 1.0, l), v)
    return o.reshape(B * N * N, D)


@pytest.mark.parametrize("B,N,head_dim", [(2, 128, 16), (1, 75, 64), (2, 33, 24), (2, 1, 8),
                                          (1, 100, 32)])
def test_f16x3_mma_as_accurate_as_tf32x3_against_float64(cp, rng, B, N, head_dim):
    """The fp32 mode's two mma.sync attentions on the same projected q, k, v and bias,
    each against the float64 attention of those inputs: f16x3 within the fp32 bound and
    within twice 3xTF32's error (a NumPy emulation of both splits put them at 2.0e-7 and
    1.9e-7 at d = 16, N = 128, emulated)."""
    from triattn_cupy.gpu.device_weights import DeviceWeights
    from triattn_cupy.gpu.forward import Forward

    h = 4
    weights = ta.random_weights(head_dim * h, h, seed=int(rng.integers(1 << 31)))
    dw = DeviceWeights(weights, cp.cuda.runtime.getDevice())
    pair = cp.asarray(rng.standard_normal((B, N, N, head_dim * h)).astype(np.float32) * 2 + 0.5)
    mask = cp.asarray(_mask(rng, B, N))
    errors = {}
    for variant in ("tf32x3", "f16x3"):
        fwd = Forward(dw, pair, mask, "zero", None,
                      attention=gpu.kernel_configs.attention_mma_launch(head_dim, variant, n=N))
        fwd.project()
        want = _attention_float64(fwd.qkvg.get().astype(np.float64),
                                  fwd.bias.get().astype(np.float64), B, N, h, head_dim)
        fwd.attention()
        errors[variant] = rel_l2(fwd.attention_output().get(), want)
    print(f"{B}x{N} d={head_dim}: rel L2 vs float64 tf32x3 {errors['tf32x3']:.3g}, "
          f"f16x3 {errors['f16x3']:.3g}")
    assert errors["f16x3"] <= TOL["f16x3"]
    assert errors["f16x3"] <= 2 * errors["tf32x3"] + 1e-8, errors


def _attention_outputs(dw, pair, mask, launches):
    """Each launch's attention output o on the same inputs (its own projection first)."""
    from triattn_cupy.gpu.forward import Forward

    outs = []
    for launch in launches:
        fwd = Forward(dw, pair, mask, "zero", None, attention=launch)
        fwd.project()
        fwd.attention()
        outs.append(fwd.attention_output().get())
    return outs


def _scaled_qkv_inputs(cp, rng, B, N, head_dim, h, magnitude, seed):
    """(DeviceWeights, pair, mask) with random weights whose q, k and v weights and biases
    are scaled by `magnitude`: what the fp16 kernels' scales must absorb."""
    from triattn_cupy.gpu.device_weights import DeviceWeights

    base = ta.random_weights(head_dim * h, h, seed=seed)
    params = dict(base.params)
    for name in ("query", "key", "value"):
        for part in ("weight", "bias"):
            params[f"{name}.{part}"] = params[f"{name}.{part}"] * np.float32(magnitude)
    weights = ta.Weights(base.pair_dim, base.num_heads, base.layer_norm_eps, params)
    dw = DeviceWeights(weights, cp.cuda.runtime.getDevice())
    pair = cp.asarray(rng.standard_normal((B, N, N, head_dim * h)).astype(np.float32) * 2 + 0.5)
    return dw, pair, cp.asarray(_mask(rng, B, N))


@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("magnitude", [1e-4, 1e3])
def test_f16x3_mma_keeps_its_accuracy_at_any_weight_scale(cp, magnitude, head_dim):
    """attention_mma_f16x3 scales the fp32 q, k, v it reads into fp16's range by the powers of
    two the host derives from the weights (gpu.scales.f16x3_scales): tiny or huge q/k/v weights
    must neither underflow nor overflow (inf, NaN) and keep the fp32 bound."""
    rng = np.random.default_rng(11)
    B, N, h = 2, 97, 2
    dw, pair, mask = _scaled_qkv_inputs(cp, rng, B, N, head_dim, h, magnitude, seed=5)
    outs = _attention_outputs(dw, pair, mask, (gpu.kernel_configs.attention_ffma_launch(head_dim),
                                               gpu.kernel_configs.attention_mma_launch(head_dim, "f16x3", n=N)))
    assert np.isfinite(outs[1]).all()
    err = rel_l2(outs[1], outs[0])
    print(f"f16x3 mma d={head_dim} weights x{magnitude:g}: rel L2 {err:.3g}")
    assert err <= TOL["f16x3"]


# Every tile shape a tile sweep may pick.
TILES = [gpu.tiles.MmaTiles(*shape) for shape in
         [(64, 1, 1, 1, 1), (64, 1, 2, 1, 1), (64, 2, 1, 1, 1), (64, 2, 2, 1, 1),
          (32, 2, 2, 1, 1), (64, 1, 4, 1, 1), (16, 2, 1, 1, 1), (64, 1, 2, 0, 1),
          (16, 1, 1, 0, 1), (64, 1, 1, 1, 2), (32, 1, 1, 1, 2), (16, 1, 1, 1, 2),
          (32, 1, 1, 0, 2), (32, 2, 2, 1, 2, 2), (32, 1, 1, 1, 2, 4), (64, 1, 2, 1, 1, 2),
          (16, 1, 1, 1, 2, 2), (32, 1, 1, 1, 3, 2), (32, 2, 2, 1, 2)]]


@pytest.mark.parametrize("variant", MMA_VARIANTS)
@pytest.mark.parametrize("tiles", TILES, ids=str)
@pytest.mark.parametrize("N", [7, 130])
def test_mma_tile_shapes(cp, rng, N, tiles, variant):
    smem = gpu.tiles.attention_mma_smem_bytes(16, variant, tiles)
    if smem > gpu.tiles.SMEM_LIMIT:
        pytest.skip(f"{variant} {tiles} needs {smem} bytes of shared memory (227 KiB max)")
    _check_against_ffma(cp, rng, 2, N, 16, variant, tiles)


def _check_against_ffma(cp, rng, B, N, head_dim, variant, tiles, launch=None):
    policy = ("zero", "nan")[(N + B) % 2]
    ref, got, ref_kept, got_kept = _run_both(cp, rng, B, N, head_dim, variant, policy, tiles,
                                             launch)
    assert ref_kept and got_kept, "the attention wrote outside the q slots"
    if policy == "nan":
        assert np.array_equal(np.isnan(got), np.isnan(ref)), "NaN exactly where FFMA has NaN"
        finite = ~np.isnan(ref)
        if not finite.any():
            return
        err = rel_l2(got, ref, where=finite)
    else:
        err = rel_l2(got, ref)  # inf on any NaN
    assert err <= TOL[variant], f"{variant} {tiles} B={B} N={N} d={head_dim}: rel L2 {err:.3g}"


@pytest.mark.parametrize("variant", MMA_VARIANTS)
def test_mma_both_policies_on_one_input(cp, rng, variant):
    """The same input under "zero" and "nan": fully masked queries are 0 resp. NaN."""
    B, N, d = 2, 65, 32
    for policy in ("zero", "nan"):
        seeded = np.random.default_rng(1234)
        ref, got, _, _ = _run_both(cp, seeded, B, N, d, variant, policy)
        if policy == "zero":
            assert not np.isnan(got).any()
        else:
            assert np.isnan(got).any()  # _mask always makes a fully masked query
            assert np.array_equal(np.isnan(got), np.isnan(ref))
        finite = ~np.isnan(ref)
        assert rel_l2(got, ref, where=finite) <= TOL[variant]


# ---- the attention on warpgroup products (kernels/attention_wgmma.cu, sm_90a) ----

WGMMA_TILES = [("bf16", gpu.tiles.attention_wgmma_tiles("bf16")),
               ("bf16", gpu.tiles.WgmmaTiles(rows=1, stages=3, min_blocks=2)),
               ("bf16", gpu.tiles.WgmmaTiles(rows=2, stages=3, min_blocks=1)),
               ("f16x3", gpu.tiles.attention_wgmma_tiles("f16x3")),
               ("f16x3", gpu.tiles.WgmmaTiles(min_blocks=1, pv_groups=2)),
               ("f16x3", gpu.tiles.WgmmaTiles(rows=2, stages=2, min_blocks=1, pv_groups=1)),
               ("f16", gpu.tiles.attention_wgmma_tiles("f16")),
               ("f16", gpu.tiles.WgmmaTiles(min_blocks=2)),
               ("f16", gpu.tiles.WgmmaTiles(rows=2, stages=3, min_blocks=1)),
               ("f16s", gpu.tiles.attention_wgmma_tiles("f16s")),
               ("f16s", gpu.tiles.WgmmaTiles(min_blocks=2)),
               ("f16s", gpu.tiles.WgmmaTiles(rows=2, stages=3, min_blocks=1))]


def _needs_sm_90(cp):
    cc = cp.cuda.Device().compute_capability
    if cc != "90":
        pytest.skip(f"wgmma (sm_90a) runs on compute capability 9.0 only; this GPU is {cc}")


@pytest.mark.parametrize("variant,tiles", WGMMA_TILES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 64, 65, 130, 199])
@pytest.mark.parametrize("B", [1, 2])
def test_wgmma_matches_ffma(cp, rng, B, N, variant, tiles):
    """Sizes below, at and past the 64-key and 128-query tiles, rows past N in a 2-row
    block (odd N), fully masked queries under both policies (by N + B)."""
    _needs_sm_90(cp)
    _check_against_ffma(cp, rng, B, N, 32, variant, None,
                        gpu.kernel_configs.attention_wgmma_launch(32, tiles, variant))


@pytest.mark.parametrize("N", [129, 200, 257])
@pytest.mark.parametrize("B", [1, 2])
def test_f16s_matches_ffma_off_the_tiles(cp, rng, B, N):
    """The f16s attention (S in fp16) at N past one query tile and off the key tiles, with
    the masks of _mask (a fully masked query; a query whose first key tile is all masked)."""
    _needs_sm_90(cp)
    _check_against_ffma(cp, rng, B, N, 32, "f16s", None,
                        gpu.kernel_configs.attention_wgmma_launch(32, variant="f16s"))


@pytest.mark.parametrize("variant", list(gpu.tiles.WGMMA_VARIANTS))
def test_wgmma_both_policies_on_one_input(cp, variant):
    _needs_sm_90(cp)
    for policy in ("zero", "nan"):
        ref, got, _, _ = _run_both(cp, np.random.default_rng(99), 2, 131, 32, variant, policy,
                                   launch=gpu.kernel_configs.attention_wgmma_launch(32, variant=variant))
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        assert np.isnan(got).any() == (policy == "nan")
        assert rel_l2(got, ref, where=~np.isnan(ref)) <= TOL[variant]


@pytest.mark.parametrize("variant", ["f16x3", "f16", "f16s"])
@pytest.mark.parametrize("magnitude", [1e-4, 1e3])
def test_f16_products_keep_their_accuracy_at_any_weight_scale(cp, magnitude, variant):
    """The fp32 mode's fp16 split products (f16x3) and the tf32 mode's one fp16 product
    (f16) scale q, k and v into fp16's range by powers of two from the weights
    (gpu.scales.f16x3_scales, f16_biased_scales): tiny or huge q/k/v weights must neither
    underflow nor overflow
    (inf, NaN). f16x3 keeps the fp32 bound; f16 is held to the TF32 mma.sync kernel's error
    on the same inputs (at 1e3 the scores reach ~1e6, where an 11-bit rounding of q and k
    moves them by hundreds: no TF32 product keeps 2e-3 there, PyTorch's neither).
    f16s (S in fp16) at 1e-4 likewise against the bf16 wgmma kernel; at 1e3 its scores
    could pass fp16's range (gpu.scales.f16s_scales: no scales), so forcing it fails clearly and
    the bf16 mode with it selected takes the bf16 variant."""
    _needs_sm_90(cp)
    from triattn_cupy.gpu.forward import Forward

    rng = np.random.default_rng(7)
    B, N, h, d = 1, 97, 2, 32
    dw, pair, mask = _scaled_qkv_inputs(cp, rng, B, N, d, h, magnitude, seed=3)
    if variant == "f16s" and magnitude > 1:
        assert dw.qkv_scales["f16s"] is None
        with pytest.raises(ValueError, match="fp16's range"):
            Forward(dw, pair, mask, "zero", None,
                    attention=gpu.kernel_configs.attention_wgmma_launch(d, variant="f16s"))
        with pytest.raises(ValueError, match="fp16's range"):
            Forward(dw, pair, mask, "zero", None, precision="bf16", route="wgmma_f16s")
        fwd = Forward(dw, pair, mask, "zero", None, precision="bf16")
        assert "f16s" not in fwd.plan.attention_kernel.name  # (N = 97: mma.sync bf16)
        return
    launches = [gpu.kernel_configs.attention_ffma_launch(d), gpu.kernel_configs.attention_wgmma_launch(d, variant=variant)]
    if variant in ("f16", "f16s"):
        # the oracle of a TF32 product's error: the mma.sync TF32 attention (f16), and of
        # bf16's the bf16 wgmma kernel (f16s)
        launches.append(gpu.kernel_configs.attention_mma_launch(d, "tf32", n=N) if variant == "f16"
                        else gpu.kernel_configs.attention_wgmma_launch(d, variant="bf16"))
    outs = _attention_outputs(dw, pair, mask, launches)
    assert np.isfinite(outs[1]).all()
    err = rel_l2(outs[1], outs[0])
    bound = TOL[variant] if variant == "f16x3" else max(TOL[variant], 2 * rel_l2(outs[2], outs[0]))
    print(f"{variant} weights x{magnitude:g}: rel L2 {err:.3g} (bound {bound:.3g})")
    assert err <= bound
