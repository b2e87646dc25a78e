"""Which kernel configuration (source file, #defines, launch shape) serves which problem.

One table for the run-time launches and the offline compile checks, so CI compiles
exactly the configurations that run.
"""
from __future__ import annotations

import dataclasses
import functools
import os

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


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    filename: str
    defines: tuple[tuple[str, int], ...]
    arch: str = ""  # a target other than the device's plain one (_compile.raw_module)

    def get(self, name: str, smem_bytes: int = 0):
        """The kernel `name`, allowed `smem_bytes` of dynamic shared memory (compiled on the
        current device at first use; cached, so the per-call cost is a dictionary look-up)."""
        return _kernel(self, name, smem_bytes, _current_device())


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


_smem_allowed: dict = {}  # (config, name, device) -> dynamic shared memory opted in so far


def _kernel(config: KernelConfig, name: str, smem_bytes: int, device: int):
    kernel = _function(config, name, device)
    key = (config, name, device)
    # One function object serves every problem size of its configuration: only ever raise
    # its limit, so a smaller request cannot break a larger one cached earlier.
    if smem_bytes > max(_smem_allowed.get(key, 0), 48 * 1024):
        kernel.max_dynamic_shared_size_bytes = smem_bytes  # opt in above the 48 KiB default
        _smem_allowed[key] = smem_bytes
    return kernel


@functools.lru_cache(maxsize=None)
def _function(config: KernelConfig, name: str, device: int):
    from ._compile import raw_module

    return raw_module(config.filename, config.defines, config.arch).get_function(name)


def forget_compiled_kernels():
    """Drop every loaded module and kernel handle, so that the next launch compiles from
    the kernel source again (scripts/ablate_*.py patch the source between runs)."""
    from ._compile import raw_module

    raw_module.cache_clear()
    _function.cache_clear()
    _smem_allowed.clear()


def supported_head_dims():
    return tuple(range(4, MAX_HEAD_DIM + 1, 4))


def check_dims(pair_dim: int, num_heads: int):
    d = pair_dim // num_heads
    if d % 4 or d > MAX_HEAD_DIM:
        raise ValueError(
            f"head dimension pair_dim/num_heads must be a multiple of 4 and at most "
            f"{MAX_HEAD_DIM} on the GPU; got {pair_dim}/{num_heads} = {d}")
    if pair_dim > MAX_PAIR_DIM:
        raise ValueError(f"pair_dim must be at most {MAX_PAIR_DIM} on the GPU; got {pair_dim}")


# ---- projections (kernels/project.cu) ----

def project_rows(pair_dim: int, rows_total: int = 1 << 62, sm_count: int = 132,
                 smem_limit: int | None = None, tensor_cores: bool = False) -> int:
    """Rows per block: 128, or 64 when a 128-row tile of D floats would not fit in shared
    memory (SMEM_LIMIT, or the GPU's smaller `smem_limit`), or when 128-row blocks would
    leave SMs idle: with fewer than one per SM (tensor cores), or ~4 per SM (FFMA).
    Measured on the H200 (`scripts/ablate_projection.py --variants rows64,rows128`): the
    tensor-core kernel at 2x128x64x4 (256 blocks of 128 rows) 0.055 -> 0.040 ms with 128
    rows; at 1x64x128x4 (32 blocks) 0.040 against 0.050 with 64."""
    per_sm = 1 if tensor_cores else 4
    if pair_dim > 320 or rows_total < per_sm * 128 * sm_count:
        return 64
    if smem_limit is not None and project_smem_bytes(pair_dim, 128) > smem_limit:
        return 64
    return 128


def check_projection_fits(pair_dim: int, smem_limit: int, gpu: str = "this GPU"):
    """A clear error where even 64-row projection blocks need more shared memory than the
    GPU lets a block have (MaxSharedMemoryPerBlockOptin: 227 KiB on sm_90, 163 KiB on
    sm_80, 99 KiB on sm_86/89)."""
    need = project_smem_bytes(pair_dim, 64)
    if need > smem_limit:
        fits = max((D for D in range(4, MAX_PAIR_DIM + 1, 4)
                    if project_smem_bytes(D, 64) <= smem_limit), default=0)
        raise ValueError(f"pair_dim {pair_dim} needs {need} bytes of shared memory per block "
                         f"for the projections; {gpu} allows {smem_limit} "
                         f"(pair_dim up to {fits} fits)")


def out_project_rows() -> int:
    """Rows per block of the out projection: 64 at every size. Its blocks are bound by
    loading o and g (the products are one pass at D = 128), and 3 blocks per SM overlap
    those loads better than 2 of 128 rows: 0.94 -> 0.84 ms at 1x1024x128x4 TF32
    (scripts/ablate_projection.py, benchmarks/NOTES.md)."""
    return 64


def project_pad(pair_dim: int) -> int:
    """Row padding of project.cu's k-major tiles: 8 words, or 4 where the 64-row tile of a
    wide D would not fit otherwise (the FFMA float4 reads are conflict-free with either)."""
    return 8 if pair_dim <= 640 else 4


