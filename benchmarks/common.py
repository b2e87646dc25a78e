"""Shared pieces of the benchmark: sizes, inputs, the results recorder, logging, selection.

No GPU and no torch here: both the main process and the worker that times our package import
this module.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import os
import pathlib
import re
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent   # the repository root

DEFAULT_SIZES = ("2x128x64x4,1x256x128x4,1x384x128x4,1x768x128x4,1x1024x128x4,"
                 "1x1536x128x4,1x2048x128x4,1x4096x128x4")
QUICK_SIZES = "2x128x64x4,1x384x128x4,1x1024x128x4"
DEFAULT_ACC_SIZES = "1x64x128x4,2x75x64x4"
QUICK_ACC_SIZES = "1x64x128x4"
PAD_FRACTION = 0.1

# Seeds: one set of weights per (D, h); accuracy inputs drawn on the host (identical in every
# process); timing inputs drawn on the device.
WEIGHT_SEED, ACCURACY_SEED, TIMING_SEED = 0, 1, 2

# Inputs smaller than this are timed round-robin over a few copies, so that repeated runs do
# not simply find the input in the ~50 MB L2 cache.
ROTATE_BELOW_BYTES = 128 << 20
ROTATE_COPIES = 3

log = logging.getLogger("triattn_bench")


@dataclasses.dataclass(frozen=True, order=True)
class Size:
    B: int
    N: int
    D: int
    h: int

    def __str__(self):
        return f"{self.B}x{self.N}x{self.D}x{self.h}"

    @property
    def key(self):
        """Execution order: by amount of work, so that each size's time predicts the next."""
        return (self.B * self.N ** 3 * self.D, str(self))

    @property
    def pair_bytes(self) -> int:
        return self.B * self.N * self.N * self.D * 4


def parse_size(text: str) -> Size:
    parts = text.strip().lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"a size is BxNxDxh with four positive integers, e.g. 1x256x128x4; "
                         f"got {text!r}")
    B, N, D, h = map(int, parts)
    if min(B, N, D, h) < 1 or D % h:
        raise ValueError(f"size {text!r}: B, N, D, h must be positive and D divisible by h")
    return Size(B, N, D, h)


def parse_sizes(text: str) -> list[Size]:
    sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise ValueError("no size given")
    return sizes


def padding_mask(B: int, N: int, pad_fraction: float = PAD_FRACTION) -> np.ndarray:
    """(B, N, N) float32 pair mask with the last 10% of positions padded, as the peers' run.

    mask[b, j, k] = 1 where both j and k are real positions. A padded query j would have every
    key masked (NaN in the reference), so it keeps key 0: no query is fully masked, and every
    system computes the same function.
    """
    L = N - int(N * pad_fraction)
    valid = np.zeros((B, N), np.float32)
    valid[:, :L] = 1
    mask = valid[:, :, None] * valid[:, None, :]
    mask[:, L:, 0] = 1
    return np.ascontiguousarray(mask, np.float32)


def host_inputs(size: Size, seed: int = ACCURACY_SEED):
    """(pair, mask) as float32 NumPy arrays: standard normal pair, padding mask."""
    rng = np.random.default_rng(seed)
    pair = rng.standard_normal((size.B, size.N, size.N, size.D), dtype=np.float32)
    return pair, padding_mask(size.B, size.N)


def rotation_copies(size: Size) -> int:
    return ROTATE_COPIES if size.pair_bytes < ROTATE_BELOW_BYTES else 1


def make_weights(D: int, h: int, seed: int = WEIGHT_SEED):
    """(params, layer_norm_eps, Weights or None): the benchmark's weights for one (D, h).

    From `triattn_cupy.random_weights` (random LayerNorm affine and biases too, so that an
    ignored parameter shows). If the package cannot be imported, the same recipe here, so
    that the PyTorch systems still run; `Weights` is then None.
    """
    try:
        from triattn_cupy import random_weights
        w = random_weights(D, h, seed)
        return dict(w.params), float(w.layer_norm_eps), w
    except Exception as exc:  # noqa: BLE001 - the package is being written concurrently
        log.warning("triattn_cupy.random_weights unavailable (%s); using the local recipe",
                    short_error(exc))
    rng = np.random.default_rng(seed)
    bound = 1.0 / math.sqrt(D)
    params = {"layer_norm.weight": 1.0 + 0.1 * rng.standard_normal(D),
              "layer_norm.bias": 0.1 * rng.standard_normal(D)}
    for name in ("query", "key", "value", "gate", "out_proj"):
        params[f"{name}.weight"] = rng.uniform(-bound, bound, (D, D))
        params[f"{name}.bias"] = rng.uniform(-bound, bound, D)
    params["bias_proj.weight"] = rng.uniform(-bound, bound, (h, D))
    return {k: np.asarray(v, np.float32) for k, v in params.items()}, 1e-5, None


