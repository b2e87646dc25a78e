"""`triattn-infer`'s inputs: bad, hostile and special files are refused with a clear
reason before their data are read, and the run goes on (CPU backend, D=16)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import zipfile

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triattn_cupy.cli import io as cli_io
from helpers import flip_header_byte
from cli_support import (D, all_files, assert_same, child_env, cli, dataset,  # noqa: F401
                         expected_output, make_pair, padding_mask, read_output, weights,
                         weights_file, write_h5)


def test_bad_inputs_are_reported_and_skipped(weights, weights_file, tmp_path, capsys):
    rng = np.random.default_rng(4)
    src = tmp_path / "in"
    src.mkdir()
    good = make_pair(rng, 5, 5)
    np.save(src / "good.npy", good)
    (src / "corrupt_a.npy").write_bytes(rng.bytes(500))
    (src / "corrupt_b.npz").write_bytes(rng.bytes(500))
    (src / "corrupt_c.h5").write_bytes(rng.bytes(500))
    np.save(src / "truncated_a.npy", make_pair(rng, 6, 6))
    data = (src / "truncated_a.npy").read_bytes()
    (src / "truncated_a.npy").write_bytes(data[:len(data) // 2])
    write_h5(src / "truncated_b.h5", pair=make_pair(rng, 6, 6))
    data = (src / "truncated_b.h5").read_bytes()
    (src / "truncated_b.h5").write_bytes(data[:len(data) // 2])
    np.save(src / "wrong_d.npy", rng.standard_normal((5, 5, D + 8)).astype(np.float32))
    nan = make_pair(rng, 5, 5)
    nan[1, 2, 3] = np.nan
    np.save(src / "nan.npy", nan)
    overflow = make_pair(rng, 5, 5, dtype=np.float64)
    overflow[0, 0, 0] = 1e300  # finite in float64, Inf in float32
    np.save(src / "overflow.npy", overflow)
    np.savez(src / "bad_mask.npz", pair=make_pair(rng, 5, 5), mask=np.ones((4, 4), bool))
    inf_mask = np.ones((5, 5))
    inf_mask[2, 2] = np.inf
    np.savez(src / "inf_mask.npz", pair=make_pair(rng, 5, 5), mask=inf_mask)
    np.savez(src / "no_key.npz", other=make_pair(rng, 5, 5))
    np.save(src / "int.npy", np.ones((5, 5, D), np.int64))
    np.save(src / "not_square.npy", rng.standard_normal((5, 6, D)))
    out = tmp_path / "out"
    assert cli(weights_file, out, src, tmp_path / "missing.npy") == 1
    assert all_files(out) == ["good.h5"]
    assert_same(read_output(out / "good.h5")[0], expected_output(weights, good))
    err = capsys.readouterr().err
    reasons = {
        "corrupt_a.npy": "cannot read the npy file",
        "corrupt_b.npz": "not a .npz file",
        "corrupt_c.h5": "not an HDF5 file",
        "truncated_a.npy": "file is truncated",
        "truncated_b.h5": "cannot read the hdf5 file (corrupt or truncated?)",
        "wrong_d.npy": f"pair's last axis must equal the weights' pair_dim {D}; got {D + 8}",
        "nan.npy": "pair contains 1 non-finite value (NaN or Inf), the first at index "
                   "(1, 2, 3)",
        "overflow.npy": "pair contains 1 non-finite value",
        "bad_mask.npz": "mask must have shape (5, 5) to match pair; got (4, 4)",
        "inf_mask.npz": "mask contains 1 non-finite value",
        "no_key.npz": "no array 'pair' in the archive (it holds 'other')",
        "int.npy": "pair has dtype int64; expected float16, float32 or float64",
        "not_square.npy": "pair must be square in its two middle axes (N, N); got (5, 6, 16)",
    }
    for name, reason in reasons.items():
        assert f"{src / name}: {reason}" in err, (name, err)
    assert f"{tmp_path / 'missing.npy'}: no such file or folder" in err
    assert "15 files: 1 computed, 0 skipped, 14 failed" in err


def test_special_files_are_skipped_without_opening(weights, weights_file, tmp_path):
    """FIFOs named like inputs (one .npy, one .h5) in a folder and one named directly: each
    is reported and skipped, never opened (opening a FIFO blocks), and the run ends.
    Run in a child process so that a hang fails the test instead of stalling it."""
    rng = np.random.default_rng(11)
    src = tmp_path / "in"
    src.mkdir()
    np.save(src / "good.npy", make_pair(rng, 4, 4))
    os.mkfifo(src / "fifo.npy")
    os.mkfifo(src / "fifo.h5")
    os.mkfifo(tmp_path / "named.npz")
    (src / "model.pt").write_bytes(b"not an input")
    os.symlink(tmp_path / "gone.npy", src / "dangling.npy")
    out = tmp_path / "out"
    script = (f"import sys\nfrom triattn_cupy.cli import main\n"
              f"sys.exit(main.main([{str(src)!r}, {str(tmp_path / 'named.npz')!r}, '-o', "
              f"{str(out)!r}, '--weights', {str(weights_file)!r}, '--device', 'cpu']))")
    proc = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all_files(out) == ["good.h5"]
    err = proc.stderr
    assert "6 files: 1 computed, 5 skipped, 0 failed" in err
    assert "5 files skipped, not taken as inputs" in err
    assert (f"{src / 'dangling.npy'}: a broken link (to {tmp_path / 'gone.npy'}, which does "
            f"not exist); not followed") in err
    for name in ("fifo.npy", "fifo.h5"):
        assert f"{src / name}: a FIFO, not a regular file; not opened" in err
    assert f"{tmp_path / 'named.npz'}: a FIFO, not a regular file; not opened" in err
    assert f"{src / 'model.pt'}: not an input type (.npy, .npz, .h5, .hdf5)" in err


def test_only_other_files_is_an_error(weights_file, tmp_path, capsys):
    src = tmp_path / "in"
    src.mkdir()
    (src / "model.pt").write_bytes(b"x")
    assert cli(weights_file, tmp_path / "out", src) == 1
    err = capsys.readouterr().err
    assert "no input files found" in err and "model.pt: not an input type" in err


def test_npy_format_3_and_fortran_order_are_read(weights, weights_file, tmp_path):
    """.npy format 3.0 (written when a dtype has UTF-8 field names; here forced) through
    NumPy's public header API, and Fortran-ordered arrays in .npy and .npz."""
    rng = np.random.default_rng(12)
    pair = make_pair(rng, 6, 6)
    header = repr({"descr": "<f4", "fortran_order": False, "shape": pair.shape})
    header += " " * (63 - (12 + len(header)) % 64) + "\n"  # 64-byte aligned, as NumPy
    with open(tmp_path / "v3.npy", "wb") as f:
        f.write(b"\x93NUMPY\x03\x00" + len(header).to_bytes(4, "little")
                + header.encode("utf-8") + pair.tobytes())
    assert np.array_equal(np.load(tmp_path / "v3.npy"), pair)
    assert (tmp_path / "v3.npy").read_bytes()[6:8] == b"\x03\x00"
    fpair = np.asfortranarray(make_pair(rng, 2, 5, 5, dtype=np.float64))
    np.save(tmp_path / "f.npy", fpair)
    np.savez(tmp_path / "fz.npz", pair=fpair, mask=np.asfortranarray(padding_mask(2, 5, 3)))
    out = tmp_path / "out"
    assert cli(weights_file, out, tmp_path / "v3.npy", tmp_path / "f.npy",
               tmp_path / "fz.npz") == 0
    assert_same(read_output(out / "v3.h5")[0], expected_output(weights, pair))
    assert_same(read_output(out / "f.h5")[0], expected_output(weights, fpair))
    assert_same(read_output(out / "fz.h5")[0],
                expected_output(weights, fpair, padding_mask(2, 5, 3)))


