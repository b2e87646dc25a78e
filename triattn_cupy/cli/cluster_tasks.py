"""The worker side of `triattn-infer` on a Dask cluster (`cluster_run`): the task that does
one file, what a worker process keeps between files, and the record of a run's claims and
temporary outputs on the scheduler.

A file's task claims its output, reads, computes and writes it through the local
pipeline's steps (`filejob`), so its output is the one a local run writes. A worker
process keeps one backend per (weights SHA-256, device kind, fully_masked, precision[,
max_scratch_bytes]), so the weights stay on its GPU and the kernels compiled from one
file to the next.

The scheduler's metadata holds, per run (`RUN_KEY`, run key):

    "claims", output, claims run id -> True  each attempt at a file, before it claims
    "temps", temporary file -> alive       each temporary output or claim file, before
                                           it is created

so that an attempt started after its worker was lost takes over that worker's claim, and
the client removes the temporary files of workers that died writing them.

This module imports Dask; only `cluster_run` imports it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading

import distributed

from .backends import CpuBackend, GpuBackend, SetupError, precision_support
from .claims import ClaimConflict, Claims
from .runfiles import claim_path, read_claim
from .filejob import FileFailed, compute_file, read_file, write_file
from .outputs import remove_quietly
from .plan import Outcome

logger = logging.getLogger("triattn_cupy.cli")

RUN_KEY = "triattn-cupy-run"


def weights_as_result(weights):
    """The task whose result carries the weights to the workers. A task's result lost
    with its workers is computed again; scattered data would be gone for good."""
    return weights


_backends = {}  # (weights sha, kind, fully_masked, precision[, max scratch]) -> _WorkerBackend
_backends_lock = threading.Lock()
_BACKENDS_KEPT = 4  # a long-lived worker serving runs with other weights drops the oldest


class _WorkerBackend:
    """A backend kept by a worker process for every file with the same weights. A GPU
    computes one file at a time (the worker's other threads read and write meanwhile)."""

    def __init__(self, backend):
        self.backend = backend
        self.label = backend.label
        self.alloc = backend.alloc
        self._lock = threading.Lock() if backend.kind == "gpu" else contextlib.nullcontext()

    def compute(self, loaded):
        with self._lock:
            self.backend.thread_init()
            return self.backend.compute(loaded)


def _worker_backend(weights, spec) -> _WorkerBackend:
    with _backends_lock:
        backend = _backends.get(spec)
        if backend is None:
            _, kind, fully_masked, precision, *scratch = spec
            if kind == "cpu":
                made = CpuBackend(weights, fully_masked)
            else:
                # One GPU per worker: the first visible one (dask-cuda sets
                # CUDA_VISIBLE_DEVICES so that it is the worker's own). Outputs name it
                # "GPU 0", as the worker's process sees it; the summary names the worker.
                _, where = precision_support()
                made = GpuBackend(weights, 0, fully_masked, precision, where,
                                  max_scratch_bytes=scratch[0] if scratch else None)
                made.warm_up()
            backend = _backends[spec] = _WorkerBackend(made)
            while len(_backends) > _BACKENDS_KEPT:
                del _backends[next(iter(_backends))]
        return backend


class RecordedTemps:
    """The `live_temps` of `write_output` and `Claims.acquire` on a worker: each
    temporary name is recorded on the scheduler before the file is created and marked gone
    after, so the client can remove the temporary file of a worker killed while writing
    it."""

    def __init__(self, client, run_key: str):
        self.client = client
        self.run_key = run_key

    def _mark(self, tmp: str, alive: bool):
        self.client.set_metadata([RUN_KEY, self.run_key, "temps", tmp], alive)

    def add(self, tmp: str):
        self._mark(tmp, True)

    def discard(self, tmp: str):
        self._mark(tmp, False)

    def update(self, temps):
        for tmp in temps:
            self._mark(tmp, True)

    def difference_update(self, temps):
        for tmp in temps:
            self._mark(tmp, False)


def remove_dead_temps(client, run_key: str) -> None:
    """Remove the temporary outputs still recorded as live once every task of the run has
    ended: their writers died mid-write."""
    try:
        temps = client.get_metadata([RUN_KEY, run_key, "temps"], default={}) or {}
    except Exception as exc:  # the scheduler went away: a later run cleans up
        logger.warning("could not look up temporary outputs of lost workers: %s", exc)
        return
    for tmp, alive in temps.items():
        if alive:
            logger.debug("removing %s, left by a worker that died writing it", tmp)
            remove_quietly(tmp)


def forget_run(client, run_key: str) -> None:
    with contextlib.suppress(Exception):
        client.set_metadata([RUN_KEY, run_key], None)


_claims = {}  # claim timeout -> the Claims of this worker process, refreshed while it lives
_claims_lock = threading.Lock()


def _worker_claims(timeout: float) -> Claims:
    with _claims_lock:
        claims = _claims.get(timeout)
        if claims is None:
            claims = _claims[timeout] = Claims(timeout).__enter__()
        return claims


def _claim(claims: Claims, client, run_key: str, task) -> str | None:
    """Claim the task's output as the local pipeline does; None when claimed, else why the
    file is skipped.

    Each attempt records the run id of its worker's claims under this run before claiming.
    A claim held by an earlier attempt of this run is taken over: the scheduler starts a
    task again only once it has lost the worker of the earlier attempt, and a claim from
    another host would otherwise hold the file until the claim timeout."""
    recorded = [RUN_KEY, run_key, "claims", task.output]
    earlier = client.get_metadata(recorded, default=None) or {}
    client.set_metadata(recorded + [claims.run_id], True)
    temps = RecordedTemps(client, run_key)
    holder = claims.acquire(task.output, temps)
    if holder is not None and earlier:
        path = claim_path(task.output)
        record = read_claim(path)
        # An unreadable claim is one written in place (a filesystem without hard links)
        # whose writer stopped between creating and filling it: the earlier attempt,
        # killed there (anyone else's fills it within microseconds; were it theirs, both
        # would write the same file atomically).
        if record is None or record.get("run") in earlier:
            logger.info("%s: taking over the claim of a lost worker of this run", path)
            remove_quietly(path)
            holder = claims.acquire(task.output, temps)
    if holder is not None:
        return f"output {holder}"
    if not earlier and _mtime_ns(task.output) != task.output_mtime:
        claims.release(task.output)  # another run wrote it since this run planned
        return "output written by another run meanwhile"
    return None


def _mtime_ns(path: str):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def file_task(task, weights, spec, settings, run_key, claim_timeout):
    """One file on a worker: claim, read, compute, write (the local pipeline's steps).
    Returns its `Outcome`; the device names the worker."""
    worker = distributed.get_worker()
    try:
        backend = _worker_backend(weights, spec)
    except SetupError as exc:
        return _failed(task, str(exc), worker.address)
    where = f"{worker.address} ({backend.label})"
    client = distributed.get_client()
    claims = _worker_claims(claim_timeout)
    try:
        skipped = _claim(claims, client, run_key, task)
    except OSError as exc:  # a folder that cannot be created or written
        return _failed(task, f"cannot claim the output {task.output}: "
                             f"{type(exc).__name__}: {exc}", where)
    except ClaimConflict as exc:
        return _failed(task, f"{exc} (conflict)", where)
    if skipped is not None:
        logger.info("%s: skipped: %s", task.input, skipped)
        return Outcome(task.input, "skipped", skipped)
    try:
        loaded = read_file(task, settings, backend.alloc)
        positions = loaded.positions
        out, meta = compute_file(task, loaded, backend)
        del loaded
        write_file(task, out, meta, settings, RecordedTemps(client, run_key))
    except FileFailed as exc:
        return _failed(task, str(exc), where)
    except OSError as exc:
        return _failed(task, f"cannot write the output {task.output}: "
                             f"{type(exc).__name__}: {exc}", where)
    finally:
        claims.release(task.output)
    return Outcome(task.input, "done", positions=positions, device=where)


def _failed(task, reason, where):
    outcome = Outcome(task.input, "failed", reason, device=where)
    logger.error("%s: %s", task.input, outcome.reason)
    return outcome
