"""The weights on one device, in the layouts the kernels read (made once, on first use)."""
from __future__ import annotations

import threading

import numpy as np

from ..weights import Weights

from . import checks
from . import layouts
from . import gpus, tiles
from .checks import _cupy
from .scales import f16_biased_scales, f16_projection_scales, f16s_scales, f16x3_scales


class DeviceWeights:
    """The weights on one device, laid out for the kernels (uploaded once)."""

    def __init__(self, weights: Weights, device_id: int):
        cupy = _cupy()
        checks.check_weights(weights)
        p = weights.params
        with cupy.cuda.Device(device_id):
            def up(a):
                return cupy.asarray(np.ascontiguousarray(a, dtype=np.float32))

            # The projection weights as PyTorch stores them, [D_out, D_in]; each kernel's
            # layout is made from them on first use (projection_weight).
            self._plain = {"qkvg": up(np.concatenate([p[f"{n}.weight"]
                                                      for n in ("query", "key", "value", "gate")])),
                           "out": up(p["out_proj.weight"])}
            self._layouts: dict = {}
            self.b_qkvg = up(np.concatenate([p[f"{n}.bias"] for n in ("query", "key", "value", "gate")]))
            self.b_out = up(p["out_proj.bias"])
            self.gamma = up(p["layer_norm.weight"])
            self.beta = up(p["layer_norm.bias"])
            self.w_bias = up(p["bias_proj.weight"])
            # A copy from pageable host memory may return before its DMA lands, and
            # nothing orders a non-blocking stream's kernels after it: every call's
            # stream must find the weights whole.
            cupy.cuda.get_current_stream().synchronize()
        self.f16x3_scales = f16x3_scales(weights)
        # The powers of two (s_q, s_k, s_v, s_b) the projections of each route's scales
        # (routes.Route.scales) multiply q, k, v and the pair bias by (attention_wgmma.cu
        # undoes them): "f16x3" and "f16_biased" for the tiles_f16_hilo and tiles_f16
        # layouts, "f16s" for the f16s attention (None where these weights' scores could
        # pass fp16's range: f16s_scales)
        self.qkv_scales = {"f16x3": (*self.f16x3_scales, 1.0),
                           "f16_biased": f16_biased_scales(weights, self.f16x3_scales),
                           "f16s": f16s_scales(weights, self.f16x3_scales[2])}
        self._weights = weights
        self.device_id = device_id
        self.plans: dict = {}  # input geometry -> Plan (Forward)
        # Held while a Plan or a layout is made: first calls from several threads at once
        # made plans whose launches gave wrong results on every later call (reentrant:
        # a Plan makes the layouts it needs).
        self.lock = threading.RLock()
        device = cupy.cuda.Device(device_id)
        attributes = device.attributes
        self.sm_count = attributes["MultiProcessorCount"]
        self.compute_capability = int(device.compute_capability)  # "90" -> 90
        # Shared memory a block may opt into: 227 KiB on sm_90 (the tables' SMEM_LIMIT),
        # less on other GPUs, where the tables take smaller tiles or a clear error (the
        # GPU table's figure where the device does not say)
        optin = attributes.get("MaxSharedMemoryPerBlockOptin",
                               gpus.gpu(self.compute_capability).smem_optin)
        self.smem_limit = min(tiles.SMEM_LIMIT, optin)
        checks.check_projection_fits(weights.pair_dim, self.smem_limit,
                                       f"GPU {device_id} (compute capability "
                                       f"{self.compute_capability})")
        self.pair_dim, self.num_heads = weights.pair_dim, weights.num_heads
        self.head_dim, self.eps = weights.head_dim, weights.layer_norm_eps

    def projection_weight(self, name: str, layout: str, scales=None):
        """Projection weight `name` ("qkvg": [Wq; Wk; Wv; Wg], or "out") in the layout its
        kernel reads: "tf32 chunks" as PyTorch stores it, [D_out, D_in], rounded to TF32
        once and cut into the chunks project_mma.cu streams (weight_chunks; TF32 products),
        "transposed" [D_in, D_out] (FFMA, project_ffma.cu: a block's weight chunk a row slice).
        "f16 chunks" the chunks with each row's 16 values as fp16 hi, then lo, times the
        weight scale of f16_scales(scales) (project_mma.cu F16_TERMS 3: f16_split_chunks);
        "f16 hi chunks" the same scaled weight as fp16 hi parts alone, 32 per chunk row
        (F16_TERMS 1: f16_hi_chunks).
        `scales`: Wq, Wk, Wv multiplied by its s_q, s_k, s_v (qkv_scales: for the
        projections that write the scaled layouts). Made on first use, on this device (the
        caller holds it current)."""
        if name != "qkvg":  # Wo's layouts do not depend on them: one copy serves every format
            scales = None

        def make():
            plain = self._plain[name]
            if scales:
                plain = plain * _cupy().asarray(_qkv_row_scales(scales, self.pair_dim))[:, None]
            if layout == "tf32 chunks":
                return weight_chunks(round_tf32(plain))
            if layout in ("f16 chunks", "f16 hi chunks"):
                f16 = self.f16_scales(scales)
                scaled = plain * (f16.w if name == "qkvg" else f16.out_w)
                if layout == "f16 hi chunks":
                    return f16_hi_chunks(scaled)
                return f16_split_chunks(weight_chunks(scaled))
            if layout == "transposed":
                return _cupy().ascontiguousarray(plain.T)
            raise ValueError("layout must be 'tf32 chunks', 'f16 chunks', "
                             f"'f16 hi chunks' or 'transposed'; got {layout!r}")
        return self._made((name, layout, scales), make)

    def tile_weight_image(self, name: str, scales=None, split: bool = False):
        """The persistent projections' resident weights, byte for byte as their shared
        memory holds them (sw128_image: fp16 rows in the 128-byte swizzle): "qkvg" [Wq; Wk;
        Wv; Wg] with the q, k, v rows times `scales`' s_q, s_k, s_v, all times the weight
        scale of f16_scales(scales), pass after pass (D rows each); "out" Wo times its own
        scale. A flat uint8 array.
        project_wgmma.cu: the passes in the order it runs them, q, gate, k, v, then the
        pair-bias weights (bias_weight) padded to 8 rows.
        `split` (project_wgmma_split.cu): each pass as its fp16 hi part, then its lo part
        (split16), in the order of its two halves, q, k, then gate, v (it computes the pair
        bias in fp32 from bias_weight)."""
        if name != "qkvg":
            scales = None

        def make():
            cupy = _cupy()
            f16 = self.f16_scales(scales)

            def image(w):  # sw128 images of w's fp16 parts, one after the other
                return [sw128_image(part).ravel() for part in (split16(w) if split
                                                                else (w.astype(cupy.float16),))]
            if name == "out":
                return cupy.concatenate(image(self._plain["out"] * f16.out_w))
            plain = self._plain["qkvg"]
            if scales:
                plain = plain * cupy.asarray(_qkv_row_scales(scales, self.pair_dim))[:, None]
            scaled = plain * f16.w
            D = self.pair_dim
            # the passes in the order the kernel runs them (PASS_*, or the halves)
            order = (0, 1, 3, 2) if split else (0, 3, 1, 2)
            parts = [piece for p in order for piece in image(scaled[p * D:(p + 1) * D])]
            if not split:
                wb = cupy.zeros((8, D), cupy.float16)
                wb[:self.num_heads] = self.bias_weight(True, scales).astype(cupy.float16)
                parts.append(sw128_image(wb).ravel())
            return cupy.concatenate(parts)
        return self._made(("tile image", name, (scales, split)), make)

    def tile_gamma_beta(self, a_scale: float):
        """[gamma; beta] times a_scale (a power of two: exact), for project_wgmma.cu."""
        return self._made(("gamma beta", a_scale, None),
                          lambda: _cupy().concatenate([self.gamma, self.beta]) * a_scale)

    def _made(self, key, make):
        """self._layouts[key], made by make() on first use (on this device), under
        `self.lock`: calls from several threads at once make each layout once.

        make() runs on the calling thread's current stream; that stream is synchronized
        before the array is shared, because another thread's call (on another stream) may
        read it next and nothing orders its kernels after this stream's work."""
        array = self._layouts.get(key)
        if array is None:
            with self.lock:
                array = self._layouts.get(key)
                if array is None:
                    array = make()
                    _cupy().cuda.get_current_stream().synchronize()
                    self._layouts[key] = array
        return array

    def qkvg_bias(self, scales=None):
        """[bq; bk; bv; bg], or (`scales`) with bq, bk, bv multiplied by s_q, s_k, s_v."""
        if not scales:
            return self.b_qkvg
        return self._made(("b_qkvg", "", scales), lambda: self.b_qkvg * _cupy().asarray(
            _qkv_row_scales(scales, self.pair_dim)))

    def f16_scales(self, scales=None) -> "F16Scales":
        """The fp16 projections' scales (F16Scales) for q, k, v and the pair bias scaled
        by `scales` (qkv_scales), or (None) stored unscaled, as rows_fp32 has them: then the
        operand scales alone, which the kernels undo before their epilogues."""
        return self._made(("f16 scales", "", scales), lambda: f16_projection_scales(
            self._weights, scales or (1.0, 1.0, 1.0, 1.0)))

    def bias_weight(self, f16: bool = False, scales=None):
        """The pair-bias weights [h, D]; times the bias scale s_b of `scales`, and (`f16`)
        the weight scale of f16_scales(scales) (the F16_TERMS projections split or round
        them themselves)."""
        if not f16 and not scales:
            return self.w_bias
        factor = (scales[3] if scales else 1.0) * (self.f16_scales(scales).w if f16 else 1.0)
        return self._made(("w_bias", f16, scales), lambda: self.w_bias * factor)

    def layernorm_bias_weight(self, scales=None):
        """(w_ln [h, D], c_ln [h]) float32 for layernorm_bias_ffma.cu: LayerNorm's gamma and
        beta folded into the pair-bias weights (times the bias scale s_b of `scales`),
        w_ln = Wb gamma, c_ln = Wb beta, formed in float64 from the host weights."""
        def make():
            w_ln, c_ln = fold_layer_norm_into_bias(self._weights.params,
                                                   scales[3] if scales else 1.0)
            cupy = _cupy()
            return cupy.asarray(w_ln), cupy.asarray(c_ln)
        return self._made(("layernorm bias", "", scales), make)


