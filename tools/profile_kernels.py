"""Where a forward's time goes, kernel by kernel, under Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --metrics sm__warps_active.avg.pct_of_peak_sustained_active --csv \\
        python tools/profile_kernels.py 1x384x128x4 1x1024x128x4 > kernels.csv
    python tools/profile_kernels.py --summarize kernels.csv

Each size and precision is run (and compiled) outside the profiled range first; then one
forward runs between cudaProfilerStart and cudaProfilerStop, under an NVTX range named
"size precision [blocked]", so that ncu profiles exactly its kernels. `--blocked` adds a
row-blocked forward at each size (the blocks of `--row-block` rows). `--summarize` reads
ncu's CSV and prints, per forward, each kernel's duration, its share of the forward, its
compute (SM) and DRAM throughput as a share of the peak, and the achieved occupancy.

Where each kernel's warps stall, instruction by instruction (the sampled stall reasons of
ncu's source page; `--stalls` prints the reasons' shares and the busiest instructions):

    ncu --profile-from-start off --clock-control none -k regex:attention -c 1 \\
        --section SourceCounters --section WarpStateStats -o attention \\
        python tools/profile_kernels.py 1x1024x128x4 --precisions bf16
    ncu -i attention.ncu-rep --page source --csv --print-source sass > attention_sass.csv
    python tools/profile_kernels.py --stalls attention_sass.csv

The pair is standard normal, the last N // 10 rows and columns masked (tools/time_forward.py).
Under ncu every kernel runs alone with its caches flushed: the durations are each kernel's
own, a little above its share of an event-timed forward, where the next kernel's launch
overlaps the previous one's tail.
"""
import argparse
import collections
import csv
import io
import re
import sys


