"""Compute backends of `triattn-infer`: one object per worker thread.

`CpuBackend` runs the NumPy reference in float32. `GpuBackend` holds one
`TriangleAttention` per device, built once, so the kernels stay compiled and the weights
stay on the device for the whole run; its host buffers are pinned, so the copies to and
from the device run at full speed.

Both expose `label`, `alloc(shape)` (a float32 host array for the reader thread to fill),
and `compute(loaded) -> np.ndarray` (float32, shaped like the pair), which raises
`ComputeError` with a readable reason for a problem that concerns one file only.
"""
from __future__ import annotations

import numpy as np

from .. import reference
from .._install import pip_install

GIB = float(1 << 30)


class ComputeError(Exception):
    """This file could not be computed (too large, rejected by the backend, ...)."""


class SetupError(Exception):
    """The run cannot start: no usable device, bad --devices, unusable weights."""


# --- what the installed package offers ------------------------------------------------------

def gpu_api():
    """The module with `TriangleAttention` and `gpu_available` (importing it never touches
    the GPU)."""
    from .. import api

    return api


def precision_support():
    """(precisions, where): the precision modes `TriangleAttention` takes, and "call": its
    call takes ``precision=``."""
    from ..gpu.checks import PRECISIONS

    return PRECISIONS, "call"


def gpu_probe() -> tuple[int, str]:
    """(number of usable CUDA devices, why there are none). Never raises."""
    try:
        import cupy
    except Exception as exc:
        return 0, (f"CuPy is not importable ({type(exc).__name__}: {exc}); install it: "
                   f"{pip_install('cuda13')}, or the extra cuda12, matching your CUDA "
                   f"driver")
    available = gpu_api().gpu_available()
    try:
        count = cupy.cuda.runtime.getDeviceCount()  # also when not available: the reason
    except Exception as exc:
        return 0, f"CUDA: {exc}"
    if not available or count < 1:
        return 0, "no CUDA device found"
    return count, ""


