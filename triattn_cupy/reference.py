"""The forward pass in NumPy: the test oracle that needs no PyTorch, and the CPU backend.

Same semantics as the reference module (``shared/spec/reference_module.py``):

    x    = LayerNorm(pair)                                  # [B, N, N, D]
    q, k, v, g = x Wq^T + bq, ..., sigmoid(x Wg^T + bg)     # [B, N, N, h*c] each
    bias = x Wb^T                                           # [B, N, N, h]
    s[b, i, head, j, k] = q[b,i,j] . k[b,i,k] / sqrt(c) + bias[b, j, k, head]
                          (-inf where mask[b, j, k] == 0)   # bias and mask shared by rows i
    o    = softmax_k(s) v, heads concatenated               # [B, N, N, h*c]
    out  = (g * o) Wo^T + bo                                # [B, N, N, D]

with h heads of width c (`Weights.head_dim`): c = D / h in the spec's module, any c here
(the models' template stacks have h*c = 2D).

A query whose keys are all masked has no softmax; ``fully_masked="zero"`` makes its
attention output zero (so ``out = bo`` there), ``"nan"`` returns NaN like the reference.

Real models' conventions (`triattn_cupy.conventions`): with ``mask_layout="row"`` the mask
is indexed (b, i, k) (-inf where ``mask[b, i, k] == 0``, for every query j of row i), and
``node="ending"`` applies all of the above to the transposed pair and mask and writes the
output in the caller's layout (``"ending_af3"``: with the pair bias transposed back). Both
are read as NumPy views, without copies.
"""
from __future__ import annotations

import math

import numpy as np

from ._checks import check_fully_masked, check_mask_dtype, pair_geometry
from .conventions import check_mask_layout, check_node, mask_as_square
from .weights import Weights

# Rows i processed together; bounds the (rows, h, N, N) score buffer.
_SCORE_BUDGET_ELEMENTS = 1 << 25


# Rows whose largest magnitude passes this are scaled down before LayerNorm squares them.
_LAYER_NORM_RESCALE_ABOVE = 2.0 ** 40


def layer_norm(x: np.ndarray, weight, bias, eps: float) -> np.ndarray:
    """torch.nn.LayerNorm over the last axis, in x's dtype, for every finite x.

    Two kinds of rows need more than the textbook formula, and only they get it (every
    other row takes the plain formula bit for bit):

    - Huge rows: in float32 the sum of squares overflows from |x| ~ 1e18 (D = 128).
      LayerNorm is unchanged by x -> x / s when eps becomes eps / s**2, so rows past
      2**40 are first divided by a power of two s near their largest magnitude (exact).
    - Narrow rows, whose spread max - min is under a quarter of their largest magnitude
      (a constant row among them): the rounding of their mean, ~ulp(max |x|), is as large
      as their deviations, so a constant row came out as noise (or NaN once eps / s**2
      underflowed). Their first element is subtracted first: every value of such a row
      lies within a factor 4/3 of it, so the difference is exact (Sterbenz), a constant
      row becomes exactly 0 and its LayerNorm exactly `bias`.
    """
    hi = np.max(x, axis=-1, keepdims=True)
    lo = np.min(x, axis=-1, keepdims=True)
    amax = np.maximum(hi, -lo)
    big = np.isfinite(amax) & (amax > _LAYER_NORM_RESCALE_ABOVE)
    if big.any():
        s = np.where(big, np.ldexp(1.0, np.frexp(amax)[1] - 1), 1.0)   # float64, <= amax
        x = x / s.astype(x.dtype)
        # eps / s**2 underflows to 0 beyond |x| ~ 1e20 in float32: kept a normal number,
        # so that a constant row divides 0 by sqrt(tiny), not by 0.
        eps = np.maximum((eps / np.square(s)).astype(x.dtype), np.finfo(x.dtype).tiny)
    with np.errstate(over="ignore", invalid="ignore"):  # hi - lo of inf / nan rows: not narrow
        narrow = (hi - lo) < amax / 4
    if narrow.any():
        x = x - np.where(narrow, x[..., :1], 0).astype(x.dtype)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased, as torch.nn.LayerNorm
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _sigmoid(x):
    """1 / (1 + e^-x) without overflow, to full relative precision on both sides:
    e^-|x| never overflows, and for x < 0 the value is e^x / (1 + e^x). (The former
    0.5 (1 + tanh(x / 2)) lost every bit below x ~ -37, where tanh rounds to -1: saturated
    gates came out 0.)"""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


