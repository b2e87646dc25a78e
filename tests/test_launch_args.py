"""Kernel scalar arguments are converted once and reused (no GPU needed)."""
import numpy as np
import pytest

from triattn_cupy import _gpu

pytest.importorskip("cupy")


def test_scalar_arguments_are_cached_per_type_and_value():
    assert _gpu._i32(7) is _gpu._i32(7)
    assert _gpu._i32(7) is not _gpu._i64(7)  # same value, another width
    assert _gpu._f32(0.5) is _gpu._f32(0.5)
    assert _gpu._i32(np.int64(7)) is _gpu._i32(7)  # NumPy and Python ints alike


def test_scalar_arguments_keep_their_type():
    from cupy.cuda.function import CNumpyArray

    for arg in (_gpu._i32(3), _gpu._i64(-(1 << 40)), _gpu._f32(1e-5)):
        assert isinstance(arg, CNumpyArray)
