"""Argument checks shared by every backend: one place that words the errors."""
from __future__ import annotations

FULLY_MASKED_POLICIES = ("zero", "nan")


def check_fully_masked(fully_masked) -> str:
    if fully_masked not in FULLY_MASKED_POLICIES:
        raise ValueError(
            f"fully_masked must be one of {FULLY_MASKED_POLICIES}, got {fully_masked!r}")
    return fully_masked


def pair_geometry(pair_shape, pair_dim: int, arg: str = "pair"):
    """(B, N, batched) of a (B, N, N, D) or (N, N, D) shape, or a ValueError naming `arg`."""
    shape = tuple(pair_shape)
    if len(shape) not in (3, 4):
        raise ValueError(
            f"{arg} must have shape (B, N, N, D) or (N, N, D); got {len(shape)} dimensions "
            f"{shape}")
    batched = len(shape) == 4
    B = shape[0] if batched else 1
    N, N2, D = shape[-3:]
    if N != N2:
        raise ValueError(f"{arg} must be square in its two middle axes (N, N); got {shape}")
    if D != pair_dim:
        raise ValueError(
            f"{arg}'s last axis must equal the weights' pair_dim {pair_dim}; got {D} "
            f"(shape {shape})")
    if B < 1 or N < 1:
        raise ValueError(f"{arg} must have B >= 1 and N >= 1; got shape {shape}")
    return B, N, batched


def check_mask_shape(mask_shape, B: int, N: int, batched: bool, arg: str = "mask"):
    shape = tuple(mask_shape)
    expected = (B, N, N) if batched else (N, N)
    if shape != expected:
        raise ValueError(f"{arg} must have shape {expected} to match pair; got {shape}")


def check_mask_dtype(dtype, arg: str = "mask"):
    if dtype.kind not in "biuf":
        raise TypeError(f"{arg} must be bool, integer or float (0 = masked); got dtype {dtype}")
