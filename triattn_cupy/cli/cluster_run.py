"""`triattn-infer` on a Dask cluster, the client's side: plan the run as a local run does,
submit one task per file (`cluster_tasks`), take the outcomes, report. `--scheduler` and
`--cluster` (`cluster`) and `triattn_cupy.distributed.infer_files` run it.

Interrupted (Ctrl-C, SIGTERM), the client cancels the files no worker has started, waits
for those in hand and reports them, as a local run finishes its file in hand.

This module imports Dask; `cluster` imports it only when a cluster is asked for.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid

from .._install import pip_install
from .._version import __version__
from . import pipeline
from .backends import SetupError, gpu_probe
from .claims import DEFAULT_TIMEOUT
from .filejob import job_settings
from .plan import Outcome, plan
from .report import Progress, report

try:
    import distributed as _distributed

    from . import cluster_tasks
except ImportError as _exc:  # the optional extra is missing: say so when used
    _distributed = cluster_tasks = None
    _IMPORT_ERROR = _exc
else:
    _IMPORT_ERROR = None

logger = logging.getLogger("triattn_cupy.cli")


def require_dask():
    """ImportError naming the extra to install, unless Dask's distributed is there."""
    if _IMPORT_ERROR is not None:
        raise ImportError(f"the batch on a Dask cluster needs Dask: "
                          f"{pip_install('distributed')} ({_IMPORT_ERROR})") from _IMPORT_ERROR


def run_batch(client, args, *, summary: bool = True):
    """Plan, compute on the cluster and report one run described by parsed `args` (the
    options of `triattn-infer`). Raises SetupError when the run cannot start."""
    require_dask()
    check_worker_versions(client)
    kind = resolve_cluster_device(client, args)
    precision = getattr(args, "precision", None)
    with contextlib.ExitStack() as stack:
        weights, weights_path, weights_sha = pipeline.load_weights(args.weights, stack)
    output_dir = os.path.abspath(args.output_dir)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise SetupError(f"--output-dir {output_dir} exists and is not a folder")
    claim_timeout = getattr(args, "claim_timeout", None) or DEFAULT_TIMEOUT
    tasks, outcomes = plan(args, output_dir, weights_sha, claim_timeout)
    if not tasks:
        if all(o.not_input for o in outcomes):
            logger.error("no input files found in %s", ", ".join(args.inputs))
            result = pipeline.RunResult(pipeline.EXIT_FAILED, outcomes)
        else:
            result = pipeline.RunResult(pipeline._exit_code(outcomes, False), outcomes)
        if summary and outcomes:
            report(result, output_dir, args.output_format)
        return result

    settings = job_settings(args, weights.pair_dim, weights_path, weights_sha,
                            weights.mask_layout)
    backend_spec = (weights_sha, kind, args.fully_masked, precision)
    scratch_gib = getattr(args, "max_scratch_gib", None)
    if scratch_gib is not None:  # (the GPU's scratch limit, where given)
        backend_spec += (int(scratch_gib * 2 ** 30),)
    run_key = uuid.uuid4().hex
    tasks.sort(key=_input_bytes, reverse=True)  # largest first: no long file last
    progress = Progress(len(tasks), quiet=args.quiet)
    start = time.perf_counter()
    interrupted = False
    futures, handled, by_key = [], set(), {}

    def take(future):
        handled.add(future.key)
        outcome = _outcome_of(future, by_key[future.key])
        outcomes.append(outcome)
        progress.add(outcome)

    try:
        with _sigterm_interrupts():
            weights_on_workers = client.submit(
                cluster_tasks.weights_as_result, weights, key=f"triattn-weights-{run_key}",
                priority=len(tasks) + 1, pure=False)
            for rank, task in enumerate(tasks):
                future = client.submit(
                    cluster_tasks.file_task, task, weights_on_workers, backend_spec,
                    settings, run_key, claim_timeout, key=f"triattn-file-{rank}-{run_key}",
                    priority=len(tasks) - rank, pure=False)
                futures.append(future)
                by_key[future.key] = task
            for future in _distributed.as_completed(futures):
                take(future)
    except KeyboardInterrupt:
        interrupted = True
        logger.error("interrupted: finishing the files in hand on the workers, then "
                     "stopping (Ctrl-C or SIGTERM again to quit at once)")
        try:
            with _sigterm_interrupts():
                _finish_in_hand(client, futures, handled, take)
        except KeyboardInterrupt:
            client.cancel(futures)
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    if not interrupted:
        cluster_tasks.remove_dead_temps(client, run_key)
    cluster_tasks.forget_run(client, run_key)
    done_on = [o.device for o in outcomes if o.status == "done" and o.device]
    result = pipeline.RunResult(pipeline._exit_code(outcomes, interrupted), outcomes,
                                seconds, tuple(sorted(set(done_on))), interrupted)
    if interrupted:
        result.not_processed = len(tasks) - len(handled)
    if summary:
        report(result, output_dir, args.output_format)
    return result


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM ends the run as Ctrl-C does (as in a local run): the files the workers have
    in hand are finished, nothing else starts. Only the main thread owns signals."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN):
        yield
        return

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _finish_in_hand(client, futures, handled, take) -> None:
    """After a first interrupt: cancel the files no worker has started, wait for those
    in hand (a worker's running and next file) and take their outcomes."""
    in_hand = {key for keys in client.processing().values() for key in keys}
    rest = [f for f in futures if f.key not in handled]
    client.cancel([f for f in rest if not f.done() and f.key not in in_hand])
    for future in _distributed.as_completed([f for f in rest
                                             if f.done() or f.key in in_hand]):
        if future.status != "cancelled":
            take(future)


