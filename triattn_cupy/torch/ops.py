"""The `triattn::triangle_attention` custom op: torch tensors in, torch tensors out.

The op runs the GPU kernels on torch's current stream, reading the pair and the mask in
place and writing the output into a tensor from torch's allocator; its scratch comes from
torch's allocator too, so that CUDA graph capture keeps it in the graph's private pool.
On the CPU it runs the NumPy backend in float64 (a reference, not a fast path).

Why the weights travel as an int handle: the kernels read the weights in prepared layouts
(TF32 chunks, fp16 hi/lo splits, range scales computed on the host), made once per device
(`gpu.device_weights.DeviceWeights`). A Python object cannot be an op argument, and passing
the raw parameter tensors would redo those layouts on every call or key a cache on tensor
identity. An int is a constant that torch.compile and CUDA graphs carry as is; the op looks
the prepared weights up at run time, where it also checks whether the module they came from
has changed its parameters since (`Registered.current`).
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Optional

import numpy as np
import torch

from .. import reference
from .._checks import check_fully_masked
from ..conventions import check_mask_layout, check_node
from ..gpu.checks import check_precision
from ..weights import Weights

__all__ = ["triangle_attention", "register_weights", "unregister", "IO_DTYPES"]

# The pair and output dtypes the kernels read and write (the arithmetic is `precision`'s).
IO_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class Registered:
    """The weights behind one handle, uploaded once per device.

    `source` (optional): (signature, reimport) callables of the module the weights came
    from; `current` re-imports and re-uploads when the signature (each parameter's
    identity, address and version counter) changes: a new checkpoint loaded with
    load_state_dict, an in-place edit, a parameter replaced. `weak`: hold the weights by a
    weak reference (the functional form: the handle dies with the caller's object).
    `tally` (optional, fallbacks.Tally): counts the calls computed with these weights."""

    def __init__(self, weights: Weights, source=None, weak: bool = False, tally=None):
        self._weights = weakref.ref(weights) if weak else (lambda: weights)
        self.source = source
        self.tally = tally
        self.signature = source[0]() if source else None
        self.device_weights: dict = {}
        self.warm: set = set()  # the call geometries run (their plans and layouts made)
        self.lock = threading.Lock()

    def _refresh(self, capturing: bool = False):
        """Re-import the weights where the source module's parameters changed."""
        if self.source is None:
            return
        signature = self.source[0]()
        if signature != self.signature:
            if capturing:
                raise RuntimeError(_CAPTURE_ERROR.format(
                    what="the block's parameters changed since its last call"))
            weights, self.signature = self.source[1](), signature
            self._weights = lambda: weights
            self.device_weights.clear()
            self.warm.clear()

    @property
    def weights(self) -> Weights:
        weights = self._weights()
        if weights is None:
            raise ValueError("the Weights object of this handle was freed")
        return weights

    def current(self, device_id: int, capturing: bool = False):
        """The DeviceWeights for `device_id` (made on first use), re-imported first where
        the source module's parameters changed. `capturing`: inside a CUDA graph capture,
        where uploads and layouts would be recorded rather than done: an error then."""
        with self.lock:
            self._refresh(capturing)
            dw = self.device_weights.get(device_id)
            if dw is None:
                if capturing:
                    raise RuntimeError(_CAPTURE_ERROR.format(
                        what=f"these weights have not run on GPU {device_id}"))
                from ..gpu.device_weights import DeviceWeights

                dw = self.device_weights[device_id] = DeviceWeights(self.weights, device_id)
            return dw

    def weights_now(self) -> Weights:
        """The weights, re-imported first where the source changed (the CPU path)."""
        with self.lock:
            self._refresh()
            return self.weights


_CAPTURE_ERROR = (
    "triattn::triangle_attention inside a CUDA graph capture: {what}, so its weights "
    "would be uploaded or laid out during the capture. Run the model once on the same "
    "shapes before capturing (the warm-up torch.cuda.graphs asks for)")

_registry: dict = {}
_handles = itertools.count(1)
_by_weights: "weakref.WeakKeyDictionary[Weights, int]" = weakref.WeakKeyDictionary()


def register_weights(weights: Weights, source=None, weak: bool = False, tally=None) -> int:
    """A new handle for `weights` (see `Registered` for `source`, `weak` and `tally`)."""
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be a triattn_cupy.Weights; got {type(weights).__name__}")
    handle = next(_handles)
    _registry[handle] = Registered(weights, source, weak, tally)
    return handle


def unregister(handle: int) -> None:
    _registry.pop(handle, None)


def _handle_of(weights: Weights) -> int:
    """The handle of a Weights object passed to the functional form (one per object; it is
    forgotten with the object)."""
    handle = _by_weights.get(weights)
    if handle is None or handle not in _registry:
        handle = register_weights(weights, weak=True)
        _by_weights[weights] = handle
        weakref.finalize(weights, _registry.pop, handle, None)
    return handle


def _lookup(handle: int) -> Registered:
    entry = _registry.get(handle)
    if entry is None:
        raise ValueError(f"weights handle {handle} is not registered (its model was restored "
                         f"or its Weights object was freed)")
    return entry


# --- the GPU implementation --------------------------------------------------------------

_streams: dict = {}  # (device id, stream address) -> cupy ExternalStream


def _cupy_stream(cupy, device: torch.device):
    """CuPy's handle on torch's current stream of `device` (made once per stream)."""
    ptr = torch.cuda.current_stream(device).cuda_stream
    key = (device.index, ptr)
    stream = _streams.get(key)
    if stream is None:
        if len(_streams) > 256:  # streams come and go; their handles cost nothing to remake
            _streams.clear()
        stream = _streams[key] = cupy.cuda.ExternalStream(ptr, device.index)
    return stream


def _torch_allocator(cupy, device: torch.device):
    """nbytes -> a CuPy MemoryPointer into a uint8 tensor from torch's caching allocator
    (stream-ordered on torch's current stream, and inside a CUDA graph capture taken from
    the graph's private pool). The tensor lives as long as the pointer."""
    def allocate(nbytes: int):
        block = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=device)
        memory = cupy.cuda.UnownedMemory(block.data_ptr(), block.numel(), block, device.index)
        return cupy.cuda.MemoryPointer(memory, 0)
    return allocate


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16,
                 torch.bfloat16: np.int16, torch.float64: np.float64, torch.bool: np.bool_,
                 torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
                 torch.int32: np.int32, torch.int64: np.int64}


