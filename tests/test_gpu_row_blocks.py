"""Row blocks on the GPU (gpu/row_blocks.py): the blocked forward gives the same bits for
any rows per block R (R = 1, R not dividing B N, R spanning batches, R = every row: ALL),
in every route, at both nodes, with pair and row masks, in place (out = pair), and as the
emulated split over several devices; it stays within the float64 NumPy backend's
tolerance; and where the route's projection is project_mma.cu's, it gives the single
pass's bits (its bias pass is the same LayerNorm and bias code).

"The same bits" holds where every out-projection launch of the blocks starts a tile (64
rows, 128 at some small sizes: Plan.out_rows) where the one block's launch has one (_keeps_tiles; row_blocks.row_unit): the
fp16-product out projections scale each tile by its largest |g o|, so another grouping
may round an output's last bits differently (about one output in 10^7). Elsewhere the
comparison allows that, and only that (_assert_same_bits_or_tile_rounding).

Each output buffer starts as NaN (poison_pool, cupy.full), and NaN never compares equal.
"""
from __future__ import annotations

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu, reference
from triattn_cupy.gpu import row_blocks
from helpers import rel_l2
from test_gpu import TOLERANCE, poison_pool
from test_gpu_conventions import _ROUTE_CASES, _route_shape, _skip_unless_runs, convention_mask

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy

    return cupy


def _problem(cp, rng, B, N, D, h, mask_kind="random"):
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
    mask = convention_mask(rng, B, N, mask_kind)
    return ta.TriangleAttention(weights), pair, mask


def _forward(cp, module, pair, mask, **options):
    """module(pair, mask) into a NaN-filled `out` (the pair's own device buffer when
    options has out="pair": in place), as a NumPy array."""
    poison_pool(cp)
    d_pair = cp.asarray(pair)
    if options.pop("out", None) == "pair":
        out = d_pair
    else:
        out = cp.full(pair.shape, np.nan, pair.dtype)
    got = module(d_pair, None if mask is None else cp.asarray(mask), out=out, **options)
    assert got is out
    return got.get()


def _assert_same_bits(got, expected, what):
    assert got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32)), (
        f"{what}: {np.count_nonzero(got.view(np.uint32) != expected.view(np.uint32))} "
        f"of {got.size} outputs differ")


def _keeps_tiles(N, B, R, devices=1, transposed=False, tile_rows=64):
    """Whether every out-projection launch of blocks of R rows (in `devices` shares) starts
    a tile (of `tile_rows` rows: Plan.out_rows) of the one block's launch: one launch from
    row 0 (its tiles on the global grid), or at the ending node one per batch (its tiles
    from the batch's first row)."""
    unit = row_blocks.row_unit(N, tile_rows)
    for share in row_blocks.split_rows(B * N, devices, unit):
        for begin, end in row_blocks.blocks_of(*share, min(R, B * N)):
            starts = ([s0 % N for s0, _ in row_blocks.batch_segments(begin, end, N)]
                      if transposed else [begin])
            if any(start % unit for start in starts):
                return False
    return True


def _assert_same_bits_or_tile_rounding(got, expected, what, kept):
    """The same bits where the tiles are kept (_keeps_tiles); else the same bits but for
    a few outputs (at most 1 in 10^5) within 4 ulp."""
    if kept:
        return _assert_same_bits(got, expected, what)
    assert got.shape == expected.shape
    assert np.array_equal(np.isnan(got), np.isnan(expected)), what
    differ = (got.view(np.uint32) != expected.view(np.uint32)) & ~np.isnan(expected)
    assert np.count_nonzero(differ) <= 2 + got.size // 10**5, (
        f"{what}: {np.count_nonzero(differ)} of {got.size} outputs differ")
    assert np.all(np.abs(got[differ] - expected[differ])
                  <= 4 * np.spacing(np.abs(expected[differ]))), f"{what}: beyond 4 ulp"


def _check_reference(got, weights, pair, mask, precision, **conventions):
    expected = reference.triangle_attention(pair, mask, weights, fully_masked="zero",
                                            **conventions)
    err = rel_l2(got, expected)
    assert err <= TOLERANCE[precision], f"rel L2 {err:.3g}"


