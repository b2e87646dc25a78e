"""One input file's job in `triattn-infer`: read and check it, compute it, write its output
with its provenance.

The local pipeline runs the three steps in separate threads (reading the next file overlaps
the computation of this one); a Dask worker runs them one after the other in one task
(`cluster_tasks`). Both call these functions, so a file computed by either has
the same data and the same attributes (but the time it was made and how long it took), and
a run of one kind resumes a run of the other.

A problem that concerns this file alone raises `FileFailed` with the sentence the summary
shows; anything else propagates.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time

import numpy as np

from .._version import __version__
from .backends import ComputeError
from .io import InputError, read_input
from .outputs import write_output

logger = logging.getLogger("triattn_cupy.cli")


class FileFailed(Exception):
    """This file cannot be done; str(exc) says why (without the path)."""


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """What every file of one run is read and written with (picklable: it travels to the
    workers of a cluster)."""

    pair_dim: int
    pair_key: str
    mask_key: str
    mask_required: bool  # --mask-key given: a file without that mask fails
    output_format: str
    common_attrs: dict  # provenance shared by every output of the run
    mask_layout: str = "pair"  # the weights': a "row" mask may come as (B, N, 1, 1, N)


def job_settings(args, pair_dim: int, weights_path: str, weights_sha: str,
                 mask_layout: str = "pair") -> JobSettings:
    """The settings of a run described by parsed `args`, with the weights it uses
    (`mask_layout`: theirs, which the mask files are read in)."""
    precision = getattr(args, "precision", None) or "fp32"
    options = {"fully_masked": args.fully_masked, "precision": precision,
               "pair_key": args.pair_key, "mask_key": args.mask_key or "mask",
               "output_format": args.output_format}
    common_attrs = {
        "weights_file": weights_path, "weights_sha256": weights_sha,
        "triattn_cupy_version": __version__, "fully_masked": args.fully_masked,
        "precision": precision, "options": json.dumps(options, sort_keys=True)}
    return JobSettings(pair_dim, args.pair_key, args.mask_key or "mask",
                       args.mask_key is not None, args.output_format, common_attrs,
                       mask_layout)


def read_file(task, settings: JobSettings, alloc=None):
    """The task's input, read and checked (a `LoadedInput`). Raises FileFailed."""
    t0 = time.perf_counter()
    try:
        loaded = read_input(task.input, task.kind, pair_dim=settings.pair_dim,
                            pair_key=settings.pair_key, mask_key=settings.mask_key,
                            mask_required=settings.mask_required, alloc=alloc,
                            mask_layout=settings.mask_layout)
    except InputError as exc:
        raise FileFailed(str(exc)) from None
    except MemoryError:
        raise FileFailed("too large to read into host memory") from None
    except Exception as exc:  # a bug, not the file: keep the traceback
        logger.debug("reading %s", task.input, exc_info=True)
        raise FileFailed(f"internal error while reading: {type(exc).__name__}: {exc}") from None
    loaded.read_seconds = time.perf_counter() - t0
    return loaded


def compute_file(task, loaded, backend):
    """(output array, provenance of this file) of `loaded` on `backend`. Raises
    FileFailed."""
    meta = {"input_file": task.input, "input_dtype": loaded.source_dtype,
            "input_shape": list(loaded.pair.shape),
            "mask_used": loaded.mask is not None, "device": backend.label}
    t0 = time.perf_counter()
    try:
        out = backend.compute(loaded)
    except ComputeError as exc:
        raise FileFailed(str(exc)) from None
    except Exception as exc:
        logger.debug("computing %s on %s", task.input, backend.label, exc_info=True)
        raise FileFailed(f"{backend.label} failed: {type(exc).__name__}: {exc}") from None
    meta["compute_seconds"] = time.perf_counter() - t0
    if np.dtype(loaded.source_dtype).itemsize == 2:  # float16 in, float16 out (computed in
        out = out.astype(np.float16)                 # float32, from the widened input)
    return out, meta


def write_file(task, out, meta: dict, settings: JobSettings, live_temps=None) -> None:
    """Write `out` to the task's output atomically, with the run's and this file's
    provenance. Raises what `write_output` raises (the temporary file is gone then)."""
    attrs = dict(settings.common_attrs)
    attrs.update(meta)
    attrs["input_shape"] = json.dumps(attrs["input_shape"])
    attrs["created_utc"] = datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds")
    write_output(task.output, out, settings.output_format, attrs, live_temps)
    logger.debug("%s -> %s (%s, %.3f s)", task.input, task.output, meta["device"],
                 meta["compute_seconds"])
