"""Triangle attention on a Dask cluster: the batch job over files, and Dask arrays.

    infer_files(client, inputs, output_dir, weights, ...)   the `triattn-infer` batch on
                                                            the workers of `client`
    triangle_attention(pair, mask, weights, ...)            over a Dask array chunked along B

Needs ``dask[distributed]`` (the extra ``triattn-cupy[distributed]``); one worker per GPU
comes from dask-cuda (``dask cuda worker``, ``LocalCUDACluster``). Importing
`triattn_cupy` never imports this module, nor Dask.

The batch: the client plans the run as a local run does (the same inputs found, the same
outputs skipped or refused), then submits one task per file, largest first. A task
(`cli/cluster_tasks.py`) reads, computes and writes its file on a worker through the same
functions as the local pipeline (`cli/filejob.py`), so the outputs of a cluster run and of
a local run are the same and either resumes the other. Workers must see the inputs and the
output folder at the same paths as the client (a shared filesystem) and run the same
version of the package.

The weights travel once, as the result of one task that every file's task depends on
(a worker fetches it once; if every copy is lost with its workers it is computed again).
Each worker builds its backend (weights on its GPU, kernels compiled) on its first file and
keeps it for every later file with the same weights, keyed by the weights' SHA-256. A
worker claims each output before computing it, as a local run does (`cli/claims.py`), so a
cluster run and local runs over the same folders split the files.

A worker that dies mid-file loses nothing: the scheduler gives its files to another worker,
which takes over the dead worker's claim (each attempt records its host and process on
the scheduler under this run before claiming, so the claim is known to be this run's own;
another host's claim would otherwise only expire after the claim timeout). An output is
only ever renamed into place when complete, and the client removes the temporary files
of writers that died: each is recorded on the scheduler before it is created.

Interrupted (Ctrl-C, SIGTERM), the client cancels the files no worker has started, waits
for those in hand and reports them, as a local run finishes its file in hand.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time
import uuid

import numpy as np

from ._install import pip_install
from ._version import __version__
from .cli import pipeline
from .cli.backends import SetupError, gpu_probe, precision_support
from .cli.claims import DEFAULT_TIMEOUT
from .cli.filejob import job_settings
from .cli.plan import Outcome, plan
from .cli.report import Progress, report

try:
    import dask
    import dask.array as _da
    import distributed as _distributed

    from .cli import cluster_tasks
except ImportError as _exc:  # the optional extra is missing: say so when used
    dask = _da = _distributed = cluster_tasks = None
    _IMPORT_ERROR = _exc
else:
    _IMPORT_ERROR = None

logger = logging.getLogger("triattn_cupy.cli")

__all__ = ["infer_files", "triangle_attention", "run_batch", "check_worker_versions",
           "resolve_cluster_device"]


def _require_dask():
    if _IMPORT_ERROR is not None:
        raise ImportError(f"triattn_cupy.distributed needs Dask: "
                          f"{pip_install('distributed')} ({_IMPORT_ERROR})") from _IMPORT_ERROR


# --- the batch job on a cluster ---------------------------------------------------------------

def infer_files(client, inputs, output_dir, weights, *, recursive: bool = False,
                pair_key: str = "pair", mask_key: str | None = None,
                fully_masked: str = "zero", precision: str | None = None,
                output_format: str = "hdf5", overwrite: bool = False,
                device: str = "auto", claim_timeout: float = DEFAULT_TIMEOUT,
                progress: bool = False):
    """Run the `triattn-infer` batch on the workers of `client` (a `distributed.Client`).

    inputs:      paths of input files and/or folders (.npy, .npz, .h5, .hdf5), as for
                 `triattn-infer INPUT...`; workers must see them at the same paths.
    output_dir:  the output folder (created if needed), on a filesystem the workers share.
    weights:     path of the HDF5 weights file.
    device:      "auto" (GPU when every worker has one, CPU when none has), "gpu" or "cpu".
    progress:    show the progress bar and log the summary, as `triattn-infer` does.
    The other options mean what the flags of the same names mean. Returns the run's
    `RunResult` (``exit_code``, ``outcomes``: one per file, ``seconds``, ``devices``).
    Raises `SetupError` when the run cannot start.
    """
    _require_dask()
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(f"weights must be the path of an HDF5 weights file; got "
                        f"{type(weights).__name__}")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    _check_choice("fully_masked", fully_masked, ("zero", "nan"))
    _check_choice("output_format", output_format, ("hdf5", "npy"))
    _check_choice("device", device, ("auto", "gpu", "cpu"))
    if precision is not None:
        _check_choice("precision", precision, precision_support()[0] or ("fp32",))
    args = argparse.Namespace(
        inputs=[os.fspath(p) for p in inputs], output_dir=os.fspath(output_dir),
        weights=os.fspath(weights), recursive=recursive, pair_key=pair_key,
        mask_key=mask_key, fully_masked=fully_masked, precision=precision,
        output_format=output_format, overwrite=overwrite, device=device, devices=None,
        claim_timeout=claim_timeout, quiet=not progress)
    return run_batch(client, args, summary=progress)


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got "
                         f"{value!r}")


def run_batch(client, args, *, summary: bool = True):
    """Plan, compute on the cluster and report one run described by parsed `args` (the
    options of `triattn-infer`). Raises SetupError when the run cannot start."""
    _require_dask()
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
    from ._version import __version__ as version

    return version


def resolve_cluster_device(client, args) -> str:
    """"cpu" or "gpu" for the workers of `client`, from --device (auto: GPU when every
    worker has one, CPU when none has; a mix is an error, as its files would differ)."""
    _require_dask()
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


# --- Dask arrays ------------------------------------------------------------------------------

def triangle_attention(pair, mask, weights, *, fully_masked: str = "zero",
                       precision: str = "fp32"):
    """Triangle self-attention over a Dask array, one task per chunk along B.

    pair:    Dask array (B, N, N, D) (or (N, N, D), one chunk), float32 or float64, with
             CuPy-backed chunks (computed by the GPU kernels, float32 result) or NumPy-backed
             chunks (the NumPy backend, in the pair's dtype). Chunks may split B only; the
             other axes are joined into one chunk.
    mask:    None, or (B, N, N) / (N, N), 0 = masked: a Dask array (rechunked to the pair's
             chunks along B) or an array of the pair's kind.
    weights: a `triattn_cupy.Weights` (one copy per worker, uploaded to each GPU once).
    fully_masked, precision: as `triattn_cupy.triangle_attention` (precision: GPU only).
    Returns a lazy Dask array shaped like `pair`.
    """
    _require_dask()
    from ._checks import check_fully_masked, pair_geometry
    from .weights import Weights

    if not isinstance(pair, _da.Array):
        raise TypeError(f"pair must be a dask.array.Array; got {type(pair).__name__} "
                        f"(use triattn_cupy.triangle_attention for a CuPy array, "
                        f"triattn_cupy.reference for NumPy)")
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be a triattn_cupy.Weights; got "
                        f"{type(weights).__name__}")
    check_fully_masked(fully_masked)
    if np.dtype(pair.dtype) not in (np.float32, np.float64):
        raise TypeError(f"pair must be float32 or float64; got dtype {pair.dtype}")
    B, N, batched = pair_geometry(pair.shape, weights.pair_dim)
    on_gpu = _is_cupy(pair._meta)
    if not on_gpu and precision != "fp32":
        raise ValueError(f"precision={precision!r} needs CuPy-backed chunks (the GPU); "
                         f"NumPy-backed chunks are computed in the pair's dtype")
    if not batched:
        pair = pair[None]
    pair = pair.rechunk({1: -1, 2: -1, 3: -1})
    out_dtype = np.float32 if on_gpu else np.dtype(pair.dtype)
    args = [pair]
    if mask is not None:
        if not batched and getattr(mask, "ndim", None) != 2:
            raise ValueError(f"mask must be (N, N) = ({N}, {N}) for an unbatched pair; got "
                             f"shape {tuple(mask.shape)}")
        if batched and getattr(mask, "ndim", None) != 3:
            raise ValueError(f"mask must be (B, N, N) = ({B}, {N}, {N}); got shape "
                             f"{tuple(getattr(mask, 'shape', ()))}")
        if not isinstance(mask, _da.Array):
            mask = _da.from_array(mask, chunks=-1, asarray=False)
        if not batched:
            mask = mask[None]
        if tuple(mask.shape) != (pair.shape[0], N, N):
            raise ValueError(f"mask must be shaped like the pair without D, "
                             f"({pair.shape[0]}, {N}, {N}); got {tuple(mask.shape)}")
        # [B, N, N, 1]: map_blocks lines arguments up from the last axis
        args.append(mask.rechunk((pair.chunks[0], -1, -1))[..., None])
    weights_key = dask.delayed(weights, pure=True)  # one key in the graph, not one per chunk
    out = _da.map_blocks(
        _attend_block, *args, weights=weights_key, fully_masked=fully_masked,
        precision=precision, dtype=out_dtype, meta=pair._meta.astype(out_dtype),
        chunks=pair.chunks)
    return out if batched else out[0]


def _is_cupy(array) -> bool:
    return type(array).__module__.split(".")[0] == "cupy"


def _attend_block(pair, mask=None, *, weights, fully_masked, precision):
    """One chunk (b, N, N, D) -> its output, on the chunk's device or the host."""
    if mask is not None:
        mask = mask[..., 0]
    if pair.size == 0:
        return pair.astype(np.float32 if _is_cupy(pair) else pair.dtype)
    if _is_cupy(pair):
        from .api import triangle_attention as gpu_attention

        if pair.dtype != np.float32:
            pair = pair.astype(np.float32)
        return gpu_attention(pair, mask, weights, fully_masked=fully_masked,
                             precision=precision)
    from . import reference

    return reference.triangle_attention(pair, mask, weights, fully_masked=fully_masked,
                                        dtype=pair.dtype)
