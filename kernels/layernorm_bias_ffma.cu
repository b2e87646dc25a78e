// The pair bias of every pair row, alone: LayerNorm, then the h bias products, in fp32
// FFMA. It is the bias pass of row blocks (triattn_cupy/gpu/row_blocks.py) for the
// persistent projections (project_wgmma.cu, project_wgmma_split.cu), whose single pass makes
// the bias inside the products of q and the gate and so has no bias-only form of its own.
//
//   bias[b, head, i, j] = log2(e) (LN(x[b, i, j]) . Wb[head]), -inf where the mask drops
//   (b, i, j), for the pair rows (b, i) in [row_begin, row_end) (common.cuh ROW_BLOCK)
//
// The pass reads the whole pair once and writes h values per D read, so it should run at
// the memory rate: eight lanes per pair row, each holding D / 8 values in registers
// (coalesced: a row's 8 lanes read 128 consecutive bytes per piece), the LayerNorm sums
// and the h dot products reduced across the eight lanes by shuffles. The memory rate needs
// bytes in flight: each lane copies its pieces of the rows BIAS_STAGES - 1 steps ahead into
// its own slots of shared memory (cp.async), so a warp waits on a row it asked for three
// steps earlier, not one. LayerNorm's gamma and beta are folded into the bias
// weights on the host (DeviceWeights.layernorm_bias_weight):
//
//   LN(x)_k . Wb = rstd sum_k (x_k - mean) (gamma_k Wb_k) + sum_k beta_k Wb_k
//                = rstd sum_k (x_k - mean) w_ln[k] + c_ln
//
// so a lane keeps its D / 8 columns of w_ln for every head in registers. The products are
// fp32, at least as accurate as the single pass's (fp16 terms, or hi + lo in the fp32 mode).
// The tile stores (pair_bias_store.cuh) are the projections' own: the same bias form.
#define EXACT_FP32 1  // LayerNorm's 1 / sqrt exact: one per row, nothing to save
#include "common.cuh"
#include "project_math.cuh"
#include "pair_bias_store.cuh"
#include "mma.cuh"

#ifndef PAIR_DIM
#define PAIR_DIM 128
#endif
#ifndef HEADS
#define HEADS 4
#endif
#define THREADS 256
#define WARPS (THREADS / 32)
// Eight lanes per row issue a third fewer instructions per row than sixteen (three
// shuffles per sum, not four; the h dot products on twice the values per lane): measured
// on the H200 at 1x4096x128 (8.6 GB of pair), 2.72 ms (3.2 TB/s) at 128 registers and 2
// blocks per SM, against 3.77 ms (2.3 TB/s, ncu: SM 73%, issue-bound) for sixteen lanes
// at 80 registers and 3 blocks (docs/performance.md, "Row blocks").
#ifndef ROW_LANES
#define ROW_LANES 8                        // lanes per pair row
#endif
#ifndef BIAS_MIN_BLOCKS
#define BIAS_MIN_BLOCKS 2                  // resident blocks per SM (at most 128 registers)
#endif
// Steps of rows each warp has asked for at once: BIAS_STAGES - 1 in flight while one is
// computed. A lane's slots hold PIECES pieces per stage (16 bytes each in fp32), so a
// block of 8 warps takes 8 x BIAS_STAGES x 2 KiB of shared memory (64 KiB in fp32 at 4:
// routes.layernorm_bias_smem_bytes); at 2 blocks per SM, 96 KiB are in flight per SM,
// about what 4 TB/s times the loaded latency (~2 us) asks of each of the 132 SMs.
// Measured at 1x4096x128 in fp32 (bits equal at every depth): the register prefetch of
// one row this replaced 2.81 ms (3.1 TB/s); 3, 4 and 6 stages 2.59-2.61 ms (3.3 TB/s);
// 8 stages 3.9 ms (256 KiB: one block per SM). The pieces of bf16 pairs take half.
#ifndef BIAS_STAGES
#define BIAS_STAGES 4
#endif
#define WARP_ROWS (32 / ROW_LANES)         // pair rows per warp and step
#define PIECES (PAIR_DIM / (4 * ROW_LANES))  // float4 pieces per lane: columns 4 l + 4 ROW_LANES p
static_assert(PAIR_DIM % (4 * ROW_LANES) == 0, "PAIR_DIM must be a multiple of 4 ROW_LANES");
static_assert(HEADS <= ROW_LANES, "each head's value is stored by one lane of its row");

