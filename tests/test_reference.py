"""The NumPy reference (`triattn_cupy.reference.triangle_attention`) against the spec module
(`tests/torch_spec.py`, run by PyTorch in float64).

Fully-masked queries: the spec returns NaN at every (b, i, j) whose mask row (b, j, :) is all
zero; ``fully_masked="nan"`` must give NaN exactly there, ``"zero"`` exactly out_proj.bias.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import rel_l2, spec_forward
from triattn_cupy import random_weights
from triattn_cupy.reference import triangle_attention

TOL64 = 1e-12
TOL32 = 1e-5
# (pair_dim D, num_heads h): head dims 8, 16, 32, 64.
DIMS = [(32, 4), (64, 4), (128, 4), (128, 2)]
BATCHES = [1, 2, 3]
SIZES = [1, 2, 5, 17, 64]


def make_pair(rng, B, N, D, dtype=np.float64):
    return rng.standard_normal((B, N, N, D)).astype(dtype)


def make_keep(rng, B, N):
    """(B, N, N) bool: ~20% of keys masked, and for N >= 2 some queries j fully masked
    (always (0, N-1)); query 0 always keeps key 0, so some positions stay comparable."""
    keep = rng.random((B, N, N)) < 0.8
    if N >= 2:
        fully = rng.random((B, N)) < 0.2
        fully[:, 0] = False
        fully[0, N - 1] = True
        keep[fully] = False
    keep[:, 0, 0] = True
    return keep


def as_mask(rng, keep, kind):
    """`keep` as a mask of dtype kind: nonzero values other than 1 must also mean 'keep'."""
    if kind == "bool":
        return keep.copy()
    if kind in ("int8", "int32", "int64", "uint8"):
        return (keep * rng.integers(1, 4, keep.shape)).astype(kind)
    if kind in ("float32", "float64"):
        return (keep * rng.choice([0.5, 1.0, -2.0], keep.shape)).astype(kind)
    raise AssertionError(kind)


def fully_masked_positions(keep):
    """(B, N, N, 1) bool: output positions (b, i, j) whose query j has no key left."""
    fully = ~keep.any(axis=-1)                     # [B, N] queries j
    return np.broadcast_to(fully[:, None, :, None], keep.shape + (1,))


def check_against_spec(out, expected, keep, weights, fully_masked, tol):
    """Compare everywhere outside fully-masked queries; check the policy inside them."""
    bad = fully_masked_positions(keep)
    spec_nan = np.isnan(expected)
    # The spec's NaN are exactly the fully-masked queries (all D channels), nowhere else.
    assert np.array_equal(spec_nan, np.broadcast_to(bad, expected.shape))
    assert rel_l2(out, expected, where=~bad) < tol
    if fully_masked == "nan":
        assert np.array_equal(np.isnan(out), spec_nan)
    else:
        assert np.isfinite(out).all()
        bias = weights["out_proj.bias"].astype(out.dtype)
        where = np.broadcast_to(bad, out.shape)
        assert np.array_equal(out[where], np.broadcast_to(bias, out.shape)[where])


# ---------------------------------------------------------------------------- the helper

def test_rel_l2_never_passes_nan_inf_or_shape_mismatch():
    a = np.arange(1.0, 7.0).reshape(2, 3)
    assert rel_l2(a, a) == 0.0
    assert rel_l2(a.astype(np.float32), a) == 0.0
    assert math.isclose(rel_l2(2 * a, a), 1.0)
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[1, 2] = bad
        assert rel_l2(b, a) == math.inf
        assert rel_l2(a, b) == math.inf
        assert rel_l2(b, b) == math.inf  # NaN in both is still not a pass
    assert rel_l2(a, a[:1]) == math.inf
    assert rel_l2(a.ravel(), a) == math.inf
    assert rel_l2(np.ones(3), np.zeros(3)) == math.inf
    assert rel_l2(np.zeros(3), np.zeros(3)) == 0.0
    b = a.copy()
    b[1] = np.nan
    assert rel_l2(b, a, where=np.array([[True], [False]])) == 0.0
    with pytest.raises(ValueError, match="nothing to compare"):
        rel_l2(a, a, where=np.zeros_like(a, bool))


# ---------------------------------------------------------------------------- the sweep

@pytest.mark.parametrize("D,h", DIMS, ids=[f"D{D}h{h}" for D, h in DIMS])
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("B", BATCHES)
def test_matches_spec_float64(rng, B, N, D, h):
    weights = random_weights(D, h, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, B, N, D)
    keep = make_keep(rng, B, N)
    pair_before, keep_before = pair.copy(), keep.copy()
    expected = spec_forward(weights, pair, keep)
    out = triangle_attention(pair, keep, weights, fully_masked="nan")
    assert out.shape == pair.shape and out.dtype == np.float64
    check_against_spec(out, expected, keep, weights, "nan", TOL64)
    assert np.array_equal(pair, pair_before) and np.array_equal(keep, keep_before)


# ---------------------------------------------------------------------------- masks

@pytest.mark.parametrize("kind", ["bool", "int8", "int32", "int64", "uint8", "float32",
                                  "float64"])
@pytest.mark.parametrize("fully_masked", ["nan", "zero"])
def test_mask_dtypes_and_policies(rng, kind, fully_masked):
    B, N, D, h = 2, 17, 64, 4
    weights = random_weights(D, h, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, B, N, D)
    keep = make_keep(rng, B, N)
    mask = as_mask(rng, keep, kind)
    expected = spec_forward(weights, pair, mask)
    out = triangle_attention(pair, mask, weights, fully_masked=fully_masked)
    check_against_spec(out, expected, keep, weights, fully_masked, TOL64)


def test_default_policy_is_zero(rng):
    weights = random_weights(32, 4, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, 2, 5, 32)
    keep = make_keep(rng, 2, 5)
    assert np.array_equal(triangle_attention(pair, keep, weights),
                          triangle_attention(pair, keep, weights, fully_masked="zero"))


@pytest.mark.parametrize("fully_masked", ["nan", "zero"])
def test_whole_batch_element_masked(rng, fully_masked):
    B, N, D, h = 2, 5, 32, 4
    weights = random_weights(D, h, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, B, N, D)
    keep = make_keep(rng, B, N)
    keep[1] = False
    expected = spec_forward(weights, pair, keep)
    out = triangle_attention(pair, keep, weights, fully_masked=fully_masked)
    check_against_spec(out, expected, keep, weights, fully_masked, TOL64)
    if fully_masked == "nan":
        assert np.isnan(out[1]).all()
    else:
        assert np.array_equal(out[1], np.broadcast_to(weights["out_proj.bias"], out[1].shape))


@pytest.mark.parametrize("N", [1, 5, 17])
def test_mask_none_means_all_ones(rng, N):
    B, D, h = 2, 32, 4
    weights = random_weights(D, h, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, B, N, D)
    expected = spec_forward(weights, pair, np.ones((B, N, N)))
    out = triangle_attention(pair, None, weights, fully_masked="nan")
    assert np.isfinite(out).all()
    assert rel_l2(out, expected) < TOL64
    assert np.array_equal(out, triangle_attention(pair, np.ones((B, N, N), bool), weights))


# ---------------------------------------------------------------------------- shapes, dtypes

@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no-mask"])
def test_unbatched(rng, with_mask):
    N, D, h = 17, 64, 4
    weights = random_weights(D, h, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, 1, N, D)[0]                     # (N, N, D)
    keep = make_keep(rng, 1, N)[0] if with_mask else None  # (N, N)
    expected = spec_forward(weights, pair, keep)
    out = triangle_attention(pair, keep, weights, fully_masked="nan")
    assert out.shape == (N, N, D)
    if with_mask:
        check_against_spec(out[None], expected[None], keep[None], weights, "nan", TOL64)
    else:
        assert rel_l2(out, expected) < TOL64
    batched = triangle_attention(pair[None], None if keep is None else keep[None], weights,
                                 fully_masked="nan")
    assert np.array_equal(out, batched[0], equal_nan=True)


@pytest.mark.parametrize("D,h", [(32, 4), (128, 4), (128, 2)], ids=["d8", "d32", "d64"])
@pytest.mark.parametrize("fully_masked", ["nan", "zero"])
def test_float32_path(rng, D, h, fully_masked):
    B, N = 2, 17
    weights = random_weights(D, h, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, B, N, D, np.float32)
    keep = make_keep(rng, B, N)
    expected = spec_forward(weights, pair, keep)          # float64 of the same float32 input
    out = triangle_attention(pair, keep, weights, fully_masked=fully_masked, dtype=np.float32)
    assert out.dtype == np.float32 and out.shape == pair.shape
    check_against_spec(out, expected, keep, weights, fully_masked, TOL32)


def test_float32_input_computed_in_float64_by_default(rng):
    weights = random_weights(64, 4, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, 2, 5, 64, np.float32)
    keep = make_keep(rng, 2, 5)
    out = triangle_attention(pair, keep, weights, fully_masked="nan")
    assert out.dtype == np.float64
    check_against_spec(out, spec_forward(weights, pair, keep), keep, weights, "nan", TOL64)


@pytest.mark.parametrize("batched", [True, False])
def test_rows_spot_check_matches_full(rng, batched):
    B, N, D, h = 2, 17, 64, 4
    weights = random_weights(D, h, seed=int(rng.integers(2**32)))
    pair = make_pair(rng, B, N, D)
    keep = make_keep(rng, B, N)
    if not batched:
        pair, keep = pair[0], keep[0]
    rows = [16, 0, 5, 5]                                   # any order, repeats allowed
    full = triangle_attention(pair, keep, weights, fully_masked="nan")
    part = triangle_attention(pair, keep, weights, fully_masked="nan", rows=rows)
    expected = full[:, rows] if batched else full[rows]
    assert part.shape == expected.shape
    assert np.array_equal(np.isnan(part), np.isnan(expected))
    assert rel_l2(part, expected, where=~np.isnan(expected)) < TOL64


# ---------------------------------------------------------------------------- input errors

@pytest.fixture
def small():
    weights = random_weights(32, 4, seed=1)
    pair = np.random.default_rng(2).standard_normal((2, 5, 5, 32))
    return weights, pair


@pytest.mark.parametrize("shape", [(5, 32), (5, 5), (1, 2, 5, 5, 32), (32,)])
def test_rejects_wrong_rank(small, shape):
    weights, _ = small
    with pytest.raises(ValueError, match=r"pair must have shape \(B, N, N, D\) or \(N, N, D\)"):
        triangle_attention(np.zeros(shape), None, weights)


def test_rejects_non_square(small):
    weights, _ = small
    with pytest.raises(ValueError, match=r"pair must be square .*\(2, 5, 4, 32\)"):
        triangle_attention(np.zeros((2, 5, 4, 32)), None, weights)


@pytest.mark.parametrize("batched", [True, False])
def test_rejects_pair_dim_mismatch(small, batched):
    weights, _ = small
    shape = (2, 5, 5, 16) if batched else (5, 5, 16)
    with pytest.raises(ValueError, match=r"last axis must equal the weights' pair_dim 32; got 16"):
        triangle_attention(np.zeros(shape), None, weights)


@pytest.mark.parametrize("mask_shape,expected", [
    ((2, 5, 4), r"\(2, 5, 5\)"), ((5, 5), r"\(2, 5, 5\)"), ((1, 5, 5), r"\(2, 5, 5\)"),
    ((2, 5, 5, 1), r"\(2, 5, 5\)"),
])
def test_rejects_mask_shape_mismatch(small, mask_shape, expected):
    weights, pair = small
    with pytest.raises(ValueError, match=rf"mask must have shape {expected} to match pair"):
        triangle_attention(pair, np.ones(mask_shape, bool), weights)


def test_rejects_batched_mask_for_unbatched_pair(small):
    weights, pair = small
    with pytest.raises(ValueError, match=r"mask must have shape \(5, 5\) to match pair; got \(1, 5, 5\)"):
        triangle_attention(pair[0], np.ones((1, 5, 5), bool), weights)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, object, "U1"])
def test_rejects_non_real_mask(small, dtype):
    weights, pair = small
    mask = np.ones((2, 5, 5), dtype)
    with pytest.raises(TypeError, match=r"mask must be bool, integer or float .*got dtype"):
        triangle_attention(pair, mask, weights)


@pytest.mark.parametrize("policy", ["nans", "Zero", None, 0, ""])
def test_rejects_bad_fully_masked(small, policy):
    weights, pair = small
    with pytest.raises(ValueError, match=r"fully_masked must be one of \('zero', 'nan'\)"):
        triangle_attention(pair, None, weights, fully_masked=policy)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.complex128])
def test_rejects_bad_compute_dtype(small, dtype):
    weights, pair = small
    with pytest.raises(ValueError, match=r"dtype must be float32 or float64"):
        triangle_attention(pair, None, weights, dtype=dtype)


def test_a_16_bit_pair_gets_its_own_dtype_back(small):
    """float16 (and ml_dtypes' bfloat16) in, the same dtype out, computed in `dtype` from
    the pair's values."""
    weights, pair = small
    half = pair.astype(np.float16)
    expected = triangle_attention(half.astype(np.float64), None, weights)
    got = triangle_attention(half, None, weights)
    assert got.dtype == np.float16
    assert np.array_equal(got, expected.astype(np.float16))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    got = triangle_attention(pair.astype(ml_dtypes.bfloat16), None, weights, dtype=np.float32)
    assert got.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", [np.int64, bool, np.complex128])
def test_rejects_non_float_pair(small, dtype):
    weights, pair = small
    with pytest.raises(TypeError, match=r"pair must be a float array, got dtype"):
        triangle_attention(pair.astype(dtype), None, weights)


# ---------------------------------------------------------------------------- saturated gates

def test_sigmoid_keeps_its_precision_far_out():
    from triattn_cupy.reference import _sigmoid

    x = np.array([-700.0, -70.0, -37.5, -20.0, 0.0, 20.0, 70.0, 700.0])
    want = np.array([1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))
                     for v in x])
    got = _sigmoid(x)
    assert np.all(got > 0) and np.all(got <= 1)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    assert abs(_sigmoid(np.float64(-70.0)) / 3.975449735908647e-31 - 1) < 1e-12


