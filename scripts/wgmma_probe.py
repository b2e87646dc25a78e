"""Where the wgmma TF32 attention (kernels/attention_wgmma.cu) departs from the FFMA kernel,
stage by stage, for debugging on a GPU:
    uniform   q = 0 and bias = 0: o is the plain mean of v over the keys (P V and the sums)
    bias      q = 0, the pair bias as projected: the bias tile and the softmax
    full      as projected: Q K^T too
For each: relative L2 error, NaN count, and the error by query position within a warp's
16 rows and by head-dim column, which name the fragment or layout at fault.

    python3 scripts/wgmma_probe.py [N ...]
"""
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _configs
from triattn_cupy._gpu import DeviceWeights, Forward


def run(dw, pair, launch, case):
    fwd = Forward(dw, pair, None, "zero", None, attention=launch)
    fwd.project()
    D, N = fwd.D, pair.shape[1]
    if case in ("uniform", "bias"):
        fwd.qkvg[:, :D] = 0
    if case == "uniform":
        fwd.bias[..., :N] = 0
    fwd.attention()
    return fwd.attention_output().get().reshape(pair.shape[0], N, N, D)


def main(sizes):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    d, h = 32, 2
    dw = DeviceWeights(ta.random_weights(d * h, h, seed=1), cp.cuda.runtime.getDevice())
    for N in sizes:
        pair = cp.random.standard_normal((1, N, N, d * h), dtype=np.float32)
        for case in ("uniform", "bias", "full"):
            ref = run(dw, pair, _configs.attention_ffma_launch(d), case)
            # the cp.async variant: "uniform" zeroes the bias as [B, H, N, NPK] (format 3)
            got = run(dw, pair, _configs.attention_wgmma_launch(d, _configs.WgmmaTiles()), case)
            diff = np.nan_to_num(got - ref, nan=1e30)
            err = np.linalg.norm(diff) / np.linalg.norm(ref)
            print(f"N={N} {case:8s} rel L2 {err:.3e}  NaN {int(np.isnan(got).sum())}", flush=True)
            if err > 2e-3:
                by_query = [np.abs(diff[:, :, j::16]).mean() for j in range(16)]
                by_dim = [np.abs(diff[..., c::d]).mean() for c in range(d)]
                print("  |err| by query % 16:", " ".join(f"{x:.2g}" for x in by_query))
                print("  |err| by dim:", " ".join(f"{x:.2g}" for x in by_dim))
                print("  ref[0,0,0,:8]", np.array2string(ref[0, 0, 0, :8], precision=3))
                print("  got[0,0,0,:8]", np.array2string(got[0, 0, 0, :8], precision=3))


if __name__ == "__main__":
    main([int(n) for n in sys.argv[1:]] or [64, 130])
