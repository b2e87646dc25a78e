"""The SM clock and board power while forwards run back to back.

    python tools/clocks.py 2x128x64x4 1x1024x128x4 1x4096x128x4

For each size and precision mode (fp32 pair, the padding mask of tools/time_forward.py),
forwards run back to back for `--seconds` while `nvidia-smi` samples the SM clock and the
board power every 50 ms; prints the median forward (CUDA events, host time included) and
the clock and power the board held. From 1x1024 on an H200 holds its 700 W limit and the
clock falls below its 1.98 GHz (docs/performance.md, "Method").
"""
import argparse
import statistics
import subprocess
import time

import cupy as cp

from time_forward import padded_inputs  # (tools/ is the script's folder on sys.path)


def back_to_back(forward, seconds):
    """(median ms, forwards, median SM MHz, lowest SM MHz, median board W)."""
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # (nvidia-smi's own start)
    times, start, stop = [], cp.cuda.Event(), cp.cuda.Event()
    end = time.time() + seconds
    while time.time() < end:
        start.record()
        forward()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    smi.terminate()
    samples = [tuple(map(float, line.split(",")))
               for line in smi.communicate()[0].splitlines() if line.strip()][6:]
    clocks = [clock for clock, _ in samples]
    return (statistics.median(times), len(times), statistics.median(clocks), min(clocks),
            statistics.median(power for _, power in samples))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sizes", nargs="+", help="BxNxDxh")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "tf32", "fp32"])
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    for size in args.sizes:
        module, pair, mask = padded_inputs(size)
        out = cp.empty_like(pair)
        for precision in args.precisions:
            def forward():
                module(pair, mask, out=out, precision=precision)
            forward()  # compiled and planned outside the timing
            ms, n, clock, lowest, power = back_to_back(forward, args.seconds)
            print(f"{size} {precision}: {ms:.3f} ms median of {n} back to back; SM clock "
                  f"median {clock:.0f} MHz (min {lowest:.0f}), board power median {power:.0f} W",
                  flush=True)
        del pair, mask, out
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
