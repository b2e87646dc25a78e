"""The report of a benchmark run: results.json (enriched), results.md, time_vs_n.png,
memory_vs_n.png, and the compact summary printed at the end.

Everything derives from the raw results dict (see common.Recorder), so a report can be
rebuilt from a saved JSON without a GPU:

    python3 benchmarks/report.py benchmarks/results/NVIDIA-H200/results.json
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks import roofline  # noqa: E402
from benchmarks.common import Recorder, parse_size  # noqa: E402

ORDER = ("ref_eager", "ref_eager_tf32", "ref_compile", "sdpa", "cueq_fp32", "cueq_bf16",
         "trifast_fp32", "trifast_bf16")
SHORT = {"ref_eager": "ref", "ref_eager_tf32": "ref_tf32", "ref_compile": "compile",
         "cueq_fp32": "cueq_fp32", "cueq_bf16": "cueq_bf16", "trifast_fp32": "trif_fp32",
         "trifast_bf16": "trif_bf16"}
STATUS_CELL = {"oom": "OOM", "skipped": "skip", "error": "err"}


def system_order(names) -> list[str]:
    names = list(dict.fromkeys(names))
    ours = sorted(n for n in names if n.startswith("ours"))
    ours.sort(key=lambda n: (n != "ours_fp32", n))
    known = [n for n in ORDER if n in names]
    rest = sorted(n for n in names if n not in ours and n not in known)
    return ours + known + rest


def rank(names):
    """Sort key placing systems in report order."""
    order = {n: i for i, n in enumerate(system_order(names))}
    return lambda n: order.get(n, len(order))


def fmt_ms(x) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def fmt_g(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


def fmt_err(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _size_key(text):
    try:
        return parse_size(text).key
    except ValueError:
        return (math.inf, text)


def ceilings_of(data) -> dict:
    c = dict(roofline.NOMINAL_H200)
    for k in c:
        v = (data.get("ceilings") or {}).get(k)
        if isinstance(v, (int, float)) and v > 0:
            c[k] = float(v)
    return c


def classes_of(data, system) -> tuple[str, str]:
    info = data.get("systems", {}).get(system, {})
    if system.startswith("ours"):  # from the mode, as the current code runs it
        return roofline.precision_classes(system, info.get("precision"))
    cls = info.get("classes")
    if isinstance(cls, (list, tuple)) and len(cls) == 2 and all(c in roofline.CLASSES
                                                                for c in cls):
        return cls[0], cls[1]
    return roofline.precision_classes(system, info.get("precision"))


def enrich(data) -> dict:
    """Adds to every timed run: GFLOP, GB, TFLOPs, GBps, the floor and the fractions of the
    ceilings. Idempotent."""
    ceil = ceilings_of(data)
    for r in data.get("runs", []):
        if r.get("status") != "ok" or not r.get("ms"):
            continue
        B, N, D, h = r["B"], r["N"], r["D"], r["h"]
        core, proj = classes_of(data, r["system"])
        a = roofline.achieved(B, N, D, h, r["ms"])
        f = roofline.floor_ms(B, N, D, h, ceil, core=core, proj=proj)
        r.update(GFLOP=roofline.forward_flops(B, N, D, h) / 1e9,
                 GB=roofline.min_bytes(B, N, D) / 1e9, TFLOPs=a["TFLOPs"], GBps=a["GBps"],
                 floor_ms=f["floor_ms"], bound=f["bound"], over_floor=r["ms"] / f["floor_ms"],
                 of_compute_ceiling=a["TFLOPs"] / roofline.rate(ceil, core),
                 of_copy_ceiling=a["GBps"] / ceil["copy_GBps"], classes=[core, proj])
    return data


def _runs_by(data):
    table = {}
    for r in data.get("runs", []):
        table[(r["system"], r["size"])] = r
    return table


def _sizes(data):
    return sorted({r["size"] for r in data.get("runs", [])}, key=_size_key)


def _timed_systems(data):
    names = {r["system"] for r in data.get("runs", [])}
    return system_order(names)


def _cell(r, key="ms", fmt=fmt_ms):
    if r is None:
        return ""
    if r.get("status") == "ok":
        return fmt(r.get(key))
    return STATUS_CELL.get(r.get("status"), r.get("status", "?"))


def _table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def label_of(data, system):
    return data.get("systems", {}).get(system, {}).get("label") or system


def best_other(data, size, exclude_prefix="ours"):
    """(system, ms) of the fastest non-ours system at a size, or None."""
    best = None
    for r in data.get("runs", []):
        if (r["size"] == size and r.get("status") == "ok"
                and not r["system"].startswith(exclude_prefix)):
            if best is None or r["ms"] < best[1]:
                best = (r["system"], r["ms"])
    return best


def markdown(data) -> str:
    enrich(data)
    meta = data.get("meta", {})
    runs = _runs_by(data)
    sizes = _sizes(data)
    systems = _timed_systems(data)
    ceil = ceilings_of(data)
    L = [f"# Triangle self-attention benchmark: {meta.get('gpu', '?')}", ""]
    L.append(f"Run {meta.get('date_utc', '?')}, commit {str(meta.get('git_commit'))[:12]}"
             f"{' (dirty)' if meta.get('git_dirty') else ''}, {meta.get('wall_s', '?')} s. "
             f"Whole-module forward, fp32 in and out, 10% of positions padded; time is the "
             f"median of CUDA-event runs after warm-up (min-max and counts under All runs).")
    L.append("")

    L += ["## Time per forward (ms)", ""]
    header = ["size BxNxDxh"] + [label_of(data, s) for s in systems]
    L += _table(header, [[sz] + [_cell(runs.get((s, sz))) for s in systems] for sz in sizes])
    L += ["", "OOM: out of device memory; skip: not run (reason under All runs); "
              "err: failed (error under All runs).", ""]

    L += ["## Peak device memory (GiB above the inputs)", ""]
    L += _table(header, [[sz] + [_cell(runs.get((s, sz)), "peak_GiB", lambda x: fmt_g(x))
                                 for s in systems] for sz in sizes])
    L += ["", "PyTorch systems: torch.cuda.max_memory_allocated() less the allocation before "
              "the first call. Ours: the high-water mark of CuPy's pool's used bytes during "
              "the module's construction and first forward, less the bytes used before "
              "(the same quantity; docs/performance.md).", ""]

    L += ["## Throughput (counted TFLOP/s)", ""]
    L += _table(header, [[sz] + [_cell(runs.get((s, sz)), "TFLOPs", lambda x: fmt_g(x))
                                 for s in systems] for sz in sizes])
    L += [""]

    for s in [s for s in systems if s.startswith("ours")]:
        core, proj = classes_of(data, s)
        L += [f"## {label_of(data, s)} against the roofline", ""]
        rows = []
        for sz in sizes:
            r = runs.get((s, sz))
            if r is None:
                continue
            if r.get("status") != "ok":
                rows.append([sz, _cell(r)] + [""] * 7)
                continue
            other = best_other(data, sz)
            rows.append([
                sz, f"{fmt_ms(r['ms'])} ({fmt_ms(r['ms_min'])}-{fmt_ms(r['ms_max'])}, "
                    f"{r['runs']})",
                fmt_g(r["TFLOPs"]), f"{100 * r['of_compute_ceiling']:.0f}%",
                fmt_g(r["GBps"], 4), f"{100 * r['of_copy_ceiling']:.1f}%",
                f"{fmt_ms(r['floor_ms'])} ({r['bound']})", f"{r['over_floor']:.2f}",
                f"{other[0]} {fmt_ms(other[1])} ({other[1] / r['ms']:.2f}x)" if other else "-"])
        L += _table(["size", "ms (min-max, runs)", "TFLOP/s", f"of {core} ceiling", "GB/s",
                     "of copy", "floor ms", "time/floor", "fastest other (its time / ours)"],
                    rows)
        L += ["", f"Floor: counted FLOPs at the measured {core} rate (projections at {proj}) "
                  f"or the compulsory bytes at the copy rate, whichever is larger.", ""]

    stage_rows = [st for st in data.get("stages", []) if st.get("stages")]
    if stage_rows:
        L += ["## Our stages (ms, median; share of their sum)", ""]
        for s in system_order({st["system"] for st in stage_rows}):
            mine = sorted((st for st in stage_rows if st["system"] == s),
                          key=lambda st: _size_key(st["size"]))
            names = list(dict.fromkeys(x["name"] for st in mine for x in st["stages"]))
            rows = []
            for st in mine:
                by = {x["name"]: x for x in st["stages"]}
                rows.append([st["size"]] + [
                    f"{fmt_ms(by[n]['ms'])} ({100 * by[n]['share']:.0f}%)" if n in by else ""
                    for n in names] + [fmt_ms(st["sum_ms"]), fmt_ms(st["forward_ms"])])
            L += [f"{label_of(data, s)}:", ""]
            L += _table(["size"] + names + ["sum", "forward"], rows)
            L += [""]
        L += _attention_core_table(data, stage_rows)
    stage_errors = [st for st in data.get("stages", []) if st.get("error")]
    for st in stage_errors:
        L.append(f"- stages of {st['system']} at {st['size']}: {st['error']}")
    if stage_errors:
        L.append("")

    acc = data.get("accuracy", [])
    if acc:
        L += ["## Accuracy (relative L2 error against the float64 reference)", ""]
        acc_sizes = sorted({a["size"] for a in acc}, key=_size_key)
        acc_systems = system_order({a["system"] for a in acc})
        by = {(a["system"], a["size"]): a for a in acc}
        rows = []
        for s in acc_systems:
            cells = []
            for sz in acc_sizes:
                a = by.get((s, sz))
                if a is None:
                    cells.append("")
                elif "rel_l2" in a:
                    mark = "ok" if a.get("ok") else "FAIL"
                    extra = f", {a['nonfinite']} non-finite" if a.get("nonfinite") else ""
                    cells.append(f"{fmt_err(a['rel_l2'])} {mark}{extra}")
                else:
                    cells.append("err")
            tol = next((by[(s, sz)].get("tolerance") for sz in acc_sizes
                        if (s, sz) in by), None)
            rows.append([label_of(data, s)] + cells + [fmt_err(tol)])
        L += _table(["system"] + acc_sizes + ["bound"], rows)
        errs = [a for a in acc if a.get("error")]
        if errs:
            L.append("")
            L += [f"- {a['system']} at {a['size']}: {a['error']}" for a in errs]
        L += ["", "Inputs drawn on the host from a fixed seed, identical for every system; "
                  "'spec_float64' is the spec module in float64 on the GPU against the NumPy "
                  "float64 reference (checks the weight loading).", ""]

    c = data.get("ceilings", {})
    L += ["## Ceilings of this GPU", ""]
    rows = [[src] + [fmt_g(fig.get(k), 4) for k in roofline.NOMINAL_H200]
            for src, fig in (c.get("by_source") or {}).items()]
    rows.append(["used"] + [fmt_g(ceil[k], 4) + (" (assumed)" if k in c.get("assumed", [])
                                                 else "") for k in roofline.NOMINAL_H200])
    L += _table(["source", "copy GB/s (read+write)", "fp32 TFLOP/s", "TF32 TFLOP/s",
                 "bf16 TFLOP/s"], rows)
    if c.get("errors"):
        L += [""] + [f"- {k}: {v}" for k, v in c["errors"].items()]
    L += [""]

    L += ["## Systems", ""]
    rows = []
    for s in system_order(data.get("systems", {}).keys()):
        info = data["systems"][s]
        rows.append([s, info.get("label", s), "yes" if info.get("available") else "no",
                     info.get("why_absent") or ""])
    L += _table(["name", "what", "available", "why not"], rows)
    L += [""]

    L += ["## Plots", "", "![time against N](time_vs_n.png)", "",
          "![peak memory against N](memory_vs_n.png)", ""]

    L += ["## All runs", ""]
    rows = []
    by_rank = rank(r["system"] for r in data.get("runs", []))
    for r in sorted(data.get("runs", []), key=lambda r: (_size_key(r["size"]),
                                                          by_rank(r["system"]))):
        if r.get("status") == "ok":
            rows.append([r["size"], r["system"], "ok", fmt_ms(r["ms"]), fmt_ms(r["ms_min"]),
                         fmt_ms(r["ms_max"]), r["runs"], fmt_g(r.get("first_call_s")),
                         fmt_g(r.get("peak_GiB")), fmt_g(r.get("TFLOPs")),
                         fmt_g(r.get("GBps"), 4), _md_escape(r.get("note") or "")])
        else:
            rows.append([r["size"], r["system"], r.get("status"), "", "", "", "", "", "", "",
                         "", _md_escape(r.get("error") or r.get("note") or "")])
    L += _table(["size", "system", "status", "median ms", "min", "max", "runs",
                 "first call s", "peak GiB", "TFLOP/s", "GB/s", "note"], rows)
    L += [""]

    L += ["## Environment", ""]
    tc = meta.get("torch_cuda") or {}
    cp = meta.get("cupy") or {}
    smi = meta.get("nvidia_smi") or {}
    env_rows = [["GPU", f"{meta.get('gpu')} ({tc.get('sms', '?')} SMs, "
                        f"{tc.get('memory_GiB', '?')} GiB, cc {tc.get('compute_capability')})"],
                ["driver", smi.get("driver_version") or cp.get("cuda_driver")],
                ["CUDA runtime (CuPy) / torch CUDA",
                 f"{cp.get('cuda_runtime')} / {tc.get('torch_cuda')}"],
                ["clocks at start (SM, max SM, mem)",
                 f"{smi.get('clocks.sm')}, {smi.get('clocks.max.sm')}, {smi.get('clocks.mem')}"],
                ["spec module", meta.get("spec_module")],
                ["phases (s)", ", ".join(f"{k} {v}" for k, v in
                                         (meta.get("phases") or {}).items())]]
    env_rows += [[k, v] for k, v in sorted((meta.get("versions") or {}).items())]
    L += _table(["what", "value"], [[a, _md_escape(str(b))] for a, b in env_rows])
    if data.get("notes"):
        L += ["", "Notes:", ""] + [f"- {_md_escape(n)}" for n in data["notes"]]
    L += ["", f"Command: `{' '.join(meta.get('argv') or [])}`", ""]
    return "\n".join(L)


def _attention_core_table(data, stage_rows) -> list[str]:
    """Our attention stage alone: its counted FLOPs (q k^T and p v) over its time, against
    the ceiling of the mode's class and against the TF32 tensor-core ceiling."""
    ceil = ceilings_of(data)
    rows = []
    for s in system_order({st["system"] for st in stage_rows}):
        core, _ = classes_of(data, s)
        for st in sorted((st for st in stage_rows if st["system"] == s),
                         key=lambda st: _size_key(st["size"])):
            by = {x["name"]: x for x in st["stages"]}
            if "attention" not in by or not by["attention"].get("ms"):
                continue
            B, N, D, h = map(int, st["size"].split("x"))
            tflops = roofline.attention_core_flops(B, N, D) / (by["attention"]["ms"] * 1e9)
            rows.append([label_of(data, s), st["size"], fmt_ms(by["attention"]["ms"]),
                         fmt_g(tflops), f"{100 * tflops / roofline.rate(ceil, core):.0f}% "
                         f"({core})", f"{100 * tflops / ceil['tf32_TFLOPs']:.0f}%"])
    if not rows:
        return []
    return ["## Our attention core against the ceilings", ""] + _table(
        ["system", "size", "attention ms", "TFLOP/s", "of its class ceiling",
         "of TF32 ceiling"], rows) + [
        "", "Counted FLOPs of q k^T and p v (4 B N^3 D) over the attention stage's time. The "
            "fp32 mode runs them as split products on tensor cores, three per counted one: "
            "fp16 hi + lo (class fp32x3: a third of the bf16 ceiling), on wgmma from N = "
            "129 at head dim 32, on mma.sync below. The "
            "tf32 mode runs one fp16 product of scaled operands on wgmma (class f16: TF32's "
            "bits at the bf16 rate), TF32 products below; the bf16 mode fp16 operands with S "
            "in fp16 (f16s) from N = 384 where the persistent projections write slot rows "
            "(D = 128), else from N = 768.", ""]


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# -- plots -------------------------------------------------------------------------------

