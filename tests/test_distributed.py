"""The batch job on a Dask cluster (`triattn-infer --scheduler / --cluster`,
`triattn_cupy.distributed`) and triangle attention over Dask arrays.

The cluster is a loopback one: a scheduler and two worker processes on 127.0.0.1, started
as `dask scheduler` / `dask worker` are, on the CPU backend. Its outputs must equal a
one-process run bit for bit (data and provenance, but the time each was made), the two must
resume each other, and a worker killed mid-run must lose nothing and leave nothing behind.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

pytest.importorskip("distributed", reason="needs dask[distributed] (the extra "
                                          "triattn-cupy[distributed])")
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster, get_client  # noqa: E402

from triattn_cupy import distributed as tdist, random_weights, reference  # noqa: E402
from triattn_cupy.cli import cluster as cli_cluster, cluster_tasks, pipeline  # noqa: E402
from triattn_cupy.cli import cluster_run  # noqa: E402
from triattn_cupy.cli.backends import SetupError, gpu_probe  # noqa: E402
from triattn_cupy.cli.claims import Claims, claim_path  # noqa: E402
from triattn_cupy.cli.filejob import job_settings  # noqa: E402
from triattn_cupy.cli.plan import Task  # noqa: E402
from triattn_cupy.hdf5 import save_weights  # noqa: E402
from helpers import rel_l2  # noqa: E402
from cli_support import (D, H, all_files, assert_same, child_env, cli,  # noqa: E402
                         expected_output, make_pair, padding_mask, read_output, sha,
                         write_h5)

# Provenance that differs between any two runs: when the file was made, how long it took.
PER_RUN_ATTRS = {"created_utc", "compute_seconds"}
START_TIMEOUT_S = 60


# --- inputs and the one-process run they are compared with ----------------------------------

@pytest.fixture(scope="module")
def weights():
    return random_weights(D, H, seed=11)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory, weights):
    path = tmp_path_factory.mktemp("weights") / "w16.h5"
    save_weights(weights, path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Every input format, masks, float64, a sub-folder, sizes from tiny to a few MB."""
    rng = np.random.default_rng(5)
    src = tmp_path_factory.mktemp("in")
    (src / "sub").mkdir()
    np.save(src / "a.npy", make_pair(rng, 7, 7))
    np.save(src / "b.npy", make_pair(rng, 2, 40, 40, dtype=np.float64))
    np.savez(src / "c.npz", pair=make_pair(rng, 9, 9), mask=padding_mask(0, 9, 7))
    np.savez(src / "d.npz", pair=make_pair(rng, 3, 24, 24))
    write_h5(src / "sub" / "e.h5", pair=make_pair(rng, 11, 11, dtype=np.float64),
             mask=(rng.random((11, 11)) > 0.3).astype(np.int32))
    write_h5(src / "sub" / "f.hdf5", pair=make_pair(rng, 2, 6, 6),
             mask=padding_mask(2, 6, 4, dtype=np.float32))
    for i in range(6):
        np.save(src / f"g{i}.npy", make_pair(rng, 2, 64 + 4 * i, 64 + 4 * i))
    return src


@pytest.fixture(scope="module")
def local_run(inputs, weights_file, tmp_path_factory):
    """The outputs of a one-process run over `inputs`."""
    out = tmp_path_factory.mktemp("local") / "out"
    assert cli(weights_file, out, inputs, "-r") == 0
    return out


def assert_same_outputs(actual_dir, expected_dir, only=None):
    """Same files (or those named in `only`); each with the same data bit for bit and the
    same provenance."""
    if only is None:
        assert all_files(actual_dir) == all_files(expected_dir)
    for rel in only or all_files(expected_dir):
        got, got_attrs = read_output(pathlib.Path(actual_dir) / rel)
        want, want_attrs = read_output(pathlib.Path(expected_dir) / rel)
        assert got.dtype == want.dtype and got.shape == want.shape, rel
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), rel
        for key in set(got_attrs) | set(want_attrs):
            if key not in PER_RUN_ATTRS:
                assert np.all(got_attrs.get(key) == want_attrs.get(key)), (rel, key)


# --- a loopback cluster of processes ---------------------------------------------------------

