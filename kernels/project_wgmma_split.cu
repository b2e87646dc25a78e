// The fp32 mode's two projections on the wgmma attention's path (tiles_f16_hilo: head dim 32,
// compute capability 9.0, D = 128): project_wgmma.cu's persistent warpgroup GEMMs with
// every product split into fp16 hi and lo parts, a b = a_hi b_hi + a_hi b_lo + a_lo b_hi
// (f16x3: fp32's accuracy from fp16 products, as project_mma.cu's F16_TERMS 3). They store
// tiles_f16_hilo's layouts (project_epilogue.cuh):
//
//   ln_qkvg_project_wgmma, every tile of 64 keys (b, i, 64c .. 64c + 63) of one pair row,
//   in two halves:
//     xn = LayerNorm(x) * a_scale                fp16 hi and lo, in shared memory (A)
//     half 0: [q k] = xn [Wq; Wk]^T, and the pair bias xn Wb^T (FFMA, in LayerNorm)
//     half 1: [g v] = xn [Wg; Wv]^T
//     q (x q_scale) as fp16 hi and lo words; the gate (sigmoid) fp32; K (half 0) and V^T
//     (half 1), hi and lo, into the attention's 16 KiB tiles per head (through shared
//     memory, one bulk copy per head and half); the pair bias (log2 e units, -inf where
//     masked) as fp16 hi and lo into row i % 128 of its tiles.
//   gated_out_project_wgmma: per tile of 64 rows: out = (g o) Wo^T + bo, g o scaled by the
//     tile's own power of two and split, Wo split on the host.
//
// Why two halves: the hi and lo parts of W for four passes are 256 KiB, more shared
// memory than a block has; two passes' (128 KiB) fit beside A's two parts and two stages
// of x rows. Each half reads the tile's rows and runs LayerNorm again (x read twice: 4
// bytes an element more, against the ~20 of what the projection writes). Why the pair
// bias on FFMA: its weights split would need 4 KiB that shared memory does not have left,
// and LayerNorm holds each row's xn in fp32 anyway (64 FFMA per thread and tile, exact in
// fp32 as PyTorch's).
//
// Accuracy: a wgmma adds its products to the accumulator inside the tensor cores, which
// do not round to nearest, so a long chain of them loses bits (README: 1.2e-5 at D = 768
// for chained 3xTF32 mma.sync). A pass keeps the hi*hi products of each CHAIN_STEPS
// k-steps in an accumulator of their own and the hi*lo and lo*hi ones in another (2^-11
// of their size: that chain's losses are 2^-11 as large), each a chain from zero, summed
// in fp32 after the wait (SplitAcc, fold).
//
// Work split and shared memory as project_wgmma.cu's (4 warpgroups, 512 threads, head w
// in warpgroup w, LayerNorm and the gated loads 8 threads per row). Launch
// (triattn_cupy/gpu/plan.py Plan): grid min(tiles, SMs), block THREADS, dynamic shared memory
// PROJECT_TILES_SMEM or OUT_TILES_SMEM (gpu/tiles.py project_tiles_smem_bytes mirrors them).
// Pointers as project_wgmma.cu's, and
//   w_image     the two halves' W images, each [Wq hi, Wq lo, Wk hi, Wk lo] (half 0) or
//               [Wg hi, Wg lo, Wv hi, Wv lo] (half 1), each part [D / 64][D rows][128 B]
//               fp16 sw128, scaled (DeviceWeights.tile_weight_image, split)
//   wb          [H][D] fp32 the pair-bias weights (times s_b); a_unscale = 1 / a_scale
//   wo_image    [Wo hi, Wo lo], each [D / 64][D rows][128 B] fp16 sw128, scaled
//
// Shared memory of ln_qkvg_project_wgmma (bytes from a 1024-aligned base):
//   W      [2 passes][hi, lo][D / 64][D rows][128 B]   this half's weights, 128 KiB
//   A      [hi, lo][D / 64][64 rows][128 B]            the tile's xn a_scale split
//   RAW    [2][64][D] fp32 (pair_t)                    x rows a tile ahead; after LayerNorm
//                                                      the staging of the K or V^T tiles
//                                                      [H][hi, lo][4 KiB] (and of q first)
//   BAR    3 mbarriers: RAW stage 0, 1, the weights
#ifndef PAIR_DIM
#define PAIR_DIM 128
#endif
#define EXACT_FP32 1    // the fp32 mode: IEEE sigmoid and 1/sqrt (project_math.cuh)
#include "project_math.cuh"
#include "project_wgmma.cuh"

