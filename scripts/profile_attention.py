"""One attention launch per tensor-core variant, for a profiler (ncu) to read:
    ncu --clock-control none -k regex:attention_ python3 scripts/profile_attention.py 1x512x128x4
With `--wgmma rows,stages,min_blocks,pingpong[,pv_groups,bulk]` (repeatable), the wgmma
kernel (attention_wgmma.cu) of `--variant` (default tf32) in those shapes instead.
"""
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _configs
from triattn_cupy._gpu import DeviceWeights, Forward

args = sys.argv[1:]
variant = "tf32"
if "--variant" in args:  # the wgmma kernel's variant (tf32, tf32x3, bf16)
    at = args.index("--variant")
    variant = args[at + 1]
    del args[at:at + 2]
wgmma = []
while "--wgmma" in args:
    at = args.index("--wgmma")
    wgmma.append(_configs.WgmmaTiles(*map(int, args[at + 1].split(","))))
    del args[at:at + 2]
size = args[0] if args else "1x512x128x4"
tiles = _configs.MmaTiles(*map(int, args[1].split(","))) if len(args) > 1 else None
B, N, D, h = map(int, size.split("x"))
dw = DeviceWeights(ta.random_weights(D, h, seed=0), cp.cuda.runtime.getDevice())
pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
launches = ([_configs.attention_wgmma_launch(D // h, t, variant) for t in wgmma] if wgmma else
            [_configs.attention_mma_launch(D // h, v, tiles, n=N)
             for v in _configs.ATTENTION_MMA_VARIANTS])
for launch in launches:
    fwd = Forward(dw, pair, None, "zero", None, attention=launch)
    fwd.project()
    fwd.attention()
cp.cuda.runtime.deviceSynchronize()
