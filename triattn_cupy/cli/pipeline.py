"""The batch job of `triattn-infer`: plan the outputs, then read, compute and write.

How a run is organised (one process, threads):

    reader thread(s)  -> ready queue -> one worker per device -> write queue -> writer thread
    (read, check, convert       (GPU: TriangleAttention     (atomic write: temp file
     to float32 into pinned      built once per device;      + os.replace)
     host memory)                CPU: NumPy reference)

The queues are short, so reading the next file overlaps the computation of the current
one, and writing overlaps both, while host memory stays bounded. The main thread only
plans, shows progress and reports. A problem with one file fails that file alone; the run
goes on, and the exit status says whether anything failed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.resources
import json
import logging
import os
import queue
import signal
import threading
import time

from .._version import __version__
from .io import (InputError, existing_output_state, input_kind, is_infer_output,
                 output_path, read_input, remove_quietly, sha256_file, special_file_kind,
                 walk_inputs, write_output)
from .backends import (ComputeError, CpuBackend, GpuBackend, SetupError, gpu_probe,
                       precision_support)
from .report import Progress, report

logger = logging.getLogger("triattn_cupy.cli")

# Exit status of a run (documented in `triattn-infer --help`).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_END = object()  # end of a queue's stream


@dataclasses.dataclass
class Task:
    """One input to compute: `rel` names it in messages and mirrors it under the output
    folder."""

    input: str
    kind: str
    rel: str
    output: str = ""


@dataclasses.dataclass
class Outcome:
    input: str
    status: str  # "done" | "skipped" | "failed"
    reason: str = ""
    positions: int = 0
    device: str = ""
    not_input: bool = False  # a file found in a folder that is not an input (skipped)


@dataclasses.dataclass
class RunResult:
    exit_code: int
    outcomes: list
    seconds: float = 0.0
    devices: tuple = ()
    interrupted: bool = False
    not_processed: int = 0

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def positions(self) -> int:
        return sum(o.positions for o in self.outcomes if o.status == "done")

# --- the run --------------------------------------------------------------------------------

def run(args, *, summary: bool = True) -> RunResult:
    """Plan, compute and report one run described by parsed `args`. Raises SetupError
    when the run cannot start."""
    kind, devices = resolve_devices(args)
    precision = getattr(args, "precision", None)
    with contextlib.ExitStack() as stack:
        weights, weights_path, weights_sha = load_weights(args.weights, stack)
        output_dir = os.path.abspath(args.output_dir)
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise SetupError(f"--output-dir {output_dir} exists and is not a folder")
        tasks, outcomes = plan(args, output_dir, weights_sha)
        if not tasks and all(o.not_input for o in outcomes):
            logger.error("no input files found in %s", ", ".join(args.inputs))
            result = RunResult(EXIT_FAILED, outcomes)
            if summary and outcomes:
                report(result, output_dir, args.output_format)
            return result
        if not tasks:
            result = RunResult(_exit_code(outcomes, False), outcomes)
            if summary:
                report(result, output_dir, args.output_format)
            return result
        backends = make_backends(kind, devices, weights, args.fully_masked, precision)
        options = {"fully_masked": args.fully_masked, "precision": precision or "fp32",
                   "pair_key": args.pair_key, "mask_key": args.mask_key or "mask",
                   "output_format": args.output_format}
        common_attrs = {
            "weights_file": weights_path, "weights_sha256": weights_sha,
            "triattn_cupy_version": __version__, "fully_masked": args.fully_masked,
            "precision": options["precision"],
            "options": json.dumps(options, sort_keys=True)}
        pipeline = _Pipeline(backends, weights.pair_dim, args, common_attrs)
        progress = Progress(len(tasks), quiet=args.quiet)
        start = time.perf_counter()
        try:
            interrupted = pipeline.run(tasks, lambda o: (outcomes.append(o), progress.add(o)))
        finally:
            progress.close()
        seconds = time.perf_counter() - start
    result = RunResult(_exit_code(outcomes, interrupted), outcomes, seconds,
                       tuple(b.label for b in backends), interrupted)
    if interrupted:
        result.not_processed = len(tasks) - len(pipeline.seen)
    if summary:
        report(result, output_dir, args.output_format)
    return result


def _exit_code(outcomes, interrupted: bool) -> int:
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if any(o.status == "failed" for o in outcomes) else EXIT_OK


def resolve_devices(args) -> tuple[str, list]:
    """("cpu", []) or ("gpu", [device indices]) from --device / --devices."""
    precision = getattr(args, "precision", None)
    if args.device == "cpu":
        if args.devices is not None:
            raise SetupError("--devices selects GPUs and cannot be combined with "
                             "--device cpu")
        kind, devices = "cpu", []
    else:
        count, why = gpu_probe()
        if args.device == "auto" and args.devices is None and count == 0:
            logger.warning("no usable CUDA GPU (%s): running on the CPU with the NumPy "
                           "backend, which is much slower (--device cpu silences this)", why)
            kind, devices = "cpu", []
        else:
            if count == 0:
                flag = "--devices" if args.devices is not None else "--device gpu"
                raise SetupError(f"{flag} needs a CUDA GPU, but none is usable: {why}. "
                                 f"Use --device cpu for the NumPy backend")
            devices = list(range(count)) if args.devices == "all" else (args.devices or [0])
            missing = [d for d in devices if d >= count]
            if missing:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                note = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
                raise SetupError(
                    f"--devices: GPU {missing[0]} does not exist; this machine has {count} "
                    f"CUDA device{'s' if count > 1 else ''}{note}, indices 0 to {count - 1}")
            kind = "gpu"
    if kind == "cpu" and precision not in (None, "fp32"):
        raise SetupError(f"--precision {precision} needs the GPU backend; the CPU backend "
                         f"computes in float32 (fp32)")
    return kind, devices


def load_weights(path_arg, stack: contextlib.ExitStack):
    """(Weights, absolute path, SHA-256) of --weights or of the shipped default."""
    from .. import hdf5

    if path_arg is None:
        path = stack.enter_context(importlib.resources.as_file(hdf5.default_weights_path()))
        what = "the default weights"
    else:
        path, what = path_arg, "--weights"
    try:
        weights = hdf5.load_weights(path)
        sha = sha256_file(path)
    except (hdf5.WeightsFormatError, OSError) as exc:
        raise SetupError(f"cannot use {what}: {exc}") from None
    logger.debug("weights %s: pair_dim %d, %d heads, sha256 %s", path, weights.pair_dim,
                 weights.num_heads, sha)
    return weights, os.path.abspath(path), sha


def make_backends(kind, devices, weights, fully_masked, precision):
    """One backend per worker, each ready to compute (kernels compiled)."""
    if kind == "cpu":
        return [CpuBackend(weights, fully_masked)]
    _, where = precision_support()
    backends = []
    for device in devices:
        t0 = time.perf_counter()
        backend = GpuBackend(weights, device, fully_masked, precision, where)
        backend.warm_up()
        logger.debug("%s ready in %.2f s (kernels compiled)", backend.label,
                     time.perf_counter() - t0)
        backends.append(backend)
    return backends


# --- planning -------------------------------------------------------------------------------

def plan(args, output_dir: str, weights_sha: str):
    """(tasks to compute, outcomes decided without computing: failed or skipped)."""
    outcomes = []
    found = []  # (path, kind, rel, from_folder)
    seen = set()
    for given in args.inputs:
        if os.path.isdir(given):
            files, passed_over = walk_inputs(given, args.recursive, exclude=output_dir)
            for path, reason in passed_over:
                logger.debug("%s: skipped: %s", path, reason)
                outcomes.append(Outcome(path, "skipped", reason, not_input=True))
            if not files:
                hint = ""
                if not args.recursive and any(e.is_dir() for e in os.scandir(given)):
                    hint = " (it has sub-folders: add --recursive)"
                logger.warning("%s: no input files (.npy, .npz, .h5, .hdf5) in this "
                               "folder%s", given, hint)
            entries = [(f, os.path.relpath(f, given), True) for f in files]
        elif os.path.isfile(given):
            entries = [(given, os.path.basename(given), False)]
        elif os.path.exists(given):  # a FIFO, socket or device: never opened
            reason = f"{special_file_kind(given)}, not a regular file; not opened"
            logger.warning("%s: skipped: %s", given, reason)
            outcomes.append(Outcome(given, "skipped", reason, not_input=True))
            continue
        else:
            outcomes.append(_fail(given, "no such file or folder"))
            continue
        for path, rel, from_folder in entries:
            real = os.path.realpath(path)
            if real in seen:
                continue  # named twice (a file and its folder): computed once
            seen.add(real)
            kind = input_kind(path)
            if kind is None:
                outcomes.append(_fail(path, "unsupported file type (expected .npy, .npz, "
                                            ".h5 or .hdf5)"))
            elif from_folder and is_infer_output(path):
                logger.debug("%s: an output of triattn-infer, not an input; ignored", path)
                outcomes.append(Outcome(path, "skipped", "an output of triattn-infer"))
            else:
                found.append(Task(os.path.abspath(path), kind, rel))
    if not found and all(o.not_input for o in outcomes):
        return [], outcomes

    inputs_real = {os.path.realpath(t.input): t.input for t in found}
    inputs_inode = {}
    for t in found:
        with contextlib.suppress(OSError):
            st = os.stat(t.input)
            inputs_inode[(st.st_dev, st.st_ino)] = t.input
    claimed = {}
    tasks, resumed, stale = [], [], []
    for task in found:
        task.output = output_path(output_dir, task.rel, args.output_format)
        real_out = os.path.realpath(task.output)
        victim = inputs_real.get(real_out)
        if victim is None and os.path.exists(task.output):
            st = os.stat(task.output)
            victim = inputs_inode.get((st.st_dev, st.st_ino))
        if victim is not None:
            outcomes.append(_fail(task.input, f"its output {task.output} would overwrite the "
                                              f"input {victim}; choose another --output-dir"))
            continue
        if real_out in claimed:
            outcomes.append(_fail(task.input, f"its output {task.output} is also the output "
                                              f"of {claimed[real_out]}; rename one of them"))
            continue
        claimed[real_out] = task.input
        state, attrs = existing_output_state(task.output, args.output_format)
        if state == "foreign":
            outcomes.append(_fail(task.input, f"{task.output} exists and is not an output of "
                                              f"triattn-infer; refusing to replace it"))
            continue
        if state == "broken":
            logger.warning("%s exists but cannot be read (not a complete output); it will be "
                           "recomputed", task.output)
        elif state == "complete" and not args.overwrite:
            resumed.append(task)
            outcomes.append(Outcome(task.input, "skipped", "output exists"))
            made = (attrs.get("weights_sha256"), attrs.get("fully_masked"),
                    attrs.get("precision"))
            if attrs and made != (weights_sha, args.fully_masked,
                                  getattr(args, "precision", None) or "fp32"):
                stale.append(task.output)
            continue
        tasks.append(task)
    if resumed:
        logger.info("resuming: %d of %d output%s exist already and are skipped "
                    "(--overwrite recomputes them)", len(resumed), len(found),
                    "s" if len(found) > 1 else "")
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        logger.warning("%d existing output%s were made with other weights or options and "
                       "were kept (--overwrite recomputes them): %s", len(stale),
                       "s" if len(stale) > 1 else "", shown)
    return tasks, outcomes


def _fail(path, reason) -> Outcome:
    logger.error("%s: %s", path, reason)
    return Outcome(path, "failed", reason)


# --- the pipeline ---------------------------------------------------------------------------

class _Pipeline:
    """Readers -> workers (one per backend) -> one writer, joined by short queues."""

    def __init__(self, backends, pair_dim: int, args, common_attrs: dict):
        self.backends = backends
        self.pair_dim = pair_dim
        self.pair_key = args.pair_key
        self.mask_key = args.mask_key or "mask"
        self.mask_key_given = args.mask_key is not None
        self.output_format = args.output_format
        self.common_attrs = common_attrs
        self.stop = threading.Event()
        self.live_temps = set()  # temporary outputs being written, for a last clean-up
        self.seen = set()  # inputs that reached an outcome
        n = len(backends)
        self.tasks = queue.Queue()
        self.ready = queue.Queue(maxsize=n)  # read, waiting for a worker
        self.written = queue.Queue(maxsize=n)  # computed, waiting for the writer
        self.results = queue.Queue()
        self.lock = threading.Lock()
        self.readers_left = n
        self.workers_left = n

    def run(self, tasks, on_outcome) -> bool:
        """Compute `tasks`, calling `on_outcome` (in this thread) for each; True when
        interrupted by Ctrl-C (the first finishes the file in hand and starts no other;
        a second quits at once)."""
        for task in tasks:
            self.tasks.put(task)
        threads = [threading.Thread(target=self._reader, args=(i,), daemon=True,
                                    name=f"triattn-read-{i}")
                   for i in range(len(self.backends))]
        threads += [threading.Thread(target=self._worker, args=(b,), daemon=True,
                                     name=f"triattn-compute-{i}")
                    for i, b in enumerate(self.backends)]
        threads.append(threading.Thread(target=self._writer, name="triattn-write",
                                        daemon=True))
        with self._first_ctrl_c_stops():
            try:
                for t in threads:
                    t.start()
                while True:
                    try:
                        item = self.results.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    if item is _END:
                        break
                    self.seen.add(item.input)
                    on_outcome(item)
                return self.stop.is_set()
            finally:
                self.stop.set()
                for t in threads:
                    if t.ident is not None:  # (started)
                        t.join(timeout=1.0)
                for tmp in list(self.live_temps):  # only after a second Ctrl-C mid-write
                    remove_quietly(tmp)

    @contextlib.contextmanager
    def _first_ctrl_c_stops(self):
        """While the pipeline runs, the first Ctrl-C (SIGINT) sets `stop` instead of
        raising KeyboardInterrupt; a second raises it. Caught where it landed instead, a
        KeyboardInterrupt could land in any step of this thread (a thread's start, an
        except clause) and escape the handler: the run then quit with the file in hand
        still a temporary, or hung at exit (1 in 5 runs of
        test_ctrl_c_signal_finishes_the_file_in_hand on a loaded machine). Where SIGINT
        is ignored, or this is not the main thread (signal handlers belong to it), nothing
        changes."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
            yield
            return

        def on_ctrl_c(signum, frame):
            if self.stop.is_set():  # second Ctrl-C (or already stopping): leave now
                raise KeyboardInterrupt
            self.stop.set()
            logger.error("interrupted: finishing the file in hand, then stopping "
                         "(Ctrl-C again to quit at once)")

        previous = signal.signal(signal.SIGINT, on_ctrl_c)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _report(self, task, status, reason="", positions=0, device=""):
        self.results.put(Outcome(task.input, status, reason, positions, device))

    def _put(self, q, item) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _reader(self, index: int):
        backend = self.backends[index]
        alloc = backend.alloc  # pinned memory is "portable": usable by every device
        try:
            backend.thread_init()
            while not self.stop.is_set():
                try:
                    task = self.tasks.get_nowait()
                except queue.Empty:
                    break
                t0 = time.perf_counter()
                try:
                    loaded = read_input(task.input, task.kind, pair_dim=self.pair_dim,
                                        pair_key=self.pair_key, mask_key=self.mask_key,
                                        mask_required=self.mask_key_given, alloc=alloc)
                except InputError as exc:
                    self._fail(task, str(exc))
                    continue
                except MemoryError:
                    self._fail(task, "too large to read into host memory")
                    continue
                except Exception as exc:  # a bug, not the file: keep the traceback
                    logger.debug("reading %s", task.input, exc_info=True)
                    self._fail(task, f"internal error while reading: "
                                     f"{type(exc).__name__}: {exc}")
                    continue
                loaded.read_seconds = time.perf_counter() - t0
                if not self._put(self.ready, (task, loaded)):
                    break
        finally:
            with self.lock:
                self.readers_left -= 1
                last = self.readers_left == 0
            if last:
                for _ in self.backends:
                    self.ready.put(_END)

    def _worker(self, backend):
        try:
            backend.thread_init()
            while True:
                item = self.ready.get()
                if item is _END:
                    break
                if self.stop.is_set():
                    continue  # interrupted: drop what was read
                task, loaded = item
                item = None
                meta = {"input_file": task.input, "input_dtype": loaded.source_dtype,
                        "input_shape": list(loaded.pair.shape),
                        "mask_used": loaded.mask is not None, "device": backend.label}
                positions = loaded.positions
                t0 = time.perf_counter()
                try:
                    out = backend.compute(loaded)
                except ComputeError as exc:
                    self._fail(task, str(exc))
                    continue
                except Exception as exc:
                    logger.debug("computing %s on %s", task.input, backend.label,
                                 exc_info=True)
                    self._fail(task, f"{backend.label} failed: {type(exc).__name__}: {exc}")
                    continue
                finally:
                    loaded = None  # give the (pinned) input buffer back
                meta["compute_seconds"] = time.perf_counter() - t0
                if not self._put(self.written, (task, meta, out, positions)):
                    break
        finally:
            with self.lock:
                self.workers_left -= 1
                last = self.workers_left == 0
            if last:
                self.written.put(_END)

    def _writer(self):
        try:
            while True:
                item = self.written.get()
                if item is _END:
                    break
                if self.stop.is_set():
                    continue
                task, meta, out, positions = item
                item = None
                attrs = dict(self.common_attrs)
                attrs.update(meta)
                attrs["input_shape"] = json.dumps(attrs["input_shape"])
                attrs["created_utc"] = datetime.datetime.now(
                    datetime.timezone.utc).isoformat(timespec="seconds")
                try:
                    write_output(task.output, out, self.output_format, attrs, self.live_temps)
                except BaseException as exc:  # Ctrl-C included: the temp file is gone
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        self.stop.set()
                        reason = "interrupted while writing the output; nothing was written"
                    else:
                        reason = (f"cannot write the output {task.output}: "
                                  f"{type(exc).__name__}: {exc}")
                    self._fail(task, reason)
                    continue
                finally:
                    out = None
                logger.debug("%s -> %s (%s, %.3f s)", task.input, task.output,
                             meta["device"], meta["compute_seconds"])
                self._report(task, "done", positions=positions, device=meta["device"])
        finally:
            self.results.put(_END)

    def _fail(self, task, reason):
        logger.error("%s: %s", task.input, reason)
        self._report(task, "failed", reason)
