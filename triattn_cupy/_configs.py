"""Which kernel configuration (source file, #defines, launch shape) serves which problem.

One table for the run-time launches and the offline compile checks, so CI compiles
exactly the configurations that run.
"""
from __future__ import annotations

import dataclasses
import functools

MAX_HEAD_DIM = 128
MAX_PAIR_DIM = 768  # the row tile of D floats x 64 rows must fit in shared memory
PROJECT_THREADS = 256
ATTENTION_THREADS = 128
_PROJECT_BK, _PROJECT_BN = 16, 128


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    filename: str
    defines: tuple[tuple[str, int], ...]

    def get(self, name: str, smem_bytes: int = 0):
        """The kernel `name`, allowed `smem_bytes` of dynamic shared memory (compiled on the
        current device at first use; cached, so the per-call cost is a dictionary look-up)."""
        return _kernel(self, name, smem_bytes, _current_device())


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


@functools.lru_cache(maxsize=None)
def _kernel(config: KernelConfig, name: str, smem_bytes: int, device: int):
    from ._compile import raw_module

    kernel = raw_module(config.filename, config.defines).get_function(name)
    if smem_bytes > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = smem_bytes  # opt in above the 48 KiB default
    return kernel


def supported_head_dims():
    return tuple(range(4, MAX_HEAD_DIM + 1, 4))


def check_dims(pair_dim: int, num_heads: int):
    d = pair_dim // num_heads
    if d % 4 or d > MAX_HEAD_DIM:
        raise ValueError(
            f"head dimension pair_dim/num_heads must be a multiple of 4 and at most "
            f"{MAX_HEAD_DIM} on the GPU; got {pair_dim}/{num_heads} = {d}")
    if pair_dim > MAX_PAIR_DIM:
        raise ValueError(f"pair_dim must be at most {MAX_PAIR_DIM} on the GPU; got {pair_dim}")


# ---- projections (kernels/project.cu) ----

def project_rows(pair_dim: int, rows_total: int = 1 << 62, sm_count: int = 132) -> int:
    """Rows per block: 128, or 64 when a 128-row tile of D floats would not fit in shared
    memory, or when 128-row blocks would leave the GPU with under ~4 blocks per SM."""
    if pair_dim > 320 or rows_total < 4 * 128 * sm_count:
        return 64
    return 128


def project_config(rows: int) -> KernelConfig:
    return KernelConfig("project.cu", (("BM", rows),))


def project_smem_bytes(pair_dim: int, bm: int) -> int:
    dpad = -(-pair_dim // _PROJECT_BK) * _PROJECT_BK
    return 8 * bm + 4 * (dpad * bm + 2 * _PROJECT_BK * _PROJECT_BN + PROJECT_THREADS + 2 * bm)


# ---- attention (kernels/attention.cu) ----

def attention_tiles(head_dim: int) -> tuple[int, int]:
    """(BQ, BK): the largest tiles whose accumulators stay in registers (no spills)."""
    if head_dim <= 32:
        return 128, 64
    if head_dim <= 64:
        return 64, 64
    return 64, 32


def attention_config(head_dim: int) -> KernelConfig:
    bq, bk = attention_tiles(head_dim)
    return KernelConfig("attention.cu", (("HEAD_DIM", head_dim), ("BQ", bq), ("BK", bk)))


def attention_smem_bytes(head_dim: int) -> int:
    bq, bk = attention_tiles(head_dim)
    dv = -(-head_dim // 32) * 32
    return 4 * (head_dim * (bq + bk) + bk * dv + bk * (bq + 4))


def all_configs():
    """Every configuration a supported (pair_dim, num_heads) can launch."""
    configs = {project_config(64), project_config(128)}
    configs.update(attention_config(d) for d in supported_head_dims())
    return sorted(configs, key=lambda c: (c.filename, c.defines))
