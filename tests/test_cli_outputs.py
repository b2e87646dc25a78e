"""`triattn-infer`'s outputs: resume, --overwrite, atomic writes, interruptions, and the
files it refuses to replace (inputs, files it did not write, name collisions)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from triattn_cupy import random_weights
from triattn_cupy.cli import outputs as cli_outputs
from triattn_cupy.cli import pipeline
from triattn_cupy.hdf5 import save_weights
from cli_support import (D, H, all_files, assert_same, child_env, cli,  # noqa: F401
                         dataset, expected_output, make_pair, read_output, sha,
                         start_slow_run, wait_for_temp, weights, weights_file, write_h5)


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
    """A stand-in for cli_outputs._write_hdf5 that writes part of the file for `name`, then
    raises `exc` (as a crash mid-write would); other files are written normally."""
    real = cli_outputs._write_hdf5

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
    monkeypatch.setattr(cli_outputs, "_write_hdf5",
                        crash_on("b.h5", OSError("simulated crash")))
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
    monkeypatch.setattr(cli_outputs, "_write_hdf5", crash_on("b.h5", OSError("disk gone")))
    assert cli(weights_file, out, src, "--overwrite") == 1
    assert sha(out / "b.h5") == before  # intact: the new one was never renamed over it
    assert all_files(out) == ["a.h5", "b.h5", "c.h5", "d.h5"]


def test_interrupt_mid_write_stops_cleanly_and_resumes(dataset, weights_file, tmp_path,
                                                       monkeypatch, capsys):
    src, _ = dataset
    out = tmp_path / "out"
    monkeypatch.setattr(cli_outputs, "_write_hdf5", crash_on("b.h5", KeyboardInterrupt()))
    assert cli(weights_file, out, src) == pipeline.EXIT_INTERRUPTED
    files = all_files(out)
    assert "b.h5" not in files and not any(f.endswith(".tmp") for f in files)
    assert "run the same command again to resume" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli(weights_file, out, src) == 0
    assert all_files(out) == ["a.h5", "b.h5", "c.h5", "d.h5"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_finishes_the_file_in_hand(tmp_path, weights_file, signum):
    """A real SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop) while an output is being
    written: that file is completed, as are those computed already, no other is started,
    no temporary file or claim is left, exit status 130."""
    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(3)
    for i in range(4):
        np.save(src / f"x{i}.npy", make_pair(rng, 4, 4))
    out = tmp_path / "out"
    proc = start_slow_run(src, out, weights_file, sleep=1.5)
    wait_for_temp(out, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == pipeline.EXIT_INTERRUPTED, err
    files = all_files(out)
    # x0 was being written; x1 and x2 may have been computed meanwhile (one waiting for
    # the writer, one for room in its queue); x3 was at most read, never computed.
    assert "x0.h5" in files and set(files) <= {"x0.h5", "x1.h5", "x2.h5"}, (files, err)
    for name in files:
        assert read_output(out / name)[0].shape == (4, 4, D)
    assert f"{4 - len(files)} file" in err and "not processed" in err
    assert ("interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)") in err


BLOCKED_COMPUTE = """
import os, sys, time
from triattn_cupy.cli import backends, main
real = backends.CpuBackend.compute
def compute(self, loaded):
    open(sys.argv[1], "w").close()  # computing: the test may signal now
    while not os.path.exists(sys.argv[2]):  # until the test says go
        time.sleep(0.01)
    return real(self, loaded)
