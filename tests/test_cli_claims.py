"""Several `triattn-infer` runs on one batch, and runs that end badly: claims split the
files, temporary files and claims of runs that have ended are removed, and .npy outputs
carry a provenance record so that a foreign .npy is a conflict, never overwritten."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

from triattn_cupy.cli import claims as cli_claims
from triattn_cupy.cli import outputs as cli_outputs
from triattn_cupy.cli import runfiles
from cli_support import (all_files, child_env, cli, dataset,  # noqa: F401
                         expected_output, make_pair, read_output, sha, start_slow_run,
                         wait_for_temp, weights, weights_file)


def dead_pid() -> int:
    """The id of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_claim(path, host, pid, age=0.0, **fields):
    """A claim record as a run writes it, naming `host` and `pid` (the process's start
    and the boot of this host, unless `fields` say otherwise), of another run."""
    record = {"host": host, "boot": runfiles.boot_id(), "pid": pid,
              "pid_start": runfiles.process_start(pid), "run": "another run",
              "started": time.time(), "token": "x", **fields}
    path.write_text(json.dumps(record))
    t = time.time() - age
    os.utime(path, (t, t))


# --- claims -------------------------------------------------------------------------------

def test_claim_is_exclusive_and_released(tmp_path):
    out = str(tmp_path / "a.h5")
    with cli_claims.Claims() as mine:
        assert mine.acquire(out) is None
        record = json.loads((tmp_path / ".a.h5.claim").read_text())
        assert record["pid"] == os.getpid() and record["host"] == runfiles.host_token()
        assert "claimed by this run already" in mine.acquire(out)
        mine.release(out)
        assert not (tmp_path / ".a.h5.claim").exists()
        assert mine.acquire(out) is None
    assert not (tmp_path / ".a.h5.claim").exists()  # leaving releases what is held


def test_claim_of_a_live_process_is_respected_and_of_a_dead_one_taken_over(tmp_path):
    out = str(tmp_path / "a.h5")
    claim = tmp_path / ".a.h5.claim"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_claim(claim, runfiles.host_token(), holder.pid, age=10_000)
        with cli_claims.Claims(timeout=1) as mine:
            why = mine.acquire(out)
            assert why and f"being computed by another run (host {runfiles.host_token()}, " \
                           f"process {holder.pid}" in why
    finally:
        holder.kill()
        holder.wait()
    with cli_claims.Claims() as mine:  # the same claim, its process gone: taken over
        assert mine.acquire(out) is None
        assert json.loads(claim.read_text())["pid"] == os.getpid()


def test_claim_from_another_host_expires_after_the_timeout(tmp_path):
    out = str(tmp_path / "a.h5")
    claim = tmp_path / ".a.h5.claim"
    write_claim(claim, "elsewhere", 1, age=5)
    with cli_claims.Claims(timeout=60) as mine:
        assert "being computed by another run (host elsewhere" in mine.acquire(out)
    write_claim(claim, "elsewhere", 1, age=120)
    with cli_claims.Claims(timeout=60) as mine:
        assert mine.acquire(out) is None


def test_unreadable_claim_is_respected_while_young(tmp_path):
    out = str(tmp_path / "a.h5")
    claim = tmp_path / ".a.h5.claim"
    claim.write_bytes(b"")
    with cli_claims.Claims(timeout=60) as mine:
        assert "being written" in mine.acquire(out)
    t = time.time() - 3600
    os.utime(claim, (t, t))
    with cli_claims.Claims(timeout=60) as mine:
        assert mine.acquire(out) is None


def test_held_claims_are_refreshed(tmp_path):
    out = str(tmp_path / "a.h5")
    with cli_claims.Claims(timeout=1.0) as mine:  # refreshed every 0.1 s
        assert mine.acquire(out) is None
        t = time.time() - 3600
        os.utime(tmp_path / ".a.h5.claim", (t, t))
        time.sleep(0.5)
        assert time.time() - os.stat(tmp_path / ".a.h5.claim").st_mtime < 0.5