@pytest.mark.parametrize("gate_bias", [-20.0, -70.0])
def test_saturated_gates_match_spec(rng, gate_bias):
    """Every gate near 0 and no out bias: the output is tiny and all of it comes through
    the gate (the GPU tests hold every mode to this reference there)."""
    from triattn_cupy import Weights

    base = random_weights(32, 2, seed=int(rng.integers(2**32)))
    params = dict(base.params)
    params["gate.bias"] = np.full_like(params["gate.bias"], gate_bias)
    params["out_proj.bias"] = np.zeros_like(params["out_proj.bias"])
    weights = Weights(base.pair_dim, base.num_heads, base.layer_norm_eps, params)
    pair = make_pair(rng, 1, 9, 32)
    keep = make_keep(rng, 1, 9)
    expected = spec_forward(weights, pair, keep)
    out = triangle_attention(pair, keep, weights, fully_masked="nan")
    assert np.nanmax(np.abs(out)) > 0  # not flushed
    check_against_spec(out, expected, keep, weights, "nan", TOL64)


@pytest.mark.parametrize("magnitude", [1e12, 1e20, 1e30, 3e38])
def test_layer_norm_of_huge_float32_inputs(rng, magnitude):
    """Finite float32 inputs up to float32's range: the variance is formed after scaling,
    so the result matches float64 instead of overflowing (relative error 0.81 at 1e20
    without it). A row of small values beside the huge ones keeps the plain formula."""
    weights = random_weights(32, 4, seed=3)
    pair = rng.uniform(-1, 1, (2, 5, 5, 32)) * magnitude
    pair[0, 0, 0] = rng.standard_normal(32)  # an ordinary row in the same input
    pair32 = pair.astype(np.float32)
    assert np.isfinite(pair32).all()
    got = triangle_attention(pair32, None, weights, dtype=np.float32)
    want = triangle_attention(pair32.astype(np.float64), None, weights, dtype=np.float64)
    assert np.isfinite(got).all()
    assert rel_l2(got, want) < TOL32