backends.CpuBackend.compute = compute
sys.exit(main.main(sys.argv[3:]))
"""


def test_sigterm_while_computing_writes_that_file_then_stops(tmp_path, weights,
                                                             weights_file):
    """SIGTERM while a file is being computed: its computation finishes and its output is
    written, as the message says; the file read meanwhile is not started; exit 130."""
    src = tmp_path / "in"
    src.mkdir()
    rng = np.random.default_rng(31)
    pairs = {f"x{i}": make_pair(rng, 5, 5) for i in range(2)}
    for name, pair in pairs.items():
        np.save(src / f"{name}.npy", pair)
    out, computing, go = tmp_path / "out", tmp_path / "computing", tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_COMPUTE, str(computing), str(go), str(src), "-o",
         str(out), "--weights", str(weights_file), "--device", "cpu"],
        env=child_env(), stderr=subprocess.PIPE, text=True)
    try:
        while not computing.exists():  # the event: the first file is being computed
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        seen = []
        while not seen or "terminated (SIGTERM)" not in seen[-1]:  # the handler ran
            seen.append(proc.stderr.readline())
            assert seen[-1], "".join(seen)
        go.touch()
        err = "".join(seen) + proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == pipeline.EXIT_INTERRUPTED, err
    assert ("finishing the file in hand (its computation and its output), starting no "
            "other, then stopping with exit status 130") in err
    assert all_files(out) == ["x0.h5"], err
    assert_same(read_output(out / "x0.h5")[0], expected_output(weights, pairs["x0"]))
    assert "1 file was not processed" in err


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


def test_unreadable_file_at_output_path_is_a_conflict(weights_file, tmp_path, capsys):
    """A file that is not even HDF5 (text named z.h5) is not an output of ours: a
    conflict, left untouched, exit 1; never "recomputed" over."""
    rng = np.random.default_rng(17)
    np.save(tmp_path / "z.npy", make_pair(rng, 4, 4))
    out = tmp_path / "out"
    out.mkdir()
    (out / "z.h5").write_text("my notes, not an HDF5 file\n")
    before = sha(out / "z.h5")
    for flags in ([], ["--overwrite"]):
        assert cli(weights_file, out, tmp_path / "z.npy", *flags) == 1
        err = capsys.readouterr().err
        assert (f"{out / 'z.h5'} exists and is not an output of triattn-infer (it cannot be "
                f"read as HDF5 (") in err and "refusing to replace it (conflict)" in err
        assert "will be recomputed" not in err
        assert sha(out / "z.h5") == before and all_files(out) == ["z.h5"]


def test_name_collision_is_refused(weights_file, tmp_path, capsys):
    rng = np.random.default_rng(8)
    src = tmp_path / "in"
    src.mkdir()
    np.save(src / "p.npy", make_pair(rng, 4, 4))
    np.savez(src / "p.npz", pair=make_pair(rng, 4, 4))
    assert cli(weights_file, tmp_path / "out", src) == 1
    assert "is also the output of" in capsys.readouterr().err
    assert all_files(tmp_path / "out") == ["p.h5"]


# --- names and messages ---------------------------------------------------------------------

@pytest.mark.parametrize("output_format", ["hdf5", "npy"])
def test_non_utf8_file_names_are_recorded_as_bytes(weights, weights_file, tmp_path,
                                                   output_format):
    """A file name that is not UTF-8 (Latin-1 here) gives an output whose provenance
    records the input's path: as its bytes in HDF5, surrogate-escaped in the .npy's JSON
    record (json's \\udcXX escapes), which os.fsencode turns back into the bytes."""
    rng = np.random.default_rng(19)
    folder = os.fsencode(tmp_path)
    name = b"caf\xe9"
    pair = make_pair(rng, 4, 4)
    with open(os.path.join(folder, name + b".npy"), "wb") as f:
        np.save(f, pair)
    out = tmp_path / "out"
    assert cli(weights_file, out, os.fsdecode(os.path.join(folder, name + b".npy")),
               "--output-format", output_format) == 0
    suffix = b".h5" if output_format == "hdf5" else b".npy"
    path = os.path.join(os.fsencode(out), name + suffix)
    got, attrs = read_output(os.fsdecode(path))
    assert_same(got, expected_output(weights, pair))
    if output_format == "hdf5":
        recorded = attrs["input_file"]
    else:
        import json
        with open(path + b".json", encoding="utf-8") as f:
            recorded = os.fsencode(json.load(f)["input_file"])
    assert recorded == os.path.join(folder, name + b".npy")


def test_a_multi_line_error_keeps_one_line_in_the_summary(dataset, weights_file, tmp_path,
                                                          monkeypatch, capsys):
    """HDF5's error text runs over several lines; the summary keeps one line per file."""
    from triattn_cupy.cli import filejob, io as cli_io

    src, _ = dataset
    real = filejob.read_input

    def read_input(path, *args, **kwargs):
        if path.endswith("b.npy"):
            raise cli_io.InputError("cannot read the hdf5 file: Unable to open\n"
                                    "  (file signature not found)\n  major: File accessibility")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(filejob, "read_input", read_input)
    assert cli(weights_file, tmp_path / "out", src) == 1
    err = capsys.readouterr().err
    summary = err[err.index("1 file failed:"):]
    assert summary.splitlines()[1] == (
        f"  {src / 'b.npy'}: cannot read the hdf5 file: Unable to open (file signature not "
        f"found) major: File accessibility")
    assert len(summary.strip().splitlines()) == 2
