"""Which kernel configuration (source file, #defines, launch shape) serves which problem.

One table for the run-time launches and the offline compile checks, so CI compiles
exactly the configurations that run.
"""
from __future__ import annotations

import dataclasses

MAX_HEAD_DIM = 128
MAX_PAIR_DIM = 768  # the row tile of D floats x 64 rows must fit in shared memory
PROJECT_THREADS = 256
ATTENTION_THREADS = 128
_PROJECT_BK, _PROJECT_BN = 16, 128


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    filename: str
    defines: tuple[tuple[str, int], ...]

    def get(self, name: str):
        from ._compile import raw_module

        return raw_module(self.filename, self.defines).get_function(name)


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

def project_rows(pair_dim: int) -> int:
    """Rows per block: 128, or 64 when a 128-row tile of D floats would not fit."""
    return 128 if pair_dim <= 320 else 64


def project_config(pair_dim: int) -> KernelConfig:
    return KernelConfig("project.cu", (("BM", project_rows(pair_dim)),))


def project_smem_bytes(pair_dim: int) -> int:
    bm = project_rows(pair_dim)
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
    configs = {project_config(64), project_config(512)}
    configs.update(attention_config(d) for d in supported_head_dims())
    return sorted(configs, key=lambda c: (c.filename, c.defines))
