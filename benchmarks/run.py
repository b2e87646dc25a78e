#!/usr/bin/env python3
"""Benchmark suite: ours against the PyTorch reference and the peers, with the roofline.

One command on a GPU machine (under 8 minutes on an H200 with the default sizes):

    python3 benchmarks/run.py --peer-tar .peers/peer_site.tar.xz --out "$OUT"

Phases, in order (each one's wall time lands in results.json, meta.phases):
  1. environment and the ceilings of this GPU (device copy, fp32/TF32/bf16 GEMM);
  2. ours, in a child process (accuracy, then every size: time, stages, peak memory);
  3. the PyTorch systems and peers: accuracy, then every size;
  4. torch.compile of the reference, at N <= --compile-max-n, within what is left of --budget;
  5. the report: results.json, results.md, time_vs_n.png, memory_vs_n.png (and run.log).
A system that is absent, runs out of memory, fails or would not fit its time budget is
recorded as such; nothing of that kind stops the run.
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import ceilings as ceilings_mod  # noqa: E402
from benchmarks import envinfo, report, timing  # noqa: E402
from benchmarks.common import (ACCURACY_SEED, DEFAULT_ACC_SIZES, DEFAULT_SIZES,  # noqa: E402
                               QUICK_ACC_SIZES, QUICK_SIZES, TIMING_SEED, TOLERANCE,
                               Recorder, gpu_slug, host_inputs, is_fatal, is_oom, log,
                               parse_sizes, reference_output, rel_l2, rotation_copies,
                               selected, setup_logging, short_error)
from benchmarks.roofline import precision_classes  # noqa: E402

SYSTEM_NAMES = ("ours_<precision> (one per triattn_cupy.PRECISIONS; ours_fp32 without it)",
                "ours_<precision>_sm80 (the route an A100 takes, forced on this GPU)",
                "ref_eager", "ref_eager_tf32", "sdpa", "cueq_fp32", "cueq_bf16",
                "trifast_fp32", "trifast_bf16", "ref_compile")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="benchmarks/run.py",
        description="Time triangle self-attention: ours, the PyTorch reference (eager fp32, "
                    "TF32, torch.compile), SDPA, cuEquivariance and trifast; ceilings, "
                    "accuracy, peak memory; JSON + Markdown + PNG report.")
    ap.add_argument("--sizes", help=f"comma list of BxNxDxh (default: {DEFAULT_SIZES}; "
                                    f"with --quick: {QUICK_SIZES})")
    ap.add_argument("--acc-sizes", help=f"sizes of the accuracy check against the float64 "
                                        f"reference (default: {DEFAULT_ACC_SIZES}; 'none' "
                                        f"to skip)")
    ap.add_argument("--quick", action="store_true",
                    help="short run: 3 sizes, one accuracy size, fewer repeats, no compile")
    ap.add_argument("--systems", help="comma list of systems to run: names, globs or "
                                      "prefixes (e.g. 'ours,cueq,ref_eager'); default all")
    ap.add_argument("--list-systems", action="store_true", help="print the system names")
    ap.add_argument("--out", help="output folder (default benchmarks/results/<gpu-name>)")
    ap.add_argument("--peer-site", help="folder prepended to sys.path (the peers' unpacked "
                                        "wheels, see shared/peers/pack_peer_wheels.sh)")
    ap.add_argument("--peer-tar", help="peer_site.tar.xz to unpack into --peer-site "
                                       "(default /tmp/peer_site) first")
    ap.add_argument("--spec", help="path of the spec reference_module.py (default: "
                                   "../shared/spec, shared/spec, .shared/spec, then the copy "
                                   "in benchmarks/)")
    ap.add_argument("--budget", type=float, default=400.0,
                    help="wall-clock seconds for the whole run; what would start later is "
                         "recorded as skipped (default 400: with the last call started and "
                         "the report, the run ends within 8 minutes)")
    ap.add_argument("--system-budget", type=float, default=45.0,
                    help="seconds one system may spend on one size; a size predicted to "
                         "exceed it is skipped (default 45)")
    ap.add_argument("--ours-budget", type=float, default=150.0,
                    help="seconds for the phase that times ours (default 150)")
    ap.add_argument("--compile-max-n", type=int, default=384,
                    help="largest N timed with torch.compile (default 384)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--trifast-tune-max-n", type=int, default=2048,
                    help="above this CLOSEST_N trifast reuses its largest tuned config "
                         "instead of autotuning for minutes (default 2048)")
    ap.add_argument("--target-s", type=float, help="device seconds of timed runs per "
                                                   "system and size (default 0.5; quick 0.3)")
    ap.add_argument("--min-reps", type=int, default=3, help="fewest timed runs (default 3)")
    ap.add_argument("--max-reps", type=int, help="most timed runs (default 50; quick 10)")
    ap.add_argument("--stage-reps", type=int, default=10,
                    help="most timed passes over our stages (default 10)")
    ap.add_argument("--ceilings", choices=("measure", "nominal"), default="measure",
                    help="measure this GPU's ceilings, or take the H200 figures of the "
                         "peers' run (default measure)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the pipeline with host timers (tests)")
    ap.add_argument("--no-isolate", action="store_true",
                    help="time ours in this process instead of a child process")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    # Internal: the child process that times ours.
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    ap.add_argument("--_worker-out", dest="_worker_out", help=argparse.SUPPRESS)
    ap.add_argument("--_deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--_log", help=argparse.SUPPRESS)
    return ap


def parse_args(argv):
    args = build_parser().parse_args(argv)
    args.sizes = parse_sizes(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
    acc = args.acc_sizes if args.acc_sizes is not None else (
        QUICK_ACC_SIZES if args.quick else DEFAULT_ACC_SIZES)
    args.acc_sizes = [] if acc.strip().lower() in ("", "none") else parse_sizes(acc)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()] \
        if args.systems else None
    if args.target_s is None:
        args.target_s = 0.3 if args.quick else 0.5
    if args.max_reps is None:
        args.max_reps = 10 if args.quick else 50
    if args.quick:
        args.no_compile = True
    return args


# -- the child that times ours ---------------------------------------------------------------

def worker_main(args) -> int:
    from benchmarks.ours import run_ours
    setup_logging(args._log, tag="[ours] ")
    rec = Recorder(args._worker_out)
    rec.save()
    deadline = args._deadline or (time.time() + args.ours_budget)
    try:
        run_ours(args, rec, deadline)
    except Exception as exc:  # noqa: BLE001 - record, let the parent go on
        rec.note(f"ours worker failed: {short_error(exc, 1000)}")
        log.exception("ours worker failed")
        return 1
    return 0


def ours_phase(args, argv, rec, deadline, log_path):
    ours_deadline = min(deadline, time.time() + args.ours_budget)
    if args.no_isolate:
        from benchmarks.ours import run_ours
        run_ours(args, rec, ours_deadline)
        return
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="triattn-ours-"))
    out_json = tmp / "ours.json"
    cmd = [sys.executable, "-u", str(ROOT / "benchmarks" / "run.py"), *argv,
           "--_worker", "ours", "--_worker-out", str(out_json),
           "--_deadline", repr(ours_deadline)]
    if log_path:
        cmd += ["--_log", str(log_path)]
    for handler in log.handlers:  # the child appends to the same log
        try:
            handler.flush()
        except (OSError, ValueError):
            pass
    _free_parent_gpu_memory()
    proc = subprocess.Popen(cmd, cwd=str(ROOT))
    # A call already started may run past the deadline by up to one system budget.
    limit = max(30.0, ours_deadline - time.time() + args.system_budget + 60.0)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = f"killed after {limit:.0f} s"
    got = {}
    if out_json.is_file():
        try:
            got = json.loads(out_json.read_text())
        except Exception as exc:  # noqa: BLE001
            rec.note(f"ours worker's results unreadable: {short_error(exc)}")
    shutil.rmtree(tmp, ignore_errors=True)
    rec.merge(got)
    if rc != 0:
        rec.note(f"ours worker exited with {rc}")
        if not got.get("systems"):
            rec.system("ours_fp32", label="ours (fp32)", kind="ours", available=False,
                       why_absent=f"ours worker exited with {rc} (see run.log)")
        done = {(r["system"], r["size"]) for r in got.get("runs", [])}
        for name, info in got.get("systems", {}).items():
            if not info.get("available"):
                continue
            for size in args.sizes:
                if (name, str(size)) not in done:
                    rec.add("runs", _row(name, size, "error",
                                         error=f"ours worker exited with {rc} before this"))


def _free_parent_gpu_memory():
    """Give the device memory this process caches back before the child allocates."""
    gc.collect()
    if "torch" in sys.modules:
        try:
            if sys.modules["torch"].cuda.is_initialized():
                sys.modules["torch"].cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
    if "cupy" in sys.modules:
        try:
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
        except Exception:  # noqa: BLE001
            pass


# -- the PyTorch systems ---------------------------------------------------------------------

def _row(name, size, status, **extra):
    row = {"system": name, "size": str(size), "B": size.B, "N": size.N, "D": size.D,
           "h": size.h, "status": status}
    row.update(extra)
    return row


class TorchSide:
    """Runs the PyTorch systems (reference, SDPA, peers, torch.compile) on one device."""

    def __init__(self, args, rec, deadline, device):
        import torch
        from benchmarks import systems
        self.torch, self.systems = torch, systems
        self.args, self.rec, self.deadline, self.device = args, rec, deadline, device
        self.timer = timing.TorchCudaTimer() if device == "cuda" else timing.WallTimer()
        self.predictor = timing.Predictor()
        self.models = {}
        self.dead = None
        self.compile_times = []
        torch.set_grad_enabled(False)
        self.spec, spec_path = systems.load_spec(args.spec)
        rec.data["meta"]["spec_module"] = spec_path
        log.info("spec module: %s", spec_path)

    # -- helpers
    def model(self, size):
        key = (size.D, size.h)
        if key not in self.models:
            self.models[key] = self.systems.TorchModel(self.spec, size.D, size.h, self.device)
        return self.models[key]

    def free(self):
        """Return the memory of the last system to the device (a collection first: an
        exception's traceback or a cycle can hold tensors). Nothing to do on the CPU."""
        if self.device == "cuda":
            gc.collect()
            self.torch.cuda.empty_cache()

    def context_ok(self) -> bool:
        try:
            self.timer.synchronize()
            return True
        except Exception:  # noqa: BLE001
            return False

    def to_device(self, array):
        return self.torch.from_numpy(array).to(self.device)

    def register(self, systems):
        usable = []
        for s in systems:
            why = s.probe(self.device)
            if s.compile and self.args.no_compile:
                why = "disabled (--no-compile or --quick)"
            kind = "peer" if s.needs else "torch"
            self.rec.system(s.name, label=s.label, kind=kind, available=why is None,
                            why_absent=why, classes=list(precision_classes(s.name)),
                            tf32=s.tf32)
            if why is None:
                usable.append(s)
            else:
                log.info("%s absent: %s", s.name, why)
        return usable

    # -- accuracy
    def accuracy(self, systems, sizes, with_sanity=True):
        for size in sizes:
            pair, mask = host_inputs(size, ACCURACY_SEED)
            ref = reference_output(pair, mask, size.D, size.h)
            try:
                model = self.model(size)
                x, mk = self.to_device(pair), self.to_device(mask)
            except Exception as exc:  # noqa: BLE001
                for s in systems:
                    self.rec.add("accuracy", {"system": s.name, "size": str(size),
                                              "error": short_error(exc), "ok": False})
                continue
            if with_sanity:
                # The spec module in float64 on the device against the NumPy reference: checks
                # the weight loading and gives the reference when the NumPy one is missing.
                row = {"system": "spec_float64", "size": str(size), "tolerance": 1e-10}
                try:
                    out64 = model.double()(x.double(), mk.double()).cpu().numpy()
                    if ref is None:
                        ref = out64
                        row["error"] = "NumPy reference unavailable: spec float64 used instead"
                    else:
                        row.update(rel_l2(out64, ref))
                except Exception as exc:  # noqa: BLE001
                    row["error"] = short_error(exc)
                row["ok"] = bool(row.get("rel_l2", float("inf")) <= row["tolerance"])
                self.rec.add("accuracy", row)
                self.free()
            for s in systems:
                row = {"system": s.name, "size": str(size),
                       "tolerance": TOLERANCE[precision_classes(s.name)[0]]}
                if ref is None:
                    row["error"] = "no reference"
                elif self.dead:
                    row["error"] = self.dead
                elif s.compile and not self._compile_fits():
                    row["error"] = "skipped: suite time budget (compile)"
                else:
                    try:
                        fn = s.bind(model)
                        t0 = time.perf_counter()
                        with self.systems.matmul_precision(s.tf32):
                            out = fn(x, mk)
                            out = out.double().cpu().numpy()
                        if s.compile:
                            row["compile_s"] = round(time.perf_counter() - t0, 2)
                            self.compile_times.append(row["compile_s"])
                        row.update(rel_l2(out, ref))
                        del out
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = short_error(exc)
                        self._check_fatal(exc, s.name, size)
                row["ok"] = bool(row.get("rel_l2", float("inf")) <= row["tolerance"])
                self.rec.add("accuracy", row)
                log.info("accuracy %-14s %-12s %s", s.name, size,
                         f"{row['rel_l2']:.2e}" if "rel_l2" in row else row.get("error"))
                self.free()
            del x, mk
            self.free()

    def _check_fatal(self, exc, name, size):
        if is_fatal(exc) or (self.device == "cuda" and not self.context_ok()):
            self.dead = f"CUDA context lost after {name} at {size}: {short_error(exc, 200)}"
            log.error(self.dead)

    def _compile_fits(self) -> bool:
        expected = max(self.compile_times) if self.compile_times else 45.0
        return time.time() + expected < self.deadline

    # -- timing
    def time_sizes(self, systems, sizes):
        for size in sorted(sizes, key=lambda s: s.key):
            todo = [s for s in systems if not (s.compile and size.N > self.args.compile_max_n)]
            if not todo:
                continue
            if self.dead or time.time() > self.deadline:
                for s in todo:
                    self.rec.add("runs", _row(s.name, size, "skipped",
                                              note=self.dead or "suite time budget"))
                continue
            try:
                model = self.model(size)
                xs, mask = self.systems.device_inputs(size, self.device, TIMING_SEED,
                                                      rotation_copies(size))
            except Exception as exc:  # noqa: BLE001
                for s in todo:
                    self.rec.add("runs", _row(s.name, size, "oom" if is_oom(exc) else "error",
                                              error=f"inputs: {short_error(exc)}"))
                self.free()
                continue
            for s in todo:
                row = self.time_one(s, model, size, xs, mask)
                self.rec.add("runs", row)
                _log_run(row)
            del xs, mask
            self.free()

    def time_one(self, s, model, size, xs, mask):
        torch, args = self.torch, self.args
        if self.dead:
            return _row(s.name, size, "skipped", note=self.dead)
        if time.time() > self.deadline:
            return _row(s.name, size, "skipped", note="suite time budget")
        if s.compile and not self._compile_fits():
            return _row(s.name, size, "skipped", note="suite time budget (compile)")
        reason = timing.over_budget(self.predictor.predict_ms(s.name, size),
                                    args.system_budget, args.min_reps)
        if reason:
            return _row(s.name, size, "skipped", note=reason)
        note = None
        if s.name.startswith("trifast"):
            note, skip = self.systems.trifast_tuning(size.N, size.h, size.D // size.h,
                                                     dict(s.kwargs)["dtype"],
                                                     args.trifast_tune_max_n)
            if skip:
                return _row(s.name, size, "skipped", note=skip)
        row = _row(s.name, size, "error")
        if note:
            row["note"] = note
        base = 0
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        core = s.bind(model)
        k = len(xs)

        def fn(i):
            return core(xs[i % k], mask)

        try:
            with self.systems.matmul_precision(s.tf32):
                m = timing.measure(fn, self.timer, target_s=args.target_s,
                                   min_reps=args.min_reps, max_reps=args.max_reps,
                                   budget_s=args.system_budget)
            row.update(m)
            row["status"] = "ok"
            if self.device == "cuda":
                row["peak_GiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                row["reserved_peak_GiB"] = torch.cuda.max_memory_reserved() / 2 ** 30
                row["memory_method"] = "torch max_memory_allocated - memory_allocated before"
            if s.compile:
                row["compile_s"] = m["first_call_s"]
                self.compile_times.append(m["first_call_s"])
            self.predictor.observe(s.name, size, m["ms"])
        except Exception as exc:  # noqa: BLE001
            row["status"] = "oom" if is_oom(exc) else "error"
            row["error"] = short_error(exc)
            self._check_fatal(exc, s.name, size)
        finally:
            self.free()
        return row


def _log_run(row):
    if row["status"] == "ok":
        peak = row.get("peak_GiB")
        log.info("time %-14s %-12s %9.3f ms [%.3f-%.3f, %d runs]%s", row["system"],
                 row["size"], row["ms"], row["ms_min"], row["ms_max"], row["runs"],
                 f" peak {peak:.2f} GiB" if peak is not None else "")
    else:
        log.info("time %-14s %-12s %s: %s", row["system"], row["size"], row["status"],
                 row.get("error") or row.get("note"))


def torch_phases(args, rec, deadline, phases):
    """Phases 3 and 4: the PyTorch systems, then torch.compile."""
    from benchmarks import systems as systems_mod
    wanted = [s for s in systems_mod.TORCH_SYSTEMS if selected(s.name, args.systems)]
    if not wanted:
        return
    why = None
    try:
        import torch
        if args.device == "cuda" and not torch.cuda.is_available():
            why = "torch sees no CUDA device"
    except Exception as exc:  # noqa: BLE001
        why = f"torch not importable ({short_error(exc, 200)})"
    if why is None:
        try:
            side = TorchSide(args, rec, deadline, args.device)
        except Exception as exc:  # noqa: BLE001
            why = f"setup failed ({short_error(exc, 300)})"
    if why:
        for s in wanted:
            rec.system(s.name, label=s.label, available=False, why_absent=why,
                       kind="peer" if s.needs else "torch")
        log.info("PyTorch systems absent: %s", why)
        return
    usable = side.register(wanted)
    eager = [s for s in usable if not s.compile]
    compiled = [s for s in usable if s.compile]

    t0 = time.time()
    if eager:
        side.accuracy(eager, args.acc_sizes)
        side.time_sizes(eager, args.sizes)
    phases["torch_systems_s"] = round(time.time() - t0, 1)

    t0 = time.time()
    if compiled:
        side.accuracy(compiled, args.acc_sizes[:1], with_sanity=False)
        side.time_sizes(compiled, [s for s in args.sizes if s.N <= args.compile_max_n])
    phases["torch_compile_s"] = round(time.time() - t0, 1)


# -- the main process ------------------------------------------------------------------------

def _prepare_peers(args):
    if args.peer_tar:
        tar = pathlib.Path(args.peer_tar)
        dest = pathlib.Path(args.peer_site or "/tmp/peer_site")
        args.peer_site = str(dest)
        marker = dest / ".unpacked-from"
        stamp = f"{tar.resolve()} {tar.stat().st_size} {tar.stat().st_mtime_ns}"
        if not (marker.is_file() and marker.read_text() == stamp):
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tar) as tf:
                try:
                    tf.extractall(dest, filter="data")
                except TypeError:  # Python without extraction filters
                    tf.extractall(dest)
            marker.write_text(stamp)
    if args.peer_site:
        site = str(pathlib.Path(args.peer_site).resolve())
        if not pathlib.Path(site).is_dir():
            raise SystemExit(f"--peer-site {site}: no such folder")
        sys.path.insert(0, site)


def _wants_ours(patterns) -> bool:
    """Whether --systems can select any ours_* (the child knows the precision modes)."""
    return (not patterns or selected("ours_fp32", patterns)
            or any(p.startswith("ours") for p in patterns))


def _gpu_name(device) -> str:
    if device == "cpu":
        return "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    info = envinfo.cupy_info()
    return info.get("gpu") or "unknown-gpu"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._worker == "ours":
        return worker_main(args)
    if args.list_systems:
        print("\n".join(SYSTEM_NAMES))
        return 0

    started = time.time()
    deadline = started + args.budget
    _prepare_peers(args)
    gpu = _gpu_name(args.device)
    out_dir = pathlib.Path(args.out or ROOT / "benchmarks" / "results" / gpu_slug(gpu))
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "run.log"
    log_path.unlink(missing_ok=True)
    setup_logging(log_path)
    rec = Recorder(out_dir / "results.json")
    meta = rec.data["meta"]
    meta.update(envinfo.host_info(["benchmarks/run.py", *argv]))
    meta["gpu"] = gpu
    meta["gpu_slug"] = gpu_slug(gpu)
    meta["device"] = args.device
    meta["settings"] = {k: (list(map(str, v)) if isinstance(v, list) else v)
                        for k, v in vars(args).items() if not k.startswith("_")}
    phases = meta.setdefault("phases", {})
    log.info("triattn benchmark on %s; output in %s; budget %.0f s", gpu, out_dir, args.budget)
    try:
        t0 = time.time()
        meta["nvidia_smi"] = envinfo.nvidia_smi() if args.device == "cuda" else None
        meta["torch_cuda"] = envinfo.torch_cuda_info()
        meta["cupy"] = envinfo.cupy_info() if args.device == "cuda" else None
        if args.device == "cuda" and args.ceilings == "measure":
            rec.data["ceilings"] = ceilings_mod.measure()
        else:
            rec.data["ceilings"] = ceilings_mod.nominal(
                "--ceilings nominal" if args.device == "cuda" else "--device cpu")
        rec.save()
        phases["env_and_ceilings_s"] = round(time.time() - t0, 1)

        t0 = time.time()
        if _wants_ours(args.systems):
            ours_phase(args, argv, rec, deadline, log_path)
        phases["ours_s"] = round(time.time() - t0, 1)

        torch_phases(args, rec, deadline, phases)
    except KeyboardInterrupt:
        rec.note("interrupted")
    except Exception as exc:  # noqa: BLE001 - keep what was measured, write the report
        rec.note(f"benchmark aborted: {short_error(exc, 1000)}")
        log.exception("benchmark aborted")
    finally:
        meta["versions"] = envinfo.versions()
        t0 = time.time()
        meta["wall_s"] = round(time.time() - started, 1)
        rec.save()
        try:
            written = report.write_all(rec.data, out_dir, plots=not args.no_plots)
        except Exception as exc:  # noqa: BLE001
            written = {}
            log.exception("report failed: %s", short_error(exc))
        phases["report_s"] = round(time.time() - t0, 1)
        meta["wall_s"] = round(time.time() - started, 1)
        rec.save()
        print()
        print(report.summary_text(rec.data))
        print(f"total {meta['wall_s']:.0f} s; written: "
              + ", ".join(str(p) for p in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
