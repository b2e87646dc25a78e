"""The wgmma attention alone in both block orders (HEAD_OUTER 0: query tile, head, row;
1: query tile, row, head), each variant, at sizes where the pair bias of all heads does and
does not fit in L2 (CUDA events, median).

    python3 scripts/grid_order.py [sizes, default 1x1024x128x4 1x2048x128x4 1x4096x128x4]
"""
import dataclasses
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _configs
from triattn_cupy._gpu import DeviceWeights, Forward
from sweep_tiles import time_attention  # scripts/ is on sys.path when run as a script


def main(sizes):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    for size in sizes:
        B, N, D, h = map(int, size.split("x"))
        dw = DeviceWeights(ta.random_weights(D, h, seed=0), cp.cuda.runtime.getDevice())
        pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
        for variant in _configs.WGMMA_VARIANTS:
            if variant == "tf32x3" and N > 2048:
                continue  # ~0.7 s a call: left to the benchmark
            tiles = _configs.attention_wgmma_tiles(variant)
            fwd = Forward(dw, pair, None, "zero", None,
                          attention=_configs.attention_wgmma_launch(D // h, tiles, variant))
            fwd.project()
            for order in (0, 1):
                launch = _configs.attention_wgmma_launch(
                    D // h, dataclasses.replace(tiles, head_outer=order), variant)
                ms = time_attention(fwd, launch, 10 if N <= 1024 else 3)
                print(f"{size} {variant:6s} head_outer={order}: {ms:.3f} ms", flush=True)
            del fwd


if __name__ == "__main__":
    main(sys.argv[1:] or ["1x1024x128x4", "1x2048x128x4", "1x4096x128x4"])
