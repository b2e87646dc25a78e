"""The GPU API's errors where the installation lacks something: no GPU (a pointer to the
NumPy backend), no NVRTC (what to install). Run on any machine: CuPy is replaced by a
stand-in where the real one would find a GPU."""
from __future__ import annotations

import types

import pytest

import triattn_cupy
from triattn_cupy import cuda_setup, random_weights


def fake_cupy(devices=1, nvrtc_error=None, device_error=None):
    def get_device_count():
        if device_error:
            raise device_error
        return devices

    def get_version():
        if nvrtc_error:
            raise nvrtc_error
        return (13, 0)

    runtime = types.SimpleNamespace(getDeviceCount=get_device_count)
    cuda = types.SimpleNamespace(runtime=runtime,
                                 nvrtc=types.SimpleNamespace(getVersion=get_version))
    return types.SimpleNamespace(cuda=cuda)


def test_no_gpu_names_the_numpy_backend():
    with pytest.raises(cuda_setup.GpuUnavailableError,
                       match=r"no CUDA GPU is usable on this machine \(RuntimeError: no "
                             r"driver\)\. Instead, triattn_cupy.reference.triangle_attention "
                             r"computes"):
        cuda_setup.check_cuda(fake_cupy(device_error=RuntimeError("no driver")))
    with pytest.raises(cuda_setup.GpuUnavailableError, match="reports no device"):
        cuda_setup.check_cuda(fake_cupy(devices=0))


def test_missing_nvrtc_says_what_to_install():
    with pytest.raises(cuda_setup.GpuUnavailableError,
                       match=r"NVRTC \(libnvrtc\).*cannot be loaded \(OSError: "
                             r"libnvrtc.so.13: cannot open\).*triattn-cupy\[cuda13\].*"
                             r"cupy-cuda13x\[ctk\]"):
        cuda_setup.check_cuda(fake_cupy(nvrtc_error=OSError("libnvrtc.so.13: cannot open")))
    cuda_setup.check_cuda(fake_cupy())  # a GPU and NVRTC: no error


@pytest.mark.skipif(triattn_cupy.gpu_available(), reason="checks the error without a GPU")
def test_public_api_without_gpu_raises_clearly():
    pytest.importorskip("cupy")
    weights = random_weights(16, 2)
    for call in (lambda: triattn_cupy.TriangleAttention(weights),
                 lambda: triattn_cupy.triangle_attention(None, None, weights)):
        with pytest.raises(cuda_setup.GpuUnavailableError,
                           match="triattn_cupy.reference.triangle_attention"):
            call()


def test_cuda_extras_bring_nvrtc_and_test_extra_brings_hypothesis():
    import configparser
    import pathlib

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).resolve().parent.parent / "setup.cfg")
    extras = {k: v.split() for k, v in cfg["options.extras_require"].items()}
    assert any(r.startswith("cupy-cuda13x[ctk]") for r in extras["cuda13"])
    assert any(r.startswith("cupy-cuda12x[ctk]") for r in extras["cuda12"])
    assert any(r.startswith("hypothesis") for r in extras["test"])
    scripts = cfg["options.entry_points"]["console_scripts"]
    assert "triattn-infer = triattn_cupy.cli.main:main" in scripts