# How the projection stores k and v (project_epilogue.cuh KV_FORMAT): as computed (fp32),
# rounded to TF32, packed bf16 (with the pair bias in fp16), or TF32 with v transposed
# into tiles of its own and the pair bias in fp16 (the TF32 wgmma attention's); the
# attention kernel that reads them names its format.
KV_FP32, KV_TF32, KV_BF16, KV_TF32_VT = 0, 1, 2, 3
KV_TF32_TILES = 5  # as KV_TF32_VT, k as tiles beside the V^T ones (the BULK wgmma attention)
KV_BF16_TILES = 6  # the same tiles in bf16, q and the gate packed bf16 (the bf16 wgmma attention)
# the tiles, q and the pair bias as fp16 hi + lo pairs, q, k, v scaled into fp16's range
# (the fp32 mode's wgmma attention, f16x3)
KV_F16X3_TILES = 7
# the hi parts alone: KV_BF16_TILES's tiles in fp16, q, k, v scaled as KV_F16X3_TILES's (the
# tf32 mode's wgmma attention, f16)
KV_F16_TILES = 8
# KV_F16_TILES's tiles, q and bias in KV_BF16_TILES's rows of D words: q's fp16 words and the
# gate's bf16 ones in each head's slot (the bf16 mode's f16s attention, from project_tiles.cu
# only: the gate in half of format 8's bytes)
KV_F16S_TILES = 9
# q, k, v scaled into fp16 (rows of 2D words, but D for KV_F16S_TILES)
KV_F16_FORMATS = (KV_F16X3_TILES, KV_F16_TILES, KV_F16S_TILES)
KV_BULK_FORMATS = (KV_TF32_TILES, KV_BF16_TILES, *KV_F16_FORMATS)  # k, v and the pair bias in tiles
# the attention writes o in 16 bits (bf16; fp16 in v's units) over each head's first 16
# words (attention_wgmma.cu, project_epilogue.cuh O16)
KV_O16_FORMATS = (KV_BF16_TILES, KV_F16_TILES, KV_F16S_TILES)
# rows of D words: q (then o) and the gate in each head's 32-word slot
KV_SLOT_FORMATS = (KV_BF16_TILES, KV_F16S_TILES)
KV_TILED_FORMATS = (KV_TF32_VT, *KV_BULK_FORMATS)  # v (at least) in tiles


def project_config(rows: int, tensor_cores: bool = False, pair_dim: int = 128,
                   kv_format: int = KV_FP32, split: bool = False,
                   f16_split: bool | None = None) -> KernelConfig:
    """rows per block; tensor_cores: mma.sync products (project_mma.cu), TF32, or
    fp32-accurate split products where `split`, on fp16 operands where project_f16_terms
    says so (F16_TERMS; `f16_split`: as there); else FFMA (project.cu); kv_format: how k
    and v are stored, for the attention kernel (KV_*)."""
    terms = project_f16_terms(kv_format, split, f16_split) if tensor_cores else 0
    return _project_config(rows, tensor_cores, pair_dim, kv_format, split, terms)


@functools.lru_cache(maxsize=None)  # per call: a look-up, not a rebuild
def _project_config(rows: int, tensor_cores: bool, pair_dim: int, kv_format: int,
                    split: bool, terms: int) -> KernelConfig:
    # 64-row blocks fit in 80 registers: 3 per SM where shared memory allows (D <= 128),
    # one wave instead of two for a small problem such as 2x128x64x4; but not with split
    # operands, which keep 2 per SM (at 80 registers 3xTF32's out projection spilled 4
    # bytes, and fp16 hi + lo's ln_qkvg_project spills 4 on sm_90; its gated_out_project
    # does not: 3 per SM there is untried, session 18).
    min_blocks = 3 if rows == 64 and not (tensor_cores and split) else 2
    shape = (("BM", rows), ("WSTAGES", project_weight_stages(pair_dim, rows, tensor_cores)),
             ("KV_FORMAT", kv_format), ("PROJECT_MIN_BLOCKS", min_blocks))
    if tensor_cores:
        f16 = (("F16_TERMS", terms),) if terms else ()
        return KernelConfig("project_mma.cu", shape + (("SPLIT", int(split)),) + f16)
    return KernelConfig("project.cu", shape + (("PAD", project_pad(pair_dim)),))


def project_uses_tensor_cores(precision: str, compute_capability: int = 90) -> bool:
    """Tensor cores on sm_80 and newer in every mode: TF32 products for tf32 and bf16 (their
    error, ~1e-4, is inside both modes' bounds), split products for fp32 (project_splits:
    fp16 hi + lo, project_f16_terms); FFMA before sm_80."""
    check_precision(precision)
    return compute_capability >= 80


def project_splits(precision: str) -> bool:
    """Whether the tensor-core projections split their operands (fp16 hi + lo, or 3xTF32):
    in fp32 mode."""
    return precision == "fp32"


# TRIATTN_PROJECT_F16_SPLIT=0 gives the fp32 mode's mma.sync projections 3xTF32 products
# again wherever they took them before session 18 (every format but KV_F16X3_TILES, whose
# have been fp16 hi + lo since session 11): read at import; A/B timings and the GPU tests
# of the two set it between plans (project_config takes it per call).
PROJECT_F16_SPLIT = os.environ.get("TRIATTN_PROJECT_F16_SPLIT", "1") != "0"


def project_f16_terms(kv_format: int, split: bool, f16_split: bool | None = None) -> int:
    """The tensor-core projections' products on scaled fp16 operands (project_mma.cu
    F16_TERMS; DeviceWeights.f16_scales), half the instructions of TF32's: 3 (hi*lo + lo*hi
    + hi*hi, fp32-accurate: half the mma.sync instructions of 3xTF32's and no split in the
    loop) for every format of the fp32 mode (`split`); 1 (hi*hi, TF32's 11 bits) for the
    tf32 and bf16 wgmma attentions' bulk tiles (KV_F16_TILES, KV_BF16_TILES, and the TF32
    wgmma kernel's KV_TF32_TILES); 0 (TF32) elsewhere. `f16_split` False (None:
    PROJECT_F16_SPLIT) keeps 3xTF32 (0) for the split formats but KV_F16X3_TILES."""
    if split:
        if kv_format == KV_F16X3_TILES:
            return 3
        return 3 if (PROJECT_F16_SPLIT if f16_split is None else f16_split) else 0
    return 1 if kv_format in (KV_TF32_TILES, KV_BF16_TILES, KV_F16_TILES, KV_F16S_TILES) else 0


