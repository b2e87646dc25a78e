"""Our package, timed: accuracy, whole forward, per-stage times and peak memory, per
precision mode (`triattn_cupy.PRECISIONS`; only fp32 if the package has no such attribute).

run.py calls `run_ours` in a child process by default, so that a sticky CUDA error in our
kernels (an illegal address, say) ends that process only: the PyTorch systems and the report
still run. The child imports CuPy and our package but not torch.

Peak memory. CuPy and PyTorch keep separate caching allocators, so torch's
max_memory_allocated cannot see ours. For ours the allocator is wrapped while the module is
built and runs its first forward: after every allocation it reads the default memory pool's
used_bytes() (bytes held by live arrays) and keeps the maximum. peak_GiB is that maximum
less the used bytes before the module existed: the live-array high-water mark of a forward
pass, output and scratch included, the inputs excluded, the same quantity as torch's
max_memory_allocated() - memory_allocated() for the PyTorch systems. Also recorded:
pool_growth_GiB (how much the pool grew: its reserved memory, with fragmentation) and
device_used_delta_GiB (the drop of cudaMemGetInfo's free memory, which also sees memory taken
outside CuPy's pool, e.g. by cuBLAS or the loaded kernels).
"""
from __future__ import annotations

import gc
import time

from . import timing
from .common import (ACCURACY_SEED, TIMING_SEED, TOLERANCE, host_inputs, is_fatal, is_oom,
                     log, make_weights, reference_output, rel_l2, rotation_copies, selected,
                     short_error)
from .roofline import precision_classes


# The route an A100 takes in each mode (mma.sync with the sm_80 tile tables), timed on this
# GPU as its stand-in where the package can force routes (system ours_<precision>_sm80)
SM80_ROUTES = {"fp32": "mma_f16x3@sm_80", "tf32": "mma_tf32@sm_80", "bf16": "mma_bf16@sm_80"}


def system_name(precision, route=None) -> str:
    return "ours_" + (str(precision) if precision else "fp32") + ("_sm80" if route else "")


def label(precision, route=None) -> str:
    return f"ours ({precision or 'fp32'}{', sm_80 route' if route else ''})"


def build(tc, weights, precision, route=None):
    """(module, call kwargs). precision=None: the package has a single (fp32) mode. The mode
    goes to the constructor if it takes it, else to each call; a forced route to each call."""
    forced = {"route": route} if route else {}
    if precision is None:
        return tc.TriangleAttention(weights), forced
    try:
        return tc.TriangleAttention(weights, precision=precision), forced
    except TypeError:
        return tc.TriangleAttention(weights), {"precision": precision, **forced}