#define KV_BYTES 16384         // per (b, i, head, 64 keys): K hi, K lo, V^T hi, V^T lo
#define PART_BYTES 4096        // from a hi K or V^T tile to its lo tile
#define HALF_KV 8192           // one half's share of a head's tile: K hi and lo, or V^T's
#define BIAS_TILE_BYTES 32768  // per (b, head, 128 queries, 64 keys): [128][64] fp16 sw128 hi, then lo
#define BIAS_LO 16384
// Words per qkvg row: per head, q's 16 fp16 hi words then its 16 lo words at [32 h,
// 32 h + 32) (dims 2w, 2w + 1 in word w), where the attention writes o; the gate fp32 at
// [D, 2D).
#define QKVG_WORDS (2 * PD)
#define Q_LO_WORDS 16

#define W_PART (PD * PD * 2)        // one pass's W, hi or lo
#define A_PART (KBLK * ROWS * 128)  // the tile's xn, hi or lo
#define OFF_W 0
#define OFF_A (OFF_W + 4 * W_PART)
#define OFF_RAW (OFF_A + 2 * A_PART)
#define OFF_BAR (OFF_RAW + 2 * RAW_BYTES)
#define PROJECT_TILES_SMEM (OFF_BAR + 64 + 1024)  // + 1024: aligned up at run time
#if HEADS * HALF_KV != RAW_BYTES
#error "project_wgmma_split.cu: a tile's K (or V^T) hi and lo tiles are staged in its RAW stage"
#endif

// The hi*hi products chain onto one accumulator for CHAIN_STEPS k-steps at most. Measured
// at 1x200 / 1x384 (docs/performance.md), the forward's error against float64
// with chains of 8, 4 and 2 k-steps: 2.41 / 1.90, 1.70 / 1.35 and 1.43 / 1.13 (e-7), and
// 1.41 / 1.07 with project_mma.cu's projections, at the same speed. PASSES_IN_FLIGHT 2:
// the second pass's products issued before the first's epilogue (no faster with chains of
// 8; with shorter ones its accumulators spill).
#ifndef CHAIN_STEPS
#define CHAIN_STEPS 2
#endif
#ifndef PASSES_IN_FLIGHT
#define PASSES_IN_FLIGHT 1
#endif
#define CHAINS (KSTEPS / CHAIN_STEPS)
#if KSTEPS % CHAIN_STEPS != 0
#error "project_wgmma_split.cu: CHAIN_STEPS divides the k-steps"
#endif

// The accumulators of a warpgroup's 32 columns of a split product: acc[c] the hi*hi
// products of k-steps [c CHAIN_STEPS, (c + 1) CHAIN_STEPS), cor the hi*lo and lo*hi ones
// of every k-step (2^-11 of acc's size: their own chaining loses 2^-11 as much).
struct SplitAcc {
    float acc[CHAINS][16];
    float cor[16];
};

// A [64 x D] x B^T, split, each accumulator a chain from zero. A's lo tile is A_PART bytes
// after its hi tile at `a_tile`; B's 32 K-major rows at `b_rows` (hi; the next block along
// K PD * 128 bytes on), its lo part `b_lo` bytes further.
__device__ __forceinline__ void split_product32(SplitAcc& r, u32 a_tile, u32 b_rows, u32 b_lo) {
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        const u32 a_at = a_tile + (s / 4) * (ROWS * 128), b_at = b_rows + (s / 4) * (PD * 128);
        const u64 ah = sw128_desc(a_at) + 2 * (s % 4), al = sw128_desc(a_at + A_PART) + 2 * (s % 4);
        const u64 bh = sw128_desc(b_at) + 2 * (s % 4), bl = sw128_desc(b_at + b_lo) + 2 * (s % 4);
        if (s % CHAIN_STEPS == 0)
            WGMMA_SS_N32("0", r.acc[s / CHAIN_STEPS], ah, bh);
        else
            WGMMA_SS_N32("1", r.acc[s / CHAIN_STEPS], ah, bh);
        if (s == 0)
            WGMMA_SS_N32("0", r.cor, ah, bl);
        else
            WGMMA_SS_N32("1", r.cor, ah, bl);
        WGMMA_SS_N32("1", r.cor, al, bh);
    }
}

