"""Row blocks: a forward whose scratch holds q, k, v and the gate of R pair rows at a time.

Row (b, i) of the output needs only row (b, i)'s q, k, v and gate and the (B, h, N, N)
pair bias, which is computed from the whole pair. So a long-N forward runs as

  1. the bias pass: LayerNorm and the pair bias of every row (one launch), written where
     the single pass has it: project_mma.cu's or project_ffma.cu's own code (BIAS_ONLY),
     or for the persistent projections (whose bias comes out of the products of q and the
     gate) layernorm_bias_ffma.cu, on the same scales, writing the same bias tiles;
  2. the row mask's bits and the key extent, for every row (small);
  3. for each block of R rows (b, i), contiguous in the flattened B N order: the
     projection of its rows with a null bias (q, k, v, gate and the K/V^T tiles; no bias),
     the attention over its rows (one launch per batch it touches), the out projection
     writing its output rows.

Scratch: the bias, the key extent and the row mask's bits for all rows, plus qkvg and the
tiles of R rows. The kernels are the single pass's, compiled with ROW_BLOCK
(kernels/common.cuh): they take the rows [row_begin, row_end) last and index every array
as the whole problem does; qkvg and the tiles are passed offset back by row_begin's rows,
so that the block's rows land in the block's scratch. The out projections take the
block's qkvg as it lies and `out` at the segment's first row. Each row's arithmetic is the
same in every block and the bias is the bias pass's alone, so the output is the same bits
for every R of whole out-projection tiles (row_unit, below); the single pass's where the
bias pass is the route's own projection code (project_mma.cu, project_ffma.cu), within
the route's accuracy otherwise.

In place (out = pair): the bias pass reads every row before any output is written; in
step 3 a block's projection reads its own rows before its out projection overwrites them,
and no later block reads them (the ending node's out projection writes row (b, i, j) of
the transposed problem to the caller's (b, j, i): the block's columns, which only its own
projection reads).

`devices` (emulate_devices): the rows split into G contiguous shares, each "device"
running the bias pass over its own rows, then its rows' blocks, as G GPUs would after
all-gathering the bias (docs/multi_gpu.md). Bit-identical to one device.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import tiles

# Default scratch limit: half the input's bytes, but never below a floor where the blocked
# path's extra read of the pair (and its launches) would cost time without need: the
# larger of 256 MiB and 1/16 of the device's memory (an H200 keeps the single pass up to
# 8.8 GB of scratch: every benchmarked size through 1x2048x128, 8.06 GiB in fp32; a 24 GB
# card up to 1.5 GB). The extra read is a share of the forward falling as 1/N: ~3% at
# 1x2048 in bf16, ~1.7% at 1x4096 (docs/performance.md).
SCRATCH_FLOOR_BYTES = 256 << 20
DEVICE_SHARE = 16
_ALIGN = 1024  # each region of the blocked scratch (the tile copies need 16 bytes)

# The out projections' tile: 64 pair rows (project_wgmma.cu, project_wgmma_split.cu ROWS;
# project_mma.cu's out blocks, 128 at some small sizes: Plan.out_rows). Their fp16
# products scale each tile's g o by a power of two from the tile's largest |g o|, so the
# tile a row falls in can round the lo parts of its tiny values, and an output's last
# bit, differently (about one output in 10^7 at 2x200x128 in fp32, measured). A block's
# out projection starts a tile at its first row: blocks of whole `row_unit` rows keep
# every tile of the single launch, and its bits.
OUT_TILE_ROWS = 64


def row_unit(N: int, tile_rows: int = OUT_TILE_ROWS) -> int:
    """The fewest rows (b, i) whose N pair rows each fill whole out-projection tiles of
    `tile_rows` rows (Plan.out_rows)."""
    return tile_rows // math.gcd(N, tile_rows)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclasses.dataclass(frozen=True)
class ScratchSizes:
    """What a forward's scratch takes: `whole` for the single pass (Plan.scratch_bytes);
    for row blocks `shared` (the bias, the key extent and the row mask's bits, read by
    every block) and `per_row` (qkvg rows and K/V^T tiles of one pair row (b, i)), over
    `rows` = B N rows; `unit` (row_unit) the rows a chosen block size is a multiple of."""
    whole: int
    shared: int
    per_row: int
    rows: int
    unit: int = 1

    def blocked(self, rows_per_block: int) -> int:
        """The row-blocked scratch of `rows_per_block` rows (regions aligned)."""
        return self.shared + _ALIGN + rows_per_block * self.per_row


def scratch_sizes(plan) -> ScratchSizes:
    B, N, H = plan.B, plan.N, plan.H
    row_mask = B * N * (plan.npk // 32) * 4 if plan.row_mask is not None else 0
    shared = _aligned(plan.bias_bytes) + _aligned(4 * B) + _aligned(row_mask)
    per_row = (N * plan.layout.row_words * plan.D * 4
               + H * (plan.npk // tiles.WGMMA_KEYS) * plan.layout.tile_bytes)
    return ScratchSizes(plan.scratch_bytes, shared, per_row, B * N, row_unit(N, plan.out_rows))


def default_limit(input_bytes: int, device_total: int | None = None) -> int:
    """The default scratch limit: max(input / 2, the floor); the floor the larger of
    SCRATCH_FLOOR_BYTES and device_total / DEVICE_SHARE."""
    floor = max(SCRATCH_FLOOR_BYTES, (device_total or 0) // DEVICE_SHARE)
    return max(input_bytes // 2, floor)


def check_row_block_args(row_block, max_scratch_bytes):
    """ValueError/TypeError naming the argument, for TriangleAttention.__call__'s
    row_block (rows (b, i) per block, >= 1) and max_scratch_bytes (bytes, >= 1)."""
    for name, value in (("row_block", row_block), ("max_scratch_bytes", max_scratch_bytes)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int or None; got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1; got {value}")


def rows_per_block(sizes: ScratchSizes, input_bytes: int, *, row_block=None,
                   max_scratch_bytes=None, device_total=None, device_free=None):
    """Rows (b, i) per block, or None for the single pass.

    `row_block` forces blocks of that many rows (at most B N: one block). Otherwise the
    single pass runs where its scratch fits the limit (`max_scratch_bytes`, else
    default_limit), and at most `device_free` (the free device memory, where known);
    else the most rows whose blocked scratch fits, in whole `sizes.unit` where one fits
    (the single launch's out-projection tiles, and so its bits: row_unit)."""
    check_row_block_args(row_block, max_scratch_bytes)
    if row_block is not None:
        return min(int(row_block), sizes.rows)
    limit = (default_limit(input_bytes, device_total) if max_scratch_bytes is None
             else int(max_scratch_bytes))
    named = max_scratch_bytes is not None
    if device_free is not None and device_free < limit:
        limit, named = int(device_free), False
    if sizes.whole <= limit:
        return None
    rows = (limit - sizes.blocked(0)) // sizes.per_row
    if rows < 1:
        what = (f"max_scratch_bytes={max_scratch_bytes}" if named
                else f"the free device memory ({limit} bytes)")
        raise MemoryError(
            f"{what} leaves no room for one row block: the pair bias, key extent and "
            f"row mask take {sizes.blocked(0)} bytes and one pair row (b, i) "
            f"{sizes.per_row} more")
    if rows >= sizes.unit:
        rows -= rows % sizes.unit
    return min(rows, sizes.rows)


def split_rows(rows: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """`rows` split into `parts` contiguous [begin, end) shares of whole `unit`s, as even as
    can be (the first ones a unit longer; the last also takes the rows % unit past the
    last whole unit), so that every share starts on a multiple of `unit`; empty shares are
    left out."""
    if parts < 1:
        raise ValueError(f"devices must be at least 1; got {parts}")
    units, tail = divmod(rows, unit)
    base, extra = divmod(units, parts)
    shares, begin = [], 0
    for g in range(parts):
        end = begin + (base + (g < extra)) * unit + (tail if g == parts - 1 else 0)
        if end > begin:
            shares.append((begin, end))
        begin = end
    return shares


def blocks_of(begin: int, end: int, rows_per_block: int) -> list[tuple[int, int]]:
    """[begin, end) in blocks of `rows_per_block` rows (the last shorter)."""
    return [(r, min(r + rows_per_block, end)) for r in range(begin, end, rows_per_block)]


def batch_segments(begin: int, end: int, N: int) -> list[tuple[int, int]]:
    """[begin, end) of the flattened B N rows cut where a batch ends (the attention
    launches of ROW_BLOCK take rows of one batch)."""
    segments = []
    while begin < end:
        stop = min(end, (begin // N + 1) * N)
        segments.append((begin, stop))
        begin = stop
    return segments


# ---- the launches ----

class RowBlockLaunches:
    """A Plan's kernels for row blocks (made once per plan: RowBlockLaunches.of), as its
    RouteLaunches build them with row_block=True: the bias pass (BIAS_ONLY, or
    layernorm_bias_ffma.cu for the persistent projections), a block's projection (with a
    null bias: none written), attention (ROW_BLOCK) and out projection (its M per
    segment)."""

    def __init__(self, plan, dw):
        self.plan, self.sm_count = plan, dw.sm_count
        build = plan.launches
        self.project = build.project(row_block=True)
        self.bias_pass, self.bias_rows, self.bias_blocks = build.bias_pass()
        self.attention = build.attention(plan.attention_kernel, row_block=True)
        self.out_project = build.out_project(row_block=True)
        self.project_rows = dict(self.project.config.defines).get("BM")

    @classmethod
    def of(cls, plan, dw) -> "RowBlockLaunches":
        made = plan.row_block_launches
        if made is None:
            made = plan.row_block_launches = cls(plan, dw)
        return made

    def bias_grid(self, rows: int) -> int:
        blocks = -(-rows * self.plan.N // self.bias_rows)
        return blocks if self.bias_blocks is None else min(blocks, self.bias_blocks)

    def project_grid(self, rows: int) -> int:
        N = self.plan.N
        if self.plan.project_persistent:  # persistent: at most one block per SM
            return min(rows * -(-N // tiles.WGMMA_KEYS), self.sm_count)
        return -(-rows * N // self.project_rows)

    def attention_grid(self, rows: int) -> int:
        k, N = self.plan.attention_kernel, self.plan.N
        return -(-N // k.queries) * self.plan.H * -(-rows // k.rows)

    def out_grid(self, rows: int) -> int:
        M = rows * self.plan.N
        if self.plan.out_persistent:
            return min(-(-M // tiles.PERSISTENT_ROWS), self.sm_count)
        return -(-M // self.plan.out_rows)


class BlockedScratch:
    """The row-blocked scratch's regions in one allocation (byte offsets): the bias,
    the key extent, the row mask's bits, then qkvg and the K/V^T tiles of R rows."""

    def __init__(self, plan, rows_per_block: int):
        self.rows_per_block = rows_per_block
        self.bias = 0
        self.extent = _aligned(plan.bias_bytes)
        self.row_mask = self.extent + _aligned(4 * plan.B)
        row_mask = plan.B * plan.N * (plan.npk // 32) * 4 if plan.row_mask is not None else 0
        self.qkvg = _aligned(self.row_mask + row_mask)
        self.qkvg_row_bytes = plan.N * plan.layout.row_words * plan.D * 4
        self.vt_row_bytes = plan.H * (plan.npk // tiles.WGMMA_KEYS) * plan.layout.tile_bytes
        self.vt = _aligned(self.qkvg + rows_per_block * self.qkvg_row_bytes)
        self.nbytes = self.vt + rows_per_block * self.vt_row_bytes


def _back(address: int, offset: int) -> int:
    """`address - offset` as the kernels' 64-bit pointer arithmetic sees it (a block's
    scratch indexed by the global row: common.cuh ROW_BLOCK)."""
    return (address - offset) % (1 << 64)


def run(forward, rows_per_block: int, devices: int = 1):
    """The forward's stages row block by row block (module docstring), on the forward's
    blocked scratch (Forward allocates BlockedScratch(plan, rows_per_block).nbytes).
    `devices` > 1 emulates that many devices on this one (emulate_devices)."""
    plan, p = forward.plan, forward.pointers
    launches = RowBlockLaunches.of(plan, forward.dw)
    N, D = plan.N, plan.D
    itemsize = 4 if plan.pair_dtype == "float32" else 2  # the output's elements
    scratch = forward.blocked_scratch
    qkvg0, vt0, bias0 = p["qkvg"], p["vt"], p["bias"]
    shares = split_rows(plan.B * N, devices, row_unit(N, plan.out_rows))

    def point(begin: int):  # qkvg and the tiles of the block starting at row `begin`
        p["qkvg"] = _back(qkvg0, begin * scratch.qkvg_row_bytes)
        p["vt"] = _back(vt0, begin * scratch.vt_row_bytes) if vt0 else 0

    forward.zero_bias_memory()
    # 1. the bias of every row: one launch per device's share (the bias all-gathered after)
    for begin, end in shares:
        p["row_begin"], p["row_end"] = begin, end
        launches.bias_pass(p, launches.bias_grid(end - begin))
    forward.take_out_memory()
    out0 = p["out"]
    forward.pack_row_mask()
    forward.find_key_extent()
    # 2. each block: its projection (no bias: null bias and bias weights), attention, out
    #    projection
    p["wb"] = 0
    for share in shares:
        for begin, end in blocks_of(*share, rows_per_block):
            point(begin)
            p["row_begin"], p["row_end"], p["bias"] = begin, end, 0
            launches.project(p, launches.project_grid(end - begin))
            p["bias"] = bias0
            for s0, s1 in batch_segments(begin, end, N):
                p["row_begin"], p["row_end"] = s0, s1
                launches.attention(p, launches.attention_grid(s1 - s0))
            segments = (batch_segments(begin, end, N) if plan.out_transposed
                        else [(begin, end)])
            for s0, s1 in segments:
                p["qkvg"] = qkvg0 + (s0 - begin) * scratch.qkvg_row_bytes
                p["M"] = (s1 - s0) * N
                if plan.out_transposed:  # caller_row of the segment's local rows, from
                    # the segment's first row (b, i): out at (b N N + i) D
                    b, i = divmod(s0, N)
                    p["out"] = out0 + (b * N * N + i) * D * itemsize
                else:
                    p["out"] = out0 + s0 * N * D * itemsize
                launches.out_project(p, launches.out_grid(s1 - s0))
    p["qkvg"], p["vt"], p["out"] = qkvg0, vt0, out0