def _input_bytes(task) -> int:
    try:
        return os.stat(task.input).st_size
    except OSError:
        return 0


def _outcome_of(future, task):
    if future.status == "finished":
        return future.result()
    try:
        exc = future.exception() if future.status == "error" else None
    except Exception as err:
        exc = err
    why = f"{type(exc).__name__}: {exc}" if exc is not None else f"task {future.status}"
    reason = f"the cluster could not compute it ({why})"
    logger.error("%s: %s", task.input, reason)
    return Outcome(task.input, "failed", reason)


def check_worker_versions(client) -> None:
    """SetupError unless every worker runs this client's version of triattn-cupy (the
    outputs, and what they record, are those of one version)."""
    versions = client.run(_package_version)
    if not versions:
        raise SetupError("the Dask cluster has no workers")
    other = {w: v for w, v in sorted(versions.items()) if v != __version__}
    if other:
        shown = ", ".join(f"{w}: {v}" for w, v in list(other.items())[:3])
        raise SetupError(f"{len(other)} of {len(versions)} workers run another version of "
                         f"triattn-cupy than this client ({__version__}): {shown}; install "
                         f"the same version everywhere")


def _package_version() -> str:
    from .._version import __version__ as version

    return version


def resolve_cluster_device(client, args) -> str:
    """"cpu" or "gpu" for the workers of `client`, from --device (auto: GPU when every
    worker has one, CPU when none has; a mix is an error, as its files would differ)."""
    require_dask()
    if getattr(args, "devices", None) is not None:
        raise SetupError("--devices selects GPUs of this host; on a cluster each worker "
                         "uses its own GPU (start one per GPU with `dask cuda worker`)")
    precision = getattr(args, "precision", None)
    if args.device == "cpu":
        kind = "cpu"
    else:
        probes = client.run(gpu_probe)
        if not probes:
            raise SetupError("the Dask cluster has no workers")
        without = {w: why for w, (count, why) in probes.items() if count == 0}
        if without:
            worker, why = sorted(without.items())[0]
            example = f"worker {worker}: {why}"
        if not without:
            kind = "gpu"
        elif args.device == "gpu":
            raise SetupError(
                f"--device gpu needs a CUDA GPU on every worker, but {len(without)} of "
                f"{len(probes)} have none ({example}); use GPU workers only, or --device cpu")
        elif len(without) < len(probes):
            raise SetupError(
                f"{len(probes) - len(without)} of {len(probes)} workers have a CUDA GPU and "
                f"{len(without)} have none ({example}); their outputs would differ: choose "
                f"--device gpu with GPU workers only, or --device cpu")
        else:
            logger.warning("no worker has a usable CUDA GPU: running on their CPUs with "
                           "the NumPy backend, which is much slower (--device cpu "
                           "silences this)")
            kind = "cpu"
    if kind == "cpu" and precision not in (None, "fp32"):
        raise SetupError(f"--precision {precision} needs the GPU backend; the CPU backend "
                         f"computes in float32 (fp32)")
    return kind
