"""Comparison helpers shared by the CPU and GPU tests.

`rel_l2` is the one error measure of the test suite: relative L2 error computed in float64,
and infinite (so every `< tol` fails) on anything that must not pass silently: different
shapes, a NaN or Inf on either side, or an empty comparison.
"""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np


def to_numpy(a) -> np.ndarray:
    """A host NumPy copy of a NumPy / CuPy array or a (CPU or CUDA) torch tensor."""
    if hasattr(a, "detach"):  # torch.Tensor
        a = a.detach().cpu().numpy()
    elif hasattr(a, "get") and not isinstance(a, np.ndarray):  # cupy.ndarray
        a = a.get()
    return np.asarray(a)


def rel_l2(actual, expected, where=None) -> float:
    """||actual - expected||_2 / ||expected||_2 in float64.

    `where`: optional boolean array broadcastable to the shape, selecting the positions to
    compare (e.g. those outside fully-masked rows). Returns ``inf`` when the shapes differ,
    when either side holds a NaN or Inf at a compared position (NaN never passes), or when
    `expected` is zero there but `actual` is not. Raises ValueError when `where` selects
    nothing: an empty comparison would pass any threshold.
    """
    a = to_numpy(actual)
    b = to_numpy(expected)
    if a.shape != b.shape:
        return math.inf
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    if where is not None:
        where = np.broadcast_to(np.asarray(where, bool), a.shape)
        a, b = a[where], b[where]
    if a.size == 0:
        raise ValueError("rel_l2: nothing to compare (empty arrays or `where` selects nothing)")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.inf
    num = float(np.linalg.norm((a - b).ravel()))
    den = float(np.linalg.norm(b.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def spec_model(weights, dtype=None):
    """The spec module (`torch_spec.TriangleSelfAttention`) in eval mode, holding
    `weights` (a `triattn_cupy.Weights`) in `dtype` (torch.float64 by default).

    Skips the calling test where torch is not installed (see `spec.load_spec_module`).
    """
    from spec import load_spec_module

    module = load_spec_module()  # skips without torch
    import torch

    model = module.TriangleSelfAttention(weights.pair_dim, weights.num_heads)
    model.layer_norm.eps = weights.layer_norm_eps
    model.load_state_dict({name: torch.from_numpy(value.copy())
                           for name, value in weights.params.items()}, strict=True)
    return model.to(dtype or torch.float64).eval()


def spec_forward(weights, pair, mask=None) -> np.ndarray:
    """The spec's output in float64 for (B, N, N, D) or (N, N, D) `pair` and a mask of any
    real dtype (None: all ones), as a NumPy array shaped like `pair`. NaN where the spec
    gives NaN (queries whose keys are all masked)."""
    model = spec_model(weights)
    import torch

    pair = np.asarray(pair, np.float64)
    batched = pair.ndim == 4
    if mask is None:
        mask = np.ones(pair.shape[:-1], np.float64)
    mask = np.asarray(mask)
    if not batched:
        pair, mask = pair[None], mask[None]
    with torch.no_grad():
        out = model(torch.from_numpy(pair), torch.from_numpy(np.ascontiguousarray(mask)))
    out = out.numpy()
    return out if batched else out[0]


def compile_ptx_or_fail(source: str, arch: str = "compute_90a"):
    """Compile `source` to PTX with NVRTC (no GPU, no ptxas), failing the calling test with
    the end of the compiler's log on an error: for the kernels' static_asserts against the
    host's mirrors of their layouts."""
    import pytest
    from cupy_backends.cuda.libs import nvrtc

    from triattn_cupy import gpu

    program = nvrtc.createProgram(source, "mirror.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [f"-arch={arch}", *gpu.compile.NVRTC_OPTIONS])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(program)[-800:])
    finally:
        nvrtc.destroyProgram(program)


@contextlib.contextmanager
def every_warning():
    """The warnings raised inside, none of them filtered out as repeats."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def fallback_messages(caught) -> list:
    """The texts of the drop-in's FallbackWarnings among `caught` warnings."""
    from triattn_cupy.torch import FallbackWarning

    return [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def flip_header_byte(path, name: str, offset: int, flip: int):
    """XOR `flip` into the byte `offset` past the object header of HDF5 object `name`."""
    import h5py

    with h5py.File(path, "r") as f:
        header = h5py.h5o.get_info(f[name].id).addr
    raw = bytearray(path.read_bytes())
    raw[header + offset] ^= flip
    path.write_bytes(raw)