def _peak_bytes_of(func):
    import tracemalloc

    tracemalloc.start()
    try:
        func()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_shapes_are_checked_before_data_are_read(tmp_path):
    """Masks of the wrong shape that decompress to 64 MB (npz, and HDF5 with gzip) and a
    pair whose archive entry is shorter than its header says: refused from the headers,
    reading a few MB at most."""
    rng = np.random.default_rng(13)
    pair = make_pair(rng, 5, 5)
    big = np.zeros((8000, 8000), bool)
    np.savez_compressed(tmp_path / "m.npz", pair=pair, mask=big)
    with h5py.File(tmp_path / "m.h5", "w") as f:
        f["pair"] = pair
        f.create_dataset("mask", data=big, compression="gzip", chunks=(1000, 1000))

    for name in ("m.npz", "m.h5"):
        def read(name=name):
            with pytest.raises(cli_io.InputError,
                               match=r"mask must have shape \(5, 5\) to match pair; got "
                                     r"\(8000, 8000\)"):
                cli_io.read_input(str(tmp_path / name), cli_io.input_kind(name),
                                  pair_dim=D)
        assert _peak_bytes_of(read) < 8 << 20, name

    # An archive entry whose header announces more data than the archive holds.
    with zipfile.ZipFile(tmp_path / "lie.npz", "w") as z:
        with z.open("pair.npy", "w") as member:
            np.lib.format.write_array_header_1_0(member, {
                "descr": "<f4", "fortran_order": False, "shape": (4000, 4000, D)})
            member.write(b"\0" * 64)
    with pytest.raises(cli_io.InputError, match="but the archive holds"):
        cli_io.read_input(str(tmp_path / "lie.npz"), "npz", pair_dim=D)


