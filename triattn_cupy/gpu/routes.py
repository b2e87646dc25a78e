"""The route of a forward: which kernels run, on which layout, with which scales.

`choose_route` is the one place that decides it, from (precision, head dim, D, N, the GPU's
row of gpus.GPUS, the pair's alignment, the shared memory per block, the weights' f16s
scales, whether a mask is given); launch_plan builds the launches from the route and
decides nothing. Tests and tools force a route by name (ROUTES) through `route=` of the
public API.

    route                     precision   GPUs (engines; head dim d, N)               projections + attention
    ffma                      any         FFMA only, or where no other fits           ffma fp32 + ffma fp32
    mma_f16x3                 fp32        mma; d % 8 == 0, d <= 64                    mma f16x3 + mma f16x3
    mma_tf32                  tf32        mma; d % 8 == 0, d <= 120                   mma tf32 + mma tf32
    mma_bf16                  bf16        mma; d % 8 == 0                             mma tf32 + mma bf16
    mma_f16x3_ffma            fp32        mma; other head dims                        mma f16x3 + ffma fp32
    mma_tf32_ffma             tf32, bf16  mma; other head dims                        mma tf32 + ffma fp32
    wgmma_f16x3               fp32        wgmma; d = 32, N > 128, D != 128            mma f16x3 + wgmma f16x3
    wgmma_f16x3_persistent    fp32        wgmma; d = 32, N > 128, D = 128             persistent f16x3 + wgmma f16x3
    wgmma_f16                 tf32        wgmma; d = 32, N > 128, D != 128            mma f16 + wgmma f16
    wgmma_f16_persistent      tf32        wgmma; d = 32, N > 128, D = 128             persistent f16 + wgmma f16
    wgmma_bf16                bf16        wgmma; d = 32, 128 < N < 768, D != 128      mma f16 + wgmma bf16
    wgmma_bf16_persistent     bf16        wgmma; d = 32, 128 < N < 384, D = 128       persistent f16 + wgmma bf16
    wgmma_f16s                bf16        wgmma; d = 32, N >= 768, D != 128           mma f16 + wgmma f16s
    wgmma_f16s_persistent     bf16        wgmma; d = 32, N >= 768, D = 128, rows unaligned   mma f16 + wgmma f16s, out persistent
    wgmma_f16s_slots          bf16        wgmma; d = 32, N >= 384, D = 128            persistent f16 + wgmma f16s (slot rows)

A route is named engine_arithmetic: the engine (ARITHMETIC below for the words after it) is
what runs, the precision mode what the caller asks for. So the bf16 mode runs bf16
products on mma.sync but fp16 ones (f16, f16s) on wgmma, where q, k, v come scaled into
fp16's range. The "_persistent" routes run the persistent projections (project_wgmma.cu,
project_wgmma_split.cu: one block per SM, the weights resident) for the out projection,
and for the LayerNorm projection where the pair's rows are 16-byte aligned (it copies
whole rows); project_mma.cu otherwise. The forward reads a pair whose rows are not
contiguous and 16-byte aligned from an aligned copy (gpu/forward.py), so the bits never
depend on an array's address: the unaligned variants (wgmma_f16s_persistent, and the
"_persistent" routes' project_mma.cu projection) run only where a route is forced. Where
the weights' scores could leave fp16's range (scales.f16s_scales is None), the f16s
routes give way to the bf16 ones. `mma_tf32x3` (fp32: 3xTF32 attention) is taken by no
GPU: it stays as the accuracy oracle of the f16x3 attention (tests/test_attention_mma.py).
"""
from __future__ import annotations

import dataclasses
import functools

from . import gpus, layouts, tuned_tiles
from .checks import PAIR_DTYPES, check_precision
from .compile import KernelConfig
from .layouts import Layout
from .tiles import (ATTENTION_MMA_THREADS, ATTENTION_THREADS, MMA_STAGED,
                    SMALL_N, SMEM_LIMIT, PERSISTENT_PAIR_DIM, WGMMA_HEAD_DIMS, WGMMA_QUERIES,
                    WGMMA_VARIANTS, MmaTiles, WgmmaTiles, attention_mma_head_dims,
                    attention_mma_smem_bytes, attention_mma_tiles, attention_smem_bytes,
                    attention_tiles, attention_wgmma_smem_bytes, attention_wgmma_tiles,
                    project_pad, persistent_smem_bytes, persistent_split,
                    project_weight_stages)

