"""The tuned tile tables: block shapes, pipeline stages and shared memory of every kernel, as
measured on an H200 within what compiles without spills for sm_80 and sm_90."""
from __future__ import annotations

import dataclasses
import functools

from .layouts import TILES_F16_HILO, Layout


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


SMEM_LIMIT = 227 * 1024  # dynamic shared memory a block may opt into on sm_80 / sm_90


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


TILES_PAIR_DIM = 128  # the pair dim they are written for (W in fp16: 128 KiB resident)


TILES_ROWS = 64       # rows (keys) per tile


TILES_THREADS = 512   # 4 warpgroups, one head each (project_wgmma.cu THREADS)


def project_tiles_split(layout: Layout) -> bool:
    """Whether the persistent projections writing `layout` split their products into fp16
    hi and lo parts (the fp32 mode's f16x3: project_wgmma_split.cu)."""
    return layout == TILES_F16_HILO


def project_tiles_smem_bytes(layout: Layout, out: bool = False) -> int:
    """The kernels' PROJECT_TILES_SMEM (ln_qkvg_project_wgmma) or OUT_TILES_SMEM (`out`),
    each + 1024 of alignment and 64 bytes of mbarriers. project_wgmma.cu: W [4 D][D] and WB
    [8][D] fp16, A [64][D] fp16, 2 stages of 64 rows of D floats, gamma and beta; the out
    projection Wo [D][D] fp16, A, 2 stages of 64 qkvg rows, the warps' maxima (64 bytes).
    project_wgmma_split.cu: W's hi and lo for two passes [4][D][D] fp16, A hi and lo, the 2
    stages; the out projection Wo's and A's hi and lo, the 2 stages, the maxima."""
    D = TILES_PAIR_DIM
    parts = 2 if project_tiles_split(layout) else 1  # hi and lo, or hi
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


def attention_mma_head_dims(variant: str = "bf16"):
    """Head dims the tensor-core kernel takes for `variant`: multiples of 8 whose tiles
    fit in registers without spills (bf16 up to 128, TF32 up to 120, 3xTF32 and f16x3 up
    to 64; wider head dims stay on the FFMA kernel)."""
    top = {"tf32x3": 64, "f16x3": 64, "tf32": 120}.get(variant, MAX_HEAD_DIM)
    return tuple(range(8, top + 1, 8))


# N at or below which the tile table takes its small-N shapes (all_configs compiles the
# shapes on both sides of it).
SMALL_N = 128


def attention_mma_tiles(head_dim: int, variant: str, n: int = 1 << 30,
                        compute_capability: int = 90) -> MmaTiles:
    """The tile shape for head dim `head_dim` and `n` keys on a GPU of `compute_capability`,
    measured on an H200 (docs/performance.md) within what compiles
    without spills for that architecture (tests/test_kernels_compile.py: sm_80 for 80-89,
    sm_90 from 90) and fits the shared memory."""
    if variant in MMA_STAGED:  # staged through registers
        # f16x3 (not yet measured: 3xTF32's shapes where they compile without spills):
        # its fp16 operands take fewer registers (q's hi and lo as many as q in fp32), so at
        # d <= 16 and small N it keeps the next tile in registers too (105-127 registers,
        # no spills; 3xTF32 spills there); at d = 24 on sm_90 3xTF32's shape spills 24-40
        # bytes in f16x3 too, so it drops the prefetch instead (125 registers).
        f16 = variant == "f16x3"
        if head_dim <= 32:
            if n <= SMALL_N and head_dim <= 16:  # (d = 24, 32 spill within 128 registers on sm_80;
                # d = 16 with the next tile in registers too)
                return MmaTiles(bk=32, prefetch=int(f16), min_blocks=2)
            # 2 rows x 2 m-tiles per warp at every N (one row was faster at N > 512, 10.8
            # against 11.8 ms at 1x1024, but spills since each k-step's P V terms are summed
            # in fragments of their own: docs/performance.md); d = 24 without
            # the next tile in registers, and sm_80 at d = 32 one m-tile: what fits in 255
            # registers there.
            if compute_capability >= 90 and head_dim == 24:
                # 2 blocks per SM, one row, the next tile in registers: 0.55 against 0.73 ms
                # at 1x384x96x4 and 0.080 against 0.094 at 1x160, though it spills 24-32 bytes
                # (tests/test_kernels_compile.py bounds them)
                return MmaTiles(bk=32, prefetch=int(not f16), min_blocks=2)
            if compute_capability < 90 and head_dim > 24:
                return MmaTiles(bk=32, mt=1, rows=2)
            return MmaTiles(bk=32, mt=2, rows=2, prefetch=0 if head_dim == 24 else 1)
        if head_dim <= 64:
            return MmaTiles(bk=16)
        raise ValueError(f"{variant} attention takes head dims up to 64; got {head_dim}")
    # TF32 and bf16: the cp.async ring; 2 blocks of 8 warps per SM where their registers fit
    if head_dim <= 16 and n <= SMALL_N:  # 3 blocks per SM (80 registers, 2-stage ring)
        return MmaTiles(bk=32, min_blocks=3, stages=2)
    if head_dim <= 32 and n > SMALL_N:
        if variant == "bf16":  # 2 rows share each bias tile, 2 m-tiles per warp
            # 32-key tiles where they fit in 128 registers: on sm_90 at d = 8, 16, 32
            # (1x1024: 3.40 -> 3.17 ms); d = 24 and sm_80 spill them: 16-key tiles there.
            wide = compute_capability >= 90 and head_dim in (8, 16, 32)
            return MmaTiles(bk=32 if wide else 16, mt=2, rows=2, min_blocks=2)
        return MmaTiles(bk=64, min_blocks=2, stages=2)
    if head_dim <= 48 or (head_dim <= 64 and variant == "bf16"):
        return MmaTiles(bk=32, min_blocks=2)
    if head_dim <= 64:
        return MmaTiles(bk=32)
    return MmaTiles(bk=16 if variant == "tf32" else 32)


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


