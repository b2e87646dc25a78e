"""Device time of a forward pass without the host: each stage, and the whole forward,
captured `--repeat` times into one CUDA graph and replayed, so the GPU never waits on a
launch (kernel boundaries and the kernels' own tails are counted). Against time_ours.py's
event-timed call this splits a small size's time into host and device.

    python3 scripts/device_time.py [sizes, default 2x128x64x4] [--precisions=fp32,tf32]
"""
import statistics
import sys

import cupy as cp

import triattn_cupy as ta
from triattn_cupy import _gpu
from time_ours import padded_inputs  # scripts/ is on sys.path when run as a script

REPEAT = 20


def graph_of(fn, stream):
    """`fn` called REPEAT times, captured into one graph on `stream`."""
    with stream:
        stream.begin_capture()
        for _ in range(REPEAT):
            fn()
        return stream.end_capture()


def replay_us(graph, stream, runs=30):
    """Median device time of one captured call, in µs."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(runs):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / REPEAT)
    return statistics.median(times)


def describe(plan) -> str:
    parts = []
    for name in ("project", "attention", "out_project"):
        launch = getattr(plan, name)
        parts.append(f"{name}={getattr(launch.kernel, 'num_regs', '?')}r "
                     f"grid {launch.grid}x{launch.block} smem {launch.smem}")
    return (f"kv_format {plan.kv_format} attention {plan.attention_kernel.name} projection "
            f"{'tiles' if plan.project_tiles else 'mma' if plan.project_mma else 'ffma'}"
            f"{' split' if plan.project_split else ''}{' f16' if plan.project_f16 else ''}; "
            + "; ".join(parts))


def main(sizes, precisions):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    stream = cp.cuda.Stream(non_blocking=True)
    for size in sizes:
        module, pair, mask = padded_inputs(size)
        out = cp.empty_like(pair)
        for precision in precisions:
            with stream:  # plans, kernels and the pool's blocks made before any capture
                for _ in range(3):
                    module(pair, mask, out=out, precision=precision)
                stream.synchronize()
                forward = _gpu.Forward(module._dw, pair, mask, "zero", out, precision)
                stages = forward.stages()
            times = {name: replay_us(graph_of(launch, stream), stream)
                     for name, launch in stages}
            whole = replay_us(graph_of(lambda: [launch() for _, launch in stages], stream),
                              stream)
            line = " ".join(f"{name}={t:.1f}" for name, t in times.items())
            print(f"{size} {precision:5s} device {whole:7.1f} us  stages [{line}]  "
                  f"{describe(forward.plan)}", flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--precisions=")]
    chosen = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--precisions=")]
    main(args or ["2x128x64x4"], chosen[0].split(",") if chosen else list(ta.PRECISIONS))