def test_layer_norm_of_ordinary_inputs_is_unchanged(rng):
    """Rows below the rescaling threshold take the textbook formula bit for bit."""
    from triattn_cupy.reference import layer_norm

    x = rng.standard_normal((3, 7, 16)).astype(np.float32) * 1e6
    w = rng.standard_normal(16).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    plain = (x - mean) / np.sqrt(var + 1e-5) * w + b
    assert np.array_equal(layer_norm(x, w, b, 1e-5), plain)


# --- LayerNorm of narrow rows: constant across D, or nearly ------------------------------

def _layer_norm_params(rng, D, dtype):
    return (rng.standard_normal(D).astype(dtype), rng.standard_normal(D).astype(dtype))


@settings(max_examples=200, deadline=None, database=None)
@given(value=st.floats(allow_nan=False, allow_infinity=False, width=32),
       D=st.sampled_from([1, 2, 3, 32, 128, 129]),
       dtype=st.sampled_from([np.float32, np.float64]),
       eps=st.sampled_from([1e-5, 1e-12, 1e-3]))
def test_layer_norm_of_a_constant_row_is_its_bias(value, D, dtype, eps):
    """A row constant across D has no deviation: LayerNorm gives `bias` exactly, for every
    finite magnitude (the mean's rounding made noise of it, or NaN once eps / s**2
    underflowed)."""
    from triattn_cupy.reference import layer_norm

    weight, bias = _layer_norm_params(np.random.default_rng(D), D, dtype)
    x = np.full((2, D), value, dtype)
    got = layer_norm(x, weight, bias, eps)
    assert np.array_equal(got, np.broadcast_to(bias, x.shape)), (value, got)