def reference_output(pair: np.ndarray, mask: np.ndarray, D: int, h: int) -> np.ndarray | None:
    """The float64 NumPy reference (`triattn_cupy.reference`), or None if unavailable."""
    try:
        from triattn_cupy import reference
    except Exception as exc:  # noqa: BLE001
        log.warning("triattn_cupy.reference unavailable: %s", short_error(exc))
        return None
    _, _, weights = make_weights(D, h)
    if weights is None:
        return None
    return reference.triangle_attention(pair, mask, weights, dtype=np.float64)


def rel_l2(out, ref) -> dict:
    """||out - ref|| / ||ref|| in float64; NaN or Inf anywhere makes it inf (never passes)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return {"rel_l2": math.inf, "max_abs": math.inf, "nonfinite": -1,
                "error": f"shape {out.shape} != reference {ref.shape}"}
    nonfinite = int(np.size(out) - np.count_nonzero(np.isfinite(out)))
    if nonfinite:
        return {"rel_l2": math.inf, "max_abs": math.inf, "nonfinite": nonfinite}
    diff = out - ref
    return {"rel_l2": float(np.linalg.norm(diff) / np.linalg.norm(ref)),
            "max_abs": float(np.abs(diff).max()), "nonfinite": 0}


# Relative L2 error a correct implementation stays under, per arithmetic class (METHOD.md:
# fp32 lands far under 1e-3, tf32 near 3e-4, bf16 operands between 1e-3 and 1e-2).
TOLERANCE = {"fp32": 1e-5, "fp32x3": 1e-5, "tf32": 2e-3, "f16": 2e-3, "bf16": 2e-2}


def short_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}"
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def is_oom(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, cupy's OutOfMemoryError, or an allocation failure."""
    if "OutOfMemory" in type(exc).__name__:
        return True
    text = str(exc).lower()
    return any(s in text for s in ("out of memory", "cudaerrormemoryallocation",
                                   "cublas_status_alloc_failed", "failed to allocate"))


FATAL_MARKERS = ("illegal memory access", "illegal address", "unspecified launch failure",
                 "device-side assert", "misaligned address", "an illegal instruction",
                 "cudaerrorlaunchfailure", "cuda_error_illegal", "context is destroyed",
                 "cudaerrorillegaladdress")


def is_fatal(exc: BaseException) -> bool:
    """A sticky CUDA error: the context is unusable for the rest of the process."""
    text = str(exc).lower()
    return any(s in text for s in FATAL_MARKERS)


def selected(name: str, patterns) -> bool:
    """Whether system `name` passes the --systems filter (None = all).

    A pattern matches the name exactly, as a glob ("cueq_*"), or, if it has no underscore,
    as a family prefix ("trifast": trifast_fp32 and trifast_bf16; "ours": every ours_*;
    "ref": ref_eager, ref_eager_tf32, ref_compile). "ref_eager" selects ref_eager alone."""
    if not patterns:
        return True
    return any(name == p or fnmatch.fnmatchcase(name, p)
               or ("_" not in p and name.startswith(p + "_")) for p in patterns)


def gpu_slug(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name or "unknown-gpu").strip("-.")
    return slug or "unknown-gpu"


class Recorder:
    """The results dict, saved to `path` (atomically) after every entry.

    Sections: meta, ceilings, systems {name: {label, kind, available, why_absent, ...}},
    accuracy [..], runs [..], stages [..], notes [..]. Each entry of runs/accuracy/stages
    names its system and size; report.py derives everything else from these.
    """

    def __init__(self, path=None, data=None):
        self.path = pathlib.Path(path) if path else None
        self.data = data if data is not None else {
            "schema": 1, "meta": {}, "ceilings": {}, "systems": {}, "accuracy": [],
            "runs": [], "stages": [], "notes": []}

    def system(self, name: str, **info):
        entry = self.data["systems"].setdefault(name, {})
        entry.update(info)
        self.save()

    def add(self, section: str, entry: dict):
        self.data[section].append(entry)
        self.save()

    def note(self, text: str):
        log.info("note: %s", text)
        self.data["notes"].append(text)
        self.save()

    def merge(self, other: dict):
        for name, info in other.get("systems", {}).items():
            self.data["systems"].setdefault(name, {}).update(info)
        for section in ("accuracy", "runs", "stages", "notes"):
            self.data[section].extend(other.get(section, []))
        for key, value in other.get("meta", {}).items():
            self.data["meta"].setdefault(key, value)
        self.save()

    def save(self):
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f, indent=1, default=_json_default, allow_nan=True)
        os.replace(tmp, self.path)


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (pathlib.Path, Size)):
        return str(obj)
    return repr(obj)


def setup_logging(log_file=None, tag: str = ""):
    """INFO lines to stdout (flushed at once) and, if given, appended to `log_file`."""
    log.setLevel(logging.INFO)
    log.propagate = False
    for handler in list(log.handlers):
        log.removeHandler(handler)
    fmt = logging.Formatter(f"%(asctime)s {tag}%(message)s", datefmt="%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    log.addHandler(stream)
    if log_file:
        pathlib.Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file, mode="a")
        handler.setFormatter(fmt)
        log.addHandler(handler)
    return log