def _as_cupy(cupy, tensor: torch.Tensor):
    """A CuPy view of a CUDA tensor (no copy): bfloat16, which CuPy has no type for, as
    its int16 bits. Made from the tensor's address, shape and strides rather than its
    __cuda_array_interface__ (a dictionary built and parsed at every call: host time that
    small blocks' kernels wait on); the tensor is the memory's owner, kept alive."""
    dtype = _NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        return cupy.asarray(tensor.detach())
    itemsize = tensor.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) \
        if tensor.numel() else 0
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), span * itemsize, tensor,
                                     tensor.device.index)
    return cupy.ndarray(tuple(tensor.shape), dtype, cupy.cuda.MemoryPointer(memory, 0),
                        strides=tuple(s * itemsize for s in tensor.stride()))


def _run_cuda(pair, mask, handle, precision, fully_masked, mask_layout, node, out):
    from ..cuda_setup import require_cuda
    from ..gpu.forward import Forward

    cupy = require_cuda()
    device = pair.device
    entry = _lookup(handle)
    if mask is not None and mask.dtype == torch.bfloat16:  # CuPy has no bfloat16: 0 or not
        mask = mask != 0
    allocate = _torch_allocator(cupy, device)
    # The first call of a geometry makes its plan and the weight layouts its kernels read
    # (kernels and uploads on this stream): never inside a capture.
    geometry = (device.index, tuple(pair.shape), pair.stride(), pair.dtype, precision,
                fully_masked, mask_layout, node, None if mask is None else
                (tuple(mask.shape), mask.stride(), mask.dtype))
    with torch.cuda.device(device), cupy.cuda.Device(device.index), \
            _cupy_stream(cupy, device):
        capturing = torch.cuda.is_current_stream_capturing()
        dw = entry.current(device.index, capturing)
        if capturing and geometry not in entry.warm:
            raise RuntimeError(_CAPTURE_ERROR.format(
                what="this input geometry has not run before"))
        # Every CuPy allocation of the call (scratch, aligned copies) from torch's allocator;
        # pair_dtype names the pair's type (the bits of a bfloat16 pair arrive as int16)
        with cupy.cuda.using_allocator(allocate):
            Forward(dw, _as_cupy(cupy, pair), None if mask is None else _as_cupy(cupy, mask),
                    fully_masked, _as_cupy(cupy, out), precision,
                    conventions=(mask_layout, node), pair_dtype=IO_DTYPES[pair.dtype],
                    allocate=allocate).run()
    if len(entry.warm) > 256:  # geometries come and go; a forgotten one warms up again
        entry.warm.clear()
    entry.warm.add(geometry)
    return out


# --- the CPU implementation --------------------------------------------------------------

def _run_cpu(pair, mask, handle, fully_masked, mask_layout, node, out):
    weights = _lookup(handle).weights_now()
    result = reference.triangle_attention(
        pair.detach().double().numpy(),
        None if mask is None else mask.detach().double().numpy(),
        weights, fully_masked=fully_masked, mask_layout=mask_layout, node=node)
    out.copy_(torch.from_numpy(np.ascontiguousarray(result)))
    return out