// After the wait for a pass's products: their sum in fp32, into out.
__device__ __forceinline__ void fold(SplitAcc& r, float (&out)[16]) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) pin(r.acc[c]);
    pin(r.cor);
#pragma unroll
    for (int e = 0; e < 16; ++e) {
        float sum = r.acc[0][e];
#pragma unroll
        for (int c = 1; c < CHAINS; ++c) sum += r.acc[c][e];
        out[e] = sum + r.cor[e];
    }
}

// x's fp16 hi and lo parts of a float4, 4 values each, as two uint2.
__device__ __forceinline__ void split4(float4 x, uint2& hi, uint2& lo) {
    split_f16(x.x, x.y, hi.x, lo.x);
    split_f16(x.z, x.w, hi.y, lo.y);
}

// LayerNorm of the RAW stage into A's hi and lo tiles, PARTS threads per row
// (row_piece), zero rows from kt.valid on: xn a_scale = (x - mean) rstd gamma' + beta'
// (row_moments), gamma' and beta' times a_scale (exact: a power of two). With `wb` (half
// 0) also the pair bias of the tile's keys for every head: xn . wb[head] from the fp32 xn
// (the PARTS threads' sums combined), log2 e units, -inf where masked and on the keys
// past N; part p stores head p's, hi and lo, into row i % 128 of its tile (f16_bias_split).
__device__ __forceinline__ void layernorm_split_tile(char* smem, const pair_t* raw, const KeyTile& kt,
                                                     float eps, const float* __restrict__ gamma_beta,
                                                     const float* __restrict__ wb, float a_unscale,
                                                     const void* __restrict__ mask, int mask_kind,
                                                     i64 mb, i64 mi, i64 mj,
                                                     unsigned short* __restrict__ bias, int N, int H,
                                                     int npk) {
    const int tid = threadIdx.x, r = tid / PARTS, p = tid % PARTS;
    float4 v[PD / 32];
    float mu, rstd;
    row_moments(raw, r, p, eps, v, mu, rstd);
    const bool ok = r < kt.valid;
    float dot[HEADS] = {};
#pragma unroll
    for (int k = 0; k < PD / 32; ++k) {
        const int idx = row_piece(r, p, k);
        const float4 g = ld4(gamma_beta + 4 * idx), c = ld4(gamma_beta + PD + 4 * idx);
        float4 y = zero4();
        if (ok)
            y = make_float4(fmaf((v[k].x - mu) * rstd, g.x, c.x), fmaf((v[k].y - mu) * rstd, g.y, c.y),
                            fmaf((v[k].z - mu) * rstd, g.z, c.z), fmaf((v[k].w - mu) * rstd, g.w, c.w));
        uint2 hi, lo;
        split4(y, hi, lo);
        *reinterpret_cast<uint2*>(smem + OFF_A + a_offset(r, 4 * idx)) = hi;
        *reinterpret_cast<uint2*>(smem + OFF_A + A_PART + a_offset(r, 4 * idx)) = lo;
        if (wb) {
#pragma unroll
            for (int h = 0; h < HEADS; ++h) {
                const float4 w = ld4(wb + h * PD + 4 * idx);
                dot[h] = fmaf(y.x, w.x, fmaf(y.y, w.y, fmaf(y.z, w.z, fmaf(y.w, w.w, dot[h]))));
            }
        }
    }
    if (!wb) return;
#pragma unroll
    for (int h = 0; h < HEADS; ++h)
#pragma unroll
        for (int lanes = 1; lanes < PARTS; lanes <<= 1) dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], lanes);
    if (p >= H) return;
    const float mine = p == 0 ? dot[0] : p == 1 ? dot[1] : p == 2 ? dot[2] : dot[3];  // (HEADS 4)
    const bool keep = ok && mask_keeps(mask, mask_kind, kt.b * mb + kt.i * mi + (i64)(kt.key0 + r) * mj);
    const float x = keep ? mine * a_unscale * LOG2E_F : neg_inf();
    unsigned short hi, lo;
    f16_bias_split(x, hi, lo);
    const i64 per_head = (i64)((N + 127) / 128) * (npk / 64);  // bias tiles of one (b, head)
    const i64 tile = ((i64)kt.b * H + p) * per_head + (kt.i / 128) * (npk / 64) + kt.c;
    char* const at = reinterpret_cast<char*>(bias) + tile * BIAS_TILE_BYTES + sw128(kt.i % 128, 2 * r);
    *reinterpret_cast<unsigned short*>(at) = hi;
    *reinterpret_cast<unsigned short*>(at + BIAS_LO) = lo;
}

