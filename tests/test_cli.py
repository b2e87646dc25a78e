"""`triattn-infer` (triattn_cupy.cli) through `main([...])`: formats, resume, atomic writes, bad inputs,
refusals, device flags, the demo. CPU backend everywhere except the tests marked `gpu`.

Sizes are tiny (D=16, h=2, N <= 13) so the file runs in seconds on a CPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

import triattn_cupy
from triattn_cupy import random_weights, reference
from triattn_cupy.cli import io as cli_io
from triattn_cupy.cli import main as cli_main
from triattn_cupy.cli import pipeline, report
from triattn_cupy.cli.backends import (CpuBackend, gpu_probe, parse_devices,
                                       precision_support)
from triattn_cupy.hdf5 import save_weights
from helpers import rel_l2

REPO = pathlib.Path(__file__).resolve().parent.parent
D, H = 16, 2


# --- fixtures and helpers -------------------------------------------------------------------

@pytest.fixture(scope="module")
def weights():
    return random_weights(D, H, seed=7)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory, weights):
    path = tmp_path_factory.mktemp("weights") / "w16.h5"
    save_weights(weights, path)
    return path


def make_pair(rng, *shape, dtype=np.float32):
    return (rng.standard_normal(shape + (D,)) * 1.5 + 0.25).astype(dtype)


def padding_mask(B, N, valid, dtype=bool):
    """Keys and queries >= valid padded: queries valid.. have every key masked."""
    keep = np.arange(N) < valid
    m = (keep[:, None] & keep[None, :]).astype(dtype)
    return np.broadcast_to(m, (B, N, N)).copy() if B else m


def cli(weights_file, out_dir, *args, device="cpu"):
    argv = [*map(str, args), "--output-dir", str(out_dir), "--weights", str(weights_file)]
    if device:
        argv += ["--device", device]
    return cli_main.main(argv)


def read_output(path):
    path = pathlib.Path(path)
    if path.suffix == ".npy":
        return np.load(path), {}
    with h5py.File(path, "r") as f:
        return f["out"][()], dict(f.attrs)


def expected_output(weights, pair, mask=None, fully_masked="zero"):
    """The library call the CLI must reproduce: the NumPy backend in float32."""
    return reference.triangle_attention(np.asarray(pair).astype(np.float32), mask, weights,
                                        fully_masked=fully_masked, dtype=np.float32)


def assert_same(actual, expected):
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


def sha(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def all_files(folder):
    return sorted(str(p.relative_to(folder)) for p in pathlib.Path(folder).rglob("*")
                  if p.is_file())


def write_h5(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, value in datasets.items():
            f[name] = value


@pytest.fixture
def dataset(tmp_path):
    """A folder with every input format, batched and not, masked and not, float32 and
    float64, N from 4 to 11, one level of sub-folder. Returns (folder, {rel: (pair, mask)})."""
    rng = np.random.default_rng(1)
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    items = {
        "a.npy": (make_pair(rng, 7, 7), None),
        "b.npy": (make_pair(rng, 2, 5, 5, dtype=np.float64), None),
        "c.npz": (make_pair(rng, 9, 9), padding_mask(0, 9, 7)),
        "d.npz": (make_pair(rng, 3, 4, 4, dtype=np.float64), None),
        "sub/e.h5": (make_pair(rng, 11, 11, dtype=np.float64),
                     (rng.random((11, 11)) > 0.3).astype(np.int32)),
        "sub/f.hdf5": (make_pair(rng, 2, 6, 6),
                       padding_mask(2, 6, 4, dtype=np.float32) * 2.0),
    }
    for rel, (pair, mask) in items.items():
        path = src / rel
        if path.suffix == ".npy":
            np.save(path, pair)
        elif path.suffix == ".npz":
            np.savez(path, **({"pair": pair} | ({} if mask is None else {"mask": mask})))
        else:
            write_h5(path, pair=pair, **({} if mask is None else {"mask": mask}))
    return src, items


# --- outputs equal the library call ---------------------------------------------------------

def test_every_format_mask_batch_and_mixed_n(dataset, weights, weights_file, tmp_path,
                                             capsys):
    src, items = dataset
    before = {p: sha(src / p) for p in all_files(src)}
    out = tmp_path / "out"
    assert cli(weights_file, out, src, "--recursive") == 0
    assert all_files(out) == sorted(os.path.splitext(rel)[0] + ".h5" for rel in items)
    weights_sha = sha(weights_file)
    for rel, (pair, mask) in items.items():
        got, attrs = read_output(out / (os.path.splitext(rel)[0] + ".h5"))
        assert_same(got, expected_output(weights, pair, mask))
        assert attrs["format"] == "triattn-cupy/infer-output"
        assert attrs["input_file"] == str(src / rel)
        assert attrs["weights_file"] == str(weights_file)
        assert attrs["weights_sha256"] == weights_sha
        assert attrs["triattn_cupy_version"] == triattn_cupy.__version__
        assert bool(attrs["mask_used"]) == (mask is not None)
        assert attrs["input_dtype"] == str(pair.dtype)
        assert json.loads(attrs["input_shape"]) == list(pair.shape)
        options = json.loads(attrs["options"])
        assert options["fully_masked"] == "zero" and options["pair_key"] == "pair"
        assert attrs["device"].startswith("CPU")
    assert {p: sha(src / p) for p in all_files(src)} == before  # inputs untouched
    err = capsys.readouterr().err
    assert "6 files: 6 computed, 0 skipped, 0 failed" in err
    assert "pair positions/s" in err and "CPU" in err


def test_npy_output_format_and_fully_masked_nan(dataset, weights, weights_file, tmp_path):
    src, items = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src / "c.npz", src / "a.npy", "--output-format", "npy",
               "--fully-masked", "nan") == 0
    assert all_files(out) == ["a.npy", "c.npy"]  # files named directly: their basename
    pair, mask = items["c.npz"]
    got, _ = read_output(out / "c.npy")
    want = expected_output(weights, pair, mask, fully_masked="nan")
    # Queries j >= 7 have every key masked: NaN in every row i, as the reference.
    assert np.isnan(got[:, 7:]).all() and np.isfinite(got[:, :7]).all()
    assert_same(got[:, :7], want[:, :7])


def test_custom_keys_and_explicit_missing_mask_warns(weights, weights_file, tmp_path,
                                                     capsys):
    rng = np.random.default_rng(2)
    pair, mask = make_pair(rng, 5, 5), padding_mask(0, 5, 3)
    np.savez(tmp_path / "k.npz", x=pair, m=mask)
    write_h5(tmp_path / "g.h5", **{"grp/x": pair})
    out = tmp_path / "out"
    assert cli(weights_file, out, tmp_path / "k.npz", "--pair-key", "x", "--mask-key",
               "m") == 0
    assert_same(read_output(out / "k.h5")[0], expected_output(weights, pair, mask))
    assert cli(weights_file, out, tmp_path / "g.h5", "--pair-key", "grp/x", "--mask-key",
               "m") == 0
    assert_same(read_output(out / "g.h5")[0], expected_output(weights, pair))
    assert "no mask 'm'; computed without a mask" in capsys.readouterr().err
    assert cli(weights_file, out, tmp_path / "g.h5", "--overwrite") == 1
    assert ("no dataset 'pair' in the file (it holds 'grp/x'); choose one with --pair-key"
            in capsys.readouterr().err)


def test_folder_without_recursive_takes_one_level(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src) == 0
    assert all_files(out) == ["a.h5", "b.h5", "c.h5", "d.h5"]
    empty = tmp_path / "empty"
    (empty / "deeper").mkdir(parents=True)
    assert cli(weights_file, out, empty) == 1
    assert "add --recursive" in capsys.readouterr().err


def test_progress_logs_without_tqdm(dataset, weights_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "tqdm_or_none", lambda: None)
    src, _ = dataset
    assert cli(weights_file, tmp_path / "out", src) == 0
    err = capsys.readouterr().err
    assert "[4/4 files]" in err and "pairs/s" in err and "ETA" in err


# --- resume, overwrite, atomic writes -------------------------------------------------------

def mtimes(folder):
    return {p: os.stat(pathlib.Path(folder) / p).st_mtime_ns for p in all_files(folder)}


def age(folder):
    """Set every file's mtime an hour back, so a rewrite shows whatever the clock."""
    for p in all_files(folder):
        t = time.time() - 3600
        os.utime(pathlib.Path(folder) / p, (t, t))


