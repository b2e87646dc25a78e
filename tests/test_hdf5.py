"""HDF5 weights, format version 1: round trip, layout, and every malformed-file error."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triattn_cupy import hdf5, random_weights
from triattn_cupy.hdf5 import (WeightsFormatError, default_weights_path, load_default_weights,
                               load_weights, save_weights)
from triattn_cupy.weights import OPTIONAL_BIASES, parameter_shapes
from helpers import flip_header_byte

D, H = 16, 4


@pytest.fixture
def weights():
    return random_weights(D, H, seed=1, layer_norm_eps=1e-6)


@pytest.fixture
def saved(tmp_path, weights):
    """A valid file; tests edit it in place to break it."""
    path = tmp_path / "w.h5"
    save_weights(weights, path)
    return path


def edit(path):
    return h5py.File(path, "r+")


def assert_same(a, b):
    assert (a.pair_dim, a.num_heads, a.layer_norm_eps) == (b.pair_dim, b.num_heads,
                                                           b.layer_norm_eps)
    assert a.params.keys() == b.params.keys()
    for name in a.params:
        assert a[name].dtype == b[name].dtype == np.float32, name
        assert np.array_equal(a[name], b[name]), name  # bitwise: no NaN to worry about


# --- round trip and layout ----------------------------------------------------------------

def test_round_trip_is_exact(saved, weights):
    assert_same(load_weights(saved), weights)
    assert_same(load_weights(str(saved)), weights)


def test_layout(saved, weights):
    with h5py.File(saved, "r") as f:
        assert f.attrs["format"] == "triattn-cupy/weights"
        assert f.attrs["format_version"] == 1
        assert (f.attrs["pair_dim"], f.attrs["num_heads"]) == (D, H)
        assert f.attrs["layer_norm_eps"] == 1e-6
        datasets = {}
        f.visititems(lambda n, o: datasets.update({n: o.shape}) if isinstance(
            o, h5py.Dataset) else None)
        assert datasets == {name.replace(".", "/"): shape
                            for name, shape in parameter_shapes(D, H).items()}
        assert all(f[n].dtype == np.float32 for n in datasets)
        assert f["query/weight"].shape == (D, D) and f["bias_proj/weight"].shape == (H, D)


def test_zero_biases_are_written(tmp_path, weights):
    params = {k: v for k, v in weights.params.items() if k not in OPTIONAL_BIASES}
    path = tmp_path / "nobias.h5"
    save_weights(type(weights)(D, H, 1e-5, params), path)
    with h5py.File(path, "r") as f:
        for name in OPTIONAL_BIASES:
            assert np.array_equal(f[name.replace(".", "/")][()], np.zeros(D, np.float32))


def test_save_replaces_and_leaves_no_temporary(saved, weights):
    other = random_weights(D, H, seed=2)
    save_weights(other, saved)
    assert_same(load_weights(saved), other)
    assert os.listdir(saved.parent) == ["w.h5"]


def test_failed_save_keeps_old_file(saved, weights, monkeypatch):
    def broken(f, w):
        f.create_dataset("half", data=np.zeros(3))
        raise RuntimeError("disk full")

    monkeypatch.setattr(hdf5, "_write", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        save_weights(random_weights(D, H, seed=2), saved)
    assert_same(load_weights(saved), weights)
    assert os.listdir(saved.parent) == ["w.h5"]


def test_save_errors(tmp_path, weights):
    with pytest.raises(TypeError, match="weights must be a triattn_cupy.Weights, got dict"):
        save_weights(weights.params, tmp_path / "x.h5")
    with pytest.raises(FileNotFoundError, match="folder .*nowhere does not exist"):
        save_weights(weights, tmp_path / "nowhere" / "x.h5")


def test_default_weights():
    assert default_weights_path().name == "default.h5"
    w = load_default_weights()
    assert (w.pair_dim, w.num_heads, w.layer_norm_eps) == (128, 4, 1e-5)
    assert np.array_equal(w["layer_norm.weight"], np.ones(128, np.float32))


# --- conversions and optional datasets ----------------------------------------------------

def test_absent_optional_biases_load_as_zeros(saved, weights):
    with edit(saved) as f:
        for name in OPTIONAL_BIASES:
            del f[name.replace(".", "/")]
    loaded = load_weights(saved)
    for name in OPTIONAL_BIASES:
        assert np.array_equal(loaded[name], np.zeros(D, np.float32))
    assert np.array_equal(loaded["query.weight"], weights["query.weight"])


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ">f4"])
def test_other_float_dtypes_are_converted(saved, dtype):
    value = np.linspace(-1, 1, D * D).reshape(D, D).astype(dtype)
    with edit(saved) as f:
        del f["key/weight"]
        f.create_dataset("key/weight", data=value)
    loaded = load_weights(saved)["key.weight"]
    assert loaded.dtype == np.float32
    assert np.array_equal(loaded, value.astype(np.float32))


def test_fixed_length_format_string_and_compression(saved, weights):
    with edit(saved) as f:
        f.attrs["format"] = np.bytes_(b"triattn-cupy/weights")  # fixed-length ASCII
        del f["query/weight"]
        f.create_dataset("query/weight", data=weights["query.weight"], compression="gzip",
                         chunks=(4, 4))
    assert_same(load_weights(saved), weights)


# --- malformed files ----------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(WeightsFormatError, match=r"absent\.h5: no such file"):
        load_weights(tmp_path / "absent.h5")


def test_folder(tmp_path):
    with pytest.raises(WeightsFormatError, match="is a folder"):
        load_weights(tmp_path)


def test_not_hdf5(tmp_path):
    path = tmp_path / "random.h5"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(WeightsFormatError, match=r"random\.h5: not an HDF5 file"):
        load_weights(path)


def test_truncated(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[:len(data) // 2])
    with pytest.raises(WeightsFormatError, match=r"w\.h5: cannot read the HDF5 file "
                                                 r"\(truncated or corrupt\?\)"):
        load_weights(saved)


def test_other_hdf5_file(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(WeightsFormatError, match="root attribute 'format' is missing"):
        load_weights(path)


def test_missing_format_attribute(saved):
    with edit(saved) as f:
        del f.attrs["format"]
    with pytest.raises(WeightsFormatError,
                       match="not a triattn-cupy weights file: root attribute 'format' is "
                             "missing"):
        load_weights(saved)


def test_wrong_format_attribute(saved):
    with edit(saved) as f:
        f.attrs["format"] = "someone-else/weights"
    with pytest.raises(WeightsFormatError, match="'format' is 'someone-else/weights', "
                                                 "expected 'triattn-cupy/weights'"):
        load_weights(saved)


@pytest.mark.parametrize("version, shown", [(2, "2"), (np.int32(0), "0"), ("1", "'1'"),
                                            (1.0, "1.0")])
def test_unknown_format_version(saved, version, shown):
    with edit(saved) as f:
        f.attrs["format_version"] = version
    with pytest.raises(WeightsFormatError, match=f"unsupported format_version {shown}; this "
                                                 f"version of triattn-cupy reads "
                                                 f"format_version 1"):
        load_weights(saved)


def test_missing_format_version(saved):
    with edit(saved) as f:
        del f.attrs["format_version"]
    with pytest.raises(WeightsFormatError, match="unsupported format_version missing"):
        load_weights(saved)


@pytest.mark.parametrize("required", ["layer_norm/weight", "layer_norm/bias", "query/weight",
                                      "out_proj/weight", "bias_proj/weight"])
def test_missing_required_dataset(saved, required):
    with edit(saved) as f:
        del f[required]
    with pytest.raises(WeightsFormatError, match=f"1 problem:\n  - dataset '{required}': "
                                                 f"missing \\(required; expected float32 of "
                                                 f"shape \\("):
        load_weights(saved)


def test_wrong_shape(saved):
    with edit(saved) as f:
        del f["bias_proj/weight"]
        f["bias_proj/weight"] = np.zeros((D, H), np.float32)  # transposed
    with pytest.raises(WeightsFormatError, match=r"dataset 'bias_proj/weight': expected "
                                                 r"shape \(4, 16\), got \(16, 4\)"):
        load_weights(saved)


def test_int_dtype(saved):
    with edit(saved) as f:
        del f["gate/bias"]
        f["gate/bias"] = np.zeros(D, np.int32)
    with pytest.raises(WeightsFormatError, match=r"dataset 'gate/bias': expected dtype float32 "
                                                 r"\(float16 and float64 are converted\), "
                                                 r"got int32"):
        load_weights(saved)


@pytest.mark.parametrize("bad, counts", [(np.nan, "1 NaN and 0 Inf"),
                                         (-np.inf, "0 NaN and 1 Inf")])
def test_non_finite(saved, bad, counts):
    with edit(saved) as f:
        f["value/weight"][3, 5] = bad
    with pytest.raises(WeightsFormatError, match=rf"dataset 'value/weight': expected finite "
                                                 rf"values, got {counts} \(first at index "
                                                 rf"\(3, 5\)\)"):
        load_weights(saved)


def test_float64_overflowing_float32(saved):
    with edit(saved) as f:
        del f["layer_norm/bias"]
        f["layer_norm/bias"] = np.full(D, 1e300)
    with pytest.raises(WeightsFormatError, match="'layer_norm/bias': values of dtype float64 "
                                                 "overflow float32"):
        load_weights(saved)


def test_unknown_extra_dataset(saved):
    with edit(saved) as f:
        f["bias_proj/bias"] = np.zeros(H, np.float32)
    with pytest.raises(WeightsFormatError, match=r"dataset 'bias_proj/bias': unexpected "
                                                 r"\(shape \(4,\), dtype float32\); format "
                                                 r"version 1 has no such parameter"):
        load_weights(saved)


@pytest.mark.parametrize("attr, value, message", [
    ("pair_dim", None, "root attribute 'pair_dim': expected a positive integer, got missing"),
    ("num_heads", 0, "root attribute 'num_heads': expected a positive integer, got 0"),
    ("head_dim", 0, "root attribute 'head_dim': expected a positive integer, got 0"),
    ("head_dim", 2.0, "root attribute 'head_dim': expected a positive integer, got 2.0"),
    ("head_dim", 8, r"dataset 'query/weight': expected shape \(32, 16\), got \(16, 16\)"),
    ("head_dim", 1025, r"num_heads x head_dim = 4 x 1025 is beyond the largest"),
    ("layer_norm_eps", -1.0, "root attribute 'layer_norm_eps': expected a positive finite "
                             "number, got -1.0"),
    ("layer_norm_eps", "1e-5", "'layer_norm_eps': expected a positive finite number, got "
                               "'1e-5'"),
])
def test_bad_attributes(saved, attr, value, message):
    with edit(saved) as f:
        if value is None:
            del f.attrs[attr]
        else:
            f.attrs[attr] = value
    with pytest.raises(WeightsFormatError, match=message):
        load_weights(saved)


# --- head width (heads x head width other than pair_dim) --------------------------------------

def test_head_width_round_trip(tmp_path):
    """The models' template stacks: h x c = 2D. The file records c; shapes follow it."""
    weights = random_weights(D, H, seed=3, head_dim=8)
    path = tmp_path / "template.h5"
    save_weights(weights, path)
    with h5py.File(path, "r") as f:
        assert (f.attrs["pair_dim"], f.attrs["num_heads"], f.attrs["head_dim"]) == (D, H, 8)
        assert f["query/weight"].shape == (32, D) and f["gate/bias"].shape == (32,)
        assert f["out_proj/weight"].shape == (D, 32) and f["out_proj/bias"].shape == (D,)
    loaded = load_weights(path)
    assert loaded.head_dim == 8 and loaded.hidden_dim == 32
    assert_same(loaded, weights)


