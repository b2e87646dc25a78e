"""Reading the .cu sources and compiling them: at run time through cupy.RawModule, and
offline (no GPU) through NVRTC for the compile checks.

A kernel configuration is a source file plus the `#define`s that specialise it (head dim,
tile sizes). The file guards each with `#ifndef`, so it also compiles alone. Local
`#include "x.cuh"` lines are inlined here, so no include path is needed, and `#line`
directives keep compiler messages pointing at the real file and line.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import pathlib
import re
import threading

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)
NVRTC_OPTIONS = ("-std=c++17",)
# What CuPy adds to every compilation of its own (denormals flushed), so that a kernel we
# compile ourselves (raw_module's `arch`) computes as CuPy-compiled ones do.
_CUPY_OPTIONS = ("-ftz=true",)


def _kernels_folder():
    try:
        return importlib.resources.files("triattn_cupy.kernels")
    except ModuleNotFoundError:  # a source checkout on sys.path, not installed
        return pathlib.Path(__file__).resolve().parents[2] / "kernels"


@functools.lru_cache(maxsize=None)
def kernel_source(filename: str) -> str:
    """The text of kernels/<filename>, found inside the installed package."""
    return _kernels_folder().joinpath(filename).read_text()


def _expand(filename: str, seen: set) -> str:
    """The file with its local headers inlined, each once per compilation (what their
    #pragma once would do; `seen` collects the names inlined so far)."""
    if filename in seen:
        return ""
    seen.add(filename)
    text = kernel_source(filename)
    pieces, last = [], 0
    for match in _INCLUDE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        pieces.append(text[last:match.start()])
        pieces.append(_expand(match.group(1), seen))
        pieces.append(f'\n#line {line + 1} "kernels/{filename}"\n')
        last = match.end() + 1
    pieces.append(text[last:])
    return f'#line 1 "kernels/{filename}"\n' + "".join(pieces)


def full_source(filename: str, defines: tuple[tuple[str, int], ...]) -> str:
    """The compilable text: the `#define`s, then the file with its headers inlined."""
    head = "".join(f"#define {name} {value}\n" for name, value in defines)
    return head + _expand(filename, set())


@functools.lru_cache(maxsize=None)
def raw_module(filename: str, defines: tuple[tuple[str, int], ...], arch: str = ""):
    """A cupy.RawModule for one configuration. CuPy compiles it on the first
    get_function, once per device, and keeps the binary in its on-disk cache. A
    configuration that names an `arch` (such as "sm_90a", whose wgmma instructions the
    plain sm_90 target rejects) is compiled here for that target instead: CuPy's own
    compilation always asks NVRTC for the device's plain architecture."""
    import cupy

    if arch:
        return cupy.RawModule(path=str(_cubin_file(filename, defines, arch)))
    return cupy.RawModule(code=full_source(filename, defines), options=NVRTC_OPTIONS)


def kernel_cache_folder() -> pathlib.Path:
    """CuPy's kernel cache folder, where it keeps the binaries it compiles and where
    _cubin_file keeps ours: $CUPY_CACHE_DIR, else ~/.cupy/kernel_cache (CuPy's rule)."""
    import os

    return pathlib.Path(os.environ.get("CUPY_CACHE_DIR",
                                       pathlib.Path.home() / ".cupy" / "kernel_cache"))


def _cubin_file(filename: str, defines: tuple[tuple[str, int], ...], arch: str) -> pathlib.Path:
    """The configuration compiled for `arch`, in CuPy's kernel cache folder under a name
    made of the source, options and NVRTC version (written whole, then renamed, so a
    concurrent process never loads half a file)."""
    import hashlib
    import os
    import tempfile

    from cupy_backends.cuda.libs import nvrtc

    source = full_source(filename, defines)
    options = (f"-arch={arch}", *NVRTC_OPTIONS, *_CUPY_OPTIONS)
    key = hashlib.sha256(repr((source, options, nvrtc.getVersion())).encode()).hexdigest()
    folder = kernel_cache_folder()
    path = folder / f"triattn_{key[:32]}.cubin"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        cubin = _nvrtc_compile(filename, defines, arch, _CUPY_OPTIONS)[0]
        with tempfile.NamedTemporaryFile(dir=folder, delete=False) as part:
            part.write(cubin)
        os.replace(part.name, path)
    return path


class CompileError(RuntimeError):
    pass


def compile_offline(filename: str, defines: tuple[tuple[str, int], ...], arch: str) -> str:
    """Compile with NVRTC for `arch` (e.g. "sm_90") without a GPU; return ptxas' report.

    Needs CuPy's NVRTC (`pip install "cupy-cuda13x[ctk]"`); raises CompileError with the
    compiler log on failure.
    """
    return _nvrtc_compile(filename, defines, arch)[1]


def _nvrtc_compile(filename: str, defines: tuple[tuple[str, int], ...], arch: str,
                   extra: tuple[str, ...] = ()):
    """(cubin, ptxas' report) of one configuration for `arch`, through NVRTC."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(full_source(filename, defines), f"kernels/{filename}", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [f"-arch={arch}", "--ptxas-options=-v",
                                           *NVRTC_OPTIONS, *extra])
        except nvrtc.NVRTCError as error:
            raise CompileError(f"{filename} {dict(defines)} for {arch}:\n"
                               f"{nvrtc.getProgramLog(program)}") from error
        # getCUBIN: the machine code really was produced
        return nvrtc.getCUBIN(program), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """{entry: {"registers", "stack", "spill_stores", "spill_loads"}} from ptxas -v output.
    The spills of an entry include those of the non-inlined functions listed after it
    (its callees): each is a separate "Function properties" line, which must add to the
    entry's, not replace them (they did, and hid the entry's own spills)."""
    report, entry = {}, None
    for line in log.splitlines():
        if (found := _PTXAS_ENTRY.search(line)):
            entry = found.group(1)
            report[entry] = {"stack": 0, "spill_stores": 0, "spill_loads": 0}
        elif entry and (found := _PTXAS_SPILL.search(line)):
            usage = report[entry]
            usage["stack"] = max(usage["stack"], int(found.group(1)))
            usage["spill_stores"] += int(found.group(2))
            usage["spill_loads"] += int(found.group(3))
        elif entry and (found := _PTXAS_REGS.search(line)):
            report[entry]["registers"] = int(found.group(1))
    return report


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    filename: str
    defines: tuple[tuple[str, int], ...]
    arch: str = ""  # a target other than the device's plain one (_compile.raw_module)

    def with_defines(self, *defines: tuple[str, int]) -> "KernelConfig":
        """This configuration with `defines` (compile-time features) added after its own."""
        return dataclasses.replace(self, defines=self.defines + tuple(defines))

    def get(self, name: str, smem_bytes: int = 0):
        """The kernel `name`, allowed `smem_bytes` of dynamic shared memory (compiled on the
        current device at first use; cached, so the per-call cost is a dictionary look-up)."""
        return _kernel(self, name, smem_bytes, _current_device())


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


_smem_allowed: dict = {}  # (config, name, device) -> dynamic shared memory opted in so far


# Held while a kernel is compiled, loaded or opted in: lru_cache lets two threads that
# miss at once both build a module, and the opt-in record is shared by the two objects
_kernel_lock = threading.RLock()


def _kernel(config: KernelConfig, name: str, smem_bytes: int, device: int):
    with _kernel_lock:
        kernel = _function(config, name, device)
        key = (config, name, device)
        # One function object serves every problem size of its configuration: only ever
        # raise its limit, so a smaller request cannot break a larger one cached earlier.
        if smem_bytes > max(_smem_allowed.get(key, 0), 48 * 1024):
            kernel.max_dynamic_shared_size_bytes = smem_bytes  # opt in above 48 KiB
            _smem_allowed[key] = smem_bytes
        return kernel


@functools.lru_cache(maxsize=None)
def _function(config: KernelConfig, name: str, device: int):
    return raw_module(config.filename, config.defines, config.arch).get_function(name)

