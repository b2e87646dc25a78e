"""The ceilings of this GPU, measured: device copy bandwidth and cuBLAS matrix rates.

Each figure is measured through CuPy (cudaMemcpyAsync; cupy.matmul with float32 in plain
fp32 and, through CuPy's compute-type switch, TF32) and through PyTorch (copy_, matmul in
fp32, TF32 and bf16), on random data (zeros run faster: METHOD.md). The ceiling is the
larger of the two; both are kept. A figure that could not be measured falls back to the
H200's nominal value (roofline.NOMINAL_H200) and is listed under "assumed".
"""
from __future__ import annotations

import statistics

from . import roofline
from .common import log, short_error

COPY_BYTES = 2 << 30      # 2 GiB each way: ~40x the L2
GEMM_N = 8192             # 8192^3 matrices fill the chip


def _events_median(timer, fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    timer.synchronize()
    times = []
    for _ in range(reps):
        a, b = timer.event(), timer.event()
        a.record()
        fn()
        b.record()
        timer.synchronize()
        times.append(timer.elapsed_ms(a, b))
    return statistics.median(times)


def _cupy_copy(timer) -> float:
    import cupy
    src = cupy.random.random(COPY_BYTES // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    ms = _events_median(timer, lambda: dst.data.copy_from_device_async(src.data, src.nbytes),
                        reps=10)
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


def _cupy_gemms(timer, out: dict):
    import cupy
    rs = cupy.random.RandomState(0)
    a = rs.standard_normal((GEMM_N, GEMM_N), dtype=cupy.float32)
    b = rs.standard_normal((GEMM_N, GEMM_N), dtype=cupy.float32)
    c = cupy.empty_like(a)
    flops = 2 * GEMM_N ** 3
    ms = _events_median(timer, lambda: cupy.matmul(a, b, out=c), reps=5)
    out["fp32_TFLOPs"] = flops / (ms * 1e-3) / 1e12
    try:  # CuPy's compute-type switch (private; PyTorch measures TF32 as well)
        from cupy._core import _routines_linalg as linalg
        old = cupy._core.get_compute_type(cupy.float32)
        cupy._core.set_compute_type(cupy.float32, linalg.COMPUTE_TYPE_TF32)
        try:
            ms = _events_median(timer, lambda: cupy.matmul(a, b, out=c), reps=10)
        finally:
            cupy._core.set_compute_type(cupy.float32, old)
        out["tf32_TFLOPs"] = flops / (ms * 1e-3) / 1e12
    except Exception as exc:  # noqa: BLE001
        out["tf32_error"] = short_error(exc)


def _cupy_ceilings(out: dict):
    import cupy
    from .timing import CupyTimer
    timer = CupyTimer()
    try:
        out["copy_GBps"] = _cupy_copy(timer)
        _cupy_gemms(timer, out)
    finally:
        cupy.get_default_memory_pool().free_all_blocks()


def _torch_copy(timer) -> float:
    import torch
    src = torch.rand(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = _events_median(timer, lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def _torch_gemms(timer, out: dict):
    import torch
    from .systems import matmul_precision
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(GEMM_N, GEMM_N, device="cuda", generator=g)
    b = torch.randn(GEMM_N, GEMM_N, device="cuda", generator=g)
    c = torch.empty_like(a)
    flops = 2 * GEMM_N ** 3
    for key, tf32, reps in (("fp32_TFLOPs", False, 5), ("tf32_TFLOPs", True, 10)):
        with matmul_precision(tf32):
            ms = _events_median(timer, lambda: torch.matmul(a, b, out=c), reps=reps)
        out[key] = flops / (ms * 1e-3) / 1e12
    ah, bh = a.bfloat16(), b.bfloat16()
    ch = torch.empty_like(ah)
    ms = _events_median(timer, lambda: torch.matmul(ah, bh, out=ch), reps=10)
    out["bf16_TFLOPs"] = flops / (ms * 1e-3) / 1e12


def _torch_ceilings(out: dict):
    import torch
    from .timing import TorchCudaTimer
    timer = TorchCudaTimer()
    try:
        out["copy_GBps"] = _torch_copy(timer)
        _torch_gemms(timer, out)
    finally:
        torch.cuda.empty_cache()


def measure(use_cupy: bool = True, use_torch: bool = True) -> dict:
    """{copy_GBps, fp32_TFLOPs, tf32_TFLOPs, bf16_TFLOPs, by_source, assumed, errors}."""
    by_source, errors = {}, {}
    for source, fn, wanted in (("cupy", _cupy_ceilings, use_cupy),
                               ("torch", _torch_ceilings, use_torch)):
        if not wanted:
            continue
        figures = {}
        try:
            fn(figures)
        except Exception as exc:  # noqa: BLE001 - record and fall back
            errors[source] = short_error(exc)
            log.warning("ceilings through %s failed: %s", source, errors[source])
        if "tf32_error" in figures:
            errors[f"{source}_tf32"] = figures.pop("tf32_error")
        if figures:
            by_source[source] = {k: round(v, 2) for k, v in figures.items()}
            log.info("ceilings via %s: %s", source, by_source[source])
    return combine(by_source, errors)


def combine(by_source: dict, errors: dict | None = None) -> dict:
    """The larger measured figure of each kind; the nominal H200 one where none was measured."""
    result = {"by_source": by_source, "assumed": [], "errors": errors or {}}
    for key, nominal in roofline.NOMINAL_H200.items():
        values = [fig[key] for fig in by_source.values() if fig.get(key)]
        if values:
            result[key] = max(values)
        else:
            result[key] = nominal
            result["assumed"].append(key)
    return result


def nominal(reason: str) -> dict:
    result = combine({}, {"not measured": reason})
    return result