def test_resume_skips_complete_outputs(dataset, weights, weights_file, tmp_path, capsys):
    src, items = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src, "-r") == 0
    age(out)
    old = mtimes(out)
    os.remove(out / "c.h5")
    capsys.readouterr()
    assert cli(weights_file, out, src, "-r") == 0
    err = capsys.readouterr().err
    assert "resuming: 5 of 6 outputs exist already" in err
    assert "6 files: 1 computed, 5 skipped, 0 failed" in err
    new = mtimes(out)
    assert {p: t for p, t in new.items() if p != "c.h5"} == {
        p: t for p, t in old.items() if p != "c.h5"}
    assert_same(read_output(out / "c.h5")[0], expected_output(weights, *items["c.npz"]))


def test_overwrite_recomputes(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src) == 0
    age(out)
    old = mtimes(out)
    assert cli(weights_file, out, src, "--overwrite") == 0
    new = mtimes(out)
    assert new.keys() == old.keys() and all(new[p] > old[p] for p in new)
    assert "4 files: 4 computed, 0 skipped" in capsys.readouterr().err


def test_resume_warns_about_outputs_of_other_weights(dataset, weights_file, tmp_path,
                                                     capsys):
    src, _ = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src / "a.npy") == 0
    other = tmp_path / "other.h5"
    save_weights(random_weights(D, H, seed=99), other)
    assert cli(other, out, src / "a.npy") == 0
    assert "made with other weights or options and were kept" in capsys.readouterr().err