def parse_devices(text: str) -> list[int]:
    """'0,1,3' -> [0, 1, 3]; ValueError for anything else (negative, duplicate, empty)."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"expected a comma-separated list of GPU indices such as 0,1; "
                         f"got {text!r}")
    devices = []
    for p in parts:
        if not p.isdigit():
            raise ValueError(f"GPU indices are non-negative integers; got {p!r} in {text!r}")
        i = int(p)
        if i in devices:
            raise ValueError(f"GPU {i} is listed twice in {text!r}")
        devices.append(i)
    return devices


# --- the backends -------------------------------------------------------------------------

class CpuBackend:
    """The NumPy reference in float32 (BLAS uses the CPU cores)."""

    kind = "cpu"

    def __init__(self, weights, fully_masked: str):
        self.weights = weights
        self.fully_masked = fully_masked
        self.label = "CPU (NumPy backend, float32)"

    def thread_init(self) -> None:
        pass

    def alloc(self, shape) -> np.ndarray:
        return np.empty(shape, np.float32)

    def warm_up(self) -> None:
        pass

    def compute(self, loaded) -> np.ndarray:
        try:
            return reference.triangle_attention(
                loaded.pair, loaded.mask, self.weights, fully_masked=self.fully_masked,
                dtype=np.float32)
        except MemoryError as exc:
            raise ComputeError(
                f"too large for host memory: pair {tuple(loaded.pair.shape)} "
                f"({loaded.pair.nbytes / GIB:.2f} GiB) ({exc})") from None
        except (ValueError, TypeError) as exc:
            raise ComputeError(str(exc)) from None


class GpuBackend:
    """`TriangleAttention` on one device, fed from pinned host buffers."""

    kind = "gpu"

    def __init__(self, weights, device: int, fully_masked: str, precision=None,
                 precision_where=None, max_scratch_bytes=None):
        import cupy

        self.cupy = cupy
        self.device = device
        self.pair_dim = weights.pair_dim
        self.fully_masked = fully_masked
        self.call_kwargs = {"fully_masked": fully_masked}
        # (the inputs' calls only: the warm-up's tiny input needs no limit)
        self.scratch_kwargs = ({} if max_scratch_bytes is None
                               else {"max_scratch_bytes": max_scratch_bytes})
        init_kwargs = {"device": device}
        if precision is not None:
            (init_kwargs if precision_where == "init" else self.call_kwargs)[
                "precision"] = precision
        props = cupy.cuda.runtime.getDeviceProperties(device)
        name = props["name"]
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.total_memory = int(props["totalGlobalMem"])
        self.label = f"GPU {device} ({self.name})"
        with cupy.cuda.Device(device):
            try:
                self.module = gpu_api().TriangleAttention(weights, **init_kwargs)
            except (ValueError, TypeError) as exc:
                raise SetupError(f"{self.label} cannot use these weights: {exc}") from None
            except RuntimeError as exc:  # no NVRTC (GpuUnavailableError), a CUDA error
                raise SetupError(f"{self.label} cannot run: {exc} (--device cpu runs the "
                                 f"NumPy backend)") from None
        self._pinned_ok = True

    def thread_init(self) -> None:
        """Make this device current in the calling thread (a reader allocating pinned
        memory would otherwise create a context on device 0)."""
        self.cupy.cuda.Device(self.device).use()

    def alloc(self, shape) -> np.ndarray:
        """A float32 array in page-locked host memory, or ordinary memory if pinning fails
        (pinned memory is a limited resource; the copy is then only slower)."""
        count = int(np.prod(shape, dtype=np.int64))
        if self._pinned_ok:
            try:
                mem = self.cupy.cuda.alloc_pinned_memory(count * 4)
                return np.frombuffer(mem, np.float32, count).reshape(shape)
            except Exception:
                self._pinned_ok = False
        return np.empty(shape, np.float32)

    def warm_up(self) -> None:
        """One call on a small input: compiles the kernels before the clock starts."""
        D = self.pair_dim
        with self.cupy.cuda.Device(self.device):
            x = self.cupy.zeros((2, 8, 8, D), self.cupy.float32)
            self.module(x, None, **self.call_kwargs)
            self.cupy.cuda.Device(self.device).synchronize()

    def compute(self, loaded) -> np.ndarray:
        cp = self.cupy
        with cp.cuda.Device(self.device):
            d_pair = d_mask = d_out = None
            try:
                d_pair = cp.empty(loaded.pair.shape, cp.float32)
                d_pair.set(loaded.pair)  # a synchronous DMA copy from pinned memory
                if loaded.mask is not None:
                    d_mask = cp.asarray(loaded.mask)
                # in place: the output takes the pair's memory (the forward reads each
                # row before it writes it, in one pass or in row blocks)
                d_out = self.module(d_pair, d_mask, out=d_pair, **self.call_kwargs,
                                    **self.scratch_kwargs)
                del d_pair, d_mask
                d_pair = d_mask = None
                host = self.alloc(d_out.shape)
                d_out.get(out=host)  # blocking: the result is complete on return
                self._trim_pinned_pool()
                return host
            except (cp.cuda.memory.OutOfMemoryError, MemoryError) as exc:
                d_pair = d_mask = d_out = None
                cp.get_default_memory_pool().free_all_blocks()
                raise ComputeError(self._oom_reason(loaded, exc)) from None
            except (ValueError, TypeError) as exc:
                raise ComputeError(str(exc)) from None
            except cp.cuda.runtime.CUDARuntimeError as exc:
                if "memory" in str(exc).lower():
                    d_pair = d_mask = d_out = None
                    cp.get_default_memory_pool().free_all_blocks()
                    raise ComputeError(self._oom_reason(loaded, exc)) from None
                raise

    def _trim_pinned_pool(self) -> None:
        """CuPy's pinned pool keeps freed blocks per size; with many different N they
        pile up. Let them go now and then (blocks in use are not affected)."""
        pool = self.cupy.get_default_pinned_memory_pool()
        if pool.n_free_blocks() > 8:
            pool.free_all_blocks()

    def _oom_reason(self, loaded, exc) -> str:
        try:
            free, total = self.cupy.cuda.runtime.memGetInfo()
        except Exception:
            free, total = None, self.total_memory
        size = loaded.pair.nbytes / GIB
        free_text = f", {free / GIB:.1f} GiB free" if free is not None else ""
        return (f"too large for the memory of {self.label}: pair {tuple(loaded.pair.shape)} "
                f"is {size:.2f} GiB as float32, and the input, the output and the working "
                f"buffers do not fit in {total / GIB:.1f} GiB{free_text} "
                f"(CuPy: {exc}); split the batch or use a GPU with more memory")
