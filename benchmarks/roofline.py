"""FLOP and byte counts of one forward pass, and the floor they imply on a GPU.

Pure functions, no GPU: the report and docs/performance.md use them, and the offline tests check them.

Counted FLOPs (a multiply-add is 2 FLOPs), shapes B x N x N x D, h heads of d = D / h:
    attention core   4 * B * N^3 * D         (q k^T and p v: 2 * B*N*h*N*N*d each)
    projections      2 * B * N^2 * D * (5D + h)   (q, k, v, gate, out_proj: D x D each;
                                                   bias_proj: D x h)
LayerNorm, softmax (B*h*N^3 exponentials), sigmoid and the gating are not counted: together
well under 1% of the FLOPs at D = 128, though the exponentials run on the slower
special-function units.

Bytes that must move (each input read once, the output written once):
    pair in (4 B/elem) + out (4 B/elem) + mask (its itemsize per (b, j, k)).
The parameters (~0.3 MB at D = 128) are negligible.
"""
from __future__ import annotations

# Ceilings measured on an NVIDIA H200 (shared/peers/README.md, 2026-11-30): the fallback
# when a run cannot measure its own. copy counts bytes read plus bytes written.
NOMINAL_H200 = {"copy_GBps": 4200.0, "fp32_TFLOPs": 51.0, "tf32_TFLOPs": 406.0,
                "bf16_TFLOPs": 779.0}

CLASSES = ("fp32", "tf32", "bf16", "fp32x3", "f16")
# fp32x3: fp32-accurate products as three 16-bit tensor-core products each (ours in fp32
# mode: a = hi + lo in fp16, hi*lo + lo*hi + hi*hi), so a third of the bf16 rate (fp16 runs
# at bf16's). Not measured on its own: derived from the bf16 ceiling (rate()). Where our
# fp32 mode runs 3xTF32 instead (N <= 128, or no wgmma), its ceiling is a third of TF32's,
# about half of this, so the fraction shown there is low by about 2x.
SPLIT_PRODUCTS = 3
# f16: TF32-accurate products as one fp16 product of operands scaled into its range (ours in
# tf32 mode on the wgmma path: fp16 keeps TF32's 11 significant bits), so the bf16 rate; its
# accuracy class (benchmarks/common.py TOLERANCE) is TF32's. Where our tf32 mode runs TF32
# products instead (N <= 128, or no wgmma) the fraction shown is low by about 2x.


def attention_core_flops(B: int, N: int, D: int) -> int:
    return 4 * B * N ** 3 * D


def projection_flops(B: int, N: int, D: int, h: int) -> int:
    return 2 * B * N ** 2 * D * (5 * D + h)


def forward_flops(B: int, N: int, D: int, h: int) -> int:
    return attention_core_flops(B, N, D) + projection_flops(B, N, D, h)


def min_bytes(B: int, N: int, D: int, *, pair_itemsize: int = 4, out_itemsize: int = 4,
              mask_itemsize: int = 4) -> int:
    """Compulsory traffic: read pair and mask once, write the output once."""
    return B * N * N * (D * pair_itemsize + D * out_itemsize + mask_itemsize)


def bias_reread_bytes(B: int, N: int, h: int, itemsize: int = 4) -> int:
    """Traffic of the (B, h, N, N) pair bias if every row i reads it again from memory.

    The bias does not depend on the row i, so a kernel that handles one row per block reads
    the whole bias N times: 4 * B * h * N^3 bytes in fp32. Unless rows that share a bias
    tile run together (L2 is ~50 MB on an H200), this, not the compulsory traffic, is the
    memory term of a fused kernel.
    """
    return B * N * h * N * N * itemsize


def rate_key(cls: str) -> str:
    if cls not in CLASSES:
        raise ValueError(f"precision class must be one of {CLASSES}; got {cls!r}")
    return f"{cls}_TFLOPs"


def rate(ceilings: dict, cls: str) -> float:
    """The TFLOP/s ceiling of class `cls` in `ceilings` (fp32x3, f16: derived from bf16's)."""
    if cls == "fp32x3":
        return ceilings[rate_key("bf16")] / SPLIT_PRODUCTS
    if cls == "f16":
        return ceilings[rate_key("bf16")]
    return ceilings[rate_key(cls)]


def floor_ms(B: int, N: int, D: int, h: int, ceilings: dict, *, core: str = "fp32",
             proj: str | None = None, mask_itemsize: int = 4) -> dict:
    """The two times of the roofline and the floor (the larger), in ms.

    `core` and `proj` name the arithmetic class ("fp32", "tf32", "bf16") of the attention
    core and of the projections (proj defaults to core); each part's FLOPs over its rate.
    """
    proj = proj or core
    t_core = attention_core_flops(B, N, D) / (rate(ceilings, core) * 1e12)
    t_proj = projection_flops(B, N, D, h) / (rate(ceilings, proj) * 1e12)
    t_compute = (t_core + t_proj) * 1e3
    t_memory = min_bytes(B, N, D, mask_itemsize=mask_itemsize) / (ceilings["copy_GBps"] * 1e9) * 1e3
    return {"compute_ms": t_compute, "memory_ms": t_memory, "floor_ms": max(t_compute, t_memory),
            "bound": "compute" if t_compute >= t_memory else "memory"}


def achieved(B: int, N: int, D: int, h: int, ms: float, *, mask_itemsize: int = 4) -> dict:
    """Counted FLOPs and compulsory bytes over a measured time."""
    s = ms * 1e-3
    return {"TFLOPs": forward_flops(B, N, D, h) / s / 1e12,
            "GBps": min_bytes(B, N, D, mask_itemsize=mask_itemsize) / s / 1e9}


def precision_classes(system: str, precision: str | None = None) -> tuple[str, str]:
    """(core class, projection class) of a benchmarked system, for its floor.

    Peers in bf16 run their attention core in bf16 but the projections in fp32 PyTorch.
    Ours: from the precision mode's name ("bf16"/"fp16" -> bf16, "tf32" -> f16: one fp16
    product of scaled operands, TF32's bits at the 16-bit rate; else fp32x3: the fp32
    mode's split products on the 16-bit tensor cores) for both parts; adjust here when a
    mode mixes them.
    """
    name = (precision or system).lower()
    if system.startswith("ours"):
        if "bf16" in name or "fp16" in name or "half" in name:
            return "bf16", "bf16"
        if "tf32" in name:
            return "f16", "f16"
        return "fp32x3", "fp32x3"
    if name.endswith("bf16"):
        return "bf16", "fp32"
    if name.endswith("tf32"):
        return "tf32", "tf32"
    return "fp32", "fp32"