def test_head_dim_is_written_for_every_file(saved):
    with h5py.File(saved, "r") as f:
        assert f.attrs["head_dim"] == D // H


def write_file_of_format_1_before_head_dim(path, weights):
    """A file as save_weights wrote it before the head_dim attribute existed."""
    with h5py.File(path, "w") as f:
        f.attrs.update(format="triattn-cupy/weights", format_version=np.int64(1),
                       pair_dim=np.int64(weights.pair_dim), num_heads=np.int64(weights.num_heads),
                       layer_norm_eps=np.float64(weights.layer_norm_eps),
                       mask_layout=weights.mask_layout, node=weights.node)
        for name, value in weights.params.items():
            f.create_dataset(name.replace(".", "/"), data=value)


def test_files_written_before_head_dim_read_it_as_pair_dim_over_heads(tmp_path, weights):
    path = tmp_path / "old.h5"
    write_file_of_format_1_before_head_dim(path, weights)
    loaded = load_weights(path)
    assert loaded.head_dim == D // H
    assert_same(loaded, weights)
    with edit(path) as f:
        f.attrs["num_heads"] = 3
    with pytest.raises(WeightsFormatError, match=r"pair_dim 16 must be a multiple of "
                                                 r"num_heads 3 \(or a head_dim attribute given\)"):
        load_weights(path)


