"""Several `triattn-infer` runs on one batch, and runs that end badly: claims split the
files, temporary files and claims of runs that have ended are removed, and .npy outputs
carry a provenance record so that a foreign .npy is a conflict, never overwritten."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

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


# --- claims after a restart, and claims no run can judge -------------------------------

def test_a_claim_naming_this_process_from_another_run_is_not_ours(tmp_path):
    """A container restarted with the same host name gives its new run the process id of
    the old one: a claim naming this host and this process that another run made (its run
    id differs) is stale, taken over, never "claimed by this run already"."""
    out = str(tmp_path / "a.h5")
    claim = tmp_path / ".a.h5.claim"
    me = runfiles.host_token()
    for record in ({},  # the earlier run's record: all but the run id as ours
                   {"pid_start": None, "boot": None},  # where /proc does not tell
                   {"run": None, "pid_start": None}):  # an older version's record
        write_claim(claim, me, os.getpid(), **record)
        with cli_claims.Claims() as mine:
            assert mine.acquire(out) is None, record
            assert json.loads(claim.read_text())["run"] == mine.run_id
            assert "claimed by this run already" in mine.acquire(out)
        assert not claim.exists()


def test_a_claim_of_a_reused_process_id_is_stale(tmp_path):
    """A claim naming a live process of this host that started at another time than the
    claim's holder (the id was reused, e.g. PID 1 of another program after a restart) is
    stale; the same process, started when the claim says, is respected."""
    out = str(tmp_path / "a.h5")
    claim = tmp_path / ".a.h5.claim"
    me = runfiles.host_token()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = runfiles.process_start(other.pid)
        assert start is not None
        write_claim(claim, me, other.pid, pid_start=start)
        with cli_claims.Claims() as mine:
            assert f"being computed by another run (host {me}, process {other.pid}" in (
                mine.acquire(out))
        for pid in (other.pid, 1):
            write_claim(claim, me, pid, pid_start=runfiles.process_start(pid) + 1)
            with cli_claims.Claims() as mine:
                assert mine.acquire(out) is None, pid
    finally:
        other.kill()
        other.wait()


def test_claims_of_another_boot_of_this_host_expire_by_age(tmp_path):
    """The same host name with another boot id is another machine (or this one before a
    reboot): its processes cannot be seen, so its claim expires by age, as another host's."""
    out = str(tmp_path / "a.h5")
    claim = tmp_path / ".a.h5.claim"
    write_claim(claim, runfiles.host_token(), dead_pid(), boot="another-boot", age=5)
    with cli_claims.Claims(timeout=60) as mine:
        assert "being computed by another run" in mine.acquire(out)
    write_claim(claim, runfiles.host_token(), dead_pid(), boot="another-boot", age=120)
    with cli_claims.Claims(timeout=60) as mine:
        assert mine.acquire(out) is None


def test_a_restarted_run_computes_what_its_earlier_self_had_claimed(dataset, weights_file,
                                                                    tmp_path, capsys):
    """The whole run, after a restart that reused this process's id: every output that
    the earlier run had claimed is computed, exit 0 (before: all skipped, exit 0)."""
    src, _ = dataset
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a", "b", "c", "d"):
        write_claim(out / f".{name}.h5.claim", runfiles.host_token(), os.getpid())
    assert cli(weights_file, out, src) == 0
    assert "4 files: 4 computed, 0 skipped, 0 failed" in capsys.readouterr().err
    assert all_files(out) == ["a.h5", "b.h5", "c.h5", "d.h5"]


def test_claims_no_run_can_judge_are_conflicts(dataset, weights_file, tmp_path, capsys):
    """A folder at a claim's name, and another host's claim dated in the future beyond the
    claim timeout, never hold their output back for ever with exit 0: each is reported by
    name as a conflict (exit 1) and left as it is; the other files are computed."""
    src, _ = dataset
    out = tmp_path / "out"
    (out / ".a.h5.claim").mkdir(parents=True)
    write_claim(out / ".b.h5.claim", "elsewhere", 7, age=-10 * 24 * 3600)
    future = os.stat(out / ".b.h5.claim").st_mtime
    assert cli(weights_file, out, src) == 1
    err = capsys.readouterr().err
    assert (f"a.npy: its claim {out / '.a.h5.claim'} is a folder, not a claim file of "
            f"triattn-infer; remove it to compute this output (conflict)") in err
    assert (f"b.npy: its claim {out / '.b.h5.claim'} (host elsewhere, process 7) is dated "
            f"864000 s in the future") in err
    assert "4 files: 2 computed, 0 skipped, 2 failed" in err
    assert all_files(out) == [".b.h5.claim", "c.h5", "d.h5"]
    assert (out / ".a.h5.claim").is_dir() and os.stat(out / ".b.h5.claim").st_mtime == future


def test_a_claim_of_this_host_dated_in_the_future_is_judged_by_its_process(tmp_path):
    """On this host the process decides, whatever the date (a clock set back): a claim of
    a process that has ended is taken over, by the sweep too."""
    out = str(tmp_path / "a.h5")
    claim = tmp_path / ".a.h5.claim"
    write_claim(claim, runfiles.host_token(), dead_pid(), age=-10 * 24 * 3600)
    assert runfiles.remove_left_behind(str(tmp_path), 60) == ([], [str(claim)])
    write_claim(claim, runfiles.host_token(), dead_pid(), age=-10 * 24 * 3600)
    with cli_claims.Claims(timeout=60) as mine:
        assert mine.acquire(out) is None


