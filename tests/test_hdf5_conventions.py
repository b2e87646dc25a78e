"""The HDF5 weights format's record of the module's conventions: root attributes
``mask_layout`` and ``node``, read as "pair" and "starting" where absent."""
from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest

from triattn_cupy import random_weights
from triattn_cupy.hdf5 import WeightsFormatError, load_weights, save_weights
from triattn_cupy.reference import triangle_attention


@pytest.mark.parametrize("mask_layout", ["pair", "row"])
@pytest.mark.parametrize("node", ["starting", "ending", "ending_af3"])
def test_conventions_round_trip(tmp_path, mask_layout, node):
    weights = dataclasses.replace(random_weights(16, 4, seed=1), mask_layout=mask_layout,
                                  node=node)
    save_weights(weights, tmp_path / "w.h5")
    with h5py.File(tmp_path / "w.h5", "r") as f:
        assert f.attrs["format_version"] == 1
        assert (f.attrs["mask_layout"], f.attrs["node"]) == (mask_layout, node)
    loaded = load_weights(tmp_path / "w.h5")
    assert (loaded.mask_layout, loaded.node) == (mask_layout, node)
    for name, value in weights.params.items():
        assert np.array_equal(loaded[name], value), name


def test_loaded_file_computes_its_module(tmp_path, rng):
    """No argument at the call: the file's conventions are used."""
    weights = dataclasses.replace(random_weights(16, 4, seed=2), mask_layout="row",
                                  node="ending")
    save_weights(weights, tmp_path / "w.h5")
    pair = rng.standard_normal((2, 6, 6, 16))
    keep = rng.random((2, 6, 6)) < 0.7
    keep[:, :, 0] = keep[:, 0, :] = True
    out = triangle_attention(pair, keep, load_weights(tmp_path / "w.h5"))
    expected = triangle_attention(pair, keep, random_weights(16, 4, seed=2),
                                  mask_layout="row", node="ending")
    assert np.array_equal(out, expected)


def test_file_without_conventions_loads_as_the_spec(tmp_path):
    save_weights(random_weights(16, 4, seed=3), tmp_path / "w.h5")
    with h5py.File(tmp_path / "w.h5", "r+") as f:  # as files were written before
        del f.attrs["mask_layout"]
        del f.attrs["node"]
    loaded = load_weights(tmp_path / "w.h5")
    assert (loaded.mask_layout, loaded.node) == ("pair", "starting")


def test_fixed_length_strings_are_read(tmp_path):
    save_weights(random_weights(16, 4, seed=4), tmp_path / "w.h5")
    with h5py.File(tmp_path / "w.h5", "r+") as f:
        f.attrs["mask_layout"] = np.bytes_(b"row")
        f.attrs["node"] = np.bytes_(b"ending")
    loaded = load_weights(tmp_path / "w.h5")
    assert (loaded.mask_layout, loaded.node) == ("row", "ending")


def test_bad_conventions_are_reported_together(tmp_path):
    save_weights(random_weights(16, 4, seed=5), tmp_path / "w.h5")
    with h5py.File(tmp_path / "w.h5", "r+") as f:
        f.attrs["mask_layout"] = "ik"
        f.attrs["node"] = np.int64(1)
    with pytest.raises(WeightsFormatError) as info:
        load_weights(tmp_path / "w.h5")
    message = str(info.value)
    assert "2 problems" in message
    assert "root attribute 'mask_layout': expected one of ('pair', 'row'), got 'ik'" in message
    assert ("root attribute 'node': expected one of ('starting', 'ending', 'ending_af3'), "
            "got 1") in message