def test_a_pair_larger_than_memory_is_refused(tmp_path, monkeypatch):
    np.save(tmp_path / "x.npy", np.zeros((3, 3, D), np.float32))
    monkeypatch.setattr(cli_io, "_host_memory_bytes", lambda: 100)
    with pytest.raises(cli_io.InputError, match=r"pair \(3, 3, 16\) takes 0.0 GiB as "
                                                r"float32, more than this machine's"):
        cli_io.read_input(str(tmp_path / "x.npy"), "npy", pair_dim=D)


def test_hdf5_inputs_must_hold_their_data(weights_file, tmp_path, capsys):
    """Inputs, like weights, never read data from outside their file."""
    rng = np.random.default_rng(14)
    pair = make_pair(rng, 4, 4)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(pair.tobytes())
    src = tmp_path / "in"
    src.mkdir()
    with h5py.File(src / "external.h5", "w") as f:
        f.create_dataset("pair", shape=pair.shape, dtype=np.float32,
                         external=[(str(raw), 0, pair.nbytes)])
    layout = h5py.VirtualLayout(shape=pair.shape, dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(tmp_path / "gone.h5"), "pair", shape=pair.shape)
    with h5py.File(src / "virtual.h5", "w") as f:
        f.create_virtual_dataset("pair", layout, fillvalue=0)
    write_h5(tmp_path / "real.h5", pair=pair)
    with h5py.File(src / "link.h5", "w") as f:
        f["pair"] = h5py.ExternalLink(str(tmp_path / "real.h5"), "/pair")
    with h5py.File(src / "unwritten.h5", "w") as f:
        f.create_dataset("pair", shape=(300, 300, D), dtype=np.float32)
    with h5py.File(src / "hardlink.h5", "w") as f:
        f["data/pair"] = pair
        f["pair"] = f["data/pair"]
    out = tmp_path / "out"
    assert cli(weights_file, out, src) == 1
    err = capsys.readouterr().err
    assert "external.h5: 'pair' keeps its raw data in external files" in err
    assert "virtual.h5: 'pair' is a virtual dataset" in err
    assert "link.h5: 'pair' is an external link to" in err
    assert "unwritten.h5: 'pair' declares" in err and "stores 0 bytes" in err
    assert all_files(out) == ["hardlink.h5"]