def fold_layer_norm_into_bias(params, bias_scale: float = 1.0):
    """(w_ln [h, D], c_ln [h]) float32, formed in float64: LayerNorm's gamma and beta folded
    into the pair-bias weights Wb (times `bias_scale`), so that for a row x with mean m and
    1 / sigma r, LN(x) . Wb[head] = r ((x - m) . w_ln[head]) + c_ln[head]
    (layernorm_bias_ffma.cu): w_ln = Wb gamma, c_ln = Wb beta."""
    wb = np.asarray(params["bias_proj.weight"], np.float64) * bias_scale
    w_ln = wb * np.asarray(params["layer_norm.weight"], np.float64)[None, :]
    c_ln = wb @ np.asarray(params["layer_norm.bias"], np.float64)
    return w_ln.astype(np.float32), c_ln.astype(np.float32)


def _qkv_row_scales(scales, D: int):
    """Per output row of [Wq; Wk; Wv; Wg]: s_q, s_k, s_v of `scales` (1 for the gate)."""
    return np.repeat(np.array([*scales[:3], 1.0], np.float32), D)


def sw128_image(a):
    """A [R, K] 16-bit matrix (R % 8 == 0, K % 64 == 0) as K-major wgmma operand tiles in the
    128-byte swizzle (kernels/wgmma.cuh sw128): [K / 64][R][64], each row's 16-byte chunk c
    at chunk c ^ (row % 8), returned as uint8 [K / 64, R, 128]."""
    xp = _cupy().get_array_module(a)
    R, K = a.shape
    if R % 8 or K % 64:
        raise ValueError(f"sw128_image needs rows a multiple of 8 and columns of 64; got {a.shape}")
    chunks = xp.ascontiguousarray(a).view(xp.uint8).reshape(R, K // 64, 8, 16).transpose(1, 0, 2, 3)
    rows = xp.arange(R)[:, None]
    image = xp.empty_like(chunks)
    image[:, rows, xp.arange(8)[None, :] ^ (rows % 8)] = chunks
    return xp.ascontiguousarray(image).reshape(K // 64, R, 128)


def split16(w):
    """float32 w as its fp16 hi part (rounded to nearest) and lo part (the rest, rounded
    again): hi + lo holds ~22 significant bits of w (within fp16's range)."""
    xp = _cupy().get_array_module(w)
    hi = w.astype(xp.float16)
    return hi, (w - hi.astype(xp.float32)).astype(xp.float16)


def f16_split_chunks(chunks):
    """Weight chunks [..., BN, BK] float32 as project_mma.cu's F16_TERMS ring reads them:
    each row's BK values as fp16 hi (rounded to nearest), then BK fp16 lo (the rest,
    rounded again): the same bytes, returned as a float32 array of the input's shape."""
    xp = _cupy().get_array_module(chunks)
    both = xp.concatenate(split16(chunks), axis=-1)  # [..., BN, 2 BK] fp16
    return xp.ascontiguousarray(both).view(xp.float32).reshape(chunks.shape)


def f16_hi_chunks(w):
    """W [NO, D] (scaled) as project_mma.cu's F16_TERMS 1 ring reads it: [NO / BN][D / 32]
    [BN][32] fp16 (PROJECT_MMA_HI_CHUNK; NO rounded up, zero-padded), chunk (pass p,
    k-chunk c) row n = fp16(W[p BN + n, 32 c : 32 c + 32]) rounded to nearest: k 0-15 in
    the row's first 32 bytes, 16-31 in the next, the kernel's two k-steps. The products
    read no lo parts, so the 8 KiB chunk carries twice the inputs of f16_split_chunks'.
    Returned as float32 [NO / BN][D / 32][BN][16] (the same bytes). D must be a multiple
    of 32 (head dim 32, the only one on these paths): the kernel's chunks would not line up
    with the row tile's 16-column ones otherwise."""
    xp = _cupy().get_array_module(w)
    bn, bk = tiles.PROJECT_MMA_HI_CHUNK
    if w.shape[1] % bk:
        raise ValueError(f"the fp16 hi-part projection weights (F16_TERMS 1) need D a multiple "
                         f"of {bk}; got D = {w.shape[1]}")
    hi = weight_chunks(w, tiles.PROJECT_MMA_HI_CHUNK).astype(xp.float16)
    return xp.ascontiguousarray(hi).view(xp.float32)


def weight_chunks(w, chunk=tiles.PROJECT_MMA_CHUNK):
    """W [NO, D] as project_mma.cu's ring reads it: [NO / BN][D / BK][BN][BK]
    ((BN, BK) = chunk, PROJECT_MMA_CHUNK; both rounded up, zero-padded), chunk (pass p,
    k-chunk c) = W[p BN : (p + 1) BN, c BK : (c + 1) BK], one contiguous 8 KiB: a block
    copies each chunk whole instead of 64 bytes from each of 128 rows."""
    xp = _cupy().get_array_module(w)  # CuPy, or NumPy (the offline test of the layout)
    bn, bk = chunk
    no, d = w.shape
    passes, chunks = -(-no // bn), -(-d // bk)
    padded = xp.zeros((passes * bn, chunks * bk), xp.float32)
    padded[:no, :d] = w
    return xp.ascontiguousarray(padded.reshape(passes, bn, chunks, bk).transpose(0, 2, 1, 3))


def round_tf32(a):
    """float32 -> the nearest TF32 value (ties away from zero, as cvt.rna.tf32.f32), still
    float32: the low 13 mantissa bits cleared. For finite values."""
    cupy = _cupy()
    bits = a.view(cupy.uint32)
    return ((bits + cupy.uint32(0x1000)) & cupy.uint32(0xFFFFE000)).view(cupy.float32)