@pytest.mark.parametrize("value", [7.3, 1e12, 1e16, 1e20, -3e20, 3e38])
def test_constant_pair_matches_float64_and_torch(rng, value):
    """A pair constant across D (every position): the float32 backend matches float64 (rel.
    error 4.4e-5 at 7.3, 0.13-0.16 at 1e12-1e20 before) and PyTorch's LayerNorm (float32
    where its variance does not overflow, else float64)."""
    torch = pytest.importorskip("torch")
    from triattn_cupy.reference import layer_norm

    weights = random_weights(128, 4, seed=4)
    pair = np.full((1, 6, 6, 128), value, np.float32)
    got = triangle_attention(pair, None, weights, dtype=np.float32)
    want = triangle_attention(pair.astype(np.float64), None, weights)
    assert rel_l2(got, want) < TOL32
    ln = torch.nn.LayerNorm(128, eps=weights.layer_norm_eps)
    with torch.no_grad():
        ln.weight.copy_(torch.from_numpy(weights["layer_norm.weight"]))
        ln.bias.copy_(torch.from_numpy(weights["layer_norm.bias"]))
        expected = ln(torch.from_numpy(pair)).numpy()
        if not np.isfinite(expected).all():  # torch's float32 variance overflows from ~1e19
            expected = ln.double()(torch.from_numpy(pair).double()).numpy()
    ours = layer_norm(pair, weights["layer_norm.weight"], weights["layer_norm.bias"],
                      weights.layer_norm_eps)
    assert rel_l2(ours, expected) < 1e-6