// The sum (max) over the eight lanes of this lane's row; every lane gets it. `group`: the
// mask of those lanes, the only ones a branch on the row's values keeps together.
__device__ __forceinline__ float row_sum(float v, unsigned group) {
#pragma unroll
    for (int o = ROW_LANES / 2; o > 0; o /= 2) v += __shfl_xor_sync(group, v, o);
    return v;
}
__device__ __forceinline__ float row_max(float v, unsigned group) {
#pragma unroll
    for (int o = ROW_LANES / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(group, v, o));
    return v;
}

// A pair row (b, i, j) and where it starts in x, stepped along the flattened rows without
// a division per row (a 64-bit division is ~70 instructions, the whole row's arithmetic).
struct PairRow {
    int b, i, j;
    i64 offset;  // b sb + i si + j sj
};
__device__ __forceinline__ PairRow pair_row(i64 m, int N, i64 sb, i64 si, i64 sj) {
    const i64 NN = (i64)N * N, b = m / NN, r = m - b * NN, i = r / N, j = r - i * N;
    return PairRow{(int)b, (int)i, (int)j, b * sb + i * si + j * sj};
}
__device__ __forceinline__ void advance(PairRow& row, int steps, int N, i64 sb, i64 si, i64 sj) {
    row.j += steps;
    row.offset += steps * sj;
    while (row.j >= N) {  // (once, unless N < steps)
        row.j -= N;
        row.offset += si - N * sj;
        if (++row.i == N) {
            row.i = 0;
            ++row.b;
            row.offset += sb - N * si;
        }
    }
}

// A lane's piece of a row: 4 pair elements as stored (16 bytes in fp32, 8 in 16 bits).
#if PAIR_DTYPE == PAIR_F32
typedef float4 piece_t;
__device__ __forceinline__ float4 piece_value(float4 u) { return u; }
#else
typedef uint2 piece_t;
__device__ __forceinline__ float4 piece_value(uint2 u) {
    return make_float4(pair_value((unsigned short)(u.x & 0xffffu)), pair_value((unsigned short)(u.x >> 16)),
                       pair_value((unsigned short)(u.y & 0xffffu)), pair_value((unsigned short)(u.y >> 16)));
}
#endif

// Ask for this lane's pieces of the pair row at x + offset (columns 4 l + 4 ROW_LANES p ..
// + 3, l = lane % ROW_LANES) into its slots `slot[32 p]` of one stage, as one group of
// asynchronous copies (waited for with cp_async_wait); zeros for a row past the last
// (`real` false). The rows are contiguous and 16-byte aligned: the persistent projections,
// the only ones this pass serves, take no other pair (routes.choose_route).
__device__ __forceinline__ void fetch_row(piece_t* slot, const pair_t* __restrict__ x,
                                          bool real, i64 offset, int l) {
    const pair_t* const row = x + offset;
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        const int k = 4 * l + 4 * ROW_LANES * p;
#if PAIR_DTYPE == PAIR_F32
        cp_async16_or_zero(smem_addr(slot + 32 * p), row + k, real);
#else
        cp_async8_or_zero(smem_addr(slot + 32 * p), row + k, real);
#endif
    }
    cp_async_commit();
}