SMEM_LIMIT = 227 * 1024  # dynamic shared memory a block may opt into on sm_80 / sm_90


def _project_smem(pair_dim: int, bm: int, weight_stages: int, tensor_cores: bool) -> int:
    """project.cu: rowoff (8 per row), As [DPAD][BM+PAD], Ws [WSTAGES][BK][BN+PAD],
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


# ---- the persistent projections of the wgmma path (kernels/project_tiles.cu: tf32, bf16;
# kernels/project_tiles_split.cu: fp32) ----

TILES_PAIR_DIM = 128  # the pair dim they are written for (W in fp16: 128 KiB resident)
# TRIATTN_PROJECT_TILES=0 keeps project_mma.cu's projections everywhere (read at import;
# scripts/tiles_probe.py and the A/B timings flip it between plans)
PROJECT_TILES = os.environ.get("TRIATTN_PROJECT_TILES", "1") != "0"
TILES_ROWS = 64       # rows (keys) per tile
TILES_THREADS = 512   # 4 warpgroups, one head each (project_tiles.cu THREADS)
_TILES_FORMATS = (KV_BF16_TILES, KV_F16_TILES, KV_F16X3_TILES, KV_F16S_TILES)


def uses_project_tiles(kv_format: int, pair_dim: int, compute_capability: int,
                       smem_limit: int = SMEM_LIMIT) -> bool:
    """Whether the out projection, and (where the pair's rows allow: Plan) the LayerNorm +
    q/k/v/gate projection, take the persistent projections instead of project_mma.cu:
    every mode on the wgmma attention (compute capability 9.0, head dim 32: KV_F16_TILES,
    KV_BF16_TILES in project_tiles.cu, the fp32 mode's KV_F16X3_TILES in
    project_tiles_split.cu) at D = 128, where their weights fit in shared memory beside
    the tiles."""
    return (PROJECT_TILES and kv_format in _TILES_FORMATS and pair_dim == TILES_PAIR_DIM
            and compute_capability == 90
            and max(project_tiles_smem_bytes(kv_format, out) for out in (False, True)) <= smem_limit)


def project_tiles_split(kv_format: int) -> bool:
    """Whether the persistent projections of `kv_format` split their products into fp16 hi
    and lo parts (the fp32 mode's f16x3: project_tiles_split.cu)."""
    return kv_format == KV_F16X3_TILES


@functools.lru_cache(maxsize=None)
def project_tiles_config(kv_format: int) -> KernelConfig:
    if project_tiles_split(kv_format):
        return KernelConfig("project_tiles_split.cu", (("PAIR_DIM", TILES_PAIR_DIM),), WGMMA_ARCH)
    return KernelConfig("project_tiles.cu", (("KV_FORMAT", kv_format),
                                             ("PAIR_DIM", TILES_PAIR_DIM)), WGMMA_ARCH)


def project_tiles_smem_bytes(kv_format: int, out: bool = False) -> int:
    """The kernels' PROJECT_TILES_SMEM (ln_qkvg_project_tiles) or OUT_TILES_SMEM (`out`),
    each + 1024 of alignment and 64 bytes of mbarriers. project_tiles.cu: W [4 D][D] and WB
    [8][D] fp16, A [64][D] fp16, 2 stages of 64 rows of D floats, gamma and beta; the out
    projection Wo [D][D] fp16, A, 2 stages of 64 qkvg rows, the warps' maxima (64 bytes).
    project_tiles_split.cu: W's hi and lo for two passes [4][D][D] fp16, A hi and lo, the 2
    stages; the out projection Wo's and A's hi and lo, the 2 stages, the maxima."""
    D = TILES_PAIR_DIM
    parts = 2 if project_tiles_split(kv_format) else 1  # hi and lo, or hi
    a = parts * 64 * D * 2
    if out:
        row_words = D if kv_format in KV_SLOT_FORMATS else 2 * D
        return parts * D * D * 2 + a + 2 * 64 * row_words * 4 + 64 + 64 + 1024
    wb_gb = 0 if parts == 2 else 8 * D * 2 + 8 * D  # project_tiles.cu's WB and GB
    return 4 * D * D * 2 + a + 2 * 64 * D * 4 + wb_gb + 64 + 1024


# ---- attention (kernels/attention.cu) ----

def attention_tiles(head_dim: int) -> tuple[int, int]:
    """(BQ, BK): the largest tiles whose accumulators stay in registers (no spills)."""
    if head_dim <= 32:
        return 128, 64
    if head_dim <= 64:
        return 64, 64
    return 64, 32


def attention_config(head_dim: int) -> KernelConfig:
    bq, bk = attention_tiles(head_dim)
    return KernelConfig("attention.cu", (("HEAD_DIM", head_dim), ("BQ", bq), ("BK", bk)))


def attention_smem_bytes(head_dim: int) -> int:
    bq, bk = attention_tiles(head_dim)
    dv = -(-head_dim // 32) * 32
    return 4 * (head_dim * (bq + bk) + bk * dv + bk * (bq + 4))


# ---- attention on tensor cores (kernels/attention_mma.cu) ----

ATTENTION_MMA_THREADS = 256  # 8 warps
# entry point attention_<variant>; "f16x3": the fp32 mode's split products in fp16 (twice
# TF32's rate), "tf32x3" (3xTF32) kept for tests and sweeps
ATTENTION_MMA_VARIANTS = ("tf32x3", "tf32", "bf16", "f16x3")
_MMA_PREC = {"tf32x3": 0, "tf32": 1, "bf16": 2, "f16x3": 3}
# f16x3 reads what tf32x3 reads (fp32 q, k, v and bias) and scales them into fp16 itself
_MMA_KV_FORMAT = {"tf32x3": KV_FP32, "tf32": KV_TF32, "bf16": KV_BF16, "f16x3": KV_FP32}
# The variants staged through registers (split into hi and lo parts as they are stored),
# which take PREFETCH; the others copy k and v as stored through a ring of STAGES.
_MMA_STAGED = ("tf32x3", "f16x3")
# The variants that take the powers of two (s_q, s_k, s_v) of _gpu.f16x3_scales as their
# last arguments (AttentionLaunch.operand_scales)
_MMA_OPERAND_SCALES = ("f16x3",)


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
_SMALL_N = 128


def attention_mma_tiles(head_dim: int, variant: str, n: int = 1 << 30,
                        compute_capability: int = 90) -> MmaTiles:
    """The tile shape for head dim `head_dim` and `n` keys on a GPU of `compute_capability`,
    measured on an H200 (scripts/sweep_tiles.py, benchmarks/NOTES.md) within what compiles
    without spills for that architecture (tests/test_kernels_compile.py: sm_80 for 80-89,
    sm_90 from 90) and fits the shared memory."""
    if variant in _MMA_STAGED:  # staged through registers
        # f16x3 (not yet measured: 3xTF32's shapes where they compile without spills):
        # its fp16 operands take fewer registers (q's hi and lo as many as q in fp32), so at
        # d <= 16 and small N it keeps the next tile in registers too (105-127 registers,
        # no spills; 3xTF32 spills there); at d = 24 on sm_90 3xTF32's shape spills 24-40
        # bytes in f16x3 too, so it drops the prefetch instead (125 registers).
        f16 = variant == "f16x3"
        if head_dim <= 32:
            if n <= _SMALL_N and head_dim <= 16:  # (d = 24, 32 spill within 128 registers on sm_80;
                # d = 16 with the next tile in registers too)
                return MmaTiles(bk=32, prefetch=int(f16), min_blocks=2)
            # 2 rows x 2 m-tiles per warp at every N (one row was faster at N > 512, 10.8
            # against 11.8 ms at 1x1024, but spills since each k-step's P V terms are summed
            # in fragments of their own: session 7, benchmarks/NOTES.md); d = 24 without
            # the next tile in registers, and sm_80 at d = 32 one m-tile: what fits in 255
            # registers there.
            if compute_capability >= 90 and head_dim == 24:
                # 2 blocks per SM, one row, the next tile in registers: 0.55 against 0.73 ms
                # at 1x384x96x4 and 0.080 against 0.094 at 1x160, though it spills 24-32 bytes
                # (results/h200-dev/sweep_tf32x3_d24.log; tests/test_kernels_compile.py)
                return MmaTiles(bk=32, prefetch=int(not f16), min_blocks=2)
            if compute_capability < 90 and head_dim > 24:
                return MmaTiles(bk=32, mt=1, rows=2)
            return MmaTiles(bk=32, mt=2, rows=2, prefetch=0 if head_dim == 24 else 1)
        if head_dim <= 64:
            return MmaTiles(bk=16)
        raise ValueError(f"{variant} attention takes head dims up to 64; got {head_dim}")
    # TF32 and bf16: the cp.async ring; 2 blocks of 8 warps per SM where their registers fit
    if head_dim <= 16 and n <= _SMALL_N:  # 3 blocks per SM (80 registers, 2-stage ring)
        return MmaTiles(bk=32, min_blocks=3, stages=2)
    if head_dim <= 32 and n > _SMALL_N:
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


def attention_mma_config(head_dim: int, variant: str, tiles: MmaTiles | None = None
                         ) -> KernelConfig:
    """The configuration whose entry point `attention_<variant>` serves `head_dim`;
    variant "tf32x3" (fp32-accurate 3xTF32), "f16x3" (fp32-accurate, fp16 split
    products), "tf32" or "bf16"."""
    if variant not in ATTENTION_MMA_VARIANTS:
        raise ValueError(f"variant must be one of {ATTENTION_MMA_VARIANTS}; got {variant!r}")
    if head_dim not in attention_mma_head_dims(variant):
        raise ValueError(f"the tensor-core attention ({variant}) takes head dims "
                         f"{attention_mma_head_dims(variant)}; got {head_dim}")
    tiles = tiles or attention_mma_tiles(head_dim, variant)
    if variant in _MMA_STAGED:  # staged through registers
        shape = (("PREFETCH", tiles.prefetch),)
    else:  # copied as stored, through the ring
        shape = (("STAGES", tiles.stages),)
    return KernelConfig("attention_mma.cu", (
        ("HEAD_DIM", head_dim), ("PREC", _MMA_PREC[variant]), ("BK", tiles.bk),
        ("MT", tiles.mt), ("ROWS", tiles.rows), *shape, ("MIN_BLOCKS", tiles.min_blocks)))


def attention_mma_smem_bytes(head_dim: int, variant: str, tiles: MmaTiles | None = None
                             ) -> int:
    """3xTF32: per row K [BK][d+4] and V^T [d][BK+4] tf32 words, hi and lo; then two bias
    tiles [BQ][BK+8] fp32. f16x3: the same with K and V [BK][d+8] fp16, hi and lo.
    TF32 / bf16: STAGES x (per row K and V [BK][d+4] words or [BK][d+8] halves, one bias
    tile, fp16 in bf16 mode)."""
    t = tiles or attention_mma_tiles(head_dim, variant)
    bias_tile = (2 if variant == "bf16" else 4) * t.queries * (t.bk + 8)  # fp16 in bf16 mode
    if variant in _MMA_STAGED:
        if variant == "f16x3":
            per_row = 2 * 2 * 2 * t.bk * (head_dim + 8)
        else:
            per_row = 2 * 4 * (t.bk * (head_dim + 4) + head_dim * (t.bk + 4))
        return t.rows * per_row + 2 * bias_tile
    per_row = 4 * t.bk * (head_dim + 8) if variant == "bf16" else 8 * t.bk * (head_dim + 4)
    return t.stages * (t.rows * per_row + bias_tile)


@dataclasses.dataclass(frozen=True)
class AttentionLaunch:
    """One attention kernel and its launch shape: blocks of `threads` threads, each taking
    `queries` queries of `rows` pair rows of one head; it reads k and v as the projection
    stores them in `kv_format` (KV_*); `operand_scales`: it scales q, k and v into fp16's
    range itself and takes the powers of two (s_q, s_k, s_v) of _gpu.f16x3_scales as its
    last arguments (attention_f16x3)."""
    config: KernelConfig
    name: str
    queries: int
    rows: int
    threads: int
    smem: int
    kv_format: int = KV_FP32
    operand_scales: bool = False

    def blocks(self, B: int, N: int, H: int) -> int:
        return -(-N // self.queries) * H * B * -(-N // self.rows)


# precision -> the attention kernel variant (mma.sync): the fp32 mode's split products in
# fp16, f16x3 (twice TF32's rate; 3xTF32, "tf32x3", stays for tests and sweeps)
PRECISIONS = ("fp32", "tf32", "bf16")
_MMA_VARIANT = {"fp32": "f16x3", "tf32": "tf32", "bf16": "bf16"}


def check_precision(precision: str):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")


def attention_mma_launch(head_dim: int, variant: str, tiles: MmaTiles | None = None,
                         n: int = 1 << 30, compute_capability: int = 90) -> AttentionLaunch:
    tiles = tiles or attention_mma_tiles(head_dim, variant, n, compute_capability)
    return AttentionLaunch(attention_mma_config(head_dim, variant, tiles),
                           f"attention_{variant}", tiles.queries, tiles.rows,
                           ATTENTION_MMA_THREADS,
                           attention_mma_smem_bytes(head_dim, variant, tiles),
                           _MMA_KV_FORMAT[variant], variant in _MMA_OPERAND_SCALES)


# ---- each batch's key extent under the mask (kernels/key_extent.cu) ----

# N from which a masked forward finds each batch's key extent, so that the attention's key
# loops stop at the last key tile any query keeps (exact: the tiles past it are masked for
# every query). Below it a trailing masked tile is too small a share to pay for the
# memset and the launch (2x128x64x4 is host-bound).
KEY_EXTENT_MIN_N = 512
KEY_EXTENT_THREADS = 256


def key_extent_config() -> KernelConfig:
    return KernelConfig("key_extent.cu", ())


def key_extent_chunks(N: int) -> int:
    """Blocks per batch: ~16 mask elements per thread, at most 512 blocks (one atomic each)."""
    return max(1, min(512, -(-N * N // (16 * KEY_EXTENT_THREADS))))


def attention_ffma_launch(head_dim: int) -> AttentionLaunch:
    return AttentionLaunch(attention_config(head_dim), "attention_fp32",
                           attention_tiles(head_dim)[0], 1, ATTENTION_THREADS,
                           attention_smem_bytes(head_dim))


# ---- attention on warpgroup products (kernels/attention_wgmma.cu, sm_90a): fp16 (f16, the
# tf32 mode), bf16, fp16 split (f16x3, the fp32 mode), and TF32 and 3xTF32 (kept for
# comparison) ----

WGMMA_ARCH = "sm_90a"  # wgmma exists only on compute capability 9.0, in this target
WGMMA_HEAD_DIMS = (32,)
WGMMA_QUERIES, WGMMA_KEYS = 128, 64  # BQ and BK of a block
VT_TILE_BYTES = WGMMA_KEYS * 32 * 4  # one V^T tile of KV_TF32_VT: 64 keys x 32 dims, tf32
# variant -> (SPLIT define, the format the projection writes for it, that with BULK);
# entry points attention_<variant>_wgmma
WGMMA_VARIANTS = {"tf32": (0, KV_TF32_VT, KV_TF32_TILES), "tf32x3": (1, KV_FP32, None),
                  "bf16": (0, None, KV_BF16_TILES), "f16x3": (0, None, KV_F16X3_TILES),
                  "f16": (0, None, KV_F16_TILES), "f16s": (0, None, KV_F16_TILES)}
# "f16s": f16 with S = bias + Q K^T in fp16 accumulators and the softmax's max and
# exponent on fp16 pairs (attention_wgmma.cu S16), reading format 8 as f16 does but with q,
# k and the bias scaled so that S fits in fp16 (_gpu.f16s_scales: the bf16 mode's option).
# precision -> the wgmma variant serving it: the fp32 mode's split products in fp16 (twice
# TF32's rate; 3xTF32 "tf32x3" stays for tests and sweeps), the tf32 mode's one fp16
# product of scaled operands (TF32's 11 bits at twice its rate; "tf32" stays likewise);
# for bf16 ("auto") its own variant ("bf16") below BF16_F16S_FROM_N and "f16s" from there
# (from BF16_F16S_SLOTS_FROM_N where it reads format 9, below): format 8's projections then serve the bf16 mode (their out projection reads an fp32 gate:
# session 18 measured the projections 0.655 + 0.360 -> 0.701 + 0.552 ms at 1x1024, the
# attention 1.958 -> 1.734; forward 2.952 -> 2.834, and 0.302 -> 0.322 at 1x384; a cubic
# attention gain against a quadratic projection cost fitted to the two breaks even near N
# = 730). TRIATTN_BF16_S16=1 / 0 (or set_bf16_variant) takes one variant at every N.
BF16_WGMMA_VARIANTS = ("auto", "bf16", "f16s")
# Format 9 (KV_F16S_TILES: the gate in bf16 in each head's slot, half format 8's bytes) for
# the f16s attention where project_tiles.cu writes the projections (Plan): on by default
# (TRIATTN_BF16_SLOT_ROWS=0: format 8 everywhere; read at import, tests set it per plan).
# Session 19 measured format 8 -> 9 at 1x1024 2.87 -> 2.73 ms (the gate and out projection
# 0.54 -> 0.30), and with format 9 the f16s attention ahead of the bf16 variant from 1x384
# (0.294 -> 0.282 ms) up: there "auto" takes f16s from BF16_F16S_SLOTS_FROM_N, elsewhere
# (format 8) from BF16_F16S_FROM_N.
BF16_SLOT_ROWS = os.environ.get("TRIATTN_BF16_SLOT_ROWS", "1") == "1"
# TRIATTN_PDL=1: the attention and the out projection launched as programmatic dependents
# of the kernel before them on sm_90 and newer (_launch.Launch overlap, kernels/common.cuh
# wait_for_previous_kernel; read at import). Off by default: session 19 measured no gain at
# 2x128x64x4 within the benchmark's spread between processes (+-5%), and at 1x384 medians
# 2-4% higher, with a wider spread (benchmarks/NOTES.md).
OVERLAP_LAUNCHES = os.environ.get("TRIATTN_PDL", "0") == "1"
BF16_F16S_FROM_N = 768
BF16_F16S_SLOTS_FROM_N = 384
_WGMMA_VARIANT = {"fp32": "f16x3", "tf32": "f16",
                  "bf16": {"1": "f16s", "0": "bf16"}.get(os.environ.get("TRIATTN_BF16_S16"),
                                                         "auto")}


def set_bf16_variant(variant: str):
    """The wgmma variant of the bf16 mode from now on ("auto": by N, BF16_F16S_FROM_N;
    "bf16" or "f16s" at every N; the default from TRIATTN_BF16_S16, else "auto"). Forwards planned before keep theirs: DeviceWeights keeps its Plans,
    so set this before the first forward of a module (or pass `attention=`)."""
    if variant not in BF16_WGMMA_VARIANTS:
        raise ValueError(f"the bf16 mode's wgmma variant must be one of "
                         f"{BF16_WGMMA_VARIANTS}; got {variant!r}")
    _WGMMA_VARIANT["bf16"] = variant
    attention_kernel.cache_clear()


def scales_key(launch: AttentionLaunch):
    """The key of DeviceWeights.qkv_scales whose powers of two the projection feeding
    `launch` scales q, k, v and the pair bias by: its format, but "f16s" for the f16s
    variant (format 8 with S in fp16: its own bound, _gpu.f16s_scales)."""
    return "f16s" if launch.name == "attention_f16s_wgmma" else launch.kv_format


def bf16_variant() -> str:
    """The bf16 mode's wgmma variant now (set_bf16_variant)."""
    return _WGMMA_VARIANT["bf16"]
# N above which a precision takes the wgmma kernel, of its variant (_WGMMA_VARIANT)
# (scripts/sweep_tiles.py, benchmarks/NOTES.md): TF32 from N = 129. bf16 from N = 129 as
# TF32 (faster at 1x384 and 1x1024: 0.179 / 2.50 against 0.198 / 3.00 ms; not swept
# between 129 and 384). fp32 (f16x3) from N = 129 too (scripts/sweep_wgmma_threshold.py,
# whole forward against the mma.sync 3xTF32 attention: 1x160 0.265 against 0.278 ms, 1x256
# 0.499 / 0.570, 1x288 0.744 / 0.837; 1x200 0.481 against 0.438, where the projection
# writing f16x3's tiles takes 0.32 ms against 0.20; below N = 128 equal within noise).
# (3xTF32 on wgmma took over only from N = 289: its 64-key tiles padded N further.)
_WGMMA_ABOVE_N = {"tf32": _SMALL_N, "fp32": _SMALL_N, "bf16": _SMALL_N}


# The variants whose Q K^T reads Q from shared memory (attention_wgmma.cu Q_SHARED)
WGMMA_Q_SHARED = ("bf16", "f16", "f16s")


@dataclasses.dataclass(frozen=True)
class WgmmaTiles:
    """The attention_wgmma.cu shape: ROWS pair rows per block (256 threads each, sharing
    the bias tiles), STAGES tiles in the cp.async ring, MIN_BLOCKS per SM asked of the
    compiler, PINGPONG: a row's second warpgroup starts its Q K^T once the first has its S,
    instead of both at once; PV_GROUPS (3xTF32 and f16x3): fresh P V accumulators per key
    tile, each added to O in fp32; BULK (TF32, bf16, f16x3 and f16, no ping-pong; bf16,
    f16x3 and f16 have no other): warp 0 fills the stages with bulk copies from K and V^T
    tiles (KV_BULK_FORMATS), paced by mbarriers."""
    rows: int = 1
    stages: int = 2
    min_blocks: int = 2
    pingpong: int = 0
    pv_groups: int = 2
    bulk: int = 0


def attention_wgmma_tiles(variant: str = "tf32") -> WgmmaTiles:
    """TF32: one row per block, two blocks (16 warps) per SM, tiles by bulk copies (BULK):
    the fastest measured at 1x384 and 1x1024 (scripts/sweep_tiles.py, benchmarks/NOTES.md:
    3.14 against 3.49 ms with cp.async at 1x1024). bf16 the same in three blocks per SM
    (2.50 against 2.61 ms at 1x1024, the same at 1x384, when it spilled 88 bytes; with Q
    in shared memory since session 12, 78 registers and no spills: 2.08 ms). f16 (the tf32
    mode's one fp16 product) as bf16 (2.26 against 2.70 ms in 2 blocks per SM).
    3xTF32: one block per SM (its two stages, with the lo parts, V as copied and an fp32
    bias tile, take 161 KiB), the row's warpgroups in ping-pong, two fresh P V
    accumulators per tile."""
    if variant == "tf32x3":
        return WgmmaTiles(min_blocks=1, pingpong=1, pv_groups=2)
    if variant == "bf16":  # 3 blocks per SM: 78 registers, no spills (Q_SHARED); faster
        return WgmmaTiles(bulk=1, min_blocks=3)  # at 1x1024 than 2 (session12_call2.txt)
    if variant == "f16x3":  # 2 blocks per SM (101 KiB each), one fresh P V accumulator
        return WgmmaTiles(bulk=1, pv_groups=1)  # per tile: 123 registers, no spills
    if variant in ("f16", "f16s"):  # as bf16's (f16s: 80 registers, no spills)
        return WgmmaTiles(bulk=1, min_blocks=3)
    return WgmmaTiles(bulk=1)


def attention_wgmma_smem_bytes(tiles: WgmmaTiles, variant: str = "tf32") -> int:
    """STAGES x (ROWS K tiles [64][32] tf32, ROWS V^T tiles of 2 x [40][32] tf32, a bias
    tile [128][64 + 8] fp16 (3xTF32: fp32, then the lo parts of the K and V^T tiles and
    ROWS V tiles [64][32] fp32 as copied; bf16: the K tile bf16, V^T 1 x [40][64] bf16)),
    and 1024 bytes to align the start; bf16 and f16 (WGMMA_Q_SHARED) also a Q tile [64][32]
    16-bit per warpgroup, 1024-aligned after the mbarriers."""
    split = WGMMA_VARIANTS[variant][0]
    element = 2 if variant in ("bf16", "f16x3", "f16", "f16s") else 4
    parts = 2 if variant == "f16x3" else 1 + split  # hi and lo (f16x3: every tile)
    k_tile = tiles.rows * WGMMA_KEYS * 32 * element
    k_vt = k_tile + tiles.rows * 40 * WGMMA_KEYS * element
    bias_row = WGMMA_KEYS if tiles.bulk else WGMMA_KEYS + 8  # BULK: the swizzled tile as is
    bias_element = 2 + 2 * split  # fp16, or fp32 (3xTF32)
    stage = (parts * k_vt + split * k_tile
             + (2 if variant == "f16x3" else 1) * bias_element * WGMMA_QUERIES * bias_row)
    if variant in WGMMA_Q_SHARED:  # the mbarriers' 1024 bytes, then a Q tile [64][32]
        return tiles.stages * stage + 1024 + tiles.rows * 2 * 64 * 32 * 2 + 1024  # per warpgroup
    return tiles.stages * (stage + 16 * tiles.bulk) + 1024  # BULK: 2 mbarriers per stage


def attention_wgmma_launch(head_dim: int = 32, tiles: WgmmaTiles | None = None,
                           variant: str = "tf32", slot_rows: bool = False) -> AttentionLaunch:
    """The attention on wgmma of `variant` (attention_<variant>_wgmma), reading k and v as
    the projection stores them for it: TF32 ("tf32") with V^T tiles (KV_TF32_VT), or with
    K, V^T and bias tiles where `tiles.bulk` (KV_TF32_TILES); 3xTF32 ("tf32x3") as
    attention_tf32x3 (KV_FP32); bf16 ("bf16"), the fp32 mode's fp16 split ("f16x3") and
    the tf32 mode's one fp16 product ("f16") with bulk copies only, from their K and V^T
    tiles (KV_BF16_TILES, KV_F16X3_TILES, KV_F16_TILES); "f16s" as "f16" with S in fp16
    (the bf16 mode's option), reading KV_F16_TILES with scales of its own (scales_key), or
    where `slot_rows` KV_F16S_TILES (its q in format 6's rows of D words)."""
    if variant not in WGMMA_VARIANTS:
        raise ValueError(f"variant must be one of {tuple(WGMMA_VARIANTS)}; got {variant!r}")
    if head_dim not in WGMMA_HEAD_DIMS:
        raise ValueError(f"the wgmma attention takes head dims {WGMMA_HEAD_DIMS}; got {head_dim}")
    t = tiles or attention_wgmma_tiles(variant)
    split, kv_format, bulk_format = WGMMA_VARIANTS[variant]
    if (kv_format if not t.bulk else bulk_format) is None:
        raise ValueError(f"the {variant} wgmma attention does not take bulk={t.bulk}")
    # The TF32 kernel's defines as before the 3xTF32 variant (its cached cubins stay valid).
    extra = (("SPLIT", 1), ("PV_GROUPS", t.pv_groups)) if split else ()
    if t.bulk:
        extra += (("BULK", 1),)
        kv_format = bulk_format
    if variant == "bf16":
        extra += (("BF16", 1),)
    if variant == "f16x3":
        extra += (("F16X3", 1), ("PV_GROUPS", t.pv_groups))
    if variant in ("f16", "f16s"):
        extra += (("F16X1", 1),)
    if variant == "f16s":
        extra += (("S16", 1),)
        if slot_rows:  # reading format 9's rows of D words (Plan: where project_tiles.cu writes them)
            extra += (("SLOT_ROWS", 1),)
            kv_format = KV_F16S_TILES
    config = KernelConfig("attention_wgmma.cu", (
        ("HEAD_DIM", head_dim), ("ROWS", t.rows), ("STAGES", t.stages),
        ("MIN_BLOCKS", t.min_blocks), ("PINGPONG", t.pingpong)) + extra, WGMMA_ARCH)
    return AttentionLaunch(config, f"attention_{variant}_wgmma", WGMMA_QUERIES, t.rows,
                           256 * t.rows, attention_wgmma_smem_bytes(t, variant), kv_format)


def uses_wgmma(head_dim: int, precision: str, compute_capability: int, n: int) -> bool:
    """Whether the attention takes attention_wgmma.cu: every mode on compute
    capability 9.0 exactly (sm_90a code runs nowhere else), at the head dims it is written
    for, above the N where it starts to be faster (_WGMMA_ABOVE_N)."""
    return (precision in _WGMMA_ABOVE_N and compute_capability == 90
            and head_dim in WGMMA_HEAD_DIMS and n > _WGMMA_ABOVE_N[precision])


@functools.lru_cache(maxsize=None)  # per call: a look-up, not a rebuild
def attention_kernel(head_dim: int, precision: str, compute_capability: int = 90,
                     n: int = 1 << 30, smem_limit: int | None = None) -> AttentionLaunch:
    """The attention kernel for `precision`: tensor cores (mma.sync, sm_80 and newer) where
    the head dim allows (attention_mma_head_dims) and its tiles fit in the GPU's shared
    memory per block (`smem_limit`, default SMEM_LIMIT), else the FFMA kernel, which is
    fp32 (so at least as accurate as any mode asks)."""
    check_precision(precision)
    limit = SMEM_LIMIT if smem_limit is None else smem_limit
    variant = _MMA_VARIANT[precision]
    if uses_wgmma(head_dim, precision, compute_capability, n):
        wgmma_variant = _WGMMA_VARIANT[precision]
        if wgmma_variant == "auto":
            # (the Plan keeps f16s below BF16_F16S_FROM_N only where format 9 is written)
            from_n = BF16_F16S_SLOTS_FROM_N if BF16_SLOT_ROWS else BF16_F16S_FROM_N
            wgmma_variant = "f16s" if n >= from_n else "bf16"
        launch = attention_wgmma_launch(head_dim, variant=wgmma_variant)
        if launch.smem <= limit:
            return launch
    if compute_capability >= 80 and head_dim in attention_mma_head_dims(variant):
        launch = attention_mma_launch(head_dim, variant, n=n,
                                      compute_capability=compute_capability)
        if launch.smem <= limit:
            return launch
    launch = attention_ffma_launch(head_dim)
    if launch.smem > limit:
        raise ValueError(f"head dim {head_dim} needs {launch.smem} bytes of shared memory per "
                         f"block for the attention; this GPU allows {limit}")
    return launch


def all_configs(arch: str | None = None):
    """Every configuration a supported (pair_dim, num_heads) can launch on a GPU of `arch`
    ("sm_80": compute capability 80-89, "sm_90": 90 and newer; None: either)."""
    capabilities = (80, 90) if arch is None else (int(arch.removeprefix("sm_")),)
    configs = {project_config(rows, mma, D, kv, split) for D in (128, MAX_PAIR_DIM)
               for rows in {project_rows(D, total) for total in (1, 1 << 62)}
               # FFMA projections with the tensor-core formats: what the GPU tests force
               # (tests/test_gpu.py test_ffma_projection_of_older_gpus)
               for mma, kv, split in ((False, KV_FP32, False), (False, KV_TF32, False),
                                      (False, KV_BF16, False), (True, KV_FP32, True),
                                      (True, KV_TF32, False), (True, KV_BF16, False),
                                      (True, KV_FP32, False))}
    # the fp32 mode's 3xTF32 projections, which TRIATTN_PROJECT_F16_SPLIT=0 selects
    configs.update(project_config(rows, True, D, KV_FP32, True, f16_split=False)
                   for D in (128, MAX_PAIR_DIM)
                   for rows in {project_rows(D, total) for total in (1, 1 << 62)})
    if 90 in capabilities:  # the projections that write tiles feed the sm_90a attention only
        configs.update(project_config(rows, True, D, kv, kv == KV_F16X3_TILES)
                       for D in (128, MAX_PAIR_DIM) for kv in KV_TILED_FORMATS
                       if kv != KV_F16S_TILES  # (project_tiles.cu only)
                       for rows in {project_rows(D, total) for total in (1, 1 << 62)})
    configs.add(key_extent_config())
    configs.update(attention_config(d) for d in supported_head_dims())
    configs.update(attention_mma_config(d, v, attention_mma_tiles(d, v, n, cc))
                   for v in ATTENTION_MMA_VARIANTS for d in attention_mma_head_dims(v)
                   for n in (_SMALL_N, _SMALL_N + 1) for cc in capabilities)
    if 90 in capabilities:
        configs.update(attention_wgmma_launch(d, variant=v).config for d in WGMMA_HEAD_DIMS
                       for v in WGMMA_VARIANTS)
        configs.update(attention_wgmma_launch(d, variant="f16s", slot_rows=True).config
                       for d in WGMMA_HEAD_DIMS)
        configs.update(project_tiles_config(kv) for kv in _TILES_FORMATS)
    return sorted(configs, key=lambda c: (c.filename, c.defines, c.arch))
