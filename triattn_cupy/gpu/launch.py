"""Kernel launches worked out once and issued through the CUDA driver.

At small sizes the caller waits on the host: the event-timed forward at 2x128x64x4 spent
~27 µs before its first kernel started, ~9 µs of it in CuPy's kernel call, which turns
every argument into its C form at every launch. Here a
launch's arguments are laid out once, each in an 8-byte slot of a template (cuLaunchKernel
reads each parameter's own size from its slot's address, little-endian), and a call
copies the template's values for its thread, writes its pointers into their slots and
calls cuLaunchKernel (CuPy's `driver.launchKernel`) on the current CuPy stream.

Arguments: `I32`, `I64`, `F32` (scalars, by value) and `Ptr` (a device address), or
`None` for a pointer or integer that each call supplies (`slots`: position -> the name it
is given by in the call's dictionary of values).

Each kernel's parameters are declared once, by name and kind (`Signature`); a launch binds
values to names, never to slot numbers.
"""
from __future__ import annotations

import threading

import numpy as np

from . import dependent_launch


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


class Call(str):
    """An argument that each call supplies: the name of its value in the call's dictionary
    (Forward: the addresses pair, mask, qkvg, bias, vt, extent, out; row blocks also the
    integers row_begin, row_end and M). Pointers and integers only: a slot holds the
    value's 8 little-endian bytes, of which the kernel reads its parameter's size."""


_KINDS = {"i32": I32, "i64": I64, "f32": F32, "ptr": Ptr}


class Signature:
    """A kernel's parameter list, declared once: ("kind name", ...) in the kernel's order,
    kind one of i32, i64, f32, ptr. `bind(**values)` gives the (args, slots) of a Launch:
    each value converted by its kind, a `Call` left for each call to fill in."""

    def __init__(self, *params: str):
        self.params = tuple(tuple(p.split()) for p in params)

    def __add__(self, other: "Signature") -> "Signature":
        return Signature(*(" ".join(p) for p in self.params + other.params))

    def bind(self, **values):
        names = [name for _, name in self.params]
        if set(values) != set(names):
            raise TypeError(f"kernel arguments {sorted(set(names) - set(values))} missing, "
                            f"{sorted(set(values) - set(names))} unknown")
        args, slots = [], []
        for position, (kind, name) in enumerate(self.params):
            value = values[name]
            if isinstance(value, Call):
                if kind == "f32":
                    raise TypeError(f"kernel argument {name} is f32: a call supplies "
                                    f"pointers and integers only")
                args.append(None)
                slots.append((position, str(value)))
            else:
                args.append(_KINDS[kind](value))
        return tuple(args), tuple(slots)


class Launch:
    """One kernel launch worked out in advance: the kernel (compiled, its shared memory
    opted in), grid, block, shared memory and parameter block (`bound`: Signature.bind's
    args and slots). Calling it with the call's {name: value} launches it on the current
    CuPy stream; a `grid` of None is given by each call (row blocks)."""
    __slots__ = ("config", "name", "kernel", "function", "grid", "block", "smem", "args",
                 "dependent")

    def __init__(self, config, name, grid, block, smem, bound, dependent: bool = False):
        self.config, self.name = config, name
        self.kernel = config.get(name, smem)   # a cupy.RawKernel (keeps its module loaded)
        self.function = self.kernel.kernel.ptr  # its CUfunction on the current device
        self.grid = None if grid is None else int(grid)
        self.block, self.smem = int(block), int(smem)
        self.args = KernelArgs(*bound)
        # Its kernel waits for the previous one before reading what that wrote
        # (wait_for_previous_kernel), so it may go out as a programmatic dependent
        # inside dependent_launch.launches_as_dependents()
        self.dependent = dependent

    def __call__(self, pointers, grid: int | None = None):
        launch, current_stream = _api or _cuda_api()
        grid = self.grid if grid is None else int(grid)
        if self.dependent and dependent_launch.active():
            dependent_launch.launch(self.function, grid, self.block, self.smem,
                                    current_stream().ptr, self.args.fill(pointers))
            return
        launch(self.function, grid, 1, 1, self.block, 1, 1, self.smem,
               current_stream().ptr, self.args.fill(pointers), 0)