def test_long_output_names_get_claims_and_temporary_files(weights, weights_file, tmp_path):
    """An output name the filesystem takes (here 253 bytes) also gets its claim and its
    temporary names (hash-shortened), for both output formats; a .npy output whose record
    name would be too long fails at planning with the reason."""
    rng = np.random.default_rng(25)
    name = "é" * 100 + "x" * 50  # 250 bytes
    pair = make_pair(rng, 4, 4)
    np.save(tmp_path / f"{name}.npy", pair)
    out = tmp_path / "out"
    claims = runfiles.claim_path(str(out / f"{name}.h5"))
    assert len(os.fsencode(os.path.basename(claims))) <= 255
    assert claims == runfiles.claim_path(str(out / f"{name}.h5"))  # the same on every run
    temp = runfiles.temp_path_for(str(out / f"{name}.h5"))
    assert len(os.fsencode(os.path.basename(temp))) <= 255 and runfiles.is_run_file(
        os.path.basename(temp))
    assert cli(weights_file, out, tmp_path / f"{name}.npy") == 0
    assert all_files(out) == [f"{name}.h5"]
    np.testing.assert_allclose(read_output(out / f"{name}.h5")[0],
                               expected_output(weights, pair), rtol=1e-6, atol=1e-6)
    assert cli(weights_file, out, tmp_path / f"{name}.npy", "--output-format", "npy") == 1
    assert all_files(out) == [f"{name}.h5"]


def test_sweep_removes_temporaries_of_a_reused_process_id(tmp_path):
    """A temporary file naming this host and a live process id, but another start time,
    was left by an earlier process of that id: removed. One of this process: kept."""
    folder = tmp_path
    mine = runfiles.temp_path_for(str(folder / "a.h5"))
    me, pid = runfiles.host_token(), os.getpid()
    start = runfiles.process_start(pid)
    earlier = folder / f".b.h5.{me}-{pid}-s{start + 1}-0123abcd.tmp"
    for path in (mine, earlier):
        pathlib.Path(path).write_bytes(b"partial")
    temps, claims = runfiles.remove_left_behind(str(folder), 600)
    assert temps == [str(earlier)] and claims == []
    assert os.path.exists(mine)


def test_a_live_claim_of_another_run_in_this_process_is_kept(tmp_path):
    """Two runs in one process (a Dask worker's threads, the client of a local cluster):
    neither the sweep nor the other run takes a claim of a live run for stale."""
    out = str(tmp_path / "a.h5")
    with cli_claims.Claims() as first, cli_claims.Claims() as second:
        assert first.acquire(out) is None
        assert runfiles.remove_left_behind(str(tmp_path), 600) == ([], [])
        assert "being computed by another run" in second.acquire(out)
        assert json.loads((tmp_path / ".a.h5.claim").read_text())["run"] == first.run_id


UNSHARED_RUN = """
import sys
from triattn_cupy.cli import main, outputs
real = outputs._write_hdf5
def never_finishing(tmp, out, attrs):
    real(tmp, out, attrs)
    open(sys.argv[1], "w").close()  # a temporary output exists: the test kills us now
    import time
    time.sleep(600)
if sys.argv[1] != "-":
    outputs._write_hdf5 = never_finishing
sys.exit(main.main(sys.argv[2:]))
"""


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                               "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_run_restarted_in_a_new_pid_namespace_computes_everything(tmp_path,
                                                                    weights_file):
    """The restart itself: a run as PID 1 of a fresh PID namespace, killed mid-write,
    then a second run as PID 1 of another: it takes over the claim of the first (same
    host, same PID, another run), computes every file and exits 0."""
    if not _unshare_works():
        pytest.skip("unshare --pid --fork --mount-proc is not permitted here (needs root "
                    "or user namespaces)")
    rng = np.random.default_rng(26)
    src = tmp_path / "in"
    src.mkdir()
    for i in range(3):
        np.save(src / f"x{i}.npy", make_pair(rng, 4, 4))
    out, writing = tmp_path / "out", tmp_path / "writing"
    argv = [str(src), "-o", str(out), "--weights", str(weights_file), "--device", "cpu"]
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", sys.executable,
               "-c", UNSHARED_RUN]
    first = subprocess.Popen(unshare + [str(writing)] + argv, env=child_env(),
                             stderr=subprocess.PIPE, text=True)
    try:
        while not writing.exists():
            assert first.poll() is None, first.communicate()[1]
            time.sleep(0.02)
        left = all_files(out)
        claimed = [f for f in left if f.endswith(".claim")]
        assert claimed and json.loads((out / claimed[0]).read_text())["pid"] == 1
    finally:
        first.kill()  # unshare, and with it (--kill-child) the run
        first.communicate(timeout=60)
    second = subprocess.run(unshare + ["-"] + argv, env=child_env(), capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "3 files: 3 computed, 0 skipped, 0 failed" in second.stderr
    assert all_files(out) == ["x0.h5", "x1.h5", "x2.h5"]
