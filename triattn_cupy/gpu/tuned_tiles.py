"""The tuned attention tiles, as data: one table per tile family (gpus.Gpu.tile_table), each
naming the GPU it was measured on and the target whose spill-free compilation bounds it.

An mma.sync table is a list of rules, the first whose arithmetic variants, head dims and N
match giving the tiles; a wgmma table gives each variant's tiles. Timings quoted are the
forward (or the attention alone) on that GPU (docs/performance.md); "spills" are what
ptxas reports for the check target (tests/test_kernels_compile.py bounds them).
"""
from __future__ import annotations

import dataclasses

# N at or below which the mma.sync tables take their small-N rules (kernel_catalog.all_configs
# compiles the tiles on both sides of it).
SMALL_N = 128


@dataclasses.dataclass(frozen=True)
class MmaTiles:
    """The attention_mma.cu tile shape: BK keys per tile, MT 16-query m-tiles per warp,
    ROWS pair rows per block (sharing their bias tiles), PREFETCH the next key/value tile
    into registers (3xTF32, whose tiles are staged through registers), MIN_BLOCKS resident
    blocks per SM asked of the compiler (2: at most 128 registers per thread), STAGES
    tiles in the cp.async ring (TF32 and bf16, which copy k and v as the projection wrote
    them). The 8 warps give BQ = 16 * MT * 8 / ROWS queries per row. PREFETCH is read by
    the staged variants (3xTF32, f16x3) only."""
    bk: int = 64
    mt: int = 1
    rows: int = 1
    prefetch: int = 1
    min_blocks: int = 1
    stages: int = 3

    @property
    def queries(self) -> int:
        return 16 * self.mt * 8 // self.rows


@dataclasses.dataclass(frozen=True)
class WgmmaTiles:
    """The attention_wgmma.cu shape: ROWS pair rows per block (256 threads each, sharing
    the bias tiles), STAGES tiles in the ring, MIN_BLOCKS per SM asked of the compiler,
    PV_GROUPS (f16x3): fresh P V accumulators per key tile, each added to O in fp32. Every
    variant's warp 0 fills the stages with bulk copies from the K and V^T tiles of a tiled
    layout, paced by mbarriers."""
    rows: int = 1
    stages: int = 2
    min_blocks: int = 2
    pv_groups: int = 2


@dataclasses.dataclass(frozen=True)
class MmaRule:
    """Tiles for the mma.sync attention's `variants` at head dims in `dims` and N "small"
    (<= SMALL_N), "large" or either (None)."""
    variants: tuple[str, ...]
    dims: range | tuple[int, ...]
    n: str | None
    tiles: MmaTiles

    def matches(self, variant: str, head_dim: int, n: int) -> bool:
        size = "small" if n <= SMALL_N else "large"
        return variant in self.variants and head_dim in self.dims and self.n in (None, size)


@dataclasses.dataclass(frozen=True)
class TileTable:
    """The tiles of one tile family: `tuned_on` the GPU measured, `check_arch` the target
    whose spill-free compilation bounds them, `mma` the mma.sync rules (first match),
    `wgmma` the wgmma attention's tiles per variant (none where the family has no wgmma)."""
    tuned_on: str
    check_arch: str
    mma: tuple[MmaRule, ...]
    wgmma: dict = dataclasses.field(default_factory=dict)


def _upto(top: int) -> range:
    return range(1, top + 1)


STAGED, RING = ("tf32x3", "f16x3"), ("tf32", "bf16")
# Rules both families share: f16x3 (not measured apart: 3xTF32's shapes where they compile
# without spills) takes fewer registers for its fp16 operands (q's hi and lo as many as q
# in fp32), so at d <= 16 and small N it keeps the next tile in registers too (105-127
# registers, no spills; 3xTF32 spills there).
_SMALL_STAGED = (
    MmaRule(("tf32x3",), _upto(16), "small", MmaTiles(bk=32, prefetch=0, min_blocks=2)),
    MmaRule(("f16x3",), _upto(16), "small", MmaTiles(bk=32, prefetch=1, min_blocks=2)),
)
# TF32 and bf16: the cp.async ring; 2 blocks of 8 warps per SM where their registers fit
_SMALL_RING = (  # 3 blocks per SM (80 registers, 2-stage ring)
    MmaRule(RING, _upto(16), "small", MmaTiles(bk=32, min_blocks=3, stages=2)),
)
_LARGE_RING = (
    # bf16: 16-key tiles, 2 rows share each bias tile, 2 m-tiles per warp
    MmaRule(("bf16",), _upto(32), "large", MmaTiles(bk=16, mt=2, rows=2, min_blocks=2)),
    MmaRule(("tf32",), _upto(32), "large", MmaTiles(bk=64, min_blocks=2, stages=2)),
    MmaRule(("tf32",), _upto(48), None, MmaTiles(bk=32, min_blocks=2)),
    MmaRule(("bf16",), _upto(64), None, MmaTiles(bk=32, min_blocks=2)),
    MmaRule(("tf32",), _upto(64), None, MmaTiles(bk=32)),
    MmaRule(("tf32",), _upto(1 << 30), None, MmaTiles(bk=16)),
    MmaRule(("bf16",), _upto(1 << 30), None, MmaTiles(bk=32)),
)

