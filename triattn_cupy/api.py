"""The public GPU API: `triangle_attention` and `TriangleAttention`."""
from __future__ import annotations

import weakref

from .conventions import Conventions
from .cuda_setup import require_cuda
from .gpu.checks import gpu_available
from .gpu.device_weights import DeviceWeights
from .gpu.forward import Forward
from .weights import Weights

__all__ = ["triangle_attention", "TriangleAttention", "gpu_available"]


class TriangleAttention:
    """Triangle self-attention with its weights resident on one GPU.

    ``TriangleAttention(weights)`` uploads `weights` (a `Weights`) to `device` (default: the
    current CuPy device) once; ``module(pair, mask)`` then runs the forward pass:

    pair:  (B, N, N, D) or (N, N, D) of float32, float16 or bfloat16: a CuPy array (of
           ml_dtypes.bfloat16 for bfloat16), or any GPU array exposing
           ``__cuda_array_interface__`` or DLPack (a torch CUDA tensor, bfloat16 too),
           taken without a copy; any strides. The kernels read it, and write the result,
           in its own type; the arithmetic between is the one `precision` names.
    mask:  (B, N, N) or (N, N) of bool, int or float on the same GPU (0 = masked), or None;
           with mask_layout "row" also (B, N, 1, 1, N) / (N, 1, 1, N), the models' shape.
    mask_layout, node: the conventions (triattn_cupy.conventions): mask_layout "pair"
           (mask[b, j, k], the spec's) or "row" (mask[b, i, k], OpenFold's, Boltz's);
           node "starting", "ending" (the transposed pair and mask read in place, the
           output written in the caller's layout) or "ending_af3". None (default): the
           weights' own (Weights.mask_layout, Weights.node), as the NumPy backend does.
    fully_masked: "zero" (default): a query whose keys are all masked gets a zero attention
           output, so ``out = out_proj.bias`` there; "nan": NaN there, as the reference.
    out:   optional C-contiguous array shaped like pair, of the pair's dtype, to write
           into (a CuPy array, or a GPU array as pair).
    row_block, max_scratch_bytes: the scratch (q, k, v, gate, the bias; ~4x the pair's
           fp32 bytes in one pass). None (default): one pass where that fits the limit
           (docs/design.md "Row blocks") and the free memory, else blocks of pair rows
           (b, i) as large as fit; max_scratch_bytes sets the limit; row_block forces
           blocks of that many rows. The result is the same bits for any block size of
           whole out-projection tiles (row_blocks.row_unit; the chosen sizes are), else
           the same but for a rare output's last bit; `out=pair` works at every size.
    route: None (default): the fastest route of kernels this GPU and problem take; or a
           route name of ``triattn_cupy.gpu.routes.ROUTES`` (optionally with "@sm_80" for
           the sm_80 tile tables) or a ``Route`` to force one (tests and tools: every route
           some GPU takes runs on an H200). A route the problem cannot take is a ValueError.
    Returns a CuPy array shaped like `pair`, of its dtype (`out` where given; for a torch
    bfloat16 pair ml_dtypes.bfloat16, or its int16 bits where ml_dtypes is not installed).
    ``module.capture(pair, mask, ...)`` captures the same forward as a CUDA graph, replayed
    for a repeated shape without the call's host work.
    """

    def __init__(self, weights: Weights, *, device=None):
        if not isinstance(weights, Weights):  # (before the GPU: the same error without one)
            raise TypeError(f"weights must be a triattn_cupy.Weights (see load_weights); got "
                            f"{type(weights).__name__}")
        cupy = require_cuda()  # a clear error without a GPU or NVRTC
        device_id = cupy.cuda.Device(device).id if device is not None else cupy.cuda.Device().id
        self.weights = weights
        self.device = device_id
        self._dw = DeviceWeights(weights, device_id)

    @classmethod
    def from_hdf5(cls, path, *, device=None) -> "TriangleAttention":
        from .hdf5 import load_weights

        return cls(load_weights(path), device=device)

    def __call__(self, pair, mask=None, *, fully_masked: str = "zero", out=None,
                 precision: str = "fp32", route=None, mask_layout=None, node=None,
                 row_block=None, max_scratch_bytes=None):
        return Forward(self._dw, pair, mask, fully_masked, out, precision, route=route,
                       conventions=self._conventions(mask_layout, node),
                       row_block=row_block, max_scratch_bytes=max_scratch_bytes).run()

    def capture(self, pair, mask=None, *, out=None, fully_masked: str = "zero",
                precision: str = "fp32", route=None, mask_layout=None, node=None,
                row_block=None, max_scratch_bytes=None):
        """The forward ``module(pair, mask, out=out, ...)`` captured as a CUDA graph, for a
        shape called again and again: a `CapturedForward` (triattn_cupy.gpu.captured).

        Runs one forward (its result in `out`), then captures one. ``graph.pair``,
        ``graph.mask`` are the given arrays themselves, read in place by every replay;
        ``graph.out`` is `out`, or an array made for it. ``graph()`` replays on CuPy's
        current stream and returns graph.out; ``graph(pair2, mask2)`` first copies them
        into graph.pair and graph.mask (same shapes and dtypes). A replay skips the host
        work of a call (checks, plan look-up, allocation, one driver call per launch)
        and gives the same bits as the call. Arguments as `__call__` (every route and
        option captures; what the call refuses, capture refuses, before capturing); the
        forward's memory is held for the graph's lifetime. Needs CuPy's stream capture
        (CuPy 11 or newer: a RuntimeError says so otherwise)."""
        require_cuda()
        from .gpu.captured import CapturedForward

        return CapturedForward(self, pair, mask, out, dict(
            fully_masked=fully_masked, precision=precision, route=route,
            mask_layout=mask_layout, node=node, row_block=row_block,
            max_scratch_bytes=max_scratch_bytes))

    def stage_launchers(self, pair, mask=None, *, fully_masked: str = "zero", out=None,
                        precision: str = "fp32", route=None, mask_layout=None, node=None):
        """[(stage name, callable)]: calling them in order performs one forward pass, for
        timing each stage. The result lands in `out` (allocated if None). The stages are
        the single pass's wherever its scratch fits the free memory (no row blocks)."""
        return Forward(self._dw, pair, mask, fully_masked, out, precision, route=route,
                       conventions=self._conventions(mask_layout, node),
                       max_scratch_bytes=_NO_SCRATCH_LIMIT).stages()

    def _conventions(self, mask_layout, node) -> Conventions:
        """The call's conventions, else the weights' own."""
        w = self.weights
        return Conventions.checked(w.mask_layout if mask_layout is None else mask_layout,
                                   w.node if node is None else node)

    def __repr__(self):
        w = self.weights
        return (f"TriangleAttention(pair_dim={w.pair_dim}, num_heads={w.num_heads}, "
                f"device={self.device})")


