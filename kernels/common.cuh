// Shared helpers of the triattn-cupy kernels. Textually inlined by the Python loader
// (triattn_cupy/_compile.py), so it needs no include path at run time.
#pragma once

typedef long long i64;

// log2(e): softmax runs in base 2 (exp2f is one MUFU instruction), so the query scale
// 1/sqrt(d) and the pair bias are both pre-multiplied by log2(e) where they are produced.
#define LOG2E_F 1.4426950408889634f

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

__device__ __forceinline__ float4 ld4(const float* p) {
    return __ldg(reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ void st4(float* p, float4 v) {
    *reinterpret_cast<float4*>(p) = v;
}
__device__ __forceinline__ float4 zero4() { return make_float4(0.f, 0.f, 0.f, 0.f); }

// 2^x in one MUFU.EX2 instruction (exp2f adds range scaling for results below 2^-126;
// flushing those to 0 changes no softmax weight that matters: they are < 2^-126 of the
// row's largest).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One step of the online softmax's running maximum: m <- max(m, tile_max). Returns the
// value to subtract from this tile's scores and sets alpha, the factor that rescales what
// earlier tiles summed. While every key so far is masked, the maximum is -inf and
// s - max would be -inf - (-inf) = NaN; subtracting 0 instead gives 2^-inf = 0 per term.
__device__ __forceinline__ float online_max_update(float& m, float tile_max, float& alpha) {
    const float m_new = fmaxf(m, tile_max);
    const float m_ref = m_new == neg_inf() ? 0.f : m_new;
    alpha = exp2f(m - m_ref);
    m = m_new;
    return m_ref;
}

// Programmatic dependent launch (sm_90 and newer): launched with
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, a kernel's blocks may start while
// the kernel before it drains, so they must wait for it before reading what it wrote
// (griddepcontrol.wait returns once every block of the previous kernel has exited and its
// writes are visible; without that launch attribute it returns at once). Only captured
// small forwards launch the attention and the out projection so (gpu/dependent_launch.py:
// calls measured no gain). A kernel lets the next one launch early by allow_next_kernel:
// the next launches once every block of this one has called it or exited, i.e. with the
// last wave running, so its waiting blocks take only SM room no block of this kernel still
// needs. Below sm_90 both are nothing (the launch attribute is not used there).
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_next_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The share of an attention block (attention_ffma.cu, attention_mma.cu, attention_wgmma.cu):
// query tile `qtile` (bq queries), pair rows i0 .. i0 + rows - 1 of batch b, head `head`.
// The grid is ceil(N / bq) * ceil(N / rows) * H * B blocks, flattened: query tile fastest,
// then the rows, then the head. So the blocks running at one time share one head's pair
// bias, which every row i reads whole again: at N = 4096 the bias of all heads outgrows L2
// (head before rows: tf32 wgmma attention 245 ms, rows before head 216; docs/performance.md).
// The keys an attention block visits, [0, keys): key_extent[b] (key_extent.cu: every key
// from it on is masked for every query of batch b, so the tiles past it add 2^-inf = 0 to
// every sum), within [1, N]; N where there is no extent (no mask, or too small an N for
// trailing tiles to be worth a launch). At least one key: a batch whose every key is
// masked still runs its first tile and ends with l = 0, the fully masked output, as before.
__device__ __forceinline__ int visited_keys(const int* __restrict__ key_extent, int b, int N) {
    return key_extent ? max(1, min(N, __ldg(key_extent + b))) : N;
}

// OUT_TRANSPOSED (the ending node; the out projections' feature, off by default): the
// forward runs on the transposed pair, whose row m = (b N + i) N + j is the caller's row
// (b N + j) N + i; the out projections write each row there, so the output lands in the
// caller's layout without a copy. The kernels then take N as their last argument.
#ifndef OUT_TRANSPOSED
#define OUT_TRANSPOSED 0
#endif
#if OUT_TRANSPOSED
__device__ __forceinline__ i64 caller_row(i64 m, int N) {
    const i64 j = m % N, bi = m / N;  // m = bi N + j, bi = b N + i
    const i64 i = bi % N, b = bi / N;
    return (b * N + j) * N + i;
}
// The out projections' last parameter, and OUT_N the value they pass on (0, unused, without)
#define OUT_TRANSPOSED_ARGS , int N
#define OUT_N N
#else
#define OUT_TRANSPOSED_ARGS
#define OUT_N 0
#endif

// ROW_MASK (the row mask layout; the attention kernels' feature, off by default): key k is
// masked for every query of row (b, i) where bit k % 32 of row_mask[(b N + i) (npk / 32) +
// k / 32] is 0 (row_mask.cu packs them); the kernels set such scores to -inf before the
// row maximum, as a masked bias entry would be. They then take row_mask last.
#ifndef ROW_MASK
#define ROW_MASK 0
#endif

struct AttentionBlock {
    int qtile, i0, head, b;
};
__device__ __forceinline__ AttentionBlock attention_block(int N, int H, int bq, int rows) {
    const int nq = (N + bq - 1) / bq, nr = (N + rows - 1) / rows;
    AttentionBlock blk;
    blk.qtile = (int)(blockIdx.x % nq);
    i64 rest = blockIdx.x / nq;
    blk.i0 = (int)(rest % nr) * rows;
    rest /= nr;
    blk.head = (int)(rest % H);
    blk.b = (int)(rest / H);
    // Pinned: the compiler otherwise recomputes or keeps the division's pieces for the
    // pointers formed later (one 128-register configuration spilled 8 bytes).
    asm volatile("" : "+r"(blk.qtile), "+r"(blk.i0), "+r"(blk.head), "+r"(blk.b));
    return blk;
}

// ROW_BLOCK (row blocks, off by default; triattn_cupy/gpu/row_blocks.py): a launch covers
// only the pair rows (b, i) = b N + i in [row_begin, row_end) of the flattened B N rows,
// and the kernel takes the two last. Every index stays global: the host passes qkvg and
// the K/V^T tiles offset back by row_begin's rows, so that a block's rows land in its own
// scratch, while the pair, the mask, the bias, the key extent and the row mask bits are
// read (and the bias written) where the whole problem has them. Each row's arithmetic is
// the whole problem's, so the result does not depend on how the rows are blocked.
//   LayerNorm projections: the pair rows m in [row_begin N, row_end N) (project_mma.cu,
//   project_ffma.cu), the key tiles T in [row_begin nc, row_end nc) (project_wgmma*.cu).
//   Attention: rows of one batch (row_end - 1 < (row_begin / N + 1) N); the grid is
//   ceil(N / bq) * ceil((row_end - row_begin) / rows) * H blocks, and a block's rows past
//   row_end are treated as rows past N (ATTENTION_BLOCK's i_end).
//   The LayerNorm projections with a null `bias` write no bias (a block's projection
//   after the bias pass, which wrote all of it; project_wgmma_split.cu: a null `wb`).
// BIAS_ONLY (project_mma.cu, project_ffma.cu; off by default): the bias pass of row
// blocks, LayerNorm and the pair bias only (no q, k, v or gate: qkvg and vt unread).
#ifndef ROW_BLOCK
#define ROW_BLOCK 0
#endif
#ifndef BIAS_ONLY
#define BIAS_ONLY 0
#endif
#if ROW_BLOCK
__device__ __forceinline__ AttentionBlock attention_block_rows(int N, int H, int bq, int rows,
                                                               i64 row_begin, i64 row_end) {
    const int count = (int)(row_end - row_begin);
    const int nq = (N + bq - 1) / bq, nr = (count + rows - 1) / rows;
    AttentionBlock blk;
    blk.qtile = (int)(blockIdx.x % nq);
    i64 rest = blockIdx.x / nq;
    blk.b = (int)(row_begin / N);
    blk.i0 = (int)(row_begin - (i64)blk.b * N) + (int)(rest % nr) * rows;
    blk.head = (int)(rest / nr);
    asm volatile("" : "+r"(blk.qtile), "+r"(blk.i0), "+r"(blk.head), "+r"(blk.b));
    return blk;
}
// The block of an attention kernel and the end of its batch's rows (N, or row_end's row)
#define ATTENTION_BLOCK(blk, i_end, N, H, bq, rows)                                   \
    const AttentionBlock blk = attention_block_rows(N, H, bq, rows, row_begin, row_end); \
    const int i_end = (int)(row_end - (i64)blk.b * N)
#define ROW_BLOCK_ARGS , i64 row_begin, i64 row_end
#else
#define ATTENTION_BLOCK(blk, i_end, N, H, bq, rows)                                   \
    const AttentionBlock blk = attention_block(N, H, bq, rows);                        \
    const int i_end = N
#define ROW_BLOCK_ARGS
#endif

// The attention kernels' last parameters, alike in every engine: the key extent
// (key_extent.cu, or null), ROW_MASK's key bits [B N][npk / 32], ROW_BLOCK's row range.
#if ROW_MASK
#define ATTENTION_TAIL_ARGS                                                            \
    , const int* __restrict__ key_extent, const unsigned* __restrict__ row_mask ROW_BLOCK_ARGS
#else
#define ATTENTION_TAIL_ARGS , const int* __restrict__ key_extent ROW_BLOCK_ARGS
#endif