WGMMA_ARCH = gpus.ARCH_SPECIFIC[gpus.WGMMA]  # the target its kernels compile for

# N above which head dim 32 takes the wgmma attention on compute capability 9.0, in every
# mode (faster from N = 129: TF32 1x384 / 1x1024 0.179 / 2.50 against 0.198 / 3.00 ms on
# mma.sync; fp32 1x160 0.265 against 0.278, 1x256 0.499 / 0.570; below N = 128 equal
# within noise).
WGMMA_ABOVE_N = SMALL_N
# The bf16 mode's f16s attention (S in fp16 accumulators) from these N: from
# F16S_SLOTS_FROM_N on the slot rows project_wgmma.cu writes (1x1024 2.87 -> 2.73 ms
# against the fp16 tiles' rows of 2D words, 1x384 0.294 -> 0.282 against the bf16
# attention), else from F16S_FROM_N (its projections cost more than its attention gains
# below: a cubic gain against a quadratic cost fitted to 1x384 and 1x1024 breaks even near
# N = 730).
F16S_FROM_N = 768
F16S_SLOTS_FROM_N = 384
# N from which a masked forward finds each batch's key extent, so that the attention's key
# loops stop at the last key tile any query keeps (exact: the tiles past it are masked for
# every query). Below it a trailing masked tile is too small a share to pay for the
# memset and the launch (2x128x64x4 is host-bound).
KEY_EXTENT_MIN_N = 512


# ---- kernel configurations ----

def pair_dtype_defines(pair_dtype: str) -> tuple[tuple[str, int], ...]:
    if pair_dtype not in PAIR_DTYPES:
        raise ValueError(f"pair_dtype must be one of {PAIR_DTYPES}; got {pair_dtype!r}")
    return () if pair_dtype == "float32" else (("PAIR_DTYPE", PAIR_DTYPES.index(pair_dtype)),)


def project_config(rows: int, engine: str, pair_dim: int, layout: Layout,
                   products: str = "tf32", pair_dtype: str = "float32") -> KernelConfig:
    """ln_qkvg_project / gated_out_project with `rows` per block: engine "ffma" (project_ffma.cu)
    or "mma" (project_mma.cu) with `products` "tf32", "f16" (one fp16 product of scaled
    operands, F16_TERMS 1) or "f16x3" (fp16 hi + lo, fp32-accurate: SPLIT, F16_TERMS 3),
    writing (and reading) `layout`, the pair read and the output written as `pair_dtype`."""
    config = _project_config(rows, engine, pair_dim, layout, products)
    return with_pair_dtype(config, pair_dtype)


def with_pair_dtype(config: KernelConfig, pair_dtype: str) -> KernelConfig:
    """A projection configuration reading the pair, and writing the output, as `pair_dtype`."""
    extra = pair_dtype_defines(pair_dtype)
    return config.with_defines(*extra)


# project_mma.cu F16_TERMS: the fp16 products per term of its products' arithmetic
F16_TERMS_NONE = 0   # TF32 products (no define emitted)
F16_TERMS_ONE = 1    # f16: one fp16 product of scaled operands (W's hi parts alone)
F16_TERMS_SPLIT = 3  # f16x3: hi hi, hi lo and lo hi of fp16 hi + lo operands (with SPLIT)
_F16_TERMS = {"tf32": F16_TERMS_NONE, "f16": F16_TERMS_ONE, "f16x3": F16_TERMS_SPLIT}


@functools.lru_cache(maxsize=None)  # per call: a look-up, not a rebuild
def _project_config(rows: int, engine: str, pair_dim: int, layout: Layout,
                    products: str) -> KernelConfig:
    mma = engine == "mma"
    split = mma and products == "f16x3"
    # 64-row blocks fit in 80 registers: 3 per SM where shared memory allows (D <= 128),
    # one wave instead of two for a small problem such as 2x128x64x4; but not with split
    # operands, which keep 2 per SM (fp16 hi + lo's ln_qkvg_project spills 4 bytes at 80
    # registers on sm_90).
    min_blocks = 3 if rows == 64 and not split else 2
    shape = (("BM", rows), ("WSTAGES", project_weight_stages(pair_dim, rows, mma)),
             *layout.defines(), ("PROJECT_MIN_BLOCKS", min_blocks))
    if mma:
        terms = _F16_TERMS[products]
        f16 = (("F16_TERMS", terms),) if terms != F16_TERMS_NONE else ()
        return KernelConfig("project_mma.cu", shape + (("SPLIT", int(split)),) + f16)
    return KernelConfig("project_ffma.cu", shape + (("PAD", project_pad(pair_dim)),))


