"""Block shapes, pipeline stages and shared memory of every kernel: the projections' rows
and stages, the attentions' tiles (read from tuned_tiles.py, the tables per GPU) and the
shared memory each shape takes."""
from __future__ import annotations

import functools

from . import gpus, tuned_tiles
from .layouts import TILES_F16_HILO, Layout
from .tuned_tiles import MmaTiles, WgmmaTiles


MAX_HEAD_DIM = 128


MAX_PAIR_DIM = 768  # the row tile of D floats x 64 rows must fit in shared memory


PROJECT_THREADS = 256


ATTENTION_THREADS = 128


_PROJECT_BK, _PROJECT_BN = 16, 128


# project_mma.cu streams W [NO, D] in chunks of BN output rows x BK inputs, pass by pass
# (BN columns of the output) and chunk by chunk along D, each chunk one contiguous block
PROJECT_MMA_CHUNK = (_PROJECT_BN, _PROJECT_BK)


# F16_TERMS 1 streams W's fp16 hi parts alone: twice the inputs in the same 8 KiB chunk
# (project_mma.cu RING_K; the pair dim a multiple of it)
PROJECT_MMA_HI_CHUNK = (_PROJECT_BN, 2 * _PROJECT_BK)


BIAS_KEY_ALIGN = 64  # the bias's key axis is padded to a multiple of every kernel's key tile


def project_rows(pair_dim: int, rows_total: int = 1 << 62, sm_count: int = 132,
                 smem_limit: int | None = None, tensor_cores: bool = False) -> int:
    """Rows per block: 128, or 64 when a 128-row tile of D floats would not fit in shared
    memory (SMEM_LIMIT, or the GPU's smaller `smem_limit`), or when 128-row blocks would
    leave SMs idle: with fewer than one per SM (tensor cores), or ~4 per SM (FFMA).
    Measured on the H200: the
    tensor-core kernel at 2x128x64x4 (256 blocks of 128 rows) 0.055 -> 0.040 ms with 128
    rows; at 1x64x128x4 (32 blocks) 0.040 against 0.050 with 64."""
    per_sm = 1 if tensor_cores else 4
    if pair_dim > 320 or rows_total < per_sm * 128 * sm_count:
        return 64
    if smem_limit is not None and project_smem_bytes(pair_dim, 128) > smem_limit:
        return 64
    return 128


