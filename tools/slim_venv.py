"""Whether a slim CUDA extra (setup.cfg's cuda13-slim, cuda12-slim) alone runs the kernels,
checked on a GPU host that has every CUDA package installed and no way to download one.

`build` makes a venv holding only the extra's packages (with the package's own
requirements and its test extra, torch left out): each installed distribution is copied
from this Python's site-packages file by file, as its RECORD lists them, so that CuPy's
library and header look-ups (cuda-pathfinder: the venv's site-packages first) find
nothing the extra does not bring. `--probe`, run by that venv's python, compiles and
launches a forward in each precision from an empty kernel cache and fails unless NVRTC,
the CUDA headers and every CUDA library loaded (the driver aside) came from the venv.

    python3 tools/slim_venv.py build /tmp/slim          # cuda13-slim; --extra cuda12-slim
    /tmp/slim/bin/python tools/slim_venv.py --compile   # every configuration; no GPU needed
    env -u CUDA_PATH -u CUDA_HOME /tmp/slim/bin/python tools/slim_venv.py --probe
    env -u CUDA_PATH -u CUDA_HOME PATH=/tmp/slim/bin:$PATH CUPY_CACHE_DIR=$(mktemp -d) \\
        TRIATTN_NO_TIMING=1 bash tools/gpu_check.sh     # the GPU suite in the slim venv

The venv also gets --also's distributions (default nvidia-curand and ml-dtypes): some GPU
tests draw their inputs with cupy.random, which needs cuRAND, and the 16-bit pair tests name
bfloat16 through ml_dtypes; the package itself needs neither (the probe fails if cuRAND or
cuBLAS is loaded). Tests that need torch skip there: torch's CUDA builds bring NVIDIA
libraries of their own, which would hide what the extra lacks.
"""
from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import venv

REPO = pathlib.Path(__file__).resolve().parents[1]
# Left out of the venv (the test extra names it): its CUDA builds bring NVIDIA libraries.
LEFT_OUT = {"torch"}
# What the slim extras leave out of [ctk]: a forward that loads one needs more than they bring.
NOT_NEEDED = ("libcublas", "libcurand", "libcufft", "libcusolver", "libcusparse")
# Relative L2 error against float64 that the GPU tests hold each precision to (README).
BOUNDS = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def extra_requirements(extra: str, setup_cfg: pathlib.Path = REPO / "setup.cfg") -> list[str]:
    """The package's requirements, `extra`'s and the test extra's, torch left out."""
    from packaging.requirements import Requirement

    config = configparser.ConfigParser()
    config.read(setup_cfg)
    extras = config["options.extras_require"]
    if extra not in extras:
        raise SystemExit(f"setup.cfg has no extra {extra!r}; it has {sorted(extras)}")
    lines = [line.strip() for value in (config["options"]["install_requires"], extras[extra],
                                        extras["test"])
             for line in value.splitlines() if line.strip()]
    return [line for line in lines if _canonical(Requirement(line).name) not in LEFT_OUT]


def closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions that `requirements` need, theirs included, each once
    (with the requirements of every extra asked of it). A needed one that is not installed
    here stops the build: the venv would lack it."""
    from packaging.requirements import Requirement

    found = {}  # canonical name -> (distribution, its extras followed so far; "" the base)
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = _canonical(requirement.name)
        if name in found:
            dist, followed = found[name]
        else:
            try:
                dist = importlib.metadata.distribution(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                raise SystemExit(f"{requirement} is needed but not installed here") from None
            followed = set()
        extras = (set(requirement.extras) | {""}) - followed
        found[name] = (dist, followed | extras)
        if not extras:
            continue
        for line in dist.requires or []:
            needed = Requirement(line)
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra})
                                             for extra in extras):
                todo.append(needed)
    return [dist for dist, _ in found.values()]


def copy_distributions(dists, site: pathlib.Path) -> int:
    """Copy each distribution's files (its RECORD) into `site`; scripts and data files
    outside site-packages are left behind. Returns the bytes copied."""
    copied = 0
    for dist in dists:
        for file in dist.files or []:
            source = pathlib.Path(dist.locate_file(file))
            if file.parts[0] == ".." or not source.is_file():
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            copied += target.stat().st_size
    return copied


def build(target: pathlib.Path, requirements: list[str]) -> dict:
    """A venv at `target` (created anew) holding only the distributions `requirements` need."""
    dists = closure(requirements)
    if target.exists():
        shutil.rmtree(target)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    site = pathlib.Path(subprocess.run(
        [target / "bin" / "python", "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    size = copy_distributions(dists, site)
    return {"venv": str(target), "site_packages": str(site), "megabytes": round(size / 1e6),
            "distributions": sorted(f"{d.metadata['Name']} {d.version}" for d in dists)}


def foreign_cuda_libraries(maps: str, prefix: str) -> list[str]:
    """The CUDA libraries in /proc/self/maps' text loaded from outside `prefix`, the
    driver's (libcuda, libnvidia-*) excepted."""
    paths = {line.split(maxsplit=5)[5] for line in maps.splitlines()
             if len(line.split(maxsplit=5)) == 6}
    prefix = os.path.realpath(prefix) + os.sep
    return sorted(path for path in paths
                  if os.path.basename(path).startswith(("libcu", "libnv"))
                  and not os.path.basename(path).startswith(("libcuda.so", "libnvidia-"))
                  and not os.path.realpath(path).startswith(prefix))


