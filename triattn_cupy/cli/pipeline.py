"""The batch job of `triattn-infer`: plan the outputs, then read, compute and write.

How a run is organised (one process, threads):

    reader thread(s)  -> ready queue -> one worker per device -> write queue -> writer thread
    (read, check, convert       (GPU: TriangleAttention     (atomic write: temp file
     to float32 into pinned      built once per device;      + os.replace)
     host memory)                CPU: NumPy reference)

The queues are short, so reading the next file overlaps the computation of the current
one, and writing overlaps both, while host memory stays bounded. Interrupted (the first
Ctrl-C or SIGTERM), a run starts no other file: each worker finishes the file it is
computing, the writer writes it and those computed already, and files read but not
started are dropped (their outputs are left for the next run). The main thread only
plans, shows progress and reports. A problem with one file fails that file alone; the run
goes on, and the exit status says whether anything failed. The steps themselves (read,
compute, write with provenance) are the functions of `filejob`, which the workers of a Dask
cluster run too (`cluster_tasks`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import logging
import os
import queue
import signal
import threading
import time

from .backends import (CpuBackend, GpuBackend, SetupError, gpu_probe,
                       precision_support)
from .claims import DEFAULT_TIMEOUT, ClaimConflict, Claims
from .filejob import FileFailed, JobSettings, compute_file, job_settings, read_file, write_file
from .outputs import remove_quietly, sha256_file
from .plan import Outcome, plan
from .report import Progress, report

logger = logging.getLogger("triattn_cupy.cli")

# Exit status of a run (documented in `triattn-infer --help`).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_END = object()  # end of a queue's stream


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
        claim_timeout = getattr(args, "claim_timeout", None) or DEFAULT_TIMEOUT
        tasks, outcomes = plan(args, output_dir, weights_sha, claim_timeout)
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
        scratch_gib = getattr(args, "max_scratch_gib", None)
        backends = make_backends(kind, devices, weights, args.fully_masked, precision,
                                 None if scratch_gib is None else int(scratch_gib * 2 ** 30))
        settings = job_settings(args, weights.pair_dim, weights_path, weights_sha,
                            weights.mask_layout)
        claims = stack.enter_context(Claims(claim_timeout))
        pipeline = _Pipeline(backends, settings, claims)
        progress = Progress(len(tasks), quiet=args.quiet)
        start = time.perf_counter()
        try:
            interrupted = pipeline.run(tasks, lambda o: (outcomes.append(o), progress.add(o)))
        finally:
            progress.close()
        seconds = time.perf_counter() - start
    if not interrupted:  # every task reaches an outcome: none may vanish unreported
        for task in tasks:
            if task.input not in pipeline.seen:
                outcomes.append(Outcome(task.input, "failed", "not processed: an internal "
                                        "error stopped a pipeline thread (see the log)"))
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


def make_backends(kind, devices, weights, fully_masked, precision, max_scratch_bytes=None):
    """One backend per worker, each ready to compute (kernels compiled). The CPU backend
    has no scratch limit (`max_scratch_bytes`: the GPU's)."""
    if kind == "cpu":
        return [CpuBackend(weights, fully_masked)]
    _, where = precision_support()
    backends = []
    for device in devices:
        t0 = time.perf_counter()
        backend = GpuBackend(weights, device, fully_masked, precision, where,
                             max_scratch_bytes=max_scratch_bytes)
        backend.warm_up()
        logger.debug("%s ready in %.2f s (kernels compiled)", backend.label,
                     time.perf_counter() - t0)
        backends.append(backend)
    return backends


# --- the pipeline ---------------------------------------------------------------------------

class _Pipeline:
    """Readers -> workers (one per backend) -> one writer, joined by short queues."""

    def __init__(self, backends, settings: JobSettings, claims: Claims):
        self.backends = backends
        self.claims = claims
        self.settings = settings
        self.stop = threading.Event()  # the first signal: start no other file
        self.quit = threading.Event()  # the run is over (a second signal): write no more
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
        interrupted by Ctrl-C or SIGTERM (the first finishes the files being computed,
        writes them and starts no other; a second quits at once)."""
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
                self.quit.set()
                for t in threads:
                    if t.ident is not None:  # (started)
                        t.join(timeout=1.0)
                for tmp in list(self.live_temps):  # only after a second Ctrl-C mid-write
                    remove_quietly(tmp)

    @contextlib.contextmanager
    def _first_ctrl_c_stops(self):
        """While the pipeline runs, the first Ctrl-C (SIGINT) or SIGTERM sets `stop`
        instead of ending the process; a second raises KeyboardInterrupt. The files being
        computed are finished and written, no other is started, temporary files are
        removed and claims released. Raised where it landed instead, a KeyboardInterrupt could hit any step
        of this thread (a thread's start, an except clause) and escape the handler,
        leaving the file in hand a temporary or hanging at exit. A signal that is
        ignored keeps being ignored; outside the main thread (signal handlers belong to
        it) nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum, frame):
            if self.stop.is_set():  # the second signal (or already stopping): leave now
                raise KeyboardInterrupt
            self.stop.set()
            name = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
            logger.error("%s: finishing the file in hand (its computation and its output), "
                         "starting no other, then stopping with exit status %d (Ctrl-C or "
                         "SIGTERM again to quit at once, losing it)", name, EXIT_INTERRUPTED)

        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, on_signal)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _report(self, task, status, reason="", positions=0, device=""):
        self.claims.release(task.output)
        self.results.put(Outcome(task.input, status, reason, positions, device))

    def _claim(self, task) -> bool:
        """Claim the output of `task` for this run; False (with the outcome reported)
        when another run holds it or has written it since this run planned."""
        try:
            holder = self.claims.acquire(task.output)
        except OSError as exc:  # a folder that cannot be created or written
            self._fail(task, f"cannot claim the output {task.output}: "
                             f"{type(exc).__name__}: {exc}")
            return False
        except ClaimConflict as exc:
            self._fail(task, f"{exc} (conflict)")
            return False
        if holder is not None:
            logger.info("%s: skipped: its output is %s", task.input, holder)
            self.results.put(Outcome(task.input, "skipped", f"output {holder}"))
            return False
        try:
            now = os.stat(task.output).st_mtime_ns
        except OSError:
            now = None
        if now != task.output_mtime:  # by another run that held the claim until now
            logger.info("%s: skipped: its output was written by another run meanwhile",
                        task.input)
            self._report(task, "skipped", "output written by another run meanwhile")
            return False
        return True

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
            self._read_tasks(backend, alloc)
        except Exception:
            logger.exception("reader thread %d stopped by an internal error", index)
        finally:
            with self.lock:
                self.readers_left -= 1
                last = self.readers_left == 0
            if last:
                for _ in self.backends:
                    self.ready.put(_END)

    def _read_tasks(self, backend, alloc):
        backend.thread_init()
        while not self.stop.is_set():
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                break
            if not self._claim(task):
                continue
            try:
                loaded = read_file(task, self.settings, alloc)
            except FileFailed as exc:
                self._fail(task, str(exc))
                continue
            if not self._put(self.ready, (task, loaded)):
                break

    def _worker(self, backend):
        try:
            backend.thread_init()
            while True:
                item = self.ready.get()
                if item is _END:
                    break
                if self.stop.is_set():
                    continue  # interrupted: drop what was read but not started
                task, loaded = item
                item = None
                positions = loaded.positions
                try:
                    out, meta = compute_file(task, loaded, backend)
                except FileFailed as exc:
                    self._fail(task, str(exc))
                    continue
                finally:
                    loaded = None  # give the (pinned) input buffer back
                # Once computed, the file is in hand: written even if interrupted
                # meanwhile (the writer takes everything until the workers end).
                self.written.put((task, meta, out, positions))
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
                task, meta, out, positions = item
                item = None
                if self.quit.is_set():  # quit at once: what is not written yet is lost
                    continue
                try:
                    write_file(task, out, meta, self.settings, self.live_temps)
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
                self._report(task, "done", positions=positions, device=meta["device"])
        finally:
            self.results.put(_END)

    def _fail(self, task, reason):
        outcome = Outcome(task.input, "failed", reason)
        logger.error("%s: %s", task.input, outcome.reason)
        self._report(task, "failed", outcome.reason)