def test_shipped_default_weights_have_no_head_dim_and_load():
    with h5py.File(default_weights_path(), "r") as f:
        assert "head_dim" not in f.attrs  # written before the attribute existed
    weights = load_default_weights()
    assert (weights.pair_dim, weights.num_heads, weights.head_dim) == (128, 4, 32)


def test_every_problem_at_once(saved):
    with edit(saved) as f:
        del f["query/weight"]
        del f["key/weight"]
        f["key/weight"] = np.zeros((D, D + 1), np.float32)
        f["value/weight"][0, 0] = np.nan
        del f["gate/weight"]
        f["gate/weight"] = np.zeros((D, D), np.int64)
        f["extra"] = np.zeros(2)
        del f.attrs["layer_norm_eps"]
    with pytest.raises(WeightsFormatError) as info:
        load_weights(saved)
    message = str(info.value)
    assert message.startswith(f"{saved}: invalid triattn-cupy weights file, 6 problems:\n")
    for expected in ["root attribute 'layer_norm_eps': expected a positive finite number, "
                     "got missing",
                     "dataset 'query/weight': missing",
                     "dataset 'key/weight': expected shape (16, 16), got (16, 17)",
                     "dataset 'value/weight': expected finite values",
                     "dataset 'gate/weight': expected dtype float32",
                     "dataset 'extra': unexpected"]:
        assert f"\n  - {expected}" in message


