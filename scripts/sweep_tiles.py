"""Time the tensor-core attention kernel alone for each candidate tile shape, to choose
_configs.attention_mma_tiles (CUDA events, median of repeats; FLOPs of QK^T and PV).

    python3 scripts/sweep_tiles.py [--wgmma-only] [--variants tf32,bf16,f16x3,f16] 1x384x128x4 1x1024x128x4

f16x3 names both the mma.sync kernel (every candidate where the head dim takes it) and,
at head dim 32, the wgmma one.

--wgmma-only: of the mma.sync kernel only the chosen shape (for comparison), then every
wgmma candidate (WGMMA_CANDIDATES).
"""
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _configs
from triattn_cupy._gpu import DeviceWeights, Forward
from time_ours import median_ms  # scripts/ is on sys.path when run as a script

# (bk, mt, rows, prefetch, min_blocks, stages): prefetch is read by 3xTF32 and f16x3 only,
# stages by TF32 and bf16 only.
CANDIDATES = [_configs.MmaTiles(*shape) for shape in
              [(64, 2, 1, 1, 1), (16, 2, 1, 1, 1), (64, 1, 1, 1, 2, 2), (32, 1, 1, 1, 2),
               (32, 1, 1, 1, 2, 4), (16, 1, 1, 1, 2), (32, 1, 1, 0, 2), (32, 2, 2, 1, 1),
               (32, 2, 2, 1, 2), (32, 2, 1, 1, 1), (64, 1, 1, 1, 1), (64, 2, 2, 1, 1, 2),
               (16, 2, 2, 1, 2), (16, 2, 1, 1, 2),
               # 3 blocks (24 warps) per SM at 80 registers: bf16 compiles without spills,
               # TF32 spills 24-44 bytes (session 7)
               (32, 1, 1, 1, 3, 2), (32, 1, 2, 1, 3, 2), (32, 1, 1, 1, 3, 3),
               # 3xTF32 at d = 24 on sm_90 (session 9)
               (32, 2, 2, 0, 1), (32, 1, 2, 1, 1), (32, 1, 2, 0, 1), (16, 2, 2, 0, 1)]]


def time_attention(fwd, launch, repeats):
    """Median ms of the attention stage of `fwd` run with `launch` (after 3 warm-ups)."""
    for _ in range(3):
        fwd.attention(launch)
    return median_ms(lambda: fwd.attention(launch), repeats)


def main(sizes):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    for size in sizes:
        B, N, D, h = map(int, size.split("x"))
        d = D // h
        dw = DeviceWeights(ta.random_weights(D, h, seed=0), cp.cuda.runtime.getDevice())
        pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
        flops = 4 * B * N**3 * D
        for variant in VARIANTS:
            if variant not in _configs.ATTENTION_MMA_VARIANTS:  # wgmma only (f16)
                sweep_wgmma(dw, pair, size, d, flops, 20 if N <= 512 else 5, variant)
                continue
            if d not in _configs.attention_mma_head_dims(variant):
                continue
            chosen = _configs.attention_mma_tiles(d, variant, N)
            # k and v as this variant reads them (the same for every tile shape)
            fwd = Forward(dw, pair, None, "zero", None,
                          attention=_configs.attention_mma_launch(d, variant, chosen))
            fwd.project()
            for tiles in CANDIDATES if MMA_SHAPES else [chosen]:
                try:
                    launch = _configs.attention_mma_launch(d, variant, tiles)
                    if launch.smem > _configs.SMEM_LIMIT:
                        raise ValueError(f"{launch.smem} bytes of shared memory")
                    ms = time_attention(fwd, launch, 20 if N <= 512 else 5)
                except Exception as exc:  # a shape that does not fit: say so, go on
                    print(f"{size} {variant:6s} {tiles}: {type(exc).__name__}: {exc}")
                    continue
                mark = " <- chosen" if tiles == chosen else ""
                print(f"{size} {variant:6s} bk={tiles.bk} mt={tiles.mt} rows={tiles.rows} "
                      f"pf={tiles.prefetch} minb={tiles.min_blocks} st={tiles.stages}: {ms:.3f} ms "
                      f"{flops / ms / 1e9:.1f} TFLOP/s{mark}",
                      flush=True)
            if variant in _configs.WGMMA_VARIANTS and d in _configs.WGMMA_HEAD_DIMS:
                sweep_wgmma(dw, pair, size, d, flops, 20 if N <= 512 else 5, variant)


