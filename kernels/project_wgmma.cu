// The two projections of the tf32 and bf16 modes on the wgmma attention's path (tiles_f16
// and 6: head dim 32, compute capability 9.0), as persistent warpgroup GEMMs with the
// weights resident in shared memory. They compute what project_mma.cu's ln_qkvg_project
// and gated_out_project compute for those formats (F16_TERMS 1: one fp16 product of
// operands scaled into fp16's range, fp32 accumulation), and store the same layouts
// (project_epilogue.cuh tiles_bf16 and tiles_f16; and tiles_f16_slots, tiles_f16's tiles in tiles_bf16's
// rows, for the bf16 mode's f16s attention, which only these kernels write):
//
//   ln_qkvg_project_wgmma:   per tile of 64 keys (b, i, 64c .. 64c + 63) of one pair row:
//     xn = LayerNorm(x) * a_scale             fp16, in shared memory (A)
//     [q g k v] = xn [Wq; Wg; Wk; Wv]^T       4 passes of 64 x D x D, wgmma from A and W
//     q (x q_scale) and the gate (sigmoid) into their qkvg words; K and V^T into the
//     attention's 8 KiB tiles per head (through shared memory, one bulk copy each); the
//     pair bias xn Wb^T (log2 e units, -inf where masked) into row i % 128 of its tiles.
//   gated_out_project_wgmma: per tile of 64 rows: out = (g o) Wo^T + bo, g o scaled by the
//     tile's own power of two (as load_gated_tile_f16), out in fp32.
//
// Why (docs/performance.md): project_mma.cu streams W through a ring per
// 128-row block and 32-wide chunk (a barrier each), runs LayerNorm, the products and the
// stores of a block one after another, and stores from the mma.sync fragments 4 bytes at a
// time; at 1x1024 it took 1.27-1.38 ms against a ~0.45 ms memory floor. Here one block per
// SM keeps W (128 KiB in fp16) in shared memory for its whole life, the copy engine brings
// the next tile's rows while this tile computes, both operands reach the tensor cores by
// descriptor (no fragment loads), each warpgroup issues the next pass's products before it
// stores this one's, q and K and V^T go out through shared memory in whole sectors.
//
// Work split: 512 threads, four warpgroups (16 warps: with 8, ncu found the schedulers
// idle 74% of the time, waiting on short latencies). LayerNorm: 8 threads per row.
// Products: warpgroup w takes head w, the columns [32 w, 32 w + 32) of each pass,
// m64n32k16, K = D in 8 steps, and the pair bias (m64n8k16, the heads as its 8 columns;
// every warpgroup computes it, a wgmma under a branch serializes the kernel's: ptxas
// C7519; warpgroup 0 stores it). Accumulator of warp (w % 4) of a warpgroup, lane (g, t):
// rows 16 (w % 4) + g (+ 8), columns 8n + 2t, +1 (wgmma.cuh).
//
// Launch (triattn_cupy/gpu/plan.py Plan: _tiles_projection, _tiles_out_projection): grid
// min(tiles, SMs), block THREADS = 512, dynamic shared memory PROJECT_TILES_SMEM or
// OUT_TILES_SMEM (gpu/tiles.py project_tiles_smem_bytes mirrors them). Pointers, float32 unless
// noted, M = B N N rows:
//   x           [B, N, N, D] of pair_t (PAIR_DTYPE, project_math.cuh: float32, float16 or
//               bfloat16) at b sb + i si + j sj (elements; the channel stride 1 and every
//               row 16-byte aligned: whole rows by bulk copy)
//   gamma_beta  [2][D] LayerNorm's gamma and beta times a_scale
//   w_image     W's and WB's shared-memory image, fp16 (DeviceWeights.tile_weight_image)
//   col_bias    [4 D] bq, bk, bv, bg (tiles_f16: bq, bk, bv times s_q, s_k, s_v, as W's rows)
//   mask        [B, N, N] at b mb + i mi + j mj, of the type mask_kind names, or null
//   qkvg        [M, QKVG_WORDS] (below); bias: the fp16 bias tiles [B, H, ceil(N / 128),
//               npk / 64][128][64]; vt: the K and V^T tiles [B N, H, npk / 64] x 8 KiB
//   wo_image    Wo's image, fp16; b_out [D]; out [M, D] contiguous, of pair_t
//
// Shared memory (bytes from a 1024-aligned base; sw128 = wgmma.cuh's 128-byte swizzle, rows
// of 128 bytes = 64 fp16 along K, so a D-wide row is D / 64 such blocks):
//   W      [4 passes][D / 64][D rows][128 B]   Wq, Wg, Wk, Wv in fp16, scaled (the host
//                                              lays the image out: DeviceWeights.tile_weight_image)
//   WB     [D / 64][8 rows][128 B]             the pair-bias weights (rows >= H zero)
//   A      [D / 64][64 rows][128 B]            the tile's xn, fp16 (zero past the last key)
//   RAW    [2][64][D] fp32 (pair_t)            x rows, by bulk copy, a tile ahead; after
//                                              LayerNorm the stage holds the tile's K and
//                                              V^T tiles [H][8 KiB] on their way out (and
//                                              before them q and a bf16 gate, each warp's
//                                              in the 1 KiB of K rows it writes later)
//   GB     [2][D] fp32                         gamma, beta times a_scale
//   BAR    3 mbarriers: RAW stage 0, 1, the weights
// The layout written (triattn_cupy/gpu/layouts.py; defaults: tiles_f16, the tf32 mode's f16
// attention): tiles_bf16 (TILES_BF16 and SLOT_ROWS), tiles_f16 (neither), tiles_f16_slots
// (SLOT_ROWS: tiles_f16's tiles in tiles_bf16's rows, the bf16 mode's f16s attention).
#ifndef TILES_BF16
#define TILES_BF16 0    // q, K, V^T (and o) in bf16, else scaled fp16
#endif
#ifndef SLOT_ROWS
#define SLOT_ROWS 0     // the gate in bf16 beside q in each head's slot, else fp32 after the row's q
#endif
#ifndef PAIR_DIM
#define PAIR_DIM 128
#endif
#define EXACT_FP32 0    // the tf32 and bf16 modes: MUFU sigmoid and 1/sqrt (project_math.cuh)
#include "project_math.cuh"
#include "project_wgmma.cuh"