def test_float16_inputs_give_float16_outputs(weights, weights_file, tmp_path):
    """A float16 pair (.npy and an HDF5 dataset) is computed in float32 from its values
    and written back in float16."""
    rng = np.random.default_rng(16)
    src = tmp_path / "in"
    src.mkdir()
    pair = make_pair(rng, 2, 6, 6).astype(np.float16)
    np.save(src / "half_npy.npy", pair)
    write_h5(src / "half_h5.h5", pair=pair)
    out = tmp_path / "out"
    assert cli(weights_file, out, src) == 0
    expected = expected_output(weights, pair.astype(np.float32)).astype(np.float16)
    for name in ("half_npy", "half_h5"):
        got, _ = read_output(out / f"{name}.h5")
        assert got.dtype == np.float16 and got.shape == pair.shape
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                                   rtol=2 ** -10, atol=1e-3)


# --- what -r follows, and what it leaves out --------------------------------------------

def test_recursive_follows_links_by_one_rule_and_reports_what_it_leaves_out(
        weights, weights_file, tmp_path, capsys):
    """Links to files and to folders are followed wherever they point, each real file and
    folder taken once; everything left out is listed by name with its reason: a hidden
    file, a broken link (as such, not "missing"), a link cycle, a link to a folder that
    holds it, a second name of a file or folder taken already."""
    rng = np.random.default_rng(18)
    src, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    (src / "real").mkdir(parents=True)
    elsewhere.mkdir()
    pairs = {"top": make_pair(rng, 4, 4), "deep": make_pair(rng, 5, 5),
             "far": make_pair(rng, 6, 6), "file": make_pair(rng, 3, 3)}
    np.save(src / "top.npy", pairs["top"])
    np.save(src / "real" / "deep.npy", pairs["deep"])
    np.save(elsewhere / "far.npy", pairs["far"])
    np.save(elsewhere / "file.npy", pairs["file"])
    os.symlink(elsewhere, src / "linked")            # a folder out of the tree: followed
    os.symlink(elsewhere / "file.npy", src / "f.npy")  # a file out of the tree: followed
    os.symlink(src / "real", src / "again")          # a second name of real/: left out
    os.symlink(src / "top.npy", src / "same.npy")    # a second name of top.npy: left out
    os.symlink(tmp_path, src / "real" / "up")        # holds the link: a cycle, left out
    os.symlink(src / "loop_b.npy", src / "loop_a.npy")
    os.symlink(src / "loop_a.npy", src / "loop_b.npy")
    os.symlink(tmp_path / "gone.npy", src / "dangling.npy")
    np.save(src / ".hidden.npy", pairs["top"])
    out = tmp_path / "out"
    assert cli(weights_file, out, src, "-r") == 0
    assert all_files(out) == ["linked/far.h5", "linked/file.h5", "real/deep.h5", "top.h5"]
    for rel, name in (("linked/file.h5", "file"), ("linked/far.h5", "far"),
                      ("real/deep.h5", "deep"), ("top.h5", "top")):
        assert_same(read_output(out / rel)[0], expected_output(weights, pairs[name]))
    err = capsys.readouterr().err
    for name, reason in (
            ("again", f"the folder {src / 'real'}, searched already; not searched twice"),
            ("same.npy", f"the same file as {src / 'top.npy'}, taken once"),
            ("f.npy", f"the same file as {src / 'linked' / 'file.npy'}, taken once"),
            ("real/up", f"a link cycle (to {tmp_path}, a folder that holds the link); "
                        f"not followed"),
            ("loop_a.npy", "a link cycle (links that lead back to themselves); not followed"),
            ("dangling.npy", f"a broken link (to {tmp_path / 'gone.npy'}, which does not "
                             f"exist); not followed"),
            (".hidden.npy", "hidden (its name starts with '.'); not taken as input")):
        assert f"  {src / name}: {reason}" in err, (name, err)
    assert "missing" not in err
    assert "12 files: 4 computed, 8 skipped, 0 failed" in err


