"""Where a forward's time goes, launch by launch, in its real order and at its real clock.

    python tools/launch_times.py 1x4096x128x4 --precisions bf16 tf32 --calls 4

For each size and mode the single pass (forced with `max_scratch_bytes`), the default (row
blocks where the policy takes them) and one block of every row (`row_block=N`), in turns:
an event recorded after every launch, and each launch's time taken as the gap from the
event before it (so the first also holds the host's lead-in). Prints per form the median
of `--calls` forwards with the events, one without them, and the medians of the summed
time of each kind of launch. Unlike Nsight Compute, whose kernels run alone with their
caches flushed, this sees the clock the board holds at its power limit.
"""
import argparse
import collections
import statistics

import cupy as cp

from triattn_cupy.gpu import row_blocks
from time_forward import padded_inputs  # (tools/ is the script's folder on sys.path)

_events = None  # [(label, event)] while a forward is recorded


class Recorded:
    """A launch that records an event after itself while `_events` is a list."""

    def __init__(self, label, launch):
        self.label, self.launch = label, launch

    def __call__(self, *args):
        result = self.launch(*args)
        if _events is not None:
            event = cp.cuda.Event()
            event.record()
            _events.append((self.label, event))
        return result

    def __getattr__(self, name):
        return getattr(self.launch, name)


def record_launches(plan, dw):
    for name in ("project", "key_extent", "row_mask", "attention", "out_project"):
        launch = getattr(plan, name, None)
        if launch is not None and not isinstance(launch, Recorded):
            setattr(plan, name, Recorded(name, launch))
    blocked = row_blocks.RowBlockLaunches.of(plan, dw)
    for name in ("bias_pass", "project", "attention", "out_project"):
        launch = getattr(blocked, name)
        if not isinstance(launch, Recorded):
            setattr(blocked, name, Recorded("block " + name, launch))


def recorded(forward):
    """(ms, {label: ms}) of one call of `forward`."""
    global _events
    _events = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    forward()
    stop.record()
    stop.synchronize()
    spans, before = collections.defaultdict(float), start
    for label, event in _events:
        spans[label] += cp.cuda.get_elapsed_time(before, event)
        before = event
    _events = None
    return cp.cuda.get_elapsed_time(start, stop), spans


def plain(forward):
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    forward()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sizes", nargs="+", help="BxNxDxh")
    ap.add_argument("--precisions", nargs="+", default=["bf16", "tf32"])
    ap.add_argument("--calls", type=int, default=4, help="forwards of each form")
    args = ap.parse_args(argv)
    for size in args.sizes:
        module, pair, mask = padded_inputs(size)
        out = cp.empty_like(pair)
        for precision in args.precisions:
            forms = {"single pass": dict(max_scratch_bytes=1 << 62), "default": {},
                     "R = N": dict(row_block=pair.shape[1])}
            calls = {name: (lambda options=options: module(pair, mask, out=out,
                                                           precision=precision, **options))
                     for name, options in forms.items()}
            for call in calls.values():  # compiled and planned outside the timing
                call()
            for plan in module._dw.plans.values():
                record_launches(plan, module._dw)
            with_events = {name: [] for name in forms}
            without = {name: [] for name in forms}
            for _ in range(args.calls):
                for name, call in calls.items():
                    with_events[name].append(recorded(call))
                    without[name].append(plain(call))
            for name in forms:
                runs = with_events[name]
                spans = "  ".join(f"{label} {statistics.median(r[1][label] for r in runs):.3f}"
                                  for label in runs[0][1])
                print(f"{size} {precision} {name}: {statistics.median(r[0] for r in runs):.2f} "
                      f"ms with events, {statistics.median(without[name]):.2f} without | "
                      f"{spans}", flush=True)
        del pair, mask, out
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
