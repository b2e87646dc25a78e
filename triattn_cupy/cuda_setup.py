"""What the GPU API needs from the installation, checked before the first GPU call so that
a missing piece gets an error that says what to do instead of a raw CUDA error.

- CuPy: ``pip install "triattn-cupy[cuda13]"`` (``pip install ".[cuda13]"`` from a source
  checkout; ``cuda12`` for a CUDA 12 driver), which
  brings ``cupy-cuda13x[ctk]``: CuPy and the CUDA libraries it loads, NVRTC included;
- a CUDA GPU: without one, `triattn_cupy.reference.triangle_attention` computes the same
  forward pass on the CPU with NumPy (it is never chosen silently);
- NVRTC (``libnvrtc``): every kernel is compiled at run time, so a host with the driver
  alone cannot run a forward pass.
"""
from __future__ import annotations

from ._install import pip_install

INSTALL_HINT = (f'{pip_install("cuda13")}, or the extra cuda12 for a CUDA 12 driver, '
                f'which brings cupy-cuda13x[ctk] / cupy-cuda12x[ctk] with NVRTC')
CPU_HINT = ("triattn_cupy.reference.triangle_attention computes the same forward pass on "
            "the CPU with NumPy")

_ready = False


class GpuUnavailableError(RuntimeError):
    """The GPU API cannot run here: no CUDA GPU, or no NVRTC to compile the kernels."""


def require_cuda():
    """CuPy, after checking once per process that a CUDA GPU is usable and that NVRTC
    loads. Raises ImportError (no CuPy) or GpuUnavailableError, each saying what to
    install or use instead."""
    try:
        import cupy
    except ImportError as error:
        raise ImportError(f"triattn_cupy's GPU API needs CuPy: {INSTALL_HINT}. Without a "
                          f"GPU, {CPU_HINT}.") from error
    global _ready
    if not _ready:
        check_cuda(cupy)
        _ready = True
    return cupy


def check_cuda(cupy) -> None:
    """GpuUnavailableError unless `cupy` sees a CUDA device and can load NVRTC."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        why = "the CUDA driver reports no device"
    except Exception as exc:  # no driver, driver too old, ...
        count, why = 0, f"{type(exc).__name__}: {exc}"
    if count < 1:
        raise GpuUnavailableError(f"no CUDA GPU is usable on this machine ({why}). "
                                  f"Instead, {CPU_HINT}.")
    try:
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        raise GpuUnavailableError(
            f"NVRTC (libnvrtc), which compiles triattn_cupy's kernels at run time, cannot "
            f"be loaded ({type(exc).__name__}: {exc}). Install it: {INSTALL_HINT}; or a "
            f"CUDA toolkit whose libnvrtc matches the driver.") from None
