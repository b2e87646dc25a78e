"""The GPU forward pass: device weights, argument conversion and the kernel launches.

Stages (one launch each):
  project    LayerNorm + q/k/v/gate + pair bias with the mask folded in; the mask is
             read in place, in its own dtype and strides; tensor cores on sm_80+
             (project_mma.cu: fp16 hi + lo split products of scaled operands for "fp32",
             F16_TERMS 3; TF32 for "tf32" and "bf16", with the wgmma attention one fp16
             product of scaled operands instead, F16_TERMS 1), else FFMA (project.cu)
  attention  flash-style softmax attention, o written over q: tensor cores for head dims
             that are multiples of 8 on sm_80+ (attention_mma.cu: fp16 split products,
             f16x3, for "fp32" (3xTF32 kept for tests), TF32, bf16; at head dim 32 on
             compute capability 9.0 from N = 129:
             attention_wgmma.cu, "fp32" as fp16 split products there, "tf32" as one
             fp16 product of scaled operands), else FFMA fp32
             (attention.cu)
  out        (g * o) Wo^T + bo, products as in project  (project.cu / project_mma.cu)
Scratch: qkvg [M, 4D] ([M, 2D] for the fp32 and tf32 wgmma attentions, f16x3 and f16,
whose k and v live in tiles only) and bias [B, h, N, NPK] float32 (float16 for the bf16 and the TF32
attention; the wgmma kernels have it in tiles and K and V^T tiles after it), one
allocation from CuPy's memory pool per call.
Everything a call launches besides its pointers is worked out once per module and input
geometry (Plan): at small sizes the caller waits on host time. The tf32 and bf16
attention kernels read k and v in their tensor-core form, which the projection writes for
them (rounded to TF32, or packed bf16 in the k columns: half the bytes; in bf16 mode q
and the gate are packed bf16 too; K, V^T and the bias in tiles for the wgmma kernels); see
_configs.KV_* and kernels/project_epilogue.cuh.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from . import _configs
from ._launch import F32, I32, I64, Launch, Ptr
from ._checks import check_fully_masked, check_mask_dtype, check_mask_shape, pair_geometry
from .weights import Weights

LOG2E = math.log2(math.e)


def _cupy():
    try:
        import cupy
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise ImportError(
            "triattn_cupy's GPU functions need CuPy: pip install 'triattn-cupy[cuda13]' "
            "(or [cuda12], matching your CUDA driver)") from error
    return cupy


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device. Never raises."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


class DeviceWeights:
    """The weights on one device, laid out for the kernels (uploaded once)."""

    def __init__(self, weights: Weights, device_id: int):
        cupy = _cupy()
        _configs.check_dims(weights.pair_dim, weights.num_heads)
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
        self.f16x3_scales = f16x3_scales(weights)
        # The powers of two (s_q, s_k, s_v, s_b) the projection writing each fp16 format
        # multiplies q, k, v and the pair bias by (attention_wgmma.cu undoes them); None:
        # unscaled (every other format).
        # (_configs.scales_key: "f16s" for the f16s variant, which reads format 8 with S in
        # fp16; None where these weights' scores could pass fp16's range: f16s_scales)
        self.qkv_scales = {_configs.KV_F16X3_TILES: (*self.f16x3_scales, 1.0),
                           _configs.KV_F16_TILES: f16_biased_scales(weights, self.f16x3_scales),
                           "f16s": f16s_scales(weights, self.f16x3_scales[2])}
        self._weights = weights
        self.device_id = device_id
        self.plans: dict = {}  # input geometry -> Plan (Forward)
        device = cupy.cuda.Device(device_id)
        attributes = device.attributes
        self.sm_count = attributes["MultiProcessorCount"]
        self.compute_capability = int(device.compute_capability)  # "90" -> 90
        # Shared memory a block may opt into: 227 KiB on sm_90 (the tables' SMEM_LIMIT),
        # less on other GPUs, where the tables take smaller tiles or a clear error.
        self.smem_limit = min(_configs.SMEM_LIMIT,
                              attributes.get("MaxSharedMemoryPerBlockOptin", _configs.SMEM_LIMIT))
        _configs.check_projection_fits(weights.pair_dim, self.smem_limit,
                                       f"GPU {device_id} (compute capability "
                                       f"{self.compute_capability})")
        self.pair_dim, self.num_heads = weights.pair_dim, weights.num_heads
        self.head_dim, self.eps = weights.head_dim, weights.layer_norm_eps

    def projection_weight(self, name: str, layout: str, scales=None):
        """Projection weight `name` ("qkvg": [Wq; Wk; Wv; Wg], or "out") in the layout its
        kernel reads: "chunks" as PyTorch stores it, [D_out, D_in], cut into the chunks
        project_mma.cu streams (weight_chunks; 3xTF32, which splits it where its fragments
        are loaded), "tf32 chunks" the same rounded to TF32 once (TF32 products),
        "transposed" [D_in, D_out] (FFMA, project.cu: a block's weight chunk a row slice).
        "f16 chunks" the chunks with each row's 16 values as fp16 hi, then lo, times the
        weight scale of f16_scales(scales) (project_mma.cu F16_TERMS 3: f16_split_chunks);
        "f16 hi chunks" the same scaled weight as fp16 hi parts alone, 32 per chunk row
        (F16_TERMS 1: f16_hi_chunks).
        `scales`: Wq, Wk, Wv multiplied by its s_q, s_k, s_v (qkv_scales: for the
        projections that write KV_F16_FORMATS). Made on first use, on this device (the
        caller holds it current)."""
        if name != "qkvg":  # Wo's layouts do not depend on them: one copy serves every format
            scales = None

        def make():
            plain = self._plain[name]
            if scales:
                plain = plain * _cupy().asarray(_qkv_row_scales(scales, self.pair_dim))[:, None]
            if layout == "chunks":
                return weight_chunks(plain)
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
            raise ValueError("layout must be 'chunks', 'tf32 chunks', 'f16 chunks', "
                             f"'f16 hi chunks' or 'transposed'; got {layout!r}")
        return self._made((name, layout, scales), make)

    def tile_weight_image(self, name: str, scales=None, split: bool = False):
        """The persistent projections' resident weights, byte for byte as their shared
        memory holds them (sw128_image: fp16 rows in the 128-byte swizzle): "qkvg" [Wq; Wk;
        Wv; Wg] with the q, k, v rows times `scales`' s_q, s_k, s_v, all times the weight
        scale of f16_scales(scales), pass after pass (D rows each); "out" Wo times its own
        scale. A flat uint8 array.
        project_tiles.cu: the passes in the order it runs them, q, gate, k, v, then the
        pair-bias weights (bias_weight) padded to 8 rows.
        `split` (project_tiles_split.cu): each pass as its fp16 hi part, then its lo part
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
        """[gamma; beta] times a_scale (a power of two: exact), for project_tiles.cu."""
        return self._made(("gamma beta", a_scale, None),
                          lambda: _cupy().concatenate([self.gamma, self.beta]) * a_scale)

    def _made(self, key, make):
        """self._layouts[key], made by make() on first use (on this device)."""
        array = self._layouts.get(key)
        if array is None:
            array = self._layouts[key] = make()
        return array

    def qkvg_bias(self, scales=None):
        """[bq; bk; bv; bg], or (`scales`) with bq, bk, bv multiplied by s_q, s_k, s_v."""
        if not scales:
            return self.b_qkvg
        return self._made(("b_qkvg", "", scales), lambda: self.b_qkvg * _cupy().asarray(
            _qkv_row_scales(scales, self.pair_dim)))

    def f16_scales(self, scales=None) -> "F16Scales":
        """The fp16 projections' scales (F16Scales) for q, k, v and the pair bias scaled
        by `scales` (qkv_scales), or (None) stored unscaled, as KV_FP32 has them: then the
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


def _qkv_row_scales(scales, D: int):
    """Per output row of [Wq; Wk; Wv; Wg]: s_q, s_k, s_v of `scales` (1 for the gate)."""
    return np.repeat(np.array([*scales[:3], 1.0], np.float32), D)


# The largest |q|, |k| or |v| the f16x3 split may meet, scaled (2^14: 4x inside fp16's
# 65504, and every value from 2^-3 up keeps a normal fp16 lo part).
F16X3_TOP = 2.0 ** 14


def f16x3_scales(weights: Weights) -> tuple[float, float, float]:
    """Powers of two (s_q, s_k, s_v) for the fp32 mode's fp16 hi + lo products and the tf32
    mode's one fp16 product (kernels/attention_wgmma.cu F16X3; F16X1 from them,
    f16_biased_scales): s_t times any value of q (with its log2(e)/sqrt(d)), k or v stays
    below F16X3_TOP, by a bound from the weights alone. LayerNorm's output n
    (before gamma, beta) has |n|_2 <= sqrt(D) in every row, so column c of x W^T + b is
    at most sqrt(D) |gamma * W[c]|_2 + |W[c] . beta + b[c]| in magnitude (Cauchy-Schwarz);
    the scale puts the largest column bound at or below F16X3_TOP. The bound is ~sqrt(D)
    times a typical value, so values sit well above fp16's subnormals. Powers of two: the
    scaled weights are exact, and the kernel undoes them exactly."""
    p = _float64_params(weights)
    D = weights.pair_dim
    return tuple(_power_of_two_below(_projection_bound(p, D, name) * factor)
                 for name, factor in (("query", LOG2E / math.sqrt(weights.head_dim)),
                                      ("key", 1.0), ("value", 1.0)))


def f16_biased_scales(weights: Weights, qkv: tuple[float, float, float]):
    """(s_q, s_k, s_v, s_b) for the tf32 mode's one fp16 product (attention_wgmma.cu
    F16X1): it accumulates S = Q K^T in units of c = s_q s_k onto the pair bias, which the
    projection stores times s_b = c (one fewer instruction per score than undoing the
    scales after the product). So c times the bias's bound (as f16x3_scales bounds q, from
    the pair-bias weights, in log2(e) units) must stay at or below F16X3_TOP as well:
    where f16x3_scales' c would pass it, s_q and s_k come down by the missing factor
    (half each, powers of two). q's and k's scaled bounds become 2^7 sqrt(B_q B_k / B_b)
    (B: the bounds), so they stay far inside fp16's normal range (the 11 bits of a TF32
    product) unless the bias's bound is some 2^20 times |q| |k|'s, where q k is below the
    bias's own fp16 rounding in S anyway (random weights: s_q, s_k 2^13, 2^11 -> 2^6, 2^4).
    """
    s_q, s_k, s_v = qkv
    bias_top = LOG2E * _projection_bound(_float64_params(weights), weights.pair_dim, "bias_proj")
    if bias_top > 0:
        over = s_q * s_k / _power_of_two_below(bias_top)  # a power of two
        if over > 1:
            e = round(math.log2(over))
            s_q, s_k = s_q / 2.0 ** (e // 2), s_k / 2.0 ** (e - e // 2)
    return s_q, s_k, s_v, s_q * s_k


# f16s (attention_wgmma.cu S16): the bound on |S| = |bias + q . k| in S's units, s_q s_k = c
# (2^15: half of fp16's largest, room for the roundings of q, k and the partial sums), and
# the largest c taken (1 / c stays a normal fp16 number, the exponent's fma operand).
S16_TOP = 2.0 ** 15
S16_MAX_C = 2.0 ** 14


def f16s_scales(weights: Weights, s_v: float):
    """(s_q, s_k, s_v, s_b = s_q s_k) for the f16s attention (attention_wgmma.cu S16, the bf16
    mode's option), or None where no such scales exist for these weights.

    The f16s kernel accumulates S = bias c + q_s . k_s (c = s_q s_k) in fp16, so every
    partial sum must stay inside fp16's range, for any input: the bounds are
    Cauchy-Schwarz's per head. q_h = W_h (gamma n) + W_h beta + b_h with |n|_2 <= sqrt(D)
    (LayerNorm), so |q_h|_2 <= sqrt(D) ||W_h diag(gamma)||_2 + |W_h beta + b_h|_2 (the
    spectral norm; q with its log2(e)/sqrt(d)), B_q the largest over heads, B_k alike, and
    |q_h . k_h| <= B_q B_k for every head and any partial sum of the dot product; the bias
    (in log2(e) units) is at most B_b (_projection_bound). c is the largest power of two with
    c (B_q B_k + B_b) <= S16_TOP, at most S16_MAX_C; s_q and s_k split it so that q's and k's
    scaled bounds are about equal (~sqrt(c B_q B_k) <= 2^8, far inside fp16 and its normal
    range). fp16's relative precision makes S's rounding independent of c; the range is
    all the scale decides.

    c below 1 (scores that could reach 2^15 in log2 units: B_q B_k + B_b > 2^15) is refused
    (None): the kernel forms the exponent as S / c + ms with ms = P16_SHIFT - m / c in fp16,
    which c >= 1 keeps finite (|m / c| <= 2^15). Forwards of such weights take the "bf16"
    variant instead (Plan), or fail clearly where the f16s launch is forced."""
    p = _float64_params(weights)
    D, H, d = weights.pair_dim, weights.num_heads, weights.head_dim
    b_q = _head_bound(p, D, H, "query") * LOG2E / math.sqrt(d)
    b_k = _head_bound(p, D, H, "key")
    b_b = LOG2E * _projection_bound(p, D, "bias_proj")
    total = b_q * b_k + b_b
    if not math.isfinite(total):
        return None
    c = S16_MAX_C if total == 0 else min(S16_MAX_C, 2.0 ** math.floor(math.log2(S16_TOP / total)))
    if c < 1:
        return None
    # s_q = 2^e ~ sqrt(c b_k / b_q): q's and k's scaled bounds equal (either may be 0: q or
    # k all zero, any split serves)
    e = (math.floor(math.log2(c * b_k / b_q) / 2) if b_q > 0 and b_k > 0 else 0)
    e = max(-40, min(40, e))
    return 2.0 ** e, c / 2.0 ** e, s_v, c


def _head_bound(p: dict, D: int, H: int, name: str) -> float:
    """The largest |LayerNorm(x) W_h^T + b_h|_2 over heads h (the head's d columns) any input
    can give for projection `name`: sqrt(D) ||W_h diag(gamma)||_2 + |W_h beta + b_h|_2."""
    w, b = p[f"{name}.weight"], p[f"{name}.bias"]
    gamma, beta = p["layer_norm.weight"], p["layer_norm.bias"]
    d = w.shape[0] // H
    bound = 0.0
    for h in range(H):
        wh = w[h * d:(h + 1) * d]
        bound = max(bound, math.sqrt(D) * float(np.linalg.norm(wh * gamma, 2))
                    + float(np.linalg.norm(wh @ beta + b[h * d:(h + 1) * d])))
    return bound


def _float64_params(weights: Weights) -> dict:
    return {k: np.asarray(v, np.float64) for k, v in weights.params.items()}


def _projection_bound(p: dict, D: int, name: str) -> float:
    """The largest |LayerNorm(x) W^T + b| any input can give for projection `name` (float64
    parameters p): sqrt(D) |gamma * W[c]|_2 + |W[c] . beta + b[c]| over the columns c (b = 0
    for the pair-bias projection, which has none)."""
    w, b = p[f"{name}.weight"], p.get(f"{name}.bias", 0.0)
    gamma, beta = p["layer_norm.weight"], p["layer_norm.bias"]
    bound = math.sqrt(D) * np.linalg.norm(w * gamma, axis=1) + np.abs(w @ beta + b)
    return float(bound.max()) if bound.size else 0.0


def _power_of_two_below(top: float, limit: float = F16X3_TOP) -> float:
    """The largest power of two s (2^-40 .. 2^40) with s * top <= limit; 1 where top is 0
    or not finite."""
    if not top > 0 or not math.isfinite(top):
        return 1.0
    # +-40: products and quotients of two scales (the kernels take 1 / (s_q s_k) and
    # 1 / (a w) in fp32) stay normal fp32 numbers
    return 2.0 ** max(-40, min(40, math.floor(math.log2(limit / top))))


@dataclasses.dataclass(frozen=True)
class F16Scales:
    """Powers of two for the projections on fp16 products (project_mma.cu F16_TERMS), each
    putting its operand's largest possible value at or below F16X3_TOP: a, w:
    ln_qkvg_project's LayerNorm output and weights (the pair-bias weights included);
    out_w: gated_out_project's Wo (its g * o each block scales by its own largest value:
    load_gated_tile_f16)."""
    a: float
    w: float
    out_w: float


def f16_projection_scales(weights: Weights, qkv_scales) -> F16Scales:
    """LayerNorm's output xn_d = n_d gamma_d + beta_d with |n|_2 <= sqrt(D) is at most
    sqrt(D) |gamma_d| + |beta_d|; the weights are [Wq; Wk; Wv; Wg] with the q, k, v rows
    times qkv_scales (s_q, s_k, s_v, s_b: as DeviceWeights lays them out; all 1 for the
    formats that store q, k, v and the bias unscaled) and the pair-bias weights (times
    s_b), under one scale (the kernel unscales every product by one factor); and Wo.
    Each product of two scaled operands is at most F16X3_TOP^2 = 2^28 and exact in the
    tensor cores' fp32 accumulation, and a sum of D <= 768 of them stays far inside fp32's
    range: no fp16 value is formed from a product, only from the operands."""
    p = _float64_params(weights)
    D = weights.pair_dim
    xn_top = float(np.max(math.sqrt(D) * np.abs(p["layer_norm.weight"])
                          + np.abs(p["layer_norm.bias"])))
    w_top = max([float(np.abs(p[f"{n}.weight"]).max()) * s for n, s in
                 zip(("query", "key", "value", "gate"), (*qkv_scales[:3], 1.0))]
                + [float(np.abs(p["bias_proj.weight"]).max()) * qkv_scales[3]])
    return F16Scales(_power_of_two_below(xn_top), _power_of_two_below(w_top),
                     _power_of_two_below(float(np.abs(p["out_proj.weight"]).max())))


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
    bn, bk = _configs.PROJECT_MMA_HI_CHUNK
    if w.shape[1] % bk:
        raise ValueError(f"the fp16 hi-part projection weights (F16_TERMS 1) need D a multiple "
                         f"of {bk}; got D = {w.shape[1]}")
    hi = weight_chunks(w, _configs.PROJECT_MMA_HI_CHUNK).astype(xp.float16)
    return xp.ascontiguousarray(hi).view(xp.float32)


def weight_chunks(w, chunk=_configs.PROJECT_MMA_CHUNK):
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


def _describe(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def as_device_array(obj, arg: str, device_id: int):
    """A CuPy view of `obj` (CuPy array, __cuda_array_interface__ or DLPack), no copy."""
    cupy = _cupy()
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{arg} is a NumPy (host) array; the GPU backend needs it on the "
                        f"device: pass cupy.asarray({arg}) (or use triattn_cupy.reference "
                        f"for the CPU)")
    if isinstance(obj, cupy.ndarray):
        array = obj
    elif hasattr(obj, "__cuda_array_interface__"):
        array = cupy.asarray(obj)
    elif hasattr(obj, "__dlpack__"):
        try:
            array = cupy.from_dlpack(obj)
        except Exception as error:
            raise TypeError(f"{arg} ({_describe(obj)}) could not be taken as a GPU array "
                            f"through DLPack: {error}") from error
    else:
        raise TypeError(f"{arg} must be a CuPy array or a GPU array exposing "
                        f"__cuda_array_interface__ or DLPack; got {_describe(obj)}")
    if array.data.device_id != device_id:  # (cheaper than array.device, a new Device)
        raise ValueError(f"{arg} is on GPU {array.device.id} but the weights are on GPU "
                         f"{device_id}; move it with cupy.asarray under "
                         f"cupy.cuda.Device({device_id}), or build the module there")
    return array


class Plan:
    """The launches of a forward pass over one input geometry: pair shape and strides,
    alignment, mask dtype and strides, precision and fully-masked policy. Everything but
    the pointers of a call is decided here, once per module and geometry (Forward keeps
    them in DeviceWeights.plans): at small sizes the host time before the first kernel starts is what the
    caller waits for (benchmarks/NOTES.md). Stages, in order: `project`, `attention`,
    `out_project`, each a Launch taking the pointers pair, mask, qkvg, bias and out."""

    def __init__(self, dw: DeviceWeights, shape, strides, aligned: bool, mask_meta,
                 precision: str, nan_fully_masked: bool,
                 attention: "_configs.AttentionLaunch | None" = None):
        B, N, _ = pair_geometry(shape, dw.pair_dim)
        D, H, d = dw.pair_dim, dw.num_heads, dw.head_dim
        self._qkv_scales = dw.qkv_scales
        self._f16x3_scales = dw.f16x3_scales  # what attention_f16x3 scales q, k, v by itself
        self.B, self.N, self.D, self.H, self.d = B, N, D, H, d
        self.M = M = B * N * N
        self.project_mma = _configs.project_uses_tensor_cores(precision, dw.compute_capability)
        # The attention and the out projection launched as programmatic dependents of the
        # kernel before them (_launch.Launch overlap; sm_90 and newer, OVERLAP_LAUNCHES)
        self.overlap = _configs.OVERLAP_LAUNCHES and dw.compute_capability >= 90
        self.project_split = self.project_mma and _configs.project_splits(precision)
        # `attention` replaces the kernel chosen for this precision (tests and tile sweeps);
        # the projection stores k and v in the form that kernel reads.
        self.attention_kernel = attention or _configs.attention_kernel(
            d, precision, dw.compute_capability, N, dw.smem_limit)
        if (_configs.scales_key(self.attention_kernel) == "f16s"
                and dw.qkv_scales["f16s"] is None):
            if attention is not None:
                raise ValueError(f"{attention.name} needs these weights' scores inside fp16's "
                                 f"range (_gpu.f16s_scales: their bound passes 2^15 in log2 "
                                 f"units); use another attention launch")
            # the bf16 mode's f16s option (_configs.set_bf16_variant) for weights it cannot
            # take: the bf16 variant, which holds S in fp32
            self.attention_kernel = _configs.attention_wgmma_launch(d, variant="bf16")
        sb, si, sj, sc = strides if len(strides) == 4 else (0, *strides)
        x_vec = int(sc == 1 and all(s % 4 == 0 for s in (sb, si, sj)) and aligned)
        if (attention is None and self.attention_kernel.name == "attention_f16s_wgmma"
                and self.project_mma and _configs.BF16_SLOT_ROWS):
            # The bf16 mode's f16s attention reads format 9 (the gate in bf16: half format 8's
            # bytes) where project_tiles.cu writes both projections (project_mma.cu does not
            # write format 9). Elsewhere it reads format 8, where "auto" takes the bf16
            # variant (format 6) below format 8's crossover, BF16_F16S_FROM_N.
            slots = _configs.attention_wgmma_launch(d, variant="f16s", slot_rows=True)
            if x_vec and _configs.uses_project_tiles(slots.kv_format, D, dw.compute_capability,
                                                     dw.smem_limit):
                self.attention_kernel = slots
            elif _configs.bf16_variant() == "auto" and N < _configs.BF16_F16S_FROM_N:
                self.attention_kernel = _configs.attention_wgmma_launch(d, variant="bf16")
        self.kv_format = self.attention_kernel.kv_format
        self.project_f16 = self.project_mma and bool(_configs.project_f16_terms(
            self.kv_format, self.project_split))  # fp16 products (F16_TERMS)
        # The key axis of the bias is padded with -inf to whole key tiles of either
        # attention kernel (at most BIAS_KEY_ALIGN keys; the tensor-core kernel copies
        # whole tiles).
        self.npk = -(-N // _configs.BIAS_KEY_ALIGN) * _configs.BIAS_KEY_ALIGN
        # qkvg rows of 4D words; 2D for KV_F16_FORMATS, whose k and v are in tiles only and
        # whose q (fp16; hi and lo for f16x3) and o share [0, D); D for KV_BF16_TILES, q and
        # the gate in bf16 in each head's 32 words (project_epilogue.cuh QKVG_LD)
        row_words = (D if self.kv_format in _configs.KV_SLOT_FORMATS
                     else 2 * D if self.kv_format in _configs.KV_F16_FORMATS else 4 * D)
        self.qkvg_shape, self.bias_shape = (M, row_words), (B, H, N, self.npk)
        # The scratch arrays in one pool allocation, the bias after qkvg (M * 8D bytes at
        # least: a multiple of 32, so the bias starts 16-byte aligned for its tile copies).
        self.qkvg_bytes = M * row_words * 4
        # The bias in fp32, or fp16 for the bf16 and the TF32 wgmma attention.
        self.bias_dtype = (np.float16 if self.kv_format in (_configs.KV_BF16,
                                                            *_configs.KV_TILED_FORMATS)
                           else np.float32)
        if self.kv_format in _configs.KV_BULK_FORMATS:  # [B, H, query tiles, key tiles] x
            # [128 queries][64 keys], rows swizzled (project_epilogue.cuh bias_element)
            q_tiles = -(-N // _configs.WGMMA_QUERIES)
            self.bias_shape = (B, H, q_tiles, self.npk // _configs.WGMMA_KEYS,
                               _configs.WGMMA_QUERIES, _configs.WGMMA_KEYS)
        self.bias_bytes = math.prod(self.bias_shape) * np.dtype(self.bias_dtype).itemsize
        # The TF32 wgmma attention reads v as V^T tiles of 8 KiB per (b, i, head) and 64 keys,
        # which the projection writes after the bias (KV_TF32_VT; a multiple of 256 bytes
        # from the start: 16-byte aligned for the tile copies).
        # KV_TF32_TILES: each 64 keys' K tile beside their V^T tile, twice the bytes;
        # KV_BF16_TILES: the two in bf16, as many bytes as KV_TF32_VT, KV_F16_TILES in fp16;
        # KV_F16X3_TILES: hi and lo of both in fp16, as KV_TF32_TILES (and the bias tiles
        # twice, hi and lo).
        if self.kv_format == _configs.KV_F16X3_TILES:
            self.bias_shape = self.bias_shape[:4] + (2,) + self.bias_shape[4:]
            self.bias_bytes *= 2
        tiles = B * N * H * (self.npk // _configs.WGMMA_KEYS) * _configs.VT_TILE_BYTES
        self.vt_bytes = {_configs.KV_TF32_VT: tiles, _configs.KV_TF32_TILES: 2 * tiles,
                         _configs.KV_BF16_TILES: tiles, _configs.KV_F16_TILES: tiles,
                         _configs.KV_F16S_TILES: tiles,
                         _configs.KV_F16X3_TILES: 2 * tiles}.get(self.kv_format, 0)
        self.scratch_bytes = self.qkvg_bytes + self.bias_bytes + self.vt_bytes
        # Each batch's key extent under the mask (key_extent.cu; B ints after the rest),
        # where the attention's key loops may stop early: masked forwards from
        # KEY_EXTENT_MIN_N.
        self.key_extent = None
        if mask_meta is not None and N >= _configs.KEY_EXTENT_MIN_N:
            chunks = _configs.key_extent_chunks(N)
            self.key_extent = Launch(
                _configs.key_extent_config(), "mask_key_extent", chunks * B,
                _configs.KEY_EXTENT_THREADS, 0,
                (None, *_mask_args(mask_meta), I32(N), I32(chunks), None),
                ((0, "mask"), (7, "extent")))
            self.extent_offset = self.scratch_bytes
            self.scratch_bytes += 4 * B

        # The persistent projections (project_tiles.cu) of the tf32 and bf16 modes' wgmma
        # path (tensor-core projections, which tests may turn off); the LayerNorm one copies
        # whole rows of x, so it needs them 16-byte aligned.
        self.tiles = self.project_mma and _configs.uses_project_tiles(
            self.kv_format, D, dw.compute_capability, dw.smem_limit)
        self.project_tiles = self.tiles and bool(x_vec)
        if self.project_tiles:
            self.project = self._tiles_projection(dw, mask_meta, sb, si, sj)
        else:
            rows = _configs.project_rows(D, M, dw.sm_count, dw.smem_limit, self.project_mma)
            self.project = Launch(
                _configs.project_config(rows, self.project_mma, D, self.kv_format,
                                        self.project_split),
                "ln_qkvg_project", -(-M // rows), _configs.PROJECT_THREADS,
                _configs.project_smem_bytes(D, rows, self.project_mma),
                (None, I64(sb), I64(si), I64(sj), I64(sc), I32(x_vec),
                 I32(B), I32(N), I32(D), I32(H),
                 F32(dw.eps), F32(LOG2E / math.sqrt(d)),
                 Ptr(dw.gamma.data.ptr), Ptr(dw.beta.data.ptr),
                 Ptr(dw.projection_weight("qkvg", self.weight_layout, self.scales).data.ptr),
                 Ptr(dw.qkvg_bias(self.scales).data.ptr),
                 Ptr(dw.bias_weight(self.project_f16, self.scales).data.ptr), None,
                 *_mask_args(mask_meta),
                 None, None, I32(self.npk), None, *self._f16_projection_args(dw)),
                ((0, "pair"), (17, "mask"), (22, "qkvg"), (23, "bias"), (25, "vt")))
        self.attention = self.attention_launch(self.attention_kernel, nan_fully_masked)
        out_rows = _configs.out_project_rows()
        self.out_project = self._tiles_out_projection(dw) if self.tiles else Launch(
            _configs.project_config(out_rows, self.project_mma, D, self.kv_format,
                                    self.project_split),  # kv_format: how it reads the gate
            "gated_out_project", -(-M // out_rows), _configs.PROJECT_THREADS,
            _configs.project_smem_bytes(D, out_rows, self.project_mma),
            (None, I64(M), I32(D),
             Ptr(dw.projection_weight("out", self.weight_layout, self.scales).data.ptr),
             Ptr(dw.b_out.data.ptr), None, *self._f16_projection_args(dw, out=True)),
            ((0, "qkvg"), (5, "out")), self.overlap)
        self.nan_fully_masked = nan_fully_masked

    def _tiles_projection(self, dw: DeviceWeights, mask_meta, sb, si, sj) -> "Launch":
        """ln_qkvg_project_tiles: one block per SM over the tiles of 64 keys (b, i, 64c ..),
        its weights resident (DeviceWeights.tile_weight_image); the split kernel (fp32
        mode) also takes the pair-bias weights in fp32 and 1 / a_scale."""
        B, N, H, d = self.B, self.N, self.H, self.d
        s = dw.f16_scales(self.scales)
        split = _configs.project_tiles_split(self.kv_format)
        tiles = B * N * -(-N // _configs.TILES_ROWS)
        smem = _configs.project_tiles_smem_bytes(self.kv_format)
        return Launch(
            _configs.project_tiles_config(self.kv_format), "ln_qkvg_project_tiles",
            min(tiles, dw.sm_count), _configs.TILES_THREADS, smem,
            (None, I64(sb), I64(si), I64(sj), I32(B), I32(N), I32(H), F32(dw.eps),
             Ptr(dw.tile_gamma_beta(s.a).data.ptr),
             Ptr(dw.tile_weight_image("qkvg", self.scales, split).data.ptr),
             Ptr(dw.qkvg_bias(self.scales).data.ptr),
             F32(LOG2E / math.sqrt(d)), F32(1.0 / (s.a * s.w)), None, *_mask_args(mask_meta),
             None, None, I32(self.npk), None,
             *((Ptr(dw.bias_weight(False, self.scales).data.ptr), F32(1.0 / s.a))
               if split else ())),
            ((0, "pair"), (13, "mask"), (18, "qkvg"), (19, "bias"), (21, "vt")))

    def _tiles_out_projection(self, dw: DeviceWeights) -> "Launch":
        """gated_out_project_tiles: one block per SM over the tiles of 64 rows, Wo resident."""
        tiles = -(-self.M // _configs.TILES_ROWS)
        split = _configs.project_tiles_split(self.kv_format)
        return Launch(
            _configs.project_tiles_config(self.kv_format), "gated_out_project_tiles",
            min(tiles, dw.sm_count), _configs.TILES_THREADS,
            _configs.project_tiles_smem_bytes(self.kv_format, out=True),
            (None, I64(self.M), Ptr(dw.tile_weight_image("out", split=split).data.ptr),
             Ptr(dw.b_out.data.ptr), None, *self._f16_projection_args(dw, out=True)),
            ((0, "qkvg"), (4, "out")), self.overlap)

    def _f16_projection_args(self, dw: DeviceWeights, out: bool = False):
        """F16_TERMS's last arguments of ln_qkvg_project, a_scale and unscale (or `out`:
        gated_out_project's w_unscale); none otherwise."""
        if not self.project_f16:
            return ()
        s = dw.f16_scales(self.scales)
        if out:  # the kernel scales each block's g o itself (load_gated_tile_f16); o comes
            # in v's units where the attention writes it in fp16 (KV_F16_TILES: O16)
            o_unit = (self.scales[2] if self.kv_format in (_configs.KV_F16_TILES,
                                                           _configs.KV_F16S_TILES) else 1.0)
            return (F32(1.0 / (s.out_w * o_unit)),)
        return F32(s.a), F32(1.0 / (s.a * s.w))

    @property
    def scales(self):
        """(s_q, s_k, s_v, s_b): the powers of two q, k, v and the pair bias come scaled by
        into fp16's range (KV_F16_FORMATS; DeviceWeights.qkv_scales), or None."""
        return self._qkv_scales.get(_configs.scales_key(self.attention_kernel))

    def attention_launch(self, k: "_configs.AttentionLaunch", nan_fully_masked: bool):
        if k.kv_format != self.kv_format:
            raise ValueError(f"launch {k.name} reads k and v in format {k.kv_format}, but "
                             f"this forward's projection stores format {self.kv_format}; "
                             f"build the Forward with attention=that launch")
        if _configs.scales_key(k) != _configs.scales_key(self.attention_kernel):
            raise ValueError(f"launch {k.name} reads q, k and the bias scaled by the scale set "
                             f"{_configs.scales_key(k)!r}, but this forward's projection "
                             f"scales them by {_configs.scales_key(self.attention_kernel)!r}; "
                             f"build the Forward with attention=that launch")
        args = (None, None, I32(self.B), I32(self.N), I32(self.H), I32(self.npk),
                I32(nan_fully_masked))
        slots = ((0, "qkvg"), (1, "bias"))
        if k.kv_format in _configs.KV_TILED_FORMATS:  # and v (and k) from the tiles
            args, slots = args + (None,), slots + ((7, "vt"),)
        if k.kv_format in _configs.KV_F16_FORMATS:  # undo the projection's scales
            s_q, s_k, s_v, _ = self.scales
            args += (F32(1.0 / (s_q * s_k)), F32(1.0 / s_v))
        if k.operand_scales:  # the kernel scales fp32 q, k, v into fp16's range itself
            args += tuple(F32(s) for s in self._f16x3_scales)
        args, slots = args + (None,), slots + ((len(args), "extent"),)  # (null: all N keys)
        return Launch(k.config, k.name, k.blocks(self.B, self.N, self.H), k.threads, k.smem,
                       args, slots, self.overlap)

    @property
    def weight_layout(self) -> str:
        """The projection weights' layout this forward's kernels read (projection_weight):
        transposed for FFMA, in fp16 hi and lo chunks for the split fp16 products
        (F16_TERMS 3), in fp16 hi chunks for one fp16 product (F16_TERMS 1), in chunks for
        3xTF32, in chunks rounded to TF32 for TF32."""
        if not self.project_mma:
            return "transposed"
        if self.project_f16:
            return "f16 chunks" if self.project_split else "f16 hi chunks"
        return "chunks" if self.project_split else "tf32 chunks"


def plan_key(pair, mask, precision: str, nan_fully_masked: bool):
    """The key of DeviceWeights.plans: what a Plan depends on, as the arrays give it
    (byte strides; the mask's dtype and byte strides), cheap to build at every call."""
    return (pair.shape, pair.strides, pair.data.ptr % 16 == 0,
            None if mask is None else (mask.dtype, mask.strides), precision, nan_fully_masked)


def make_plan(dw: "DeviceWeights", key, attention: "_configs.AttentionLaunch | None" = None):
    """The Plan of a plan_key (pair strides in elements, the mask's meta)."""
    shape, strides, aligned, mask_key, precision, nan_fully_masked = key
    return Plan(dw, shape, tuple(s // 4 for s in strides), aligned, _mask_meta(mask_key),
                precision, nan_fully_masked, attention)


def _mask_meta(mask_key):
    """What of the mask a plan depends on, from plan_key's (dtype, byte strides): None, or
    (itemsize, is float, strides in elements over (B, N, N))."""
    if mask_key is None:
        return None
    dtype, byte_strides = mask_key
    strides = tuple(s // dtype.itemsize for s in byte_strides)
    return (dtype.itemsize, dtype.kind == "f", strides if len(strides) == 3 else (0, *strides))


def _mask_args(meta):
    """(kind, mb, mi, mj) for project.cu's mask reader (MASK_* codes), after its pointer."""
    if meta is None:  # a null pointer
        return I32(0), I64(0), I64(0), I64(0)
    itemsize, is_float, strides = meta
    kind = 5 + {2: 0, 4: 1, 8: 2}[itemsize] if is_float else {1: 1, 2: 2, 4: 3, 8: 4}[itemsize]
    return (I32(kind), *map(I64, strides))


_PLANS_PER_MODULE = 64  # geometries remembered per DeviceWeights (then forgotten, all at once)


class Forward:
    """One forward pass prepared: arguments checked, its Plan looked up (made on first
    use), scratch allocated. `stages()` lists the launches in order; `run()` performs
    them all."""

    def __init__(self, dw: DeviceWeights, pair, mask, fully_masked: str, out,
                 precision: str = "fp32",
                 attention: "_configs.AttentionLaunch | None" = None):
        cupy = _cupy()
        check_fully_masked(fully_masked)
        _configs.check_precision(precision)
        pair = as_device_array(pair, "pair", dw.device_id)
        if pair.dtype != np.float32:
            raise TypeError(f"pair must be float32; got {pair.dtype} (convert with "
                            f"pair.astype(cupy.float32))")
        B, N, batched = pair_geometry(pair.shape, dw.pair_dim)
        if mask is not None:
            mask = as_device_array(mask, "mask", dw.device_id)
            check_mask_dtype(mask.dtype)
            check_mask_shape(mask.shape, B, N, batched)
        if out is not None:
            out = as_device_array(out, "out", dw.device_id)
            if out.shape != pair.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
                raise ValueError(f"out must be a C-contiguous float32 array of shape "
                                 f"{pair.shape}; got {out.dtype} {out.shape} "
                                 f"(c_contiguous={out.flags.c_contiguous})")
        key = plan_key(pair, mask, precision, fully_masked == "nan")
        # Whether calls must switch to the weights' device (each look-up of the current
        # device costs ~0.7 µs of host time before the first kernel: done once here)
        self.dw, self._switch = dw, cupy.cuda.runtime.getDevice() != dw.device_id
        with self._on_device():  # one device switch: kernels, allocations
            if attention is None:
                plan = dw.plans.get(key)
                if plan is None:
                    if len(dw.plans) >= _PLANS_PER_MODULE:
                        dw.plans.clear()
                    plan = dw.plans[key] = make_plan(dw, key)
            else:
                plan = make_plan(dw, key, attention)
            self.plan, self.pair, self.mask = plan, pair, mask
            self._scratch = cupy.cuda.alloc(plan.scratch_bytes)  # qkvg, the bias, V^T
        scratch = self._scratch.ptr
        # The output's memory is taken after the first launch (_take_out_memory: ~1 µs of
        # host time the first kernel need not wait on), its CuPy array after the last
        # (making an ndarray costs ~2.5 µs)
        self._out, self._out_memory = out, None if out is None else out.data
        # The call's device addresses, by the names the launches' slots give them
        self._pointers = {"pair": pair.data.ptr, "mask": 0 if mask is None else mask.data.ptr,
                          "qkvg": scratch, "bias": scratch + plan.qkvg_bytes,
                          "vt": (scratch + plan.qkvg_bytes + plan.bias_bytes
                                 if plan.vt_bytes else 0),
                          "extent": scratch + plan.extent_offset if plan.key_extent else 0,
                          "out": None if out is None else out.data.ptr}

    # The geometry, as the plan has it
    B = property(lambda self: self.plan.B)
    N = property(lambda self: self.plan.N)
    D = property(lambda self: self.plan.D)
    H = property(lambda self: self.plan.H)
    d = property(lambda self: self.plan.d)
    M = property(lambda self: self.plan.M)
    npk = property(lambda self: self.plan.npk)
    kv_format = property(lambda self: self.plan.kv_format)

    def _on_device(self):
        """The weights' device as the current one, for kernels and allocations."""
        return _cupy().cuda.Device(self.dw.device_id) if self._switch else contextlib.nullcontext()

    def _take_out_memory(self):
        if self._out_memory is None:
            self._out_memory = _cupy().cuda.alloc(4 * self.pair.size)
            self._pointers["out"] = self._out_memory.ptr

    @property
    def out(self):
        """The float32 result, shaped like pair (the caller's `out`, or the array made
        for it)."""
        if self._out is None:
            with self._on_device():
                self._take_out_memory()
            self._out = _cupy().ndarray(self.pair.shape, np.float32, memptr=self._out_memory)
        return self._out

    @property
    def qkvg(self):
        """The scratch [M, 4D] float32 the stages share (q, k, v, gate; o over q), or [M,
        2D] for KV_F16_FORMATS (q's fp16 words per head, hi and lo for f16x3, o over them;
        the gate)."""
        return _cupy().ndarray(self.plan.qkvg_shape, np.float32, memptr=self._scratch)

    def attention_output(self):
        """o [M, D] float32 as the attention stage left it in qkvg: fp32 over [0, D), or
        for KV_O16_FORMATS 16 bits over each head's first 16 words (bf16; fp16 in v's
        units for KV_F16_TILES, undone here). For tests and tools: the out projection
        reads it in place."""
        cupy = _cupy()
        o = self.qkvg[:, :self.D]
        if self.kv_format not in _configs.KV_O16_FORMATS:
            return o.copy()
        # a head's 16 words, dim pair p in word 4 (p % 4) + p // 4 (project_epilogue.cuh load_o4)
        words = o.reshape(self.M, self.H, self.d)[:, :, :self.d // 2].view(cupy.uint32)
        halves = words.reshape(self.M, self.H, 4, 4).transpose(0, 1, 3, 2).copy().view(cupy.uint16)
        if self.kv_format == _configs.KV_BF16_TILES:
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
            self.plan.project(self._pointers)

    def attention(self, launch: "_configs.AttentionLaunch | None" = None):
        """The attention stage (with the key extent before it, where the plan finds one);
        `launch` replaces the kernel chosen for this forward (tile sweeps time kernels on
        the same scratch): it must read k and v in the form this forward's projection
        stores them."""
        with self._on_device():
            self._find_key_extent()
            if launch is None:
                self.plan.attention(self._pointers)
            else:
                self.plan.attention_launch(launch, self.plan.nan_fully_masked)(self._pointers)

    def out_project(self):
        with self._on_device():
            self._take_out_memory()
            self.plan.out_project(self._pointers)

    def stages(self):
        return [("layernorm+projections", self.project),
                ("attention", self.attention), ("gate+out_proj", self.out_project)]

    def _find_key_extent(self):
        if self.plan.key_extent is not None:
            cupy = _cupy()
            cupy.cuda.runtime.memsetAsync(self._pointers["extent"], 0, 4 * self.B,
                                          cupy.cuda.get_current_stream().ptr)
            self.plan.key_extent(self._pointers)

    def run(self):
        with self._on_device():
            self.plan.project(self._pointers)
            self._take_out_memory()
            self._find_key_extent()
            self.plan.attention(self._pointers)
            self.plan.out_project(self._pointers)
            out = self.out
        # Scratch back to the pool now, not at GC (the pool reuses it in stream order).
        self._scratch = self._pointers = None
        return out