#define KV_BYTES 8192            // per (b, i, head, 64 keys): the K tile, then the V^T tile
#define VT_IN_TILE 4096
#define BIAS_TILE_BYTES 16384    // per (b, head, 128 queries, 64 keys), [128][64] fp16 sw128
#if TILES_BF16 && !SLOT_ROWS
#error "project_wgmma.cu: bf16 tiles come with slot rows (tiles_bf16)"
#endif
// Words per qkvg row (project_epilogue.cuh QKVG_LD): tiles_f16 q's fp16 words per head at
// [32 h, 32 h + 16) (o later over them), the gate fp32 at [D, 2D); tiles_bf16 and tiles_f16_slots rows of
// D words, q's bf16 (9: fp16) words at [32 h, 32 h + 16), the gate's bf16 at [32 h + 16,
// 32 h + 32): half tiles_f16's bytes for the gate, written here and read by the out
// projection (the bf16 mode's f16s attention reads tiles_f16_slots; the tf32 mode keeps its gate
// in fp32, whose 16-bit form measured more error).
#define QKVG_WORDS (SLOT_ROWS ? PD : 2 * PD)
// The passes in the order they run (rows of the W image, DeviceWeights.tile_weight_image): the
// gate's sigmoid (two MUFU operations per value) second, where its epilogue overlaps
// k's products; k and v last, staged together for their bulk copies.
#define PASS_Q 0
#define PASS_G 1
#define PASS_K 2
#define PASS_V 3

