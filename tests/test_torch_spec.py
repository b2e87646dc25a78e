"""Our PyTorch statement of the spec (`tests/torch_spec.py`) against the reference module file
(``reference_module.py``, found by `spec.find_spec_file`).

Both run in float64 on the CPU with the same random weights (LayerNorm affine and every bias
random, so no parameter can hide) on B = 1 and 2, several N, head dims 8 to 64, and masks
with fully-masked queries. They must agree to float64 rounding, with NaN at exactly the
same positions (the fully-masked queries). Skipped, naming the paths looked at, where the
reference file is not available.
"""
from __future__ import annotations

import numpy as np
import pytest

from spec import load_reference_file_module, load_spec_module

TOL = 1e-13
# (B, N, D, h): N on and off powers of two, head dims 8, 16, 32, 64.
CASES = [(1, 1, 32, 4), (2, 5, 32, 2), (2, 17, 64, 4), (1, 33, 128, 4), (2, 40, 128, 2)]


def random_module(module_file, D, h, seed):
    """`module_file.TriangleSelfAttention(D, h)` in float64 with every parameter random."""
    import torch

    torch.manual_seed(seed)
    model = module_file.TriangleSelfAttention(D, h).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    return model


def mask_with_fully_masked_queries(rng, B, N):
    """(B, N, N) float64: ~25% of keys masked; for N >= 2 query N-1 of batch 0 has no key."""
    keep = rng.random((B, N, N)) < 0.75
    keep[:, :, 0] |= N == 1  # N = 1: keep the one key
    if N >= 2:
        keep[0, N - 1, :] = False
        keep[:, 0, 0] = True
    return keep.astype(np.float64)


@pytest.mark.parametrize("B,N,D,h", CASES)
def test_ours_equals_the_reference_file_in_float64(rng, B, N, D, h):
    import torch

    reference = load_reference_file_module()  # skips where the file is not available
    ours = load_spec_module()
    seed = int(rng.integers(2**31))
    ours_model = random_module(ours, D, h, seed)
    reference_model = random_module(reference, D, h, seed)
    # Same names, shapes and (from the same seed) values on both sides.
    ours_state, reference_state = ours_model.state_dict(), reference_model.state_dict()
    assert list(ours_state) == list(reference_state)
    for name, value in reference_state.items():
        assert torch.equal(ours_state[name], value), name

    pair = torch.from_numpy(rng.standard_normal((B, N, N, D)) * 2.0 + 0.5)  # (B, N, N, D)
    mask = torch.from_numpy(mask_with_fully_masked_queries(rng, B, N))     # (B, N, N)
    with torch.no_grad():
        expected = reference_model(pair, mask).numpy()
        actual = ours_model(pair, mask).numpy()

    assert actual.shape == expected.shape == (B, N, N, D)
    assert actual.dtype == expected.dtype == np.float64
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan)
    fully = ~mask.numpy().astype(bool).any(axis=-1)  # (B, N) queries j with no key
    assert np.array_equal(nan, np.broadcast_to(fully[:, None, :, None], nan.shape))
    assert (N < 2) or nan.any()  # the fully-masked query is exercised
    keep = ~nan
    assert np.isfinite(actual[keep]).all()
    err = np.linalg.norm(actual[keep] - expected[keep]) / np.linalg.norm(expected[keep])
    assert err < TOL, f"relative L2 error {err:.3e}"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_ours_equals_the_reference_file_bit_for_bit_in_low_precision(rng, dtype_name):
    """The same operations in the same order: equal to the bit in float32 and bf16 too, so
    the GPU tests' "at most twice PyTorch's error in the same precision" means the same
    with either module."""
    import torch

    reference = load_reference_file_module()
    ours = load_spec_module()
    dtype = getattr(torch, dtype_name)
    B, N, D, h = 2, 33, 64, 4
    seed = int(rng.integers(2**31))
    ours_model = random_module(ours, D, h, seed).to(dtype)
    reference_model = random_module(reference, D, h, seed).to(dtype)
    pair = torch.from_numpy(rng.standard_normal((B, N, N, D))).to(dtype)   # (B, N, N, D)
    mask = torch.from_numpy(mask_with_fully_masked_queries(rng, B, N))     # (B, N, N)
    with torch.no_grad():
        expected = reference_model(pair, mask).float().numpy()
        actual = ours_model(pair, mask).float().numpy()
    assert np.array_equal(actual, expected, equal_nan=True)
    assert np.isnan(expected).any() and not np.isnan(expected).all()


def test_default_initialisation_draws_the_reference_files_numbers():
    """Under one seed both modules initialise alike (weights/default.h5's recipe relies on
    it), in the reference's parameter order."""
    import torch

    reference = load_reference_file_module()
    ours = load_spec_module()
    torch.manual_seed(0)
    reference_state = reference.TriangleSelfAttention(128, 4).state_dict()
    torch.manual_seed(0)
    ours_state = ours.TriangleSelfAttention(128, 4).state_dict()
    assert list(ours_state) == list(reference_state)
    for name, value in reference_state.items():
        assert torch.equal(ours_state[name], value), name


def test_ours_names_the_bad_argument():
    load_spec_module()
    import torch_spec

    with pytest.raises(ValueError, match="pair_dim must be divisible by num_heads"):
        torch_spec.TriangleSelfAttention(30, 4)
    model = torch_spec.TriangleSelfAttention(8, 2)
    import torch

    with pytest.raises(ValueError, match=r"pair_repr must be \(B, N, N, D\)"):
        model(torch.zeros(1, 3, 4, 8), torch.ones(1, 3, 4))
