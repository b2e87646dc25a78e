"""Where the projection kernels' time goes: each stage timed alone (CUDA events, median)
with parts of its kernel removed by a text patch of its kernels/*.cu (a measurement
only: the results are wrong on purpose). A part whose removal saves little is not what
sets the time. Check each row against the ceilings: a patch can let the compiler remove
more than the part it names (after the epilogue of 024f159, `no_store` also lost the
products: fp32 "products" at ~490 TFLOP/s). The patches were written for the TF32 and
3xTF32 kernels: on the fp16-product paths (F16_TERMS, the wgmma attentions' projections)
`no_store` leaves q's lo words stored; `weights_l1` and `row_major_weights` no longer match
the ring's copy code (its swizzled pieces, session 10) and stop with "text not found", as
`no_bias_lo` does since format 7's bias store changed; read those rows accordingly.

    python3 scripts/ablate_projection.py [--variants full,no_store,only_gemm+rows64,...]
        [--precisions fp32,tf32,bf16] [sizes, default 1x1024x128x4 2x128x64x4]
"""
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _compile, _configs, _gpu
from time_ours import median_ms  # scripts/ is on sys.path when run as a script

ORIGINAL = _compile.kernel_source

# name -> {file: [(text, replacement)]}; each text must occur in its file. The FFMA
# projection ("fp32") is project.cu, the tensor-core one ("tf32", "bf16") project_mma.cu;
# their epilogues are project_epilogue.cuh. A variant is timed only for the precisions
# whose kernel file it patches (or that share a patched header).
ST2 = "__device__ __forceinline__ void st2(float* p, float2 v) { *reinterpret_cast"
STORE_KV = "                    *dst = p[0];"
EPILOGUE = "project_epilogue.cuh"
PATCHES = {
    "no_store": {EPILOGUE: [(ST2, ST2.replace("{ *reinterpret", "{ if (v.x == 1234.5f) *reinterpret")),
                            (STORE_KV, STORE_KV.replace("*dst", "if (p[0] == 1234.5f) *dst"))]},
    "no_pair_bias": {"project.cu": [("for (int p = t; p < BM * H; p += THREADS) {",
                                     "for (int p = t + BM * H; p < BM * H; p += THREADS) {")],
                     "project_mma.cu": [("    pair_bias(s.As, astr,", "    if (N < 0) pair_bias(s.As, astr,")]},
    "no_layernorm": {"project.cu": [("    {\n        const int ml = t % BM, part = t / BM",
                                     "    if (N < 0) {\n        const int ml = t % BM, part = t / BM")]},
    "no_layernorm_mma": {"project_mma.cu": [("    if (t < BM) {\n        float* const row",
                                             "    if (t < BM && N < 0) {\n        float* const row")]},
    "no_load": {"project.cu": [("        if (x_vec) return ld4(p + k);",
                                "        if (x_vec) return make_float4(1.f, 2.f, 3.f, (float)ml);"),
                               ("const float4 o = ld4(row + k), g = load_gate4(row, D, k);",
                                "const float4 o = make_float4(1.f, 2.f, 3.f, (float)ml), g = o;")],
                "project_mma.cu": [("cp_async16_or_zero(smem_addr(dst + k), ok ? p + k : x, ok);",
                                    "cp_async16_or_zero(smem_addr(dst + k), x, false);"),
                                   ("const float4 o = load_o4(row, k), g = load_gate4(row, D, k);",
                                    "const float4 o = make_float4(1.f, 2.f, 3.f, (float)ml), g = o;")]},
    # The weight chunks through L1 (cp.async.ca) instead of L2 only (.cg): the 2 blocks of an
    # SM stream the same chunks, and ncu puts the weights at ~2.9 GB of L2 traffic at 1x1024.
    "weights_l1": {"project_mma.cu": [(
        "cp_async16_or_zero(stage + 4 * (nl * WSTR + kl), chunk + 4 * idx, true);",
        "asm volatile(\"cp.async.ca.shared.global [%0], [%1], 16, 16;\" :: \"r\"(stage + 4 * (nl * WSTR + kl)), "
        "\"l\"(chunk + 4 * idx));")]},
    # The weights as PyTorch stores them ([NO][D], each chunk 64 bytes of 128 rows, bounds
    # tested per copy), as before session 10's chunk order (use_variant swaps the layout).
    "row_major_weights": {"project_mma.cu": [(
        "cp_async16_or_zero(stage + 4 * (nl * WSTR + kl), chunk + 4 * idx, true);",
        "const bool ok = n0 + nl < NO && kc * BK + kl < D; (void)chunk;\n"
        "                cp_async16_or_zero(stage + 4 * (nl * WSTR + kl), "
        "ok ? W + (i64)(n0 + nl) * D + kc * BK + kl : W, ok);")]},
    # format 7 (the fp32 mode's f16x3 attention): the pair bias's lo tile not stored
    "no_bias_lo": {EPILOGUE: [("    p[BIAS_TILE_BYTES / 4] = lo;",
                               "    if (x == 1234.5f) p[BIAS_TILE_BYTES / 4] = lo;")]},
    # the weight chunks never copied (the products read whatever the ring holds): what
    # streaming W through the ring costs the loop
    "no_ring": {"project_mma.cu": [("        if (kc < nchunks) {",
                                    "        if (kc < nchunks && nchunks < 0) {")]},
    # the stores of q and the gate pair by pair again, as before store_pair_run (session 15)
    "no_store_runs": {EPILOGUE: [("#define STORE_RUNS (KV_FORMAT == 6 || KV_FORMAT == 8)",
                                  "#define STORE_RUNS 0")]},
    # LayerNorm on every thread of a 128-row block, 2 per row (project_mma.cu LN_SPLIT; session 15)
    "ln_split": {"project_mma.cu": [("#define LN_SPLIT 0", "#define LN_SPLIT 1")]},
    # gated_out_project in 3 blocks per SM (80 registers) where its config asks 2: the fp32
    # mode's 64-row fp16 hi + lo out projection, which fits them unspilled (session 18;
    # the tf32 and bf16 ones have 3 already). At 2x128x64x4, 512 blocks: 2 waves of 264
    # blocks, or one of 396 and 116.
    "out_blocks3": {"project_mma.cu": [("#define OUT_MIN_BLOCKS PROJECT_MIN_BLOCKS",
                                        "#define OUT_MIN_BLOCKS 3")]},
    # nor this: the fp32 mode's 3xTF32 products where it takes fp16 hi + lo ones since
    # session 18 (TRIATTN_PROJECT_F16_SPLIT=0; every format but 7): the same-call A/B
    "tf32x3_products": {},
    "rows64": {},  # not a text patch: 64-row blocks (3 per SM) at every size
    "rows128": {},  # nor this: 128-row blocks (2 per SM) at every size
    "stages5": {},  # nor this: 5 weight chunks in the ring (4 ahead) where 4 fit
}
VARIANTS = {
    "full": [],
    **{name: [name] for name in PATCHES},
    "only_gemm": ["no_store", "no_pair_bias", "no_layernorm", "no_layernorm_mma", "no_load"],
}
PROJECT_FILE = {"fp32": "project_mma.cu", "tf32": "project_mma.cu", "bf16": "project_mma.cu"}  # sm_80+


