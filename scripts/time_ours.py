"""Quick timing of our forward pass and its stages (CUDA events, median of repeats).

The full comparison with the peers is benchmarks/run.py; this is the fast loop for a
kernel change:  python3 scripts/time_ours.py 2x128x64x4 1x384x128x4 1x1024x128x4
(--precisions=bf16: that mode alone; TRIATTN_BF16_S16=1: the bf16 mode on the f16s
attention, S in fp16; each line ends with the attention kernel the forward took)
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
    for precision in PRECISIONS:
        for size in sizes:
            time_size(size, precision)


def padded_inputs(size):
    """(module, pair, mask) for a "BxNxDxh" size: random weights (seed 0), a standard-normal
    pair, the last N // 10 rows and columns masked (padded queries fully masked)."""
    B, N, D, h = map(int, size.split("x"))
    module = ta.TriangleAttention(ta.random_weights(D, h, seed=0))
    pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
    mask = cp.ones((B, N, N), bool)
    pad = N // 10
    if pad:
        mask[:, :, -pad:] = False
        mask[:, -pad:, :] = False
    return module, pair, mask


def time_size(size, precision):
    module, pair, mask = padded_inputs(size)
    B, N, D, h = map(int, size.split("x"))
    repeats = 50 if N <= 512 else 10
    kw = {} if precision == "fp32-ffma" else {"precision": precision}
    for _ in range(3):
        module(pair, mask, **kw)
    total = median_ms(lambda: module(pair, mask, **kw), repeats)
    # Stage times from one prepared forward (arguments checked and scratch allocated
    # once): stages 0..i run together, and stage i's time is the difference. Their sum
    # against `total` is the host overhead of a call (checks, allocation, launch set-up).
    stages = module.stage_launchers(pair, mask, **kw)
    cumulative = [median_ms(lambda i=i: [launch() for _, launch in stages[: i + 1]], repeats)
                  for i in range(len(stages))]
    times = [(name, c - (cumulative[i - 1] if i else 0.0))
             for i, ((name, _), c) in enumerate(zip(stages, cumulative))]
    times.append(("host", total - cumulative[-1]))
    # The projections alone, each repeated on the scratch the passes left: steadier than
    # the differences for a change to one stage. (The repeated projection writes q back
    # over o, so the out projection then reads q as its o: the same work, other values.
    # The attention, which writes o over q, is timed by difference only.)
    alone = {name: median_ms(launch, repeats) for name, launch in stages
             if name != "attention"}
    flops = 4 * B * N**3 * D + 2 * B * N * N * D * (5 * D + h)
    line = " ".join(f"{name}={t:.3f}" for name, t in times)
    line_alone = " ".join(f"{name}={t:.3f}" for name, t in alone.items())
    # the attention kernel the forward took (the bf16 mode's depends on TRIATTN_BF16_S16)
    kernels = ",".join(sorted({plan.attention_kernel.name for plan in module._dw.plans.values()}))
    print(f"{precision:9s} {size}: {total:.3f} ms  {flops / total / 1e9:.1f} TFLOP/s  [{line}]"
          f"  alone [{line_alone}]  {kernels}", flush=True)


PRECISIONS = ("fp32", "tf32", "bf16")

if __name__ == "__main__":
    if "--ffma" in sys.argv:  # the FFMA attention kernel in place of tensor cores, to compare
        sys.argv.remove("--ffma")
        from triattn_cupy import _configs

        _configs.attention_kernel = lambda d, *args: _configs.attention_ffma_launch(d)
        PRECISIONS = ("fp32-ffma",)
    for arg in list(sys.argv[1:]):  # --precisions=tf32,bf16: those modes only
        if arg.startswith("--precisions="):
            if PRECISIONS == ("fp32-ffma",):
                raise SystemExit("--precisions and --ffma exclude each other")
            sys.argv.remove(arg)
            PRECISIONS = tuple(arg.split("=", 1)[1].split(","))
    main(sys.argv[1:] or ["2x128x64x4", "1x384x128x4", "1x1024x128x4"])
