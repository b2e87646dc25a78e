"""Time the forward pass and its stages on the GPU (CUDA events, median of repeats), per precision and route.

The full comparison with the peers is benchmarks/run.py; this is the fast loop for a
kernel change:

    python tools/time_forward.py 2x128x64x4 1x384x128x4 1x1024x128x4
    python tools/time_forward.py --precisions bf16 --route wgmma_bf16_persistent 1x1024x128x4
    python tools/time_forward.py --route mma_tf32@sm_80 --precisions tf32 1x1024x128x4
    python tools/time_forward.py --mask-layout pair,row 1x384x128x4 1x1024x128x4

The padding mask is the same under either mask layout (rows and keys past N - N // 10),
so pair against row times the row layout's own cost.

Each line ends with the route the forward took (triattn_cupy.gpu.routes).
"""
import argparse
import statistics

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy.gpu import routes


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


def padding_mask(B, N):
    """(B, N, N) bool on the device: the last N // 10 rows and columns masked (padded
    queries fully masked)."""
    mask = cp.ones((B, N, N), bool)
    pad = N // 10
    if pad:
        mask[:, :, -pad:] = False
        mask[:, -pad:, :] = False
    return mask


def padded_inputs(size):
    """(module, pair, mask) for a "BxNxDxh" size: random weights (seed 0), a standard-normal
    pair, padding_mask."""
    B, N, D, h = map(int, size.split("x"))
    module = ta.TriangleAttention(ta.random_weights(D, h, seed=0))
    pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
    return module, pair, padding_mask(B, N)


def time_size(size, precision, route, mask_layout="pair"):
    module, pair, mask = padded_inputs(size)
    B, N, D, h = map(int, size.split("x"))
    repeats = 50 if N <= 512 else 10
    kw = {"precision": precision, "route": route, "mask_layout": mask_layout}
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
    d = D // h
    taken = routes.choose_route(precision, d, D, N, int(cp.cuda.Device().compute_capability),
                                masked=True, force=route).name
    print(f"{precision:5s} {size} {mask_layout:4s}: {total:.3f} ms  {flops / total / 1e9:.1f} TFLOP/s  [{line}]"
          f"  alone [{line_alone}]  {taken}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sizes", nargs="*", default=["2x128x64x4", "1x384x128x4", "1x1024x128x4"],
                    help="BxNxDxh")
    ap.add_argument("--precisions", default=",".join(ta.PRECISIONS))
    ap.add_argument("--route", help="a route name to force (triattn_cupy.gpu.routes.ROUTES)")
    ap.add_argument("--mask-layout", default="pair",
                    help="pair, row, or both (pair,row: timed alternately, size by size)")
    args = ap.parse_args(argv)
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    for precision in args.precisions.split(","):
        for size in args.sizes:
            for mask_layout in args.mask_layout.split(","):
                time_size(size, precision, args.route, mask_layout)


if __name__ == "__main__":
    main()
