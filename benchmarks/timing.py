"""Timing: device events after warm-up, the median/min/max of enough runs, within a budget.

A timer hides where the events come from: `TorchCudaTimer` (torch.cuda.Event, for the
PyTorch systems), `CupyTimer` (cupy.cuda.Event, for ours) or `WallTimer` (perf_counter, for
--device cpu and the offline tests). Each run is bracketed by two events on the current
stream and followed by a device synchronize, so a sample is the device time of one whole
forward pass, host launch gaps included (what a caller waits for).
"""
from __future__ import annotations

import statistics
import time

from . import roofline


class WallTimer:
    """Host clock; no device. For --device cpu and tests."""
    name = "wall"

    class _Event:
        t = 0.0

        def record(self, stream=None):
            self.t = time.perf_counter()

    def event(self):
        return self._Event()

    def elapsed_ms(self, a, b) -> float:
        return (b.t - a.t) * 1e3

    def synchronize(self):
        pass


class TorchCudaTimer:
    name = "torch.cuda.Event"

    def __init__(self):
        import torch
        self._torch = torch

    def event(self):
        return self._torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, a, b) -> float:
        return float(a.elapsed_time(b))

    def synchronize(self):
        self._torch.cuda.synchronize()


class CupyTimer:
    name = "cupy.cuda.Event"

    def __init__(self):
        import cupy
        self._cupy = cupy

    def event(self):
        return self._cupy.cuda.Event()

    def elapsed_ms(self, a, b) -> float:
        return float(self._cupy.cuda.get_elapsed_time(a, b))

    def synchronize(self):
        self._cupy.cuda.Device().synchronize()


def measure(fn, timer, *, target_s: float = 0.5, min_reps: int = 3, max_reps: int = 50,
            budget_s: float | None = None, first_call=None) -> dict:
    """Time `fn(i)` (i = run index, for rotating inputs) after warm-up.

    1. A first call, untimed (compilation, autotuning, allocator growth): `first_call_s`.
       `first_call(fn)` replaces it when given (ours measures its memory there).
    2. One timed call estimates the cost. If it is under 50 ms, more untimed warm-up calls
       follow (at least 2, about 0.1 s) and the estimate is dropped; a longer call is already
       warm (the GPU clocks ramp within it) and counts as the first sample.
    3. Timed runs until `reps` samples: about target_s of device time, between min_reps and
       max_reps, and no more than what is left of budget_s.
    Returns ms (median), ms_min, ms_max, ms_mean, runs, ms_all, wall_ms (median host time of a
    run, synchronize included), first_call_s, warmup_calls.
    """
    start = time.perf_counter()
    if first_call is not None:
        first_call(fn)
    else:
        fn(0)
    timer.synchronize()
    first_call_s = time.perf_counter() - start

    samples, walls = [], []

    def timed(i):
        a, b = timer.event(), timer.event()
        w0 = time.perf_counter()
        a.record()
        out = fn(i)
        b.record()
        timer.synchronize()
        walls.append((time.perf_counter() - w0) * 1e3)
        del out
        samples.append(timer.elapsed_ms(a, b))

    timed(1)
    est_s = max(samples[0] / 1e3, 1e-6)
    warmup_calls = 1
    if est_s < 0.05:
        n_warm = min(50, max(2, int(0.1 / est_s)))
        for i in range(n_warm):
            fn(2 + i)
        timer.synchronize()
        warmup_calls += n_warm
        samples.clear()
        walls.clear()

    reps = int(target_s / est_s)
    reps = max(min_reps, min(max_reps, reps))
    if budget_s is not None:
        left = budget_s - (time.perf_counter() - start)
        reps = max(min_reps, min(reps, int(left / est_s)))
    i = 100
    while len(samples) < reps:
        timed(i)
        i += 1

    return {"ms": statistics.median(samples), "ms_min": min(samples), "ms_max": max(samples),
            "ms_mean": statistics.fmean(samples), "runs": len(samples),
            "ms_all": [round(s, 5) for s in samples], "wall_ms": statistics.median(walls),
            "first_call_s": round(first_call_s, 4), "warmup_calls": warmup_calls,
            "timer": timer.name}


def time_stages(launchers, timer, *, reps: int = 5) -> list[dict]:
    """Per-stage device time of `launchers` [(name, callable)], called in order `reps` times
    after one warm-up pass; an event between consecutive stages."""
    for _, launch in launchers:
        launch()
    timer.synchronize()
    per_stage = [[] for _ in launchers]
    for _ in range(reps):
        events = [timer.event() for _ in range(len(launchers) + 1)]
        events[0].record()
        for k, (_, launch) in enumerate(launchers):
            launch()
            events[k + 1].record()
        timer.synchronize()
        for k in range(len(launchers)):
            per_stage[k].append(timer.elapsed_ms(events[k], events[k + 1]))
    return [{"name": name, "ms": statistics.median(t), "ms_min": min(t), "ms_max": max(t),
             "runs": len(t)} for (name, _), t in zip(launchers, per_stage)]


class Predictor:
    """Predicts a system's time at a size from its last measured size, scaled by FLOPs.

    Good at large N, where time follows the N^3 term; pessimistic from small sizes, where
    launch overhead dominates (which only makes the budget check cautious for one step).
    """

    def __init__(self):
        self._last = {}

    @staticmethod
    def work(size) -> float:
        return float(roofline.forward_flops(size.B, size.N, size.D, size.h))

    def observe(self, system: str, size, ms: float):
        self._last[system] = (self.work(size), ms)

    def predict_ms(self, system: str, size) -> float | None:
        last = self._last.get(system)
        if last is None:
            return None
        return last[1] * self.work(size) / last[0]


def over_budget(pred_ms: float | None, budget_s: float, min_reps: int) -> str | None:
    """Why a (system, size) is skipped for time, or None: the first call plus min_reps timed
    runs at the predicted time would exceed budget_s."""
    if pred_ms is None:
        return None
    cost_s = (1 + min_reps) * pred_ms / 1e3
    if cost_s > budget_s:
        return (f"time: predicted {pred_ms / 1e3:.3g} s per call, {cost_s:.3g} s for "
                f"{1 + min_reps} calls > per-system budget {budget_s:g} s")
    return None