# A process that claims and releases one output as fast as it can, to be killed at any
# instant of a claim.
CLAIM_LOOP = """
import sys
from triattn_cupy.cli import claims
held = claims.Claims()
print("claiming", flush=True)
while True:
    if held.acquire(sys.argv[1]) is None:
        held.release(sys.argv[1])
"""


def test_a_run_killed_while_claiming_never_leaves_a_claim_in_the_way(tmp_path):
    """Killed at any instant, a run leaves no claim or one naming it (never a half-written
    one, which would look like a claim being written and hold its output back); what it
    leaves is removed or taken over at once by the next run."""
    out = str(tmp_path / "a.h5")
    for kill in range(16):
        proc = subprocess.Popen([sys.executable, "-c", CLAIM_LOOP, out],
                                stdout=subprocess.PIPE, text=True, env=child_env())
        assert proc.stdout.readline() == "claiming\n"
        time.sleep(0.02 + 0.01 * (kill % 7))
        proc.kill()
        proc.communicate()
        runfiles.remove_left_behind(str(tmp_path), 600)
        with cli_claims.Claims() as mine:
            assert mine.acquire(out) is None, f"kill {kill}"
        assert os.listdir(tmp_path) == []


def test_claim_temporary_file_is_held_in_live_temps_while_it_exists(tmp_path, monkeypatch):
    """A cluster worker records the claim's temporary file (as its temporary outputs)
    from before it is created until it is removed, so the client can remove it after the
    worker was killed in between."""
    seen = []

    class Recorder:
        def add(self, name):
            seen.append(("add", name, os.path.exists(name)))

        def discard(self, name):
            seen.append(("discard", name, os.path.exists(name)))

    real_link = os.link

    def link(src, dst):
        seen.append(("link", src, os.path.exists(src)))
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link)
    out = str(tmp_path / "a.h5")
    with cli_claims.Claims() as mine:
        assert mine.acquire(out, Recorder()) is None
    temp = seen[0][1]
    assert seen == [("add", temp, False), ("link", temp, True), ("discard", temp, False)]
    assert os.path.basename(temp).startswith(".a.h5.claim.") and temp.endswith(".tmp")
    assert runfiles._TEMP_NAME.match(os.path.basename(temp))["pid"] == str(os.getpid())


