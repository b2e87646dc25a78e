"""``triattn-check``: what this host runs, and the kernels compiled ahead of time.

It reports CuPy, the CUDA driver and runtime, NVRTC, each GPU (name, compute capability),
the route each precision takes for a shape (``--shape``), and CuPy's kernel cache: its
folder and size. ``--warmup SHAPE...`` runs one forward of each shape in each precision,
mask layout and node, so that every kernel those forwards launch is compiled into the
cache: a container build runs it once, and later processes compile nothing.

Exit status: 0 the GPU API is usable here (and the warmup, where asked, ran); 1 it is not,
the reason printed; 2 a usage error.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

import numpy as np

from ._version import __version__
from .conventions import NODES
from .cuda_setup import INSTALL_HINT, GpuUnavailableError, check_cuda
from .gpu import gpus as gpus_table
from .gpu.checks import PRECISIONS, check_dims, check_projection_fits
from .gpu.compile import kernel_cache_folder, raw_module
from .gpu.tiles import SMEM_LIMIT

USABLE, NOT_USABLE, USAGE = 0, 1, 2
DEFAULT_SHAPE = "1x384x128x4"
PAIR_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    n: int
    pair_dim: int
    heads: int

    def __str__(self):
        return f"{self.batch}x{self.n}x{self.pair_dim}x{self.heads}"


def parse_shape(text: str) -> Shape:
    """B x N x D x heads, as in 1x384x128x4 (argparse's type: a clear message otherwise)."""
    if not re.fullmatch(r"\d+x\d+x\d+x\d+", text):
        raise argparse.ArgumentTypeError(
            f"a shape is BxNxDxh, four positive integers such as {DEFAULT_SHAPE} (batch, "
            f"length, pair dim, heads); got {text!r}")
    shape = Shape(*(int(part) for part in text.split("x")))
    if min(dataclasses.astuple(shape)) < 1:
        raise argparse.ArgumentTypeError(f"every size of a shape must be at least 1; got {text!r}")
    if shape.pair_dim % shape.heads:
        raise argparse.ArgumentTypeError(
            f"the pair dim D must be a multiple of the heads h (head dim D / h); got D = "
            f"{shape.pair_dim}, h = {shape.heads} in {text!r}")
    return shape


def parse_arch(text: str) -> int:
    """A compute capability: 90, sm_90, sm_90a or 9.0 (100, sm_100, 10.0)."""
    found = re.fullmatch(r"(?:sm_)?(\d+)(\d)[af]?|(\d+)\.(\d)", text.strip())
    if not found:
        raise argparse.ArgumentTypeError(
            f"--arch is a compute capability such as 90, sm_90 or 9.0; got {text!r}")
    major, minor = (found.group(1), found.group(2)) if found.group(1) else found.group(3, 4)
    return int(major) * 10 + int(minor)


def route_names(shape: Shape, compute_capability: int, smem_limit: int) -> dict[str, str]:
    """{precision: the route a forward of `shape` takes on such a GPU, or why it cannot run}
    (weights whose scores fit fp16's range, a contiguous pair: the common case)."""
    from .gpu.routes import choose_route

    head_dim = shape.pair_dim // shape.heads
    try:
        check_dims(shape.pair_dim, shape.heads)
        check_projection_fits(shape.pair_dim, smem_limit)
    except ValueError as exc:
        return {precision: f"none: {exc}" for precision in PRECISIONS}
    return {precision: choose_route(precision, head_dim, shape.pair_dim, shape.n,
                                    compute_capability, smem_limit=smem_limit).name
            for precision in PRECISIONS}


def cache_report(folder) -> str:
    """The cache folder, its compiled kernels and bytes, or that it does not exist yet."""
    if os.environ.get("CUPY_CACHE_IN_MEMORY", "").lower() in ("1", "true", "yes"):
        return (f"{folder}: not used (CUPY_CACHE_IN_MEMORY is set: every process compiles "
                f"its kernels again)")
    if not folder.is_dir():
        return f"{folder} (does not exist yet; CUPY_CACHE_DIR moves it)"
    files = [entry for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)]
    kernels = sum(entry.name.endswith(".cubin") for entry in files)
    size = sum(entry.stat(follow_symlinks=False).st_size for entry in files)
    return (f"{folder} ({kernels} compiled kernel{'s' * (kernels != 1)}, "
            f"{size / 2**20:.1f} MiB; CUPY_CACHE_DIR moves it)")


