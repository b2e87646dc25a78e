"""One forward per precision, for a profiler (ncu) to read:
    ncu --clock-control none -k regex:project python3 scripts/profile_forward.py 1x512x128x4
ABLATE=<variant>: with that variant of scripts/ablate_projection.py (its kernels patched).
"""
import os
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta

if os.environ.get("ABLATE"):  # a variant of scripts/ablate_projection.py (profile_projection.sh)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ablate_projection

    ablate_projection.use_variant(ablate_projection.VARIANTS[os.environ["ABLATE"]])

B, N, D, h = map(int, (sys.argv[1] if len(sys.argv) > 1 else "1x512x128x4").split("x"))
module = ta.TriangleAttention(ta.random_weights(D, h, seed=0))
pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
for precision in sys.argv[2:] or ta.PRECISIONS:
    module(pair, None, precision=precision)
cp.cuda.runtime.deviceSynchronize()