def crash_on(name, exc):
    """A stand-in for cli_io._write_hdf5 that writes part of the file for `name`, then
    raises `exc` (as a crash mid-write would); other files are written normally."""
    real = cli_io._write_hdf5

    def writer(tmp, out, attrs):
        if os.path.basename(tmp).startswith(f".{name}."):
            with open(tmp, "wb") as f:
                f.write(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)  # half a file
            assert os.path.exists(tmp)
            raise exc
        return real(tmp, out, attrs)
    return writer


def test_crash_mid_write_leaves_no_output_and_no_temp(dataset, weights, weights_file,
                                                      tmp_path, monkeypatch, capsys):
    src, items = dataset
    out = tmp_path / "out"
    monkeypatch.setattr(cli_io, "_write_hdf5", crash_on("b.h5", OSError("simulated crash")))
    assert cli(weights_file, out, src) == 1
    assert all_files(out) == ["a.h5", "c.h5", "d.h5"]  # no b.h5, no .b.h5.*.tmp
    assert_same(read_output(out / "a.h5")[0], expected_output(weights, *items["a.npy"]))
    err = capsys.readouterr().err
    assert "b.npy: cannot write the output" in err and "simulated crash" in err
    assert "4 files: 3 computed, 0 skipped, 1 failed" in err
    monkeypatch.undo()
    assert cli(weights_file, out, src) == 0  # the rerun completes the missing one
    assert all_files(out) == ["a.h5", "b.h5", "c.h5", "d.h5"]


def test_crash_while_overwriting_keeps_the_earlier_output(dataset, weights_file, tmp_path,
                                                          monkeypatch):
    src, _ = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src) == 0
    before = sha(out / "b.h5")
    monkeypatch.setattr(cli_io, "_write_hdf5", crash_on("b.h5", OSError("disk gone")))
    assert cli(weights_file, out, src, "--overwrite") == 1
    assert sha(out / "b.h5") == before  # intact: the new one was never renamed over it
    assert all_files(out) == ["a.h5", "b.h5", "c.h5", "d.h5"]


