"""What the results were measured with: GPU, driver, CUDA, library versions, git commit, date.

Every probe is guarded: a missing tool or package gives None or an error text, never an
exception.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys

from .common import ROOT, short_error

DISTRIBUTIONS = ("torch", "triton", "numpy", "cupy-cuda13x", "cupy-cuda12x", "cupy",
                 "cuequivariance", "cuequivariance-torch", "cuequivariance-ops-torch-cu13",
                 "cuequivariance-ops-cu13", "cuequivariance-ops-torch-cu12", "trifast",
                 "matplotlib", "triattn-cupy")


def _run(cmd, timeout=10):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return p.stdout.strip() if p.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def versions() -> dict:
    found = {}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except Exception:  # noqa: BLE001
            pass
    for module, key in (("cuequivariance_torch", "cuequivariance_torch.__version__"),
                        ("trifast", "trifast.__version__"),
                        ("triattn_cupy", "triattn_cupy.__version__")):
        mod = sys.modules.get(module)
        if mod is not None and getattr(mod, "__version__", None):
            found[key] = str(mod.__version__)
    return found


def host_info(argv) -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        # TRIATTN_GIT_COMMIT names the commit where the checkout's git metadata cannot
        # (a copied working tree, as on the remote GPU machine); dirty is then unknown.
        "git_commit": os.environ.get("TRIATTN_GIT_COMMIT") or _run(["git", "rev-parse", "HEAD"]),
        "git_dirty": None if os.environ.get("TRIATTN_GIT_COMMIT") else
        (lambda s: None if s is None else bool(s))(
            _run(["git", "status", "--porcelain", "--untracked-files=no"])),
    }


def nvidia_smi() -> dict | None:
    """Read-only query of the GPU's state (clocks, temperature, power); settings untouched."""
    fields = ("name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,"
              "temperature.gpu,power.draw,power.limit,persistence_mode")
    out = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
    if not out:
        return None
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    return dict(zip(fields.split(","), values))


def torch_cuda_info() -> dict:
    info = {}
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        try:
            info["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # noqa: BLE001
            pass
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sms=p.multi_processor_count,
                        memory_GiB=round(p.total_memory / 2 ** 30, 2),
                        compute_capability=f"{p.major}.{p.minor}")
            l2 = getattr(p, "L2_cache_size", None)
            if l2:
                info["l2_MiB"] = round(l2 / 2 ** 20, 1)
        else:
            info["cuda_available"] = False
    except Exception as exc:  # noqa: BLE001
        info["torch_error"] = short_error(exc)
    return info


def cupy_info() -> dict:
    info = {}
    try:
        import cupy
        info["cupy"] = cupy.__version__
        rt = cupy.cuda.runtime
        info["cuda_driver"] = rt.driverGetVersion()
        info["cuda_runtime"] = rt.runtimeGetVersion()
        try:
            info["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        except Exception:  # noqa: BLE001
            pass
        if cupy.cuda.is_available():
            props = rt.getDeviceProperties(0)
            name = props.get("name", b"")
            info["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
            info["compute_capability"] = cupy.cuda.Device(0).compute_capability
    except Exception as exc:  # noqa: BLE001
        info["cupy_error"] = short_error(exc)
    return info
