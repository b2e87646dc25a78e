"""Argument checks of the GPU engine (the backend-neutral ones are in triattn_cupy._checks):
CuPy present, problem sizes the kernels take, arrays on the right device."""
from __future__ import annotations

import numpy as np

from .tiles import MAX_HEAD_DIM, MAX_PAIR_DIM, project_smem_bytes


def _cupy():
    try:
        import cupy
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise ImportError(
            "triattn_cupy's GPU functions need CuPy: pip install 'triattn-cupy[cuda13]' "
            "(or [cuda12], matching your CUDA driver)") from error
    return cupy


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device. Never raises."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


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


def check_projection_fits(pair_dim: int, smem_limit: int, gpu: str = "this GPU"):
    """A clear error where even 64-row projection blocks need more shared memory than the
    GPU lets a block have (MaxSharedMemoryPerBlockOptin: 227 KiB on sm_90, 163 KiB on
    sm_80, 99 KiB on sm_86/89)."""
    need = project_smem_bytes(pair_dim, 64)
    if need > smem_limit:
        fits = max((D for D in range(4, MAX_PAIR_DIM + 1, 4)
                    if project_smem_bytes(D, 64) <= smem_limit), default=0)
        raise ValueError(f"pair_dim {pair_dim} needs {need} bytes of shared memory per block "
                         f"for the projections; {gpu} allows {smem_limit} "
                         f"(pair_dim up to {fits} fits)")


# The precision modes (the routes of each: routes.py)
PRECISIONS = ("fp32", "tf32", "bf16")


def check_precision(precision: str):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")


def _describe(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def as_device_array(obj, arg: str, device_id: int):
    """A CuPy view of `obj` (CuPy array, __cuda_array_interface__ or DLPack), no copy."""
    cupy = _cupy()
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{arg} is a NumPy (host) array; the GPU backend needs it on the "
                        f"device: pass cupy.asarray({arg}) (or use triattn_cupy.reference "
                        f"for the CPU)")
    if isinstance(obj, cupy.ndarray):
        array = obj
    elif hasattr(obj, "__cuda_array_interface__"):
        array = cupy.asarray(obj)
    elif hasattr(obj, "__dlpack__"):
        try:
            array = cupy.from_dlpack(obj)
        except Exception as error:
            raise TypeError(f"{arg} ({_describe(obj)}) could not be taken as a GPU array "
                            f"through DLPack: {error}") from error
    else:
        raise TypeError(f"{arg} must be a CuPy array or a GPU array exposing "
                        f"__cuda_array_interface__ or DLPack; got {_describe(obj)}")
    if array.data.device_id != device_id:  # (cheaper than array.device, a new Device)
        raise ValueError(f"{arg} is on GPU {array.device.id} but the weights are on GPU "
                         f"{device_id}; move it with cupy.asarray under "
                         f"cupy.cuda.Device({device_id}), or build the module there")
    return array
