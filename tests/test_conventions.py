"""Mask layouts ("pair", "row") and nodes ("starting", "ending") in the NumPy backend, against
a direct float64 statement of each convention (explicit copies of the transposed arrays, the
whole (B, I, h, J, K) score tensor), and the conventions carried by `Weights`."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helpers import rel_l2
from triattn_cupy import random_weights
from triattn_cupy.reference import triangle_attention

TOL64 = 1e-12
CONVENTIONS = [(layout, node) for layout in ("pair", "row")
               for node in ("starting", "ending", "ending_af3")]


def direct_forward(pair, mask, weights, mask_layout, node):
    """The block as the models write it, in float64: NaN where a query has no key left."""
    p = {name: value.astype(np.float64) for name, value in weights.params.items()}
    x = np.array(pair, np.float64)
    keep = np.ones(x.shape[:-1], bool) if mask is None else np.array(mask) != 0
    if node != "starting":  # the block on the transposed pair, as copies
        x = np.ascontiguousarray(x.swapaxes(1, 2))
        keep = np.ascontiguousarray(keep.swapaxes(1, 2))
    B, N, _, D = x.shape
    h = weights.num_heads
    d = D // h
    mean = x.mean(-1, keepdims=True)
    x = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True)
                             + weights.layer_norm_eps) * p["layer_norm.weight"] + p["layer_norm.bias"]

    def linear(name):
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    q, k, v = (linear(n).reshape(B, N, N, h, d) for n in ("query", "key", "value"))
    bias = x @ p["bias_proj.weight"].T                                   # [B, J, K, h]
    s = np.einsum("bijhd,bikhd->bihjk", q, k) / np.sqrt(d)              # [B, I, h, J, K]
    if node == "ending_af3":  # query j, key k: the bias of pair[j, k] = x[k, j]
        s = s + np.einsum("bkjh->bhjk", bias)[:, None]
    else:
        s = s + np.einsum("bjkh->bhjk", bias)[:, None]
    if mask_layout == "pair":
        s = np.where(keep[:, None, None, :, :], s, -np.inf)             # mask[b, j, k]
    else:
        s = np.where(keep[:, :, None, None, :], s, -np.inf)             # mask[b, i, k]
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(-1, keepdims=True))                         # NaN if all -inf
        a = e / e.sum(-1, keepdims=True)
    o = np.einsum("bihjk,bikhd->bijhd", a, v).reshape(B, N, N, D)
    g = 1 / (1 + np.exp(-linear("gate")))
    out = (g * o) @ p["out_proj.weight"].T + p["out_proj.bias"]
    return out if node == "starting" else out.swapaxes(1, 2)


def random_keep(rng, B, N):
    """(B, N >= 3, N) bool: ~30% masked; row N-1 and column N-1 of batch element 0 fully
    masked (so every convention meets a query without keys), every other row and column
    keeps key 0 or query 0."""
    keep = rng.random((B, N, N)) < 0.7
    keep[:, :, 0] = True
    keep[:, 0, :] = True
    keep[0, N - 1, :] = False
    keep[0, :, N - 1] = False
    return keep


@pytest.mark.parametrize("mask_layout,node", CONVENTIONS)
@pytest.mark.parametrize("B,N,D,h", [(1, 1, 16, 4), (2, 7, 16, 4), (3, 13, 24, 3)])
def test_matches_direct_float64(rng, mask_layout, node, B, N, D, h):
    weights = random_weights(D, h, seed=int(rng.integers(1 << 30)))
    pair = rng.standard_normal((B, N, N, D))
    keep = random_keep(rng, B, N) if N > 1 else np.ones((B, N, N), bool)
    expected = direct_forward(pair, keep, weights, mask_layout, node)
    out = triangle_attention(pair, keep, weights, mask_layout=mask_layout, node=node,
                             fully_masked="nan")
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(out), nan)
    if N > 1:
        assert nan.any() and not nan.all()
    assert rel_l2(out, expected, where=~nan) < TOL64


@pytest.mark.parametrize("mask_layout,node", CONVENTIONS)
def test_zero_policy_gives_out_proj_bias(rng, mask_layout, node):
    weights = random_weights(16, 2, seed=3)
    pair = rng.standard_normal((2, 6, 6, 16))
    keep = random_keep(rng, 2, 6)
    nan = np.isnan(triangle_attention(pair, keep, weights, mask_layout=mask_layout, node=node,
                                      fully_masked="nan"))
    out = triangle_attention(pair, keep, weights, mask_layout=mask_layout, node=node)
    assert np.isfinite(out).all()
    assert np.array_equal(out[nan], np.broadcast_to(weights["out_proj.bias"], out.shape)[nan])


def test_af3_ending_differs_from_ending_by_the_bias(rng):
    weights = random_weights(16, 4, seed=12)
    pair = rng.standard_normal((1, 8, 8, 16))
    a = triangle_attention(pair, None, weights, node="ending")
    b = triangle_attention(pair, None, weights, node="ending_af3")
    assert rel_l2(a, b) > 1e-2
    no_bias = dataclasses.replace(weights, params={**weights.params,
                                                   "bias_proj.weight": np.zeros((4, 16))})
    a = triangle_attention(pair, None, no_bias, node="ending")
    b = triangle_attention(pair, None, no_bias, node="ending_af3")
    assert np.array_equal(a, b)


@pytest.mark.parametrize("mask_layout", ["pair", "row"])
def test_ending_is_starting_on_the_transposed_pair(rng, mask_layout):
    weights = random_weights(16, 4, seed=4)
    pair = rng.standard_normal((2, 9, 9, 16)).astype(np.float32)
    keep = random_keep(rng, 2, 9)
    ending = triangle_attention(pair, keep, weights, mask_layout=mask_layout, node="ending")
    starting = triangle_attention(np.ascontiguousarray(pair.swapaxes(1, 2)),
                                  np.ascontiguousarray(keep.swapaxes(1, 2)), weights,
                                  mask_layout=mask_layout, node="starting")
    assert rel_l2(ending, starting.swapaxes(1, 2)) < TOL64


def test_padding_mask_layouts_agree_on_kept_positions(rng):
    """An outer-product mask: both layouts agree wherever row i and query j are kept."""
    weights = random_weights(16, 4, seed=5)
    B, N = 2, 11
    pair = rng.standard_normal((B, N, N, 16))
    kept = np.ones((B, N), bool)
    kept[0, 8:] = False
    kept[1, 5:] = False
    keep = kept[:, :, None] & kept[:, None, :]
    both = (kept[:, :, None] & kept[:, None, :])[..., None]
    for node in ("starting", "ending"):
        a = triangle_attention(pair, keep, weights, mask_layout="pair", node=node)
        b = triangle_attention(pair, keep, weights, mask_layout="row", node=node)
        assert rel_l2(a, b, where=both) < TOL64
        assert rel_l2(a, b) > 1e-3  # and differ on the padding


def test_crop_mask_layouts_differ(rng):
    """A mask that is not an outer product (a crop of the keys of some rows)."""
    weights = random_weights(16, 4, seed=6)
    pair = rng.standard_normal((1, 10, 10, 16))
    keep = np.ones((1, 10, 10), bool)
    keep[0, :5, 6:] = False
    a = triangle_attention(pair, keep, weights, mask_layout="pair")
    b = triangle_attention(pair, keep, weights, mask_layout="row")
    assert rel_l2(a, b) > 1e-2
    assert rel_l2(b, direct_forward(pair, keep, weights, "row", "starting")) < TOL64


@pytest.mark.parametrize("node", ["starting", "ending"])
@pytest.mark.parametrize("batched", [True, False])
def test_row_mask_in_the_models_broadcast_shape(rng, node, batched):
    weights = random_weights(16, 4, seed=7)
    pair = rng.standard_normal((2, 8, 8, 16))
    keep = random_keep(rng, 2, 8).astype(np.float32)
    if not batched:
        pair, keep = pair[0], keep[0]
    square = triangle_attention(pair, keep, weights, mask_layout="row", node=node)
    broadcast = triangle_attention(pair, keep[..., :, None, None, :], weights,
                                   mask_layout="row", node=node)
    assert np.array_equal(square, broadcast)


@pytest.mark.parametrize("mask_layout,node", CONVENTIONS)
def test_rows_spot_check(rng, mask_layout, node):
    weights = random_weights(16, 4, seed=8)
    pair = rng.standard_normal((2, 9, 9, 16))
    keep = random_keep(rng, 2, 9)
    full = triangle_attention(pair, keep, weights, mask_layout=mask_layout, node=node)
    rows = np.array([7, 0, 3])
    part = triangle_attention(pair, keep, weights, mask_layout=mask_layout, node=node,
                              rows=rows)
    expected = full[:, rows] if node == "starting" else full[:, :, rows]
    assert rel_l2(part, expected) < TOL64


def test_non_contiguous_inputs(rng):
    weights = random_weights(16, 4, seed=9)
    big = rng.standard_normal((2, 10, 10, 32))
    pair = big[:, 1:9, 1:9, ::2]
    keep = random_keep(rng, 2, 16)[:, ::2, ::2]
    for mask_layout, node in CONVENTIONS:
        out = triangle_attention(pair, keep, weights, mask_layout=mask_layout, node=node)
        expected = triangle_attention(pair.copy(), keep.copy(), weights,
                                      mask_layout=mask_layout, node=node)
        assert np.array_equal(out, expected)


def test_weights_carry_the_conventions(rng):
    weights = random_weights(16, 4, seed=10)
    assert (weights.mask_layout, weights.node) == ("pair", "starting")
    model = dataclasses.replace(weights, mask_layout="row", node="ending")
    pair = rng.standard_normal((2, 7, 7, 16))
    keep = random_keep(rng, 2, 7)
    implied = triangle_attention(pair, keep, model)
    explicit = triangle_attention(pair, keep, weights, mask_layout="row", node="ending")
    assert np.array_equal(implied, explicit)
    # a call overrides either convention
    overridden = triangle_attention(pair, keep, model, mask_layout="pair", node="starting")
    assert np.array_equal(overridden, triangle_attention(pair, keep, weights))


@pytest.mark.parametrize("field,value,message", [
    ("mask_layout", "rows", r"Weights.mask_layout must be one of \('pair', 'row'\), got 'rows'"),
    ("node", "end", r"Weights.node must be one of \('starting', 'ending', 'ending_af3'\), "
                    r"got 'end'"),
])
def test_weights_reject_unknown_conventions(field, value, message):
    weights = random_weights(16, 4)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(weights, **{field: value})


def test_rejects_unknown_conventions_in_a_call(rng):
    weights = random_weights(16, 4)
    pair = rng.standard_normal((1, 3, 3, 16))
    with pytest.raises(ValueError, match=r"mask_layout must be one of \('pair', 'row'\), "
                                         r"got 'ik'"):
        triangle_attention(pair, None, weights, mask_layout="ik")
    with pytest.raises(ValueError, match=r"node must be one of \('starting', 'ending', "
                                         r"'ending_af3'\), got 'incoming'"):
        triangle_attention(pair, None, weights, node="incoming")


@pytest.mark.parametrize("mask_layout,shape,expected", [
    ("pair", (2, 5, 1, 1, 5), r"\(2, 5, 5\) to match pair; got \(2, 5, 1, 1, 5\) "
                              r"\(mask_layout 'pair'\)"),
    ("row", (2, 5, 1, 5), r"\(2, 5, 5\) or \(2, 5, 1, 1, 5\) to match pair; got \(2, 5, 1, 5\)"),
    ("row", (2, 5, 1, 1, 4), r"\(2, 5, 5\) or \(2, 5, 1, 1, 5\) to match pair"),
])
def test_rejects_mask_shapes_by_layout(rng, mask_layout, shape, expected):
    weights = random_weights(16, 4)
    pair = rng.standard_normal((2, 5, 5, 16))
    with pytest.raises(ValueError, match=rf"mask must have shape {expected}"):
        triangle_attention(pair, np.ones(shape, bool), weights, mask_layout=mask_layout)


@pytest.mark.parametrize("mask_layout,node", CONVENTIONS)
def test_float32_path(rng, mask_layout, node):
    weights = random_weights(32, 4, seed=11)
    pair = rng.standard_normal((2, 17, 17, 32)).astype(np.float32)
    keep = random_keep(rng, 2, 17)
    out = triangle_attention(pair, keep, weights, mask_layout=mask_layout, node=node,
                             dtype=np.float32, fully_masked="nan")
    expected = direct_forward(pair, keep, weights, mask_layout, node)
    nan = np.isnan(expected)
    assert out.dtype == np.float32
    assert np.array_equal(np.isnan(out), nan)
    assert rel_l2(out, expected, where=~nan) < 1e-5


def test_conventions_record_says_what_a_forward_does_with_them():
    """conventions.Conventions: the (mask_layout, node) pair by name, checked, and what the
    GPU forward makes of it (a row mask for the attention; the transposed pair)."""
    from triattn_cupy.conventions import Conventions

    given = Conventions.checked("row", "ending")
    assert given == ("row", "ending") and given.row_mask and given.transposed
    assert Conventions(*("pair", "ending_af3")).transposed
    assert Conventions() == ("pair", "starting")
    assert not Conventions().row_mask and not Conventions().transposed
    with pytest.raises(ValueError, match="node must be one of .* got 'middle'"):
        Conventions.checked("pair", "middle")
    with pytest.raises(ValueError, match="mask_layout must be one of .* got 'col'"):
        Conventions.checked("col", "starting")