// This warp's rows [begin, end) of the launch's pair rows [row_begin N, row_end N =
// m_end): one contiguous run per warp, a multiple of WARP_ROWS long (its bias stores then
// fill consecutive keys j); empty (begin >= end) for the warps past the last row.
struct WarpRun {
    i64 begin, end, m_end;
};
__device__ __forceinline__ WarpRun warp_run(int N, i64 row_begin, i64 row_end) {
    const i64 m_begin = row_begin * N, m_end = row_end * N;
    const i64 warps = (i64)gridDim.x * WARPS, warp = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
    const i64 run = (m_end - m_begin + warps * WARP_ROWS - 1) / (warps * WARP_ROWS) * WARP_ROWS;
    const i64 run_begin = m_begin + warp * run;
    return WarpRun{run_begin, min(run_begin + run, m_end), m_end};
}

// LayerNorm's statistics of the row whose pieces v this lane holds (its ROW_LANES lanes,
// `group`, hold the rest): the mean subtracted from v in place, 1 / sigma returned. Two
// passes (no cancellation); a row past 2^40 scaled first (project_math.cuh: its result
// unchanged, its sums finite).
__device__ __forceinline__ float center_row(float4 (&v)[PIECES], unsigned group, float eps) {
    float s = 0.f, amax = 0.f;
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        s += sum4(v[p]);
        amax = absmax4(amax, v[p]);
    }
    amax = row_max(amax, group);
    const float eps_row = ln_rescale_huge(amax, eps, s, [&](float f) {  // (the row's lanes alike)
        float sum = 0.f;
#pragma unroll
        for (int p = 0; p < PIECES; ++p) {
            v[p] = scale4(v[p], f);
            sum += sum4(v[p]);
        }
        return sum;
    });
    const float mean = row_sum(s, group) / PAIR_DIM;
    float sq = 0.f;
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
        v[p] = minus4(v[p], mean);
        sq = sum_squares4(sq, v[p]);
    }
    return inverse_sqrt(row_sum(sq, group) / PAIR_DIM + eps_row);
}

// The h bias values of the centred row v (rstd its 1 / sigma): rstd (v . w[h]) + c[h],
// each reduced over the row's lanes; lane l of the row gets head l's (others: 0).
__device__ __forceinline__ float head_bias(const float4 (&v)[PIECES],
                                           const float (&w)[HEADS][PIECES][4],
                                           const float (&c)[HEADS], float rstd,
                                           unsigned group, int l) {
    float mine = 0.f;
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int p = 0; p < PIECES; ++p)
            dot = fmaf(v[p].x, w[h][p][0], fmaf(v[p].y, w[h][p][1],
                  fmaf(v[p].z, w[h][p][2], fmaf(v[p].w, w[h][p][3], dot))));
        dot = fmaf(row_sum(dot, group), rstd, c[h]);
        if (l == h) mine = dot;
    }
    return mine;
}

// This step's row: waits for the oldest stage's copies (this lane's own), then reads its
// pieces from `stage` of the slots, widened. The copies are asm the compiler cannot see
// into: a memory clobber keeps the reads after the wait, and every read before the
// caller refills the stage.
__device__ __forceinline__ void take_row(float4 (&v)[PIECES], const piece_t* slots, int stage) {
    cp_async_wait<BIAS_STAGES - 2>();
    asm volatile("" ::: "memory");
#pragma unroll
    for (int p = 0; p < PIECES; ++p) v[p] = piece_value(slots[(stage * PIECES + p) * 32]);
    asm volatile("" ::: "memory");
}

// bias[b, head, i, j] of pair row `row` = value, or -inf where the mask drops it (`keep`
// false), in the layout's form (pair_bias_store.cuh: rows, or KV_TILED tiles).
__device__ __forceinline__ void store_head_bias(bias_t* __restrict__ bias, const PairRow& row,
                                                int head, int N, int npk, bool keep,
                                                float value) {
#if KV_TILED  // (store_pair_bias_tiled exists only then)
    store_pair_bias_tiled(bias, (i64)row.b * HEADS + head, row.i, row.j, N, npk, keep, value);
#else
    store_pair_bias(bias + (((i64)row.b * HEADS + head) * N + row.i) * npk, row.j, N, npk,
                    keep, value);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, BIAS_MIN_BLOCKS)
