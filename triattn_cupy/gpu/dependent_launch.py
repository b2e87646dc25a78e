"""Programmatic dependent launches (compute capability 9.0 and newer), for captured forwards.

A kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start
while the kernel before it drains: its blocks are placed once every block of that kernel
has called `allow_next_kernel` (kernels/common.cuh), and each waits in
`wait_for_previous_kernel` until that kernel has finished and its writes are visible.
Captured into a CUDA graph this becomes a programmatic edge, and a replay skips the gap
between the kernels' grids. At 2x128x64x4 a replay is three kernels of one wave each, so
those gaps are a visible share of it (docs/performance.md, "Small sizes").

Only the launches whose kernels wait before reading what the previous kernel wrote are
marked dependent (Plan: the attention and the out projection), and only a captured
forward of at most MAX_ROWS pair rows (gpu/captured.py) launches them so: ordinary calls
measured no gain from it (docs/design.md), and large forwards have no gaps worth it. The
bits are the same either way: the order of every read after every write is kept by the
waits.

CuPy's driver module has no cuLaunchKernelEx, so it is called through ctypes, from the
driver library CuPy itself uses.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import threading

from . import gpus

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
# Drivers from CUDA 12.3 capture a programmatic launch as a programmatic graph edge
_MIN_DRIVER = 12030
# Pair rows (B N N) up to which a captured forward takes them. Replayed on the H200:
# 2x128x64x4 -2.0 to -2.7%, 1x256x128x4 -1.2 to -2.0%; at 1x1024x128x4 the gaps are
# ~0.1% of a replay and it measured +0.7 / +0.8% (tf32 / bf16, within the rounds'
# spread), so larger forwards launch as a call does (docs/performance.md).
MAX_ROWS = 1 << 16


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint),
                ("grid_z", ctypes.c_uint), ("block_x", ctypes.c_uint),
                ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def programmatic_attribute() -> _LaunchAttribute:
    """The one launch attribute: programmatic stream serialization allowed (an int 1)."""
    attribute = _LaunchAttribute()
    attribute.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value = (1).to_bytes(4, "little") + bytes(60)
    return attribute


_ATTRIBUTE = programmatic_attribute()
_driver = None        # cuLaunchKernelEx, once loaded
_state = threading.local()  # .on: this thread is inside launches_as_dependents()


def _launch_kernel_ex():
    global _driver
    if _driver is None:
        library = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        function = library.cuLaunchKernelEx
        function.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_void_p]
        function.restype = ctypes.c_int
        _driver = function
    return _driver


def chosen(compute_capability: int, rows: int) -> bool:
    """Whether a captured forward of `rows` pair rows on a GPU of `compute_capability`
    launches its dependents programmatically."""
    return rows <= MAX_ROWS and supported(compute_capability)


def supported(compute_capability: int) -> bool:
    """Whether this driver and a GPU of `compute_capability` run and capture programmatic
    launches (and the driver library exports cuLaunchKernelEx)."""
    if not gpus.gpu(compute_capability).dependent_launches:
        return False
    import cupy

    try:
        if cupy.cuda.runtime.driverGetVersion() < _MIN_DRIVER:
            return False
        _launch_kernel_ex()
    except (OSError, AttributeError):
        return False
    return True


@contextlib.contextmanager
def launches_as_dependents(enabled: bool = True):
    """Inside, on this thread, the launches marked dependent go out as programmatic
    dependents (where `enabled`; captured.py passes `chosen(...)`)."""
    previous = getattr(_state, "on", False)
    _state.on = bool(enabled)
    try:
        yield
    finally:
        _state.on = previous


def active() -> bool:
    """Whether this thread is inside launches_as_dependents()."""
    return getattr(_state, "on", False)


def launch(function: int, grid: int, block: int, smem: int, stream: int, params: int) -> None:
    """cuLaunchKernelEx of `function` (a CUfunction) with the programmatic attribute; a
    RuntimeError with the driver's code where it fails."""
    config = _LaunchConfig(grid, 1, 1, block, 1, 1, smem, stream, ctypes.pointer(_ATTRIBUTE), 1)
    status = _launch_kernel_ex()(ctypes.byref(config), function, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA driver error {status}")
