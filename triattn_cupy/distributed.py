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
which takes over the dead worker's claim (each attempt records its claims' run id on the
scheduler under this run before claiming, so the claim is known to be this run's own;
another host's claim would otherwise only expire after the claim timeout). An output is
only ever renamed into place when complete, and the client removes the temporary files
of writers that died: each is recorded on the scheduler before it is created.

Interrupted (Ctrl-C, SIGTERM), the client cancels the files no worker has started, waits
for those in hand and reports them, as a local run finishes its file in hand.

The batch's client side is `triattn_cupy.cli.cluster_run` (this module depends on the
command's package, never the other way round); `run_batch`, `check_worker_versions` and
`resolve_cluster_device` are re-exported from there.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from .cli.backends import precision_support
from .cli.claims import DEFAULT_TIMEOUT
from .cli.cluster_run import (check_worker_versions, require_dask, resolve_cluster_device,
                              run_batch)

try:
    import dask
    import dask.array as _da
except ImportError:  # the optional extra is missing: require_dask says so when used
    dask = _da = None

__all__ = ["infer_files", "triangle_attention", "run_batch", "check_worker_versions",
           "resolve_cluster_device"]


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
    require_dask()
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
    require_dask()
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