#define W_BYTES (4 * PD * PD * 2)
#define WB_BYTES (KBLK * 8 * 128)
#define A_BYTES (KBLK * ROWS * 128)
#define OFF_W 0
#define OFF_WB (OFF_W + W_BYTES)
#define OFF_A (OFF_WB + WB_BYTES)
#define OFF_RAW (OFF_A + A_BYTES)
#define OFF_GB (OFF_RAW + 2 * RAW_BYTES)
#define OFF_BAR (OFF_GB + 2 * PD * 4)
#define PROJECT_TILES_SMEM (OFF_BAR + 64 + 1024)  // + 1024: aligned up at run time
#if HEADS * KV_BYTES != RAW_BYTES
#error "project_wgmma.cu: a tile's K and V^T tiles are staged in its RAW stage"
#endif

// wgmma m64n8k16 (the pair bias: the heads as its 8 columns), as WGMMA_SS_N32.
#define WGMMA_SS_N8(first, d, a, b)                                                           \
    asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, %4, %5, "  \
                 first ", 1, 1, 0, 0;" : WGMMA_D4("+f", d, 0) : "l"(a), "l"(b))

// acc = A [64 x D] x Wb^T: Wb's 8 K-major rows (rows >= H zero) from `b_rows`.
__device__ __forceinline__ void product8(float (&acc)[4], u32 a_tile, u32 b_rows) {
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        const u64 a = sw128_desc(a_tile + (s / 4) * (ROWS * 128)) + 2 * (s % 4);
        const u64 b = sw128_desc(b_rows + (s / 4) * (8 * 128)) + 2 * (s % 4);
        if (s == 0)
            WGMMA_SS_N8("0", acc, a, b);
        else
            WGMMA_SS_N8("1", acc, a, b);
    }
}

// Two values as the 16-bit pair q, k, v and the out projection's operands take.
__device__ __forceinline__ u32 pack16(float x0, float x1) {
    return TILES_BF16 ? pack_bf16(x0, x1) : pack_f16(x0, x1);
}

// LayerNorm of the RAW stage into A, PARTS threads per row (row_piece), zero rows from
// `valid` on: xn = (x - mean) rstd gamma' + beta' (row_moments), gamma' and beta' times
// a_scale (GB).
__device__ __forceinline__ void layernorm_tile(char* smem, const pair_t* raw, int valid, float eps) {
    const int tid = threadIdx.x, r = tid / PARTS, p = tid % PARTS;
    float4 v[PD / 32];
    float mu, rstd;
    row_moments(raw, r, p, eps, v, mu, rstd);
    const bool ok = r < valid;
    const float4* const gamma = reinterpret_cast<const float4*>(smem + OFF_GB);
    const float4* const beta = gamma + PD / 4;
#pragma unroll
    for (int k = 0; k < PD / 32; ++k) {
        const int idx = row_piece(r, p, k);
        const float4 g = gamma[idx], c = beta[idx];
        uint2 h = make_uint2(0u, 0u);
        if (ok) {
            h.x = pack_f16(fmaf((v[k].x - mu) * rstd, g.x, c.x), fmaf((v[k].y - mu) * rstd, g.y, c.y));
            h.y = pack_f16(fmaf((v[k].z - mu) * rstd, g.z, c.z), fmaf((v[k].w - mu) * rstd, g.w, c.w));
        }
        *reinterpret_cast<uint2*>(smem + OFF_A + a_offset(r, 4 * idx)) = h;
    }
}