def test_without_recursive_sub_folders_are_named(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    os.symlink(src / "sub", src / "linked_sub")
    assert cli(weights_file, tmp_path / "out", src) == 0
    err = capsys.readouterr().err
    assert (f"{src}: 2 sub-folders not searched (add --recursive): {src / 'linked_sub'}, "
            f"{src / 'sub'}") in err


def test_named_broken_links_fail_as_what_they_are(weights_file, tmp_path, capsys):
    os.symlink(tmp_path / "gone.npy", tmp_path / "dangling.npy")
    os.symlink(tmp_path / "b.npy", tmp_path / "a.npy")
    os.symlink(tmp_path / "a.npy", tmp_path / "b.npy")
    assert cli(weights_file, tmp_path / "out", tmp_path / "dangling.npy",
               tmp_path / "a.npy") == 1
    err = capsys.readouterr().err
    assert (f"{tmp_path / 'dangling.npy'}: a broken link (to {tmp_path / 'gone.npy'}, which "
            f"does not exist)") in err
    assert f"{tmp_path / 'a.npy'}: a link cycle (links that lead back to themselves)" in err
    assert "no such file" not in err

# The CLI in a child process whose reader shrinks one input right after its header is
# checked (the destination is allocated then): the event, not a timer, orders the two.
_SHRINK_DURING_READ = """
import os, sys
import numpy as np
from triattn_cupy.cli import filejob, main

victim, keep = sys.argv[1], int(sys.argv[2])
real_read_input = filejob.read_input

def read_input(path, *args, alloc=None, **kwargs):
    def shrinking_alloc(shape):
        if os.path.basename(path) == victim:
            os.truncate(path, keep)
        return alloc(shape) if alloc else np.empty(shape, np.float32)
    return real_read_input(path, *args, alloc=shrinking_alloc, **kwargs)

filejob.read_input = read_input
sys.exit(main.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("dtype,order", [(np.float32, "C"), (np.float64, "F")])
def test_an_input_shrinking_while_read_fails_alone(weights, weights_file, tmp_path, dtype,
                                                   order):
    """A .npy truncated after its header check ended the whole run with SIGBUS (it was
    read through a memory map). Now the short read is that file's error, "file changed
    while being read", and the batch computes the other files."""
    rng = np.random.default_rng(17)
    src = tmp_path / "in"
    src.mkdir()
    pairs = {name: np.asarray(make_pair(rng, 40, 40, dtype=dtype), order=order)
             for name in ("a", "b_shrinks", "c")}
    for name, pair in pairs.items():
        np.save(src / f"{name}.npy", pair)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", _SHRINK_DURING_READ, "b_shrinks.npy", "4096", str(src),
         "-o", str(out), "--weights", str(weights_file), "--device", "cpu"],
        env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert f"{src / 'b_shrinks.npy'}: file changed while being read" in proc.stderr
    assert "3 files: 2 computed, 0 skipped, 1 failed" in proc.stderr
    assert all_files(out) == ["a.h5", "c.h5"]
    for name in ("a", "c"):
        assert_same(read_output(out / f"{name}.h5")[0],
                    expected_output(weights, pairs[name].astype(np.float32)))


def _patch_lzf_to_unknown_filter(path):
    """Rename the file's LZF filter (32000) to 32001, mandatory: a filter nobody has."""
    raw = bytearray(path.read_bytes())
    at = raw.find(b"lzf\0") - 8  # the pipeline entry: id, name length, flags
    assert raw[at:at + 2] == (32000).to_bytes(2, "little")
    raw[at:at + 2] = (32001).to_bytes(2, "little")
    raw[at + 4:at + 6] = b"\0\0"
    path.write_bytes(raw)