# stage_launchers' scratch limit: only the free memory bounds the single pass
_NO_SCRATCH_LIMIT = 1 << 62

# One module per (weights object, device), so the function form uploads weights once.
_modules: "weakref.WeakKeyDictionary[Weights, dict]" = weakref.WeakKeyDictionary()


def triangle_attention(pair, mask, weights, *, fully_masked: str = "zero", out=None,
                       precision: str = "fp32", route=None, mask_layout=None, node=None,
                       row_block=None, max_scratch_bytes=None):
    """Functional form: ``triangle_attention(pair, mask, weights)``.

    `weights` is a `Weights` (uploaded to the pair's GPU once per object and cached) or a
    `TriangleAttention`. Arguments and result as `TriangleAttention.__call__`.
    """
    if isinstance(weights, TriangleAttention):
        return weights(pair, mask, fully_masked=fully_masked, out=out, precision=precision,
                       route=route, mask_layout=mask_layout, node=node, row_block=row_block,
                       max_scratch_bytes=max_scratch_bytes)
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be a triattn_cupy.Weights or TriangleAttention; got "
                        f"{type(weights).__name__}")
    cupy = require_cuda()
    device_id = pair.device.id if isinstance(pair, cupy.ndarray) else cupy.cuda.Device().id
    per_device = _modules.setdefault(weights, {})
    if device_id not in per_device:
        per_device[device_id] = TriangleAttention(weights, device=device_id)
    return per_device[device_id](pair, mask, fully_masked=fully_masked, out=out,
                                 precision=precision, route=route, mask_layout=mask_layout,
                                 node=node, row_block=row_block,
                                 max_scratch_bytes=max_scratch_bytes)
