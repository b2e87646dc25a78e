"""What the routes know of each GPU: one row per compute capability (`GPUS`).

A row names the engines the GPU runs ("ffma": fp32 FMA kernels; "mma": the mma.sync tensor
cores, 8.0 and newer; "wgmma": the warpgroup products and the persistent projections
built on them, compiled for sm_90a, which no other GPU runs), the dynamic shared memory a
block may opt into, the tile table (tuned_tiles.TABLES) its mma.sync attention takes, and
the target its kernels are compile-checked for offline (tests/test_kernels_compile.py,
tools/compare_kernels.py). routes.choose_route decides from the row alone.

A compute capability missing from the table takes a declared row: before 8.0 the FFMA
kernels alone; otherwise the newest row below it, less the engines that only their own
architecture runs (wgmma), logged once. So an sm_100 or sm_120 GPU runs the sm_90 row's
mma.sync kernels and tiles, compiled by CuPy for its own architecture.

Adding a GPU: its row here (engines, shared memory, tile table; a new tile table in
tuned_tiles.py where it was tuned for it) with its compile target (check_arch: every
target of the table is in CHECK_ARCHS, whose kernel configurations
tests/test_kernels_compile.py compiles without spills).
"""
from __future__ import annotations

import dataclasses
import functools
import logging

_log = logging.getLogger("triattn_cupy")

# The engines: FFMA everywhere; mma.sync from 8.0; wgmma (sm_90a) on 9.0 alone
FFMA, MMA, WGMMA = "ffma", "mma", "wgmma"
# Engines whose kernels run only on the architecture they are compiled for, and that target
# (wgmma exists on compute capability 9.0 alone, in sm_90a, which the plain sm_90 rejects)
ARCH_SPECIFIC = {WGMMA: "sm_90a"}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One compute capability: `engines` it runs, `smem_optin` bytes of dynamic shared
    memory a block may opt into (MaxSharedMemoryPerBlockOptin), `tile_table` the mma.sync
    attention's tiles (tuned_tiles.TABLES), `check_arch` its kernels' offline compile
    target, `dependent_launches` whether it runs programmatic dependent launches
    (dependent_launch.py), `examples` GPUs of that capability, `declared` a row made for a
    capability the table does not list."""
    compute_capability: int
    engines: tuple[str, ...]
    smem_optin: int
    tile_table: str
    check_arch: str
    dependent_launches: bool = False
    examples: str = ""
    declared: bool = False

    def runs(self, engine: str) -> bool:
        return engine in self.engines


KIB = 1024
GPUS = {gpu.compute_capability: gpu for gpu in (
    Gpu(80, (FFMA, MMA), 163 * KIB, "sm_80", "sm_80", examples="A100, A30"),
    Gpu(86, (FFMA, MMA), 99 * KIB, "sm_80", "sm_80", examples="RTX 30, A10, A40"),
    Gpu(87, (FFMA, MMA), 163 * KIB, "sm_80", "sm_80", examples="Jetson Orin"),
    Gpu(89, (FFMA, MMA), 99 * KIB, "sm_80", "sm_80", examples="RTX 40, L4, L40"),
    Gpu(90, (FFMA, MMA, WGMMA), 227 * KIB, "sm_90", "sm_90", dependent_launches=True,
        examples="H100, H200"),
)}
# Before 8.0: the FFMA kernels alone (compile-checked as sm_80's FFMA configurations)
_FFMA_ONLY = Gpu(0, (FFMA,), 48 * KIB, "sm_80", "sm_80", declared=True)

# The targets the kernels are compile-checked for offline (sm_80 the oldest: before it the
# FFMA kernels alone run, the ones sm_80 checks), each standing for its rows (check_arch)
CHECK_ARCHS = tuple(sorted({gpu.check_arch for gpu in GPUS.values()}))


@functools.lru_cache(maxsize=None)
def gpu(compute_capability: int) -> Gpu:
    """The row of `compute_capability` (e.g. 90), or the declared row of one the table does
    not list (the module docstring), with one log line saying which."""
    row = GPUS.get(compute_capability)
    if row is not None:
        return row
    older = [cc for cc in GPUS if cc < compute_capability]
    if compute_capability < min(GPUS) or not older:
        row = dataclasses.replace(_FFMA_ONLY, compute_capability=compute_capability)
    else:
        base = GPUS[max(older)]
        row = dataclasses.replace(
            base, compute_capability=compute_capability, declared=True, examples="",
            engines=tuple(e for e in base.engines if e not in ARCH_SPECIFIC))
        _log.info("compute capability %.1f is not in triattn_cupy's GPU table: it takes the "
                  "%.1f row's %s kernels and tiles", compute_capability / 10,
                  base.compute_capability / 10, " and ".join(row.engines))
    return row


def check_arch(arch: str | None):
    """The rows whose kernels `arch` ("sm_80", "sm_90"; None: every one) compile-checks."""
    return [g for g in GPUS.values() if arch is None or g.check_arch == arch]