def _main_group(data):
    """(B, D, h) with the most timed sizes: the plots' x axis is N within it."""
    counts = {}
    for r in data.get("runs", []):
        key = (r["B"], r["D"], r["h"])
        counts.setdefault(key, set()).add(r["N"])
    if not counts:
        return None
    return max(counts, key=lambda k: (len(counts[k]), -k[0], k[1]))


def make_plots(data, out_dir) -> dict:
    """time_vs_n.png and memory_vs_n.png; {} (and a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        data.setdefault("notes", []).append(f"no plots: matplotlib not importable ({exc})")
        return {}
    enrich(data)
    group = _main_group(data)
    if group is None:
        return {}
    B, D, h = group
    out_dir = pathlib.Path(out_dir)
    gpu = data.get("meta", {}).get("gpu", "")
    systems = _timed_systems(data)
    cmap = plt.get_cmap("tab10")
    colors = {s: cmap(i % 10) for i, s in enumerate(systems)}
    written = {}

    def series(system, key):
        pts = sorted((r["N"], r.get(key)) for r in data["runs"]
                     if r["system"] == system and (r["B"], r["D"], r["h"]) == group
                     and r.get("status") == "ok" and r.get(key))
        return [p[0] for p in pts], [p[1] for p in pts]

    def style(s):
        ours = s.startswith("ours")
        return dict(color=colors[s], lw=2.6 if ours else 1.4, marker="o" if ours else ".",
                    ms=6 if ours else 5, ls="-" if ours or "bf16" not in s else "--")

    for key, fname, ylabel, title in (
            ("ms", "time_vs_n.png", "time per forward (ms)", "time"),
            ("peak_GiB", "memory_vs_n.png", "peak device memory above inputs (GiB)",
             "peak memory")):
        fig, ax = plt.subplots(figsize=(8.5, 5.5))
        all_n = set()
        for s in systems:
            xs, ys = series(s, key)
            if not xs:
                continue
            all_n.update(xs)
            failed = sorted({r["N"] for r in data["runs"] if r["system"] == s
                             and (r["B"], r["D"], r["h"]) == group and r["status"] == "oom"})
            lab = label_of(data, s) + (f" (OOM at N={','.join(map(str, failed))})"
                                       if failed else "")
            ax.plot(xs, ys, label=lab, **style(s))
        if key == "ms" and all_n:
            ceil = ceilings_of(data)
            ns = sorted(all_n)
            for cls, ls in (("fp32", ":"), ("bf16", "-.")):
                fl = [roofline.floor_ms(B, n, D, h, ceil, core=cls)["floor_ms"] for n in ns]
                ax.plot(ns, fl, color="gray", ls=ls, lw=1,
                        label=f"floor at the {cls} ceiling ({fmt_g(ceil[cls + '_TFLOPs'])} "
                              f"TFLOP/s)")
        if key == "peak_GiB":
            total = (data.get("meta", {}).get("torch_cuda") or {}).get("memory_GiB")
            if total:
                ax.axhline(total, color="gray", ls=":", lw=1, label=f"device memory {total} GiB")
        if not all_n:
            plt.close(fig)
            continue
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted(all_n))
        ax.set_xticklabels([str(n) for n in sorted(all_n)])
        ax.set_xlabel("N (sequence length; pair is B x N x N x D)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"Triangle self-attention forward {title}, B={B} D={D} h={h}, {gpu}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper left")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=130)
        plt.close(fig)
        written[fname] = path
    return written


# -- the summary printed last ------------------------------------------------------------

def summary_text(data) -> str:
    enrich(data)
    runs = _runs_by(data)
    sizes = _sizes(data)
    systems = _timed_systems(data)
    meta = data.get("meta", {})
    out = [f"== triattn benchmark, {meta.get('gpu', '?')}: ms per forward (median) =="]
    heads = [SHORT.get(s, s) for s in systems]
    widths = [max(8, len(h)) for h in heads]
    out.append(f"{'size':<13}" + " ".join(f"{h:>{w}}" for h, w in zip(heads, widths)))
    for sz in sizes:
        cells = [_cell(runs.get((s, sz))) or "." for s in systems]
        out.append(f"{sz:<13}" + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    for s in [s for s in systems if s.startswith("ours")]:
        core, _ = classes_of(data, s)
        out.append(f"-- {s}: TFLOP/s, % of {core} ceiling, time/floor, stage shares")
        stages = {st["size"]: st for st in data.get("stages", []) if st["system"] == s
                  and st.get("stages")}
        for sz in sizes:
            r = runs.get((s, sz))
            if r is None or r.get("status") != "ok":
                continue
            st = stages.get(sz)
            shares = " ".join(f"{x['name']} {100 * x['share']:.0f}%" for x in st["stages"]) \
                if st else ""
            other = best_other(data, sz)
            vs = (f" | fastest other {SHORT.get(other[0], other[0])} takes "
                  f"{other[1] / r['ms']:.2f}x our time") if other else ""
            out.append(f"  {sz:<13} {fmt_g(r['TFLOPs']):>6} TF/s "
                       f"{100 * r['of_compute_ceiling']:4.0f}%  {r['over_floor']:5.2f}x floor"
                       f"{vs} | {shares}")
    acc = [a for a in data.get("accuracy", []) if a["system"] != "spec_float64"]
    if acc:
        first = acc[0]["size"]  # the first --acc-sizes entry
        cells = []
        by_rank = rank(a["system"] for a in acc)
        for a in sorted((a for a in acc if a["size"] == first),
                        key=lambda a: by_rank(a["system"])):
            if "rel_l2" in a:
                cells.append(f"{SHORT.get(a['system'], a['system'])} {fmt_err(a['rel_l2'])}"
                             f"{'' if a.get('ok') else ' FAIL'}")
            else:
                cells.append(f"{SHORT.get(a['system'], a['system'])} err")
        out.append(f"accuracy at {first} (rel L2 vs float64): " + ", ".join(cells))
    bad = [r for r in data.get("runs", []) if r.get("status") != "ok"]
    if bad:
        counts = {}
        for r in bad:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        out.append("not timed: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                   + " (reasons in results.md, All runs)")
    absent = [s for s, i in data.get("systems", {}).items() if not i.get("available")]
    if absent:
        out.append("absent: " + "; ".join(
            f"{s} ({(data['systems'][s].get('why_absent') or '')[:70]})" for s in absent))
    c = data.get("ceilings", {})
    ceil = ceilings_of(data)
    out.append("ceilings: copy {:.0f} GB/s, fp32 {:.1f}, tf32 {:.0f}, bf16 {:.0f} TFLOP/s{}".format(
        ceil["copy_GBps"], ceil["fp32_TFLOPs"], ceil["tf32_TFLOPs"], ceil["bf16_TFLOPs"],
        f" (assumed: {', '.join(c['assumed'])})" if c.get("assumed") else ""))
    return "\n".join(out)


def write_all(data, out_dir, *, plots: bool = True) -> dict:
    """Writes results.json, results.md and (if matplotlib imports) the two PNGs."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    enrich(data)
    written = {}
    if plots:
        written.update(make_plots(data, out_dir))
    md = out_dir / "results.md"
    md.write_text(markdown(data))
    written["results.md"] = md
    Recorder(out_dir / "results.json", data).save()
    written["results.json"] = out_dir / "results.json"
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild the report from a results.json.")
    ap.add_argument("results", help="results.json of a run")
    ap.add_argument("--out", help="output folder (default: the JSON's folder)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    path = pathlib.Path(args.results)
    data = json.loads(path.read_text())
    written = write_all(data, args.out or path.parent, plots=not args.no_plots)
    print(summary_text(data))
    print("written: " + ", ".join(map(str, written.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
