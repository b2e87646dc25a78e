"""Row blocks without a GPU: the policy's arithmetic (when blocks run, how many rows), the
splits into blocks, batch segments and device shares, the argument errors, and the
scratch sizes of the plans' layouts (gpu/row_blocks.py)."""
from __future__ import annotations

import types

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import reference
from triattn_cupy.gpu.device_weights import fold_layer_norm_into_bias

from triattn_cupy.gpu import kernel_catalog, kernel_configs, layouts, row_blocks, tiles
from triattn_cupy.gpu.checks import PAIR_DTYPES
from triattn_cupy.gpu.row_blocks import rows_per_block

GiB, MiB = 1 << 30, 1 << 20


def _sizes(N=4096, D=128, H=4, B=1, layout=layouts.TILES_F16_SLOTS, bias_bytes=None):
    """The scratch of a plan of this geometry (a stand-in with Plan's attributes)."""
    npk = -(-N // 64) * 64
    plan = types.SimpleNamespace(
        B=B, N=N, D=D, H=H, npk=npk, layout=layout, row_mask=None, key_extent=None,
        out_rows=64, bias_bytes=bias_bytes if bias_bytes is not None else B * H * N * npk * 2)
    per_row = N * layout.row_words * D * 4 + H * (npk // 64) * layout.tile_bytes
    plan.scratch_bytes = plan.bias_bytes + B * N * per_row
    return row_blocks.scratch_sizes(plan)


def test_scratch_sizes_per_row_and_shared():
    s = _sizes(N=1024, layout=layouts.ROWS_FP32, bias_bytes=4 * 1024 * 1024 * 4)
    assert s.per_row == 1024 * 4 * 128 * 4          # qkvg rows of 4D words, no tiles
    assert s.shared == 4 * 1024 * 1024 * 4 + 1024   # the bias, the key extent's region
    assert s.rows == 1024
    tiled = _sizes(N=1000, layout=layouts.TILES_F16_HILO)
    assert tiled.per_row == 1000 * 2 * 128 * 4 + 4 * 16 * 16384  # 2D words + hi/lo tiles


def test_small_problems_keep_the_single_pass():
    s = _sizes(N=256)
    assert s.whole < row_blocks.SCRATCH_FLOOR_BYTES
    assert rows_per_block(s, 256 * 256 * 128 * 4, device_total=24 * GiB,
                          device_free=20 * GiB) is None


def test_the_floor_is_a_sixteenth_of_the_device():
    assert row_blocks.default_limit(GiB, None) == 512 * MiB
    assert row_blocks.default_limit(100 * MiB, None) == row_blocks.SCRATCH_FLOOR_BYTES
    assert row_blocks.default_limit(GiB, 141 * 10**9) == 141 * 10**9 // 16
    assert row_blocks.default_limit(64 * GiB, 141 * 10**9) == 32 * GiB


def test_the_benchmarked_sizes_keep_the_single_pass_on_an_h200():
    for N, layout in ((1024, layouts.TILES_F16_HILO), (2048, layouts.TILES_F16_HILO),
                      (2048, layouts.TILES_F16_SLOTS)):
        s = _sizes(N=N, layout=layout)
        assert rows_per_block(s, N * N * 128 * 4, device_total=141 * 10**9,
                              device_free=130 * GiB) is None


def test_long_n_blocks_within_half_the_input():
    N, D = 8192, 128
    input_bytes = N * N * D * 4
    s = _sizes(N=N)
    R = rows_per_block(s, input_bytes, device_total=141 * 10**9, device_free=100 * GiB)
    assert R is not None and 1 <= R < N
    assert s.blocked(R) <= input_bytes // 2 < s.blocked(R + 1)


def test_free_memory_bounds_the_scratch():
    s = _sizes(N=2048)  # ~4 GiB in one pass: within an H200's floor
    input_bytes = 2048 * 2048 * 128 * 4
    assert rows_per_block(s, input_bytes, device_total=141 * 10**9, device_free=80 * GiB) is None
    R = rows_per_block(s, input_bytes, device_total=141 * 10**9, device_free=GiB)
    assert R is not None and s.blocked(R) <= GiB


def test_max_scratch_bytes_sets_the_limit():
    s = _sizes(N=1024)
    input_bytes = 1024 * 1024 * 128 * 4
    assert rows_per_block(s, input_bytes, max_scratch_bytes=s.whole) is None
    R = rows_per_block(s, input_bytes, max_scratch_bytes=s.whole - 1)
    assert R == (s.whole - 1 - s.blocked(0)) // s.per_row
    assert rows_per_block(s, input_bytes, max_scratch_bytes=s.blocked(1)) == 1


def test_too_small_a_limit_names_what_limits_it():
    s = _sizes(N=1024)
    with pytest.raises(MemoryError, match=r"max_scratch_bytes=1000 leaves no room"):
        rows_per_block(s, 1 << 29, max_scratch_bytes=1000)
    with pytest.raises(MemoryError, match=r"free device memory \(1000 bytes\)"):
        rows_per_block(s, 1 << 29, device_free=1000)


def test_row_block_forces_blocks_up_to_all_rows():
    s = _sizes(N=64, B=3)
    assert rows_per_block(s, 1, row_block=5) == 5
    assert rows_per_block(s, 1, row_block=10 ** 6) == 3 * 64  # one block of every row


@pytest.mark.parametrize("name,value,error,match", [
    ("row_block", 0, ValueError, r"row_block must be at least 1; got 0"),
    ("row_block", 2.5, TypeError, r"row_block must be an int or None; got float"),
    ("row_block", True, TypeError, r"row_block must be an int or None; got bool"),
    ("max_scratch_bytes", -1, ValueError, r"max_scratch_bytes must be at least 1; got -1"),
    ("max_scratch_bytes", "1G", TypeError, r"max_scratch_bytes must be an int"),
])
def test_bad_arguments_are_named(name, value, error, match):
    with pytest.raises(error, match=match):
        row_blocks.check_row_block_args(**{"row_block": None, "max_scratch_bytes": None,
                                           name: value})


def test_blocks_segments_and_shares():
    assert row_blocks.blocks_of(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert row_blocks.blocks_of(3, 4, 1) == [(3, 4)]
    # rows of one batch per attention launch (N = 4)
    assert row_blocks.batch_segments(3, 10, 4) == [(3, 4), (4, 8), (8, 10)]
    assert row_blocks.batch_segments(4, 8, 4) == [(4, 8)]
    assert row_blocks.split_rows(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_blocks.split_rows(2, 4) == [(0, 1), (1, 2)]  # no empty shares
    with pytest.raises(ValueError, match="devices must be at least 1"):
        row_blocks.split_rows(10, 0)


def test_row_units_fill_whole_out_projection_tiles():
    for tile in (64, 128):
        for N in (1, 61, 120, 130, 200, 384, 4095, 4096):
            unit = row_blocks.row_unit(N, tile)
            assert unit * N % tile == 0
            assert all(u * N % tile for u in range(1, unit))
    assert (row_blocks.row_unit(200), row_blocks.row_unit(61), row_blocks.row_unit(4096)) == (8, 64, 1)
    assert (row_blocks.row_unit(120, 128), row_blocks.row_unit(128, 128)) == (16, 1)


def test_out_blocks_of_128_rows_only_where_they_save_a_wave():
    """128-row out blocks on tensor cores where they are one wave (2 per SM) and 64-row
    ones are not (3 per SM): 2x128x64x4 on 132 SMs; 64 rows at large sizes, on FFMA, and
    where either is one wave."""
    rows = tiles.out_project_rows
    assert rows(2 * 128 * 128, 132) == 128 and rows(2 * 128 * 128, 132, False) == 64
    assert rows(3 * 64 * 132, 132) == 64 and rows(3 * 64 * 132 + 1, 132) == 128
    assert rows(2 * 128 * 132, 132) == 128 and rows(2 * 128 * 132 + 1, 132) == 64
    assert rows(1 << 20, 132) == 64 and rows(1000, 132) == 64 and rows() == 64
    assert rows(2 * 128 * 128, 108) == 64  # (an A100: 2 waves of 128 rows too)


def test_shares_start_on_whole_units():
    assert row_blocks.split_rows(400, 3, 8) == [(0, 136), (136, 272), (272, 400)]
    assert row_blocks.split_rows(405, 5, 8) == [(0, 80), (80, 160), (160, 240), (240, 320),
                                                (320, 405)]  # the last takes the tail
    assert row_blocks.split_rows(2, 4, 8) == [(0, 2)]
    for rows, parts, unit in ((400, 7, 8), (122, 3, 64), (4096, 8, 1)):
        shares = row_blocks.split_rows(rows, parts, unit)
        assert shares[0][0] == 0 and shares[-1][1] == rows
        assert all(b % unit == 0 for b, _ in shares)
        assert all(e == b2 for (_, e), (b2, _) in zip(shares, shares[1:]))


def test_the_chosen_rows_per_block_are_whole_units():
    N = 4000  # unit 2
    s = _sizes(N=N)
    assert s.unit == 2
    for limit in (3 * GiB, 5 * GiB + 12345, 7 * GiB):
        R = rows_per_block(s, N * N * 128 * 4, max_scratch_bytes=limit)
        assert R % 2 == 0 and s.blocked(R) <= limit
    assert rows_per_block(s, 0, row_block=7) == 7  # a forced size stays as given


@pytest.mark.parametrize("rows,R", [(1, 1), (7, 3), (122, 5), (4096, 700)])
def test_blocks_cover_every_row_once(rows, R):
    covered = [r for b in row_blocks.blocks_of(0, rows, R) for r in range(*b)]
    assert covered == list(range(rows))
    for share in row_blocks.split_rows(rows, 3):
        assert all(e - b <= R for b, e in row_blocks.blocks_of(*share, R))


def test_pointers_offset_back_wrap_as_the_kernels_add():
    base, offset = 0x7f00_0000_0000, 0x7f00_0000_1000
    back = row_blocks._back(base, offset)
    assert 0 <= back < 1 << 64 and (back + offset) % (1 << 64) == base


@pytest.mark.parametrize("layout", [l for l in layouts.LAYOUTS if l.tiled], ids=str)
def test_every_persistent_layout_has_its_bias_pass(layout):
    """The persistent projections' bias pass is layernorm_bias_ffma.cu writing the same
    bias form, for every pair dtype, in the configurations the compile checks build
    (tests/test_kernels_compile.py)."""
    bias_layout = kernel_configs.bias_pass_layout(layout)
    assert (bias_layout.tiled, bias_layout.bias, bias_layout.scaled) == (
        layout.tiled, layout.bias, layout.scaled)
    configs = set(kernel_catalog.row_blocked_configs("sm_90"))
    for pair_dtype in PAIR_DTYPES:
        assert kernel_configs.layernorm_bias_config(bias_layout, 128, 4, pair_dtype) in configs


def test_the_bias_pass_folds_layer_norm_into_the_bias_weights():
    """layernorm_bias_ffma.cu's arithmetic in float64: r ((x - m) . w_ln) + c_ln is
    LN(x) . Wb (the reference's LayerNorm), times the bias scale."""
    rng = np.random.default_rng(0)
    weights = ta.random_weights(128, 4, seed=3)
    p = weights.params
    x = rng.standard_normal((50, 128)) * 3 + 1
    w_ln, c_ln = fold_layer_norm_into_bias(p, 0.5)
    mean = x.mean(axis=-1, keepdims=True)
    r = 1 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + weights.layer_norm_eps)
    got = r * ((x - mean) @ w_ln.astype(np.float64).T) + c_ln
    ln = reference.layer_norm(x, p["layer_norm.weight"], p["layer_norm.bias"],
                              weights.layer_norm_eps)
    expected = 0.5 * ln @ np.asarray(p["bias_proj.weight"], np.float64).T
    assert w_ln.dtype == c_ln.dtype == np.float32 and w_ln.shape == (4, 128)
    assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max()


# ---- the orchestration, with each kernel's addressing modelled on the host ----

class _Model:
    """Fake launches of row_blocks.run: each records what its kernel would read and write
    (rows (b, i) of the pair, the bias, the block's scratch), by the addresses `run` passes
    and the kernels' global indexing (common.cuh ROW_BLOCK)."""

    def __init__(self, plan, scratch, base, out_base):
        self.plan, self.scratch, self.base, self.out_base = plan, scratch, base, out_base
        self.events = []   # ("read" | "write", caller row (b, r)) of the pair / output
        self.bias_rows = set()
        self.held = {}     # scratch row -> the global row (b N + i) it holds
        self.bias_pass = lambda p, grid: self._bias(p)
        self.project = lambda p, grid: self._project(p)
        self.attention = lambda p, grid: self._attention(p)
        self.out_project = lambda p, grid: self._out(p)
        self.bias_grid = self.project_grid = self.attention_grid = self.out_grid = int

    def _scratch_row(self, address):
        row_bytes = self.scratch.qkvg_row_bytes
        offset = (address - (self.base + self.scratch.qkvg)) % (1 << 64)
        assert offset % row_bytes == 0 and offset // row_bytes < self.scratch.rows_per_block
        return offset // row_bytes

    def _read_rows(self, begin, end):  # the projection reads rows of x: caller rows
        for g in range(begin, end):
            self.events.append(("read", g))

    def _bias(self, p):
        self._read_rows(p["row_begin"], p["row_end"])
        self.bias_rows.update(range(p["row_begin"], p["row_end"]))

    def _project(self, p):
        assert p["bias"] == 0 and p["wb"] == 0  # a block's projection writes no bias
        self._read_rows(p["row_begin"], p["row_end"])
        for g in range(p["row_begin"], p["row_end"]):  # global row g at qkvg + g N ld
            row = self._scratch_row((p["qkvg"] + g * self.scratch.qkvg_row_bytes) % (1 << 64))
            self.held[row] = g

    def _attention(self, p):
        N = self.plan.N
        begin, end = p["row_begin"], p["row_end"]
        assert begin // N == (end - 1) // N, "attention rows of one batch"
        assert p["bias"] != 0 and len(self.bias_rows) == self.plan.B * N
        for g in range(begin, end):
            row = self._scratch_row((p["qkvg"] + g * self.scratch.qkvg_row_bytes) % (1 << 64))
            assert self.held[row] == g

    def _out(self, p):
        N, D = self.plan.N, self.plan.D
        first = self._scratch_row(p["qkvg"])
        for r in range(p["M"] // N):  # local rows of the segment
            g = self.held[first + r]
            if self.plan.out_transposed:  # caller rows (b, j, i): column i of every j
                b, i = divmod(g, N)
                assert p["out"] == self.out_base + (b * N * N + (g - r) % N) * D * 4
            else:
                assert p["out"] + r * N * D * 4 == self.out_base + g * N * D * 4
            self.events.append(("write", g))


@pytest.mark.parametrize("B,N,R,devices", [(1, 7, 3, 1), (2, 5, 1, 1), (2, 5, 7, 1),
                                           (3, 4, 5, 2), (2, 6, 12, 1), (2, 9, 4, 3)])
@pytest.mark.parametrize("transposed", [False, True])
def test_run_writes_every_row_once_after_reading_it(monkeypatch, B, N, R, devices,
                                                    transposed):
    """Every output row written once, by the block that projected it, after the bias of
    every row; in place, no row is read after it is written (the ending node's output
    rows are the caller's columns i: the same rows of the transposed problem)."""
    plan = types.SimpleNamespace(B=B, N=N, D=8, H=2, npk=64, layout=layouts.TILES_F16,
                                 row_mask=None, key_extent=None, bias_bytes=4096, out_rows=64,
                                 out_transposed=transposed, pair_dtype="float32")
    scratch = row_blocks.BlockedScratch(plan, R)
    base, out_base = 1 << 40, 1 << 41
    model = _Model(plan, scratch, base, out_base)
    monkeypatch.setattr(row_blocks.RowBlockLaunches, "of", lambda plan, dw: model)
    steps = []
    forward = types.SimpleNamespace(
        plan=plan, dw=None, blocked_scratch=scratch,
        pointers=dict(pair=1, mask=0, qkvg=base + scratch.qkvg, bias=base + scratch.bias,
                       vt=base + scratch.vt, extent=0, row_mask=0, out=out_base),
        zero_bias_memory=lambda: steps.append("zero"), take_out_memory=lambda: None,
        pack_row_mask=lambda: steps.append("row mask"),
        find_key_extent=lambda: steps.append("extent"))
    row_blocks.run(forward, R, devices)
    writes = [g for kind, g in model.events if kind == "write"]
    assert sorted(writes) == list(range(B * N))
    first_write = model.events.index(("write", writes[0]))
    assert {g for kind, g in model.events[:first_write] if kind == "read"} == set(range(B * N))
    for position, (kind, g) in enumerate(model.events):
        if kind == "write":
            assert ("read", g) not in model.events[position + 1:], f"row {g} read after written"
    assert steps[0] == "zero" and forward.pointers["qkvg"] == base + scratch.qkvg