TABLES = {
    "sm_90": TileTable(
        tuned_on="NVIDIA H200", check_arch="sm_90",
        mma=_SMALL_STAGED + (
            # d = 24: 2 blocks per SM, one row, the next tile in registers (3xTF32): 0.55
            # against 0.73 ms at 1x384x96x4 and 0.080 against 0.094 at 1x160, though it
            # spills 24-32 bytes; f16x3 spills 24-40 bytes with that shape, so it drops the
            # prefetch instead (125 registers)
            MmaRule(("tf32x3",), (24,), None, MmaTiles(bk=32, prefetch=1, min_blocks=2)),
            MmaRule(("f16x3",), (24,), None, MmaTiles(bk=32, prefetch=0, min_blocks=2)),
            # 2 rows x 2 m-tiles per warp at every N (one row was faster at N > 512, 10.8
            # against 11.8 ms at 1x1024, but spills since each k-step's P V terms are summed
            # in fragments of their own)
            MmaRule(STAGED, _upto(32), None, MmaTiles(bk=32, mt=2, rows=2, prefetch=1)),
            MmaRule(STAGED, _upto(64), None, MmaTiles(bk=16)),
        ) + _SMALL_RING + (
            # bf16 32-key tiles where they fit in 128 registers, d = 8, 16, 32 (1x1024:
            # 3.40 -> 3.17 ms); d = 24 spills them
            MmaRule(("bf16",), (8, 16, 32), "large",
                    MmaTiles(bk=32, mt=2, rows=2, min_blocks=2)),
        ) + _LARGE_RING,
        # One row per block, tiles by bulk copies: the fastest measured at 1x384 and 1x1024
        # (3.14 against 3.49 ms with cp.async at 1x1024 in TF32).
        wgmma={
            # 3 blocks per SM: 78 registers, no spills (Q in shared memory); 2.50 against
            # 2.61 ms at 1x1024 in two (2.08 ms with Q in shared memory)
            "bf16": WgmmaTiles(min_blocks=3),
            # 2 blocks per SM (101 KiB each), one fresh P V accumulator per tile: 123
            # registers, no spills
            "f16x3": WgmmaTiles(pv_groups=1),
            # the tf32 mode's one fp16 product as bf16's: 2.26 against 2.70 ms in 2 blocks
            # per SM
            "f16": WgmmaTiles(min_blocks=3),
            "f16s": WgmmaTiles(min_blocks=3),  # 80 registers, no spills
        }),
    "sm_80": TileTable(
        # the H200's shapes where they compile for sm_80 within 255 registers, without
        # spills; not measured on an sm_80 GPU
        tuned_on="NVIDIA H200", check_arch="sm_80",
        mma=_SMALL_STAGED + (
            # d = 24 without the next tile in registers; d = 32 one m-tile (d = 24, 32
            # spill within 128 registers)
            MmaRule(STAGED, (24,), None, MmaTiles(bk=32, mt=2, rows=2, prefetch=0)),
            MmaRule(STAGED, _upto(24), None, MmaTiles(bk=32, mt=2, rows=2, prefetch=1)),
            MmaRule(STAGED, _upto(32), None, MmaTiles(bk=32, mt=1, rows=2)),
            MmaRule(STAGED, _upto(64), None, MmaTiles(bk=16)),
        ) + _SMALL_RING + _LARGE_RING),
}


def mma_tiles(table: str, head_dim: int, variant: str, n: int) -> MmaTiles:
    """The first rule of `table` matching (variant, head_dim, n), or a ValueError."""
    for rule in TABLES[table].mma:
        if rule.matches(variant, head_dim, n):
            return rule.tiles
    raise ValueError(f"{variant} attention takes head dims up to 64; got {head_dim}")


def wgmma_tiles(table: str, variant: str) -> WgmmaTiles:
    """The wgmma attention's tiles of `variant` in `table`."""
    return TABLES[table].wgmma[variant]
