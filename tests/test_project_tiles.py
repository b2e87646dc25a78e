"""The persistent projections of the wgmma path (kernels/project_wgmma.cu: the tf32 and bf16
modes; kernels/project_wgmma_split.cu: the fp32 mode's fp16 hi + lo products): their
weight images and shared-memory mirrors offline, and on a GPU with wgmma (H100/H200) the
forward that takes them against the float64 reference: N on and off the 64-key tiles,
B > 1, masks with fully-masked queries under both policies, every way the pair's rows can
arrive (one bulk copy per tile, one per row, or the old kernel where rows are misaligned),
saturated gates, and the same inputs through project_mma.cu's projections."""
from __future__ import annotations

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu, reference
from helpers import compile_ptx_or_fail, rel_l2

TOLERANCE = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}
PRECISIONS = list(TOLERANCE)


def _sw128(row, byte):  # kernels/wgmma.cuh sw128
    return row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15)


def test_weight_image_is_the_swizzled_tile():
    """gpu.device_weights.sw128_image lays a [R, K] 16-bit matrix out as wgmma's 128-byte swizzle: element
    (r, c) at block c // 64, sw128(r, 2 (c % 64)), as the kernel's descriptors read it."""
    pytest.importorskip("cupy")
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 16, (24, 128)).astype(np.uint16)
    image = gpu.device_weights.sw128_image(a.view(np.float16)).ravel()
    expected = np.zeros_like(image)
    for r in range(24):
        for c in range(128):
            off = (c // 64) * 24 * 128 + _sw128(r, 2 * (c % 64))
            expected[off:off + 2] = np.frombuffer(a[r, c].tobytes(), np.uint8)
    assert np.array_equal(image, expected)
    with pytest.raises(ValueError, match="multiple of 8"):
        gpu.device_weights.sw128_image(np.zeros((12, 64), np.float16))


@pytest.mark.gpu
def test_split_weight_image_is_hi_then_lo_of_each_pass():
    """The fp32 mode's image (tile_weight_image(split=True), project_wgmma_split.cu): for
    each pass in the order of its halves (q, k, then gate, v) the sw128 image of the
    scaled weights' fp16 hi part, then of their lo part, no pair-bias rows; hi + lo is the
    scaled weight to ~2^-22. And Wo's: hi, then lo."""
    weights = ta.random_weights(128, 4, seed=5)
    dw = gpu.device_weights.DeviceWeights(weights, 0)
    scales = dw.qkv_scales["f16x3"]
    f16 = dw.f16_scales(scales)
    D, part = 128, 128 * 128 * 2
    plain = np.concatenate([weights.params[f"{n}.weight"] for n in ("query", "key", "value", "gate")])
    row_scale = np.repeat(np.array([*scales[:3], 1.0]), D)[:, None]
    scaled = plain.astype(np.float64) * row_scale * f16.w
    passes = [scaled[p * D:(p + 1) * D] for p in (0, 1, 3, 2)]
    out = weights.params["out_proj.weight"].astype(np.float64) * f16.out_w
    for image, wanted in ((dw.tile_weight_image("qkvg", scales, split=True).get(), passes),
                          (dw.tile_weight_image("out", split=True).get(), [out])):
        assert image.size == 2 * len(wanted) * part
        for k, want in enumerate(wanted):
            hi = _unswizzle(image[2 * k * part:(2 * k + 1) * part], D, D).astype(np.float64)
            lo = _unswizzle(image[(2 * k + 1) * part:(2 * k + 2) * part], D, D).astype(np.float64)
            assert np.array_equal(hi, want.astype(np.float32).astype(np.float16).astype(np.float64))
            assert np.abs(hi + lo - want).max() <= 2.0 ** -21 * np.abs(want).max()


def _unswizzle(image, R, K):
    """sw128_image's inverse: uint8 [K / 64, R, 128] -> float16 [R, K]."""
    chunks = image.reshape(K // 64, R, 8, 16)
    rows = np.arange(R)[:, None]
    plain = chunks[:, rows, np.arange(8)[None, :] ^ (rows % 8)]
    return np.ascontiguousarray(plain.transpose(1, 0, 2, 3)).reshape(R, K * 2).view(np.float16)


def test_where_the_persistent_projections_run():
    """Every mode's tiled layout at D = 128 where their shared memory fits (fp32's in the
    split kernels); the routes take them on compute capability 9.0 only."""
    f16, bf16, f16x3 = gpu.layouts.TILES_F16, gpu.layouts.TILES_BF16, gpu.layouts.TILES_F16_HILO
    for layout in (f16, bf16, f16x3, gpu.layouts.TILES_F16_SLOTS):
        assert gpu.kernel_configs.persistent_fits(layout, 128)
        assert not gpu.kernel_configs.persistent_fits(layout, 64)
        assert not gpu.kernel_configs.persistent_fits(layout, 128, smem_limit=163 * 1024)
        assert gpu.kernel_configs.persistent_project_config(layout) in gpu.kernel_catalog.all_configs("sm_90")
    assert not gpu.kernel_configs.persistent_fits(gpu.layouts.ROWS_TF32, 128)
    assert gpu.kernel_configs.persistent_project_config(f16x3).filename == "project_wgmma_split.cu"
    assert gpu.kernel_configs.persistent_project_config(f16).filename == "project_wgmma.cu"
    for precision in PRECISIONS:
        assert gpu.routes.choose_route(precision, 32, 128, 300, 90).out_project == "persistent"
        assert gpu.routes.choose_route(precision, 32, 128, 300, 80).out_project == "mma"


@pytest.mark.parametrize("layout", [gpu.layouts.TILES_F16, gpu.layouts.TILES_BF16,
                                       gpu.layouts.TILES_F16_HILO, gpu.layouts.TILES_F16_SLOTS])
def test_shared_memory_mirror_matches_the_kernel(layout):
    """gpu.tiles.persistent_smem_bytes and PERSISTENT_THREADS are what the host launches with;
    the kernels lay their shared memory out by PROJECT_TILES_SMEM and OUT_TILES_SMEM and
    split their work for THREADS: a static_assert that they agree (PTX only). (A launch
    of 256 threads once left half the heads unwritten; the kernels now trap on it.)"""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("NVRTC library not found (pip install 'cupy-cuda13x[ctk]')")
    config = gpu.kernel_configs.persistent_project_config(layout)
    compile_ptx_or_fail(
        gpu.compile.full_source(config.filename, config.defines)
        + f"\nstatic_assert(PROJECT_TILES_SMEM == {gpu.tiles.persistent_smem_bytes(layout)}, \"in\");"
        + f"\nstatic_assert(OUT_TILES_SMEM == {gpu.tiles.persistent_smem_bytes(layout, out=True)}, \"out\");"
        + f"\nstatic_assert(THREADS == {gpu.tiles.PERSISTENT_THREADS}, \"threads\");\n")


# ---- on the GPU ----

@pytest.fixture
def cp():
    import cupy

    return cupy


def _needs_wgmma(cp):
    if int(cp.cuda.Device().compute_capability) != 90:
        pytest.skip("the persistent projections run on compute capability 9.0 (H100/H200)")


def _inputs(rng, B, N, D=128, h=4, fully_masked_rows=True):
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
    keep = rng.random((B, N, N)) > 0.25
    if fully_masked_rows:
        keep[:, rng.integers(N), :] = False
    return weights, pair, keep


def _check(cp, weights, pair_dev, mask_h, precision, fully_masked="zero", expect_tiles=True):
    pair_h = pair_dev.get()
    module = ta.TriangleAttention(weights)
    cp.full(64 << 18, np.nan, np.float32)  # (freed: the pool hands out NaN-filled memory)
    out = cp.full(pair_dev.shape, np.nan, np.float32)
    got = module(pair_dev, cp.asarray(mask_h), fully_masked=fully_masked, out=out,
                 precision=precision)
    (plan,) = module._dw.plans.values()
    assert plan.out_persistent and plan.project_persistent == expect_tiles, (
        plan.out_persistent, plan.project_persistent)
    expected = reference.triangle_attention(pair_h, mask_h, weights, fully_masked=fully_masked)
    got = got.get()
    if fully_masked == "nan":
        fully = np.broadcast_to((~mask_h.any(axis=-1))[:, None, :, None], got.shape)
        assert np.array_equal(np.isnan(got), fully), "NaN exactly at fully-masked queries"
        err = rel_l2(got, expected, where=~fully)
    else:
        err = rel_l2(got, expected)
    assert err <= TOLERANCE[precision], (precision, pair_dev.shape, err)
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("B,N", [(1, 129), (2, 192), (1, 200), (3, 131), (1, 256), (2, 257)])
def test_forward_on_and_off_the_key_tiles(cp, rng, B, N, precision):
    """N a multiple of the 64-key tiles and not (the last tile's keys past N: zero rows of
    A, zero V^T, -inf bias), B > 1, both policies."""
    _needs_wgmma(cp)
    weights, pair, keep = _inputs(rng, B, N)
    _check(cp, weights, cp.asarray(pair), keep, precision, ("zero", "nan")[N % 2])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("view", ["transposed", "padded_rows", "pair_rows_apart", "misaligned"])
def test_pair_rows_in_any_layout(cp, rng, view, precision):
    """One bulk copy per tile where a tile's rows are contiguous (sj = D: pair_rows_apart),
    one per row otherwise (transposed, padded_rows); rows that are not 16-byte aligned
    (misaligned) are read from an aligned copy, so they take the persistent projections
    too (the route never depends on the address)."""
    _needs_wgmma(cp)
    B, N, D = 2, 150, 128
    weights, pair, keep = _inputs(rng, B, N)
    if view == "transposed":
        dev = cp.asarray(np.ascontiguousarray(pair.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    elif view == "padded_rows":
        base = cp.zeros((B, N, N, D + 4), np.float32)
        base[..., :D] = cp.asarray(pair)
        dev = base[..., :D]
    elif view == "pair_rows_apart":
        base = cp.zeros((B, N, N + 3, D), np.float32)
        base[:, :, :N] = cp.asarray(pair)
        dev = base[:, :, :N]
    else:
        base = cp.zeros((B, N, N, D + 1), np.float32)
        base[..., 1:] = cp.asarray(pair)
        dev = base[..., 1:]
    assert not dev.flags.c_contiguous
    _check(cp, weights, dev, keep, precision, expect_tiles=True)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("gate_bias", [-20.0, -70.0])
def test_saturated_gates(cp, rng, precision, gate_bias):
    """Every gate near 0 and no out bias (tests/test_gpu.py's case at D = 128): each tile
    scales its own g o, and the two unscales apply one after the other."""
    _needs_wgmma(cp)
    base, pair, keep = _inputs(rng, 1, 136, fully_masked_rows=False)
    params = dict(base.params)
    params["gate.bias"] = np.full_like(params["gate.bias"], gate_bias)
    params["out_proj.bias"] = np.zeros_like(params["out_proj.bias"])
    weights = ta.Weights(base.pair_dim, base.num_heads, base.layer_norm_eps, params)
    _check(cp, weights, cp.asarray(pair), keep, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_same_result_as_the_mma_projections(cp, rng, precision):
    """The same inputs through project_mma.cu's projections (the route without "_persistent")
    and through project_wgmma.cu's: each within the mode's bound, and within it of each
    other."""
    _needs_wgmma(cp)
    weights, pair, keep = _inputs(rng, 2, 160)
    dev, mask = cp.asarray(pair), cp.asarray(keep)
    outs = {}
    name = {"fp32": "wgmma_f16x3", "tf32": "wgmma_f16", "bf16": "wgmma_bf16"}[precision]
    for tiles in (False, True):
        module = ta.TriangleAttention(weights)
        outs[tiles] = module(dev, mask, precision=precision,
                             route=name + ("_persistent" if tiles else "")).get()
        (plan,) = module._dw.plans.values()
        assert plan.project_persistent == tiles
    expected = reference.triangle_attention(pair, keep, weights)
    for out in outs.values():
        assert rel_l2(out, expected) <= TOLERANCE[precision]
    assert rel_l2(outs[True], outs[False]) <= TOLERANCE[precision]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_large_n_spot_rows(cp, rng, precision):
    """1x1024 (each block many tiles, both RAW stages cycling): sampled rows exact."""
    _needs_wgmma(cp)
    B, N, D, h = 1, 1024, 128, 4
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
    mask = cp.ones((B, N, N), bool)
    mask[:, :, -N // 10:] = False
    out = ta.TriangleAttention(weights)(pair, mask, precision=precision)
    rows = [0, 63, 64, 500, N - 1]
    expected = reference.triangle_attention(pair.get(), mask.get(), weights, rows=rows)
    assert rel_l2(out[:, rows], expected) <= TOLERANCE[precision]