def test_one_huge_constant_position_gives_no_nan(rng):
    """One position of -3e20 across D in a 6x6x128 input gave NaN in 1408 of 4608 outputs."""
    weights = random_weights(128, 4, seed=5)
    pair = rng.standard_normal((6, 6, 128)).astype(np.float32)
    pair[2, 3] = -3e20
    got = triangle_attention(pair, None, weights, dtype=np.float32)
    want = triangle_attention(pair.astype(np.float64), None, weights)
    assert np.isfinite(got).all()
    assert rel_l2(got, want) < TOL32


@settings(max_examples=100, deadline=None, database=None)
@given(offset=st.floats(-1e30, 1e30).filter(lambda v: abs(v) > 1e-20),
       spread=st.sampled_from([1e-6, 1e-3, 1e-1]), seed=st.integers(0, 2**16))
def test_layer_norm_of_narrow_rows_matches_float64(offset, spread, seed):
    """Rows far from 0 with a small spread (offset + spread * noise): float32 LayerNorm of the
    float32 row matches float64's of the same row (the deviations, not the mean's
    rounding, make the result)."""
    from triattn_cupy.reference import layer_norm

    rng = np.random.default_rng(seed)
    weight, bias = _layer_norm_params(rng, 64, np.float64)
    x = (offset * (1 + spread * rng.standard_normal((3, 64)))).astype(np.float32)
    got = layer_norm(x, weight.astype(np.float32), bias.astype(np.float32), 1e-5)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    want = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5) \
        * weight + bias
    assert rel_l2(got, want) < 1e-5