layernorm_bias_ffma(const pair_t* __restrict__ x, i64 sb, i64 si, i64 sj,
                    int N, float eps,
                    const float* __restrict__ w_ln,  // [HEADS][PAIR_DIM]: gamma Wb (scaled)
                    const float* __restrict__ c_ln,  // [HEADS]: beta . Wb (scaled)
                    const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi, i64 mj,
                    bias_t* __restrict__ bias, int npk, i64 row_begin, i64 row_end) {
    const int lane = threadIdx.x & 31, l = lane % ROW_LANES, slot = lane / ROW_LANES;
    const unsigned group = (ROW_LANES == 32 ? 0xffffffffu : (1u << ROW_LANES) - 1u)
                           << (ROW_LANES * slot);
    const WarpRun run = warp_run(N, row_begin, row_end);
    if (run.begin >= run.end) return;  // (whole warps: no shuffle misses a lane)

    // This lane's columns (4 l + 4 ROW_LANES p .. + 3) of the folded weights of every
    // head, and their constants, in registers for the whole run. (Here, not in a function:
    // there, the compiler ordered the loads' address arithmetic otherwise.)
    float w[HEADS][PIECES][4], c[HEADS];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        c[h] = __ldg(c_ln + h);
#pragma unroll
        for (int p = 0; p < PIECES; ++p) {
            const float4 q = ld4(w_ln + h * PAIR_DIM + 4 * l + 4 * ROW_LANES * p);
            w[h][p][0] = q.x, w[h][p][1] = q.y, w[h][p][2] = q.z, w[h][p][3] = q.w;
        }
    }

    // This warp's slots: [BIAS_STAGES][PIECES][32 lanes] pieces, a lane reading back only
    // what it copied (no barrier: cp.async.wait_group orders a lane's own copies).
    extern __shared__ piece_t ring[];
    piece_t* const slots = ring + (threadIdx.x / 32) * (BIAS_STAGES * PIECES * 32) + lane;

    i64 m = run.begin + slot;  // this lane's row; `ahead` the one asked for last
    PairRow row = pair_row(min(m, run.m_end - 1), N, sb, si, sj), ahead = row;
#pragma unroll
    for (int s = 0; s < BIAS_STAGES - 1; ++s) {
        fetch_row(slots + s * PIECES * 32, x, m + s * WARP_ROWS < run.end, ahead.offset, l);
        advance(ahead, WARP_ROWS, N, sb, si, sj);
    }
    // (the loop's test is the warp's first row: every lane of the warp takes each step, so
    // the shuffles see their whole row)
    for (int stage = 0; m - slot < run.end; m += WARP_ROWS) {
        // This step's row in, and the row BIAS_STAGES - 1 steps on asked for.
        float4 v[PIECES];
        take_row(v, slots, stage);
        // the row BIAS_STAGES - 1 steps on, into the stage the last step read
        const int refill = stage == 0 ? BIAS_STAGES - 1 : stage - 1;
        fetch_row(slots + refill * PIECES * 32, x, m + (BIAS_STAGES - 1) * WARP_ROWS < run.end,
                  ahead.offset, l);
        advance(ahead, WARP_ROWS, N, sb, si, sj);
        stage = stage == BIAS_STAGES - 1 ? 0 : stage + 1;

        // LayerNorm's mean and 1 / sigma, then the h dot products: lane l of the row keeps
        // head l's, and stores it.
        const float rstd = center_row(v, group, eps);
        const float mine = head_bias(v, w, c, rstd, group, l);
        if (l < HEADS && m < run.end)
            store_head_bias(bias, row, l, N, npk,
                            mask_keeps(mask, mask_kind, row.b * mb + row.i * mi + row.j * mj),
                            mine);
        advance(row, WARP_ROWS, N, sb, si, sj);
    }
    cp_async_wait<0>();  // (none left in flight at exit)
}

