"""Where the wgmma TF32 attention's time goes (kernels/attention_wgmma.cu, d = 32): the
attention stage timed alone (CUDA events, median) with parts of the kernel removed by a
text patch (a measurement only: the results are wrong on purpose), for each loop shape.
A part whose removal saves little is not what sets the time.

    python3 scripts/ablate_attention.py [--bf16] [--variants full,no_exp,...] [sizes, default 1x1024x128x4]

--bf16: the bf16 kernel (BF16, bulk copies) and its own patches (BF16_PATCHES).
"""
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _compile, _configs
from triattn_cupy._gpu import DeviceWeights, Forward
from ablate_projection import ORIGINAL
from sweep_tiles import time_attention

FILE = "attention_wgmma.cu"
NEVER = "N < 0"  # a condition the compiler cannot fold away
PATCHES = {  # name -> [(text, replacement)], every occurrence replaced
    "no_exp": [("__float_as_uint(fast_exp2(", "__float_as_uint((")],
    "no_rescale": [("    auto rescale = [&](const float (&s)[4 * NT]) {\n",
                    "    auto rescale = [&](const float (&s)[4 * NT]) {\n        if (!(N < 0)) return;\n")],
    # S from constants instead of the bias tile (no loads, no conversions)
    "no_bias": [("            bias_pairs(r, stage, j, 0);\n#pragma unroll\n"
                 "            for (int q = 0; q < 4; ++q) {\n"
                 "                const float2 x = half2_to_float2(r[q]);",
                 "            for (int q = 0; q < 4; ++q) {\n"
                 "                const float2 x = make_float2((float)q, (float)j);")],
    "no_s": [("for (int kk = 0; kk < DT; ++kk) wgmma_m64n64k8_tf32(",
              f"for (int kk = 0; kk < DT * ({NEVER}); ++kk) wgmma_m64n64k8_tf32(")],
    "no_pv": [("for (int kk = 0; kk < NT; ++kk) wgmma_m64n40k8_tf32(",
               f"for (int kk = 0; kk < NT * ({NEVER}); ++kk) wgmma_m64n40k8_tf32(")],
    "no_v": [("                cp_async16_or_zero(st + VT_OFFSET + vt_dst",
              f"                if ({NEVER}) cp_async16_or_zero(st + VT_OFFSET + vt_dst")],
    "no_k": [("                cp_async16_or_zero(st + k_dst",
              f"                if ({NEVER}) cp_async16_or_zero(st + k_dst")],
    "no_bias_copy": [("            copy_bias(k0, st + BIAS_OFFSET);",
                      f"            if ({NEVER}) copy_bias(k0, st + BIAS_OFFSET);")],
    "no_copies": [("        if (k0 < N) {\n            const u32 st", f"        if (k0 < N && {NEVER}) {{\n            const u32 st")],
}
VARIANTS = {"full": [], **{name: [name] for name in PATCHES},
            "only_products": ["no_exp", "no_rescale", "no_bias", "no_v", "no_copies"],
            "only_softmax": ["no_s", "no_pv", "no_v", "no_copies"]}
# The cp.async variant (its copies are what the patches remove; BULK reads another format).
SHAPES = [_configs.WgmmaTiles(), _configs.WgmmaTiles(rows=1, stages=3, min_blocks=2)]
KERNEL = "tf32"

# --bf16: the bf16 kernel (BULK only: its copies are one instruction per tile, not patched).
BF16_PATCHES = {
    "no_exp": [("return pack_bf16(fast_exp2(c[0] - m_sub[r]), fast_exp2(c[1] - m_sub[r]));",
                "return pack_bf16(c[0] - m_sub[r], c[1] - m_sub[r]);")],
    "no_rescale": PATCHES["no_rescale"],
    "no_bias": PATCHES["no_bias"],
    # the bias words read as bf16 pairs (shift, mask) instead of converted from fp16
    "bias_bf16": [("const float2 x = half2_to_float2(r[q]);", "const float2 x = bf16_pair(r[q]);"),
                  ('#include "wgmma.cuh"\n', '#include "wgmma.cuh"\n__device__ __forceinline__ float2 '
                   "bf16_pair(u32 w) { return make_float2(__uint_as_float(w << 16), "
                   "__uint_as_float(w & 0xffff0000u)); }\n")],
    # P truncated to bf16 by a byte permute instead of converted (rounded)
    "pack_trunc": [("return pack_bf16(fast_exp2(", "return pack_trunc(fast_exp2("),
                   ('#include "wgmma.cuh"\n', '#include "wgmma.cuh"\n__device__ __forceinline__ u32 '
                    "pack_trunc(float a, float b) { return __byte_perm(__float_as_uint(a), "
                    "__float_as_uint(b), 0x7632); }\n")],
    "no_s": [("            wgmma_m64n64k16_bf16_ss(s, ",
              f"            if ({NEVER}) wgmma_m64n64k16_bf16_ss(s, ")],
    "no_pv": [("            wgmma_m64n40k16_bf16(o, pa[kk], ",
               f"            if ({NEVER}) wgmma_m64n40k16_bf16(o, pa[kk], ")],
}
BF16_VARIANTS = {"full": [], **{name: [name] for name in BF16_PATCHES},
                 "bias_bf16,pack_trunc": ["bias_bf16", "pack_trunc"],
                 "only_products": ["no_exp", "no_rescale", "no_bias"],
                 "only_softmax": ["no_s", "no_pv"]}
BF16_SHAPES = [_configs.attention_wgmma_tiles("bf16"),
               _configs.WgmmaTiles(rows=1, stages=2, min_blocks=3, bulk=1)]


def use_variant(parts):
    patches = BF16_PATCHES if KERNEL == "bf16" else PATCHES

    def source(filename):
        text = ORIGINAL(filename)
        if filename == FILE:
            for part in parts:
                for old, new in patches[part]:
                    if old not in text:
                        raise SystemExit(f"patch {part!r}: text not found: {old!r}")
                    text = text.replace(old, new)
        return text
    _compile.kernel_source = source
    _configs.forget_compiled_kernels()


def main(sizes, variants):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    for size in sizes:
        B, N, D, h = map(int, size.split("x"))
        dw = DeviceWeights(ta.random_weights(D, h, seed=0), cp.cuda.runtime.getDevice())
        pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
        flops = 4 * B * N**3 * D
        shapes, table = (BF16_SHAPES, BF16_VARIANTS) if KERNEL == "bf16" else (SHAPES, VARIANTS)
        fwd = Forward(dw, pair, None, "zero", None,
                      attention=_configs.attention_wgmma_launch(D // h, shapes[0], KERNEL))
        fwd.project()
        for tiles in shapes:
            for variant in variants:
                use_variant(table[variant])
                ms = time_attention(fwd, _configs.attention_wgmma_launch(D // h, tiles, KERNEL),
                                    20 if N <= 512 else 5)
                print(f"{size} rows={tiles.rows} minb={tiles.min_blocks} st={tiles.stages} "
                      f"{variant:14s} {ms:7.3f} ms "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    use_variant([])


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--bf16"]:
        KERNEL = "bf16"
        args = args[1:]
    chosen = list(BF16_VARIANTS if KERNEL == "bf16" else VARIANTS)
    if args[:1] == ["--variants"]:
        chosen = args[1].split(",")
        args = args[2:]
    main(args or ["1x1024x128x4"], chosen)
