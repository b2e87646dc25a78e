"""The fp32 mode's error against float64 (the spec module, tests/helpers.spec_forward) with
each 3xTF32 attention kernel on the same inputs, beside PyTorch's own fp32 error: to choose
attention_wgmma.cu's PV_GROUPS (how many k-steps the tensor cores' truncating accumulation
may chain before a sum goes to fp32), and to see the mma.sync kernel's error beside it.

    python3 scripts/wgmma_accuracy.py [BxNxDxh ...]    (default 1x160x128x4 1x257x128x4)
"""
import dataclasses
import pathlib
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers import rel_l2, spec_forward, spec_model  # noqa: E402

import triattn_cupy as ta  # noqa: E402
from triattn_cupy import _configs  # noqa: E402
from triattn_cupy._gpu import DeviceWeights, Forward  # noqa: E402


def torch_fp32(weights, pair, mask):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        out = spec_model(weights, torch.float32).cuda()(
            torch.from_numpy(pair).cuda(), torch.from_numpy(mask.astype(np.float32)).cuda())
    return out.cpu().numpy()


def launches(d, N):
    yield "mma.sync tf32x3", _configs.attention_mma_launch(d, "tf32x3", n=N)
    for groups in (1, 2, 4):
        tiles = dataclasses.replace(_configs.attention_wgmma_tiles("tf32x3"), pv_groups=groups)
        yield f"wgmma pv_groups={groups}", _configs.attention_wgmma_launch(d, tiles, "tf32x3")


def main(sizes):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    rng = np.random.default_rng(2026)
    for size in sizes:
        B, N, D, h = map(int, size.split("x"))
        weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
        dw = DeviceWeights(weights, cp.cuda.runtime.getDevice())
        pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
        mask = rng.random((B, N, N)) > 0.25
        expected = spec_forward(weights, pair, mask)
        print(f"{size} PyTorch fp32: {rel_l2(torch_fp32(weights, pair, mask), expected):.3e}")
        for name, launch in launches(D // h, N):
            fwd = Forward(dw, cp.asarray(pair), cp.asarray(mask), "zero", None, "fp32",
                          attention=launch)
            print(f"{size} {name}: {rel_l2(fwd.run().get(), expected):.3e}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["1x160x128x4", "1x257x128x4"])