// This thread's column pairs col0 + 8n (n < 4) of head wg: their biases, folded with the
// scales as the epilogues apply them (q: (acc unscale + bq) q_scale as acc uq + bq q_scale;
// the gate's exponent -(acc unscale + bg) log2 e as acc ug + bg').
__device__ __forceinline__ void load_column_biases(float2 (&bq)[4], float2 (&bg)[4], float2 (&bk)[4],
                                                   float2 (&bv)[4], const float* __restrict__ col_bias,
                                                   int col0, float q_scale) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        const int col = col0 + 8 * n;
        const float2 q = ld2(col_bias + col), k = ld2(col_bias + PD + col),
                     v = ld2(col_bias + 2 * PD + col), gb = ld2(col_bias + 3 * PD + col);
        bq[n] = make_float2(q.x * q_scale, q.y * q_scale);
        bk[n] = k, bv[n] = v;
        bg[n] = make_float2(-gb.x * LOG2E_F, -gb.y * LOG2E_F);
    }
}

// Whether the mask keeps this thread's keys r0 and r1 of the tile, where they are keys of
// it (keep0, keep1 true): the elements (b, i, key) that the pair bias reads, loaded by
// warpgroup 0 (which stores the bias) before the products run.
__device__ __forceinline__ void mask_keeps_rows(bool& keep0, bool& keep1, int r0, int r1, const KeyTile& kt,
                                                const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi,
                                                i64 mj) {
    const i64 base = kt.b * mb + kt.i * mi + (i64)kt.key0 * mj;
    if (keep0) keep0 = mask_keeps(mask, mask_kind, base + r0 * mj);
    if (keep1) keep1 = mask_keeps(mask, mask_kind, base + r1 * mj);
}

// q: acc uq + bq', packed 16-bit, into w for the head's q words.
__device__ __forceinline__ void q_words(u32 (&w)[4][2], const float (&acc)[16], float uq, const float2 (&bq)[4]) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            w[n][h] = pack16(fmaf(acc[4 * n + 2 * h], uq, bq[n].x), fmaf(acc[4 * n + 2 * h + 1], uq, bq[n].y));
}

// The pair bias (warpgroup 0): heads 2t, 2t + 1 of keys r0, r1 (accumulator accb), log2 e
// units, -inf where masked and on the keys past N (its tile's padded keys: npk is N
// rounded up to 64), into row i % 128 of their fp16 tiles.
__device__ __forceinline__ void store_bias_tile_rows(unsigned short* bias, const KeyTile& kt, int N, int H,
                                                     int npk, int t, int r0, int r1, bool keep0, bool keep1,
                                                     const float (&accb)[4], float unscale) {
    const int qt = kt.i / 128;
    char* const tiles = reinterpret_cast<char*>(bias);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int head = 2 * t + (e & 1), r = e < 2 ? r0 : r1;
        if (head >= H) continue;
        const i64 tile = (((i64)kt.b * H + head) * ((N + 127) / 128) + qt) * (npk / 64) + kt.c;
        *reinterpret_cast<unsigned short*>(tiles + tile * BIAS_TILE_BYTES + sw128(kt.i % 128, 2 * r)) =
            f16_bias_bits((e < 2 ? keep0 : keep1) ? accb[e] * unscale * LOG2E_F : neg_inf());
    }
}

// The gate: 1 / (1 + 2^(-(acc unscale + bg) log2 e)) = 1 / (1 + 2^(acc ug + bg')).
__device__ __forceinline__ void gate_values(float (&s)[4][4], const float (&acc)[16], float ug,
                                            const float2 (&bg)[4]) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            s[n][e] = __fdividef(1.0f, 1.0f + fast_exp2(fmaf(acc[4 * n + e], ug, e & 1 ? bg[n].y : bg[n].x)));
}

// The gate's values s, packed bf16, into w for the head's gate words (SLOT_ROWS).
__device__ __forceinline__ void gate_words(u32 (&w)[4][2], const float (&s)[4][4]) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int h = 0; h < 2; ++h) w[n][h] = pack_bf16(s[n][2 * h], s[n][2 * h + 1]);
}

