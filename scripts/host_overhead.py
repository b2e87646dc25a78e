"""The host side of a forward call at small sizes, where it can outlast the kernels: host
time per call (many calls queued without waiting), the event-timed call the benchmark
takes (host launch gaps included), the host time of preparing a forward and of each
launch, and a cProfile of the calls.

    python3 scripts/host_overhead.py [sizes, default 2x128x64x4]
"""
import cProfile
import pstats
import sys
import time

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _gpu
from time_ours import median_ms  # scripts/ is on sys.path when run as a script


def host_us(fn, calls=300):
    fn()
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    cp.cuda.Device().synchronize()
    return elapsed / calls * 1e6


def prepare_parts(module, pair, mask):
    """Host µs of the steps a call takes before its first launch, each timed alone."""
    dw = module._dw
    forward = _gpu.Forward(dw, pair, mask, "zero", None, "bf16")
    key = next(iter(dw.plans))
    parts = {
        "as_device_array": lambda: _gpu.as_device_array(pair, "pair", dw.device_id),
        "dtype check": lambda: pair.dtype != np.float32,
        "pair_geometry": lambda: _gpu.pair_geometry(pair.shape, dw.pair_dim),
        "plan_key": lambda: _gpu.plan_key(pair, mask, "bf16", False),
        "plans.get": lambda: dw.plans.get(key),
        "current device": lambda: cp.cuda.runtime.getDevice() != dw.device_id,
        "cupy.empty": lambda: cp.empty(pair.shape, np.float32),
        "cupy.cuda.alloc": lambda: cp.cuda.alloc(forward.plan.scratch_bytes),
        "current stream": lambda: cp.cuda.get_current_stream().ptr,
        "args.fill": lambda: forward.plan.project.args.fill(forward._pointers),
    }
    print("prepare, each step alone (host us): " + " ".join(
        f"{name}={host_us(fn, 3000):.2f}" for name, fn in parts.items()), flush=True)


def main(sizes):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    for size in sizes:
        B, N, D, h = map(int, size.split("x"))
        module = ta.TriangleAttention(ta.random_weights(D, h, seed=0))
        pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
        mask = cp.ones((B, N, N), bool)
        for precision in ta.PRECISIONS:
            call = lambda: module(pair, mask, precision=precision)  # noqa: E731
            prepare = lambda: _gpu.Forward(module._dw, pair, mask, "zero", None, precision)  # noqa: E731
            stages = module.stage_launchers(pair, mask, precision=precision)
            launches = " ".join(f"{name}={host_us(launch):.1f}" for name, launch in stages)
            print(f"{size} {precision:5s} host per call {host_us(call):6.1f} us  "
                  f"event-timed call {median_ms(call, 100) * 1e3:6.1f} us  "
                  f"prepare {host_us(prepare):5.1f} us  launches (host us) {launches}",
                  flush=True)
        prepare_parts(module, pair, mask)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(300):
            module(pair, mask, precision="bf16")
        profile.disable()
        cp.cuda.Device().synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main(sys.argv[1:] or ["2x128x64x4"])