class LoopbackCluster:
    """`dask scheduler` and `dask worker` processes on 127.0.0.1 (workers without a
    nanny, so a killed worker stays dead)."""

    def __init__(self, folder: pathlib.Path, workers: int = 2):
        folder.mkdir(parents=True, exist_ok=True)
        self.scheduler_file = folder / "scheduler.json"
        self.log = open(folder / "cluster.log", "ab")
        self.processes = []
        self.scheduler = self._start("distributed.cli.dask_scheduler", "--host",
                                     "127.0.0.1", "--port", "0", "--no-dashboard",
                                     "--scheduler-file", self.scheduler_file)
        self.workers = [self._start("distributed.cli.dask_worker", "--scheduler-file",
                                    self.scheduler_file, "--host", "127.0.0.1",
                                    "--nthreads", "1", "--no-nanny", "--no-dashboard",
                                    "--name", f"worker-{i}")
                        for i in range(workers)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.scheduler_file.exists() and self.scheduler_file.stat().st_size):
            assert self.scheduler.poll() is None, "the scheduler exited"
            assert time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.05)
        with Client(scheduler_file=str(self.scheduler_file), timeout=START_TIMEOUT_S) as c:
            c.wait_for_workers(workers, timeout=START_TIMEOUT_S)
            self.worker_pids = c.run(os.getpid)  # address -> pid

    def _start(self, module, *args):
        proc = subprocess.Popen([sys.executable, "-m", module, *map(str, args)],
                                env=child_env(), stdout=self.log, stderr=self.log)
        self.processes.append(proc)
        return proc

    def close(self):
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def loopback(tmp_path_factory):
    cluster = LoopbackCluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.close()


# --- the batch on the cluster ----------------------------------------------------------------

