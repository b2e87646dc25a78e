"""A forward of one input geometry captured as a CUDA graph and replayed (CapturedForward).

At small sizes a call's host work (argument checks, the plan look-up, the scratch
allocation, one driver call per launch) is a large share of its time. A CUDA graph
records the launches, memsets and copies of one forward once; a replay is one
cudaGraphLaunch whose kernels read the same device addresses: the static pair and mask
(read in place at every replay), the weights, the scratch and `out`.

How it is made (TriangleAttention.capture):
  1. warm-up: one ordinary forward on a private non-blocking stream, synchronized. It
     makes the Plan (compiles kernels, uploads the weights' layouts: the work that
     synchronizes and so cannot be captured) and takes its memory from the arena;
  2. capture: a Forward built and run inside ``stream.begin_capture()`` ...
     ``stream.end_capture()``. It is built inside the capture because its __init__ may
     enqueue copies (the aligned copy of a strided pair) that every replay must repeat.
     Its memory comes from the arena again, the warm-up's blocks in the warm-up's order,
     so nothing is allocated during the capture where the sizes repeat; its row blocks
     are the warm-up's (pinned: the free memory, which chooses them, may have changed).
The arena (`_Arena`) owns every block for the CapturedForward's lifetime: the graph refers
to their addresses. The blocks are cudaMalloc'd outside CuPy's pool, so that their release
(cudaFree, which waits for the device's work) can never hand memory to another stream while
a replay still runs.

The kernels, the launches and the scratch layout are the ones `module(pair, mask, ...)`
launches for the same arguments: a replay gives the same bits as the call.
"""
from __future__ import annotations

import contextlib

from .checks import _cupy, as_device_array, bfloat16_bits, bfloat16_dtype
from .forward import Forward
from . import dependent_launch, row_blocks

# CuPy's stream capture (Stream.begin_capture / end_capture, cupy.cuda.graph.Graph)
GRAPH_API_CUPY_VERSION = "11"


def check_graph_api(cupy) -> None:
    """RuntimeError naming the CuPy version needed where `cupy` lacks stream capture."""
    stream = getattr(getattr(cupy, "cuda", None), "Stream", None)
    if not (hasattr(stream, "begin_capture") and hasattr(stream, "end_capture")):
        raise RuntimeError(
            f"capturing a forward as a CUDA graph needs CuPy {GRAPH_API_CUPY_VERSION} or "
            f"newer (cupy.cuda.Stream.begin_capture); this CuPy is "
            f"{getattr(cupy, '__version__', 'of an unknown version')}. Upgrade it: pip "
            f"install -U cupy-cuda13x (or cupy-cuda12x)")


def check_like(name: str, static, given) -> None:
    """ValueError naming the argument unless `given` has the static array's shape and
    dtype (what a copy into the static array, read in place by every replay, needs)."""
    if tuple(given.shape) != tuple(static.shape) or given.dtype != static.dtype:
        raise ValueError(
            f"{name} must have the captured {name}'s shape {tuple(static.shape)} and dtype "
            f"{static.dtype}; got shape {tuple(given.shape)} and dtype {given.dtype}")


class _Arena:
    """Device memory of one captured forward: an `allocate` callable for Forward (nbytes
    -> cupy.cuda.Memory, 256-byte aligned). `rewind()` makes the next requests take the
    blocks already made, in their order, where each is large enough; every block lives as
    long as the arena."""

    def __init__(self, cupy):
        self._cupy = cupy
        self.blocks: list = []
        self._next = 0

    def rewind(self):
        self._next = 0

    def __call__(self, nbytes: int):
        if self._next < len(self.blocks) and self.blocks[self._next].size >= nbytes:
            block = self.blocks[self._next]
        else:
            block = self._malloc(max(int(nbytes), 1))
            self.blocks.insert(self._next, block)
        self._next += 1
        return block

    def _malloc(self, nbytes: int):
        cupy = self._cupy
        try:
            return cupy.cuda.Memory(nbytes)
        except cupy.cuda.runtime.CUDARuntimeError:  # the pool's free blocks back first
            cupy.get_default_memory_pool().free_all_blocks()
            return cupy.cuda.Memory(nbytes)

    @property
    def nbytes(self) -> int:
        return sum(block.size for block in self.blocks)