def _cached_kernels(folder) -> set[str]:
    return {name for name in os.listdir(folder) if name.endswith(".cubin")} \
        if folder.is_dir() else set()


def _version(call) -> str:
    """`call()` formatted, or why it failed (the report goes on)."""
    try:
        return call()
    except Exception as exc:  # a missing library, no driver: reported, not raised
        return f"unavailable ({type(exc).__name__}: {exc})"


def _cuda_version(number: int) -> str:
    """CUDA's version number (13020) as 13.2; 0, which cudaDriverGetVersion gives where no
    driver is loaded, as that."""
    if number == 0:
        return "none (no CUDA driver is loaded)"
    return f"{number // 1000}.{number % 1000 // 10}"


def _gpus(cupy) -> list[dict]:
    """Name, compute capability, SMs, memory and shared memory limit of each visible GPU."""
    gpus = []
    for index in range(cupy.cuda.runtime.getDeviceCount()):
        properties = cupy.cuda.runtime.getDeviceProperties(index)
        optin = cupy.cuda.Device(index).attributes.get("MaxSharedMemoryPerBlockOptin",
                                                       SMEM_LIMIT)
        gpus.append(dict(index=index, name=properties["name"].decode(),
                         compute_capability=properties["major"] * 10 + properties["minor"],
                         sms=properties["multiProcessorCount"],
                         memory=properties["totalGlobalMem"],
                         smem_limit=min(SMEM_LIMIT, optin)))
    return gpus


def warmup(shapes, precisions, dtypes: dict, say) -> tuple[int, int]:
    """One forward of each shape in each precision, pair dtype ({name: NumPy dtype}),
    mask layout and node on the
    current GPU, so that their kernels are compiled into the cache. (compiled, cached):
    the compiled kernels the cache gained (CuPy's own small kernels the weights' upload uses
    among them), and this package's kernel configurations loaded from the cache."""
    import cupy

    from . import TriangleAttention, random_weights

    folder = kernel_cache_folder()
    before, loaded_before = _cached_kernels(folder), raw_module.cache_info().misses
    for shape in shapes:
        module = TriangleAttention(random_weights(shape.pair_dim, shape.heads, seed=0))
        # the values do not choose the kernels (the weights' scales do): zeros, made fast
        host = np.zeros((shape.batch, shape.n, shape.n, shape.pair_dim), np.float32)
        # uploaded from the host: no CuPy kernel runs to make them
        mask = cupy.asarray(np.ones((shape.batch, shape.n, shape.n), dtype=bool))
        for dtype, numpy_dtype in dtypes.items():
            pair = cupy.asarray(host.astype(numpy_dtype))
            started = time.perf_counter()
            for precision in precisions:
                for mask_layout in ("pair", "row"):
                    for node in NODES:
                        if node == "ending_af3":  # the NumPy backend's only
                            continue
                        module(pair, mask, precision=precision, mask_layout=mask_layout,
                               node=node)
            cupy.cuda.get_current_stream().synchronize()
            say(f"  {shape} {dtype}: {', '.join(precisions)} in "
                f"{time.perf_counter() - started:.1f} s")
    compiled = len(_cached_kernels(folder) - before)
    loaded = raw_module.cache_info().misses - loaded_before
    return compiled, max(loaded - compiled, 0)