def triangle_attention(pair, mask, weights: Weights, *, fully_masked: str = "zero",
                       dtype=np.float64, rows=None, mask_layout=None, node=None) -> np.ndarray:
    """Triangle self-attention on the CPU.

    pair: (B, N, N, D) or (N, N, D), any real dtype. mask: (B, N, N) / (N, N) of bool,
    int or float (0 = masked), or None; with ``mask_layout="row"`` also (B, N, 1, 1, N) /
    (N, 1, 1, N). Computed in `dtype` (float64 or float32) and returned in it, shaped like
    `pair`; a 16-bit pair (float16, or ml_dtypes.bfloat16) gets its own dtype back, as the
    GPU backend returns it.
    mask_layout: "pair" (mask[b, j, k]: key k of query j, in every row i; the spec's) or
    "row" (mask[b, i, k]: key k of every query of row i; OpenFold's, Boltz's, Protenix's).
    node: "starting" (rows along the first N axis), "ending" (the block applied to the
    transposed pair and mask, the output transposed back) or "ending_af3" (as "ending",
    with the pair bias of the untransposed pair, as AlphaFold3). None: the weights' own
    (`Weights.mask_layout`, `Weights.node`), so weights imported from a model compute what
    the model computes.
    rows: optional indices of the rows to compute (a spot check of a large input): indices
    i of the first N axis for the starting node, of the second for the ending node (the
    rows of the transposed pair); the result then has len(rows) in place of that axis.
    """
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be a triattn_cupy.Weights (see load_weights); got "
                        f"{type(weights).__name__}")
    check_fully_masked(fully_masked)
    mask_layout = check_mask_layout(weights.mask_layout if mask_layout is None else mask_layout)
    node = check_node(weights.node if node is None else node)
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    pair = np.asarray(pair)
    if pair.dtype.kind != "f" and pair.dtype.name != "bfloat16":  # (ml_dtypes': kind "V")
        raise TypeError(f"pair must be a float array, got dtype {pair.dtype}")
    result_dtype = pair.dtype if pair.dtype.itemsize == 2 else dtype
    B, N, batched = pair_geometry(pair.shape, weights.pair_dim)
    D, h, d = weights.pair_dim, weights.num_heads, weights.head_dim
    hidden = weights.hidden_dim                                      # h * d
    x = pair.reshape(B, N, N, D)                                     # a view of pair
    if mask is None:
        keep = np.ones((B, N, N), bool)
    else:
        mask = np.asarray(mask)
        check_mask_dtype(mask.dtype)
        keep = mask_as_square(mask, B, N, batched, mask_layout) != 0  # [B, N, N]
    if node != "starting":
        # The transposed pair and mask as strided views: x[b, i, j] = pair[b, j, i].
        x = x.swapaxes(1, 2)
        keep = keep.swapaxes(1, 2)

    p = {name: value.astype(dtype) for name, value in weights.params.items()}
    x = layer_norm(x.astype(dtype, copy=False), p["layer_norm.weight"], p["layer_norm.bias"],
                   weights.layer_norm_eps)

    def linear(name, inp):
        return inp @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    g = _sigmoid(linear("gate", x))                                  # [B, N, N, h*d]
    bias = np.moveaxis(x @ p["bias_proj.weight"].T, -1, 1)           # [B, h, N, N]
    if node == "ending_af3":
        bias = bias.swapaxes(-1, -2)  # [b, h, j, k] from pair[b, j, k], not from pair[b, k, j]
    if mask_layout == "pair":
        bias = np.where(keep[:, None], bias, -np.inf)                # mask folded in
    # [B, N]: the queries j (pair layout) or the rows i (row layout) left without a key.
    fully = ~keep.any(axis=-1)

    if rows is None:
        rows = np.arange(N)
    else:
        rows = np.asarray(rows).reshape(-1)
        if rows.dtype.kind not in "iu" or rows.size == 0 or rows.min() < 0 or rows.max() >= N:
            raise ValueError(f"rows must be non-empty integer indices in [0, {N}); got {rows}")
    out = np.empty((B, len(rows), N, D) if node == "starting" else (B, N, len(rows), D), dtype)
    out_rows = out if node == "starting" else out.swapaxes(1, 2)    # [B, R, N, D] view
    fill = np.nan if fully_masked == "nan" else 0.0
    chunk = max(1, _SCORE_BUDGET_ELEMENTS // (h * N * N))
    for b in range(B):
        for i0 in range(0, len(rows), chunk):
            picked = rows[i0:i0 + chunk]
            xi = x[b, picked]                                        # [R, N, D]
            R = xi.shape[0]
            q = linear("query", xi).reshape(R, N, h, d).transpose(0, 2, 1, 3)  # [R, h, N, d]
            k = linear("key", xi).reshape(R, N, h, d).transpose(0, 2, 1, 3)
            v = linear("value", xi).reshape(R, N, h, d).transpose(0, 2, 1, 3)
            s = q @ k.transpose(0, 1, 3, 2) * dtype.type(1 / math.sqrt(d)) + bias[b][None]  # [R, h, N, N]
            if mask_layout == "row":
                # [R, 1, 1, N]: key k removed from every query of row i
                s = np.where(keep[b, picked][:, None, None, :], s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            # A fully-masked query has m = -inf; exp(-inf - (-inf)) would be NaN, so
            # subtract 0 there instead: every term is exp(-inf) = 0 and the sum is 0.
            e = np.exp(s - np.where(np.isfinite(m), m, 0))
            total = e.sum(axis=-1, keepdims=True)
            with np.errstate(invalid="ignore", divide="ignore"):
                o = (e @ v) / total                                  # [R, h, N, d]; 0/0 = NaN
            if mask_layout == "pair":
                dead = fully[b][None, None, :, None]                 # [1, 1, N, 1] queries j
            else:
                dead = fully[b, picked][:, None, None, None]         # [R, 1, 1, 1] rows i
            o = np.where(dead, fill, o)
            o = o.transpose(0, 2, 1, 3).reshape(R, N, hidden)        # [R, N, h*d]
            out_rows[b, i0:i0 + R] = linear("out_proj", g[b, picked] * o)
    out = out.astype(result_dtype, copy=False)
    return out if batched else out[0]