def test_interrupt_mid_write_stops_cleanly_and_resumes(dataset, weights_file, tmp_path,
                                                       monkeypatch, capsys):
    src, _ = dataset
    out = tmp_path / "out"
    monkeypatch.setattr(cli_io, "_write_hdf5", crash_on("b.h5", KeyboardInterrupt()))
    assert cli(weights_file, out, src) == pipeline.EXIT_INTERRUPTED
    files = all_files(out)
    assert "b.h5" not in files and not any(f.endswith(".tmp") for f in files)
    assert "run the same command again to resume" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli(weights_file, out, src) == 0
    assert all_files(out) == ["a.h5", "b.h5", "c.h5", "d.h5"]


def test_ctrl_c_signal_finishes_the_file_in_hand(tmp_path, weights_file):
    """A real SIGINT while an output is being written: that file is completed, the rest
    is not started, no temporary file is left, exit status 130."""
    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(3)
    for i in range(4):
        np.save(src / f"x{i}.npy", make_pair(rng, 4, 4))
    out = tmp_path / "out"
    script = f"""
import sys, time
from triattn_cupy.cli import io as cli_io, main as cli_main
real = cli_io._write_hdf5
def slow(tmp, out, attrs):
    real(tmp, out, attrs)
    time.sleep(1.5)  # the temporary file exists, complete but not yet renamed
cli_io._write_hdf5 = slow
sys.exit(cli_main.main([{str(src)!r}, "-o", {str(out)!r}, "--weights", {str(weights_file)!r},
                     "--device", "cpu", "-q"]))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    # A shell without job control starts background jobs with SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler: give the child the default disposition a
    # user's terminal would, whatever this test process inherited.
    proc = subprocess.Popen([sys.executable, "-c", script], env=env,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 30
    while time.time() < deadline and not (out.exists() and any(
            p.name.endswith(".tmp") for p in out.iterdir())):
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == pipeline.EXIT_INTERRUPTED, err
    files = all_files(out)
    assert files == ["x0.h5"], (files, err)  # finished, then stopped; nothing half-written
    assert "interrupted" in err


# --- bad inputs -----------------------------------------------------------------------------

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
        "int.npy": "pair has dtype int64; expected float32 or float64",
        "not_square.npy": "pair must be square in its two middle axes (N, N); got (5, 6, 16)",
    }
    for name, reason in reasons.items():
        assert f"{src / name}: {reason}" in err, (name, err)
    assert f"{tmp_path / 'missing.npy'}: no such file or folder" in err
    assert "15 files: 1 computed, 0 skipped, 14 failed" in err


def test_unusable_weights_is_a_setup_error(dataset, tmp_path, capsys):
    src, _ = dataset
    bad = tmp_path / "w.h5"
    bad.write_bytes(b"not hdf5")
    assert cli(bad, tmp_path / "out", src) == 2
    assert "cannot use --weights" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_wrong_d_for_the_default_weights(dataset, tmp_path, capsys):
    src, _ = dataset  # D=16 inputs; the default weights have D=128
    assert cli_main.main([str(src / "a.npy"), "-o", str(tmp_path / "out"), "--device",
                       "cpu"]) == 1
    assert "pair_dim 128; got 16" in capsys.readouterr().err


# --- refusals -------------------------------------------------------------------------------

def test_output_over_input_is_refused(weights_file, tmp_path, capsys):
    rng = np.random.default_rng(5)
    src = tmp_path / "in"
    src.mkdir()
    write_h5(src / "x.h5", pair=make_pair(rng, 4, 4))
    np.save(src / "y.npy", make_pair(rng, 4, 4))
    before = {p: sha(src / p) for p in all_files(src)}
    assert cli(weights_file, src, src) == 1  # x.h5 -> x.h5: itself
    err = capsys.readouterr().err
    assert f"its output {src / 'x.h5'} would overwrite the input {src / 'x.h5'}" in err
    assert all_files(src) == ["x.h5", "y.h5", "y.npy"]
    assert {p: sha(src / p) for p in ["x.h5", "y.npy"]} == before
    assert cli(weights_file, src, src, "--output-format", "npy") == 1  # y.npy -> y.npy
    assert "would overwrite the input" in capsys.readouterr().err
    assert sha(src / "y.npy") == before["y.npy"]


def test_outputs_among_inputs_are_not_inputs(weights_file, tmp_path, capsys):
    rng = np.random.default_rng(6)
    src = tmp_path / "in"
    src.mkdir()
    np.save(src / "y.npy", make_pair(rng, 4, 4))
    assert cli(weights_file, src, src) == 0  # y.npy -> y.h5 beside it
    capsys.readouterr()
    assert cli(weights_file, src, src) == 0  # y.h5 is recognised as an output: skipped
    assert "2 files: 0 computed, 2 skipped, 0 failed" in capsys.readouterr().err
    nested = src / "out"  # an output folder inside a recursively searched input folder
    assert cli(weights_file, nested, src, "-r") == 0
    assert cli(weights_file, nested, src, "-r") == 0  # out/ itself is not searched
    assert all_files(nested) == ["y.h5"]
    assert "0 failed" in capsys.readouterr().err


def test_foreign_file_at_output_path_is_kept(weights_file, tmp_path, capsys):
    rng = np.random.default_rng(7)
    np.save(tmp_path / "z.npy", make_pair(rng, 4, 4))
    out = tmp_path / "out"
    out.mkdir()
    write_h5(out / "z.h5", something=np.arange(3))
    before = sha(out / "z.h5")
    assert cli(weights_file, out, tmp_path / "z.npy", "--overwrite") == 1
    assert "exists and is not an output of triattn-infer; refusing to replace it" in (
        capsys.readouterr().err)
    assert sha(out / "z.h5") == before


def test_name_collision_is_refused(weights_file, tmp_path, capsys):
    rng = np.random.default_rng(8)
    src = tmp_path / "in"
    src.mkdir()
    np.save(src / "p.npy", make_pair(rng, 4, 4))
    np.savez(src / "p.npz", pair=make_pair(rng, 4, 4))
    assert cli(weights_file, tmp_path / "out", src) == 1
    assert "is also the output of" in capsys.readouterr().err
    assert all_files(tmp_path / "out") == ["p.h5"]


# --- flags and devices ----------------------------------------------------------------------

def test_parse_devices():
    assert parse_devices("0") == [0]
    assert parse_devices(" 0, 2,1 ") == [0, 2, 1]
    for bad, match in [("", "comma-separated"), ("0,,1", "comma-separated"),
                       ("a", "non-negative integers"), ("-1", "non-negative integers"),
                       ("1.5", "non-negative integers"), ("0,1,0", "listed twice")]:
        with pytest.raises(ValueError, match=match):
            parse_devices(bad)


@pytest.mark.parametrize("value, message", [
    ("x", "non-negative integers"), ("0,0", "GPU 0 is listed twice"),
    ("-1", "non-negative integers"), ("0,", "comma-separated")])
def test_devices_flag_syntax(dataset, weights_file, tmp_path, capsys, value, message):
    src, _ = dataset
    assert cli_main.main([str(src), "-o", str(tmp_path / "o"), "--devices", value]) == 2
    err = capsys.readouterr().err
    assert "argument --devices" in err and message in err


def test_devices_with_cpu_is_refused(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    assert cli(weights_file, tmp_path / "o", src, "--devices", "0") == 2
    assert "cannot be combined with --device cpu" in capsys.readouterr().err


class FakeGpuBackend(CpuBackend):
    """Stands in for GpuBackend (NumPy underneath), so the multi-device scheduling runs on
    any machine; the sleep makes each worker hold a file long enough for both to work."""

    kind = "gpu"

    def __init__(self, weights, device, fully_masked, precision=None, where=None):
        super().__init__(weights, fully_masked)
        self.device = device
        self.label = f"GPU {device} (fake)"

    def compute(self, loaded):
        time.sleep(0.05)
        return super().compute(loaded)


@pytest.fixture
def two_fake_gpus(monkeypatch):
    monkeypatch.setattr(pipeline, "gpu_probe", lambda: (2, ""))
    monkeypatch.setattr(pipeline, "GpuBackend", FakeGpuBackend)


def test_devices_spread_files_over_workers(two_fake_gpus, dataset, weights, weights_file,
                                           tmp_path, capsys):
    src, items = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src, "-r", "--devices", "1,0", device=None) == 0
    used = set()
    for rel, (pair, mask) in items.items():
        got, attrs = read_output(out / (os.path.splitext(rel)[0] + ".h5"))
        assert_same(got, expected_output(weights, pair, mask))
        used.add(attrs["device"])
    assert used == {"GPU 0 (fake)", "GPU 1 (fake)"}
    err = capsys.readouterr().err
    assert "6 files: 6 computed" in err
    assert "GPU 1 (fake): " in err and "GPU 0 (fake): " in err
    assert cli(weights_file, out, src, "--devices", "all", "--overwrite", device=None) == 0


def test_devices_must_exist(two_fake_gpus, dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    assert cli(weights_file, tmp_path / "o", src, "--devices", "0,2", device=None) == 2
    assert ("--devices: GPU 2 does not exist; this machine has 2 CUDA devices, indices 0 "
            "to 1") in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(gpu_probe()[0] > 0, reason="checks the error on a machine without GPU")
@pytest.mark.parametrize("flags, name", [(["--devices", "0,1"], "--devices"),
                                         (["--device", "gpu"], "--device gpu")])
def test_gpu_flags_without_gpu_fail_clearly(dataset, weights_file, tmp_path, capsys, flags,
                                            name):
    src, _ = dataset
    assert cli(weights_file, tmp_path / "o", src, *flags, device=None) == 2
    err = capsys.readouterr().err
    assert f"{name} needs a CUDA GPU, but none is usable" in err and "--device cpu" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(gpu_probe()[0] > 0, reason="checks the CPU fallback")
def test_auto_falls_back_to_cpu_in_one_line(dataset, weights, weights_file, tmp_path,
                                            capsys):
    src, items = dataset
    assert cli(weights_file, tmp_path / "o", src / "a.npy", device=None) == 0
    err = capsys.readouterr().err
    assert err.count("running on the CPU with the NumPy backend") == 1
    assert_same(read_output(tmp_path / "o" / "a.h5")[0],
                expected_output(weights, items["a.npy"][0]))


@pytest.mark.skipif(precision_support()[0] is None, reason="no precision modes yet")
def test_precision_other_than_fp32_needs_gpu(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    low = [p for p in precision_support()[0] if p != "fp32"][0]
    assert cli(weights_file, tmp_path / "o", src, "--precision", low) == 2
    assert "needs the GPU backend" in capsys.readouterr().err


def test_output_dir_must_be_a_folder(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    (tmp_path / "file").write_text("x")
    assert cli(weights_file, tmp_path / "file", src) == 2
    assert "exists and is not a folder" in capsys.readouterr().err


def test_usage_errors(tmp_path, capsys):
    assert cli_main.main([]) == 2
    assert "no INPUT given" in capsys.readouterr().err
    assert cli_main.main([str(tmp_path)]) == 2
    assert "--output-dir is required" in capsys.readouterr().err
    assert cli_main.main(["--help"]) == 0
    assert "--output-dir" in capsys.readouterr().out


def test_python_m_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "triattn_cupy", "--help"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m triattn_cupy" in proc.stdout
    for flag in ("--output-dir", "--recursive", "--pair-key", "--mask-key", "--weights",
                 "--fully-masked", "--output-format", "--overwrite", "--device",
                 "--devices", "--quiet", "--demo"):
        assert flag in proc.stdout


def test_demo_on_cpu(capsys, tmp_path):
    assert cli_main.main(["--demo", "--device", "cpu", "-o", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "relative L2 error" in out and ": OK" in out and "Demo passed" in out
    assert "pair positions/s" in out and "CPU" in out
    assert all_files(tmp_path / "demo") == ["b2_n16_masked.h5", "n24.h5", "n37.h5",
                                            "n45_masked.h5"]


# --- GPU ------------------------------------------------------------------------------------

def gpu_count():
    return gpu_probe()[0]


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="no CUDA GPU")
def test_gpu_outputs_equal_the_library_call(dataset, weights, weights_file, tmp_path,
                                            capsys):
    import cupy as cp

    src, items = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src, "-r", device="gpu") == 0
    module = triattn_cupy.TriangleAttention(weights, device=0)
    for rel, (pair, mask) in items.items():
        got, attrs = read_output(out / (os.path.splitext(rel)[0] + ".h5"))
        d_mask = None if mask is None else cp.asarray(mask)
        want = module(cp.asarray(pair.astype(np.float32)), d_mask).get()
        assert_same(got, want)
        assert rel_l2(got, reference.triangle_attention(pair, mask, weights)) < 1e-5
        assert attrs["device"].startswith("GPU 0")
    assert "GPU 0" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="no CUDA GPU")
def test_gpu_device_index_must_exist(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    n = gpu_count()
    assert cli(weights_file, tmp_path / "o", src, "--devices", f"0,{n}", device=None) == 2
    assert f"GPU {n} does not exist; this machine has {n} CUDA device" in (
        capsys.readouterr().err)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="no CUDA GPU")
def test_gpu_out_of_memory_fails_that_file_only(dataset, weights_file, tmp_path,
                                                monkeypatch, capsys):
    import cupy as cp

    src, _ = dataset
    real = triattn_cupy.TriangleAttention.__call__

    def call(self, pair, mask=None, **kw):
        if pair.shape == (2, 5, 5, D):  # b.npy
            raise cp.cuda.memory.OutOfMemoryError(1 << 40, 0)
        return real(self, pair, mask, **kw)

    monkeypatch.setattr(triattn_cupy.TriangleAttention, "__call__", call)
    assert cli(weights_file, tmp_path / "o", src, device="gpu") == 1
    err = capsys.readouterr().err
    assert "b.npy: too large for the memory of GPU 0" in err
    assert all_files(tmp_path / "o") == ["a.h5", "c.h5", "d.h5"]


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1 or precision_support()[0] is None,
                    reason="needs a GPU and precision modes")
@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("tf32", 1e-3), ("bf16", 5e-3)])
def test_gpu_precision_modes(dataset, weights, weights_file, tmp_path, precision, tol):
    if precision not in precision_support()[0]:
        pytest.skip(f"no precision {precision}")
    src, items = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src, "--precision", precision, device="gpu") == 0
    for rel in ("a.npy", "c.npz"):
        pair, mask = items[rel]
        got, attrs = read_output(out / (os.path.splitext(rel)[0] + ".h5"))
        assert attrs["precision"] == precision
        assert rel_l2(got, reference.triangle_attention(pair, mask, weights)) < tol


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs")
def test_two_gpus_share_the_files(dataset, weights, weights_file, tmp_path, capsys):
    import cupy as cp

    src, items = dataset
    out = tmp_path / "out"
    assert cli(weights_file, out, src, "-r", "--devices", "0,1", device=None) == 0
    used = set()
    for rel, (pair, mask) in items.items():
        got, attrs = read_output(out / (os.path.splitext(rel)[0] + ".h5"))
        used.add(attrs["device"].split(" (")[0])
        with cp.cuda.Device(0):
            want = triattn_cupy.TriangleAttention(weights, device=0)(
                cp.asarray(pair.astype(np.float32)),
                None if mask is None else cp.asarray(mask)).get()
        assert_same(got, want)
    err = capsys.readouterr().err
    assert "GPU 0" in err and "GPU 1" in err
    assert used <= {"GPU 0", "GPU 1"}


# --- the package's shape ------------------------------------------------------------------

def test_cli_modules_import_no_circle_and_stay_small():
    """The modules of triattn_cupy.cli import each other along one direction (imports
    inside functions included), and none is over 600 lines."""
    import ast

    folder = REPO / "triattn_cupy" / "cli"
    modules = {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
    edges = {}
    for name, path in modules.items():
        text = path.read_text()
        assert len(text.splitlines()) <= 600, f"{path.name}: over 600 lines"
        deps = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps |= {a.name for a in node.names}
        edges[name] = deps & set(modules)

    def visit(name, stack):
        assert name not in stack, f"import circle: {' -> '.join(stack + [name])}"
        for dep in sorted(edges[name]):
            visit(dep, stack + [name])

    for name in modules:
        visit(name, [])
