"""Each batch's key extent under the mask (kernels/key_extent.cu) and the attention's key
loops stopping there: the extent against NumPy for every mask layout, and forwards with
and without it equal in every mode and on every attention path: to the bit where a tile's
products are added to the output in fp32 (a tile past the extent is masked for every
query, so it adds exactly zero), to the tensor cores' truncation where they are
accumulated in the tensor cores (the tf32 and bf16 wgmma kernels)."""
from __future__ import annotations

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu
from helpers import rel_l2

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy

    return cupy


def padded_masks(rng, B, N):
    """bool [B, N, N]: batch 0 a crop padded from 0.9 N (padded queries keep key 0, as
    the benchmark's), batch 1 random keys up to a random last one, batch 2 (and on)
    every key masked."""
    keep = np.zeros((B, N, N), bool)
    L = int(0.9 * N)
    keep[0, :L, :L] = True
    keep[0, L:, 0] = True
    if B > 1:
        last = int(rng.integers(N // 2, N - 1))
        keep[1, :, :last + 1] = rng.random((N, last + 1)) > 0.5
        keep[1, rng.integers(N), last] = True
    return keep


def extent_of(keep):
    """NumPy's key extent: 1 + the largest key kept by any query, 0 for none."""
    kept = keep.any(axis=-2)  # [B, N keys]
    return np.where(kept.any(-1), kept.shape[-1] - np.argmax(kept[:, ::-1], axis=-1), 0)


@pytest.mark.parametrize("layout", ["bool", "float32", "float16", "int8", "int64",
                                    "transposed", "broadcast"])
def test_key_extent_matches_numpy(cp, rng, layout):
    B, N, D, h = 3, 530, 64, 4
    keep = padded_masks(rng, B, N)
    if layout == "transposed":  # a non-contiguous view: the same values, strides swapped
        mask = cp.asarray(np.ascontiguousarray(keep.transpose(0, 2, 1))).transpose(0, 2, 1)
    elif layout == "broadcast":  # one mask for every batch, stride 0 over B
        keep = np.broadcast_to(keep[:1], keep.shape)
        mask = cp.broadcast_to(cp.asarray(keep[:1]), keep.shape)
    else:
        mask = cp.asarray(keep.astype(layout))
    module = ta.TriangleAttention(ta.random_weights(D, h, seed=1))
    pair = cp.asarray(rng.standard_normal((B, N, N, D)).astype(np.float32))
    forward = gpu.forward.Forward(module._dw, pair, mask, "zero", None, "tf32")
    plan = forward.plan
    assert plan.key_extent is not None
    extent = cp.ndarray((B,), cp.int32, memptr=forward._scratch + plan.extent_offset)
    extent.fill(-7)  # poisoned: the memset and the kernel must both run
    forward.project()
    forward.attention()
    np.testing.assert_array_equal(extent.get(), extent_of(keep))


def test_no_extent_without_a_mask_or_below_its_n(cp, rng):
    module = ta.TriangleAttention(ta.random_weights(64, 4, seed=1))
    for N, mask in ((530, None), (gpu.routes.KEY_EXTENT_MIN_N - 1, True)):
        pair = cp.zeros((1, N, N, 64), cp.float32)
        m = None if mask is None else cp.ones((1, N, N), bool)
        assert gpu.forward.Forward(module._dw, pair, m, "zero", None, "fp32").plan.key_extent is None


# (D, h): head dim 32 (wgmma on the H200 from N = 129), 16 (mma.sync), 12 (FFMA)
@pytest.mark.parametrize("D,h", [(128, 4), (64, 4), (36, 3)])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("fully_masked", ["zero", "nan"])
def test_stopping_at_the_key_extent_changes_no_bit(cp, rng, monkeypatch, D, h, precision,
                                                   fully_masked):
    B, N = 3, 517
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = cp.asarray(rng.standard_normal((B, N, N, D)).astype(np.float32))
    keep = padded_masks(rng, B, N)
    keep[0, 3, :] = False  # and a fully masked query in a batch with an extent
    mask = cp.asarray(keep)
    outs = []
    for min_n in (gpu.routes.KEY_EXTENT_MIN_N, 1 << 30):  # with the extent, then without
        monkeypatch.setattr(gpu.routes, "KEY_EXTENT_MIN_N", min_n)
        module = ta.TriangleAttention(weights)
        out = cp.full(pair.shape, np.nan, np.float32)
        module(pair, mask, out=out, fully_masked=fully_masked, precision=precision)
        plan, = module._dw.plans.values()
        assert (plan.key_extent is not None) == (min_n <= N)
        outs.append(out.get())
    with_extent, without = outs
    assert np.array_equal(np.isnan(with_extent), np.isnan(without))
    if fully_masked == "zero":
        assert np.isfinite(with_extent).all()
    chained = precision != "fp32" and "wgmma" in plan.attention_kernel.name
    if not chained:  # the skipped tiles' zeros added in fp32: nothing changes
        np.testing.assert_array_equal(with_extent, without)  # (NaN where NaN, -0 == +0)
    else:
        # The tf32 and bf16 wgmma kernels add each tile's P V onto O inside the tensor cores,
        # whose accumulation truncates: a tile of zeros still moves O's last bits (seen: 0.3%
        # of the elements, by up to ~3e-4 absolute). Far inside either mode's error.
        finite = np.isfinite(without)
        assert rel_l2(with_extent[finite], without[finite]) <= 1e-4
