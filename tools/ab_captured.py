"""Time captured forwards (and calls) of the tree against its small-size launch choices undone, on the GPU.

    python tools/ab_captured.py 2x128x64x4 2x120x64x4 1x256x128x4 1x384x128x4
    python tools/ab_captured.py --undo dependents --rounds 8 2x128x64x4

The variants: "tree" as the package runs, and "base" with `--undo` of its small-size
choices: "out-rows" (out-projection blocks of 64 rows everywhere, not tiles.out_project_rows'
128 where they save a wave), "dependents" (plain launches in captures, not
gpu/dependent_launch.py's programmatic dependents), or "both" (default). For each round,
size, precision and variant, interleaved (the order reversed every other round) with the
module's plans cleared before each variant (a plan holds its launches): a capture of the
padded forward of tools/time_forward.py, its replay timed by CUDA events (median of 200,
20 above N = 512, after 20 warm-ups), then the call the same way. Prints the medians over
rounds against base's, whether the replays' outputs have base's bits, and every round's
replay.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
PRECISIONS = ("fp32", "tf32", "bf16")
UNDO = ("out-rows", "dependents", "both")


def base_choices(undo: str, dependent_launch, tiles) -> tuple:
    """(chosen, out_project_rows) of the base variant: the package's, with `undo`'s undone."""
    chosen, rows = dependent_launch.chosen, tiles.out_project_rows
    if undo in ("dependents", "both"):
        chosen = lambda compute_capability, rows_total: False  # noqa: E731
    if undo in ("out-rows", "both"):
        rows = lambda *args, **kwargs: 64  # noqa: E731
    return chosen, rows


def warm_median_ms(fn, repeats: int, warmups: int) -> float:
    """time_forward.median_ms of `fn` after `warmups` untimed calls."""
    from time_forward import median_ms

    for _ in range(warmups):
        fn()
    return median_ms(fn, repeats)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sizes", nargs="+", help="BxNxDxh")
    ap.add_argument("--undo", choices=UNDO, default="both")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    import cupy as cp
    import numpy as np
    from time_forward import padded_inputs
    from triattn_cupy.gpu import dependent_launch, tiles

    variants = {"base": base_choices(args.undo, dependent_launch, tiles),
                "tree": (dependent_launch.chosen, tiles.out_project_rows)}
    tree = variants["tree"]
    times, outputs = {}, {}
    precisions = args.precisions.split(",")
    try:
        for r in range(args.rounds):
            for size in args.sizes:
                module, pair, mask = padded_inputs(size)
                repeats = 200 if int(size.split("x")[1]) <= 512 else 20
                for precision in precisions:
                    for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                        dependent_launch.chosen, tiles.out_project_rows = variants[name]
                        module._dw.plans.clear()
                        graph = module.capture(pair, mask, precision=precision)
                        replay = warm_median_ms(graph, repeats, warmups=20)
                        call = warm_median_ms(
                            lambda: module(pair, mask, precision=precision), repeats, 3)
                        times.setdefault((size, precision, name), []).append((replay, call))
                        if r == 0:
                            outputs[(size, precision, name)] = cp.asnumpy(graph())
                        del graph
            print(f"round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
    finally:
        dependent_launch.chosen, tiles.out_project_rows = tree
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), f"(base: --undo {args.undo})")
    for (size, precision, name), runs in times.items():
        base = [statistics.median(x) for x in zip(*times[(size, precision, "base")])]
        replay, call = (statistics.median(x) for x in zip(*runs))
        same = np.array_equal(outputs[(size, precision, name)], outputs[(size, precision, "base")])
        print(f"{size:12s} {precision} {name:4s} replay {replay * 1e3:8.1f} us "
              f"({100 * (replay / base[0] - 1):+.1f}%) call {call * 1e3:8.1f} us "
              f"({100 * (call / base[1] - 1):+.1f}%) bits {'same' if same else 'DIFFERENT'}"
              " replays " + " ".join(f"{t * 1e3:.1f}" for t, _ in runs), flush=True)


if __name__ == "__main__":
    main()
