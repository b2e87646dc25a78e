"""The package as a user gets it: a wheel built from a clean copy of the source tree,
installed into a fresh venv, imported from a folder that is not the repository.

Checks that the top-level kernels/ and weights/ folders ship as the subpackages
``triattn_cupy.kernels`` and ``triattn_cupy.default_weights`` (found through
importlib.resources), that LICENSE and py.typed ship, that the metadata's Python
requirement matches CuPy 14's, that every console script runs, and that importing the
package never imports CuPy or touches CUDA.

Building the wheel needs the build backend (setuptools), which pip fetches from the index.
"""
from __future__ import annotations

import configparser
import email
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a clean clone would not have (the .gitignore's entries) and what a build leaves.
IGNORED = ("__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".venv", ".pytest_cache",
           ".shared", ".whl", ".git")
HEAVY_MODULES = ("cupy", "cupyx", "cupy_backends", "torch")
CUDA_LIBRARIES = ("libcuda.so", "libcudart", "libnvrtc")

# Run inside the venv (or the test environment) from a neutral folder; prints one JSON line.
PROBE = textwrap.dedent("""
    import importlib.metadata, importlib.resources, json, sys
    import triattn_cupy
    kernels = importlib.resources.files("triattn_cupy.kernels")
    weights = importlib.resources.files("triattn_cupy.default_weights")
    try:
        dist_version = importlib.metadata.version("triattn-cupy")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        dist_version = None
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = None
    print(json.dumps({
        "file": triattn_cupy.__file__,
        "prefix": sys.prefix,
        "version": triattn_cupy.__version__,
        "dist_version": dist_version,
        "kernels": {p.name: p.read_bytes().hex() for p in kernels.iterdir()
                    if p.name.endswith((".cu", ".cuh"))},
        "kernels_listing": sorted(p.name for p in kernels.iterdir()),
        "weights": sorted(p.name for p in weights.iterdir()),
        "modules": sorted(m for m in sys.modules if m.split(".")[0] in %r),
        "cuda_libraries": None if maps is None else sorted(
            {lib for lib in %r if lib in maps}),
    }))
""" % (HEAVY_MODULES, CUDA_LIBRARIES))


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra)
    return env


def _run(cmd, *, cwd, timeout=300, env=None):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        pytest.fail(f"command failed with exit code {proc.returncode}: {' '.join(map(str, cmd))}"
                    f"\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc.stdout


def _probe(python, cwd, env=None):
    out = _run([python, "-c", PROBE], cwd=cwd, env=env)
    return json.loads(out.strip().splitlines()[-1])


def _repo_files(folder, *patterns):
    return sorted(p for pattern in patterns for p in (REPO / folder).glob(pattern))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Path of a wheel built from a clean copy of the work tree (an in-place build would
    leave build/ in the repo, whose stale files setuptools would package next time)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    out = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--disable-pip-version-check",
          "-q", "-w", out], cwd=tmp)
    wheels = sorted(out.glob("triattn_cupy-*.whl"))
    assert len(wheels) == 1, f"expected one triattn_cupy wheel in {out}, found {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(python of a fresh venv holding the wheel, the venv folder, a neutral cwd)."""
    tmp = tmp_path_factory.mktemp("venv")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=tmp)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    # --system-site-packages reaches the *base* interpreter's packages; when the tests run
    # in a venv themselves (as in CI), numpy and h5py live in that venv: point at it too.
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=tmp).strip()
    outer = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    Path(site, "_outer_environment.pth").write_text("".join(f"{p}\n" for p in sorted(outer)))
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
          "--disable-pip-version-check", wheel], cwd=tmp)
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return python, venv, cwd


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"triattn_cupy"}, sorted(top)
    expected = {f"triattn_cupy/{p.relative_to(REPO / 'triattn_cupy').as_posix()}"
                for p in (REPO / "triattn_cupy").rglob("*.py")}
    expected |= {f"triattn_cupy/kernels/{p.name}"
                 for p in _repo_files("kernels", "*.py", "*.cu", "*.cuh")}
    expected |= {f"triattn_cupy/default_weights/{p.name}"
                 for p in _repo_files("weights", "*.py", "*.h5", "README.md")}
    expected.add("triattn_cupy/py.typed")  # PEP 561: the annotations are part of the API
    missing = sorted(expected - names)
    assert not missing, f"files of the repo missing from {wheel.name}: {missing}"
    licenses = [name for name in names
                if name.split("/")[0].endswith(".dist-info") and name.endswith("/LICENSE")]
    assert len(licenses) == 1, sorted(names)
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(licenses[0]) == (REPO / "LICENSE").read_bytes()


