"""One attention launch per tensor-core variant, for a profiler (ncu) to read:
    ncu --clock-control none -k regex:attention_ python3 scripts/profile_attention.py 1x512x128x4
"""
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _configs
from triattn_cupy._gpu import DeviceWeights, Forward

size = sys.argv[1] if len(sys.argv) > 1 else "1x512x128x4"
tiles = _configs.MmaTiles(*map(int, sys.argv[2].split(","))) if len(sys.argv) > 2 else None
B, N, D, h = map(int, size.split("x"))
dw = DeviceWeights(ta.random_weights(D, h, seed=0), cp.cuda.runtime.getDevice())
pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
for variant in _configs.ATTENTION_MMA_VARIANTS:
    launch = _configs.attention_mma_launch(D // h, variant, tiles, n=N)
    fwd = Forward(dw, pair, None, "zero", None, attention=launch)
    fwd.project()
    fwd.attention()
cp.cuda.runtime.deviceSynchronize()
