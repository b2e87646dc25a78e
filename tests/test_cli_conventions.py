"""triattn-infer with weights that carry a model's conventions (Weights.mask_layout,
Weights.node): the run computes what the NumPy backend computes with those weights, and a
row mask may be stored as the models' (B, N, 1, 1, N)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from triattn_cupy.cli import io as cli_io
from triattn_cupy.hdf5 import save_weights
from cli_support import (D, assert_same, cli, expected_output, make_pair, read_output,  # noqa: F401
                         weights, write_h5)


def _row_mask(rng, B, N):
    keep = rng.random((B, N, N)) > 0.3
    keep[:, 1, :] = False  # a row without keys
    return keep


@pytest.mark.parametrize("node", ["starting", "ending"])
def test_row_layout_weights_and_the_models_mask_shape(weights, tmp_path, rng, node):
    model = dataclasses.replace(weights, mask_layout="row", node=node)
    path = tmp_path / "model.h5"
    save_weights(model, path)
    B, N = 2, 9
    pair = make_pair(rng, B, N, N)
    keep = _row_mask(rng, B, N)
    src = tmp_path / "in"
    src.mkdir()
    np.savez(src / "square.npz", pair=pair, mask=keep)
    np.savez(src / "broadcast.npz", pair=pair, mask=keep.reshape(B, N, 1, 1, N).astype(np.int8))
    write_h5(src / "broadcast_h5.h5", pair=pair, mask=keep.reshape(B, N, 1, 1, N))
    assert cli(path, tmp_path / "out", src) == 0
    expected = expected_output(model, pair, keep)
    for name in ("square", "broadcast", "broadcast_h5"):
        got, _ = read_output(tmp_path / "out" / f"{name}.h5")
        assert_same(got, expected)


def test_the_broadcast_mask_needs_the_row_layout(weights, tmp_path, rng):
    B, N = 1, 7
    path = tmp_path / "in.npz"
    np.savez(path, pair=make_pair(rng, B, N, N), mask=np.ones((B, N, 1, 1, N), bool))
    with pytest.raises(cli_io.InputError, match=r"mask must have shape \(1, 7, 7\) to match"):
        cli_io.read_input(str(path), "npz", pair_dim=D)
    loaded = cli_io.read_input(str(path), "npz", pair_dim=D, mask_layout="row")
    assert loaded.mask.shape == (B, N, N) and loaded.mask.all()
    unbatched = tmp_path / "one.npz"
    np.savez(unbatched, pair=make_pair(rng, N, N), mask=np.ones((N, 1, 1, N), bool))
    assert cli_io.read_input(str(unbatched), "npz", pair_dim=D,
                             mask_layout="row").mask.shape == (N, N)
    # pair-layout weights: the file fails with the shape in its message
    spec = tmp_path / "spec.h5"
    save_weights(weights, spec)
    assert cli(spec, tmp_path / "out", path) != 0


@pytest.mark.gpu
@pytest.mark.parametrize("node", ["starting", "ending"])
def test_gpu_backend_computes_the_weights_conventions(weights, tmp_path, rng, node):
    from triattn_cupy import gpu_available, reference
    from helpers import rel_l2

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    model = dataclasses.replace(weights, mask_layout="row", node=node)
    path = tmp_path / "model.h5"
    save_weights(model, path)
    B, N = 2, 45
    pair = make_pair(rng, B, N, N)
    keep = _row_mask(rng, B, N)
    src = tmp_path / "in"
    src.mkdir()
    np.savez(src / "x.npz", pair=pair, mask=keep.reshape(B, N, 1, 1, N))
    assert cli(path, tmp_path / "out", src, device="gpu") == 0
    got, attrs = read_output(tmp_path / "out" / "x.h5")
    assert attrs["device"].startswith("GPU")
    assert rel_l2(got, reference.triangle_attention(pair, keep, model)) < 1e-5