// k or v (VT): acc unscale + b, packed, into the head's K tile [64 keys][32 dims] (sw64)
// at raw + wg KV_BYTES, or transposed into its V^T tile [32 dims][64 keys] (sw128) VT_IN_TILE
// further, 0 on the keys past N (rows r0, r1 from `valid` on). Matrix j of stmatrix u is
// column group n = 2u + j / 2 of the warp's keys + 8 (j % 2); in V^T its rows are the
// dims 8n + row.
template <bool VT>
__device__ __forceinline__ void stage_kv_tile(u32 raw, int wg, const float (&acc)[16], float unscale,
                                              const float2 (&b)[4], int r0, int r1, int valid, int w4, int jm,
                                              int jr) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        u32 w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = 2 * u + j / 2, h = j % 2;
            w[j] = !VT || (h ? r1 : r0) < valid ? pack16(fmaf(acc[4 * n + 2 * h], unscale, b[n].x),
                                                         fmaf(acc[4 * n + 2 * h + 1], unscale, b[n].y))
                                                : 0u;
        }
        if constexpr (VT) {
            const int n = 2 * u + jm / 2, key = 16 * w4 + 8 * (jm % 2);
            stsm_x4_trans(raw + wg * KV_BYTES + VT_IN_TILE + sw128(8 * n + jr, 2 * key), w[0], w[1], w[2], w[3]);
        } else {
            const int n = 2 * u + jm / 2, key = 16 * w4 + 8 * (jm % 2) + jr;
            stsm_x4(raw + wg * KV_BYTES + sw64(key, 16 * n), w[0], w[1], w[2], w[3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
ln_qkvg_project_wgmma_f16(const pair_t* __restrict__ x, i64 sb, i64 si, i64 sj, int B, int N, int H,
                      float eps, const float* __restrict__ gamma_beta,  // [2][D], times a_scale
                      const uint4* __restrict__ w_image,  // W then WB (W_BYTES + WB_BYTES)
                      const float* __restrict__ col_bias,  // [4 D]: bq, bk, bv, bg
                      float q_scale, float unscale,
                      const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi, i64 mj,
                      float* __restrict__ qkvg, unsigned short* __restrict__ bias, int npk,
                      char* __restrict__ vt
                      ROW_BLOCK_ARGS  // (common.cuh ROW_BLOCK: the rows [row_begin, row_end))
                      ) {
    BLOCK_PROLOGUE();
    allow_next_kernel();  // the attention may launch (it waits for this kernel: common.cuh)
    KEY_TILE_RANGE();
    const u32 bar_w = smem_s + OFF_BAR + 16, bar_raw = smem_s + OFF_BAR;  // raw: + 8 stage
    check_block();
    init_barriers(bar_raw);
    for (int e = tid; e < 2 * PD / 4; e += THREADS)
        reinterpret_cast<float4*>(smem + OFF_GB)[e] = ld4(gamma_beta + 4 * e);
    __syncthreads();  // the mbarriers initialised, GB written
    if (warp == 0) {
        if (lane == 0)
            load_weights<W_BYTES + WB_BYTES>(smem_s + OFF_W, reinterpret_cast<const char*>(w_image), bar_w);
        for (int s = 0; s < 2; ++s) {
            const int T = t0 + blockIdx.x + s * gridDim.x;
            if (T < ntiles)
                load_rows(x, sb, si, sj, KeyTile(T, N, nc), smem_s + OFF_RAW + s * RAW_BYTES,
                          bar_raw + 8 * s);
        }
    }

    // This thread's column pairs 32 wg + 8n + 2t (n < 4) of head wg, and their biases.
    const int col0 = NW * wg + 2 * t;
    float2 bq[4], bg[4], bk[4], bv[4];
    load_column_biases(bq, bg, bk, bv, col_bias, col0, q_scale);
    const float uq = unscale * q_scale, ug = -unscale * LOG2E_F;
    const u32 a_tile = smem_s + OFF_A;
    const u32 w_head = smem_s + OFF_W + wg * NW * 128;  // this warpgroup's rows of each pass
    // The K tile rows (keys) this warp writes, 1 KiB, also its staging for q and the gate.
    const u32 k_rows = wg * KV_BYTES + w4 * 1024;
    int k = 0;
    for (int T = t0 + blockIdx.x; T < ntiles; T += gridDim.x, ++k) {
        const int stage = k & 1;
        const KeyTile kt(T, N, nc);
        const u32 raw = smem_s + OFF_RAW + stage * RAW_BYTES;
        char* const raw_g = smem + OFF_RAW + stage * RAW_BYTES;
        const i64 m_first = kt.bi * N + kt.key0;  // qkvg row of the tile's first key
        // This thread's two rows (keys) of the accumulators, and whether the pair bias
        // keeps them.
        const int r0 = 16 * w4 + g, r1 = r0 + 8, rows_left = kt.valid - 16 * w4;
        bool keep0 = r0 < kt.valid, keep1 = r1 < kt.valid;
        if (wg == 0) mask_keeps_rows(keep0, keep1, r0, r1, kt, mask, mask_kind, mb, mi, mj);

        // This warp's 16 rows of 32 packed 16-bit columns w, through its staging, into
        // their qkvg rows from word `word` (q: the head's slot; tiles_bf16's gate: its half).
        auto store_slot = [&](const u32 (&w)[4][2], int word) {
            store_rows16(w, raw + k_rows, raw_g + k_rows, rows_left, [&](int row) {
                return reinterpret_cast<char*>(qkvg + (m_first + 16 * w4 + row) * QKVG_WORDS + word);
            });
        };

        // 1. LayerNorm: RAW -> A.
        mbar_wait(bar_raw + 8 * stage, (k >> 1) & 1);
        layernorm_tile(smem, reinterpret_cast<const pair_t*>(raw_g), kt.valid, eps);
        fence_async_shared();  // A's generic stores, before the tensor cores read it
        __syncthreads();       // A complete; the RAW stage free for the staging
        if (k == 0) mbar_wait(bar_w, 0);
        // The previous tile's stage takes the next tile's rows (wait_stage_reads).
        if (warp == 0 && k > 0) {
            wait_stage_reads();
            const int next = T + gridDim.x;
            if (next < ntiles)
                load_rows(x, sb, si, sj, KeyTile(next, N, nc), smem_s + OFF_RAW + (stage ^ 1) * RAW_BYTES,
                          bar_raw + 8 * (stage ^ 1));
        }

        // 2. Products and epilogues, two passes in flight: pass p's accumulators are
        //    stored while pass p + 1's run.
        float acc0[16], acc1[16], accb[4];
        wgmma_fence();
        product32(acc0, a_tile, w_head + PASS_Q * KBLK * PD * 128, PD * 128);
        product8(accb, a_tile, smem_s + OFF_WB);
        wgmma_commit();
        product32(acc1, a_tile, w_head + PASS_G * KBLK * PD * 128, PD * 128);
        wgmma_commit();

        // q: packed 16-bit into the head's q words (through the staging: 64 bytes a row).
        wgmma_wait<1>();
        pin(acc0);
        pin(accb);
        {
            u32 w[4][2];
            q_words(w, acc0, uq, bq);
            store_slot(w, 32 * wg);
        }
        // the pair bias (warpgroup 0); none with a null bias under ROW_BLOCK (after the bias
        // pass: common.cuh)
        if (wg == 0 && (!ROW_BLOCK || bias != nullptr))
            store_bias_tile_rows(bias, kt, N, H, npk, t, r0, r1, keep0, keep1, accb, unscale);
        wgmma_fence();
        product32(acc0, a_tile, w_head + PASS_K * KBLK * PD * 128, PD * 128);
        wgmma_commit();

        // the gate: fp32 at [D, 2D) (tiles_f16), or packed bf16 at the head's words [32 h +
        // 16, 32 h + 32) (tiles_bf16 and tiles_f16_slots, staged as q).
        wgmma_wait<1>();
        pin(acc1);
        {
            float s[4][4];
            gate_values(s, acc1, ug, bg);
            if constexpr (SLOT_ROWS) {
                u32 w[4][2];
                gate_words(w, s);
                store_slot(w, 32 * wg + 16);
            } else {
                store_gate_f32(qkvg, m_first, QKVG_WORDS, r0, r1, kt.valid, col0,
                               [&](int n, int e) { return s[n][e]; });
            }
        }
        wgmma_fence();
        product32(acc1, a_tile, w_head + PASS_V * KBLK * PD * 128, PD * 128);
        wgmma_commit();

        const int jm = lane >> 3, jr = lane & 7;  // the matrix and row this lane addresses
        // k and v into the head's K and V^T tiles in the stage.
        wgmma_wait<1>();
        pin(acc0);
        stage_kv_tile<false>(raw, wg, acc0, unscale, bk, r0, r1, kt.valid, w4, jm, jr);
        wgmma_wait<0>();
        pin(acc1);
        stage_kv_tile<true>(raw, wg, acc1, unscale, bv, r0, r1, kt.valid, w4, jm, jr);
        // Every head's K and V^T tile complete in the stage, and A's products done: out in
        // one bulk copy each (the stage is refilled after the next tile's LayerNorm).
        fence_async_shared();
        __syncthreads();  // every warp's K and V^T rows staged, every warpgroup's products done
        if (tid == 0) store_head_tiles(vt, kt, H, npk, raw, KV_BYTES, 0, KV_BYTES);
    }
    if (tid == 0) bulk_wait_all();  // the last tile's copies complete before the block ends
}

// ---- gated_out_project_wgmma: out = (g o) Wo^T + bo, 64 rows per tile ----
//
// A qkvg row holds o in 16 bits over each head's first 16 words (attention_wgmma.cu O16:
// dims 2p, 2p + 1 in word 4 (p % 4) + p / 4; tiles_f16: fp16 in v's units, which w_unscale
// undoes) and the gate (tiles_f16: fp32 at [D, 2D); tiles_bf16: bf16 in the head's words
// [32 h + 16, 32 h + 32)). A tile's 64 rows are contiguous: one bulk copy, one tile ahead.
// PARTS threads per row as LayerNorm's (row_piece: piece P holds columns 4P .. 4P + 3 of
// head P / 8). The tile's g o is scaled by its own power of two a, its largest |g o| into
// [2^13, 2^14) (gates near 0 keep their bits: load_gated_tile_f16), and the products are
// undone by w_unscale, then by 1 / a, one after the other (their product may fall below
// fp32's range where each result does not). Warpgroup w computes out's columns [32 w,
// 32 w + 32).
//
// Shared memory: WO [D / 64][D rows][128 B] (Wo in fp16, scaled), A as above, IN [2][64
// rows][QKVG_WORDS words], RED [16] (the warps' largest |g o|), 2 mbarriers.
#define IN_BYTES (ROWS * QKVG_WORDS * 4)
#define WO_BYTES (PD * PD * 2)
#define OFF_WO 0
#define OFF_AO (OFF_WO + WO_BYTES)
#define OFF_IN (OFF_AO + A_BYTES)
#define OFF_RED (OFF_IN + 2 * IN_BYTES)
#define OFF_OBAR (OFF_RED + 64)
#define OUT_TILES_SMEM (OFF_OBAR + 64 + 1024)

// gated_out_projection's steps for the tf32 and bf16 modes: A in fp16, one product (no
// scratch for the steps).
struct OutSteps {
    enum : int { off_bar = OFF_OBAR, off_red = OFF_RED, off_in = OFF_IN, in_bytes = IN_BYTES,
                 row_words = QKVG_WORDS, off_a = OFF_AO, off_wo = OFF_WO };
    struct AScratch {};
    struct Products {};

    // Wo's image into WO (thread 0), one bulk copy.
    static __device__ __forceinline__ void load_wo(u32 smem_s, const uint4* wo_image, u32 bar_w) {
        mbar_arrive_expect(bar_w, WO_BYTES);
        bulk_copy(smem_s + OFF_WO, wo_image, WO_BYTES, bar_w);
    }

    // g o of this thread's pieces of row r of an IN stage (o's dims 4p .. 4p + 3 of a head
    // are its dim pairs 2p, 2p + 1, in words 8 (p % 2) + p / 2 and 4 on), and their largest
    // |g o| (NaN, where a fully masked query's o is, drops out of fmaxf).
    static __device__ __forceinline__ float gated_pieces(float4 (&go)[PD / 32], const char* in_stage, int r,
                                                         int p) {
        const u32* const row = reinterpret_cast<const u32*>(in_stage) + r * QKVG_WORDS;
        float top = 0.f;
#pragma unroll
        for (int j = 0; j < PD / 32; ++j) {
            const int P = row_piece(r, p, j), head = P / 8;
            const u32* const slot = row + 32 * head;
            const u32 o01 = slot[8 * (p % 2) + p / 2], o23 = slot[8 * (p % 2) + p / 2 + 4];
            float4 gate, o;
            if constexpr (SLOT_ROWS) {
                const uint2 gw = *reinterpret_cast<const uint2*>(slot + 16 + 2 * p);
                gate = make_float4(__uint_as_float(gw.x << 16), __uint_as_float(gw.x & 0xffff0000u),
                                   __uint_as_float(gw.y << 16), __uint_as_float(gw.y & 0xffff0000u));
            } else {
                gate = *reinterpret_cast<const float4*>(reinterpret_cast<const float*>(row) + PD + 4 * P);
            }
            if constexpr (TILES_BF16) {
                o = make_float4(__uint_as_float(o01 << 16), __uint_as_float(o01 & 0xffff0000u),
                                __uint_as_float(o23 << 16), __uint_as_float(o23 & 0xffff0000u));
            } else {
                const float2 o0 = half2_to_float2(o01), o1 = half2_to_float2(o23);
                o = make_float4(o0.x, o0.y, o1.x, o1.y);
            }
            go[j] = make_float4(gate.x * o.x, gate.y * o.y, gate.z * o.z, gate.w * o.w);
            top = abs_max4(top, go[j]);
        }
        return top;
    }

    // g o times a (the tile's power of two) into A in fp16, row r's pieces; zero from
    // rows_here on (rows past M, whatever the stage held).
    static __device__ __forceinline__ void write_a(AScratch&, AScratch&, char* smem, const float4 (&go)[PD / 32],
                                                   float a, int r, int p, int rows_here) {
#pragma unroll
        for (int j = 0; j < PD / 32; ++j) {
            uint2 h = make_uint2(0u, 0u);
            if (r < rows_here)
                h = make_uint2(pack_f16(go[j].x * a, go[j].y * a), pack_f16(go[j].z * a, go[j].w * a));
            *reinterpret_cast<uint2*>(smem + OFF_AO + a_offset(r, 4 * row_piece(r, p, j))) = h;
        }
    }

    // acc = A Wo^T (this warpgroup's rows of Wo at wo_rows), waited for.
    static __device__ __forceinline__ void product(Products&, float (&acc)[16], u32 a_tile, u32 wo_rows) {
        wgmma_fence();
        product32(acc, a_tile, wo_rows, PD * 128);
        wgmma_commit();
        wgmma_wait<0>();
        pin(acc);
    }
};

extern "C" __global__ void __launch_bounds__(THREADS, 1)
gated_out_project_wgmma_f16(const float* __restrict__ qkvg, i64 M,
                        const uint4* __restrict__ wo_image,  // WO_BYTES
                        const float* __restrict__ b_out, pair_t* __restrict__ out,
                        float w_unscale
                        OUT_TRANSPOSED_ARGS  // the pair's N: rows go to caller_row (common.cuh)
                        ) {
    gated_out_projection<OutSteps>(qkvg, M, wo_image, b_out, out, w_unscale, OUT_N);
}