def persistent_project_config(layout: Layout, pair_dtype: str = "float32") -> KernelConfig:
    """The persistent projections writing `layout` (project_wgmma_split.cu for the fp16
    hi + lo tiles, else project_wgmma.cu), the pair read and the output written as
    `pair_dtype`."""
    return with_pair_dtype(_persistent_project_config(layout), pair_dtype)


@functools.lru_cache(maxsize=None)
def _persistent_project_config(layout: Layout) -> KernelConfig:
    if persistent_split(layout):
        return KernelConfig("project_wgmma_split.cu", (("PAIR_DIM", PERSISTENT_PAIR_DIM),), WGMMA_ARCH)
    features = tuple(d for d in layout.defines() if d[0] in ("TILES_BF16", "SLOT_ROWS"))
    return KernelConfig("project_wgmma.cu", features + (("PAIR_DIM", PERSISTENT_PAIR_DIM),),
                        WGMMA_ARCH)


def out_transposed(config: KernelConfig) -> KernelConfig:
    """An out projection's `config` with OUT_TRANSPOSED, for the ending node: each row goes
    to the caller's layout (common.cuh caller_row); its kernels then take N last."""
    return config.with_defines(("OUT_TRANSPOSED", 1))


def persistent_fits(layout: Layout, pair_dim: int, smem_limit: int = SMEM_LIMIT) -> bool:
    """Whether the persistent projections serve `layout` at `pair_dim`: the tiled layouts
    at D = 128, where their weights fit in shared memory beside the tiles."""
    return (layout.tiled and pair_dim == PERSISTENT_PAIR_DIM
            and max(persistent_smem_bytes(layout, out) for out in (False, True)) <= smem_limit)


def attention_config(head_dim: int) -> KernelConfig:
    bq, bk = attention_tiles(head_dim)
    return KernelConfig("attention_ffma.cu", (("HEAD_DIM", head_dim), ("BQ", bq), ("BK", bk)))


def key_extent_config() -> KernelConfig:
    return KernelConfig("key_extent.cu", ())


ROW_MASK_THREADS = 256  # row_mask.cu THREADS


def row_mask_config() -> KernelConfig:
    """row_mask_pack: the row mask's key bits, for the attention's ROW_MASK."""
    return KernelConfig("row_mask.cu", ())


def row_masked(config: KernelConfig) -> KernelConfig:
    """An attention kernel's `config` with ROW_MASK (the row mask layout: key bits per row
    (b, i), common.cuh); its kernels then take the bits' pointer last. The same tiles
    and blocks per SM as without: the wgmma attentions read the bits from shared memory
    (row_mask_smem_bytes), which keeps their 80-register forms free of spills."""
    return config.with_defines(("ROW_MASK", 1))


def row_mask_smem_bytes(launch: "AttentionLaunch", npk: int) -> int:
    """Shared memory an attention launch adds under ROW_MASK: the wgmma attention keeps its
    rows' key bits there (attention_wgmma.cu ROW_MASK_OFFSET), npk / 8 bytes a row; the
    others read them from global memory."""
    if launch.config.filename != "attention_wgmma.cu":
        return 0
    return launch.rows * npk // 8


def row_blocked(config: KernelConfig) -> KernelConfig:
    """A LayerNorm projection's or an attention's `config` with ROW_BLOCK (row blocks:
    common.cuh; gpu/row_blocks.py): its kernels take the rows [row_begin, row_end) last."""
    return config.with_defines(("ROW_BLOCK", 1))


def bias_only(config: KernelConfig) -> KernelConfig:
    """A project_mma.cu or project_ffma.cu LayerNorm projection's `config` (with
    ROW_BLOCK) under BIAS_ONLY: the bias pass of row blocks, LayerNorm and the pair bias."""
    return config.with_defines(("BIAS_ONLY", 1))


def layernorm_bias_config(layout: Layout, pair_dim: int, num_heads: int,
                          pair_dtype: str = "float32") -> KernelConfig:
    """layernorm_bias_ffma.cu writing the pair bias as `layout` holds it, reading the pair
    as `pair_dtype`: the bias pass of row blocks for the persistent projections."""
    shape = (("PAIR_DIM", pair_dim), ("HEADS", num_heads), *layout.defines(),
             ("BIAS_STAGES", LAYERNORM_BIAS_STAGES))
    return with_pair_dtype(KernelConfig("layernorm_bias_ffma.cu", shape), pair_dtype)