def out_project_rows(rows_total: int = 1 << 62, sm_count: int = 132,
                     tensor_cores: bool = True) -> int:
    """Rows per block of the out projection (project_mma.cu, project_ffma.cu): 64, or 128
    on tensor cores where 128-row blocks are one wave (2 per SM) and 64-row ones are not
    (3 per SM). Its blocks are bound by loading o and g (the products are one pass at D =
    128): at large sizes 3 blocks of 64 rows per SM overlap those loads better than 2 of
    128, 0.94 -> 0.84 ms at 1x1024x128x4 TF32; at small ones the second wave's tail
    decides, 2x128x64x4 (32,768 rows) replayed from a CUDA graph 78.7 / 64.7 / 64.0 ->
    76.8 / 61.6 / 62.1 µs (fp32 / tf32 / bf16) with 128 (docs/performance.md)."""
    one_wave_of_128 = -(-rows_total // 128) <= 2 * sm_count
    one_wave_of_64 = -(-rows_total // 64) <= 3 * sm_count
    return 128 if tensor_cores and one_wave_of_128 and not one_wave_of_64 else 64


def project_pad(pair_dim: int) -> int:
    """Row padding of project_ffma.cu's k-major tiles: 8 words, or 4 where the 64-row tile of a
    wide D would not fit otherwise (the FFMA float4 reads are conflict-free with either)."""
    return 8 if pair_dim <= 640 else 4


# The most dynamic shared memory a block may opt into on any GPU of the table (sm_90's
# 227 KiB): what the projections' stages are sized for
SMEM_LIMIT = max(gpu.smem_optin for gpu in gpus.GPUS.values())


def _project_smem(pair_dim: int, bm: int, weight_stages: int, tensor_cores: bool) -> int:
    """project_ffma.cu: rowoff (8 per row), As [DPAD][BM+PAD], Ws [WSTAGES][BK][BN+PAD],
    red [THREADS]; project_mma.cu: rowoff, As [BM][DPAD+4], Ws [WSTAGES][BN][BK] (rows
    swizzled, unpadded), cbias [2][BN]."""
    dpad = -(-pair_dim // _PROJECT_BK) * _PROJECT_BK
    if tensor_cores:
        return 8 * bm + 4 * (bm * (dpad + 4) + weight_stages * _PROJECT_BN * _PROJECT_BK
                             + 2 * _PROJECT_BN)
    pad = project_pad(pair_dim)
    return 8 * bm + 4 * (dpad * (bm + pad) + weight_stages * _PROJECT_BK * (_PROJECT_BN + pad)
                         + PROJECT_THREADS)


def project_weight_stages(pair_dim: int, bm: int, tensor_cores: bool = False) -> int:
    """Weight chunks in the projection's cp.async ring: 4, or 2 where the row tile of a
    wide D leaves no room for more."""
    return 4 if _project_smem(pair_dim, bm, 4, tensor_cores) <= SMEM_LIMIT else 2


@functools.lru_cache(maxsize=None)  # per call: a look-up, not a rebuild
def project_smem_bytes(pair_dim: int, bm: int, tensor_cores: bool | None = None) -> int:
    """Dynamic shared memory of a projection block; tensor_cores None: the larger of the
    two kernels' (what a GPU must allow for every precision)."""
    if tensor_cores is None:
        return max(project_smem_bytes(pair_dim, bm, mma) for mma in (False, True))
    return _project_smem(pair_dim, bm, project_weight_stages(pair_dim, bm, tensor_cores),
                         tensor_cores)


PERSISTENT_PAIR_DIM = 128  # the pair dim they are written for (W in fp16: 128 KiB resident)


PERSISTENT_ROWS = 64       # rows (keys) per tile


PERSISTENT_THREADS = 512   # 4 warpgroups, one head each (project_wgmma.cu THREADS)


def persistent_split(layout: Layout) -> bool:
    """Whether the persistent projections writing `layout` split their products into fp16
    hi and lo parts (the fp32 mode's f16x3: project_wgmma_split.cu)."""
    return layout == TILES_F16_HILO


def persistent_smem_bytes(layout: Layout, out: bool = False) -> int:
    """The kernels' PROJECT_TILES_SMEM (ln_qkvg_project_wgmma) or OUT_TILES_SMEM (`out`),
    each + 1024 of alignment and 64 bytes of mbarriers. project_wgmma.cu: W [4 D][D] and WB
    [8][D] fp16, A [64][D] fp16, 2 stages of 64 rows of D floats, gamma and beta; the out
    projection Wo [D][D] fp16, A, 2 stages of 64 qkvg rows, the warps' maxima (64 bytes).
    project_wgmma_split.cu: W's hi and lo for two passes [4][D][D] fp16, A hi and lo, the 2
    stages; the out projection Wo's and A's hi and lo, the 2 stages, the maxima."""
    D = PERSISTENT_PAIR_DIM
    parts = 2 if persistent_split(layout) else 1  # hi and lo, or hi
    a = parts * 64 * D * 2
    if out:
        row_words = D if layout.slot_rows else 2 * D
        return parts * D * D * 2 + a + 2 * 64 * row_words * 4 + 64 + 64 + 1024
    wb_gb = 0 if parts == 2 else 8 * D * 2 + 8 * D  # project_wgmma.cu's WB and GB
    return 4 * D * D * 2 + a + 2 * 64 * D * 4 + wb_gb + 64 + 1024


def attention_tiles(head_dim: int) -> tuple[int, int]:
    """(BQ, BK): the largest tiles whose accumulators stay in registers (no spills)."""
    if head_dim <= 32:
        return 128, 64
    if head_dim <= 64:
        return 64, 64
    return 64, 32


def attention_smem_bytes(head_dim: int) -> int:
    bq, bk = attention_tiles(head_dim)
    dv = -(-head_dim // 32) * 32
    return 4 * (head_dim * (bq + bk) + bk * dv + bk * (bq + 4))


ATTENTION_MMA_THREADS = 256  # 8 warps


# The variants staged through registers (split into hi and lo parts as they are stored),
# which take PREFETCH; the others copy k and v as stored through a ring of STAGES.
MMA_STAGED = ("tf32x3", "f16x3")


def attention_mma_head_dims(variant: str = "bf16"):
    """Head dims the tensor-core kernel takes for `variant`: multiples of 8 whose tiles
    fit in registers without spills (bf16 up to 128, TF32 up to 120, 3xTF32 and f16x3 up
    to 64; wider head dims stay on the FFMA kernel)."""
    top = {"tf32x3": 64, "f16x3": 64, "tf32": 120}.get(variant, MAX_HEAD_DIM)
    return tuple(range(8, top + 1, 8))


def attention_mma_tiles(head_dim: int, variant: str, n: int = 1 << 30,
                        compute_capability: int = 90) -> MmaTiles:
    """The tile shape for head dim `head_dim` and `n` keys on a GPU of `compute_capability`:
    its tile table's (gpus.Gpu.tile_table, tuned_tiles.TABLES)."""
    return tuned_tiles.mma_tiles(gpus.gpu(compute_capability).tile_table, head_dim,
                                 variant, n)


def attention_mma_smem_bytes(head_dim: int, variant: str, tiles: MmaTiles | None = None
                             ) -> int:
    """3xTF32: per row K [BK][d+4] and V^T [d][BK+4] tf32 words, hi and lo; then two bias
    tiles [BQ][BK+8] fp32. f16x3: the same with K and V [BK][d+8] fp16, hi and lo.
    TF32 / bf16: STAGES x (per row K and V [BK][d+4] words or [BK][d+8] halves, one bias
    tile, fp16 in bf16 mode)."""
    t = tiles or attention_mma_tiles(head_dim, variant)
    bias_tile = (2 if variant == "bf16" else 4) * t.queries * (t.bk + 8)  # fp16 in bf16 mode
    if variant in MMA_STAGED:
        if variant == "f16x3":
            per_row = 2 * 2 * 2 * t.bk * (head_dim + 8)
        else:
            per_row = 2 * 4 * (t.bk * (head_dim + 4) + head_dim * (t.bk + 4))
        return t.rows * per_row + 2 * bias_tile
    per_row = 4 * t.bk * (head_dim + 8) if variant == "bf16" else 8 * t.bk * (head_dim + 4)
    return t.stages * (t.rows * per_row + bias_tile)


KEY_EXTENT_THREADS = 256


def key_extent_chunks(N: int) -> int:
    """Blocks per batch: ~16 mask elements per thread, at most 512 blocks (one atomic each)."""
    return max(1, min(512, -(-N * N // (16 * KEY_EXTENT_THREADS))))


WGMMA_HEAD_DIMS = (32,)


WGMMA_QUERIES, WGMMA_KEYS = 128, 64  # BQ and BK of a block


# The wgmma attention's variants (entry points attention_<variant>_wgmma): bf16 operands,
# fp16 hi + lo (f16x3, the fp32 mode), one fp16 product (f16, the tf32 mode), and f16 with
# S in fp16 accumulators (f16s, the bf16 mode from the N where it is faster)
WGMMA_VARIANTS = ("bf16", "f16x3", "f16", "f16s")


# The variants whose Q K^T reads Q from shared memory (attention_wgmma.cu Q_SHARED)
WGMMA_Q_SHARED = ("bf16", "f16", "f16s")


def attention_wgmma_tiles(variant: str) -> WgmmaTiles:
    """The wgmma attention's tiles of `variant` (tuned_tiles.TABLES["sm_90"])."""
    if variant not in WGMMA_VARIANTS:
        raise ValueError(f"the wgmma attention's variant must be one of {WGMMA_VARIANTS}; "
                         f"got {variant!r}")
    return tuned_tiles.wgmma_tiles(gpus.gpu(90).tile_table, variant)


def attention_wgmma_smem_bytes(tiles: WgmmaTiles, variant: str) -> int:
    """STAGES x (ROWS K tiles [64][32] 16-bit, ROWS V^T tiles of [40][64] 16-bit, a bias
    tile [128][64] fp16; f16x3: each twice, hi and lo), and 1024 bytes to align the start;
    bf16, f16 and f16s (WGMMA_Q_SHARED) also a Q tile [64][32] 16-bit per warpgroup,
    1024-aligned after the mbarriers."""
    element = 2
    parts = 2 if variant == "f16x3" else 1  # hi and lo (f16x3: every tile)
    k_tile = tiles.rows * WGMMA_KEYS * 32 * element
    k_vt = k_tile + tiles.rows * 40 * WGMMA_KEYS * element
    bias_row = WGMMA_KEYS  # the swizzled tile as the bulk copy brings it
    bias_element = 2  # fp16
    stage = (parts * k_vt
             + (2 if variant == "f16x3" else 1) * bias_element * WGMMA_QUERIES * bias_row)
    if variant in WGMMA_Q_SHARED:  # the mbarriers' 1024 bytes, then a Q tile [64][32]
        return tiles.stages * stage + 1024 + tiles.rows * 2 * 64 * 32 * 2 + 1024  # per warpgroup
    return tiles.stages * (stage + 16) + 1024  # 2 mbarriers per stage
