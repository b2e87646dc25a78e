"""Kernel launches worked out once and issued through the CUDA driver.

At small sizes the caller waits on the host: the event-timed forward at 2x128x64x4 spent
~27 µs before its first kernel started, ~9 µs of it in CuPy's kernel call, which turns
every argument into its C form at every launch (benchmarks/NOTES.md, session 18). Here a
launch's arguments are laid out once, each in an 8-byte slot of a template (cuLaunchKernel
reads each parameter's own size from its slot's address, little-endian), and a call
copies the template's values for its thread, writes its pointers into their slots and
calls cuLaunchKernel (CuPy's `driver.launchKernel`) on the current CuPy stream.

Arguments: `I32`, `I64`, `F32` (scalars, by value) and `Ptr` (a device address), or
`None` for a pointer that each call supplies (`slots`: position -> the name it is given
by in the call's dictionary of addresses).

A launch made with `overlap=True` goes through cuLaunchKernelEx (ctypes: CuPy exposes no
binding) with programmatic stream serialization: on sm_90 its blocks may start while the
kernel before it in the stream drains, and wait for it inside (griddepcontrol.wait,
kernels/common.cuh), which hides a kernel boundary's launch latency.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np


def I32(value) -> np.ndarray:
    return np.array(int(value), np.int32)


def I64(value) -> np.ndarray:
    return np.array(int(value), np.int64)


def F32(value) -> np.ndarray:
    return np.array(float(value), np.float32)


def Ptr(address: int) -> np.ndarray:
    return np.array(int(address), np.uint64)


class KernelArgs:
    """The parameter block of one kernel: every argument in an 8-byte slot, and the array
    of their addresses that cuLaunchKernel takes. The values are copied per thread (a
    launch in one thread must not see the pointers another thread is writing); `fill`
    writes one call's pointers and returns the address of the parameter array."""
    __slots__ = ("template", "slots", "_local")

    def __init__(self, args, slots):
        self.template = np.zeros(len(args), np.uint64)
        slot_bytes = self.template.view(np.uint8).reshape(len(args), 8)
        for position, arg in enumerate(args):
            if arg is None:
                continue
            value = np.asarray(arg)
            if value.ndim != 0 or value.dtype.itemsize > 8 or value.dtype.kind not in "iuf":
                raise TypeError(f"kernel argument {position} must be a scalar made by I32, "
                                f"I64, F32 or Ptr; got {arg!r}")
            raw = value.reshape(1).view(np.uint8)
            slot_bytes[position, :raw.size] = raw
        missing = [p for p, arg in enumerate(args) if arg is None]
        named = sorted(position for position, _ in slots)
        if named != missing:
            raise ValueError(f"kernel arguments left as None at {missing} must be exactly "
                             f"the call's pointer slots; slots name {named}")
        self.slots = tuple(slots)
        self._local = threading.local()

    def _buffers(self):
        values = self.template.copy()
        addresses = values.ctypes.data + 8 * np.arange(len(values), dtype=np.uint64)
        self._local.buffers = buffers = (values, addresses, int(addresses.ctypes.data))
        return buffers

    def fill(self, pointers) -> int:
        """Writes `pointers[name]` into each slot of this thread's parameter block and
        returns the address of its parameter array (valid until this thread's next fill)."""
        try:
            values, _, params = self._local.buffers
        except AttributeError:
            values, _, params = self._buffers()
        for position, name in self.slots:
            values[position] = pointers[name]
        return params

    def values(self, pointers) -> np.ndarray:
        """The slots as one call would pass them (uint64 each), for tests."""
        self.fill(pointers)
        return self._local.buffers[0].copy()


_api = None  # (cuLaunchKernel, cupy.cuda.get_current_stream), imported on first use


def _cuda_api():
    global _api
    if _api is None:
        import cupy
        from cupy_backends.cuda.api import driver

        _api = driver.launchKernel, cupy.cuda.get_current_stream
    return _api


# cuLaunchKernelEx's configuration (cuda.h CUlaunchConfig_st, CUlaunchAttribute_st: an id,
# padding to 8 bytes, a 64-byte value union whose first int is the value used here).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint),
                ("block_z", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_launch_ex = None  # cuLaunchKernelEx, loaded on first use


def _cuda_launch_ex():
    global _launch_ex
    if _launch_ex is None:
        driver = ctypes.CDLL("libcuda.so.1")
        function = driver.cuLaunchKernelEx
        function.argtypes = [ctypes.c_void_p] * 4
        function.restype = ctypes.c_int
        _launch_ex = function
    return _launch_ex


class Launch:
    """One kernel launch worked out in advance: the kernel (compiled, its shared memory
    opted in), grid, block, shared memory and parameter block. Calling it with the call's
    {name: device address} launches it on the current CuPy stream; with `overlap`, as the
    programmatic dependent of the kernel before it (the module docstring)."""
    __slots__ = ("kernel", "function", "grid", "block", "smem", "args", "overlap", "_local")

    def __init__(self, config, name, grid, block, smem, args, slots, overlap=False):
        self.kernel = config.get(name, smem)   # a cupy.RawKernel (keeps its module loaded)
        self.function = self.kernel.kernel.ptr  # its CUfunction on the current device
        self.grid, self.block, self.smem = int(grid), int(block), int(smem)
        self.args = KernelArgs(args, slots)
        self.overlap = bool(overlap)
        self._local = threading.local()  # (overlap) this thread's launch configuration

    def __call__(self, pointers):
        launch, current_stream = _api or _cuda_api()
        if not self.overlap:
            launch(self.function, self.grid, 1, 1, self.block, 1, 1, self.smem,
                   current_stream().ptr, self.args.fill(pointers), 0)
            return
        try:
            config, address = self._local.config
        except AttributeError:
            config, address = self._local.config = self._config()
        config.stream = current_stream().ptr
        status = (_launch_ex or _cuda_launch_ex())(address, self.function,
                                                   self.args.fill(pointers), None)
        if status != 0:
            from cupy_backends.cuda.api import driver

            raise driver.CUDADriverError(status)

    def _config(self):
        attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig(grid_x=self.grid, grid_y=1, grid_z=1, block_x=self.block,
                               block_y=1, block_z=1, smem=self.smem,
                               attrs=ctypes.pointer(attribute), num_attrs=1)
        config._attribute = attribute  # (kept alive with the configuration)
        return config, ctypes.addressof(config)
