"""Kernel configurations: the `KernelConfig` (file and #defines) of every kernel a route
can launch, the features that change them (the pair's type, OUT_TRANSPOSED, ROW_MASK,
ROW_BLOCK, BIAS_ONLY) and the attention kernels' launch shapes (AttentionLaunch). Which
of them a forward takes is routes.choose_route's decision; launch_plan binds their
arguments."""
from __future__ import annotations

import dataclasses
import functools

from . import gpus, layouts
from .checks import PAIR_DTYPES
from .compile import KernelConfig
from .layouts import Layout
from .tiles import (ATTENTION_MMA_THREADS, ATTENTION_THREADS, MMA_STAGED, SMEM_LIMIT,
                    PERSISTENT_PAIR_DIM, WGMMA_HEAD_DIMS, WGMMA_QUERIES, WGMMA_VARIANTS,
                    MmaTiles, WgmmaTiles, attention_mma_head_dims, attention_mma_smem_bytes,
                    attention_mma_tiles, attention_smem_bytes, attention_tiles,
                    attention_wgmma_smem_bytes, attention_wgmma_tiles, persistent_smem_bytes,
                    persistent_split, project_pad, project_weight_stages)

WGMMA_ARCH = gpus.ARCH_SPECIFIC[gpus.WGMMA]  # the target the wgmma kernels compile for


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
WGMMA_LAYOUTS = {"bf16": layouts.TILES_BF16, "f16x3": layouts.TILES_F16_HILO,
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
    layout = WGMMA_LAYOUTS[variant]
    if slot_rows:
        extra += (("SLOT_ROWS", 1),)
        layout = layouts.TILES_F16_SLOTS
    config = KernelConfig("attention_wgmma.cu", (
        ("HEAD_DIM", head_dim), ("ROWS", t.rows), ("STAGES", t.stages),
        ("MIN_BLOCKS", t.min_blocks)) + extra, WGMMA_ARCH)
    return AttentionLaunch(config, f"attention_wgmma_{variant}", WGMMA_QUERIES, t.rows,
                           256 * t.rows, attention_wgmma_smem_bytes(t, variant), layout)
