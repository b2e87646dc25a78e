"""One call of the GPU forward pass (Forward): arguments checked, the Plan of its input
geometry looked up (made on first use), scratch allocated, the stages launched.

Stages (one launch each; the kernels of each route: gpu/routes.py, gpu/kernel_configs.py):
  project    LayerNorm + q/k/v/gate + pair bias with the mask folded in (the mask read in
             place, in its own dtype and strides), written in the route's layout; the row
             mask layout folds no mask in
  row mask   the row mask layout: its key bits per row (b, i) (row_mask.cu)
  extent     masked forwards from N = 512: each batch's last kept key (key_extent.cu)
  attention  flash-style softmax attention, o written over q
  out        (g * o) Wo^T + bo
Scratch: qkvg rows (4D, 2D or D words by layout), the bias (fp32 or fp16; tiles for the
tiled layouts), the K and V^T tiles, the key extent and the row mask's bits, one
allocation per call (CuPy's memory pool, or the caller's `allocate`). Everything a call
launches besides its pointers is worked out once per module and input geometry (Plan): at
small sizes the caller waits on host time.
The pair is read, and the output written, in the pair's own type (float32, float16 or
bfloat16: the projections' PAIR_DTYPE); everything between is the route's arithmetic.
The ending node runs on the transposed pair and mask, read in place as strided views; the
out projection writes each row back to the caller's layout (OUT_TRANSPOSED).
Where the scratch of every row would pass the limit (row_blocks.rows_per_block), the
stages run in blocks of pair rows on a scratch of one block (row_blocks.run): the same
bits for blocks of whole out-projection tiles (row_blocks.row_unit).
"""
from __future__ import annotations

import contextlib

import numpy as np

from .._checks import check_fully_masked, check_mask_dtype, pair_geometry
from ..conventions import Conventions, check_mask_shape
from . import checks, layouts, row_blocks
from .checks import _cupy, as_device_array
from .device_weights import DeviceWeights
from .launch_plan import PlanKey, make_plan


_PLANS_PER_MODULE = 64  # geometries remembered per DeviceWeights (then forgotten, all at once)


