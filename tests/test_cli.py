"""`triattn-infer` (triattn_cupy.cli) through `main([...])`: formats, resume, atomic
writes, refusals, device flags, the demo. CPU backend everywhere except the tests marked
`gpu`. Sizes are tiny (D=16, h=2, N <= 13) so the file runs in seconds on a CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import triattn_cupy
from triattn_cupy import reference
from triattn_cupy.cli import main as cli_main
from triattn_cupy.cli import pipeline, report
from triattn_cupy.cli.backends import (CpuBackend, gpu_probe, parse_devices,
                                       precision_support)
from cli_support import (D, REPO, all_files, assert_same, cli, dataset,  # noqa: F401
                         expected_output, make_pair, padding_mask, read_output, sha, weights,
                         weights_file, write_h5)
from helpers import rel_l2


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
    # Files named directly: their basename; each .npy with its provenance record.
    assert all_files(out) == ["a.npy", "a.npy.json", "c.npy", "c.npy.json"]
    record = json.loads((out / "c.npy.json").read_text())
    assert record["format"] == "triattn-cupy/infer-output" and record["array"] == "c.npy"
    assert record["sha256"] == sha(out / "c.npy")
    assert record["bytes"] == os.path.getsize(out / "c.npy")
    assert record["input_file"] == str(src / "c.npz") and record["mask_used"] is True
    assert record["fully_masked"] == "nan" and record["weights_sha256"] == sha(weights_file)
    pair, mask = items["c.npz"]
    got, _ = read_output(out / "c.npy")
    want = expected_output(weights, pair, mask, fully_masked="nan")
    # Queries j >= 7 have every key masked: NaN in every row i, as the reference.
    assert np.isnan(got[:, 7:]).all() and np.isfinite(got[:, :7]).all()
    assert_same(got[:, :7], want[:, :7])


def test_custom_keys_and_explicit_missing_mask_fails(weights, weights_file, tmp_path,
                                                     capsys):
    """A mask named by --mask-key must be there: a file without it fails (it is not
    computed unmasked), a .npy too (it holds no mask)."""
    rng = np.random.default_rng(2)
    pair, mask = make_pair(rng, 5, 5), padding_mask(0, 5, 3)
    np.savez(tmp_path / "k.npz", x=pair, m=mask)
    np.savez(tmp_path / "nomask.npz", x=pair)
    write_h5(tmp_path / "g.h5", **{"grp/x": pair})
    np.save(tmp_path / "p.npy", pair)
    out = tmp_path / "out"
    assert cli(weights_file, out, tmp_path / "k.npz", "--pair-key", "x", "--mask-key",
               "m") == 0
    assert_same(read_output(out / "k.h5")[0], expected_output(weights, pair, mask))
    assert cli(weights_file, out, tmp_path / "g.h5", tmp_path / "nomask.npz",
               tmp_path / "p.npy", "--pair-key", "grp/x", "--mask-key", "m") == 1
    err = capsys.readouterr().err
    assert "g.h5: no mask 'm' (--mask-key) in the file" in err
    assert "nomask.npz: no array 'grp/x'" in err
    assert "p.npy: a .npy file holds the pair alone, without the mask 'm'" in err
    assert not (out / "g.h5").exists() and not (out / "p.h5").exists()
    assert cli(weights_file, out, tmp_path / "nomask.npz", "--pair-key", "x",
               "--mask-key", "m") == 1
    assert "nomask.npz: no mask 'm' (--mask-key) in the archive" in capsys.readouterr().err
    assert cli(weights_file, out, tmp_path / "nomask.npz", "--pair-key", "x") == 0
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


def test_unusable_weights_is_a_setup_error(dataset, tmp_path, capsys):
    src, _ = dataset
    bad = tmp_path / "w.h5"
    bad.write_bytes(b"not hdf5")
    assert cli(bad, tmp_path / "out", src) == 2
    assert "cannot use --weights" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_weights_are_required_except_for_the_demo(dataset, tmp_path, capsys):
    """The shipped weights are random: a real run without --weights is a usage error,
    not a silent run of the demo weights on real data."""
    src, _ = dataset
    assert cli_main.main([str(src / "a.npy"), "-o", str(tmp_path / "out"), "--device",
                          "cpu"]) == 2
    assert "--weights is required" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_wrong_d_for_the_weights(dataset, tmp_path, capsys):
    from triattn_cupy.hdf5 import default_weights_path

    src, _ = dataset  # D=16 inputs; the default weights have D=128
    assert cli_main.main([str(src / "a.npy"), "-o", str(tmp_path / "out"), "--device",
                          "cpu", "--weights", str(default_weights_path())]) == 1
    assert "pair_dim 128; got 16" in capsys.readouterr().err


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

    made = []  # (device, max_scratch_bytes) of each backend made

    def __init__(self, weights, device, fully_masked, precision=None, where=None,
                 max_scratch_bytes=None):
        super().__init__(weights, fully_masked)
        self.device = device
        FakeGpuBackend.made.append((device, max_scratch_bytes))
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


def test_max_scratch_reaches_each_gpu_backend(two_fake_gpus, dataset, weights_file,
                                              tmp_path):
    src, _ = dataset
    FakeGpuBackend.made.clear()
    assert cli(weights_file, tmp_path / "o", src, "-r", "--devices", "0,1",
               "--max-scratch-gib", "0.5", device=None) == 0
    assert sorted(FakeGpuBackend.made) == [(0, 1 << 29), (1, 1 << 29)]


@pytest.mark.parametrize("value", ["0", "-1", "x", "inf"])
def test_max_scratch_must_be_positive(dataset, weights_file, tmp_path, capsys, value):
    src, _ = dataset
    assert cli(weights_file, tmp_path / "o", src, "--max-scratch-gib", value) == 2
    assert "argument --max-scratch-gib: expected a positive number of GiB" in (
        capsys.readouterr().err)


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
                 "--devices", "--quiet", "--demo", "--claim-timeout"):
        assert flag in proc.stdout
    text = " ".join(proc.stdout.split())
    for status in ("exit status: 0 every file computed or skipped", "; 1 some file failed",
                   "; 2 usage or setup error", "; 130 interrupted (Ctrl-C or SIGTERM)"):
        assert status in text


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


def test_distributed_depends_on_cli_never_the_reverse():
    """triattn_cupy.distributed imports the command's package; no module of
    triattn_cupy.cli imports triattn_cupy.distributed, not even inside a function."""
    import ast

    folder = REPO / "triattn_cupy" / "cli"
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                names = {node.module} if node.module else {a.name for a in node.names}
                assert "distributed" not in {n.split(".")[0] for n in names}, path.name
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("triattn_cupy.distributed"), path.name
