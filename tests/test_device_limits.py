"""DeviceWeights on GPUs with less shared memory per block than the H200, without a GPU:
CuPy replaced by NumPy and a stand-in device that reports the limits of other GPUs."""
import types

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import gpu


class FakeDevice:
    def __init__(self, optin, capability):
        self.attributes = {"MultiProcessorCount": 84}
        if optin is not None:
            self.attributes["MaxSharedMemoryPerBlockOptin"] = optin
        self.compute_capability = capability

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_gpu(monkeypatch):
    """gpu(optin bytes, compute capability): make DeviceWeights see such a GPU."""
    def install(optin, capability):
        fake = types.SimpleNamespace(asarray=np.asarray, uint32=np.uint32, float32=np.float32,
                                     cuda=types.SimpleNamespace(
                                         Device=lambda device_id=None: FakeDevice(optin, capability),
                                         get_current_stream=lambda: types.SimpleNamespace(
                                             synchronize=lambda: None)))
        monkeypatch.setattr(gpu.device_weights, "_cupy", lambda: fake)
    return install


def test_h200_limit_is_the_tables_limit(fake_gpu):
    fake_gpu(227 * 1024, "90")
    dw = gpu.device_weights.DeviceWeights(ta.random_weights(768, 6, seed=0), 0)
    assert dw.smem_limit == gpu.tiles.SMEM_LIMIT and dw.compute_capability == 90


def test_pair_dim_too_wide_for_the_gpu_is_a_clear_error(fake_gpu):
    fake_gpu(99 * 1024, "86")
    with pytest.raises(ValueError, match=r"pair_dim 256 needs \d+ bytes .* GPU 0 \(compute "
                                         r"capability 86\) allows 101376 \(pair_dim up to 224"):
        gpu.device_weights.DeviceWeights(ta.random_weights(256, 4, seed=0), 0)


def test_small_gpu_gets_launches_that_fit(fake_gpu):
    fake_gpu(99 * 1024, "86")
    dw = gpu.device_weights.DeviceWeights(ta.random_weights(128, 4, seed=0), 0)
    assert dw.smem_limit == 99 * 1024
    assert gpu.tiles.project_rows(128, 10**9, dw.sm_count, dw.smem_limit) == 64
    launch = gpu.routes.attention_kernel(32, "tf32", dw.compute_capability, 4096, dw.smem_limit)
    assert launch.smem <= dw.smem_limit and launch.name == "attention_ffma_fp32"


def test_heads_times_head_width_other_than_pair_dim_is_refused(fake_gpu):
    """The template stacks' weights (h x c = 2 D): a HeadWidthError naming the shapes and
    the NumPy backend, before anything is uploaded."""
    fake_gpu(227 * 1024, "90")
    weights = ta.random_weights(64, 4, seed=0, head_dim=32)
    message = (r"heads x head width = 4 x 32 = 128 differs from pair_dim 64: the GPU kernels "
               r"take only heads x head width = pair_dim; the NumPy backend "
               r"\(triattn_cupy.reference.triangle_attention\) computes these weights")
    with pytest.raises(gpu.checks.HeadWidthError, match=message):
        gpu.device_weights.DeviceWeights(weights, 0)
    assert ta.HeadWidthError is gpu.checks.HeadWidthError
    assert issubclass(ta.HeadWidthError, ValueError)
    gpu.checks.check_dims(64, 4, 16)  # h x c = D passes
    gpu.checks.check_dims(64, 4)


def test_a_device_that_does_not_say_takes_the_gpu_tables_shared_memory(fake_gpu):
    fake_gpu(None, "86")  # (no MaxSharedMemoryPerBlockOptin attribute)
    dw = gpu.device_weights.DeviceWeights(ta.random_weights(128, 4, seed=0), 0)
    assert dw.smem_limit == gpu.gpus.GPUS[86].smem_optin == 99 * 1024