def _in_slim_venv() -> dict:
    """Where NVRTC and the CUDA headers come from; stops outside a venv."""
    if sys.prefix == sys.base_prefix:
        raise SystemExit("run this in the slim venv: /path/to/venv/bin/python")
    from cuda import pathfinder

    import cupy

    return {"nvrtc": pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path,
            "cuda_headers": pathfinder.find_nvidia_header_directory("cudart"),
            "nvrtc_version": cupy.cuda.nvrtc.getVersion()}


def _found_inside(report: dict) -> bool:
    return all(str(report[key]).startswith(sys.prefix) for key in ("nvrtc", "cuda_headers"))


def compile_every_configuration() -> int:
    """Every kernel configuration the package knows (sm_80, sm_90, sm_90a), compiled as a
    forward compiles it, without a GPU: the plain-target ones through CuPy's own run-time
    compilation (RawModule's options: CuPy's include folders, the CUDA headers it finds,
    -ftz=true, --pch ...), the sm_90a ones through gpu/compile.py (_cubin_file's). 0 if
    all compile with NVRTC and headers from this venv."""
    report = _in_slim_venv()
    import cupy
    from cupy.cuda import compiler

    from triattn_cupy.gpu import compile as kernels_compile
    from triattn_cupy.gpu import kernel_catalog

    # CuPy takes the target from the current device (memoized per device): give it here.
    compiler._get_arch_for_options_for_nvrtc = lambda arch=None: (f"-arch=sm_{arch}", "cubin")
    options = cupy._core.core.assemble_cupy_compiler_options(kernels_compile.NVRTC_OPTIONS)
    pairs = dict.fromkeys((config, config.arch or arch)
                          for arch in kernels_compile.CHECK_ARCHS
                          for configs in (kernel_catalog.all_configs,
                                          kernel_catalog.transposed_out_configs,
                                          kernel_catalog.row_masked_configs,
                                          kernel_catalog.pair_dtype_configs,
                                          kernel_catalog.row_blocked_configs)
                          for config in configs(arch))
    failed = []
    for config, arch in pairs:
        try:
            if config.arch:
                kernels_compile._nvrtc_compile(config.filename, config.defines, config.arch,
                                               kernels_compile._CUPY_OPTIONS)
            else:
                compiler._compile_using_nvrtc_no_warning(
                    kernels_compile.full_source(config.filename, config.defines),
                    options + ("-ftz=true",), arch[3:], cache_in_memory=True)
        except Exception as error:  # the compiler's log, for the report
            failed.append(f"{arch} {config.filename} {dict(config.defines)}: {error}")
    report.update(compiled=len(pairs) - len(failed), failed=failed,
                  through_sm_90a=sum(1 for config, _ in pairs if config.arch))
    print(json.dumps(report, indent=1))
    return 0 if _found_inside(report) and not failed else 1


def probe() -> int:
    """One forward per precision from an empty kernel cache, on the GPU; 0 if everything
    CUDA but the driver came from this venv and no library of NOT_NEEDED was loaded."""
    os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="slim_cache_")
    report = _in_slim_venv()
    report["errors"] = {}
    import numpy as np

    import cupy
    import triattn_cupy as ta
    from triattn_cupy import reference

    weights = ta.load_default_weights()
    module = ta.TriangleAttention(weights)
    rng = np.random.default_rng(0)
    accurate = True
    for n in (200, 400):  # on 9.0 bf16 takes fp16 scores from N = 384
        pair = rng.standard_normal((1, n, n, weights.pair_dim), dtype=np.float32)
        mask = rng.random((1, n, n)) > 0.1
        want = reference.triangle_attention(pair, mask, weights)
        for precision, bound in BOUNDS.items():
            out = module(cupy.asarray(pair), cupy.asarray(mask), precision=precision)
            error = float(np.linalg.norm(cupy.asnumpy(out) - want) / np.linalg.norm(want))
            report["errors"][f"{precision} N={n}"] = error
            accurate &= error <= bound  # NaN fails too
    with open("/proc/self/maps") as maps:
        text = maps.read()
    report["foreign_cuda_libraries"] = foreign_cuda_libraries(text, sys.prefix)
    report["not_needed_but_loaded"] = sorted({name for name in NOT_NEEDED if name in text})
    print(json.dumps(report, indent=1))
    return 0 if (_found_inside(report) and accurate and not report["foreign_cuda_libraries"]
                 and not report["not_needed_but_loaded"]) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=["build"])
    parser.add_argument("target", nargs="?", type=pathlib.Path, help="the venv to build")
    parser.add_argument("--extra", default="cuda13-slim")
    parser.add_argument("--also", nargs="*", default=["nvidia-curand", "ml-dtypes"],
                        help="distributions the tests need beside the extra (for "
                             "cuda12-slim: nvidia-curand-cu12 ml-dtypes)")
    parser.add_argument("--probe", action="store_true",
                        help="compile and launch in this venv; check where CUDA came from")
    parser.add_argument("--compile", action="store_true",
                        help="compile every kernel configuration in this venv (no GPU)")
    args = parser.parse_args(argv)
    if args.probe:
        return probe()
    if args.compile:
        return compile_every_configuration()
    if args.command != "build" or args.target is None:
        parser.error("say `build VENV`, `--compile` or `--probe`")
    print(json.dumps(build(args.target, extra_requirements(args.extra) + args.also), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
