"""triattn-check: its report without a GPU (the real CuPy on a host without one), with one
(a stand-in CuPy), the kernel cache's folder and size, argument errors; the warmup on a
GPU, compiling nothing the second time."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import triattn_cupy
from triattn_cupy import check
from triattn_cupy.gpu.routes import ROUTES

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "kernel cache"
    monkeypatch.setenv("CUPY_CACHE_DIR", str(folder))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    return folder


def run(capsys, *argv):
    code = check.main(list(argv))
    return code, capsys.readouterr().out


def fake_cupy(compute_capability=90, name="NVIDIA H200", smem_optin=232448):
    """A CuPy that sees one GPU (the calls triattn-check and check_cuda make)."""
    major, minor = divmod(compute_capability, 10)
    properties = {"name": name.encode(), "major": major, "minor": minor,
                  "multiProcessorCount": 132, "totalGlobalMem": 150 * 2**30}
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1, driverGetVersion=lambda: 13000,
        runtimeGetVersion=lambda: 13020, getDeviceProperties=lambda index: properties)
    device = types.SimpleNamespace(attributes={"MaxSharedMemoryPerBlockOptin": smem_optin},
                                   id=0)
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda index=None: device,
                                 nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 2)))
    return types.SimpleNamespace(__version__="14.2.0", cuda=cuda)


def route_lines(out):
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("routes:"))
    return dict(line.split() for line in lines[start + 1:start + 4])


@pytest.mark.skipif(triattn_cupy.gpu_available(), reason="the report of a host without a GPU")
def test_without_a_gpu_reports_what_it_can_and_exits_1(capsys, cache_dir):
    code, out = run(capsys)
    assert code == check.NOT_USABLE
    import cupy

    assert f"CuPy:          {cupy.__version__}\n" in out
    assert "NVRTC:         " in out and "GPU:           none usable\n" in out
    assert "routes:        no GPU to choose for (--arch 90 shows" in out
    assert f"kernel cache:  {cache_dir} (does not exist yet; CUPY_CACHE_DIR moves it)" in out
    assert "not usable:    no CUDA GPU is usable on this machine" in out
    assert "usable:        yes" not in out

    # --arch: the routes of that GPU all the same; --warmup: not run, said why
    code, out = run(capsys, "--arch", "sm_90", "--warmup", "1x64x128x4")
    assert code == check.NOT_USABLE
    assert "routes:        1x384x128x4 (B x N x D x heads) on --arch compute capability 9.0:" \
        in out
    assert set(route_lines(out)) == {"fp32", "tf32", "bf16"}
    assert set(route_lines(out).values()) <= set(ROUTES)
    assert "warmup:        not run: it compiles the kernels by running forwards, which needs a " \
           "GPU" in out


def test_without_cupy_exits_1(capsys, cache_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    code, out = run(capsys)
    assert code == check.NOT_USABLE
    assert "CuPy:          not importable (ModuleNotFoundError" in out
    assert 'not usable:    the GPU API needs CuPy: pip install "triattn-cupy[cuda13]" (from a ' \
           'source checkout: pip install ".[cuda13]")' in out
    assert f"kernel cache:  {cache_dir}" in out


def test_with_a_gpu_reports_it_and_its_routes(capsys, cache_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    code, out = run(capsys, "--shape", "2x256x128x4")
    assert code == check.USABLE, out
    assert "CUDA driver:   13.0\nCUDA runtime:  13.2\nNVRTC:         13.2\n" in out
    assert "GPU 0:         NVIDIA H200, compute capability 9.0, 132 SMs, 150.0 GiB\n" in out
    assert ("routes:        2x256x128x4 (B x N x D x heads) on GPU 0, compute capability "
            "9.0:\n") in out
    routes = route_lines(out)
    assert routes == check.route_names(check.parse_shape("2x256x128x4"), 90, check.SMEM_LIMIT)
    assert set(routes.values()) <= set(ROUTES)
    assert out.endswith("usable:        yes\n")


def test_routes_of_a_shape_the_gpu_refuses(capsys, cache_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(86, "NVIDIA RTX A6000", 101376))
    code, out = run(capsys, "--shape", "1x64x1024x4")
    assert code == check.USABLE  # the host is usable; that shape is not, and it says why
    assert route_lines_raw(out, "fp32").startswith(
        "fp32  none: head dimension pair_dim/num_heads must be a multiple of 4 and at most 128")


def route_lines_raw(out, precision):
    return next(line.strip() for line in out.splitlines()
                if line.strip().startswith(precision + " "))


def test_cache_folder_and_size(capsys, cache_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    cache_dir.mkdir()
    (cache_dir / "a.cubin").write_bytes(b"x" * 2**20)
    (cache_dir / "b.cubin").write_bytes(b"x" * 2**19)
    (cache_dir / "b.cubin.cu").write_text("source kept by CUPY_CACHE_SAVE_CUDA_SOURCE")
    (cache_dir / "sub").mkdir()
    _, out = run(capsys)
    assert f"kernel cache:  {cache_dir} (2 compiled kernels, 1.5 MiB; CUPY_CACHE_DIR moves it)" \
        in out
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    _, out = run(capsys)
    assert f"kernel cache:  {cache_dir}: not used (CUPY_CACHE_IN_MEMORY is set" in out


def test_cache_folder_default_is_cupys(monkeypatch):
    monkeypatch.delenv("CUPY_CACHE_DIR", raising=False)
    assert check.kernel_cache_folder() == Path.home() / ".cupy" / "kernel_cache"


@pytest.mark.parametrize("argv, message", [
    (["--shape", "1x384x128"], "argument --shape: a shape is BxNxDxh, four positive integers"),
    (["--shape", "1x384x128x4x2"], "a shape is BxNxDxh"),
    (["--shape", "1x0x128x4"], "every size of a shape must be at least 1; got '1x0x128x4'"),
    (["--shape", "1x64x130x4"], "the pair dim D must be a multiple of the heads h"),
    (["--warmup"], "argument --warmup: expected at least one argument"),
    (["--warmup", "big"], "argument --warmup: a shape is BxNxDxh"),
    (["--arch", "hopper"], "--arch is a compute capability such as 90, sm_90 or 9.0; got "
                           "'hopper'"),
    (["--arch", "9"], "--arch is a compute capability such as 90"),
    (["--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
])
def test_argument_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        check.main(argv)
    assert exit_.value.code == check.USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, cc", [("90", 90), ("sm_90", 90), ("sm_90a", 90), ("9.0", 90),
                                      ("8.6", 86), ("sm_80", 80), ("10.0", 100),
                                      ("sm_100", 100), ("120", 120)])
def test_arch_spellings(text, cc):
    assert check.parse_arch(text) == cc


def _check_in_subprocess(cache, *argv):
    proc = subprocess.run([sys.executable, "-m", "triattn_cupy.check", *argv],
                          capture_output=True, text=True, timeout=600, cwd=cache.parent,
                          env={**os.environ, "PYTHONPATH": str(REPO),
                               "CUPY_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.gpu
def test_warmup_compiles_once(tmp_path):
    """A second process finds every kernel of the warmed shape in the cache."""
    cache = tmp_path / "cache"
    argv = ("--warmup", "1x64x32x1", "--precision", "tf32")
    first = _check_in_subprocess(cache, *argv)
    compiled = int(first.split("warmup:        compiled ")[1].split(",")[0])
    assert compiled > 0, first
    second = _check_in_subprocess(cache, *argv)
    assert "warmup:        compiled 0, cached " in second, second
    cached = int(second.split("cached ")[1].split()[0])
    assert cached > 0, second
    # and a forward of that shape in a fresh process compiles nothing either
    files = sorted(os.listdir(cache))
    script = ("import cupy, numpy as np, triattn_cupy as ta;"
              "m = ta.TriangleAttention(ta.random_weights(32, 1, seed=1));"
              "p = cupy.asarray(np.ones((1, 64, 64, 32), np.float32));"
              "k = cupy.asarray(np.ones((1, 64, 64), bool));"
              "m(p, k, precision='tf32', mask_layout='row', node='ending');"
              "cupy.cuda.get_current_stream().synchronize()")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600, cwd=tmp_path,
                   env={**os.environ, "PYTHONPATH": str(REPO), "CUPY_CACHE_DIR": str(cache)})
    assert sorted(os.listdir(cache)) == files


def test_warmup_counts_compiled_and_cached(cache_dir, monkeypatch):
    """The counting, with a stand-in GPU: each (precision, node) is one kernel
    configuration, compiled into the cache the first time a process loads it."""
    cache_dir.mkdir()
    loads = []  # this "process"'s configurations loaded (raw_module's misses)
    calls = []

    class Module:
        def __init__(self, weights):
            self.weights = weights

        def __call__(self, pair, mask, *, precision, mask_layout, node):
            calls.append((pair.dtype.name, precision, mask_layout, node))
            config = f"{self.weights.pair_dim}-{precision}-{node}"
            if config not in loads:
                loads.append(config)
                if not (cache_dir / f"{config}.cubin").exists():
                    (cache_dir / f"{config}.cubin").write_bytes(b"cubin")
            return pair

    stream = types.SimpleNamespace(synchronize=lambda: None)
    cupy = types.SimpleNamespace(asarray=lambda a: a, cuda=types.SimpleNamespace(
        get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(triattn_cupy, "TriangleAttention", Module)
    monkeypatch.setattr(check, "raw_module", types.SimpleNamespace(
        cache_info=lambda: types.SimpleNamespace(misses=len(loads))))
    shapes = [check.parse_shape("1x8x16x4"), check.parse_shape("2x4x16x2")]
    said = []
    dtypes = {"float32": np.dtype("float32"), "float16": np.dtype("float16")}
    assert check.warmup(shapes, ["fp32", "bf16"], dtypes, said.append) == (4, 0)
    # every precision, pair dtype, mask layout and GPU node, for each shape
    assert sorted(set(calls)) == sorted(
        (dtype, precision, layout, node) for dtype in dtypes for precision in ("fp32", "bf16")
        for layout in ("pair", "row") for node in ("starting", "ending"))
    assert len(calls) == 2 * 2 * 2 * 2 * 2 and len(said) == 4
    loads.clear()  # a second process: everything comes from the cache
    assert check.warmup(shapes, ["fp32", "bf16"], dtypes, said.append) == (0, 4)


def test_warmup_failures_exit_1_with_the_reason(capsys, cache_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())

    def refuse(weights):
        raise ValueError(f"pair_dim {weights.pair_dim} is too large for this GPU")

    monkeypatch.setattr(triattn_cupy, "TriangleAttention", refuse)
    code, out = run(capsys, "--warmup", "1x8x1024x8")
    assert code == check.NOT_USABLE
    assert "warmup failed: ValueError: pair_dim 1024 is too large for this GPU\n" in out
    assert "usable:        yes" not in out
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    code, out = run(capsys, "--warmup", "1x8x16x4", "--dtype", "bfloat16")
    assert code == check.NOT_USABLE
    assert "warmup failed: ImportError: --dtype bfloat16 needs ml_dtypes" in out