def test_hdf5_inputs_storage_is_checked_before_reading(tmp_path):
    """An .h5 pair whose chunks are far larger than its data (each read allocates a
    chunk whole), one with unwritten gzip chunks (read as zeros), one naming a filter
    no library registers (which made HDF5 load plugins): refused from the metadata."""
    pair = make_pair(np.random.default_rng(18), 4, 4)
    with h5py.File(tmp_path / "bomb.h5", "w") as f:
        f.create_dataset("pair", data=pair, chunks=(256, 128, D), maxshape=(None,) * 3,
                         compression="gzip")
    with h5py.File(tmp_path / "holes.h5", "w") as f:
        f.create_dataset("pair", shape=pair.shape, dtype=np.float32, chunks=(1, 4, D),
                         compression="gzip")[0] = pair[0]
    with h5py.File(tmp_path / "filter.h5", "w") as f:
        f.create_dataset("pair", data=np.zeros((40, 40, D), np.float32), compression="lzf")
    _patch_lzf_to_unknown_filter(tmp_path / "filter.h5")
    cases = {"bomb.h5": r"'pair' is stored in chunks of shape \(256, 128, 16\) \(2097152 "
                        r"bytes each\) for 1024 bytes of data",
             "holes.h5": r"'pair' \(float32 \(4, 4, 16\)\) is stored in 4 chunks but the "
                         r"file holds 1",
             "filter.h5": r"'pair' uses HDF5 filter 32001 \(lzf\), which is not supported: "
                          r"rewrite the file without it"}
    for name, message in cases.items():
        with pytest.raises(cli_io.InputError, match=message):
            cli_io.read_input(str(tmp_path / name), "hdf5", pair_dim=D)


def test_an_npz_that_expands_far_beyond_its_size_is_refused(tmp_path):
    """A small .npz of zeros expanding ~1000 times (a 2 MB one reached 4.1 GB of memory):
    refused from the archive's directory, before anything is decompressed. A pair of
    real values, compressed, is read."""
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("pair.npy", "w", force_zip64=True) as member:
            shape = (1, 1100, 1100, D)
            np.lib.format.write_array_header_1_0(member, {
                "descr": "<f4", "fortran_order": False, "shape": shape})
            zeros = bytes(1 << 20)
            for _ in range(math.prod(shape) * 4 >> 20):
                member.write(zeros)
            member.write(bytes(math.prod(shape) * 4 % (1 << 20)))
    assert (tmp_path / "bomb.npz").stat().st_size < 200_000

    def read():
        with pytest.raises(cli_io.InputError, match=r"pair: the archive stores \d+ bytes that "
                                                    r"expand to \d+, more than 100 times; "
                                                    r"refused as a compression bomb"):
            cli_io.read_input(str(tmp_path / "bomb.npz"), "npz", pair_dim=D)
    assert _peak_bytes_of(read) < 8 << 20
    pair = make_pair(np.random.default_rng(19), 4, 4)
    np.savez_compressed(tmp_path / "real.npz", pair=pair)
    assert np.array_equal(cli_io.read_input(str(tmp_path / "real.npz"), "npz",
                                            pair_dim=D).pair, pair)


@settings(max_examples=100, deadline=None, database=None)
@given(offset=st.integers(0, 299), flip=st.integers(1, 255))
def test_a_damaged_mask_is_never_read_as_no_mask(tmp_path_factory, offset, flip):
    """Any byte of the mask's object header flipped: the input is refused, or read with a
    mask; an object HDF5 cannot open was taken for an absent mask (computed unmasked)."""
    path = tmp_path_factory.mktemp("flip") / "x.h5"
    write_h5(path, pair=make_pair(np.random.default_rng(20), 4, 4),
             mask=padding_mask(0, 4, 3))
    flip_header_byte(path, "mask", offset, flip)
    try:
        loaded = cli_io.read_input(str(path), "hdf5", pair_dim=D)
    except cli_io.InputError:
        return
    assert loaded.mask is not None


def test_a_mask_that_is_not_a_dataset_is_named(tmp_path):
    path = tmp_path / "x.h5"
    write_h5(path, pair=make_pair(np.random.default_rng(21), 4, 4))
    with h5py.File(path, "r+") as f:
        f["mask"] = np.dtype("?")
    with pytest.raises(cli_io.InputError, match=r"mask 'mask': is a Datatype \(damaged\?\), "
                                                r"expected a dataset"):
        cli_io.read_input(str(path), "hdf5", pair_dim=D)
