"""Finite float32 inputs up to float32's range: the result is correct, or a clear error;
never a silently wrong answer. LayerNorm is where magnitude matters: the sum of squared
deviations of a row of D values overflows float32 from |x| ~ 1e18 (D = 128) unless the
row is scaled before squaring. The NumPy backend is covered in tests/test_reference.py;
this holds the GPU path (every precision) to the same, against float64.
"""
from __future__ import annotations

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import reference
from helpers import rel_l2

# Relative L2 error against float64 allowed per precision (as for ordinary inputs: the
# LayerNorm output has the same scale whatever the input's).
TOLERANCE = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("magnitude", [1e12, 1e20, 1e30, 3e37])
def test_gpu_huge_inputs_are_right_or_refused(precision, magnitude):
    import cupy as cp

    rng = np.random.default_rng(5)
    weights = ta.random_weights(128, 4, seed=5)
    pair = (rng.uniform(-1, 1, (1, 37, 37, 128)) * magnitude).astype(np.float32)
    pair[0, 0, :3] = rng.standard_normal((3, 128))  # ordinary rows in the same input
    assert np.isfinite(pair).all()
    want = reference.triangle_attention(pair.astype(np.float64), None, weights)
    try:
        got = ta.TriangleAttention(weights)(cp.asarray(pair), precision=precision).get()
    except ValueError as exc:  # a clear refusal is acceptable; it must say why
        assert "pair" in str(exc) and ("range" in str(exc) or "magnitude" in str(exc)), exc
        return
    assert rel_l2(got, want) < TOLERANCE[precision], (precision, magnitude)