def parts_of(variant):
    """A variant's parts: a name of VARIANTS, or names joined by "+" (their parts together,
    as in only_gemm+rows64)."""
    return [part for name in variant.split("+") for part in VARIANTS[name]]


def applies(parts, precision):
    """Whether the variant changes (or, for "full" and "rows*", just runs) the precision's
    kernel: a patch of its file or of the shared epilogue."""
    files = {f for part in parts for f in PATCHES[part]}
    return not files or files & {PROJECT_FILE[precision], EPILOGUE}


ORIGINAL_ROWS = _configs.project_rows
ORIGINAL_CHUNKS = _gpu.weight_chunks
ORIGINAL_STAGES = _configs.project_weight_stages
ORIGINAL_F16_SPLIT = _configs.PROJECT_F16_SPLIT


def use_variant(parts):
    def source(filename):
        text = ORIGINAL(filename)
        for part in parts:
            for old, new in PATCHES[part].get(filename, ()):
                if old not in text:
                    raise SystemExit(f"patch {part!r}: text not found in {filename}: {old!r}")
                text = text.replace(old, new)
        return text
    _compile.kernel_source = source
    _gpu.weight_chunks = ((lambda w, *chunk: w) if "row_major_weights" in parts
                          else ORIGINAL_CHUNKS)
    rows = [r for r in (64, 128) if f"rows{r}" in parts]
    _configs.project_rows = (lambda *args: rows[0]) if rows else ORIGINAL_ROWS
    _configs.project_weight_stages = (
        (lambda *args: ORIGINAL_STAGES(*args) + (ORIGINAL_STAGES(*args) == 4))
        if "stages5" in parts else ORIGINAL_STAGES)
    _configs.PROJECT_F16_SPLIT = ORIGINAL_F16_SPLIT and "tf32x3_products" not in parts
    _configs._project_config.cache_clear()
    _configs.project_smem_bytes.cache_clear()
    _configs.forget_compiled_kernels()


def main(sizes, variants, precisions):
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    for size in sizes:
        B, N, D, h = map(int, size.split("x"))
        module = ta.TriangleAttention(ta.random_weights(D, h, seed=0))
        pair = cp.random.standard_normal((B, N, N, D), dtype=np.float32)
        mask = cp.ones((B, N, N), bool)
        repeats = 50 if N <= 512 else 15
        for precision in precisions:
            for variant in variants:
                if not applies(parts_of(variant), precision):
                    continue
                use_variant(parts_of(variant))
                module._dw.plans.clear()  # the launch plans hold the kernels they chose
                module._dw._layouts.clear()  # and the weights in the layout they read
                stages = dict(module.stage_launchers(pair, mask, precision=precision))
                for launch in stages.values():
                    launch()
                proj = median_ms(stages["layernorm+projections"], repeats)
                out = median_ms(stages["gate+out_proj"], repeats)
                print(f"{size} {precision:5s} {variant:30s} projection {proj:7.3f} ms"
                      f"  out projection {out:7.3f} ms", flush=True)
    use_variant([])


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = list(VARIANTS)
    precisions = ["fp32", "tf32", "bf16"]
    while args[:1] in (["--variants"], ["--precisions"]):
        if args[0] == "--variants":
            chosen = args[1].split(",")
        else:
            precisions = args[1].split(",")
        args = args[2:]
    main(args or ["1x1024x128x4", "2x128x64x4"], chosen, precisions)
