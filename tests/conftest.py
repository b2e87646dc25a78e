"""Test-suite wiring: GPU tests skip with a reason where there is no GPU, slow tests are
opt-in (``--run-slow``), and `rng` is a freshly seeded generator whose seed is printed.

Markers ``gpu`` and ``slow`` are declared in setup.cfg. Nothing here touches CuPy unless a
collected test is marked ``gpu``.
"""
from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

SEED_ENV = "TRIATTN_TEST_SEED"


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (long sweeps)")


def _no_gpu_reason():
    """None where a CUDA GPU is usable through CuPy, else why not ("no CUDA GPU: ...")."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return f"no CUDA GPU: CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        available = cupy.cuda.is_available()
    except Exception as exc:
        return f"no CUDA GPU: cupy.cuda.is_available() raised {type(exc).__name__}: {exc}"
    if not available:
        return "no CUDA GPU: cupy.cuda.is_available() is False"
    return None


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: CuPy only for selected tests
def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items:  # import CuPy only when a GPU test was collected
        reason = _no_gpu_reason()
        if reason:
            skip = pytest.mark.skip(reason=reason)
            for item in gpu_items:
                item.add_marker(skip)
    if not config.getoption("--run-slow"):
        skip = pytest.mark.skip(reason="slow: run with --run-slow")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(skip)


@pytest.fixture
def rng():
    """A NumPy Generator seeded afresh for each test; the seed is printed (pytest shows it
    with a failure) and can be forced with the environment variable TRIATTN_TEST_SEED."""
    seed = int(os.environ.get(SEED_ENV) or secrets.randbits(64))
    print(f"rng seed: {seed} (reproduce with {SEED_ENV}={seed})")
    return np.random.default_rng(seed)