class CapturedForward:
    """One forward of `module` captured as a CUDA graph; made by TriangleAttention.capture.

    pair, mask: the static arrays, the caller's own objects: every replay reads them in
           place (update them in place, or pass new values to the call).
    out:   the result array every replay writes: the caller's `out`, else one made at
           capture (it holds the warm-up forward's result until the first replay).
    ``graph()`` replays on CuPy's current stream (of the weights' device) and returns
    `out`; ``graph(pair2, mask2)`` first copies pair2 (and mask2, where given) into the
    static arrays on that stream (each of the static array's shape and dtype, else a
    ValueError). Nothing synchronizes: the replay is ordered on the stream after the
    work already enqueued there, as a call is. Replays on one static set of arrays
    share one scratch: replay on one stream at a time (or order the streams), as calls
    sharing an `out` would.

    The same bits as ``module(pair, mask, out=..., **options)``: the same Plan, kernels,
    launches and scratch layout. The module's weights are read where the capture found
    them: capture again for other weights."""

    def __init__(self, module, pair, mask, out, options: dict):
        cupy = _cupy()
        check_graph_api(cupy)
        self.module, self.options = module, dict(options)  # (the call's keywords)
        self.device = module.device
        self.pair, self.mask = pair, mask
        # CuPy views taken once, before the capture: taking a foreign array may synchronize
        # the stream its __cuda_array_interface__ names, which a capture must not record
        self._pair_view, pair_bfloat16 = _device_view(pair, "pair", self.device)
        self._mask_view = (None if mask is None
                           else _device_view(mask, "mask", self.device)[0])
        out_view, out_bfloat16 = (None, False) if out is None else _device_view(
            out, "out", self.device)
        pair, mask = self._pair_view, self._mask_view
        pair_dtype = "bfloat16" if pair_bfloat16 else None
        out = out_view
        self._arena = _Arena(cupy)
        dw, conventions = module._dw, module._conventions(options.get("mask_layout"),
                                                          options.get("node"))
        args = dict(fully_masked=options.get("fully_masked", "zero"),
                    precision=options.get("precision", "fp32"), route=options.get("route"))
        row_block = options.get("row_block")
        max_scratch_bytes = options.get("max_scratch_bytes")
        with cupy.cuda.Device(self.device):
            self._stream = stream = cupy.cuda.Stream(non_blocking=True)
            # The warm-up after the work the caller's stream holds (which may be writing
            # the pair): a non-blocking stream is not ordered after it otherwise
            stream.wait_event(cupy.cuda.get_current_stream().record())
            with stream:
                warm = Forward(dw, pair, mask, args["fully_masked"], out, args["precision"],
                               route=args["route"], conventions=conventions,
                               pair_dtype=pair_dtype,
                               row_block=row_block, max_scratch_bytes=max_scratch_bytes,
                               allocate=self._arena)
                plan, rows_per_block = warm.plan, warm.rows_per_block
                warm_out = warm.run()
                stream.synchronize()
                del warm
                # The warm-up's choice of single pass or row blocks, pinned
                if rows_per_block is not None:
                    row_block, max_scratch_bytes = rows_per_block, None
                elif (max_scratch_bytes is not None
                      or plan.scratch_bytes > row_blocks.SCRATCH_FLOOR_BYTES):
                    max_scratch_bytes = plan.scratch_bytes
                self._arena.rewind()
                stream.begin_capture()
                try:
                    forward = Forward(dw, pair, mask, args["fully_masked"], out,
                                      args["precision"], route=args["route"],
                                      conventions=conventions, pair_dtype=pair_dtype,
                                      row_block=row_block,
                                      max_scratch_bytes=max_scratch_bytes,
                                      allocate=self._arena)
                    if forward.plan is not plan or forward.rows_per_block != rows_per_block:
                        raise RuntimeError(
                            "the forward changed between the warm-up and the capture (its "
                            "plan was remade, or the free device memory chose other row "
                            "blocks): capture again, or pass row_block= to fix the row "
                            "blocks")
                    # The attention and the out projection as programmatic dependents
                    # in small forwards, where the GPU and driver take them: edges that
                    # skip the gaps between the kernels at every replay
                    # (gpu/dependent_launch.py)
                    with dependent_launch.launches_as_dependents(
                            dependent_launch.chosen(dw.compute_capability, plan.M)):
                        self.out = forward.run()
                except BaseException:
                    _abandon_capture(stream)
                    raise
                graph = stream.end_capture()
                self._graph = graph
                if out is None and self.out.data.ptr != warm_out.data.ptr:
                    _bits(self.out)[...] = _bits(warm_out)  # (the warm-up's result)
                    stream.synchronize()
        if (out is None and pair_bfloat16) or out_bfloat16:  # as a call returns a torch
            self.out = self.out.view(bfloat16_dtype(self.out.dtype))  # bfloat16 result
        self.rows_per_block = rows_per_block
        self.route = plan.route

    @property
    def memory_bytes(self) -> int:
        """The device memory the captured forward owns (scratch, copies, a made `out`)."""
        return self._arena.nbytes

    def __call__(self, pair=None, mask=None):
        cupy = _cupy()
        switch = cupy.cuda.runtime.getDevice() != self.device
        with cupy.cuda.Device(self.device) if switch else contextlib.nullcontext():
            copies = []  # (static, given): every argument checked before any copy
            if pair is not None:
                given = _device_view(pair, "pair", self.device)[0]
                check_like("pair", self._pair_view, given)
                copies.append((self._pair_view, given))
            if mask is not None:
                if self._mask_view is None:
                    raise ValueError("mask: this forward was captured without a mask "
                                     "(mask=None), so it has no mask to update; capture "
                                     "with a mask to replay with one")
                given = _device_view(mask, "mask", self.device)[0]
                check_like("mask", self._mask_view, given)
                copies.append((self._mask_view, given))
            for static, given in copies:
                _bits(static)[...] = _bits(given)
            self._graph.launch(cupy.cuda.get_current_stream())
        return self.out

    def __repr__(self):
        return (f"CapturedForward(pair={tuple(self._pair_view.shape)}, "
                f"mask={'None' if self.mask is None else tuple(self._mask_view.shape)}, "
                f"route={self.route.name!r}, rows_per_block={self.rows_per_block}, "
                f"device={self.device})")


def _device_view(obj, name: str, device_id: int):
    """(a CuPy view of `obj`, whether it is a torch bfloat16 tensor, viewed as its int16
    bits), no copy."""
    obj, torch_bfloat16 = bfloat16_bits(obj)
    return as_device_array(obj, name, device_id), torch_bfloat16


def _abandon_capture(stream):
    """Ends the capture under way on `stream` after an error inside it, so that the stream
    is usable again; the graph (where CUDA still makes one) is dropped, and an error of
    an invalidated capture gives way to the error that ended it."""
    try:
        stream.end_capture()
    except Exception:
        pass


def _bits(array):
    """A bfloat16 (ml_dtypes) array as its uint16 bits, for copies; others as they are."""
    return array.view("uint16") if array.dtype.name == "bfloat16" else array