class PoolPeak:
    """High-water mark of CuPy's default pool's used bytes, sampled after each allocation."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.pool = cupy.get_default_memory_pool()
        self.prev = None
        self.peak = self.pool.used_bytes()
        self.calls = 0

    def malloc(self, size):
        mem = self.prev(size)
        self.calls += 1
        used = self.pool.used_bytes()
        if used > self.peak:
            self.peak = used
        return mem

    def start(self):
        get = (getattr(self.cupy.cuda, "get_allocator", None)
               or getattr(getattr(self.cupy.cuda, "memory", None), "get_allocator", None))
        self.prev = get() if get else self.pool.malloc
        self.cupy.cuda.set_allocator(self.malloc)

    def stop(self):
        if self.prev is not None:
            self.cupy.cuda.set_allocator(self.prev)
            self.prev = None


def _free(cupy):
    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def _tolerance(name, precision):
    return TOLERANCE[precision_classes(name, precision)[0]]


def run_ours(args, rec, deadline: float):
    """Accuracy, then every size, for each of our precision modes; all into `rec`."""
    try:
        import cupy
        import triattn_cupy as tc
    except Exception as exc:  # noqa: BLE001
        rec.system("ours_fp32", label="ours (fp32)", kind="ours", available=False,
                   why_absent=f"not importable ({short_error(exc, 300)})")
        return
    precisions = tuple(getattr(tc, "PRECISIONS", None) or (None,))
    names = [(system_name(p), p, None) for p in precisions]
    if hasattr(tc, "gpu") and hasattr(getattr(tc.gpu, "routes", None), "ROUTES"):
        names += [(system_name(p, SM80_ROUTES[p]), p, SM80_ROUTES[p]) for p in precisions
                  if p in SM80_ROUTES]
    names = [(n, p, r) for n, p, r in names if selected(n, args.systems)]
    if not names:
        return
    why = None
    if not hasattr(tc, "TriangleAttention"):
        why = "triattn_cupy has no TriangleAttention"
    else:
        try:
            if not cupy.cuda.is_available():
                why = "no CUDA device visible to CuPy"
        except Exception as exc:  # noqa: BLE001
            why = f"CUDA unusable ({short_error(exc, 200)})"
    for n, p, r in names:
        rec.system(n, label=label(p, r), kind="ours", precision=p or "fp32",
                   available=why is None, why_absent=why,
                   classes=list(precision_classes(n, p)))
    if why:
        log.info("ours absent: %s", why)
        return

    from .envinfo import cupy_info
    info = cupy_info()
    info["triattn_cupy"] = getattr(tc, "__version__", None)
    info["precisions"] = [p or "fp32" for p in precisions]
    rec.data["meta"]["ours_env"] = info
    rec.save()
    timer = timing.CupyTimer()
    state = {"dead": None}

    # -- accuracy against the float64 reference ------------------------------------------
    for size in args.acc_sizes:
        pair, mask = host_inputs(size, ACCURACY_SEED)
        ref = reference_output(pair, mask, size.D, size.h)
        _, _, weights = make_weights(size.D, size.h)
        for n, p, r in names:
            row = {"system": n, "size": str(size), "tolerance": _tolerance(n, p)}
            if ref is None or weights is None:
                row["error"] = "no float64 reference (triattn_cupy.reference unavailable)"
            elif state["dead"]:
                row["error"] = state["dead"]
            else:
                try:
                    module, kw = build(tc, weights, p, r)
                    d_pair, d_mask = cupy.asarray(pair), cupy.asarray(mask)
                    out = cupy.full(pair.shape, cupy.nan, dtype=cupy.float32)  # poisoned
                    try:
                        res = module(d_pair, d_mask, out=out, **kw)
                    except TypeError:
                        res = module(d_pair, d_mask, **kw)
                    row.update(rel_l2(cupy.asnumpy(res), ref))
                    del module, d_pair, d_mask, out, res
                except Exception as exc:  # noqa: BLE001
                    row["error"] = short_error(exc)
                    if is_fatal(exc) or not _context_ok(cupy):
                        state["dead"] = f"CUDA context lost after {n} failed: {row['error']}"
            row["ok"] = bool(row.get("rel_l2", float("inf")) <= row["tolerance"])
            rec.add("accuracy", row)
            log.info("accuracy %-14s %-12s %s", n, size,
                     f"{row['rel_l2']:.2e}" if "rel_l2" in row else row.get("error"))
        _free(cupy)

    # -- timing, per size ----------------------------------------------------------------
    predictor = timing.Predictor()
    for size in sorted(args.sizes, key=lambda s: s.key):
        xs = mask = None
        try:
            if not state["dead"] and time.time() < deadline:
                rs = cupy.random.RandomState(TIMING_SEED)
                xs = [_normal_pair(cupy, rs, size) for _ in range(rotation_copies(size))]
                from .common import padding_mask
                mask = cupy.asarray(padding_mask(size.B, size.N))
        except Exception as exc:  # noqa: BLE001
            for n, _, _ in names:
                rec.add("runs", _row(n, size, "oom" if is_oom(exc) else "error",
                                     error=f"inputs: {short_error(exc)}"))
            xs = None
            _free(cupy)
            continue
        _, _, weights = make_weights(size.D, size.h)
        for n, p, r in names:
            row = _time_one(cupy, tc, timer, args, n, p, size, xs, mask, weights, predictor,
                            deadline, state, r)
            rec.add("runs", row["run"])
            if row.get("stages"):
                rec.add("stages", row["stages"])
            _log_row(row["run"])
        del xs, mask
        _free(cupy)


def _normal_pair(cupy, rs, size):
    """Standard-normal float32 (B, N, N, D) drawn in slabs of rows, each under 2^28 elements
    (N = 4096, D = 128 is 2^31 elements: no single cuRAND call of that length is needed)."""
    B, N, D = size.B, size.N, size.D
    x = cupy.empty((B, N, N, D), dtype=cupy.float32)
    rows = max(1, (1 << 28) // (N * D))
    for b in range(B):
        for i0 in range(0, N, rows):
            i1 = min(N, i0 + rows)
            x[b, i0:i1] = rs.standard_normal((i1 - i0, N, D), dtype=cupy.float32)
    return x


def _row(name, size, status, **extra):
    row = {"system": name, "size": str(size), "B": size.B, "N": size.N, "D": size.D,
           "h": size.h, "status": status}
    row.update(extra)
    return row


def _log_row(row):
    if row["status"] == "ok":
        log.info("time %-14s %-12s %9.3f ms [%.3f-%.3f, %d runs] peak %.2f GiB", row["system"],
                 row["size"], row["ms"], row["ms_min"], row["ms_max"], row["runs"],
                 row.get("peak_GiB") or 0.0)
    else:
        log.info("time %-14s %-12s %s: %s", row["system"], row["size"], row["status"],
                 row.get("error") or row.get("note"))


def _time_one(cupy, tc, timer, args, name, precision, size, xs, mask, weights, predictor,
              deadline, state, route=None):
    if state["dead"]:
        return {"run": _row(name, size, "skipped", note=state["dead"])}
    if xs is None or time.time() > deadline:
        return {"run": _row(name, size, "skipped", note="suite time budget")}
    if weights is None:
        return {"run": _row(name, size, "error", error="no Weights (triattn_cupy import)")}
    pred = predictor.predict_ms(name, size)
    reason = timing.over_budget(pred, args.system_budget, args.min_reps)
    if reason:
        return {"run": _row(name, size, "skipped", note=reason)}

    _free(cupy)
    pool = cupy.get_default_memory_pool()
    base_used, base_total = pool.used_bytes(), pool.total_bytes()
    free0 = cupy.cuda.runtime.memGetInfo()[0]
    tracker = PoolPeak(cupy)
    holder = {}
    row = _row(name, size, "error")
    result = {"run": row}
    try:
        tracker.start()
        try:
            module, kw = build(tc, weights, precision, route)
        except Exception:
            tracker.stop()
            raise
        holder["module"], holder["kw"] = module, kw
        k = len(xs)

        def fn(i):
            return module(xs[i % k], mask, **kw)

        def first_call(f):
            try:
                out = f(0)
                cupy.cuda.Device().synchronize()
                del out
            finally:
                tracker.stop()

        m = timing.measure(fn, timer, target_s=args.target_s, min_reps=args.min_reps,
                           max_reps=args.max_reps, budget_s=args.system_budget,
                           first_call=first_call)
        row.update(m)
        row["status"] = "ok"
        row["peak_GiB"] = (tracker.peak - base_used) / 2 ** 30
        row["pool_growth_GiB"] = (pool.total_bytes() - base_total) / 2 ** 30
        row["device_used_delta_GiB"] = (free0 - cupy.cuda.runtime.memGetInfo()[0]) / 2 ** 30
        row["alloc_calls_first_call"] = tracker.calls
        row["memory_method"] = "cupy pool used_bytes high-water mark (first call)"
        predictor.observe(name, size, m["ms"])
    except Exception as exc:  # noqa: BLE001
        tracker.stop()
        row["status"] = "oom" if is_oom(exc) else "error"
        row["error"] = short_error(exc)
        if is_fatal(exc) or not _context_ok(cupy):
            state["dead"] = f"CUDA context lost after {name} at {size}: {row['error']}"
        return result

    # -- per-stage times -------------------------------------------------------------------
    if hasattr(holder["module"], "stage_launchers") and time.time() < deadline:
        try:
            est_s = max(row["ms"] / 1e3, 1e-6)
            reps = max(3, min(args.stage_reps, int(0.5 * args.target_s / est_s)))
            launchers = holder["module"].stage_launchers(xs[0], mask, **holder["kw"])
            stages = timing.time_stages(launchers, timer, reps=reps)
            total = sum(s["ms"] for s in stages) or float("nan")
            for s in stages:
                s["share"] = s["ms"] / total
            result["stages"] = {"system": name, "size": str(size), "forward_ms": row["ms"],
                                "sum_ms": total, "stages": stages}
            del launchers
        except Exception as exc:  # noqa: BLE001
            result["stages"] = {"system": name, "size": str(size), "error": short_error(exc)}
            if is_fatal(exc) or not _context_ok(cupy):
                state["dead"] = f"CUDA context lost in {name}'s stages at {size}"
    holder.clear()
    return result


def _context_ok(cupy) -> bool:
    try:
        cupy.cuda.Device().synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False