@dataclasses.dataclass(frozen=True)
class WgmmaTiles:
    """The attention_wgmma.cu shape: ROWS pair rows per block (256 threads each, sharing
    the bias tiles), STAGES tiles in the ring, MIN_BLOCKS per SM asked of the compiler,
    PV_GROUPS (f16x3): fresh P V accumulators per key tile, each added to O in fp32; BULK
    (every variant): warp 0 fills the stages with bulk copies from the K and V^T tiles of
    a tiled layout, paced by mbarriers."""
    rows: int = 1
    stages: int = 2
    min_blocks: int = 2
    pv_groups: int = 2
    bulk: int = 1


def attention_wgmma_tiles(variant: str) -> WgmmaTiles:
    """One row per block, tiles by bulk copies (BULK): the fastest measured at 1x384 and
    1x1024 (3.14 against 3.49 ms with cp.async at 1x1024 in TF32). bf16 in three blocks per
    SM (2.50 against 2.61 ms at 1x1024 in two; with Q in shared memory, 78 registers and
    no spills: 2.08 ms). f16 (the tf32 mode's one fp16 product) as bf16 (2.26 against 2.70
    ms in 2 blocks per SM). f16x3 in two (101 KiB each)."""
    if variant not in WGMMA_VARIANTS:
        raise ValueError(f"the wgmma attention's variant must be one of {WGMMA_VARIANTS}; "
                         f"got {variant!r}")
    if variant == "bf16":  # 3 blocks per SM: 78 registers, no spills (Q_SHARED); faster
        return WgmmaTiles(bulk=1, min_blocks=3)  # at 1x1024 than 2
    if variant == "f16x3":  # 2 blocks per SM (101 KiB each), one fresh P V accumulator
        return WgmmaTiles(bulk=1, pv_groups=1)  # per tile: 123 registers, no spills
    if variant in ("f16", "f16s"):  # as bf16's (f16s: 80 registers, no spills)
        return WgmmaTiles(bulk=1, min_blocks=3)


def attention_wgmma_smem_bytes(tiles: WgmmaTiles, variant: str) -> int:
    """STAGES x (ROWS K tiles [64][32] 16-bit, ROWS V^T tiles of [40][64] 16-bit, a bias
    tile [128][64] fp16; f16x3: each twice, hi and lo), and 1024 bytes to align the start;
    bf16, f16 and f16s (WGMMA_Q_SHARED) also a Q tile [64][32] 16-bit per warpgroup,
    1024-aligned after the mbarriers."""
    element = 2
    parts = 2 if variant == "f16x3" else 1  # hi and lo (f16x3: every tile)
    k_tile = tiles.rows * WGMMA_KEYS * 32 * element
    k_vt = k_tile + tiles.rows * 40 * WGMMA_KEYS * element
    bias_row = WGMMA_KEYS if tiles.bulk else WGMMA_KEYS + 8  # BULK: the swizzled tile as is
    bias_element = 2  # fp16
    stage = (parts * k_vt
             + (2 if variant == "f16x3" else 1) * bias_element * WGMMA_QUERIES * bias_row)
    if variant in WGMMA_Q_SHARED:  # the mbarriers' 1024 bytes, then a Q tile [64][32]
        return tiles.stages * stage + 1024 + tiles.rows * 2 * 64 * 32 * 2 + 1024  # per warpgroup
    return tiles.stages * (stage + 16 * tiles.bulk) + 1024  # BULK: 2 mbarriers per stage