ALL = 10 ** 6  # rows per block past B N: one block of every row, still the blocked path


# ---- any R gives the same bits ----

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("R", [1, 5, 61, 64, 90, 122])
def test_any_rows_per_block_give_the_same_bits(cp, rng, precision, R):
    """B = 2, N = 61: R = 1, R not dividing B N, R = N, R spanning the batches, R = B N."""
    module, pair, mask = _problem(cp, rng, 2, 61, 64, 4)
    every = _forward(cp, module, pair, mask, precision=precision, row_block=ALL)
    blocked = _forward(cp, module, pair, mask, precision=precision, row_block=R)
    _assert_same_bits_or_tile_rounding(blocked, every, f"R={R} {precision}",
                                       _keeps_tiles(61, 2, R))
    if R == 5:
        _check_reference(blocked, module.weights, pair, mask, precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_project_mma_routes_keep_the_single_pass_bits(cp, rng, precision):
    """mma_f16x3, mma_bf16 (D = 64): the bias pass is project_mma.cu's own LayerNorm and
    bias under BIAS_ONLY, so row blocks give the single pass's bits (R = 64: whole
    out-projection tiles at N = 61)."""
    module, pair, mask = _problem(cp, rng, 2, 61, 64, 4)
    whole = _forward(cp, module, pair, mask, precision=precision)
    blocked = _forward(cp, module, pair, mask, precision=precision, row_block=64)
    _assert_same_bits(blocked, whole, f"single pass against R=64 {precision}")


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("R", [5, 16, 32])
def test_out_blocks_of_128_rows_keep_their_tiles(cp, rng, precision, R):
    """2x120x64x4 takes 128-row out blocks on the H200 (tiles.out_project_rows: 225 of
    them are one wave, 450 of 64 rows are not): row blocks of whole 128-row tiles (R a
    multiple of row_unit(120, 128) = 16) give the single pass's bits, and R = 5 all but
    a few last bits."""
    module, pair, mask = _problem(cp, rng, 2, 120, 64, 4)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    tile_rows = gpu.tiles.out_project_rows(2 * 120 * 120, sms)
    if sms == 132:
        assert tile_rows == 128
    whole = _forward(cp, module, pair, mask, precision=precision)
    blocked = _forward(cp, module, pair, mask, precision=precision, row_block=R)
    _assert_same_bits_or_tile_rounding(blocked, whole, f"R={R} {precision}",
                                       _keeps_tiles(120, 2, R, tile_rows=tile_rows))
    if R == 5:
        _check_reference(blocked, module.weights, pair, mask, precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("R", [1, 7, 8, 200, 333])
def test_the_default_wgmma_routes(cp, rng, precision, R):
    """D = 128, h = 4, N = 200 (above the wgmma threshold; query tiles of 128 not filled):
    the persistent projections, whose bias pass is project_mma.cu's."""
    module, pair, mask = _problem(cp, rng, 2, 200, 128, 4, "padding")
    every = _forward(cp, module, pair, mask, precision=precision, row_block=ALL)
    blocked = _forward(cp, module, pair, mask, precision=precision, row_block=R)
    _assert_same_bits_or_tile_rounding(blocked, every, f"R={R} {precision}",
                                       _keeps_tiles(200, 2, R))
    if R == 7:
        whole = _forward(cp, module, pair, mask, precision=precision)
        assert rel_l2(blocked, whole) <= TOLERANCE[precision]


@pytest.mark.parametrize("name,precision", _ROUTE_CASES, ids=lambda x: str(x))
def test_every_route_row_blocked(cp, rng, name, precision):
    """Each route forced, R = 13 (neither N nor B N a multiple), the row mask at the
    ending node and the pair mask at the starting node; against one block's bits and the
    float64 backend."""
    _skip_unless_runs(cp, name)
    D, h = _route_shape(name)
    module, pair, mask = _problem(cp, rng, 2, 61, D, h)
    for conventions in (dict(mask_layout="row", node="ending"),
                        dict(mask_layout="pair", node="starting")):
        options = dict(precision=precision, route=name, **conventions)
        every = _forward(cp, module, pair, mask, row_block=ALL, **options)
        blocked = _forward(cp, module, pair, mask, row_block=13, **options)
        _assert_same_bits_or_tile_rounding(
            blocked, every, f"{name} {precision} {conventions}",
            _keeps_tiles(61, 2, 13, transposed=conventions["node"] == "ending"))
        _check_reference(blocked, module.weights, pair, mask, precision, **conventions)


@pytest.mark.parametrize("mask_layout", ["pair", "row"])
@pytest.mark.parametrize("node", ["starting", "ending"])
def test_both_nodes_and_masks(cp, rng, mask_layout, node):
    module, pair, mask = _problem(cp, rng, 3, 130, 128, 4, "crop")
    options = dict(precision="tf32", mask_layout=mask_layout, node=node)
    every = _forward(cp, module, pair, mask, row_block=ALL, **options)
    for R in (1, 32, 129, 131):
        blocked = _forward(cp, module, pair, mask, row_block=R, **options)
        _assert_same_bits_or_tile_rounding(blocked, every, f"R={R} {mask_layout}/{node}",
                                           _keeps_tiles(130, 3, R, transposed=node == "ending"))


def test_unmasked(cp, rng):
    module, pair, _ = _problem(cp, rng, 1, 70, 64, 2)
    every = _forward(cp, module, pair, None, row_block=ALL)
    _assert_same_bits_or_tile_rounding(_forward(cp, module, pair, None, row_block=9), every,
                                       "unmasked", _keeps_tiles(70, 1, 9))


# ---- the persistent projections' bias pass (layernorm_bias_ffma.cu) ----

@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("pair_dtype", ["float32", "float16"])
def test_persistent_bias_pass_against_float64(cp, rng, precision, pair_dtype):
    """D = 128, h = 4, B = 2, N = 133 (no tile filled), every route's default persistent
    projection: the blocked forward within the mode's tolerance of the float64 backend,
    with rows far past 2^40 and a constant row among them (LayerNorm's rescaled path)."""
    module, pair, mask = _problem(cp, rng, 2, 133, 128, 4, "padding")
    pair[0, 5, :7] *= 1e30
    pair[1, 9, 3] = 3e20
    pair = pair.astype(pair_dtype) if pair_dtype == "float32" else (
        np.clip(pair, -6e4, 6e4).astype(pair_dtype))
    got = _forward(cp, module, pair, mask, precision=precision, row_block=11)
    assert np.isfinite(got).all()
    expected = reference.triangle_attention(pair.astype(np.float32), mask, module.weights,
                                            fully_masked="zero")
    err = rel_l2(got.astype(np.float64), expected)
    # (a float16 output adds its own rounding, ~3e-4 rel L2)
    tolerance = TOLERANCE[precision] if pair_dtype == "float32" else max(TOLERANCE[precision], 1e-3)
    assert err <= tolerance, f"rel L2 {err:.3g}"


def test_persistent_bias_pass_writes_the_bias_the_single_pass_does(cp, rng):
    """The bias tiles of the bias pass against the single pass's (fp16 in both; the pass's
    fp32 products against the persistent projection's fp16 hi + lo ones): equal to
    within fp16's rounding, -inf exactly where the mask drops."""
    module, pair, mask = _problem(cp, rng, 1, 200, 128, 4, "padding")
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    single = gpu.forward.Forward(module._dw, d_pair, d_mask, "zero", None, "fp32")
    single.project()
    blocked = gpu.forward.Forward(module._dw, d_pair, d_mask, "zero", None, "fp32",
                                  row_block=50)
    assert blocked.plan.project_persistent  # (the persistent projections' bias pass)
    launches = row_blocks.RowBlockLaunches.of(blocked.plan, module._dw)
    blocked.zero_bias_memory()
    p = blocked.pointers
    p["row_begin"], p["row_end"] = 0, 200
    launches.bias_pass(p, launches.bias_grid(200))
    a = single.bias.get().view(np.float16).astype(np.float32)
    b = cp.ndarray(single.plan.bias_shape, single.plan.bias_dtype,
                   memptr=blocked._scratch).get().view(np.float16).astype(np.float32)
    assert np.array_equal(np.isneginf(a), np.isneginf(b))
    finite = np.isfinite(a)
    assert np.isfinite(b[finite]).all()
    assert np.abs(a[finite] - b[finite]).max() <= 2e-3 * max(1.0, np.abs(a[finite]).max())


# ---- in place ----

@pytest.mark.parametrize("node", ["starting", "ending"])
@pytest.mark.parametrize("R", [None, 1, 17])
def test_in_place(cp, rng, node, R):
    """out = pair: the single pass (R None) and row blocks give the out-of-place bits."""
    module, pair, mask = _problem(cp, rng, 2, 150, 128, 4)
    expected = _forward(cp, module, pair, mask, precision="bf16", node=node, row_block=R)
    got = _forward(cp, module, pair, mask, precision="bf16", node=node, out="pair",
                   row_block=R)
    _assert_same_bits(got, expected, f"in place R={R} {node}")


def test_in_place_under_a_scratch_limit(cp, rng):
    """max_scratch_bytes below the single pass's: the policy picks row blocks itself."""
    module, pair, mask = _problem(cp, rng, 1, 256, 128, 4)
    expected = _forward(cp, module, pair, mask, precision="fp32", row_block=ALL)
    limit = pair.nbytes // 2
    forward = gpu.forward.Forward(module._dw, cp.asarray(pair), cp.asarray(mask), "zero",
                                  None, "fp32", max_scratch_bytes=limit)
    assert forward.rows_per_block is not None and forward.blocked_scratch.nbytes <= limit
    got = _forward(cp, module, pair, mask, precision="fp32", out="pair",
                   max_scratch_bytes=limit)
    _assert_same_bits(got, expected, "in place under max_scratch_bytes")


def test_small_problems_take_the_single_pass(cp, rng):
    module, pair, mask = _problem(cp, rng, 2, 64, 64, 4)
    forward = gpu.forward.Forward(module._dw, cp.asarray(pair), cp.asarray(mask), "zero",
                                  None, "fp32")
    assert forward.rows_per_block is None


def test_a_limit_too_small_for_one_row_is_a_memory_error(cp, rng):
    module, pair, mask = _problem(cp, rng, 1, 64, 64, 4)
    with pytest.raises(MemoryError, match="max_scratch_bytes=4096 leaves no room"):
        module(cp.asarray(pair), cp.asarray(mask), max_scratch_bytes=4096)


def test_stage_launchers_refuse_row_blocks(cp, rng):
    module, pair, mask = _problem(cp, rng, 1, 64, 64, 4)
    forward = gpu.forward.Forward(module._dw, cp.asarray(pair), cp.asarray(mask), "zero",
                                  None, "fp32", row_block=8)
    with pytest.raises(ValueError, match="runs in row blocks of 8 rows"):
        forward.stages()


# ---- several devices, emulated ----

@pytest.mark.parametrize("devices,R", [(2, 1000), (3, 7), (8, 16), (5, 1), (3, 24)])
def test_emulated_devices_equal_one(cp, rng, devices, R):
    """The rows split over `devices` shares (bias pass per share, then each share's
    blocks) give the bits of one device's blocked forward."""
    module, pair, mask = _problem(cp, rng, 2, 200, 128, 4)
    for precision in ("fp32", "bf16"):
        whole = _forward(cp, module, pair, mask, precision=precision, row_block=ALL)
        poison_pool(cp)
        got = gpu.forward.emulate_devices(module, cp.asarray(pair), cp.asarray(mask),
                                         devices=devices, row_block=R, precision=precision)
        _assert_same_bits_or_tile_rounding(got.get(), whole,
                                           f"{devices} devices R={R} {precision}",
                                           _keeps_tiles(200, 2, R, devices))