@pytest.mark.parametrize("bad", [{"query.weight": np.zeros((4, 4))}, None, "w.h5"])
def test_weights_of_another_type_are_a_type_error(bad):
    """A non-Weights object ran into an AttributeError (weights.mask_layout); the GPU API
    says the same before it looks for a GPU."""
    import triattn_cupy as ta

    pair = np.zeros((3, 3, 16))
    with pytest.raises(TypeError, match=rf"weights must be a triattn_cupy.Weights \(see "
                                        rf"load_weights\); got {type(bad).__name__}"):
        triangle_attention(pair, None, bad)
    with pytest.raises(TypeError, match=rf"weights must be a triattn_cupy.Weights \(see "
                                        rf"load_weights\); got {type(bad).__name__}"):
        ta.TriangleAttention(bad)
    with pytest.raises(TypeError, match="weights must be a triattn_cupy.Weights or "
                                        "TriangleAttention"):
        ta.triangle_attention(pair, None, bad)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_reaches_its_row_and_its_query_only(rng, bad):
    """README: NaN or Inf at pair[b, i, j] makes NaN row (b, i) (its key j) and query i of
    every row (the pair bias of (i, j)); every other output is as without it."""
    weights = random_weights(16, 2, seed=6)
    pair = rng.standard_normal((2, 7, 7, 16))
    clean = triangle_attention(pair, None, weights)
    pair[1, 2, 4, 5] = bad
    with np.errstate(invalid="ignore"):
        out = triangle_attention(pair, None, weights)
    reached = np.zeros((2, 7, 7), bool)
    reached[1, 2, :] = reached[1, :, 2] = True
    assert np.isnan(out[reached]).all()
    np.testing.assert_allclose(out[~reached], clean[~reached], rtol=1e-12, atol=1e-12)

# ---------------------------------------------------------------------------- head width

