"""Powers of two that put q, k, v, the pair bias and the projections' operands into fp16's
range, from bounds on the weights alone (exact to apply and to undo)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..weights import Weights



LOG2E = math.log2(math.e)


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