# (rows, stages, min_blocks, pingpong, pv_groups, bulk) of attention_wgmma.cu, per variant
WGMMA_CANDIDATES = {
    "tf32": [_configs.WgmmaTiles(*shape) for shape in
             [(1, 2, 2, 0), (1, 3, 2, 0), (1, 3, 2, 1), (2, 2, 1, 1), (2, 3, 1, 1),
              # bulk copies by warp 0, mbarriers (BULK)
              (1, 2, 2, 0, 2, 1), (1, 3, 2, 0, 2, 1), (1, 4, 2, 0, 2, 1), (2, 3, 1, 0, 2, 1),
              (2, 4, 1, 0, 2, 1)]],
    "tf32x3": [_configs.WgmmaTiles(*shape) for shape in
               [(1, 2, 1, 0, 2), (1, 2, 1, 1, 1), (1, 2, 1, 1, 2), (1, 2, 1, 1, 4)]],
    "bf16": [_configs.WgmmaTiles(*shape) for shape in  # bulk copies only
             [(1, 2, 2, 0, 2, 1), (1, 3, 2, 0, 2, 1), (1, 4, 2, 0, 2, 1), (2, 2, 1, 0, 2, 1),
              (2, 3, 1, 0, 2, 1), (2, 4, 1, 0, 2, 1), (1, 2, 3, 0, 2, 1)]],
    "f16x3": [_configs.WgmmaTiles(*shape) for shape in  # bulk copies only
              [(1, 2, 2, 0, 1, 1), (1, 2, 2, 0, 2, 1), (1, 2, 1, 0, 2, 1), (1, 3, 1, 0, 1, 1),
               (2, 2, 1, 0, 1, 1)]],
    "f16": [_configs.WgmmaTiles(*shape) for shape in  # bulk copies only
            [(1, 2, 3, 0, 2, 1), (1, 2, 2, 0, 2, 1), (1, 3, 2, 0, 2, 1), (2, 3, 1, 0, 2, 1)]],
}


def sweep_wgmma(dw, pair, size, d, flops, repeats, variant):
    """The wgmma attention's candidates (k and v projected in their own format)."""
    chosen = _configs.attention_wgmma_tiles(variant)
    forwards = {}  # k and v projected once per format the candidates read
    for tiles in WGMMA_CANDIDATES[variant]:
        try:
            launch = _configs.attention_wgmma_launch(d, tiles, variant)
            if launch.smem > _configs.SMEM_LIMIT:
                raise ValueError(f"{launch.smem} bytes of shared memory")
            if launch.kv_format not in forwards:
                forwards[launch.kv_format] = Forward(dw, pair, None, "zero", None,
                                                     attention=launch)
                forwards[launch.kv_format].project()
            ms = time_attention(forwards[launch.kv_format], launch, repeats)
        except Exception as exc:
            print(f"{size} wgmma {variant} {tiles}: {type(exc).__name__}: {exc}")
            continue
        mark = " <- chosen" if tiles == chosen else ""
        print(f"{size} wgmma {variant:6s} rows={tiles.rows} minb={tiles.min_blocks} "
              f"st={tiles.stages} pingpong={tiles.pingpong} pv_groups={tiles.pv_groups} "
              f"bulk={tiles.bulk}: "
              f"{ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s{mark}", flush=True)


VARIANTS = _configs.ATTENTION_MMA_VARIANTS
MMA_SHAPES = True  # every mma.sync candidate, or (--wgmma-only) the chosen one

if __name__ == "__main__":
    if sys.argv[1:2] == ["--wgmma-only"]:
        MMA_SHAPES = False
        del sys.argv[1]
    if sys.argv[1:2] == ["--variants"]:  # e.g. --variants tf32,bf16
        VARIANTS = tuple(sys.argv[2].split(","))
        del sys.argv[1:3]
    main(sys.argv[1:] or ["1x384x128x4", "1x1024x128x4"])