def test_invalid_dimensions_still_report_datasets(saved):
    with edit(saved) as f:
        del f.attrs["num_heads"]
        f["out_proj/bias"][0] = np.inf
    with pytest.raises(WeightsFormatError, match=r"2 problems \(dataset shapes not checked\)"
                                                 r":\n.*'num_heads'.*\n.*'out_proj/bias': "
                                                 r"expected finite"):
        load_weights(saved)


# --- data from outside the file, links, declared sizes ------------------------------------

def test_external_storage_is_refused(saved, tmp_path):
    """The raw data of a dataset in another file (here a file of secrets) must not load."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.ones(D * D, np.float32).tobytes())
    with edit(saved) as f:
        del f["query/weight"]
        f.create_dataset("query/weight", shape=(D, D), dtype=np.float32,
                         external=[(str(secret), 0, D * D * 4)])
    with pytest.raises(WeightsFormatError, match=r"'query/weight' keeps its raw data in "
                                                 r"external files \(.*secret.bin\); refused"):
        load_weights(saved)


def test_virtual_dataset_is_refused(saved, tmp_path):
    layout = h5py.VirtualLayout(shape=(D, D), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(tmp_path / "gone.h5"), "x", shape=(D, D))
    with edit(saved) as f:
        del f["key/weight"]
        f.create_virtual_dataset("key/weight", layout, fillvalue=0)
    with pytest.raises(WeightsFormatError, match="'key/weight' is a virtual dataset"):
        load_weights(saved)


def test_external_link_is_refused(saved, tmp_path, weights):
    other = tmp_path / "other.h5"
    save_weights(weights, other)
    with edit(saved) as f:
        del f["value/weight"]
        f["value/weight"] = h5py.ExternalLink(str(other), "/value/weight")
    with pytest.raises(WeightsFormatError, match=r"'value/weight' is an external link to "
                                                 r".*other.h5:/value/weight; refused"):
        load_weights(saved)


def test_hard_and_soft_links_inside_the_file_are_accepted(saved, weights):
    """One bias stored once and hard-linked under a second name; one soft link."""
    with edit(saved) as f:
        del f["key/bias"]
        f["key/bias"] = f["query/bias"]          # a hard link: the same dataset
        del f["gate/bias"]
        f["gate/bias"] = h5py.SoftLink("/query/bias")
    loaded = load_weights(saved)
    assert np.array_equal(loaded["key.bias"], weights["query.bias"])
    assert np.array_equal(loaded["gate.bias"], weights["query.bias"])


def test_dangling_soft_link_is_missing(saved):
    with edit(saved) as f:
        del f["query/weight"]
        f["query/weight"] = h5py.SoftLink("/nowhere")
    with pytest.raises(WeightsFormatError, match="'query/weight': missing"):
        load_weights(saved)


def test_huge_declared_pair_dim_is_refused_before_reading(tmp_path):
    """A few KB declaring pair_dim 10**6: refused from the attributes, no MemoryError."""
    path = tmp_path / "huge.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="triattn-cupy/weights", format_version=1, pair_dim=10**6,
                       num_heads=4, layer_norm_eps=1e-5)
        f.create_dataset("query/weight", shape=(10**6, 10**6), dtype=np.float32)
    with pytest.raises(WeightsFormatError, match=r"pair_dim': 1000000 is beyond the largest "
                                                 r"this package reads, 4096"):
        load_weights(path)


def test_unwritten_datasets_are_refused(tmp_path):
    """Shapes that agree with the attributes but no data stored (they would read as
    zeros): refused from the metadata, nothing read."""
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="triattn-cupy/weights", format_version=1, pair_dim=2048,
                       num_heads=16, layer_norm_eps=1e-5)
        for name, shape in parameter_shapes(2048, 16).items():
            f.create_dataset(name.replace(".", "/"), shape=shape, dtype=np.float32)
    assert os.path.getsize(path) < 100_000
    with pytest.raises(WeightsFormatError, match=r"'query/weight' declares 16777216 bytes "
                                                 r"\(float32 \(2048, 2048\)\) but the file "
                                                 r"stores 0 bytes"):
        load_weights(path)


def test_too_many_heads_is_refused(saved):
    with edit(saved) as f:
        f.attrs["num_heads"] = D * 2
    with pytest.raises(WeightsFormatError, match=f"num_heads {2 * D} is more than pair_dim"):
        load_weights(saved)


def test_fifo_is_refused_without_opening(tmp_path):
    os.mkfifo(tmp_path / "w.h5")
    with pytest.raises(WeightsFormatError, match="not a regular file"):
        load_weights(tmp_path / "w.h5")


def test_group_in_place_of_an_optional_bias_is_refused(saved):
    """Not read as an absent bias (zeros): a group where a dataset belongs is an error."""
    with edit(saved) as f:
        del f["query/bias"]
        f.create_group("query/bias")
    with pytest.raises(WeightsFormatError, match="'query/bias': is a group, expected a "
                                                 "dataset"):
        load_weights(saved)


def test_link_name_that_is_not_utf8_is_reported(saved):
    """h5py's own link visit fails on such a name and leaves its lock broken; the
    loader reports the name instead (and later calls still work)."""
    with edit(saved) as f:
        f.id.links.create_hard(b"\xec\xff", f.id, b"query/bias")
    with pytest.raises(WeightsFormatError, match=r"link b'\\xec\\xff': its name is not UTF-8"):
        load_weights(saved)
    with edit(saved) as f:
        f.id.unlink(b"\xec\xff")
    load_weights(saved)


# --- damaged objects, unwritten chunks, bombs, filters ------------------------------------

def test_named_datatype_in_place_of_an_optional_bias_is_refused(saved):
    """A damaged object header can make a dataset read as another kind of object (a
    named datatype): an error, not an absent bias read as zeros."""
    with edit(saved) as f:
        del f["query/bias"]
        f["query/bias"] = np.dtype("<f4")  # a committed (named) datatype
    with pytest.raises(WeightsFormatError, match=r"'query/bias': is a Datatype \(damaged\?\), "
                                                 r"expected a dataset"):
        load_weights(saved)


@settings(max_examples=100, deadline=None, database=None)
@given(offset=st.integers(0, 299), flip=st.integers(1, 255))
def test_a_flipped_byte_in_an_optional_bias_never_reads_as_zeros(tmp_path_factory, offset,
                                                                 flip):
    """Any byte of query/bias's object header flipped: the load fails with
    WeightsFormatError, or query/bias is still a dataset and was read as one; never taken
    for an absent bias (zeros). (A flipped data address can point the read at other bytes
    of the file: the format has no checksums to tell.)"""
    weights = random_weights(D, H, seed=1)
    path = tmp_path_factory.mktemp("flip") / "w.h5"
    save_weights(weights, path)
    flip_header_byte(path, "query/bias", offset, flip)
    try:
        loaded = load_weights(path)
    except WeightsFormatError:
        return
    with h5py.File(path, "r") as f:
        assert isinstance(f.get("query/bias"), h5py.Dataset)
        assert np.array_equal(loaded["query.bias"], f["query/bias"][()])


def _weights_file(path, D, h, **dataset_options):
    """A weights file whose datasets are created with `dataset_options`, written whole."""
    values = random_weights(D, h, seed=2)
    with h5py.File(path, "w") as f:
        f.attrs.update(format="triattn-cupy/weights", format_version=1, pair_dim=D,
                       num_heads=h, layer_norm_eps=1e-5)
        for name, value in values.params.items():
            f.create_dataset(name.replace(".", "/"), data=value, **dataset_options)
    return values


@pytest.mark.parametrize("filters", [{"compression": "gzip"}, {"shuffle": True},
                                     {"compression": "gzip", "shuffle": True}])
def test_unwritten_chunks_of_a_filtered_dataset_are_refused(saved, filters):
    """A chunked dataset with a filter stores less than its logical size, so its stored
    size alone cannot tell unwritten chunks (read as zeros): every chunk must be there."""
    with edit(saved) as f:
        del f["query/weight"]
        ds = f.create_dataset("query/weight", shape=(D, D), dtype=np.float32,
                              chunks=(1, D), **filters)
        ds[0] = np.arange(D, dtype=np.float32)  # one row of D written
    with pytest.raises(WeightsFormatError, match=r"'query/weight' \(float32 \(16, 16\)\) is "
                                                 r"stored in 16 chunks but the file holds 1"):
        load_weights(saved)


def test_written_chunked_and_filtered_datasets_load(tmp_path):
    path = tmp_path / "w.h5"
    values = _weights_file(path, D, H, chunks=True, compression="gzip", shuffle=True,
                           fletcher32=True)
    loaded = load_weights(path)
    for name in values.params:
        assert np.array_equal(loaded[name], values[name]), name


def test_a_file_of_fill_values_declaring_pair_dim_4096_is_refused(tmp_path):
    """67 KB of gzip chunks, one written per dataset, declaring pair_dim 4096: refused
    from the metadata (it loaded: fill values read as weights)."""
    path = tmp_path / "fill.h5"
    with h5py.File(path, "w") as f:
        f.attrs.update(format="triattn-cupy/weights", format_version=1, pair_dim=4096,
                       num_heads=4, layer_norm_eps=1e-5)
        for name, shape in parameter_shapes(4096, 4).items():
            ds = f.create_dataset(name.replace(".", "/"), shape=shape, dtype=np.float32,
                                  chunks=(1,) * (len(shape) - 1) + (4096,),
                                  compression="gzip")
            ds[(0,) * (len(shape) - 1)] = np.ones(4096, np.float32)
    assert os.path.getsize(path) < 200_000
    with pytest.raises(WeightsFormatError, match=r"'query/weight' \(float32 \(4096, 4096\)\) "
                                                 r"is stored in 4096 chunks but the file "
                                                 r"holds 1"):
        load_weights(path)


def test_chunks_far_larger_than_the_dataset_are_refused(saved):
    """chunks=(1 << 22,) on a 16-element bias: reading it allocates the chunk whole (a
    1.4 MB file of such chunks reached 3.6 GB). Refused from the metadata."""
    with edit(saved) as f:
        del f["query/bias"]
        f.create_dataset("query/bias", data=np.ones(D, np.float32), chunks=(1 << 22,),
                         maxshape=(None,), compression="gzip")
    with pytest.raises(WeightsFormatError, match=r"'query/bias' is stored in chunks of shape "
                                                 r"\(4194304,\) \(16777216 bytes each\) for 64 "
                                                 r"bytes of data"):
        load_weights(saved)


def test_deep_nesting_is_refused_fast(saved):
    """1000 nested groups took 21 s to refuse (each name followed from the root)."""
    import time

    with edit(saved) as f:
        f.create_group("/".join(["g"] * 1000))
    start = time.perf_counter()
    with pytest.raises(WeightsFormatError, match="groups nested more than 32 deep"):
        load_weights(saved)
    assert time.perf_counter() - start < 5.0


def test_very_deep_nesting_does_not_crash(saved, tmp_path):
    """HDF5's recursive link visit overflowed the C stack on 20000 nested groups (the
    process died with SIGSEGV); the groups are walked level by level, to 32. In a child
    process, for weights and for an input whose pair is missing (the error lists the
    file's datasets)."""
    import subprocess
    import sys

    from cli_support import child_env

    deep = "/".join(["g"] * 20000)
    with edit(saved) as f:
        f.create_group(deep)
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.create_group(deep)
    script = ("import sys\nfrom triattn_cupy.hdf5 import load_weights\n"
              "from triattn_cupy.cli.io import read_input\n"
              "for load in (lambda: load_weights(sys.argv[1]),\n"
              "             lambda: read_input(sys.argv[2], 'hdf5', pair_dim=16)):\n"
              "    try:\n        load()\n    except Exception as err:\n"
              "        print(type(err).__name__, str(err).splitlines()[-1])\n")
    proc = subprocess.run([sys.executable, "-c", script, str(saved), str(tmp_path / "x.h5")],
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.splitlines() == [
        "WeightsFormatError   - groups nested more than 32 deep (at 'g/g/g/g/g/g/g/g/g/g/g/g/"
        "g/g/g/g/g/g/g/g/g/g/g/g/g/g/g/g/g/g/...'); refused",
        "InputError no dataset 'pair' in the file (it holds no datasets); choose one with "
        "--pair-key"], proc.stdout


def _unknown_filter_file(path):
    """A weights file whose query/weight names filter 32001, a mandatory filter no
    library registers: h5py's LZF (32000) in the file, its id changed."""
    _weights_file(path, D, H)
    with edit(path) as f:
        del f["query/weight"]
        f.create_dataset("query/weight", data=np.zeros((D, D), np.float32),
                         compression="lzf")
    raw = bytearray(path.read_bytes())
    at = raw.find(b"lzf\0") - 8  # the pipeline message's entry: id, name length, flags
    assert raw[at:at + 2] == (32000).to_bytes(2, "little")
    raw[at:at + 2] = (32001).to_bytes(2, "little")
    raw[at + 4:at + 6] = b"\0\0"  # mandatory
    path.write_bytes(raw)


def test_an_unknown_filter_is_named_and_no_plugin_is_loaded(tmp_path):
    """A dataset naming a filter HDF5 does not know made it load plugins from
    HDF5_PLUGIN_PATH (a planted library's constructor ran), then say "corrupt?". The
    load runs in a child process whose HDF5 starts with that path."""
    import shutil
    import subprocess
    import sys

    from cli_support import child_env

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted plugin")
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    source = tmp_path / "planted.c"
    source.write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        "  FILE* f = fopen(getenv(\"PLANTED_MARKER\"), \"w\"); if (f) fclose(f); }\n"
        "int H5PLget_plugin_type(void) { return 0; }\n"
        "const void* H5PLget_plugin_info(void) { return 0; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(plugins / "libplanted.so"),
                    str(source)], check=True)
    path = tmp_path / "w.h5"
    _unknown_filter_file(path)
    marker = tmp_path / "planted_ran"
    env = dict(child_env(), HDF5_PLUGIN_PATH=str(plugins), PLANTED_MARKER=str(marker))
    script = ("import sys, h5py\nfrom triattn_cupy.hdf5 import load_weights\n"
              "paths = [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())]\n"
              "try:\n    load_weights(sys.argv[1])\nexcept Exception as err:\n"
              "    print(type(err).__name__, err)\n"
              "assert [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())] == paths\n")
    proc = subprocess.run([sys.executable, "-c", script, str(path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert ("WeightsFormatError" in proc.stdout and "dataset 'query/weight' uses HDF5 filter "
            "32001 (lzf), which is not supported: rewrite the file without it" in proc.stdout
            ), proc.stdout
    assert not marker.exists()


def test_no_filter_plugins_empties_the_search_path_and_restores_it():
    before = [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())]
    with hdf5.no_filter_plugins():
        with hdf5.no_filter_plugins():  # nested (another reader thread)
            assert h5py.h5pl.size() == 0
        assert h5py.h5pl.size() == 0
    assert [h5py.h5pl.get(i) for i in range(h5py.h5pl.size())] == before


def test_an_unreadable_file_is_a_weights_error(saved, monkeypatch):
    """A raw PermissionError came out of load_weights; now a WeightsFormatError naming
    the file and the reason."""
    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(h5py, "is_hdf5", refuse)
    with pytest.raises(WeightsFormatError, match=f"{saved}: cannot be read: Permission "
                                                 f"denied"):
        load_weights(saved)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without permission")
def test_a_file_without_read_permission_is_a_weights_error(saved):
    os.chmod(saved, 0)
    with pytest.raises(WeightsFormatError, match=f"{saved}: cannot be read: Permission "
                                                 f"denied"):
        load_weights(saved)