class Forward:
    """One forward pass prepared: arguments checked, its Plan looked up (made on first
    use), scratch allocated. `stages()` lists the launches in order; `run()` performs
    them all. `route` forces a route (routes.ROUTES name or Route); `attention` one
    attention kernel (tile sweeps and tests), with the projections its layout takes.

    The contract for callers that build a Forward themselves (triattn_cupy.torch):

    pair:  (B, N, N, D) or (N, N, D), any strides: a CuPy array (or any object
           as_device_array takes) of float32, float16, or bfloat16 (a CuPy array of
           ml_dtypes.bfloat16, or a torch bfloat16 tensor, taken as its int16 bits), or a
           uint16 / int16 array of bfloat16 bits with ``pair_dtype="bfloat16"``. The
           kernels read it in that type (no conversion pass); rows that are not
           contiguous and 16-byte aligned are read from an aligned copy in the same type
           (16-bit pairs with D % 8 != 0: in place, by scalar loads).
    pair_dtype: None (the pair's dtype says it), or "float32", "float16", "bfloat16" (the
           last also for 16-bit integer arrays holding bfloat16 bits).
    out:   None, or C-contiguous, shaped like pair, of the pair's type (for bfloat16 any
           of its carriers: ml_dtypes.bfloat16, uint16, int16, a torch bfloat16 tensor).
           The result (`out`, or `run()`'s value) is `out` itself; else a new array of the
           pair's dtype as given (uint16 / int16 bits stay so; a torch bfloat16 pair gives
           ml_dtypes.bfloat16 where ml_dtypes imports, else its int16 bits).
    allocate: None (CuPy's memory pool), or a callable nbytes -> object with an integer
           `.ptr` (a device address on the weights' device, valid while the object
           lives, 256-byte aligned as allocators give): the scratch, the aligned copies
           and the result when `out` is None come from it (a capture-aware allocator
           under CUDA graph capture). The Forward keeps each object alive as long as it
           lives, and the result array keeps its own.
    Once the Plan exists, nothing here synchronizes the device or the stream: the
    launches, the memsets and the copies are all asynchronous on CuPy's current stream
    (the caller sets it: torch's stream, cupy.cuda.ExternalStream). Making a Plan (first
    call of a geometry) compiles kernels and uploads weights, which does. CuPy taking an
    array through __cuda_array_interface__ synchronizes the stream the interface names,
    where it names one (torch's names none); CuPy arrays over the tensors' memory
    (cupy.cuda.UnownedMemory, as triattn_cupy.torch makes them) never do."""

    def __init__(self, dw: DeviceWeights, pair, mask, fully_masked: str, out,
                 precision: str = "fp32",
                 attention: "kernel_configs.AttentionLaunch | None" = None,
                 route: "routes.Route | str | None" = None,
                 conventions: "Conventions | tuple[str, str]" = Conventions(),
                 pair_dtype: str | None = None, allocate=None,
                 row_block: int | None = None, max_scratch_bytes: int | None = None):
        cupy = _cupy()
        row_blocks.check_row_block_args(row_block, max_scratch_bytes)
        check_fully_masked(fully_masked)
        checks.check_precision(precision)
        self.dw, self._allocate = dw, allocate
        conventions = Conventions(*conventions)  # (a (mask_layout, node) pair too)
        pair, mask = self._take_inputs(cupy, pair, mask, pair_dtype, conventions)
        out = self._take_out(cupy, out, pair.shape)
        # Rows whose vector loads would be misaligned (an odd offset, a channel stride) are
        # read from an aligned copy, and an unaligned `out` is written through one: the
        # route, and so the bits, must not depend on where the arrays lie.
        if _needs_aligned_copy(pair):
            copy = self._array(pair.shape, pair.dtype)
            copy[...] = pair
            pair = copy
        self._out_target = None
        if out is not None and out.data.ptr % 16:
            self._out_target, out = out, None
        key = PlanKey.of(pair, mask, precision, fully_masked == "nan", route,
                         out_transposed=conventions.transposed,
                         row_mask=mask is not None and conventions.row_mask,
                         pair_dtype=self.pair_dtype)
        # Whether calls must switch to the weights' device (each look-up of the current
        # device costs ~0.7 µs of host time before the first kernel: done once here)
        self._switch = cupy.cuda.runtime.getDevice() != dw.device_id
        with self._on_device():  # one device switch: kernels, allocations
            self.plan = plan = self._plan(key, attention)
            self.pair, self.mask = pair, mask
            # Row blocks where the single pass's scratch would pass the limit (row_blocks.py)
            self.rows_per_block = _rows_per_block(cupy, dw, plan, pair, out is None,
                                                  row_block, max_scratch_bytes)
            self.devices = 1  # (emulate_devices: G devices emulated)
            if self.rows_per_block is None:
                self._scratch = self._memory(plan.scratch_bytes)  # qkvg, the bias, V^T
            else:
                blocked = self.blocked_scratch = row_blocks.BlockedScratch(
                    plan, self.rows_per_block)
                self._scratch = self._memory(blocked.nbytes)
        # The output's memory is taken after the first launch (take_out_memory: ~1 µs of
        # host time the first kernel need not wait on), its CuPy array after the last
        # (making an ndarray costs ~2.5 µs)
        self._out, self._out_memory = out, None if out is None else out.data
        self.pointers = self._addresses(out)

    def _take_inputs(self, cupy, pair, mask, pair_dtype, conventions: Conventions):
        """(pair, mask) as the kernels read them: checked, on the weights' device, the
        pair's 16-bit types as their bits, the mask (B, N, N), both transposed for an
        ending node. Sets pair_dtype and the result's dtype."""
        dw = self.dw
        pair, given_bfloat16 = checks.bfloat16_bits(pair)
        pair = as_device_array(pair, "pair", dw.device_id)
        self.pair_dtype = checks.check_pair_dtype(
            pair.dtype, "bfloat16" if given_bfloat16 else pair_dtype)
        # The result's dtype: the pair's as given (a torch bfloat16 pair's: ml_dtypes')
        self._result_dtype = (checks.bfloat16_dtype(pair.dtype) if given_bfloat16
                              else pair.dtype)
        if pair.dtype.name == "bfloat16":  # (ml_dtypes': CuPy copies it as its bits)
            pair = pair.view(cupy.uint16)
        B, N, batched = pair_geometry(pair.shape, dw.pair_dim)
        if mask is not None:
            mask = as_device_array(mask, "mask", dw.device_id)
            check_mask_dtype(mask.dtype)
            check_mask_shape(mask.shape, B, N, batched, conventions.mask_layout)
            if mask.ndim != (3 if batched else 2):  # the models' (B, N, 1, 1, N) row mask,
                # its unit axes dropped (a view)
                mask = mask.reshape((B, N, N) if batched else (N, N))
        _refuse_unsupported(conventions.node)
        if conventions.transposed:
            # The block on the transposed pair and mask, read in place (strided views:
            # x[b, i, j] = pair[b, j, i]); the out projection writes each row back to the
            # caller's layout (Plan.out_transposed), so `out` is shaped and laid out as pair.
            pair = pair.swapaxes(-2, -3)
            if mask is not None:
                mask = mask.swapaxes(-1, -2)
        return pair, mask

    def _take_out(self, cupy, out, shape):
        """The caller's `out` checked (shaped and typed as the pair), as its bits where
        bfloat16; None stays None. The caller's own object is what a call returns."""
        self._caller_out = out if isinstance(out, cupy.ndarray) else None
        if out is None:
            return None
        out, out_bfloat16 = checks.bfloat16_bits(out)
        out = as_device_array(out, "out", self.dw.device_id)
        checks.check_out(out, shape, self.pair_dtype, out_bfloat16)
        self._result_dtype = (checks.bfloat16_dtype(out.dtype) if out_bfloat16
                              else out.dtype)
        return out.view(cupy.uint16) if out.dtype.name == "bfloat16" else out

    def _plan(self, key: PlanKey, attention):
        """The Plan of `key`: the module's (made once, by one thread), or one of its own
        around a forced `attention` kernel."""
        dw = self.dw
        if attention is not None:
            return make_plan(dw, key, attention)
        plan = dw.plans.get(key)
        if plan is None:
            with dw.lock:  # one thread makes it; the others wait and share it
                plan = dw.plans.get(key)
                if plan is None:
                    if len(dw.plans) >= _PLANS_PER_MODULE:
                        dw.plans.clear()
                    plan = dw.plans[key] = make_plan(dw, key)
        return plan

    def _addresses(self, out) -> dict:
        """The call's device addresses, by the names the launches' slots give them."""
        plan, pair, mask, scratch = self.plan, self.pair, self.mask, self._scratch.ptr
        if self.rows_per_block is None:
            qkvg, bias = scratch, scratch + plan.qkvg_bytes
            vt, extent = bias + plan.bias_bytes, scratch + plan.extent_offset
            row_mask = scratch + plan.row_mask_offset
        else:  # the blocked scratch's regions
            blocked = self.blocked_scratch
            qkvg, bias, vt = (scratch + blocked.qkvg, scratch + blocked.bias,
                              scratch + blocked.vt)
            extent, row_mask = scratch + blocked.extent, scratch + blocked.row_mask
        return {"pair": pair.data.ptr, "mask": 0 if mask is None else mask.data.ptr,
                "qkvg": qkvg, "bias": bias, "vt": vt if plan.vt_bytes else 0,
                "extent": extent if plan.key_extent else 0,
                "row_mask": row_mask if plan.row_mask is not None else 0,
                "out": None if out is None else out.data.ptr}

    # The geometry, as the plan has it
    B = property(lambda self: self.plan.B)
    N = property(lambda self: self.plan.N)
    D = property(lambda self: self.plan.D)
    H = property(lambda self: self.plan.H)
    d = property(lambda self: self.plan.d)
    M = property(lambda self: self.plan.M)
    npk = property(lambda self: self.plan.npk)
    layout = property(lambda self: self.plan.layout)
    route = property(lambda self: self.plan.route)

    def _on_device(self):
        """The weights' device as the current one, for kernels and allocations."""
        return _cupy().cuda.Device(self.dw.device_id) if self._switch else contextlib.nullcontext()

    def _memory(self, nbytes: int):
        """`nbytes` of device memory: from CuPy's pool, or the caller's `allocate` (its
        object kept alive by the MemoryPointer, as long as any array over it lives)."""
        cupy = _cupy()
        if self._allocate is None:
            return cupy.cuda.alloc(nbytes)
        owner = self._allocate(nbytes)
        memory = cupy.cuda.UnownedMemory(int(owner.ptr), nbytes, owner, self.dw.device_id)
        return cupy.cuda.MemoryPointer(memory, 0)

    def _array(self, shape, dtype):
        """A C-contiguous array from `_memory` (the aligned copies, the result)."""
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return _cupy().ndarray(shape, dtype, memptr=self._memory(nbytes))

    def take_out_memory(self):
        if self._out_memory is None:
            self._out_memory = self._memory(self.pair.itemsize * self.pair.size)
            self.pointers["out"] = self._out_memory.ptr

    @property
    def out(self):
        """The result, shaped like pair, of the pair's dtype (the caller's `out`, or the
        array made for it)."""
        if self._out is None:
            with self._on_device():
                self.take_out_memory()
            self._out = _cupy().ndarray(self.pair.shape, self.pair.dtype,
                                        memptr=self._out_memory)
            if self._out_target is not None:  # the caller's unaligned `out`
                target = self._out_target
                target[...] = self._out.view(target.dtype)
                self._out = target
        if self._caller_out is not None:
            self._out = self._caller_out
        elif self._out.dtype != self._result_dtype:  # (bfloat16: its bits, viewed)
            self._out = self._out.view(self._result_dtype)
        return self._out

    @property
    def qkvg(self):
        """The scratch [M, row words] float32 the stages share: q, k, v, gate (o over q) in
        the layout's rows (layouts.Layout.row_words)."""
        return _cupy().ndarray(self.plan.qkvg_shape, np.float32, memptr=self._scratch)

    def attention_output(self):
        """o [M, D] float32 as the attention stage left it in qkvg: fp32 over [0, D), or
        for the layouts with o16 16 bits over each head's first 16 words (bf16; fp16 in v's
        units, undone here). For tests and tools: the out projection
        reads it in place."""
        cupy = _cupy()
        o = self.qkvg[:, :self.D]
        if not self.layout.o16:
            return o.copy()
        # a head's 16 words, dim pair p in word 4 (p % 4) + p // 4 (project_epilogue.cuh load_o4)
        words = o.reshape(self.M, self.H, self.d)[:, :, :self.d // 2].view(cupy.uint32)
        halves = words.reshape(self.M, self.H, 4, 4).transpose(0, 1, 3, 2).copy().view(cupy.uint16)
        if self.layout.o16 == "bf16":
            o = (halves.astype(cupy.uint32) << 16).view(cupy.float32)
        else:
            o = halves.view(cupy.float16).astype(cupy.float32) / np.float32(self.plan.scales[2])
        return o.reshape(self.M, self.D)

    @property
    def bias(self):
        """The pair bias [B, H, N, NPK] (log2 e units, -inf where masked): float32, or
        float16 for the bf16 and the wgmma attentions (f16x3: tiles of fp16 hi and lo)."""
        return _cupy().ndarray(self.plan.bias_shape, self.plan.bias_dtype,
                               memptr=self._scratch + self.plan.qkvg_bytes)

    # -- stages --------------------------------------------------------------------

    # (Each stage on the weights' device: stages() hands them out to be called alone.)
    def project(self):
        with self._on_device():
            self.zero_bias_memory()
            self.plan.project(self.pointers)

    def zero_bias_memory(self):
        if self.plan.zero_bias:
            cupy = _cupy()
            cupy.cuda.runtime.memsetAsync(self.pointers["bias"], 0, self.plan.bias_bytes,
                                          cupy.cuda.get_current_stream().ptr)

    def attention(self, launch: "kernel_configs.AttentionLaunch | None" = None):
        """The attention stage (with the key extent before it, where the plan finds one);
        `launch` replaces the kernel chosen for this forward (tile sweeps time kernels on
        the same scratch): it must read k and v in the form this forward's projection
        stores them."""
        with self._on_device():
            self.pack_row_mask()
            self.find_key_extent()
            if launch is None:
                self.plan.attention(self.pointers)
            else:
                self.plan.attention_launch(launch, self.plan.nan_fully_masked)(self.pointers)

    def out_project(self):
        with self._on_device():
            self.take_out_memory()
            self.plan.out_project(self.pointers)

    def stages(self):
        if self.rows_per_block is not None:
            raise ValueError(f"this forward runs in row blocks of {self.rows_per_block} "
                             f"rows: the stages are the single pass's, whose "
                             f"{self.plan.scratch_bytes} bytes of scratch pass the limit "
                             f"(max_scratch_bytes) or the free device memory")
        return [("layernorm+projections", self.project),
                ("attention", self.attention), ("gate+out_proj", self.out_project)]

    def pack_row_mask(self):
        if self.plan.row_mask is not None:  # the row layout's key bits (row_mask.cu)
            self.plan.row_mask(self.pointers)

    def find_key_extent(self):
        if self.plan.key_extent is not None:
            cupy = _cupy()
            cupy.cuda.runtime.memsetAsync(self.pointers["extent"], 0, 4 * self.B,
                                          cupy.cuda.get_current_stream().ptr)
            self.plan.key_extent(self.pointers)

    def run(self):
        if self.rows_per_block is not None:
            with self._on_device():
                row_blocks.run(self, self.rows_per_block, self.devices)
                out = self.out
            self._scratch = self.pointers = None
            return out
        with self._on_device():
            self.zero_bias_memory()
            self.plan.project(self.pointers)
            self.take_out_memory()
            self.pack_row_mask()
            self.find_key_extent()
            self.plan.attention(self.pointers)
            self.plan.out_project(self.pointers)
            out = self.out
        # Scratch back to the pool now, not at GC (the pool reuses it in stream order).
        self._scratch = self.pointers = None
        return out


def _refuse_unsupported(node: str):
    """An error (UnsupportedOnGpu) for the node the GPU kernels do not compute, ending_af3
    (its pair bias from the untransposed pair), rather than a result computed otherwise."""
    if node == "ending_af3":
        raise checks.UnsupportedOnGpu(
            "node='ending_af3' (the pair bias of the untransposed pair, as AlphaFold3) is "
            "not computed on the GPU, which computes the nodes 'starting' and 'ending'. Use "
            "the NumPy backend (triattn_cupy.reference.triangle_attention, or triattn-infer "
            "--device cpu) for these weights")


def _needs_aligned_copy(pair) -> bool:
    """Whether `pair` is read from a C-contiguous copy: where its rows are not contiguous
    and 16-byte aligned (what the projections' vector loads and row copies need) and a
    copy's rows would be (16-bit rows with D % 8 != 0 never are: read by scalar loads,
    in place)."""
    itemsize, D = pair.itemsize, pair.shape[-1]
    if (D * itemsize) % 16:
        return False
    contiguous_rows = (pair.strides[-1] == itemsize
                       and all(s % 16 == 0 for s in pair.strides[:-1]))
    return not (contiguous_rows and pair.data.ptr % 16 == 0)


_device_total: dict = {}  # device id -> its memory in bytes (asked once)


def _rows_per_block(cupy, dw, plan, pair, allocates_out: bool, row_block, max_scratch_bytes):
    """Rows per block for this call, or None: the single pass (row_blocks.rows_per_block).
    Scratch within SCRATCH_FLOOR_BYTES takes the single pass without asking the device
    (a driver call of host time, which small sizes wait on)."""
    if (row_block is None and max_scratch_bytes is None
            and plan.scratch_bytes <= row_blocks.SCRATCH_FLOOR_BYTES):
        return None
    total = _device_total.get(dw.device_id)
    if total is None:
        total = _device_total[dw.device_id] = cupy.cuda.runtime.memGetInfo()[1]
    free = None
    if row_block is None:  # the free memory bounds the scratch, less the output's
        free = (cupy.cuda.runtime.memGetInfo()[0]
                + cupy.get_default_memory_pool().free_bytes()
                - (pair.nbytes if allocates_out else 0))
    return row_blocks.rows_per_block(row_blocks.scratch_sizes(plan), pair.nbytes,
                                     row_block=row_block,
                                     max_scratch_bytes=max_scratch_bytes,
                                     device_total=total, device_free=max(free, 0)
                                     if free is not None else None)


def emulate_devices(module, pair, mask=None, *, devices: int, row_block: int, **options):
    """The forward of `module` (a TriangleAttention) as `devices` GPUs would compute one
    sample, emulated on its one device: the rows split into `devices` contiguous shares;
    each share's bias pass, then each share's blocks of `row_block` rows. Options as
    TriangleAttention.__call__; bit-identical to module(pair, mask, **options) (tests)."""
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise ValueError(f"devices must be an int of at least 1; got {devices!r}")
    forward = Forward(module._dw, pair, mask, options.pop("fully_masked", "zero"),
                      options.pop("out", None), options.pop("precision", "fp32"),
                      route=options.pop("route", None),
                      conventions=module._conventions(options.pop("mask_layout", None),
                                                      options.pop("node", None)),
                      row_block=row_block)
    if options:
        raise TypeError(f"unknown options {sorted(options)}")
    forward.devices = int(devices)
    return forward.run()
