"""The models' conventions on the GPU (triattn_cupy.conventions): row masks (b, i, k) and
the ending node, in every route forced and on the default routes, against the float64
NumPy backend, which computes them by definition.

Each output buffer starts as NaN, and `rel_l2` fails on any NaN. Compared where a row keeps
at least one key; at the rows whose keys are all masked, `fully_masked` decides: NaN exactly
there ("nan"), or the out projection's bias alone ("zero").
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu, reference
from helpers import rel_l2
from test_gpu import TOLERANCE, poison_pool

pytestmark = pytest.mark.gpu

MASK_KINDS = ("padding", "crop", "random")


@pytest.fixture
def cp():
    import cupy

    return cupy


def convention_mask(rng, B, N, kind):
    """A (B, N, N) bool mask of `kind`:
    padding: an outer product keep[i] keep[k], each batch padded from its own length;
    crop:    key window |i - k| <= w around each row's own position, w per batch;
    random:  75% kept, with a fully masked row i0 and column k0 in every batch (a row
             without keys at the starting node, and at the ending node, whose row i is
             the mask's column i)."""
    if kind == "padding":
        lengths = rng.integers(max(1, N // 2), N + 1, B)
        keep = np.arange(N)[None, :] < lengths[:, None]                   # [B, N]
        return keep[:, :, None] & keep[:, None, :]
    if kind == "crop":
        width = rng.integers(1, max(2, N // 3), B)
        i = np.arange(N)
        return np.abs(i[None, :, None] - i[None, None, :]) <= width[:, None, None]
    keep = rng.random((B, N, N)) > 0.25
    if N > 1:
        keep[:, rng.integers(N), :] = False
        keep[:, :, rng.integers(N)] = False
    return keep


def check_conventions(cp, rng, B, N, D, h, *, mask_layout, node, mask_kind="random",
                      precision="fp32", route=None, fully_masked="zero", weights=None,
                      mask_form=None, pass_conventions=True):
    """One GPU forward against the float64 NumPy backend; returns the rel L2 error.
    `mask_form(mask) -> array`: how the mask reaches the GPU (a dtype, a view, a shape)."""
    if weights is None:
        weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = rng.standard_normal((B, N, N, D)).astype(np.float32) * 2 + 0.5
    mask = convention_mask(rng, B, N, mask_kind)
    conventions = dict(mask_layout=mask_layout, node=node) if pass_conventions else {}
    # From N = 512 the float64 reference computes a sample of rows: 16 at random and every
    # row left without a key (rows i of the node's own frame: the mask's columns at the
    # ending node)
    rows = None
    if N >= 512:
        keep = mask if node == "starting" else mask.swapaxes(1, 2)
        rows = np.union1d(rng.choice(N, 16, replace=False),
                          np.flatnonzero((~keep.any(axis=-1)).any(axis=0)))
    # float64; "nan" marks exactly the outputs of rows left without a key
    expected = reference.triangle_attention(pair, mask, weights, fully_masked="nan",
                                            rows=rows, **conventions)
    dead = np.isnan(expected)
    assert (~dead).any()
    d_mask = cp.asarray(mask)
    if mask_form is not None:
        d_mask = mask_form(d_mask)
    poison_pool(cp)
    out = cp.full(pair.shape, np.nan, np.float32)
    got = ta.triangle_attention(cp.asarray(pair), d_mask, weights, fully_masked=fully_masked,
                                out=out, precision=precision, route=route, **conventions)
    assert got is out
    got = got.get()
    if rows is not None:  # the rows the reference computed
        got = got[:, rows] if node == "starting" else got[:, :, rows]
    if fully_masked == "nan":
        assert np.array_equal(np.isnan(got), dead), "NaN exactly at the rows without keys"
    elif dead.any():
        # zero attention output there: out = the out projection's bias
        bias = np.broadcast_to(weights.params["out_proj.bias"], got.shape)
        assert np.isfinite(got[dead]).all()
        assert rel_l2(got[dead], bias[dead]) <= TOLERANCE[precision]
    err = rel_l2(got, expected, where=~dead)
    assert err <= TOLERANCE[precision], (
        f"{route or 'default'} {precision} {mask_layout}/{node} {mask_kind} B={B} N={N} "
        f"D={D} h={h}: rel L2 {err:.3g}")
    return err


def _route_shape(name):
    """(D, h) a forced route takes (as tests/test_gpu.py test_every_route_forced)."""
    parts = gpu.routes.route_parts(name)
    tiles = parts["project"] == "persistent"
    wide = tiles or parts["attention"].startswith("wgmma")
    return (128, 4) if wide else (64, 4)


def _skip_unless_runs(cp, name):
    attention = gpu.routes.route_parts(name)["attention"]
    cc = int(cp.cuda.Device().compute_capability)
    if attention.startswith("wgmma") and cc != 90:
        pytest.skip("wgmma runs on compute capability 9.0 only")
    if attention != "ffma" and cc < 80:
        pytest.skip("tensor cores need compute capability 8.0")


_ROUTE_CASES = [(name, precision) for name in gpu.routes.ROUTES
                for precision in gpu.routes.route_parts(name)["precisions"]]


@pytest.mark.parametrize("name,precision", _ROUTE_CASES, ids=lambda x: str(x))
def test_every_route_forced(cp, rng, name, precision):
    """Each route: the row layout at both nodes and the pair layout at the ending node,
    B = 2, N off every tile, random masks with fully masked rows; "nan" at N = 61."""
    _skip_unless_runs(cp, name)
    D, h = _route_shape(name)
    for mask_layout, node in (("row", "starting"), ("row", "ending"), ("pair", "ending")):
        check_conventions(cp, rng, 2, 61, D, h, mask_layout=mask_layout, node=node,
                          precision=precision, route=name, fully_masked="nan")
    check_conventions(cp, rng, 2, 200, D, h, mask_layout="row", node="ending",
                      precision=precision, route=name)


@pytest.mark.parametrize("name", [n for n in gpu.routes.ROUTES
                                  if gpu.routes.route_parts(n)["attention"].startswith("mma")])
def test_mma_routes_with_the_sm_80_tables(cp, rng, name):
    """The sm_80 tile tables (an A100's: other key tiles, two rows per block in bf16)."""
    _skip_unless_runs(cp, name)
    D, h = _route_shape(name)
    precision = gpu.routes.route_parts(name)["precisions"][0]
    for node in ("starting", "ending"):
        check_conventions(cp, rng, 2, 61, D, h, mask_layout="row", node=node,
                          precision=precision, route=name + "@sm_80", fully_masked="nan")


# The default routes: N 61 (mma.sync), 200 (wgmma on an H200, the persistent projections
# at D = 128), 600 (wgmma at D = 64, with the key extent from N = 512).
_DEFAULT_SHAPES = {61: (64, 4), 200: (128, 4), 600: (64, 2)}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("N", sorted(_DEFAULT_SHAPES))
@pytest.mark.parametrize("node", ["starting", "ending"])
def test_default_routes(cp, rng, node, N, precision):
    """Row masks of every kind (padding, crop, random with fully masked rows), B = 2."""
    D, h = _DEFAULT_SHAPES[N]
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    for kind in MASK_KINDS:
        check_conventions(cp, rng, 2, N, D, h, mask_layout="row", node=node, mask_kind=kind,
                          precision=precision, weights=weights)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("fully_masked", ["zero", "nan"])
@pytest.mark.parametrize("N", [61, 200])
def test_fully_masked_rows(cp, rng, N, fully_masked, precision):
    """Rows without a key at both nodes: zero attention output (out = bo) or NaN exactly
    there, on the default route and on the FFMA route."""
    D, h = _DEFAULT_SHAPES[N]
    for route in (None, "ffma"):
        for node in ("starting", "ending"):
            check_conventions(cp, rng, 2, N, D, h, mask_layout="row", node=node,
                              precision=precision, route=route, fully_masked=fully_masked)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pair_layout_at_the_ending_node_default_routes(cp, rng, precision):
    for N in (61, 200, 600):
        D, h = _DEFAULT_SHAPES[N]
        check_conventions(cp, rng, 2, N, D, h, mask_layout="pair", node="ending",
                          precision=precision, fully_masked="nan")


@pytest.mark.parametrize("node", ["starting", "ending"])
def test_mask_forms(cp, rng, node):
    """The row mask as the models pass it, (B, N, 1, 1, N); in other dtypes; as a strided
    view (every other element of a wider array, and a transposed copy's view)."""
    forms = [
        lambda m: m.reshape(m.shape[0], m.shape[1], 1, 1, m.shape[2]),
        lambda m: m.astype(cp.int8),
        lambda m: m.astype(cp.float16) * 3,
        lambda m: cp.repeat(m.astype(cp.float32), 2, axis=-1)[..., ::2],
        lambda m: cp.ascontiguousarray(m.swapaxes(1, 2)).swapaxes(1, 2),
    ]
    for form in forms:
        check_conventions(cp, rng, 2, 45, 64, 4, mask_layout="row", node=node,
                          mask_form=form)


def test_unbatched_and_strided_pair(cp, rng):
    """(N, N, D) inputs, and a pair that is itself a transposed view, at the ending node
    (the block then reads the underlying array in its own order)."""
    weights = ta.random_weights(64, 4, seed=5)
    N = 53
    pair = rng.standard_normal((N, N, 64)).astype(np.float32)
    mask = convention_mask(rng, 1, N, "random")[0]
    for node in ("starting", "ending"):
        expected = reference.triangle_attention(pair, mask, weights, mask_layout="row",
                                                node=node)
        got = ta.triangle_attention(cp.asarray(pair), cp.asarray(mask), weights,
                                    mask_layout="row", node=node)
        assert rel_l2(got.get(), expected) <= TOLERANCE["fp32"]
        mask5 = cp.asarray(mask).reshape(N, 1, 1, N)
        got = ta.triangle_attention(cp.asarray(pair), mask5, weights, mask_layout="row",
                                    node=node)
        assert rel_l2(got.get(), expected) <= TOLERANCE["fp32"]
    base = rng.standard_normal((2, N, N, 64)).astype(np.float32)
    view = base.swapaxes(1, 2)
    keep = convention_mask(rng, 2, N, "random")
    expected = reference.triangle_attention(view, keep, weights, mask_layout="row",
                                            node="ending")
    got = ta.triangle_attention(cp.asarray(base).swapaxes(1, 2), cp.asarray(keep), weights,
                                mask_layout="row", node="ending")
    assert got.shape == view.shape and got.flags.c_contiguous
    assert rel_l2(got.get(), expected) <= TOLERANCE["fp32"]


def test_the_weights_conventions_are_the_default(cp, rng):
    """None (the default): the weights' own mask layout and node, as the NumPy backend;
    a call overrides them."""
    base = ta.random_weights(64, 4, seed=11)
    for mask_layout, node in (("row", "ending"), ("row", "starting"), ("pair", "ending")):
        weights = dataclasses.replace(base, mask_layout=mask_layout, node=node)
        check_conventions(cp, rng, 2, 45, 64, 4, mask_layout=mask_layout, node=node,
                          weights=weights, pass_conventions=False)
        module = ta.TriangleAttention(weights)
        pair = rng.standard_normal((2, 45, 45, 64)).astype(np.float32)
        mask = convention_mask(rng, 2, 45, "random")
        expected = reference.triangle_attention(pair, mask, weights, mask_layout="pair",
                                                node="starting")
        got = module(cp.asarray(pair), cp.asarray(mask), mask_layout="pair", node="starting")
        assert rel_l2(got.get(), expected) <= TOLERANCE["fp32"]


def test_ending_af3_is_refused_naming_the_numpy_backend(cp, rng):
    weights = ta.random_weights(64, 4, seed=1)
    pair = cp.zeros((1, 8, 8, 64), cp.float32)
    with pytest.raises(ValueError, match="ending_af3.*NumPy backend"):
        ta.triangle_attention(pair, None, weights, node="ending_af3")
    with pytest.raises(ValueError, match="node must be one of"):
        ta.triangle_attention(pair, None, weights, node="end")
    with pytest.raises(ValueError, match="mask_layout must be one of"):
        ta.triangle_attention(pair, None, weights, mask_layout="rows")
    mask5 = cp.ones((1, 8, 1, 1, 8), cp.bool_)
    with pytest.raises(ValueError, match=r"mask must have shape \(1, 8, 8\)"):
        ta.triangle_attention(pair, mask5, weights, mask_layout="pair")


def test_row_mask_launches_and_plans(cp, rng):
    """A row-masked forward packs the key bits (row_mask_pack) and folds no mask into the
    bias; the pair layout's plan is unchanged by the conventions' code."""
    weights = ta.random_weights(64, 4, seed=2)
    module = ta.TriangleAttention(weights)
    pair = cp.asarray(rng.standard_normal((2, 61, 61, 64)).astype(np.float32))
    mask = cp.asarray(convention_mask(rng, 2, 61, "random"))
    row = gpu.forward.Forward(module._dw, pair, mask, "zero", None, "fp32",
                              conventions=("row", "starting"))
    assert row.plan.row_mask is not None and not row.plan.out_transposed
    plain = gpu.forward.Forward(module._dw, pair, mask, "zero", None, "fp32")
    assert plain.plan.row_mask is None and not plain.plan.out_transposed
    ending = gpu.forward.Forward(module._dw, pair, mask, "zero", None, "fp32",
                                 conventions=("pair", "ending"))
    assert ending.plan.row_mask is None and ending.plan.out_transposed