def profile(sizes, precisions, blocked, row_block):
    import cupy as cp
    from cupy.cuda import nvtx, profiler

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from time_forward import padded_inputs

    for size in sizes:
        module, pair, mask = padded_inputs(size)
        out = cp.empty_like(pair)
        N = int(size.split("x")[1])
        variants = [("", {"max_scratch_bytes": 1 << 62})]
        if blocked:
            variants.append(("blocked", {"row_block": row_block or max(N // 4, 1)}))
        for precision in precisions:
            for label, kw in variants:
                for _ in range(2):  # compiled, planned and warm outside the range
                    module(pair, mask, out=out, precision=precision, **kw)
                cp.cuda.Device().synchronize()
                name = f"{size} {precision} {label}".strip()
                profiler.start()
                nvtx.RangePush(name)
                module(pair, mask, out=out, precision=precision, **kw)
                nvtx.RangePop()
                cp.cuda.Device().synchronize()
                profiler.stop()
                print(f"profiled {name}", file=sys.stderr, flush=True)
        del module, pair, mask, out
        cp.get_default_memory_pool().free_all_blocks()


_METRICS = {
    "gpu__time_duration.sum": "us",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "mem%",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
}
_SECTION_NAMES = {  # the SpeedOfLight section's names for the same metrics (--page details)
    "Duration": "us", "Compute (SM) Throughput": "sm%", "Memory Throughput": "mem%",
    "DRAM Throughput": "dram%", "Achieved Occupancy": "occ%",
}


def _range_name(row):
    """The NVTX push/pop range a kernel ran in (ncu --nvtx: a column whose name holds
    "Push/Pop_Range", its value "<pid>  "<default domain>:NAME:none:..."")."""
    for column, value in row.items():
        if column and "Push/Pop_Range" in column and value:
            found = re.search(r"<default domain>:(.*?):none", value)
            return found.group(1) if found else value.strip()
    return ""


def summarize(path):
    """Print ncu's CSV (--csv, details or raw page) as one table per forward."""
    text = open(path).read()
    start = text.find('"ID"')
    if start < 0:
        sys.exit(f"{path}: no ncu CSV table (a line starting with \"ID\") in it")
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels = collections.OrderedDict()  # (range, id) -> {"name":, metric: value}
    for row in rows:
        key = (_range_name(row), row["ID"])
        entry = kernels.setdefault(key, {"name": row.get("Kernel Name", "?")})
        if "Metric Name" in row:  # details page: a row per metric
            label = _SECTION_NAMES.get(row["Metric Name"]) or _METRICS.get(row["Metric Name"])
            if label:
                value = float(row["Metric Value"].replace(",", ""))
                unit = row.get("Metric Unit", "")
                if label == "us":
                    value *= {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0,
                              "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
                entry[label] = value
        else:  # raw page: a column per metric
            for metric, label in _METRICS.items():
                if metric in row and row[metric] not in ("", "n/a"):
                    value = float(row[metric].replace(",", ""))
                    entry[label] = value * 1e-3 if label == "us" else value
    forwards = collections.OrderedDict()
    for (rng, _), entry in kernels.items():
        forwards.setdefault(rng, []).append(entry)
    for rng, entries in forwards.items():
        total = sum(e.get("us", 0.0) for e in entries)
        print(f"\n{rng or '(no range)'}: {total / 1e3:.3f} ms in {len(entries)} kernels")
        print("| kernel | us | share | SM % | memory % | DRAM % | occupancy % |")
        print("|---|---|---|---|---|---|---|")
        for e in entries:
            name = e["name"].split("(")[0]
            print(f"| {name} | {e.get('us', 0):.1f} | {100 * e.get('us', 0) / total:.0f}% | "
                  f"{e.get('sm%', 0):.0f} | {e.get('mem%', 0):.0f} | {e.get('dram%', 0):.0f} | "
                  f"{e.get('occ%', 0):.0f} |")


def stalls(path, top=12):
    """Print where each kernel's warps stall, from ncu's source page (--page source --csv
    --print-source sass; a "Kernel Name" line, then a table, per kernel): the share of the
    stall samples by reason over the kernel, the instruction mix per trip of its main
    loop, then the instructions holding the most samples, each with the instruction
    before it and its leading reasons."""
    lines = open(path).read().splitlines()
    starts = [n for n, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    if not starts:
        sys.exit(f"{path}: no ncu source page in it (a line starting with \"Kernel Name\")")
    for first, end in zip(starts, starts[1:] + [len(lines)]):
        name = next(csv.reader([lines[first]]))[1]
        _kernel_stalls(name, list(csv.DictReader(lines[first + 1:end])), top)


def _number(text):
    """ncu's number ("1,234.5"); 0 where a cell is empty or not a number."""
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def _kernel_stalls(name, rows, top):
    samples = "Warp Stall Sampling (All Samples)"
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]

    # samples under a reason the table has no column for (the wgmma's issue stall, on
    # sm_90) count as "unnamed"
    def reasons_of(r):
        named = [(_number(r[c]), c[6:]) for c in reasons]
        return named + [(_number(r[samples]) - sum(n for n, _ in named), "unnamed")]

    total = sum(_number(r[samples]) for r in rows) or 1.0
    by_reason = collections.Counter()
    for r in rows:
        for n, reason in reasons_of(r):
            by_reason[reason] += n
    print(f"\n{name}: {len(rows)} instructions, {total:.0f} stall samples\n")
    print("by reason: " + ", ".join(f"{reason} {100 * n / total:.1f}%"
                                    for reason, n in by_reason.most_common() if n / total >= 0.005)
          + "\n")
    # The instruction mix per trip of the main loop: executions by opcode over the count
    # of the loop, taken as the execution count that carries the most executions (a loop
    # body's instructions run equally often; a wait's spin runs more often but is short,
    # the set-up is long but runs once)
    counts = collections.Counter(_number(r.get("Instructions Executed", "")) for r in rows)
    trips = max((n for n in counts if n), key=lambda n: n * counts[n], default=1.0)
    mix = collections.Counter()
    for r in rows:
        words = [w for w in r["Source"].split() if not w.startswith("@")]
        if words:
            mix[words[0].split(".")[0]] += _number(r.get("Instructions Executed", "")) / trips
    print(f"per trip of the main loop ({trips:.0f} trips, the set-up shared out): "
          f"{sum(mix.values()):.1f} instructions; "
          + ", ".join(f"{op} {n:.1f}" for op, n in mix.most_common(12)) + "\n")
    print("| share | instruction | the one before it | executed | leading reasons |")
    print("|---|---|---|---|---|")
    text = [" ".join(r["Source"].split()) for r in rows]  # in address order
    for n in sorted(range(len(rows)), key=lambda n: -_number(rows[n][samples]))[:top]:
        lead = sorted(reasons_of(rows[n]), reverse=True)[:3]
        why = ", ".join(f"{reason} {100 * k / total:.1f}%" for k, reason in lead
                        if k / total >= 0.001)
        before = f"`{text[n - 1]}`" if n else ""
        print(f"| {100 * _number(rows[n][samples]) / total:.1f}% | `{text[n]}` | {before} | "
              f"{rows[n].get('Instructions Executed', '')} | {why} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sizes", nargs="*", default=["2x128x64x4", "1x384x128x4", "1x1024x128x4"],
                    help="BxNxDxh")
    ap.add_argument("--precisions", default="fp32,tf32,bf16")
    ap.add_argument("--blocked", action="store_true", help="also a row-blocked forward")
    ap.add_argument("--row-block", type=int, help="rows per block for --blocked (N // 4)")
    ap.add_argument("--summarize", metavar="CSV", help="print ncu's CSV output as tables")
    ap.add_argument("--stalls", metavar="CSV",
                    help="print where each kernel's warps stall (ncu's source page, SASS)")
    args = ap.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
    elif args.stalls:
        stalls(args.stalls)
    else:
        profile(args.sizes, args.precisions.split(","), args.blocked, args.row_block)


if __name__ == "__main__":
    main()