def bias_pass_layout(layout: Layout) -> Layout:
    """The layout whose bias form the persistent projections' bias pass writes for theirs:
    the same bias tiles (tiles_f16_slots' are tiles_f16's)."""
    return {layouts.TILES_F16_SLOTS: layouts.TILES_F16}.get(layout, layout)


# layernorm_bias_ffma.cu's block and pipeline: 8 warps, each with BIAS_STAGES stages of
# its 32 lanes' pieces of a row (D / 8 elements per lane) in shared memory.
LAYERNORM_BIAS_THREADS = 256
LAYERNORM_BIAS_STAGES = 4


def layernorm_bias_smem_bytes(pair_dim: int, pair_dtype: str = "float32") -> int:
    """Dynamic shared memory of a layernorm_bias_ffma.cu block: 64 KiB in fp32 at D = 128."""
    itemsize = 4 if pair_dtype == "float32" else 2
    return LAYERNORM_BIAS_THREADS * LAYERNORM_BIAS_STAGES * (pair_dim // 8) * itemsize


@dataclasses.dataclass(frozen=True)
class AttentionLaunch:
    """One attention kernel and its launch shape: blocks of `threads` threads, each taking
    `queries` queries of `rows` pair rows of one head; it reads q, k, v and the bias as
    the projection stores them in `layout`; `operand_scales`: it scales q, k and v into
    fp16's range itself and takes the powers of two (s_q, s_k, s_v) of
    scales.f16x3_scales as its last arguments (attention_mma_f16x3)."""
    config: KernelConfig
    name: str
    queries: int
    rows: int
    threads: int
    smem: int
    layout: Layout = layouts.ROWS_FP32
    operand_scales: bool = False

    def blocks(self, B: int, N: int, H: int) -> int:
        return -(-N // self.queries) * H * B * -(-N // self.rows)


def attention_ffma_launch(head_dim: int) -> AttentionLaunch:
    return AttentionLaunch(attention_config(head_dim), "attention_ffma_fp32",
                           attention_tiles(head_dim)[0], 1, ATTENTION_THREADS,
                           attention_smem_bytes(head_dim))


# ---- attention on mma.sync (kernels/attention_mma.cu): entry point attention_mma_<variant>;
# "f16x3": the fp32 mode's split products in fp16 (twice TF32's rate); "tf32x3" (3xTF32)
# the oracle of its accuracy ----
ATTENTION_MMA_VARIANTS = ("tf32x3", "tf32", "bf16", "f16x3")
# attention_mma.cu PREC: the arithmetic of its entry point attention_mma_<arithmetic>
PREC_TF32X3, PREC_TF32, PREC_BF16, PREC_F16X3 = 0, 1, 2, 3
_MMA_PREC = {"tf32x3": PREC_TF32X3, "tf32": PREC_TF32, "bf16": PREC_BF16,
             "f16x3": PREC_F16X3}
# f16x3 reads what tf32x3 reads (fp32 q, k, v and bias) and scales them into fp16 itself
_MMA_LAYOUT = {"tf32x3": layouts.ROWS_FP32, "tf32": layouts.ROWS_TF32,
               "bf16": layouts.ROWS_BF16, "f16x3": layouts.ROWS_FP32}


def attention_mma_config(head_dim: int, variant: str, tiles: MmaTiles | None = None
                         ) -> KernelConfig:
    """The configuration whose entry point `attention_mma_<variant>` serves `head_dim`;
    variant "tf32x3" (fp32-accurate 3xTF32), "f16x3" (fp32-accurate, fp16 split
    products), "tf32" or "bf16"."""
    if variant not in ATTENTION_MMA_VARIANTS:
        raise ValueError(f"variant must be one of {ATTENTION_MMA_VARIANTS}; got {variant!r}")
    if head_dim not in attention_mma_head_dims(variant):
        raise ValueError(f"the tensor-core attention ({variant}) takes head dims "
                         f"{attention_mma_head_dims(variant)}; got {head_dim}")
    tiles = tiles or attention_mma_tiles(head_dim, variant)
    if variant in MMA_STAGED:  # staged through registers
        shape = (("PREFETCH", tiles.prefetch),)
    else:  # copied as stored, through the ring
        shape = (("STAGES", tiles.stages),)
    return KernelConfig("attention_mma.cu", (
        ("HEAD_DIM", head_dim), ("PREC", _MMA_PREC[variant]), ("BK", tiles.bk),
        ("MT", tiles.mt), ("ROWS", tiles.rows), *shape, ("MIN_BLOCKS", tiles.min_blocks)))


def attention_mma_launch(head_dim: int, variant: str, tiles: MmaTiles | None = None,
                         n: int = 1 << 30, compute_capability: int = 90) -> AttentionLaunch:
    tiles = tiles or attention_mma_tiles(head_dim, variant, n, compute_capability)
    return AttentionLaunch(attention_mma_config(head_dim, variant, tiles),
                           f"attention_mma_{variant}", tiles.queries, tiles.rows,
                           ATTENTION_MMA_THREADS,
                           attention_mma_smem_bytes(head_dim, variant, tiles),
                           _MMA_LAYOUT[variant], variant == "f16x3")


# ---- attention on warpgroup products (kernels/attention_wgmma.cu, sm_90a) ----
_WGMMA_LAYOUT = {"bf16": layouts.TILES_BF16, "f16x3": layouts.TILES_F16_HILO,
                 "f16": layouts.TILES_F16, "f16s": layouts.TILES_F16}
_WGMMA_DEFINES = {"bf16": (("BF16", 1),), "f16x3": (("F16X3", 1),), "f16": (("F16X1", 1),),
                  "f16s": (("F16X1", 1), ("S16", 1))}


def attention_wgmma_launch(head_dim: int = 32, tiles: WgmmaTiles | None = None,
                           variant: str = "bf16", slot_rows: bool = False) -> AttentionLaunch:
    """The attention on wgmma of `variant` (attention_wgmma_<variant>), reading its tiled
    layout: bf16 (tiles_bf16), f16x3 (tiles_f16_hilo), f16 and f16s (tiles_f16; f16s
    where `slot_rows` tiles_f16_slots, q in rows of D words)."""
    if variant not in WGMMA_VARIANTS:
        raise ValueError(f"variant must be one of {WGMMA_VARIANTS}; got {variant!r}")
    if head_dim not in WGMMA_HEAD_DIMS:
        raise ValueError(f"the wgmma attention takes head dims {WGMMA_HEAD_DIMS}; got {head_dim}")
    if slot_rows and variant != "f16s":
        raise ValueError(f"slot rows are read by the f16s variant only; got {variant!r}")
    t = tiles or attention_wgmma_tiles(variant)
    extra = _WGMMA_DEFINES[variant]
    if variant == "f16x3":
        extra = (("F16X3", 1), ("PV_GROUPS", t.pv_groups))
    layout = _WGMMA_LAYOUT[variant]
    if slot_rows:
        extra += (("SLOT_ROWS", 1),)
        layout = layouts.TILES_F16_SLOTS
    config = KernelConfig("attention_wgmma.cu", (
        ("HEAD_DIM", head_dim), ("ROWS", t.rows), ("STAGES", t.stages),
        ("MIN_BLOCKS", t.min_blocks)) + extra, WGMMA_ARCH)
    return AttentionLaunch(config, f"attention_wgmma_{variant}", WGMMA_QUERIES, t.rows,
                           256 * t.rows, attention_wgmma_smem_bytes(t, variant), layout)


# ---- routes ----

# What each arithmetic word of a route, a kernel entry point or Route.products means
ARITHMETIC = {
    "fp32": "fp32 FMA",
    "tf32": "TF32 products, fp32 sums",
    "tf32x3": "3xTF32: TF32 hi + lo products, fp32-accurate",
    "bf16": "bf16 products, fp32 sums",
    "f16": "fp16 products of operands scaled into fp16's range, fp32 sums",
    "f16x3": "fp16 hi + lo products of scaled operands, fp32-accurate",
    "f16s": "f16 with the scores summed in fp16 accumulators",
}


@dataclasses.dataclass(frozen=True)
class Route:
    """Every choice of a forward (the module docstring's table):

    project, out_project: the LayerNorm + q/k/v/gate/bias projection's and the gated out
        projection's engine: "ffma" (project_ffma.cu), "mma" (project_mma.cu) or
        "persistent" (the persistent projections, project_wgmma.cu / project_wgmma_split.cu);
    products: the projections' arithmetic (ARITHMETIC): "fp32", "tf32", "f16", "f16x3";
    attention: "ffma", "mma_<arithmetic>" or "wgmma_<arithmetic>" (attention_ffma.cu,
        attention_mma.cu, attention_wgmma.cu; as their entry points);
    layout: how the projection stores q, k, v, the gate and the bias (layouts.py);
    scales: the powers of two q, k, v and the bias come scaled by (DeviceWeights.qkv_scales:
        "f16x3", "f16_biased", "f16s"), or None;
    tile_table: the tile table (tuned_tiles.TABLES) that shapes the mma.sync attention;
    key_extent: each batch's last kept key found first (masked forwards from
        KEY_EXTENT_MIN_N)."""
    name: str
    project: str
    out_project: str
    products: str
    attention: str
    layout: Layout
    scales: str | None = None
    tile_table: str = "sm_90"
    key_extent: bool = False

    def attention_launch(self, head_dim: int, n: int) -> AttentionLaunch:
        """The attention kernel of this route for `head_dim` and `n` keys."""
        engine, _, variant = self.attention.partition("_")
        if engine == "ffma":
            return attention_ffma_launch(head_dim)
        if engine == "mma":
            return attention_mma_launch(head_dim, variant, n=n,
                                        tiles=tuned_tiles.mma_tiles(self.tile_table,
                                                                    head_dim, variant, n))
        return attention_wgmma_launch(head_dim, variant=variant,
                                      slot_rows=self.layout == layouts.TILES_F16_SLOTS)


@dataclasses.dataclass(frozen=True)
class RouteRow:
    """A row of the route table: the `precisions` it serves, the projections' `engine`
    ("ffma", "mma", "persistent": the LayerNorm projection "mma" where the pair's rows are
    unaligned) and arithmetic (`products`), the `attention`, the `layout` and `scales`
    (as Route's)."""
    precisions: tuple[str, ...]
    engine: str
    products: str
    attention: str
    layout: Layout
    scales: str | None = None

    @property
    def engines(self) -> tuple[str, ...]:
        """The GPU engines (gpus.py) the route's kernels need."""
        attention = self.attention.partition("_")[0]
        projection = gpus.WGMMA if self.engine == "persistent" else self.engine
        return tuple(dict.fromkeys((projection, attention)))


_ANY = ("fp32", "tf32", "bf16")
ROUTE_TABLE = {
    "ffma": RouteRow(_ANY, "ffma", "fp32", "ffma", layouts.ROWS_FP32),
    "mma_f16x3": RouteRow(("fp32",), "mma", "f16x3", "mma_f16x3", layouts.ROWS_FP32),
    "mma_tf32": RouteRow(("tf32",), "mma", "tf32", "mma_tf32", layouts.ROWS_TF32),
    "mma_bf16": RouteRow(("bf16",), "mma", "tf32", "mma_bf16", layouts.ROWS_BF16),
    "mma_f16x3_ffma": RouteRow(("fp32",), "mma", "f16x3", "ffma", layouts.ROWS_FP32),
    "mma_tf32_ffma": RouteRow(("tf32", "bf16"), "mma", "tf32", "ffma", layouts.ROWS_FP32),
    "wgmma_f16x3": RouteRow(("fp32",), "mma", "f16x3", "wgmma_f16x3",
                            layouts.TILES_F16_HILO, "f16x3"),
    "wgmma_f16x3_persistent": RouteRow(("fp32",), "persistent", "f16x3", "wgmma_f16x3",
                                       layouts.TILES_F16_HILO, "f16x3"),
    "wgmma_f16": RouteRow(("tf32",), "mma", "f16", "wgmma_f16", layouts.TILES_F16,
                          "f16_biased"),
    "wgmma_f16_persistent": RouteRow(("tf32",), "persistent", "f16", "wgmma_f16",
                                     layouts.TILES_F16, "f16_biased"),
    "wgmma_bf16": RouteRow(("bf16",), "mma", "f16", "wgmma_bf16", layouts.TILES_BF16),
    "wgmma_bf16_persistent": RouteRow(("bf16",), "persistent", "f16", "wgmma_bf16",
                                      layouts.TILES_BF16),
    "wgmma_f16s": RouteRow(("bf16",), "mma", "f16", "wgmma_f16s", layouts.TILES_F16, "f16s"),
    "wgmma_f16s_persistent": RouteRow(("bf16",), "persistent", "f16", "wgmma_f16s",
                                      layouts.TILES_F16, "f16s"),
    "wgmma_f16s_slots": RouteRow(("bf16",), "persistent", "f16", "wgmma_f16s",
                                 layouts.TILES_F16_SLOTS, "f16s"),
    # the accuracy oracle of the f16x3 attention, taken by no GPU
    "mma_tf32x3": RouteRow(("fp32",), "mma", "f16x3", "mma_tf32x3", layouts.ROWS_FP32),
}
ROUTES = tuple(ROUTE_TABLE)

# The attention arithmetic of each precision mode on each tensor-core engine
_MMA_ARITHMETIC = {"fp32": "f16x3", "tf32": "tf32", "bf16": "bf16"}
_WGMMA_ARITHMETIC = {"fp32": "f16x3", "tf32": "f16", "bf16": "bf16"}


def route_parts(name: str) -> dict:
    """The parts of the route `name` (ROUTES) as a dictionary, for tables and tools."""
    row = ROUTE_TABLE[name]
    return {"precisions": row.precisions, "project": row.engine, "out_project": row.engine,
            "products": row.products, "attention": row.attention, "layout": row.layout.name,
            "scales": row.scales}


def _default_route_name(precision: str, head_dim: int, pair_dim: int, n: int,
                        gpu: gpus.Gpu, rows_aligned: bool, smem_limit: int,
                        f16s_scales: bool) -> str:
    """The fastest route a GPU of row `gpu` takes (the module docstring)."""
    if not gpu.runs(gpus.MMA):
        return "ffma"
    if gpu.runs(gpus.WGMMA) and head_dim in WGMMA_HEAD_DIMS and n > WGMMA_ABOVE_N:
        variant = _WGMMA_ARITHMETIC[precision]
        # (slot rows: from project_wgmma.cu only, whose LayerNorm projection needs them aligned)
        slots = rows_aligned and persistent_fits(layouts.TILES_F16_SLOTS, pair_dim, smem_limit)
        if precision == "bf16" and f16s_scales and n >= (F16S_SLOTS_FROM_N if slots
                                                         else F16S_FROM_N):
            variant = "f16s"
        if attention_wgmma_launch(head_dim, variant=variant).smem <= smem_limit:
            if variant == "f16s" and slots:
                return "wgmma_f16s_slots"
            persistent = persistent_fits(_WGMMA_LAYOUT[variant], pair_dim, smem_limit)
            return f"wgmma_{variant}" + ("_persistent" if persistent else "")
    mma = _MMA_ARITHMETIC[precision]
    if head_dim in attention_mma_head_dims(mma):
        tiles = tuned_tiles.mma_tiles(gpu.tile_table, head_dim, mma, n)
        if attention_mma_smem_bytes(head_dim, mma, tiles) <= smem_limit:
            return f"mma_{mma}"
    return "mma_f16x3_ffma" if precision == "fp32" else "mma_tf32_ffma"


def choose_route(precision: str, head_dim: int, pair_dim: int, n: int,
                 compute_capability: int, *, rows_aligned: bool = True,
                 smem_limit: int = SMEM_LIMIT, f16s_scales: bool = True,
                 masked: bool = False, force: "Route | str | None" = None) -> Route:
    """The route of a forward: `precision`, head dim, pair dim D, N on a GPU of
    `compute_capability` (its row of gpus.GPUS) allowing `smem_limit` bytes of shared
    memory per block; rows_aligned: the pair's rows are contiguous and 16-byte aligned (the
    persistent LayerNorm projection copies whole rows); f16s_scales: the weights admit the
    f16s attention's scales (scales.f16s_scales); masked: a mask is given.
    `force`: a route name (ROUTES), optionally with "@" and a tile table (tuned_tiles.TABLES:
    "@sm_80"), or a Route to take instead of the fastest; a route the problem cannot take
    is a ValueError naming what is missing."""
    check_precision(precision)
    if isinstance(force, Route):
        return force
    gpu = gpus.gpu(compute_capability)
    tile_table, suffix = gpu.tile_table, ""
    if force is None:
        name = _default_route_name(precision, head_dim, pair_dim, n, gpu, rows_aligned,
                                   smem_limit, f16s_scales)
    elif isinstance(force, str):
        name, at, table = force.partition("@")
        if name not in ROUTE_TABLE or (at and table not in tuned_tiles.TABLES):
            tables = " or ".join(f"'@{t}'" for t in sorted(tuned_tiles.TABLES))
            raise ValueError(f"route must be a Route or one of {ROUTES}, optionally with "
                             f"{tables} (the mma attention's tile table); got {force!r}")
        _check_forced(name, precision, head_dim, pair_dim, gpu, smem_limit, f16s_scales)
        if at:
            tile_table, suffix = table, at + table
    else:
        raise TypeError(f"route must be a Route, a route name or None; got "
                        f"{type(force).__name__}")
    row = ROUTE_TABLE[name]
    project = "mma" if row.engine == "persistent" and not rows_aligned else row.engine
    if row.attention == "ffma" and attention_smem_bytes(head_dim) > smem_limit:
        raise ValueError(f"head dim {head_dim} needs {attention_smem_bytes(head_dim)} bytes of "
                         f"shared memory per block for the attention; this GPU allows "
                         f"{smem_limit}")
    return Route(name + suffix, project, row.engine, row.products, row.attention,
                 row.layout, row.scales, tile_table, masked and n >= KEY_EXTENT_MIN_N)


def route_for_attention(launch: AttentionLaunch, precision: str, pair_dim: int, n: int,
                        compute_capability: int, *, rows_aligned: bool = True,
                        smem_limit: int = SMEM_LIMIT, masked: bool = False) -> Route:
    """The route around a given attention `launch` (tile sweeps and tests of one kernel):
    the projections the default routes pair with its layout, in `precision`'s arithmetic."""
    check_precision(precision)
    gpu = gpus.gpu(compute_capability)
    attention = launch.name.removeprefix("attention_")  # engine_arithmetic
    if attention.startswith("ffma"):
        attention = "ffma"
    layout = launch.layout
    if not gpu.runs(gpus.MMA):
        project, products = "ffma", "fp32"
    else:
        project = "mma"
        products = "f16x3" if precision == "fp32" else "f16" if layout.tiled else "tf32"
    out_project = project
    if (project == "mma" and gpu.runs(gpus.WGMMA)
            and persistent_fits(layout, pair_dim, smem_limit)):
        out_project = "persistent"
        project = "persistent" if rows_aligned else "mma"
    scales = ("f16s" if attention == "wgmma_f16s"
              else {layouts.TILES_F16_HILO: "f16x3", layouts.TILES_F16: "f16_biased"}.get(layout))
    return Route(f"{project}+{attention}", project, out_project, products, attention, layout,
                 scales, gpu.tile_table, masked and n >= KEY_EXTENT_MIN_N)


def _check_forced(name, precision, head_dim, pair_dim, gpu: gpus.Gpu, smem_limit,
                  f16s_scales):
    row = ROUTE_TABLE[name]
    if precision not in row.precisions:
        raise ValueError(f"route {name!r} serves precision {' or '.join(row.precisions)}; "
                         f"got {precision!r}")
    engine, _, variant = row.attention.partition("_")
    capability = f"this GPU has {gpu.compute_capability / 10:.1f}"
    if engine != "ffma" and not gpu.runs(gpus.MMA):
        raise ValueError(f"route {name!r} needs compute capability 8.0 or newer (tensor "
                         f"cores); {capability}")
    if engine == "mma" and head_dim not in attention_mma_head_dims(variant):
        raise ValueError(f"route {name!r} takes head dims {attention_mma_head_dims(variant)}; "
                         f"got {head_dim}")
    if gpus.WGMMA in row.engines and not gpu.runs(gpus.WGMMA):
        raise ValueError(f"route {name!r} needs compute capability 9.0 (wgmma); {capability}")
    if engine == "wgmma" and head_dim not in WGMMA_HEAD_DIMS:
        raise ValueError(f"route {name!r} takes head dims {WGMMA_HEAD_DIMS}; got {head_dim}")
    if row.engine == "persistent" and not persistent_fits(row.layout, pair_dim, smem_limit):
        raise ValueError(f"route {name!r} needs pair_dim {PERSISTENT_PAIR_DIM} (the persistent "
                         f"projections); got {pair_dim}")
    if row.scales == "f16s" and not f16s_scales:
        raise ValueError(f"route {name!r} needs these weights' scores inside fp16's range "
                         f"(scales.f16s_scales: their bound passes 2^15 in log2 units)")


def attention_kernel(head_dim: int, precision: str, compute_capability: int = 90,
                     n: int = 1 << 30, smem_limit: int | None = None) -> AttentionLaunch:
    """The attention kernel the default route takes (for tables and tests), or a clear
    error where even the FFMA kernel's tiles do not fit."""
    limit = SMEM_LIMIT if smem_limit is None else smem_limit
    route = choose_route(precision, head_dim, PERSISTENT_PAIR_DIM, n, compute_capability,
                         smem_limit=limit)
    launch = route.attention_launch(head_dim, n)
    if launch.smem > limit:
        raise ValueError(f"head dim {head_dim} needs {launch.smem} bytes of shared memory per "
                         f"block for the attention; this GPU allows {limit}")
    return launch