def test_cluster_run_equals_one_process_run(loopback, inputs, local_run, weights_file,
                                            tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(weights_file, out, inputs, "-r", "--scheduler", loopback.scheduler_file) == 0
    assert_same_outputs(out, local_run)
    err = capsys.readouterr().err
    assert "12 files: 12 computed, 0 skipped, 0 failed" in err
    assert "pair positions/s" in err and "CPU (NumPy backend, float32)" in err
    assert "files, tcp://127.0.0.1:" in err  # files per worker


def test_cluster_and_local_runs_resume_each_other(loopback, inputs, local_run, weights_file,
                                                  tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(weights_file, out, inputs, "-r") == 0
    for rel in ("a.h5", "sub/e.h5", "g3.h5"):
        os.remove(out / rel)
    kept = {rel: os.stat(out / rel).st_mtime_ns for rel in all_files(out)}
    capsys.readouterr()
    address = json.loads(loopback.scheduler_file.read_text())["address"]  # tcp://...
    assert cli(weights_file, out, inputs, "-r", "--scheduler", address) == 0
    err = capsys.readouterr().err
    assert "resuming: 9 of 12 outputs exist already" in err
    assert "12 files: 3 computed, 9 skipped, 0 failed" in err
    assert {rel: os.stat(out / rel).st_mtime_ns for rel in kept} == kept
    for rel in ("c.h5", "g0.h5"):  # now the local run resumes the cluster's
        os.remove(out / rel)
    assert cli(weights_file, out, inputs, "-r") == 0
    assert "12 files: 2 computed, 10 skipped, 0 failed" in capsys.readouterr().err
    assert_same_outputs(out, local_run)


def test_a_worker_killed_mid_run_loses_nothing(inputs, local_run, weights_file, tmp_path,
                                               capsys):
    """SIGKILL one of two workers while it writes an output (or, failing to catch that
    moment, while it has files in hand): the other computes its files, every output is
    there and equal, and no temporary file is left."""
    cluster = LoopbackCluster(tmp_path / "cluster-kill")
    try:
        victim_address, victim = sorted(cluster.worker_pids.items())[0]
        out = tmp_path / "out"
        killed = threading.Event()
        caught_writing = []

        def kill_when_writing():
            deadline = None
            while not killed.is_set():
                writing = _open_files_under(victim, out)
                if deadline is None and out.exists() and any(out.iterdir()):
                    deadline = time.monotonic() + 2.0  # the run is under way
                if writing or (deadline is not None and time.monotonic() > deadline):
                    caught_writing.extend(writing)
                    os.kill(victim, signal.SIGKILL)
                    killed.set()
                time.sleep(0.0005)

        killer = threading.Thread(target=kill_when_writing, daemon=True)
        killer.start()
        code = cli(weights_file, out, inputs, "-r", "--scheduler", cluster.scheduler_file,
                   "-v")
        killed.set()
        killer.join()
        err = capsys.readouterr().err
        assert code == 0, err
        assert "12 files: 12 computed, 0 skipped, 0 failed" in err
        [process] = [w for w in cluster.workers if w.pid == victim]
        assert process.wait(timeout=10) == -signal.SIGKILL
        assert_same_outputs(out, local_run)  # no stray files either: all_files compares
        assert not [p for p in out.rglob("*") if p.is_file() and p.suffix == ".tmp"]
        print(f"killed {victim_address} "
              f"{'while writing ' + ', '.join(caught_writing) if caught_writing else ''}")
    finally:
        cluster.close()


def _open_files_under(pid: int, folder: pathlib.Path) -> list:
    """Paths under `folder` that process `pid` has open (Linux /proc)."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    prefix = str(folder) + os.sep
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            found.append(target)
    return found


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_cluster_run_resumes(signum, loopback, weights, weights_file,
                                            tmp_path):
    """Ctrl-C or SIGTERM: the files in hand on the workers are finished and reported, no
    other is started, the client stops with 130 (nothing half-written), and the same
    command completes the batch."""
    rng = np.random.default_rng(8)
    src, out = tmp_path / "in", tmp_path / "out"
    src.mkdir()
    pairs = {f"p{i:02d}": make_pair(rng, 2, 96, 96) for i in range(16)}
    for name, pair in pairs.items():
        np.save(src / f"{name}.npy", pair)
    argv = [src, "-o", out, "--weights", weights_file, "--device", "cpu", "--scheduler",
            loopback.scheduler_file]
    proc = subprocess.Popen(
        [sys.executable, "-m", "triattn_cupy", *map(str, argv)], env=child_env(),
        stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (out.exists() and any(p.suffix == ".h5" for p in out.iterdir())):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no output appeared"
        time.sleep(0.01)
    proc.send_signal(signum)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert re.search(r"interrupted: \d+ files? (was|were) not processed; run the same "
                     r"command again to resume", err), err
    deadline = time.monotonic() + START_TIMEOUT_S
    while any(p.name.startswith(".") for p in out.iterdir()):  # files in hand: claims, temps
        assert time.monotonic() < deadline, sorted(p.name for p in out.iterdir())
        time.sleep(0.05)
    done = sorted(p.stem for p in out.iterdir())
    assert 0 < len(done) < len(pairs), done
    for name in done:
        assert_same(read_output(out / f"{name}.h5")[0], expected_output(weights, pairs[name]))
    assert cli(weights_file, out, src, "--scheduler", loopback.scheduler_file) == 0
    assert all_files(out) == sorted(f"{name}.h5" for name in pairs)
    for name, pair in pairs.items():
        assert_same(read_output(out / f"{name}.h5")[0], expected_output(weights, pair))


def test_temporary_outputs_of_dead_writers_are_removed(tmp_path):
    """What a worker records before creating a temporary output lets the client remove
    it when the worker died before renaming it (a writer that finished is marked gone)."""
    dead, finished = tmp_path / ".x.h5.dead.tmp", tmp_path / ".y.h5.done.tmp"

    def write_and_die(run_key):
        record = cluster_tasks.RecordedTemps(get_client(), run_key)
        record.update([str(dead)])
        dead.write_bytes(b"half")  # no discard: the writer "died" here
        record.update([str(finished)])
        record.difference_update([str(finished)])
        return True

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as lc, Client(lc) as client:
        assert client.submit(write_and_die, "run-1", pure=False).result()
        finished.write_bytes(b"someone else's file of that name")
        cluster_tasks.remove_dead_temps(client, "run-1")
        assert not dead.exists() and finished.exists()
        cluster_tasks.forget_run(client, "run-1")
        assert not client.get_metadata([cluster_tasks.RUN_KEY, "run-1"], default=None)


@pytest.mark.parametrize("claim", ["this run's", "this run's, empty", "another run's"])
def test_claim_of_a_lost_worker_of_this_run_is_taken_over(
        claim, inputs, local_run, weights, weights_file, tmp_path):
    """A claim from another host expires only after the claim timeout. The task started
    again after its worker was lost takes it over when this run's earlier attempt holds
    it (also one killed before it filled the claim file), and leaves it alone (the file
    skipped) when another run does."""
    out = tmp_path / "out"
    out.mkdir()
    task = Task(str(inputs / "a.npy"), "npy", "a.npy", str(out / "a.h5"))
    args = argparse.Namespace(fully_masked="zero", precision=None, pair_key="pair",
                              mask_key=None, output_format="hdf5")
    settings = job_settings(args, D, str(weights_file), sha(weights_file))
    claim_file = pathlib.Path(claim_path(task.output))
    claim_file.write_text("" if claim.endswith("empty") else json.dumps(
        {"host": "elsewhere", "pid": 4321, "run": "lost-worker-run", "token": "t",
         "started": time.time(), "output": "a.h5"}))
    earlier_attempt_recorded = claim.startswith("this run's")
    spec = (sha(weights_file), "cpu", "zero", None)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as lc, Client(lc) as client:
        if earlier_attempt_recorded:
            client.set_metadata([cluster_tasks.RUN_KEY, "run-2", "claims", task.output,
                                 "lost-worker-run"], True)
        outcome = client.submit(cluster_tasks.file_task, task, weights, spec, settings, "run-2",
                                600.0, pure=False).result()
    if earlier_attempt_recorded:
        assert outcome.status == "done", outcome
        assert not claim_file.exists()
        assert_same_outputs(out, local_run, only=["a.h5"])
    else:
        assert outcome.status == "skipped"
        assert "being computed by another run (host elsewhere, process 4321" in outcome.reason
        assert claim_file.exists() and not (out / "a.h5").exists()


def test_a_claim_that_cannot_be_made_fails_its_file(inputs, weights_file, tmp_path,
                                                    monkeypatch):
    real = Claims.acquire

    def acquire(self, output, live_temps=None):
        if output.endswith("a.h5"):
            raise PermissionError(13, "Permission denied", output)
        return real(self, output, live_temps)

    monkeypatch.setattr(Claims, "acquire", acquire)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as lc, Client(lc) as client:
        result = tdist.infer_files(client, [inputs / "a.npy", inputs / "c.npz"],
                                   tmp_path / "out", weights_file, device="cpu")
    assert result.exit_code == 1 and result.count("done") == 1
    [failed] = [o for o in result.outcomes if o.status == "failed"]
    assert failed.input.endswith("a.npy")
    assert "cannot claim the output" in failed.reason and "Permission denied" in failed.reason
    assert all_files(tmp_path / "out") == ["c.h5"]


def test_infer_files_python_api(loopback, inputs, local_run, weights_file, tmp_path):
    with Client(scheduler_file=str(loopback.scheduler_file)) as client:
        result = tdist.infer_files(client, [inputs], tmp_path / "out", weights_file,
                                   recursive=True, device="cpu")
    assert result.exit_code == 0 and result.count("done") == 12
    for name, value, message in (("fully_masked", "one", "fully_masked must be one of "
                                  "'zero', 'nan'; got 'one'"),
                                 ("output_format", "npz", "output_format must be one of"),
                                 ("device", "tpu", "device must be one of"),
                                 ("precision", "fp8", "precision must be one of")):
        with pytest.raises(ValueError, match=message):
            tdist.infer_files(None, inputs, tmp_path / "o2", weights_file, **{name: value})
    with pytest.raises(TypeError, match="weights must be the path of an HDF5 weights file"):
        tdist.infer_files(None, inputs, tmp_path / "o2", None)
    assert all(o.device.endswith("(CPU (NumPy backend, float32))") for o in result.outcomes)
    assert result.positions == sum(o.positions for o in result.outcomes)
    assert_same_outputs(tmp_path / "out", local_run)


def test_auto_device_on_workers_without_a_gpu(loopback, inputs, weights_file, tmp_path,
                                             caplog):
    with Client(scheduler_file=str(loopback.scheduler_file)) as client:
        if any(count for count, _ in client.run(gpu_probe).values()):
            pytest.skip("the workers have a GPU")
        result = tdist.infer_files(client, inputs / "a.npy", tmp_path / "out", weights_file)
    assert "no worker has a usable CUDA GPU" in caplog.text
    assert result.exit_code == 0 and result.count("done") == 1
    assert read_output(tmp_path / "out" / "a.h5")[1]["device"].startswith("CPU")


def test_local_cpu_cluster(inputs, local_run, weights_file, tmp_path):
    out = tmp_path / "out"
    assert cli(weights_file, out, inputs, "-r", "--cluster", "local") == 0
    assert_same_outputs(out, local_run)


def test_local_gpu_cluster_without_dask_cuda(inputs, weights_file, tmp_path, capsys,
                                            monkeypatch):
    try:
        import dask_cuda  # noqa: F401
        pytest.skip("dask-cuda is installed and usable here")
    except Exception:
        pass
    monkeypatch.setattr(pipeline, "resolve_devices", lambda args: ("gpu", [0]))
    assert cli(weights_file, tmp_path / "out", inputs, "--cluster", "local",
               device=None) == 2
    assert ('--cluster local on GPUs needs dask-cuda (pip install '
            '"triattn-cupy[distributed-cuda]" (from a source checkout: pip install '
            '".[distributed-cuda]"))') in capsys.readouterr().err


def test_cluster_flag_errors(loopback, inputs, weights_file, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert cli(weights_file, out, inputs, "--scheduler", loopback.scheduler_file,
               "--cluster", "local") == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert cli(weights_file, out, inputs, "--scheduler", loopback.scheduler_file,
               "--devices", "0,1", device=None) == 2
    assert "--devices selects GPUs of this host" in capsys.readouterr().err
    assert cli(weights_file, out, inputs, "--scheduler", loopback.scheduler_file,
               "--precision", "bf16", device="cpu") == 2
    capsys.readouterr()
    monkeypatch.setattr(cli_cluster, "CONNECT_TIMEOUT_S", 1)
    assert cli(weights_file, out, inputs, "--scheduler", "tcp://127.0.0.1:9") == 2
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in capsys.readouterr().err
    assert not out.exists()


def _half_the_workers_have_a_gpu(dask_worker=None):  # client.run passes the worker
    return (1, "") if dask_worker.name == 0 else (0, "no CUDA device found")


def test_workers_must_agree_on_device_and_version(monkeypatch):
    monkeypatch.setattr(cluster_run, "gpu_probe", _half_the_workers_have_a_gpu)
    args = argparse.Namespace(device="auto", devices=None, precision=None)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as lc, Client(lc) as client:
        with pytest.raises(SetupError, match="1 of 2 workers have a CUDA GPU and 1 have "
                                             "none .*their outputs would differ"):
            tdist.resolve_cluster_device(client, args)
        args.device = "gpu"
        with pytest.raises(SetupError, match="--device gpu needs a CUDA GPU on every "
                                             "worker, but 1 of 2 have none"):
            tdist.resolve_cluster_device(client, args)
        args.device = "cpu"
        assert tdist.resolve_cluster_device(client, args) == "cpu"
        tdist.check_worker_versions(client)  # the same version: no error
        monkeypatch.setattr(cluster_run, "__version__", "0.0.other")
        with pytest.raises(SetupError, match=r"2 of 2 workers run another version of "
                                             r"triattn-cupy than this client \(0.0.other\)"):
            tdist.check_worker_versions(client)


def test_neither_the_package_nor_a_local_run_imports_dask(inputs, weights_file, tmp_path):
    script = textwrap.dedent(f"""
        import json, sys
        import triattn_cupy
        from triattn_cupy.cli.main import main
        code = main([{str(inputs / 'a.npy')!r}, "-o", {str(tmp_path / 'out')!r},
                     "--weights", {str(weights_file)!r}, "--device", "cpu", "-q"])
        print(json.dumps([code, sorted(m for m in sys.modules
                                        if m.split(".")[0] in ("dask", "distributed",
                                                               "dask_cuda"))]))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    code, modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 0 and modules == []


# --- Dask arrays -----------------------------------------------------------------------------

def test_dask_array_equals_the_numpy_backend(weights):
    rng = np.random.default_rng(3)
    B, N = 5, 13
    pair = make_pair(rng, B, N, N)
    mask = padding_mask(B, N, 9)
    mask[1] = 0  # a fully masked example
    lazy = tdist.triangle_attention(da.from_array(pair, chunks=(2, 5, N, D)), mask, weights)
    assert isinstance(lazy, da.Array) and lazy.shape == pair.shape
    assert lazy.chunks[0] == (2, 2, 1) and lazy.dtype == np.float32
    got = lazy.compute(scheduler="sync")
    want = reference.triangle_attention(pair, mask, weights, dtype=np.float32)
    assert np.array_equal(got, want)
    nan = tdist.triangle_attention(
        da.from_array(pair.astype(np.float64), chunks=(3, N, N, D)),
        da.from_array(mask, chunks=(1, N, N)), weights, fully_masked="nan")
    got64 = nan.compute(scheduler="sync")
    assert got64.dtype == np.float64 and np.isnan(got64[1]).all()
    want64 = reference.triangle_attention(pair, mask, weights, fully_masked="nan")
    np.testing.assert_array_equal(got64, want64)


def test_dask_array_unbatched_and_on_a_cluster(weights):
    rng = np.random.default_rng(4)
    pair = make_pair(rng, 6, 6)
    got = tdist.triangle_attention(da.from_array(pair), None, weights).compute(
        scheduler="sync")
    assert np.array_equal(got, reference.triangle_attention(pair, None, weights,
                                                             dtype=np.float32))
    batch = make_pair(rng, 4, 6, 6)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as lc, Client(lc):
        out = tdist.triangle_attention(da.from_array(batch, chunks=(1, 6, 6, D)), None,
                                       weights).compute()
    assert np.array_equal(out, reference.triangle_attention(batch, None, weights,
                                                            dtype=np.float32))


def test_dask_array_argument_errors(weights):
    pair = da.zeros((2, 5, 5, D), np.float32, chunks=(1, 5, 5, D))
    with pytest.raises(TypeError, match="pair must be a dask.array.Array; got ndarray"):
        tdist.triangle_attention(np.zeros((2, 5, 5, D), np.float32), None, weights)
    with pytest.raises(ValueError, match="needs CuPy-backed chunks"):
        tdist.triangle_attention(pair, None, weights, precision="bf16")
    with pytest.raises(ValueError, match=r"mask must be \(B, N, N\) = \(2, 5, 5\)"):
        tdist.triangle_attention(pair, np.ones((5, 5), bool), weights)
    with pytest.raises(ValueError, match="mask must be shaped like the pair"):
        tdist.triangle_attention(pair, np.ones((3, 5, 5), bool), weights)
    with pytest.raises(TypeError, match="pair must be float32 or float64; got dtype int32"):
        tdist.triangle_attention(pair.astype(np.int32), None, weights)
    with pytest.raises(ValueError, match="fully_masked"):
        tdist.triangle_attention(pair, None, weights, fully_masked="one")
    with pytest.raises(TypeError, match="weights must be a triattn_cupy.Weights"):
        tdist.triangle_attention(pair, None, {"a": 1})


# --- on a GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
def test_local_cuda_cluster_equals_the_local_gpu_run(inputs, weights_file, tmp_path):
    try:
        import dask_cuda  # noqa: F401
    except Exception as exc:  # not installed, or its CUDA bindings do not load
        pytest.skip(f"needs dask-cuda: {type(exc).__name__}: {exc}")
    local, on_cluster = tmp_path / "local", tmp_path / "cluster"
    assert cli(weights_file, local, inputs, "-r", "--devices", "0", device="gpu") == 0
    assert cli(weights_file, on_cluster, inputs, "-r", "--cluster", "local", "--devices", "0",
               device="gpu") == 0
    assert_same_outputs(on_cluster, local)
    _, attrs = read_output(on_cluster / "a.h5")
    assert attrs["device"].startswith("GPU 0")


@pytest.mark.gpu
def test_dask_array_with_cupy_chunks(weights):
    import cupy

    rng = np.random.default_rng(6)
    pair = make_pair(rng, 3, 33, 33)
    mask = padding_mask(3, 33, 30)
    lazy = tdist.triangle_attention(
        da.from_array(cupy.asarray(pair), chunks=(1, 33, 33, D), asarray=False),
        cupy.asarray(mask), weights)
    assert lazy.chunks[0] == (1, 1, 1)
    got = lazy.compute(scheduler="sync")
    assert isinstance(got, cupy.ndarray) and got.dtype == np.float32
    want = reference.triangle_attention(pair, mask, weights)  # float64
    assert rel_l2(cupy.asnumpy(got), want) <= 1e-5  # the fp32 mode's bound (test_gpu.py)