def _compute(pair, mask, handle, precision, fully_masked, mask_layout, node, out):
    if pair.device.type == "cuda":
        _run_cuda(pair, mask, handle, precision, fully_masked, mask_layout, node, out)
    elif pair.device.type == "cpu":
        _run_cpu(pair, mask, handle, fully_masked, mask_layout, node, out)
    else:
        raise ValueError(f"pair is on {pair.device}; expected a CUDA (or CPU) tensor")
    # Counted here, where every call computes (eager or compiled), not where it is traced
    tally = _lookup(handle).tally
    if tally is not None:
        tally.count_kernel_call()
    return out


# --- the ops -----------------------------------------------------------------------------

@torch.library.custom_op("triattn::triangle_attention", mutates_args=())
def _op(pair: torch.Tensor, mask: Optional[torch.Tensor], handle: int, precision: str,
        fully_masked: str, mask_layout: str, node: str) -> torch.Tensor:
    out = torch.empty(pair.shape, dtype=pair.dtype, device=pair.device)
    return _compute(pair, mask, handle, precision, fully_masked, mask_layout, node, out)


@_op.register_fake
def _op_fake(pair, mask, handle, precision, fully_masked, mask_layout, node):
    return pair.new_empty(pair.shape)  # C-contiguous, pair's dtype and device


@torch.library.custom_op("triattn::triangle_attention_out", mutates_args=("out",))
def _op_out(pair: torch.Tensor, mask: Optional[torch.Tensor], handle: int, precision: str,
            fully_masked: str, mask_layout: str, node: str, out: torch.Tensor) -> None:
    _compute(pair, mask, handle, precision, fully_masked, mask_layout, node, out)


@_op_out.register_fake
def _op_out_fake(pair, mask, handle, precision, fully_masked, mask_layout, node, out):
    return None


# --- the public function -----------------------------------------------------------------

def _check_tensors(pair, mask, out, pair_dim):
    if not isinstance(pair, torch.Tensor):
        raise TypeError(f"pair must be a torch.Tensor; got {type(pair).__name__}")
    if pair.dtype not in IO_DTYPES:
        raise TypeError(f"pair must be float32, bfloat16 or float16; got {pair.dtype}")
    if pair.dim() not in (3, 4) or pair.shape[-3] != pair.shape[-2] \
            or pair.shape[-1] != pair_dim:
        raise ValueError(f"pair must have shape (B, N, N, {pair_dim}) or (N, N, {pair_dim}); "
                         f"got {tuple(pair.shape)}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor or None; got {type(mask).__name__}")
        if mask.device != pair.device:
            raise ValueError(f"mask is on {mask.device} but pair is on {pair.device}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None; got {type(out).__name__}")
        if out.shape != pair.shape or out.dtype != pair.dtype or out.device != pair.device \
                or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {pair.dtype} tensor of shape "
                             f"{tuple(pair.shape)} on {pair.device}; got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device} "
                             f"(contiguous={out.is_contiguous()})")


def triangle_attention(pair, mask, weights: Weights, *, precision: str = "fp32",
                       fully_masked: str = "zero", out=None, mask_layout=None, node=None):
    """Triangle self-attention on torch tensors, on torch's current stream.

    pair:  (B, N, N, D) or (N, N, D) CUDA tensor, float32, bfloat16 or float16, any
           strides; read in place in its own dtype.
    mask:  (B, N, N) / (N, N) of bool, int or float on pair's device (0 = masked), or
           None; with mask_layout "row" also (B, N, 1, 1, N). Read in place.
    weights: a `triattn_cupy.Weights`, uploaded to each device once and cached.
    precision: the arithmetic ("fp32", "tf32", "bf16"), whatever pair's dtype.
    fully_masked, mask_layout, node: as `triattn_cupy.triangle_attention`.
    out:   optional contiguous tensor like pair (its dtype) to write into.
    Returns a tensor of pair's shape and dtype (C-contiguous). CPU tensors run the NumPy
    backend in float64 (a reference). A registered torch op (``triattn::triangle_attention``)
    with a fake implementation: it traces under torch.compile and replays in CUDA graphs.
    """
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be a triattn_cupy.Weights (see load_weights, "
                        f"import_weights); got {type(weights).__name__}")
    _check_tensors(pair, mask, out, weights.pair_dim)
    check_precision(precision)
    check_fully_masked(fully_masked)
    mask_layout = check_mask_layout(weights.mask_layout if mask_layout is None else mask_layout)
    node = check_node(weights.node if node is None else node)
    handle = _handle_of(weights)
    if out is None:
        return _op(pair, mask, handle, precision, fully_masked, mask_layout, node)
    _op_out(pair, mask, handle, precision, fully_masked, mask_layout, node, out)
    return out
