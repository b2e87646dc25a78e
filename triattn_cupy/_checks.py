"""Argument checks shared by every backend: one place that words the errors.

Argument checks live in one module per layer: here those every backend shares (the
fully-masked policy, the pair's geometry, the mask's dtype); the conventions' own
(mask_layout, node, a mask's shape under its layout) in triattn_cupy.conventions, beside
what they mean; the GPU engine's (CuPy present, sizes and element types the kernels take,
arrays on the weights' device, precision modes) in triattn_cupy.gpu.checks."""
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


def check_mask_dtype(dtype, arg: str = "mask"):
    if dtype.kind not in "biuf":
        raise TypeError(f"{arg} must be bool, integer or float (0 = masked); got dtype {dtype}")
