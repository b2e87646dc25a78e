"""Finite float32 inputs up to float32's range: the result is correct, or a clear error;
never a silently wrong answer. LayerNorm is where magnitude matters: the sum of squared
deviations of a row of D values overflows float32 from |x| ~ 1e18 (D = 128) unless the
row is scaled before squaring (project_math.cuh, LayerNorm's range). The NumPy backend is
covered in tests/test_reference.py; this holds every GPU route and precision to the same,
against float64, with huge and ordinary rows in one input (and in one block of rows).
"""
from __future__ import annotations

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu, reference
from helpers import rel_l2

# Relative L2 error against float64 allowed per precision (as for ordinary inputs: the
# LayerNorm output has the same scale whatever the input's).
TOLERANCE = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}
MAGNITUDES = [1e12, 1e20, 1e30, 3e37]
D, HEADS = 128, 4  # a pair dim and head count every route serves (wgmma: head dim 32)

_ROUTE_CASES = [(name, precision) for name in gpu.routes.ROUTES
                for precision in gpu.routes.route_parts(name)["precisions"]]


def _skip_unless_runs_here(cp, name):
    attention = gpu.routes.route_parts(name)["attention"]
    tiles = gpu.routes.route_parts(name)["project"] == "persistent"
    cc = int(cp.cuda.Device().compute_capability)
    if (attention.startswith("wgmma") or tiles) and cc != 90:
        pytest.skip("wgmma runs on compute capability 9.0 only")
    if attention != "ffma" and cc < 80:
        pytest.skip("tensor cores need compute capability 8.0")


def _compare(cp, pair, weights, precision, route=None):
    """The GPU forward of `pair` against the NumPy backend in float64: within the precision's
    bound, or refused with a ValueError that names the pair and its range."""
    assert np.isfinite(pair).all()
    want = reference.triangle_attention(pair.astype(np.float64), None, weights)
    try:
        got = ta.TriangleAttention(weights)(cp.asarray(pair), precision=precision,
                                            route=route).get()
    except ValueError as exc:  # a clear refusal is acceptable; it must say why
        assert "pair" in str(exc) and ("range" in str(exc) or "magnitude" in str(exc)), exc
        return
    err = rel_l2(got, want)
    assert err < TOLERANCE[precision], (route, precision, err)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("magnitude", MAGNITUDES)
def test_gpu_huge_inputs_are_right_or_refused(precision, magnitude):
    import cupy as cp

    rng = np.random.default_rng(5)
    weights = ta.random_weights(D, HEADS, seed=5)
    pair = (rng.uniform(-1, 1, (1, 37, 37, D)) * magnitude).astype(np.float32)
    pair[0, 0, :3] = rng.standard_normal((3, D))  # ordinary rows in the same input
    _compare(cp, pair, weights, precision)


def _mixed_rows(rng, B, N):
    """Rows of every magnitude side by side: each row (b, i, j) ordinary or scaled by one of
    MAGNITUDES, some off-centre (mean far from 0: the mean's sum overflows first), one at
    float32's largest finite value."""
    pair = rng.standard_normal((B, N, N, D))
    scale = rng.choice([1.0, 1.0] + MAGNITUDES, size=(B, N, N, 1))
    offset = rng.choice([0.0, 0.0, 3.0], size=(B, N, N, 1))
    pair = (pair + offset) / (np.abs(pair + offset).max(axis=-1, keepdims=True)) * scale
    pair[0, 0, 0] = np.linspace(-1, 1, D) * np.finfo(np.float32).max
    return pair.astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("name,precision", _ROUTE_CASES, ids=lambda x: str(x))
def test_every_route_huge_and_ordinary_rows(name, precision):
    import cupy as cp

    _skip_unless_runs_here(cp, name)
    rng = np.random.default_rng(26)
    weights = ta.random_weights(D, HEADS, seed=26)
    for B, N in [(2, 45), (1, 67)]:  # sizes off the tiles, B > 1
        _compare(cp, _mixed_rows(rng, B, N), weights, precision, route=name)

