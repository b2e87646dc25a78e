"""Quick timing of our forward pass and its stages (CUDA events, median of repeats).

The full comparison with the peers is benchmarks/run.py; this is the fast loop for a
kernel change:  python3 scripts/time_ours.py 2x128x64x4 1x384x128x4 1x1024x128x4
"""
import statistics
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta


def median_ms(fn, repeats):
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def main(sizes):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    for size in sizes:
        B, N, D, h = map(int, size.split("x"))
        module = ta.TriangleAttention(ta.random_weights(D, h, seed=0))
        pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
        mask = cp.ones((B, N, N), bool)
        pad = N // 10
        if pad:
            mask[:, :, -pad:] = False
            mask[:, -pad:, :] = False
        repeats = 50 if N <= 512 else 10
        for _ in range(3):
            module(pair, mask)
        total = median_ms(lambda: module(pair, mask), repeats)
        stages = module.stage_launchers(pair, mask)
        parts = []
        for i, (name, _) in enumerate(stages):
            def upto(i=i):
                for _, launch in module.stage_launchers(pair, mask)[: i + 1]:
                    launch()
            parts.append((name, median_ms(upto, repeats)))
        flops = 4 * B * N**3 * D + 2 * B * N * N * D * (5 * D + h)
        line = " ".join(f"{name}={t - (parts[i-1][1] if i else 0):.3f}" for i, (name, t) in enumerate(parts))
        print(f"{size}: {total:.3f} ms  {flops / total / 1e9:.1f} TFLOP/s  [{line}]", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["2x128x64x4", "1x384x128x4", "1x1024x128x4"])