def _numpy_dtype(name: str):
    """The NumPy dtype of a --dtype name; bfloat16 is ml_dtypes' (ImportError without it)."""
    if name != "bfloat16":
        return np.dtype(name)
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("--dtype bfloat16 needs ml_dtypes (pip install ml_dtypes), the "
                          "bfloat16 type of CuPy arrays") from None
    return ml_dtypes.bfloat16


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triattn-check",
        description="What this host runs: CuPy, the CUDA driver, NVRTC, the GPUs, the route "
                    "each precision takes for a shape, and the kernel cache; --warmup "
                    "compiles the kernels of given shapes ahead of time.",
        epilog="Exit status: 0 the GPU API is usable here (and the warmup ran), 1 it is not "
               "(the reason printed), 2 usage error. The kernel cache is CuPy's: "
               "$CUPY_CACHE_DIR, else ~/.cupy/kernel_cache.")
    parser.add_argument("--shape", type=parse_shape, default=parse_shape(DEFAULT_SHAPE),
                        metavar="BxNxDxh",
                        help=f"the shape whose routes are shown (default {DEFAULT_SHAPE})")
    parser.add_argument("--arch", type=parse_arch, metavar="CC",
                        help="show the routes of a GPU of this compute capability (90, sm_80, "
                             "8.6) instead of this host's")
    parser.add_argument("--warmup", type=parse_shape, nargs="+", metavar="BxNxDxh",
                        help="compile the kernels of these shapes (every mask layout and "
                             "node) into the kernel cache; needs a GPU")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                        help="the warmup's precisions (default: all)")
    parser.add_argument("--dtype", nargs="+", choices=PAIR_DTYPES, default=["float32"],
                        help="the warmup's pair dtypes (default float32)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def _label(name: str) -> str:
    return f"{name + ':':<15}"


def _report_installation(say):
    """(CuPy or None, the usable GPUs, None or why the GPU API cannot run), reported."""
    try:
        import cupy
    except Exception as exc:  # not installed, or a broken CUDA install raising at import
        say(_label("CuPy") + f"not importable ({type(exc).__name__}: {exc})")
        say(_label("GPU") + "none usable")
        return None, [], f"the GPU API needs CuPy: {INSTALL_HINT}"
    say(_label("CuPy") + cupy.__version__)
    runtime = cupy.cuda.runtime
    say(_label("CUDA driver") + _version(lambda: _cuda_version(runtime.driverGetVersion())))
    say(_label("CUDA runtime") + _version(lambda: _cuda_version(runtime.runtimeGetVersion())))
    say(_label("NVRTC") + _version(lambda: ".".join(map(str, cupy.cuda.nvrtc.getVersion()))))
    try:
        check_cuda(cupy)
    except GpuUnavailableError as exc:
        say(_label("GPU") + "none usable")
        return cupy, [], str(exc)
    gpus = _gpus(cupy)
    for gpu in gpus:
        cc = gpu["compute_capability"]
        say(_label(f"GPU {gpu['index']}") + f"{gpu['name']}, compute capability "
            f"{cc // 10}.{cc % 10}, {gpu['sms']} SMs, {gpu['memory'] / 2**30:.1f} GiB")
    return cupy, gpus, None


def _report_routes(shape: Shape, arch: int | None, gpus: list[dict], say):
    """The routes of `shape` on a GPU of compute capability `arch`, else on GPU 0."""
    if arch is None and not gpus:
        say(_label("routes") + f"no GPU to choose for (--arch 90 shows a compute "
            f"capability 9.0 GPU's for {shape})")
        return
    if arch is None:
        cc, smem, where = gpus[0]["compute_capability"], gpus[0]["smem_limit"], "GPU 0, "
    else:
        # the GPU table's shared memory: a GPU present reports its own
        cc, smem, where = arch, gpus_table.gpu(arch).smem_optin, "--arch "
    say(_label("routes") + f"{shape} (B x N x D x heads) on {where}compute capability "
        f"{cc // 10}.{cc % 10}:")
    for precision, route in route_names(shape, cc, smem).items():
        say(f"  {precision:<5} {route}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    say = print
    say(f"triattn-cupy {__version__}")
    cupy, gpus, reason = _report_installation(say)
    _report_routes(args.shape, args.arch, gpus, say)
    say(_label("kernel cache") + cache_report(kernel_cache_folder()))
    if reason is not None:
        say(_label("not usable") + reason)
        if args.warmup:
            say(_label("warmup") + "not run: it compiles the kernels by running forwards, "
                "which needs a GPU (run it where the kernels will run, or in a build on a GPU "
                "host)")
        return NOT_USABLE
    if args.warmup:
        started = time.perf_counter()
        try:
            dtypes = {name: _numpy_dtype(name) for name in args.dtype}
            say(_label("warmup") + f"{len(args.warmup)} shape{'s' * (len(args.warmup) > 1)} "
                f"on GPU {cupy.cuda.Device().id}")
            compiled, cached = warmup(args.warmup, args.precision, dtypes, say)
        except (ImportError, ValueError, TypeError, MemoryError, RuntimeError) as exc:
            # a shape the GPU refuses, too large for its memory, no ml_dtypes
            say(_label("warmup failed") + f"{type(exc).__name__}: {exc}")
            return NOT_USABLE
        say(_label("warmup") + f"compiled {compiled}, cached {cached} in "
            f"{time.perf_counter() - started:.1f} s")
        say(_label("kernel cache") + cache_report(kernel_cache_folder()))
    say(_label("usable") + "yes")
    return USABLE


if __name__ == "__main__":
    sys.exit(main())
