"""Argument checks of the GPU engine (the backend-neutral ones are in triattn_cupy._checks):
CuPy present, problem sizes the kernels take, arrays on the right device."""
from __future__ import annotations

import numpy as np

from .._install import pip_install
from .tiles import MAX_HEAD_DIM, MAX_PAIR_DIM, project_smem_bytes


def _cupy():
    try:
        import cupy
    except ImportError as error:  # pragma: no cover - depends on the installation
        raise ImportError(
            f"triattn_cupy's GPU functions need CuPy: {pip_install('cuda13')}, or the "
            f"extra cuda12, matching your CUDA driver") from error
    return cupy


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device. Never raises."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


class UnsupportedOnGpu(ValueError):
    """Input or weights the GPU kernels do not compute (the NumPy backend computes them).
    A ValueError like every argument check; its own class so that callers with another way
    to compute (triattn_cupy.torch's original forwards) can tell a refusal from a bug."""


def supported_head_dims():
    return tuple(range(4, MAX_HEAD_DIM + 1, 4))


class HeadWidthError(UnsupportedOnGpu):
    """Weights whose heads x head width differs from their pair dimension (the models'
    template stacks): the kernels project q, k, v and the gate to pair_dim channels, so the
    GPU refuses them; the NumPy backend (triattn_cupy.reference) computes them, and the
    PyTorch drop-in leaves such a block to its own forward."""


def check_dims(pair_dim: int, num_heads: int, head_dim: int | None = None):
    """The problem sizes the kernels take; head_dim None: pair_dim / num_heads."""
    if head_dim is not None and num_heads * head_dim != pair_dim:
        raise HeadWidthError(
            f"heads x head width = {num_heads} x {head_dim} = {num_heads * head_dim} differs "
            f"from pair_dim {pair_dim}: the GPU kernels take only heads x head width = "
            f"pair_dim; the NumPy backend (triattn_cupy.reference.triangle_attention) "
            f"computes these weights")
    d = pair_dim // num_heads
    if d % 4 or d > MAX_HEAD_DIM:
        raise UnsupportedOnGpu(
            f"head dimension pair_dim/num_heads must be a multiple of 4 and at most "
            f"{MAX_HEAD_DIM} on the GPU; got {pair_dim}/{num_heads} = {d}")
    if pair_dim > MAX_PAIR_DIM:
        raise UnsupportedOnGpu(
            f"pair_dim must be at most {MAX_PAIR_DIM} on the GPU; got {pair_dim}")


def check_weights(weights):
    """Refuse (UnsupportedOnGpu) weights whose shapes the kernels do not compute, before
    any upload: every device-independent check of a `Weights` on the GPU side."""
    check_dims(weights.pair_dim, weights.num_heads, weights.head_dim)


def check_projection_fits(pair_dim: int, smem_limit: int, gpu: str = "this GPU"):
    """A clear error where even 64-row projection blocks need more shared memory than the
    GPU lets a block have (MaxSharedMemoryPerBlockOptin: 227 KiB on sm_90, 163 KiB on
    sm_80, 99 KiB on sm_86/89)."""
    need = project_smem_bytes(pair_dim, 64)
    if need > smem_limit:
        fits = max((D for D in range(4, MAX_PAIR_DIM + 1, 4)
                    if project_smem_bytes(D, 64) <= smem_limit), default=0)
        raise UnsupportedOnGpu(
            f"pair_dim {pair_dim} needs {need} bytes of shared memory per block for the "
            f"projections; {gpu} allows {smem_limit} (pair_dim up to {fits} fits)")


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


# The element types of the pair the projections read and of the output the out projections
# write (PAIR_DTYPE, kernels/project_math.cuh: the index here; float32 emits no define, so
# its kernels are the ones without the feature)
PAIR_DTYPES = ("float32", "float16", "bfloat16")
# bfloat16 also as the bits of a 16-bit integer array
_BFLOAT16_CARRIERS = ("bfloat16", "uint16", "int16")


def bfloat16_bits(obj):
    """(obj, False), or for a torch bfloat16 tensor (which neither DLPack in CuPy nor
    __cuda_array_interface__ carries) (its int16 view, True): the same memory, no copy.
    torch is never imported here: a tensor's own module is."""
    dtype = getattr(obj, "dtype", None)
    if type(obj).__module__.startswith("torch") and str(dtype) == "torch.bfloat16":
        import sys

        return obj.view(sys.modules["torch"].int16), True
    return obj, False


def bfloat16_dtype(carrier):
    """The dtype a bfloat16 result carried as `carrier` (16-bit integers) is returned in:
    ml_dtypes.bfloat16 where ml_dtypes imports (optional), else the carrier itself."""
    try:
        import ml_dtypes
    except ImportError:
        return carrier
    return np.dtype(ml_dtypes.bfloat16)


def check_pair_dtype(dtype, pair_dtype: str | None) -> str:
    """The pair's element type as the kernels take it ("float32", "float16", "bfloat16"),
    from its CuPy dtype and the caller's `pair_dtype` (None: the dtype's own)."""
    name = np.dtype(dtype).name
    if pair_dtype is None:
        if name in PAIR_DTYPES:
            return name
        raise TypeError(f"pair must be float32, float16 or bfloat16 (a CuPy array of "
                        f"ml_dtypes.bfloat16, or a torch bfloat16 tensor); got {name} (convert "
                        f"with pair.astype(cupy.float32))")
    if pair_dtype not in PAIR_DTYPES:
        raise ValueError(f"pair_dtype must be one of {PAIR_DTYPES} or None; got "
                         f"{pair_dtype!r}")
    if name != pair_dtype and not (pair_dtype == "bfloat16" and name in _BFLOAT16_CARRIERS):
        expected = "bfloat16, uint16 or int16" if pair_dtype == "bfloat16" else pair_dtype
        raise TypeError(f"pair must be {expected} for pair_dtype={pair_dtype!r}; got {name}")
    return pair_dtype


def check_out(out, shape, pair_dtype: str, bfloat16: bool = False):
    """`out` C-contiguous, shaped and typed as the pair (bfloat16: any of its carriers)."""
    name = out.dtype.name
    same = (name == pair_dtype if pair_dtype != "bfloat16"
            else bfloat16 or name in _BFLOAT16_CARRIERS)
    if not same or out.shape != tuple(shape) or not out.flags.c_contiguous:
        got = "bfloat16 (torch)" if bfloat16 else name
        raise ValueError(f"out must be a C-contiguous {pair_dtype} array (the pair's dtype) of "
                         f"shape {tuple(shape)}; got {got} {out.shape} "
                         f"(c_contiguous={out.flags.c_contiguous})")