def test_wheel_metadata(wheel):
    """The Python requirement is CuPy 14's (3.10), the classifiers name no older Python,
    and the version is the package's."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(name))
    assert metadata["Requires-Python"] == ">=3.10"
    pythons = [c.rsplit(" :: ", 1)[1] for c in metadata.get_all("Classifier")
               if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert pythons and all(tuple(map(int, v.split("."))) >= (3, 10) for v in pythons), pythons
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    version = re.search(r'__version__ = "([^"]+)"',
                        (REPO / "triattn_cupy" / "_version.py").read_text()).group(1)
    assert metadata["Version"] == version
    assert "LICENSE" in (metadata.get_all("License-File") or []), metadata.items()


def test_installed_wheel(installed):
    python, venv, cwd = installed
    info = _probe(python, cwd)
    file = Path(info["file"]).resolve()
    assert file.is_relative_to(venv.resolve()), f"imported from {file}, not from the venv"
    assert not file.is_relative_to(REPO), f"imported the repository's copy: {file}"
    assert info["dist_version"] == info["version"]

    # kernels/: the resource folder is found; every .cu/.cuh of the repo is in it, unchanged.
    assert "__init__.py" in info["kernels_listing"]
    for path in _repo_files("kernels", "*.cu", "*.cuh"):
        assert path.name in info["kernels"], f"{path.name} not installed with the wheel"
        assert bytes.fromhex(info["kernels"][path.name]) == path.read_bytes(), path.name
    if _repo_files("kernels", "*.cu"):
        assert any(name.endswith(".cu") for name in info["kernels"])

    # weights/: default.h5 ships when the repo has it.
    assert "__init__.py" in info["weights"]
    if (REPO / "weights" / "default.h5").is_file():
        assert "default.h5" in info["weights"]

    assert info["modules"] == [], f"import triattn_cupy imported {info['modules']}"
    assert not info["cuda_libraries"], f"import triattn_cupy loaded {info['cuda_libraries']}"


def test_console_scripts_resolve(installed):
    python, _, cwd = installed
    script = textwrap.dedent("""
        import importlib.metadata, json
        dist = importlib.metadata.distribution("triattn-cupy")
        print(json.dumps({ep.name: ep.value for ep in dist.entry_points
                          if ep.group == "console_scripts"}))
    """)
    scripts = json.loads(_run([python, "-c", script], cwd=cwd).strip().splitlines()[-1])
    assert {"triattn-export", "triattn-infer", "triattn-check"} <= set(scripts), scripts
    not_written = []
    for name, value in sorted(scripts.items()):
        module, _, attr = value.partition(":")
        if not (REPO / Path(*module.split("."))).with_suffix(".py").is_file():
            not_written.append(f"{name} -> {module}")
            continue
        _run([python, "-c", f"import {module}; assert callable({module}.{attr})"], cwd=cwd)
        _run([Path(python).parent / name, "--help"], cwd=cwd)
    if not_written:
        pytest.skip(f"entry points whose module is not in the repo yet: {not_written}")


def test_installed_check_reports_the_cache(installed, tmp_path):
    """triattn-check as installed: exit 0 or 1 as the host allows, naming the cache."""
    python, _, cwd = installed
    cache = tmp_path / "cache"
    proc = subprocess.run([Path(python).parent / "triattn-check", "--arch", "90"], cwd=cwd,
                          env=_clean_env(CUPY_CACHE_DIR=str(cache)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert f"kernel cache:  {cache}" in proc.stdout, proc.stdout + proc.stderr
    assert ("usable:        yes" in proc.stdout) == (proc.returncode == 0), proc.stdout


def test_import_does_not_touch_cupy_or_cuda(tmp_path):
    """In the test environment itself (the editable install in CI, else the source tree)."""
    script = textwrap.dedent("""
        import json, sys
        import triattn_cupy
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            maps = ""
        print(json.dumps({
            "modules": sorted(m for m in sys.modules if m.split(".")[0] in %r),
            "cuda_libraries": sorted({lib for lib in %r if lib in maps}),
        }))
    """ % (HEAVY_MODULES, CUDA_LIBRARIES))
    out = _run([sys.executable, "-c", script], cwd=tmp_path,
               env=_clean_env(PYTHONPATH=str(REPO)))
    info = json.loads(out.strip().splitlines()[-1])
    assert info["modules"] == [], f"import triattn_cupy imported {info['modules']}"
    assert info["cuda_libraries"] == [], f"import triattn_cupy loaded {info['cuda_libraries']}"


def _extras():
    """{extra: [requirement, ...]} as setup.cfg declares them (no build, no network)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return {name: [line.strip() for line in value.splitlines() if line.strip()]
            for name, value in config["options.extras_require"].items()}


@pytest.mark.parametrize("cuda", ["12", "13"])
def test_cuda_extras_full_and_slim(cuda):
    """cudaXX keeps CuPy's whole toolkit ([ctk]); cudaXX-slim names only what compiling the
    kernels needs: CuPy, NVRTC and the CUDA runtime's headers, of the same CUDA major
    (docs/install.md: without the headers CuPy refuses to compile anything)."""
    extras = _extras()
    assert extras[f"cuda{cuda}"] == [f"cupy-cuda{cuda}x[ctk]>=14"]
    assert extras[f"cuda{cuda}-slim"] == [f"cupy-cuda{cuda}x>=14",
                                          f"cuda-toolkit[nvrtc,cudart]=={cuda}.*"]


def test_wheel_declares_the_slim_extras(wheel):
    """The slim extras reach the wheel's metadata under their own names."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(name))
    extras = metadata.get_all("Provides-Extra")
    assert {"cuda12", "cuda13", "cuda12-slim", "cuda13-slim"} <= set(extras), extras
    requires = metadata.get_all("Requires-Dist")
    for cuda in ("12", "13"):
        slim = sorted(r.split(";")[0].replace(" ", "") for r in requires
                      if f'extra == "cuda{cuda}-slim"' in r)
        assert slim == [f"cuda-toolkit[cudart,nvrtc]=={cuda}.*", f"cupy-cuda{cuda}x>=14"], slim