// q: (acc unscale + bq) q_scale as fp16 hi and lo words (column pair 8n + 2t of rows g + 8h).
__device__ __forceinline__ void q_split_words(u32 (&hi)[4][2], u32 (&lo)[4][2], const float (&acc)[16],
                                              float unscale, const float2 (&bq)[4], float q_scale) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            split_f16(fmaf(acc[4 * n + 2 * h], unscale, bq[n].x) * q_scale,
                      fmaf(acc[4 * n + 2 * h + 1], unscale, bq[n].y) * q_scale, hi[n][h], lo[n][h]);
}

// Half 0's second pass k, or half 1's v: acc unscale + b as fp16 hi and lo, into the head's
// K tiles [64 keys][32 dims] (sw64) or, transposed, its V^T tiles [32 dims][64 keys]
// (sw128, 0 on the keys past N: rows r0, r1 from `valid` on), hi at head_stage and lo
// PART_BYTES on (stmatrix u's matrix j: column group n = 2u + j / 2, the warp's keys + 8
// (j % 2)). hi and lo are the caller's scratch: declared here, the compiler took them up in
// another order and the machine code changed.
__device__ __forceinline__ void stage_split_tiles(u32 (&hi)[4], u32 (&lo)[4], u32 head_stage, int half,
                                                  const float (&acc)[16], float unscale, const float2 (&b)[4],
                                                  int r0, int r1, int valid, int w4, int jm, int jr) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // matrix j of stmatrix u: column group n, rows + 8 h
            const int n = 2 * u + j / 2, h = j % 2;
            split_f16(fmaf(acc[4 * n + 2 * h], unscale, b[n].x), fmaf(acc[4 * n + 2 * h + 1], unscale, b[n].y),
                      hi[j], lo[j]);
            if (half && (h ? r1 : r0) >= valid) hi[j] = lo[j] = 0u;  // V^T: 0 past N
        }
        const int n = 2 * u + jm / 2;
        if (half == 0) {
            const int key = 16 * w4 + 8 * (jm % 2) + jr;
            stsm_x4(head_stage + sw64(key, 16 * n), hi[0], hi[1], hi[2], hi[3]);
            stsm_x4(head_stage + PART_BYTES + sw64(key, 16 * n), lo[0], lo[1], lo[2], lo[3]);
        } else {
            const int key = 16 * w4 + 8 * (jm % 2);
            stsm_x4_trans(head_stage + sw128(8 * n + jr, 2 * key), hi[0], hi[1], hi[2], hi[3]);
            stsm_x4_trans(head_stage + PART_BYTES + sw128(8 * n + jr, 2 * key), lo[0], lo[1], lo[2], lo[3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
ln_qkvg_project_wgmma_f16x3(const pair_t* __restrict__ x, i64 sb, i64 si, i64 sj, int B, int N, int H,
                      float eps, const float* __restrict__ gamma_beta,  // [2][D], times a_scale
                      const uint4* __restrict__ w_image,  // 2 halves x 4 W_PART
                      const float* __restrict__ col_bias,  // [4 D]: bq, bk, bv (times s_q, s_k, s_v), bg
                      float q_scale, float unscale,
                      const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi, i64 mj,
                      float* __restrict__ qkvg, unsigned short* __restrict__ bias, int npk,
                      char* __restrict__ vt, const float* __restrict__ wb, float a_unscale
                      ROW_BLOCK_ARGS  // (common.cuh ROW_BLOCK: the rows [row_begin, row_end))
                      ) {
    BLOCK_PROLOGUE();
    allow_next_kernel();  // the attention may launch (it waits for this kernel: common.cuh)
    KEY_TILE_RANGE();
    // This block's tiles blockIdx.x + n gridDim.x (n < mine; the grid is at most ntiles), each
    // in half 0, then each in half 1: step s takes tile n = s % mine in half s / mine.
    const int mine = (ntiles - t0 - 1 - (int)blockIdx.x) / (int)gridDim.x + 1, steps = 2 * mine;
    const u32 bar_w = smem_s + OFF_BAR + 16, bar_raw = smem_s + OFF_BAR;  // raw: + 8 stage
    check_block();
    init_barriers(bar_raw);
    __syncthreads();  // the mbarriers initialised
    auto step_tile = [&](int s) { return KeyTile(t0 + (int)blockIdx.x + (s % mine) * (int)gridDim.x, N, nc); };
    // Half `half`'s W into shared memory (one thread), counted on bar_w's phase `half`.
    auto load_w = [&](int half) {
        load_weights<4 * W_PART>(smem_s + OFF_W, reinterpret_cast<const char*>(w_image) + half * 4 * W_PART,
                                 bar_w);
    };
    if (warp == 0) {
        if (lane == 0) load_w(0);
        for (int s = 0; s < 2 && s < steps; ++s)
            load_rows(x, sb, si, sj, step_tile(s), smem_s + OFF_RAW + s * RAW_BYTES, bar_raw + 8 * s);
    }

    // This thread's column pairs 32 wg + 8n + 2t (n < 4) of head wg (their biases are
    // loaded per step, for the half's two passes: all four held took 32 registers, and
    // the kernel spilled).
    const int col0 = NW * wg + 2 * t;
    const u32 a_tile = smem_s + OFF_A;
    const u32 w_head = smem_s + OFF_W + wg * NW * 128;  // this warpgroup's rows of each pass
    // The K hi rows (keys) this warp writes, 1 KiB of the stage: first q's staging.
    const u32 k_rows = wg * HALF_KV + w4 * 1024;
    for (int s = 0; s < steps; ++s) {
        const int half = s >= mine, stage = s & 1;
        const KeyTile kt = step_tile(s);
        const u32 raw = smem_s + OFF_RAW + stage * RAW_BYTES;
        char* const raw_g = smem + OFF_RAW + stage * RAW_BYTES;
        const i64 m_first = kt.bi * N + kt.key0;  // qkvg row of the tile's first key
        const int r0 = 16 * w4 + g, r1 = r0 + 8, rows_left = kt.valid - 16 * w4;

        // 1. LayerNorm: RAW -> A, hi and lo (half 0: and the pair bias).
        mbar_wait(bar_raw + 8 * stage, (s >> 1) & 1);
        layernorm_split_tile(smem, reinterpret_cast<const pair_t*>(raw_g), kt, eps, gamma_beta,
                             half ? nullptr : wb, a_unscale, mask, mask_kind, mb, mi, mj, bias, N,
                             H, npk);
        fence_async_shared();  // A's generic stores, before the tensor cores read it
        __syncthreads();       // A complete; the RAW stage free for the staging
        if (s == 0 || s == mine) mbar_wait(bar_w, half);
        // The previous step's stage (its bulk copies' reads waited for here, long done)
        // takes the next step's rows: one step ahead.
        if (warp == 0 && s > 0) {
            wait_stage_reads();
            if (s + 1 < steps)
                load_rows(x, sb, si, sj, step_tile(s + 1), smem_s + OFF_RAW + (stage ^ 1) * RAW_BYTES,
                          bar_raw + 8 * (stage ^ 1));
        }

        // 2. This half's two passes (q and k, or the gate and v), the second's products
        //    running while the first's epilogue stores; b0, b1 their column biases.
        float2 b0[4], b1[4];
        SplitAcc pass0, pass1;
        float acc0[16], acc1[16];
        wgmma_fence();
        split_product32(pass0, a_tile, w_head, W_PART);
        wgmma_commit();
        if constexpr (PASSES_IN_FLIGHT == 2) {
            split_product32(pass1, a_tile, w_head + 2 * W_PART, W_PART);
            wgmma_commit();
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        fold(pass0, acc0);
        column_biases(b0, col_bias + (half ? 3 * PD : 0), col0);  // bq, bg
        if (half == 0) {
            // q: (acc unscale + bq) q_scale, fp16 hi words then lo words into the head's slot
            // (through the staging: 64 bytes a row each).
            u32 hi[4][2], lo[4][2];
            q_split_words(hi, lo, acc0, unscale, b0, q_scale);
            auto q_words = [&](int word) {  // where row `row` of this warp's 16 takes them
                return [&, word](int row) {
                    return reinterpret_cast<char*>(qkvg + (m_first + 16 * w4 + row) * QKVG_WORDS + word);
                };
            };
            store_rows16(hi, raw + k_rows, raw_g + k_rows, rows_left, q_words(32 * wg));
            store_rows16(lo, raw + k_rows, raw_g + k_rows, rows_left, q_words(32 * wg + Q_LO_WORDS));
        } else {
            // the gate: sigmoid(acc unscale + bg), fp32 at [D, 2D)
            store_gate_f32(qkvg, m_first, QKVG_WORDS, r0, r1, kt.valid, col0, [&](int n, int e) {
                return sigmoid(fmaf(acc0[4 * n + e], unscale, e & 1 ? b0[n].y : b0[n].x));
            });
        }

        if constexpr (PASSES_IN_FLIGHT == 1) {
            wgmma_fence();
            split_product32(pass1, a_tile, w_head + 2 * W_PART, W_PART);
            wgmma_commit();
        }
        wgmma_wait<0>();
        fold(pass1, acc1);
        column_biases(b1, col_bias + (half ? 2 * PD : PD), col0);  // bk, bv
        const int jm = lane >> 3, jr = lane & 7;  // the matrix and row this lane addresses
        const u32 head_stage = raw + wg * HALF_KV;
        u32 hi[4], lo[4];
        stage_split_tiles(hi, lo, head_stage, half, acc1, unscale, b1, r0, r1, kt.valid, w4, jm, jr);
        fence_async_shared();
        __syncthreads();  // every warp's K or V^T rows staged, every warpgroup's products done
        if (tid == 0) {
            store_head_tiles(vt, kt, H, npk, raw, KV_BYTES, half * HALF_KV, HALF_KV);
            // The last tile of half 0 is done with W (the barrier above): half 1's replaces it.
            if (s == mine - 1) load_w(1);
        }
    }
    if (tid == 0) bulk_wait_all();  // the last tile's copies complete before the block ends
}

// ---- gated_out_project_wgmma: out = (g o) Wo^T + bo, 64 rows per tile ----
//
// A qkvg row holds o fp32 at [0, D) (attention_wgmma.cu's f16x3 writes it over q) and the
// gate fp32 at [D, 2D); a tile's 64 rows are one bulk copy, two tiles ahead. PARTS threads
// per row (row_piece). The tile's g o is scaled by its own power of two a, its largest
// |g o| into [2^13, 2^14) (gates near 0 keep their bits: project_mma.cu
// load_gated_tile_f16), and split into A's hi and lo; the products are undone by
// w_unscale, then by 1 / a, one after the other (their product may fall below fp32's
// range where each result does not). Warpgroup w computes out's columns [32 w, 32 w + 32).
//
// Shared memory: WO [hi, lo][D / 64][D rows][128 B] (Wo in fp16, scaled), A as above, IN
// [2][64 rows][2 D] fp32, RED [16] (the warps' largest |g o|), 3 mbarriers (IN 0, 1, Wo).
#define IN_BYTES (ROWS * QKVG_WORDS * 4)
#define OFF_WO 0
#define OFF_AO (OFF_WO + 2 * W_PART)
#define OFF_IN (OFF_AO + 2 * A_PART)
#define OFF_RED (OFF_IN + 2 * IN_BYTES)
#define OFF_OBAR (OFF_RED + 64)
#define OUT_TILES_SMEM (OFF_OBAR + 64 + 1024)

// gated_out_projection's steps for the fp32 mode: o fp32 at [0, D) of a qkvg row (the
// attention's f16x3 writes it over q), the gate fp32 at [D, 2D); A in fp16 hi and lo, Wo
// split on the host (split_product32).
struct SplitOutSteps {
    enum : int { off_bar = OFF_OBAR, off_red = OFF_RED, off_in = OFF_IN, in_bytes = IN_BYTES,
                 row_words = QKVG_WORDS, off_a = OFF_AO, off_wo = OFF_WO };
    using AScratch = uint2;  // hi and lo of a piece of A (write_a)
    using Products = SplitAcc;

    // Wo's hi and lo images into WO (thread 0).
    static __device__ __forceinline__ void load_wo(u32 smem_s, const uint4* wo_image, u32 bar_w) {
        load_weights<2 * W_PART>(smem_s + OFF_WO, reinterpret_cast<const char*>(wo_image), bar_w);
    }

    // g o of this thread's pieces (columns 4P .. 4P + 3) of row r of an IN stage, and their
    // largest |g o| (NaN, where a fully masked query's o is, drops out of fmaxf).
    static __device__ __forceinline__ float gated_pieces(float4 (&go)[PD / 32], const char* in_stage, int r,
                                                         int p) {
        const float* const row = reinterpret_cast<const float*>(in_stage) + r * QKVG_WORDS;
        float top = 0.f;
#pragma unroll
        for (int j = 0; j < PD / 32; ++j) {
            const int P = row_piece(r, p, j);
            const float4 o = *reinterpret_cast<const float4*>(row + 4 * P);
            const float4 gate = *reinterpret_cast<const float4*>(row + PD + 4 * P);
            go[j] = make_float4(gate.x * o.x, gate.y * o.y, gate.z * o.z, gate.w * o.w);
            top = abs_max4(top, go[j]);
        }
        return top;
    }

    // g o times a (the tile's power of two) into A's hi and lo tiles, row r's pieces; zero
    // from rows_here on (rows past M, whatever the stage held).
    static __device__ __forceinline__ void write_a(uint2& hi, uint2& lo, char* smem, const float4 (&go)[PD / 32],
                                                   float a, int r, int p, int rows_here) {
#pragma unroll
        for (int j = 0; j < PD / 32; ++j) {
            hi = make_uint2(0u, 0u), lo = hi;
            if (r < rows_here) split4(make_float4(go[j].x * a, go[j].y * a, go[j].z * a, go[j].w * a), hi, lo);
            const u32 at = a_offset(r, 4 * row_piece(r, p, j));
            *reinterpret_cast<uint2*>(smem + OFF_AO + at) = hi;
            *reinterpret_cast<uint2*>(smem + OFF_AO + A_PART + at) = lo;
        }
    }

    // acc = A Wo^T, split (this warpgroup's rows of Wo at wo_rows), waited for.
    static __device__ __forceinline__ void product(SplitAcc& products, float (&acc)[16], u32 a_tile, u32 wo_rows) {
        wgmma_fence();
        split_product32(products, a_tile, wo_rows, W_PART);
        wgmma_commit();
        wgmma_wait<0>();
        fold(products, acc);
    }
};

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gated_out_project_wgmma_f16x3(const float* __restrict__ qkvg, i64 M,
                        const uint4* __restrict__ wo_image,  // 2 W_PART
                        const float* __restrict__ b_out, pair_t* __restrict__ out,
                        float w_unscale
                        OUT_TRANSPOSED_ARGS  // the pair's N: rows go to caller_row (common.cuh)
                        ) {
    gated_out_projection<SplitOutSteps>(qkvg, M, wo_image, b_out, out, w_unscale, OUT_N);
}