def widened_heads(weights, factor=2):
    """Weights with heads `factor` times as wide that compute what `weights` computes: each
    head's q, k, v and gate rows followed by random rows that cannot matter (zero query and
    key rows, value rows that the output projection's zero columns drop), the query scaled
    by sqrt(factor) so that the scores' 1 / sqrt(c) is unchanged."""
    rng = np.random.default_rng(5)
    D, h, d = weights.pair_dim, weights.num_heads, weights.head_dim
    c = factor * d

    def heads(rows, extra):  # (h * d, ...) -> (h * c, ...), each head padded with `extra`
        rows = rows.reshape(h, d, *rows.shape[1:])
        pad = extra((h, c - d, *rows.shape[2:]))
        return np.concatenate([rows, pad], axis=1).reshape(h * c, *rows.shape[2:])

    zeros, noise = np.zeros, rng.standard_normal
    p = dict(weights.params)
    for name, extra, scale in (("query", zeros, math.sqrt(factor)), ("key", zeros, 1.0),
                               ("value", noise, 1.0), ("gate", noise, 1.0)):
        p[f"{name}.weight"] = heads(p[f"{name}.weight"].astype(np.float64) * scale, extra)
        p[f"{name}.bias"] = heads(p[f"{name}.bias"].astype(np.float64) * scale, extra)
    out = p["out_proj.weight"].T.astype(np.float64)                  # (h * d, D)
    p["out_proj.weight"] = heads(out, zeros).T
    return type(weights)(D, h, weights.layer_norm_eps, p, head_dim=c)


@pytest.mark.parametrize("node", ["starting", "ending", "ending_af3"])
@pytest.mark.parametrize("mask_layout", ["pair", "row"])
def test_head_width_other_than_pair_dim_over_heads(rng, node, mask_layout):
    """h x c = 2 D (the models' template stacks) computes what the equivalent h x c = D
    weights compute, in every convention, with masked keys and fully-masked rows."""
    weights = random_weights(16, 4, seed=6)
    wide = widened_heads(weights)
    assert (wide.head_dim, wide.hidden_dim) == (8, 32)
    assert wide["query.weight"].shape == (32, 16) and wide["out_proj.weight"].shape == (16, 32)
    pair = make_pair(rng, 2, 9, 16)
    keep = make_keep(rng, 2, 9)
    kwargs = dict(mask_layout=mask_layout, node=node)
    want = triangle_attention(pair, keep, weights, **kwargs)
    got = triangle_attention(pair, keep, wide, **kwargs)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert rel_l2(got, want, where=~np.isnan(want)) < 1e-6  # weights rounded to float32
    rows = [0, 5]
    assert np.array_equal(triangle_attention(pair, keep, wide, rows=rows, **kwargs),
                          np.take(got, rows, axis=1 if node == "starting" else 2))


def test_random_weights_of_the_default_head_width_are_unchanged():
    a, b = random_weights(16, 4, seed=7), random_weights(16, 4, seed=7, head_dim=4)
    assert a.head_dim == b.head_dim == 4
    for name in a.params:
        assert np.array_equal(a[name], b[name]), name


def test_weights_check_head_width_shapes():
    from triattn_cupy import Weights

    params = random_weights(16, 4, seed=8).params
    with pytest.raises(ValueError, match=r"(?s)query.weight: expected shape \(32, 16\), got "
                                         r"\(16, 16\)\n.*out_proj.weight: expected shape "
                                         r"\(16, 32\), got \(16, 16\)"):
        Weights(16, 4, 1e-5, params, head_dim=8)
    with pytest.raises(ValueError, match=r"pair_dim must be a positive multiple of num_heads "
                                         r"\(or head_dim given\); got pair_dim=10, num_heads=4"):
        Weights(10, 4, 1e-5, params)
    with pytest.raises(ValueError, match=r"must be positive; got pair_dim=16, num_heads=4, "
                                         r"head_dim=0"):
        Weights(16, 4, 1e-5, params, head_dim=0)