def test_claim_is_written_in_place_where_there_are_no_hard_links(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    out = str(tmp_path / "a.h5")
    with cli_claims.Claims() as mine:
        assert mine.acquire(out) is None
        assert os.listdir(tmp_path) == [".a.h5.claim"]  # no temporary file left
        assert json.loads((tmp_path / ".a.h5.claim").read_text())["pid"] == os.getpid()
        assert "claimed by this run already" in mine.acquire(out)
    assert os.listdir(tmp_path) == []


def test_claim_link_that_reports_an_error_but_was_made_counts(tmp_path, monkeypatch):
    """NFS: a retried link whose first reply was lost reports EEXIST, yet made the name."""
    real_link = os.link

    def link_with_lost_reply(src, dst):
        real_link(src, dst)
        raise FileExistsError(errno.EEXIST, "File exists")

    monkeypatch.setattr(os, "link", link_with_lost_reply)
    out = str(tmp_path / "a.h5")
    with cli_claims.Claims() as mine:
        assert mine.acquire(out) is None
        assert os.listdir(tmp_path) == [".a.h5.claim"]
    assert os.listdir(tmp_path) == []


def summary_counts(err):
    match = re.search(r"(\d+) files?: (\d+) computed, (\d+) skipped, (\d+) failed", err)
    assert match, err
    return tuple(int(g) for g in match.groups())


def test_two_runs_split_one_batch(tmp_path, weights, weights_file):
    """Two processes started together on the same folders: every file is computed once,
    by one of them, and both exit 0."""
    rng = np.random.default_rng(21)
    src = tmp_path / "in"
    src.mkdir()
    pairs = {}
    for i in range(8):
        pairs[f"x{i}"] = make_pair(rng, 5, 5)
        np.save(src / f"x{i}.npy", pairs[f"x{i}"])
    out = tmp_path / "out"
    procs = [start_slow_run(src, out, weights_file, sleep=0.3) for _ in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    computed = [summary_counts(err)[1] for err in errs]
    assert sum(computed) == 8 and min(computed) >= 1, (computed, errs)
    assert all_files(out) == [f"x{i}.h5" for i in range(8)]  # no claim, no temporary
    for name, pair in pairs.items():
        np.testing.assert_allclose(read_output(out / f"{name}.h5")[0],
                                   expected_output(weights, pair), rtol=1e-6, atol=1e-6)


# --- what runs that ended leave behind ----------------------------------------------------

def test_stale_temporaries_and_claims_are_removed(dataset, weights_file, tmp_path, capsys):
    src, _ = dataset
    out = tmp_path / "out"
    out.mkdir()
    me = runfiles.host_token()
    dead = dead_pid()
    stale = [f".a.h5.{me}-{dead}-0123abcd.tmp",            # this host, process gone
             ".b.h5.elsewhere-7-0123abcd.tmp",             # another host, old
             ".c.h5.0123456789ab.tmp"]                     # no writer named, old
    kept = [f".d.h5.{me}-{os.getpid()}-0123abcd.tmp",      # a live process
            ".a.h5.elsewhere-8-0123abcd.tmp",             # another host, recent
            ".notes.tmp"]                                  # not ours
    old = time.time() - 7200
    for name in stale + kept:
        (out / name).write_bytes(b"partial")
        if "elsewhere-8" not in name:
            os.utime(out / name, (old, old))
    write_claim(out / ".b.h5.claim", me, dead)
    assert cli(weights_file, out, src) == 0
    files = all_files(out)
    assert not set(stale) & set(files) and ".b.h5.claim" not in files
    assert set(kept) <= set(files)
    assert {"a.h5", "b.h5", "c.h5", "d.h5"} <= set(files)
    assert "removed 3 temporary files left by runs that have ended" in (
        capsys.readouterr().err)


def test_after_sigkill_the_next_run_cleans_up_and_completes(tmp_path, weights_file):
    """SIGKILL mid-write leaves a temporary file and a claim; the next run removes both
    (their process is gone) and computes what is missing."""
    rng = np.random.default_rng(22)
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        np.save(src / f"x{i}.npy", make_pair(rng, 4, 4))
    out = tmp_path / "out"
    proc = start_slow_run(src, out, weights_file, sleep=30)
    wait_for_temp(out, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    left = all_files(out)
    assert any(f.endswith(".tmp") for f in left) and any(f.endswith(".claim") for f in left)
    assert cli(weights_file, out, src) == 0
    assert all_files(out) == ["x0.h5", "x1.h5", "x2.h5"]


# --- provenance of .npy outputs -----------------------------------------------------------

def test_npy_outputs_resume_and_are_not_inputs(weights_file, tmp_path, capsys):
    rng = np.random.default_rng(23)
    src = tmp_path / "in"
    src.mkdir()
    np.savez(src / "a.npz", pair=make_pair(rng, 4, 4))
    assert cli(weights_file, src, src, "--output-format", "npy") == 0  # a.npy beside a.npz
    before = sha(src / "a.npy")
    capsys.readouterr()
    assert cli(weights_file, src, src, "--output-format", "npy") == 0
    err = capsys.readouterr().err
    # a.npz: output exists (resumed); a.npy: our output, not an input; a.npy.json unseen.
    assert "2 files: 0 computed, 2 skipped, 0 failed" in err
    assert "not taken as input" not in err
    assert sha(src / "a.npy") == before


def test_foreign_npy_is_a_conflict(weights_file, tmp_path, capsys):
    """A .npy this tool did not write (no record) is neither taken as done nor replaced,
    with or without --overwrite; nor is one of ours changed since (checksum)."""
    rng = np.random.default_rng(24)
    np.save(tmp_path / "z.npy", make_pair(rng, 4, 4))
    out = tmp_path / "out"
    out.mkdir()
    np.save(out / "z.npy", np.arange(3.0))
    before = sha(out / "z.npy")
    for flags in ([], ["--overwrite"]):
        assert cli(weights_file, out, tmp_path / "z.npy", "--output-format", "npy",
                   *flags) == 1
        assert ("z.npy exists and has no provenance record of triattn-infer (z.npy.json) "
                "or does not match it; refusing to replace it (conflict)") in (
            capsys.readouterr().err)
        assert sha(out / "z.npy") == before and all_files(out) == ["z.npy"]

    os.remove(out / "z.npy")
    assert cli(weights_file, out, tmp_path / "z.npy", "--output-format", "npy") == 0
    data = bytearray((out / "z.npy").read_bytes())
    data[-1] ^= 1  # same size, other contents
    (out / "z.npy").write_bytes(bytes(data))
    changed = sha(out / "z.npy")
    assert cli(weights_file, out, tmp_path / "z.npy", "--output-format", "npy",
               "--overwrite") == 1
    assert "refusing to replace it (conflict)" in capsys.readouterr().err
    assert sha(out / "z.npy") == changed


def test_npy_record_written_before_the_array(tmp_path, monkeypatch):
    """A crash between the two renames leaves an array with no record of its own: the
    record goes first, so the state is then "broken" (recomputed), never "foreign"."""
    path = str(tmp_path / "o.npy")
    cli_outputs.write_output(path, np.ones((2, 2, 2, 4), np.float32), "npy", {"k": "v"})
    assert cli_outputs.existing_output_state(path, "npy", verify=True)[0] == "complete"
    real = os.replace
    calls = []

    def replace(src, dst):
        calls.append(os.path.basename(dst))
        if dst == path:
            raise OSError("power cut")
        return real(src, dst)

    monkeypatch.setattr(cli_outputs.os, "replace", replace)
    try:
        cli_outputs.write_output(path, np.zeros((3, 3, 3, 4), np.float32), "npy", {})
    except OSError:
        pass
    monkeypatch.undo()
    assert calls == ["o.npy.json", "o.npy"]
    assert cli_outputs.existing_output_state(path, "npy")[0] == "broken"
    assert sorted(os.listdir(tmp_path)) == ["o.npy", "o.npy.json"]  # no temporary left


def test_a_claim_that_cannot_be_made_fails_its_file(dataset, weights_file, tmp_path,
                                                    monkeypatch, capsys):
    """A claim that cannot be made (a folder that cannot be written) fails its file with
    the reason; the other files go on, and none is lost."""
    src, _ = dataset
    real = cli_claims.Claims.acquire

    def acquire(self, output, live_temps=None):
        if output.endswith("b.h5"):
            raise PermissionError(13, "Permission denied", output)
        return real(self, output, live_temps)

    monkeypatch.setattr(cli_claims.Claims, "acquire", acquire)
    out = tmp_path / "out"
    assert cli(weights_file, out, src) == 1
    err = capsys.readouterr().err
    assert "4 files: 3 computed, 0 skipped, 1 failed" in err
    assert "b.npy: cannot claim the output" in err and "Permission denied" in err
    assert all_files(out) == ["a.h5", "c.h5", "d.h5"]


def test_no_file_vanishes_when_a_thread_stops(dataset, weights_file, tmp_path, monkeypatch,
                                              capsys):
    """An internal error that stops the reader thread: the files it never reached are
    reported failed, not left out of the summary (exit status 1, not 0)."""
    from triattn_cupy.cli import pipeline

    src, _ = dataset
    real = pipeline._Pipeline._claim

    def claim(self, task):
        if task.input.endswith("b.npy"):
            raise RuntimeError("simulated bug")
        return real(self, task)

    monkeypatch.setattr(pipeline._Pipeline, "_claim", claim)
    assert cli(weights_file, tmp_path / "out", src) == 1
    err = capsys.readouterr().err
    assert "reader thread 0 stopped by an internal error" in err and "simulated bug" in err
    assert "4 files: 1 computed, 0 skipped, 3 failed" in err
    assert err.count("not processed: an internal error stopped a pipeline thread") >= 3
