// The attention of attention_mma.cu on Hopper's warpgroup products (wgmma, sm_90a;
// wgmma.cuh), head dim 32, reading the tiled layouts: the same computation, outputs and
// edge cases. For every row (b, i), head h and query j (q and bias pre-scaled by log2 e):
//
//   s[k]         = q[b,i,j,h] . k[b,i,k,h] + bias[b,h,j,k]    # bias = -inf where masked
//   o[b,i,j,h]   = sum_k 2^(s[k] - max s) v[b,i,k,h] / sum_k 2^(s[k] - max s)
//
// Why: mma.sync keeps each warp issuing its own small products and waiting on them (at
// N = 1024 its TF32 kernel reaches ~27% of the TF32 ceiling, its warps stalled on shared
// memory and on the tensor cores' latency). A wgmma multiplies a 64-query tile by a whole
// key tile in one instruction, reads K and V from shared memory itself, and runs while
// the warps go on.
//
// Work split: a block owns ROWS pair rows i (of one batch b) and BQ = 128 queries of one
// head; each row has 2 warpgroups of 64 queries. Per key tile of BK = 64 keys and
// warpgroup: S (64 x 64) = bias + Q K^T, the online softmax of S in registers (as
// attention_mma.cu, lazy rescaling), and [O | l] (64 x 40) += P [V | 1 | 0] with P
// straight from S's registers and a column of ones appended to V, so that the row sums l
// come out of the same product, from the same rounded P, as O's numerator.
// BF16 (attention_wgmma_bf16): Q packed bf16 (the projection stores q so), written
// once to a shared-memory tile that S's products read by descriptor (Q_SHARED), 2 wgmma
// m64n64k16 for S and 4 m64n40k16 for P V, P rounded to bf16 as it is
// exponentiated; the projection writes K tiles [64 keys][32 dims] bf16 in the 64-byte
// swizzle and V^T tiles [32 dims][64 keys] bf16, one 128-byte row per dim, keys in their own
// order (a bf16 A fragment takes S's columns in order: tiles_bf16); fp32 softmax and O.
// F16X3 (attention_wgmma_f16x3, the fp32 mode): every operand a = hi + lo in fp16, hi =
// rn(a), lo = rn(a - hi): 22 bits where lo is normal, as 3xTF32's, at twice the rate of
// TF32 products (fp16 wgmma runs at bf16's rate). fp16's range is narrow, so the
// projection scales q, k and v by powers of two that keep every value below 2^14 (a bound
// from the weights: DeviceWeights.f16x3_scales) and the kernel undoes them: S = (Q_hi K_lo
// + Q_lo K_hi + Q_hi K_hi) qk_unscale + bias (12 wgmma, small terms first) from zero, the
// bias held as fp16 hi and lo tiles (hi + lo, exact in fp32) and added in fp32 after; P =
// 2^(S - m + P_SHIFT) (at most 2^(8 + 6): P's lo parts stay normal down to P ~ 2^-9)
// split as exponentiated, and [O | l] += P_hi V_lo + P_lo V_hi + P_hi V_hi into
// PV_GROUPS fresh accumulators per tile, each added to O in fp32 (the tensor cores'
// accumulation truncates, so its chains are kept short); o = O v_unscale / l (P_SHIFT
// cancels). The projection writes per (b, i, head, 64 keys) 16 KiB: the K hi and lo tiles
// as tiles_bf16's K tile, then the V^T hi and lo tiles as its V^T tile (tiles_f16_hilo);
// qkvg rows of 2D words, q's 16 hi then 16 lo words of packed fp16 per head where its o
// goes, the gate after; the bias as fp16 hi and lo tiles, 32 KiB per tile.
// F16X1 (attention_wgmma_f16, the tf32 mode): F16X3 with the hi parts alone, one product
// each: fp16 keeps TF32's 11 significant bits, so q, k, v and P scaled into its range
// lose no more than TF32's roundings, at bf16's rate and bytes. As BF16's: S = bias + Q K^T
// (2 wgmma m64n64k16 onto the fp16 bias tile, Q from shared memory), but in units of c =
// s_q s_k (the projection stores the bias times c: DeviceWeights.qkv_scales), which the
// exponent's FFMA takes back out (qk_unscale = 1 / c): P = 2^((S - m) / c + P_SHIFT);
// [O | l] += P V in 4 wgmma m64n40k16 straight into O; the projection writes tiles_bf16's
// tiles in fp16, q's 16 fp16 words per head where its o goes (tiles_f16).
// S16 (attention_wgmma_f16s, F16X1 for the bf16 mode): the same inputs (tiles_f16, or
// SLOT_ROWS tiles_f16_slots, scaled by gpu/scales.py f16s_scales so that |bias| + |q . k|
// <= 2^15 in S's units c = s_q s_k, c >= 1), S = bias + Q K^T in fp16 accumulators (wgmma
// .f16.f16.f16): the bias tile's fp16 pairs are the accumulator's start as loaded, the row
// maxima and the exponent run on fp16 pairs (P = 2^x, x = S / c + P16_SHIFT - m / c in one
// fma.rn.f16x2, ex2.approx.f16x2), and P comes out packed as P V's A fragment; [O | l] +=
// P V stays fp32. S keeps fp16's 11 bits (PyTorch's bf16 S keeps 8); x rounds to fp16
// (half an ulp 2^-11..2^-10 where P is largest), ex2.approx.f16's own error is ~2^-10
// relative. ~154 instructions per warp and 64-key tile against F16X1's ~227.
// P's register layout fixes which key each V^T position holds: within each 8 keys of a
// 16-bit tile, keys in order (a 16-bit A fragment takes S's columns in order).
//
// Shared memory, all parts 1024-byte aligned (wgmma.cuh), STAGES x
//   ROWS x K tile [BK][32] 16-bit, 4 KiB, 64-byte swizzle (F16X3: its hi then its lo tile)
//   ROWS x V^T tile: one column of 64 keys, [d + 8 rows][64 keys] 16-bit (row d is ones,
//     d + 1 .. d + 7 zeros: written once, never copied over; F16X3: the hi column then the
//     lo column, its ones row zero)
//   the bias tile [BQ][BK] fp16 with rows in the 128-byte swizzle, as the projection
//     writes it (conflict-free unpadded; F16X3: the hi tile then the lo tile)
// filled by warp 0 with bulk copies, one per K tile, V^T column and bias tile, paced by
// the mbarriers full[STAGES] and empty[STAGES] after the stages (no barrier in the loop).
//
// Launch: grid ceil(N/BQ) * ceil(N/ROWS) * H * B, flattened (attention_block); block
// THREADS = 256 ROWS; dynamic shared memory SMEM_BYTES (triattn_cupy/gpu/tiles.py mirrors
// it). Pointers: qkvg [B*N*N, ...] (q only;
// BF16: rows of D words, q's packed bf16 words per head at [32 h, 32 h + 16), tiles_bf16;
// F16X1: rows of 2D words, q's fp16 words per head at [32 h, 32 h + 16), tiles_f16;
// F16X3: rows of 2D words, q's hi and lo per head at [32 h, 32 h + 32), tiles_f16_hilo), o
// written over [0, D) of each row (O16: packed bf16 or fp16 over [32 h, 32 h + 16) per
// head, where BF16's and F16X1's q was);
// bias: the tiles of project_epilogue.cuh bias_element, NPK a multiple of BK, -inf on the
// padded keys; vt: per (b, i, head, 64 keys) the K tile then the V^T tile (BF16, F16X1:
// 8 KiB; F16X3: 16 KiB, K hi, K lo, V^T hi, V^T lo), zero past key N in V^T; F16X3, F16X1:
// qk_unscale = 1 / (s_q s_k) and v_unscale = 1 / s_v, the projection's scales undone
// (F16X1's o stays in v's units: the out projection undoes s_v); key_extent [B]
// (key_extent.cu) or null: the key loop stops at the tile holding key key_extent[b] - 1
// (visited_keys).
#include "common.cuh"
#include "wgmma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 32     // d: one swizzle row of K per key
#endif
#ifndef ROWS
#define ROWS 1          // pair rows per block (1 or 2), sharing the bias tiles
#endif
#ifndef STAGES
#define STAGES 2        // key tiles in the ring of bulk copies
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2    // __launch_bounds__ occupancy hint
#endif
#ifndef PV_GROUPS
#define PV_GROUPS 2     // F16X3: fresh P V accumulators per key tile (1, 2 or 4)
#endif
#ifndef BF16
#define BF16 0          // 1: bf16 operands (attention_wgmma_bf16; tiles_bf16)
#endif
#ifndef F16X3
#define F16X3 0         // 1: fp16 hi + lo operands (attention_wgmma_f16x3; tiles_f16_hilo)
#endif
#ifndef F16X1
#define F16X1 0         // 1: fp16 operands, one product (attention_wgmma_f16; tiles_f16)
#endif
#ifndef S16
#define S16 0           // F16X1 with S in fp16 accumulators (attention_wgmma_f16s; the bf16 mode's option)
#endif
#ifndef SLOT_ROWS
#define SLOT_ROWS 0     // F16X1: qkvg rows of D words, q and the gate in each head's slot (tiles_f16_slots), not 2D
#endif
#ifndef P16_SHIFT
#define P16_SHIFT 2.f   // S16: P = 2^((S - m) / c + P16_SHIFT), at most 2^(RESCALE_SLACK + 2)
#endif
#define F16 (F16X3 || F16X1)  // fp16 operands, scaled by the projection (qk_unscale, v_unscale)
// Q K^T with Q from shared memory (both operands by descriptor; BF16, F16X1): Q's 8
// registers of A fragments, held for the whole key loop, pushed the 80-register kernels
// (3 blocks per SM) into spills and made ptxas serialize their wgmmas.
#define Q_SHARED (BF16 || F16X1)
// o in 16 bits (BF16: bf16; F16X1: fp16 in v's units, which the out projection undoes) in
// the first 16 words of the head's o slot (F16X1: where its q was; project_epilogue.cuh
// O16): the out projection rounds g o to 16 bits for its products anyway, and this halves
// o's bytes each way.
#define O16 (BF16 || F16X1)
#if O16
static_assert(HEAD_DIM == 32, "O16: a lane's o values of a row are one 16-byte store");
#endif

#define BK 64                          // keys per tile
#define ROW_GROUPS 2                   // warpgroups per row
#define BQ (64 * ROW_GROUPS)           // queries per row and block
#define THREADS (128 * ROW_GROUPS * ROWS)
#define NT (BK / 8)                    // 8-key column groups of S
#define DT (HEAD_DIM / 8)              // 8-dim column groups of O
#define ON (HEAD_DIM + 8)              // columns of [O | l]: d, the row sum, 7 zeros
#define RESCALE_SLACK 8.f              // as attention_mma.cu

#if HEAD_DIM != 32
#error "attention_wgmma.cu: HEAD_DIM must be 32 (one swizzle row of K per key)"
#endif
#if BF16 + F16X3 + F16X1 != 1
#error "attention_wgmma.cu: exactly one of BF16, F16X3 and F16X1"
#endif
#define P_SHIFT 6.f  // F16: P scaled by 2^6 (at most 2^(RESCALE_SLACK + 6), inside fp16)
#if S16 && !F16X1
#error "attention_wgmma.cu: S16 is an option of F16X1"
#endif

#if ROWS != 1 && ROWS != 2
#error "attention_wgmma.cu: ROWS must be 1 or 2"
#endif

#define K_ROW 64                          // bytes per key of a K tile: 32 16-bit dims
#define K_PART (BK * K_ROW)               // bytes of one K tile (F16X3: hi, then lo)
#define K_TILE ((1 + F16X3) * K_PART)     // bytes
// V^T columns per tile: rows of 128 bytes of keys (F16X3: the hi column, then the lo)
#define VT_COLUMNS (F16X3 ? 2 : 1)
#define VT_COLUMN (ON * 128)              // one column of V^T: 64 16-bit keys
#define VT_TILE (VT_COLUMNS * VT_COLUMN)
#define VT_COPIED (VT_COLUMNS * HEAD_DIM * 128)  // bytes of a V^T tile the projection wrote
typedef unsigned short bias_elem;  // fp16 bits (F16X3: the hi tile, then the lo)
#if BF16
#define ENTRY attention_wgmma_bf16
#elif F16X3
#define ENTRY attention_wgmma_f16x3
#elif S16
#define ENTRY attention_wgmma_f16s
#else
#define ENTRY attention_wgmma_f16
#endif
#define BIAS_PART (BQ * BK * 2)
#define BIAS_TILE ((1 + F16X3) * BIAS_PART)  // F16X3: the hi part, then the lo
#define VT_OFFSET (ROWS * K_TILE)         // in a stage
#define BIAS_OFFSET (ROWS * (K_TILE + VT_TILE))
#define STAGE_BYTES (BIAS_OFFSET + BIAS_TILE)
// Then the mbarriers full[STAGES], empty[STAGES]; + 1024: the dynamic shared memory
// is aligned up to 1024 bytes at run time
// Q_SHARED: then (from the next 1024 bytes) each warpgroup's Q tile [64 queries][32 dims],
// 16-bit, in the 64-byte swizzle (K's layout), 4 KiB.
#define Q_OFFSET (STAGES * STAGE_BYTES + 1024)
#define Q_TILE (64 * HEAD_DIM * 2)  // bytes
#define SMEM_BYTES (Q_SHARED ? Q_OFFSET + 2 * ROWS * Q_TILE + 1024 \
                             : STAGES * STAGE_BYTES + 16 * STAGES + 1024)
// ROW_MASK: the block's rows' key bits, ROWS x npk / 32 words, after the rest (the launch
// adds ROWS npk / 8 bytes: gpu/plan.py); from the aligned base, whose 1024 bytes of slack
// SMEM_BYTES counts
#define ROW_MASK_OFFSET (SMEM_BYTES - 1024)

#if BIAS_TILE % 1024 != 0 || VT_COLUMN % 1024 != 0
#error "attention_wgmma.cu: the tile shapes must give whole copies and 1024-byte parts"
#endif
#if PV_GROUPS != 1 && PV_GROUPS != 2 && PV_GROUPS != 4
#error "attention_wgmma.cu: PV_GROUPS must be 1, 2 or 4"
#endif
#define KV_TILES (K_TILE + VT_COPIED)  // bytes per (b, i, head, 64 keys): K's tile, then V^T's

// S of one key tile, in wgmma's accumulator layout (wgmma.cuh): fp32, or S16's fp16 pairs
// (issue_scores)
#if S16
typedef u32 Scores[2 * NT];
#else
typedef float Scores[4 * NT];
#endif

// The entry's arguments which only some variants take, as values every variant can pass
// to the steps (the others read none): the F16 variants' scales
#if F16
#define QK_UNSCALE qk_unscale
#define V_UNSCALE v_unscale
#else
#define QK_UNSCALE 1.f
#define V_UNSCALE 1.f
#endif
// ROW_MASK's key bits, null for the others
#if ROW_MASK
#define ROW_MASK_BITS row_mask
#else
#define ROW_MASK_BITS nullptr
#endif

// d += a_hi b_lo + a_lo b_hi + a_hi b_hi over the k-steps kk in [k0, k1), small terms
// first (F16X3): product(d, a, kk, lo, first) issues k-step kk's wgmma of A
// fragment a against B's lo (or hi) part; `first` for the first of the chain (which may
// overwrite d instead of adding to it). (A function, not a generic lambda: the NVRTC of
// CUDA 13.0 takes a lambda with auto parameters for a host function.)
template <class Acc, class Frags, class Product>
__device__ __forceinline__ void three_terms(Acc& d, const Frags& ah, const Frags& al, int k0,
                                            int k1, Product product) {
#pragma unroll
    for (int kk = k0; kk < k1; ++kk) product(d, ah[kk], kk, true, kk == k0);
#pragma unroll
    for (int kk = k0; kk < k1; ++kk) product(d, al[kk], kk, false, false);
#pragma unroll
    for (int kk = k0; kk < k1; ++kk) product(d, ah[kk], kk, false, false);
}

#define BF16_ONES 0x3f803f80u  // two bf16 ones
#define F16_ONES 0x3c003c00u   // two fp16 ones

// ---- the steps of one warp (warpgroup wg, row rw, queries q0 .. q0 + 15) ----

// Q's A fragments (zero past N), per 16-dim k-step: packed 16-bit pairs as the projection
// stored them, the head's 16 words where its o goes (F16X3: hi, then the 16 lo words in ql).
__device__ __forceinline__ void load_queries(u32 (&qa)[HEAD_DIM / 16][4], u32 (&ql)[HEAD_DIM / 16][4],
                                             const float* row, int q0, bool row_ok, int N,
                                             i64 ld, int g, int t) {
    const int j0 = q0 + g, j1 = j0 + 8;
    const bool ok0 = row_ok && j0 < N, ok1 = row_ok && j1 < N;
    const u32* const q_packed = reinterpret_cast<const u32*>(row);
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {  // dims 16kk + 2t, +1 in word 8kk + t
        const int w = 8 * kk + t;
        qa[kk][0] = ok0 ? q_packed[(i64)j0 * ld + w] : 0u;
        qa[kk][1] = ok1 ? q_packed[(i64)j1 * ld + w] : 0u;
        qa[kk][2] = ok0 ? q_packed[(i64)j0 * ld + w + 4] : 0u;
        qa[kk][3] = ok1 ? q_packed[(i64)j1 * ld + w + 4] : 0u;
        if constexpr (F16X3) {
            const u32* const q_lo = q_packed + HEAD_DIM / 2;
            ql[kk][0] = ok0 ? q_lo[(i64)j0 * ld + w] : 0u;
            ql[kk][1] = ok1 ? q_lo[(i64)j1 * ld + w] : 0u;
            ql[kk][2] = ok0 ? q_lo[(i64)j0 * ld + w + 4] : 0u;
            ql[kk][3] = ok1 ? q_lo[(i64)j1 * ld + w + 4] : 0u;
        }
    }
}

// Q_SHARED: this warp's 16 rows of its warpgroup's Q tile, once: fragment word e of k-step
// kk holds row g (+ 8 for e odd), bytes 32 kk + 4t (+ 16 for e >= 2). Published to the
// tensor cores by the fence and barrier before the key loop.
__device__ __forceinline__ void store_q_tile(char* smem, const u32 (&qa)[HEAD_DIM / 16][4],
                                             int wg, int warp, int g, int t) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            *reinterpret_cast<u32*>(smem + Q_OFFSET + wg * Q_TILE
                                    + sw64(16 * (warp % 4) + g + 8 * (e & 1),
                                           32 * kk + 4 * t + 16 * (e >> 1))) = qa[kk][e];
}

// The ones row (d) and zero rows (d + 1 .. d + 7) of every V^T column, once (F16X3: the
// same rows of the lo columns all zero: the ones are hi parts).
__device__ __forceinline__ void write_ones_rows(char* smem, int tid) {
    for (int idx = tid; idx < STAGES * ROWS * VT_COLUMNS * 8 * 32; idx += THREADS) {
        const int k32 = idx % 32, n = HEAD_DIM + (idx / 32) % 8, column = idx / 256;
        const int stage = column / (ROWS * VT_COLUMNS), in_stage = column % (ROWS * VT_COLUMNS);
        const u32 one = BF16 ? BF16_ONES : F16X3 && in_stage % 2 ? 0u : F16_ONES;
        *reinterpret_cast<u32*>(smem + stage * STAGE_BYTES + VT_OFFSET + in_stage * VT_COLUMN
                                + sw128(n, 4 * k32)) = n == HEAD_DIM ? one : 0u;
    }
}

// Key 8n + 2t + (e & 1) of row g + 8 (e >> 1) of S masked: -inf in S's register 4n + e
// (fp32), or in half e & 1 of register 2n + (e >> 1) (S16's fp16 pairs: 0xfc00).
__device__ __forceinline__ void set_key_neg_inf(float (&s)[4 * NT], int n, int e) {
    s[4 * n + e] = neg_inf();
}
__device__ __forceinline__ void set_key_neg_inf(u32 (&s)[2 * NT], int n, int e) {
    u32& w = s[2 * n + (e >> 1)];
    w = e & 1 ? (w & 0xffffu) | 0xfc000000u : (w & 0xffff0000u) | 0xfc00u;
}

// ROW_MASK: keys masked for every query of this warp's row i get -inf in S, as a masked
// bias entry (applied to S's start, the bias, before the products accumulate onto it:
// fewer registers live than after them, where the 80-register kernels spilled; F16X3:
// after add_bias). The tile's 64 keys (k0 a multiple of BK = 64) are words k0 / 32 and
// k0 / 32 + 1 of the row's bits; S's register 4n + e (S16: half e & 1 of register 2n + e /
// 2) holds key 8n + 2t + (e & 1). The words come from the block's copy of its rows' bits
// in shared memory (ROW_MASK_OFFSET, filled before the key loop): read from global memory,
// the row's 64-bit pointer stayed live through the loop and spilled the 80-register
// kernels, which then ran 2 blocks per SM instead of 3. A tile whose 64 keys are all kept
// (every tile of a padding mask's kept rows) skips the selects: the branch is
// warp-uniform, a warp's queries sharing their row.
template <class S>
__device__ __forceinline__ void mask_row_keys(S& s, const char* smem, int rw, int npk, int k0,
                                              int t) {
    const uint2 words = *reinterpret_cast<const uint2*>(
        smem + ROW_MASK_OFFSET + 4 * (rw * (npk / 32) + (k0 >> 5)));
    const unsigned w0 = words.x, w1 = words.y;
    if ((w0 & w1) == 0xffffffffu) return;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int kl = 8 * n + 2 * t + (e & 1);  // (n < NT / 2: in word w0)
            if (!((((n < NT / 2) ? w0 : w1) >> (kl & 31)) & 1u)) set_key_neg_inf(s, n, e);
        }
}

// Keys past N of the last tile (at k0): -inf in S, their K rows were never written (may be
// NaN).
template <class S>
__device__ __forceinline__ void mask_keys_past_n(S& s, int k0, int N, int t) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (k0 + 8 * n + 2 * t + (e & 1) >= N) set_key_neg_inf(s, n, e);
}

// ---- S = bias + Q K^T of the key tile in ring stage `stage` ----

// This lane's ldmatrix address in stage 0's bias tile, for bias_pairs (S16: for
// issue_scores' accumulator start). One ldmatrix.x4 per two bias pairs (its 8x8 matrices of
// 16-bit elements are the pairs' fragment layout: lane l gets row l / 4, elements 2 (l % 4),
// + 1): lane L names row (L & 7) + 8 (L >> 4) of the warp's 16 and chunk c = (L >> 3) & 1 of
// two, stored at chunk c ^ (row % 8) of the swizzled tile; the stage and row offsets leave
// bits 4-6 (the chunk) clear, so chunks 2j + c are the same address XOR 32 j. (16 scalar
// loads and their ~20 address instructions per tile otherwise: ptxas.)
// S16: its lanes name the matrices in the accumulator's order (matrix q: rows g + 8 (q &
// 1), chunk q >> 1; lane L names row (L & 7) + 8 ((L >> 3) & 1), chunk L >> 4), so that
// each ldmatrix writes s[4j .. 4j + 3] directly (in bias_pairs' order ptxas moved all 16
// registers into place: 16 more instructions per tile).
__device__ __forceinline__ u32 bias_lane_address(u32 bias_tile, int q_in_tile, int lane) {
    if constexpr (S16)
        return bias_tile + (q_in_tile + (lane & 7) + 8 * ((lane >> 3) & 1)) * 128
               + 16 * ((lane >> 4) ^ (lane & 7));
    else
        return bias_tile + (q_in_tile + (lane & 7) + 8 * (lane >> 4)) * 128
               + 16 * (((lane >> 3) & 1) ^ (lane & 7));
}

// This lane's bias pairs (rows g, g + 8; keys 8n + 2t, + 1) as fp16 pairs: r[0], r[1]
// pairs 2j, 2j + 1 of row g and r[2], r[3] those of row g + 8, of the tile in `stage`
// (F16X3: part 1 its lo tile). bias_rows: bias_lane_address.
__device__ __forceinline__ void bias_pairs(u32 (&r)[4], u32 bias_rows, int stage, int j,
                                           int part) {
    ldsm_x4(r, ((bias_rows + stage * STAGE_BYTES) ^ (32 * j)) + part * BIAS_PART);
}
// Where bias_pairs' r[q] goes in S (pairs 2j, 2j + 1 of rows g, g + 8): s[8j + slot(q)], + 1
__device__ __forceinline__ int pair_slot(int q) { return 4 * (q & 1) + 2 * (q >> 1); }

// The scores' arguments after S and its stage, as the key loop holds them: bias_rows
// (bias_lane_address), the aligned shared memory's address and pointer, the warpgroup's Q
// tile (Q_SHARED) or Q's A fragments qa (F16X3: hi, ql lo), row rw of the block, npk, the
// tile's first key k0 and t = lane & 3 (ROW_MASK).
#define SCORE_ARGS u32 bias_rows, u32 smem_s, u32 q_tile,                              \
                   const u32 (&qa)[HEAD_DIM / 16][4], const u32 (&ql)[HEAD_DIM / 16][4], \
                   const char* smem, int rw, int npk, int k0, int t

// S16: S = bias + Q K^T issued (not waited for) in fp16 accumulators
// (wgmma_m64n64k16_f16acc_ss), 16 registers of pairs: s[2n] row g, s[2n + 1] row g + 8,
// columns 8n + 2t, + 1. The bias tile's fp16 pairs start the accumulator as they are, no
// conversions (bias_lane_address' S16 order). Every partial sum stays inside fp16: |bias| +
// |q . k| <= S16_TOP in S's units by the scales' bound (gpu/scales.py f16s_scales), and a
// partial dot product is bounded as the whole one. ROW_MASK: the row's masked keys set to
// -inf in the bias first.
__device__ __forceinline__ void issue_scores(u32 (&s)[2 * NT], int stage, SCORE_ARGS) {
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
        u32 r[4];
        ldsm_x4(r, (bias_rows + stage * STAGE_BYTES) ^ (32 * j));
        s[4 * j] = r[0], s[4 * j + 1] = r[1], s[4 * j + 2] = r[2], s[4 * j + 3] = r[3];
    }
    if constexpr (ROW_MASK) mask_row_keys(s, smem, rw, npk, k0, t);
    const u64 k_desc = sw64_desc(smem_s + stage * STAGE_BYTES + rw * K_TILE);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        wgmma_m64n64k16_f16acc_ss(s, sw64_desc(q_tile) + 2 * kk, k_desc + 2 * kk);
    wgmma_commit();
}

// The same in fp32 accumulators (wgmma.cuh's layout), issued. BF16, F16X1: S starts as the
// bias tile (F16X1's holds bias s_q s_k, S's units), ROW_MASK's masked keys set to -inf in
// it, and the products (Q from shared memory, Q_SHARED) accumulate onto it (as
// attention_mma_tf32). F16X3: the first product overwrites S, small terms first
// (three_terms); the bias is added in fp32 after the wait (add_bias).
__device__ __forceinline__ void issue_scores(float (&s)[4 * NT], int stage, SCORE_ARGS) {
    if constexpr (F16X3) {
        const u32 k_tile = smem_s + stage * STAGE_BYTES + rw * K_TILE;
        const u64 k_desc = sw64_desc(k_tile), k_lo_desc = sw64_desc(k_tile + K_PART);
        wgmma_fence();
        three_terms(s, qa, ql, 0, HEAD_DIM / 16,
                    [&](float (&d)[4 * NT], const u32 (&a)[4], int kk, bool lo, bool first) {
            if (first)
                wgmma_m64n64k16_f16_first(d, a, (lo ? k_lo_desc : k_desc) + 2 * kk);
            else
                wgmma_m64n64k16_f16(d, a, (lo ? k_lo_desc : k_desc) + 2 * kk);
        });
    } else {
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            u32 r[4];
            bias_pairs(r, bias_rows, stage, j, 0);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 x = half2_to_float2(r[q]);
                s[8 * j + pair_slot(q)] = x.x, s[8 * j + pair_slot(q) + 1] = x.y;
            }
        }
        if constexpr (ROW_MASK) mask_row_keys(s, smem, rw, npk, k0, t);
        const u64 k_desc = sw64_desc(smem_s + stage * STAGE_BYTES + rw * K_TILE);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            if constexpr (F16X1)
                wgmma_m64n64k16_f16_ss(s, sw64_desc(q_tile) + 2 * kk, k_desc + 2 * kk);
            else
                wgmma_m64n64k16_bf16_ss(s, sw64_desc(q_tile) + 2 * kk, k_desc + 2 * kk);
        }
    }
    wgmma_commit();
}

// F16X3: S = products qk_unscale + bias, once the products are done: the bias's hi and lo
// tiles summed (exact in fp32; -inf + 0 where masked).
__device__ __forceinline__ void add_bias(float (&s)[4 * NT], int stage, u32 bias_rows,
                                         float qk_unscale) {
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
        u32 hi[4], lo[4];
        bias_pairs(hi, bias_rows, stage, j, 0);
        bias_pairs(lo, bias_rows, stage, j, 1);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 h = half2_to_float2(hi[q]), l = half2_to_float2(lo[q]);
            const float2 b = make_float2(h.x + l.x, h.y + l.y);
            float* const at = s + 8 * j + pair_slot(q);
            at[0] = fmaf(at[0], qk_unscale, b.x);
            at[1] = fmaf(at[1], qk_unscale, b.y);
        }
    }
}

// Once S's products are done: S and O pinned after the wait (wgmma.cuh pin); F16X3: the
// bias added (add_bias) and ROW_MASK's masked keys set to -inf after it (the other variants
// mask in issue_scores); keys past N of the last tile masked.
template <class S>
__device__ __forceinline__ void finish_scores(S& s, float (&o)[4 * ON / 8], int stage,
                                              u32 bias_rows, float qk_unscale, const char* smem,
                                              int rw, int npk, int k0, int N, int t) {
    pin(s);
    pin(o);
    if constexpr (F16X3) {
        add_bias(s, stage, bias_rows, qk_unscale);
        if constexpr (ROW_MASK) mask_row_keys(s, smem, rw, npk, k0, t);
    }
    if (k0 + BK > N) mask_keys_past_n(s, k0, N, t);
}

// ---- the online softmax of S (its product done), in two parts ----
// rescale: the reference maximum m of rows g and g + 8 (m_sub; m_lim = m + RESCALE_SLACK,
// the bound past which it moves) moves, lazily as attention_mma.cu, and O is rescaled with
// it. exponentiate: P = 2^(S - m) as the A fragments of the k-steps of P V.
// F16X1: S is in units of s_q s_k (log2): log2_per_s converts it back (exact, a power of
// two; s_per_log2 its inverse), folded into the exponent's FFMA (in place of its FADD).
// The state (o, m_sub, m_lim; S16's ms2, msf) is the key loop's, updated in place.
#define SOFTMAX_ARGS float (&o)[4 * ON / 8], float (&m_sub)[2], float (&m_lim)[2], \
                     float log2_per_s, float s_per_log2, u32 (&ms2)[2], float (&msf)[2]
// exponentiate's after S: P's A fragments pa (F16X3: hi, pl lo) and the state it reads
#define EXPONENT_ARGS u32 (&pa)[NT / 2][4], u32 (&pl)[NT / 2][4], const float (&m_sub)[2], \
                      float log2_per_s, u32 inv_c2, const u32 (&ms2)[2]

// The maximum of two fp16 pairs, pair by pair (S16)
__device__ __forceinline__ u32 hmax2(u32 a, u32 b) {
    u32 d;
    asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// S16: the same on S's fp16 pairs. The maximum: a max.f16x2 tree over each row's 8
// pairs (S's values, exact), its two candidates per row paired across the rows by two
// byte permutes and one more max; compared in fp32 with m_lim (fp32, S's units, as
// F16X1's). P = 2^x, x = S / c + ms[r] in one fma.rn.f16x2 per pair (S / c exact, one
// rounding), ex2.approx.f16x2 giving P already packed as P V's A fragment (register
// 4kk + e of S is word e of k-step kk's fragment). ms[r] = P16_SHIFT - m_sub / c rounded
// to fp16 once per move of m (ms2; msf the same in fp32, exact), and O's rescale factor
// taken from the rounded offsets (2^(ms_new - ms_old)), so all of a row's P share one
// reference exactly however ms rounded; x <= RESCALE_SLACK + P16_SHIFT (+ that rounding):
// P <= ~2^10. fp16 keeps x's rounding small where P is large: half an ulp of x at the
// row's largest keys (x near P16_SHIFT = 2) is 2^-11..2^-10 (P16_SHIFT 6, F16X1's, would
// put them in [4, 8): 2^-9), under ex2.approx.f16's own error; P below 2^-14 is subnormal
// (x < -14, keys 2^16 below the row's largest: negligible in the sum). Masked keys: S =
// -inf, x = -inf, P = 0; rows with every key so far masked keep m_sub 0, ms P16_SHIFT
// (finite: no -inf - (-inf)). ms cannot overflow: |m_sub / c| <= the scores' bound <= 2^15
// (c >= 1, gpu/scales.py f16s_scales).
__device__ __forceinline__ void rescale(const u32 (&s)[2 * NT], SOFTMAX_ARGS) {
    u32 a = s[0], b = s[1];  // rows g, g + 8
#pragma unroll
    for (int n = 1; n < NT; ++n) a = hmax2(a, s[2 * n]), b = hmax2(b, s[2 * n + 1]);
    // (a.lo, b.lo) against (a.hi, b.hi): the two rows' maxima in one pair
    const float2 mx = half2_to_float2(hmax2(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632)));
    const bool grow = mx.x > m_lim[0] || mx.y > m_lim[1];
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float x = r ? mx.y : mx.x;
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
            const float m_old = m_lim[r] == neg_inf() ? neg_inf() : m_sub[r];
            const float m_new = fmaxf(m_old, x);
            m_sub[r] = m_new == neg_inf() ? 0.f : m_new;
            m_lim[r] = m_new + RESCALE_SLACK * s_per_log2;
            ms2[r] = pack_f16(P16_SHIFT - m_sub[r] * log2_per_s, P16_SHIFT - m_sub[r] * log2_per_s);
            const float ms_new = half2_to_float2(ms2[r]).x;
            // (m_old -inf: O and l are still 0, and ms_new - msf may be large)
            const float alpha = m_old == neg_inf() ? 0.f : fast_exp2(ms_new - msf[r]);
            msf[r] = ms_new;
#pragma unroll
            for (int v = 0; v < ON / 8; ++v) {
                o[4 * v + 2 * r] *= alpha;
                o[4 * v + 2 * r + 1] *= alpha;
            }
        }
    }
}
__device__ __forceinline__ void exponentiate(const u32 (&s)[2 * NT], EXPONENT_ARGS) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // row e & 1
            u32 x;
            asm("fma.rn.f16x2 %0, %1, %2, %3;"
                : "=r"(x) : "r"(s[4 * kk + e]), "r"(inv_c2), "r"(ms2[e & 1]));
            asm("ex2.approx.f16x2 %0, %1;" : "=r"(pa[kk][e]) : "r"(x));
        }
}

// fp32 S: each row's maximum over its 16 values in this lane (two chains), then over the
// row's 4 lanes.
__device__ __forceinline__ void rescale(const float (&s)[4 * NT], SOFTMAX_ARGS) {
    float mx[2];
    bool grow = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rows g (r = 0: s[4n + 0..1]) and g + 8 (r = 1)
        float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            mx0 = fmaxf(mx0, s[4 * n + 2 * r]);
            mx1 = fmaxf(mx1, s[4 * n + 2 * r + 1]);
        }
        mx[r] = fmaxf(mx0, mx1);
        grow |= mx[r] > m_lim[r];
    }
    if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float x = mx[r];
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
            const float m_old = m_lim[r] == neg_inf() ? neg_inf() : m_sub[r];
            const float m_new = fmaxf(m_old, x);
            const float alpha = m_new == neg_inf() ? 1.f : fast_exp2((m_old - m_new) * log2_per_s);
            m_sub[r] = m_new == neg_inf() ? 0.f : m_new;
            m_lim[r] = m_new + RESCALE_SLACK * s_per_log2;
#pragma unroll
            for (int v = 0; v < ON / 8; ++v) {
                o[4 * v + 2 * r] *= alpha;
                o[4 * v + 2 * r + 1] *= alpha;
            }
        }
    }
}

// P's A fragments from fp32 S: k-step kk takes S's column groups 2kk (a0, a1) and 2kk + 1
// (a2, a3); p(c, r) packs 2^(S - m) of S's values c[0], c[1] of row g + 8r.
template <class Pack>
__device__ __forceinline__ void packed_fragments(u32 (&pa)[NT / 2][4], const float (&s)[4 * NT],
                                                 Pack p) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        const float* const lo = s + 8 * kk;  // column group 2kk: keys 16kk + 2t, +1
        const float* const hi = lo + 4;      // 2kk + 1: 8 keys further
        pa[kk][0] = p(lo, 0), pa[kk][1] = p(lo + 2, 1);
        pa[kk][2] = p(hi, 0), pa[kk][3] = p(hi + 2, 1);
    }
}

// fp32 S (BF16): the A fragments of the 4 16-key k-steps, packed bf16 (packed_fragments),
// keys in the V^T tile's own order. F16X1: the same in fp16, each value 2^(S - m + P_SHIFT)
// (S in its units: 2^((S - m) log2_per_s + P_SHIFT), one FFMA each). F16X3: 2^(S - m +
// P_SHIFT) split into fp16 hi (pa) and lo (pl).
__device__ __forceinline__ void exponentiate(const float (&s)[4 * NT], EXPONENT_ARGS) {
    if constexpr (F16X3) {
        const float ms[2] = {m_sub[0] - P_SHIFT, m_sub[1] - P_SHIFT};
        auto p = [&](const float* c, int r, u32& hi, u32& lo) {
            split_f16(fast_exp2(c[0] - ms[r]), fast_exp2(c[1] - ms[r]), hi, lo);
        };
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            const float* const lo = s + 8 * kk;
            const float* const hi = lo + 4;
            p(lo, 0, pa[kk][0], pl[kk][0]), p(lo + 2, 1, pa[kk][1], pl[kk][1]);
            p(hi, 0, pa[kk][2], pl[kk][2]), p(hi + 2, 1, pa[kk][3], pl[kk][3]);
        }
    } else if constexpr (F16X1) {
        const float ms[2] = {P_SHIFT - m_sub[0] * log2_per_s, P_SHIFT - m_sub[1] * log2_per_s};
        packed_fragments(pa, s, [&](const float* c, int r) {
            return pack_f16(fast_exp2(fmaf(c[0], log2_per_s, ms[r])),
                            fast_exp2(fmaf(c[1], log2_per_s, ms[r])));
        });
    } else {
        packed_fragments(pa, s, [&](const float* c, int r) {
            return pack_bf16(fast_exp2(c[0] - m_sub[r]), fast_exp2(c[1] - m_sub[r]));
        });
    }
}

// ---- [O | l] += P [V | 1 | 0] ----

// Issued (not waited for), from the V^T tile of row rw in ring stage `stage`: k-step kk
// takes keys 16kk .. 16kk + 15 of its 64-key column, 32 bytes along its rows. BF16, F16X1:
// straight into O. F16X3: P_hi V_lo + P_lo V_hi + P_hi V_hi into ot[grp], fresh, for the
// keys of group grp (GROUP_STEPS k-steps each), added to O after the wait (finish_pv).
#define GROUP_STEPS (NT / 2 / PV_GROUPS)
__device__ __forceinline__ void issue_pv(float (&o)[4 * ON / 8],
                                         float (&ot)[PV_GROUPS][4 * ON / 8],
                                         const u32 (&pa)[NT / 2][4], const u32 (&pl)[NT / 2][4],
                                         int stage, u32 smem_s, int rw) {
    if constexpr (F16X3) {
        const u32 vt_tile = smem_s + stage * STAGE_BYTES + VT_OFFSET + rw * VT_TILE;
        const u64 vt_hi_desc = sw128_desc(vt_tile), vt_lo_desc = sw128_desc(vt_tile + VT_COLUMN);
        wgmma_fence();  // (the first product of each group overwrites its accumulator)
#pragma unroll
        for (int grp = 0; grp < PV_GROUPS; ++grp)
            three_terms(ot[grp], pa, pl, grp * GROUP_STEPS, (grp + 1) * GROUP_STEPS,
                        [&](float (&d)[4 * ON / 8], const u32 (&a)[4], int kk, bool lo, bool first) {
                if (first)
                    wgmma_m64n40k16_f16_first(d, a, (lo ? vt_lo_desc : vt_hi_desc) + 2 * kk);
                else
                    wgmma_m64n40k16_f16(d, a, (lo ? vt_lo_desc : vt_hi_desc) + 2 * kk);
            });
        wgmma_commit();
    } else {
        const u64 vt_desc = sw128_desc(smem_s + stage * STAGE_BYTES + VT_OFFSET + rw * VT_TILE);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            if constexpr (F16X1)
                wgmma_m64n40k16_f16(o, pa[kk], vt_desc + 2 * kk);
            else
                wgmma_m64n40k16_bf16(o, pa[kk], vt_desc + 2 * kk);
        }
        wgmma_commit();
    }
}

// After P V's wait: F16X3's group sums added to O; the registers the products read or wrote
// pinned after the wait (wgmma.cuh pin).
__device__ __forceinline__ void finish_pv(float (&o)[4 * ON / 8],
                                          float (&ot)[PV_GROUPS][4 * ON / 8],
                                          u32 (&pa)[NT / 2][4], u32 (&pl)[NT / 2][4]) {
    if constexpr (F16X3) {
#pragma unroll
        for (int grp = 0; grp < PV_GROUPS; ++grp) {
            pin(ot[grp]);
#pragma unroll
            for (int i = 0; i < 4 * ON / 8; ++i) o[i] += ot[grp][i];
        }
#pragma unroll
        for (int n = 0; n < NT / 2; ++n) pin(pl[n]);
    }
    pin(o);
#pragma unroll
    for (int n = 0; n < NT / 2; ++n) pin(pa[n]);
}

// ---- the ring of STAGES key tiles ----
// Warp 0 fills the stages with bulk copies (one instruction per K or V^T column tile, one
// per bias tile) that complete on the stage's `full` mbarrier; each warp arrives on its
// `empty` mbarrier when its products of the stage are done, and warp 0 refills a stage once
// all have. No block barrier in the key loop: the warpgroups (four with ROWS 2, sharing
// each bias tile) drift apart by up to STAGES - 2 tiles. The projection writes K as tiles
// too (per (b, i, head, 64 keys) the K tile then the V^T tile, as shared memory holds
// them); keys past N are left unwritten in K (S is masked to -inf there) and zero in V^T.

// Where the block's tiles come from: kv_row0 the block's first row's K and V^T tiles of
// this head, kv_rstride bytes apart per row, for rows_here rows; bias_tiles this query
// tile's bias tiles (shared by the block's rows).
struct TileSources {
    const char* kv_row0;
    i64 kv_rstride;
    int rows_here;
    const char* bias_tiles;
};

// Warp 0: key tile j into ring stage j % STAGES by bulk copies that complete on the stage's
// `full` mbarrier (announced first, by lane 0): lanes 0 .. (1 + VT_COLUMNS) rows_here - 1
// copy row r's K tile, then its V^T columns; lane 31 the bias tile (project_epilogue.cuh
// bias_element).
// (`lane` by reference: as an argument, the compiler writes the lane test the other way
// round, and ptxas schedules the loop differently.)
__device__ __forceinline__ void produce_tile(int j, u32 smem_s, u32 full_bar,
                                             const TileSources& from, const int& lane) {
    const int s = j % STAGES;
    const u32 st = smem_s + s * STAGE_BYTES, full = full_bar + 8 * s;
    if (lane == 0) mbar_arrive_expect(full, from.rows_here * (K_TILE + VT_COPIED) + BIAS_TILE);
    __syncwarp();
    if (lane < (1 + VT_COLUMNS) * from.rows_here) {  // K, then V^T's columns, of row r
        const int r = lane / (1 + VT_COLUMNS), part = lane % (1 + VT_COLUMNS);
        const char* const src = from.kv_row0 + r * from.kv_rstride + (i64)j * KV_TILES;
        if (part == 0)
            bulk_copy(st + r * K_TILE, src, K_TILE, full);
        else
            bulk_copy(st + VT_OFFSET + r * VT_TILE + (part - 1) * VT_COLUMN,
                      src + K_TILE + (part - 1) * (VT_COPIED / VT_COLUMNS),
                      VT_COPIED / VT_COLUMNS, full);
    }
    if (lane == 31)
        bulk_copy(st + BIAS_OFFSET, from.bias_tiles + (i64)j * BIAS_TILE, BIAS_TILE, full);
}

// Warp 0, at tile j - STAGES + 1: tile j into the stage the last tile used, once every warp
// has arrived on that stage's `empty` mbarrier (its products of it done).
__device__ __forceinline__ void refill_stage(int j, u32 smem_s, u32 full_bar, u32 empty_bar,
                                             const TileSources& src, const int& lane) {
    if (j >= STAGES) mbar_wait(empty_bar + 8 * (j % STAGES), (j / STAGES - 1) & 1);
    produce_tile(j, smem_s, full_bar, src, lane);
}

// Thread 0: the ring's mbarriers. full[s] completes on warp 0's one arrival (with the bytes
// it announces) and the copies' bytes; empty[s] on one arrival per warp.
__device__ __forceinline__ void init_ring(u32 full_bar, u32 empty_bar, int tid) {
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            mbar_init(empty_bar + 8 * s, THREADS / 32);
        }
    }
}

// ROW_MASK: the block's rows' key bits into shared memory (ROW_MASK_OFFSET), npk / 32 words
// per row (rows past i_end: row i_end - 1's, read, never written out).
__device__ __forceinline__ void copy_row_mask(char* smem, const unsigned* __restrict__ row_mask,
                                              int b, int N, int i0, int i_end, int npk, int tid) {
    const int words = npk / 32;
    unsigned* const keep = reinterpret_cast<unsigned*>(smem + ROW_MASK_OFFSET);
    for (int w = tid; w < ROWS * words; w += THREADS)
        keep[w] = row_mask[((i64)b * N + min(i0 + w / words, i_end - 1)) * words + w % words];
}

// ---- the epilogue ----

// The epilogue of this warp's query row r (query q0 + 8r + g; rows g, g + 8 of O): o = O / l
// (F16X3: O v_unscale / l, the projection's scale of v undone; F16X1's o stays in v's
// units, which the out projection undoes), written to `row` (qkvg at query 0 of this warp's
// row, this head's columns) unless past N. total: l, 0 only where every key was masked:
// those queries get 0, or NaN with nan_fully_masked. O16: a lane's 4 pairs packed in one
// 16-byte store, word 4t + v holding dims 8v + 2t, + 1 (load_o4 gathers them); otherwise 4
// float2 stores. (O16's pair computed x1 first and the fp32 pair as a float2, and the
// words without an array: the instruction order the tuned machine code has.)
__device__ __forceinline__ void store_o_row(const float (&o)[4 * ON / 8], int r, float total,
                                            float* row, int q0, int N, i64 ld, int g, int t,
                                            int nan_fully_masked, float v_unscale) {
    const int j = q0 + 8 * r + g;
    if (j >= N) return;
    const bool fully_masked = total == 0.f;
    const float inv = fully_masked ? 0.f : (F16X3 ? v_unscale : 1.0f) / total;
    const float fill = nan_fully_masked ? quiet_nan() : 0.f;
    float* const out = row + (i64)j * ld + (O16 ? DT * t : 2 * t);
    if constexpr (O16) {  // word v: dims 8v + 2t, + 1
        auto word = [&](int v) {
            const float x1 = fully_masked ? fill : o[4 * v + 2 * r + 1] * inv;
            const float x0 = fully_masked ? fill : o[4 * v + 2 * r] * inv;
            return BF16 ? pack_bf16(x0, x1) : pack_f16(x0, x1);
        };
        const u32 w0 = word(0), w1 = word(1), w2 = word(2), w3 = word(3);
        *reinterpret_cast<uint4*>(out) = make_uint4(w0, w1, w2, w3);
    } else {
#pragma unroll
        for (int v = 0; v < DT; ++v) {  // dims 8v + 2t, + 1
            float2 x = make_float2(o[4 * v + 2 * r] * inv, o[4 * v + 2 * r + 1] * inv);
            if (fully_masked) x = make_float2(fill, fill);
            *reinterpret_cast<float2*>(out + 8 * v) = x;
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(float* qkvg, const bias_elem* __restrict__ bias, int B, int N, int H, int npk,
      int nan_fully_masked
      , const float* __restrict__ vt
#if F16
      , float qk_unscale, float v_unscale
#endif
      ATTENTION_TAIL_ARGS  // key_extent, row_mask, row range (common.cuh)
      ) {
    extern __shared__ float4 smem4[];
    wait_for_previous_kernel();  // q, k, v, the bias and the key extent come from it
    allow_next_kernel();
    const u32 raw_s = smem_addr(smem4);
    const u32 align = (1024u - (raw_s & 1023u)) & 1023u;
    char* const smem = reinterpret_cast<char*>(smem4) + align;
    const u32 smem_s = raw_s + align;

    const int D = H * HEAD_DIM;
    const i64 ld = (BF16 || SLOT_ROWS ? 1LL : F16 ? 2LL : 4LL) * D;  // words per qkvg row (project_epilogue.cuh QKVG_LD)
    // i_end: this batch's rows end there (N, or the row block's end: common.cuh)
    ATTENTION_BLOCK(blk, i_end, N, H, BQ, ROWS);
    const int qtile = blk.qtile, i0 = blk.i0, head = blk.head, b = blk.b;
    const int keys = visited_keys(key_extent, b, N);  // the key loop's end (key_extent.cu)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;

    // This warp: warpgroup wg, row rw of the block, queries q0 .. q0 + 15.
    // (ROWS 1: rw a constant 0, so the descriptors of the products stay in uniform
    // registers: ~26-50 fewer instructions per tile, ptxas; not for F16X3, whose 128
    // registers it pushed into spills)
    const int wg = warp / 4, rw = ROWS == 1 && !F16X3 ? 0 : wg / ROW_GROUPS;
    const bool row_ok = i0 + rw < i_end;
    // qkvg at (b, i0 + rw, j = 0), this head's q columns
    float* const row = qkvg + ((i64)b * N + i0 + rw) * N * ld + head * HEAD_DIM;
    const int q_in_tile = (wg % ROW_GROUPS) * 64 + (warp % 4) * 16;
    const int q0 = qtile * BQ + q_in_tile;

    // ---- Q: A fragments, and Q_SHARED its tile in shared memory ----
    u32 qa[HEAD_DIM / 16][4], ql[HEAD_DIM / 16][4];  // (ql: F16X3's lo parts)
    load_queries(qa, ql, row, q0, row_ok, N, ld, g, t);
    const u32 q_tile = smem_s + Q_OFFSET + wg * Q_TILE;
    if constexpr (Q_SHARED) store_q_tile(smem, qa, wg, warp, g, t);

    const int ntiles = npk / BK;  // key tiles per row of V^T (and of K and the bias)

    write_ones_rows(smem, tid);

    // [O | l] in wgmma's accumulator layout (wgmma.cuh): o[4v + 0..1] row g, o[4v + 2..3]
    // row g + 8, columns 8v + 2t, + 1; the row sums at column d (lanes t = 0: o[4 DT],
    // o[4 DT + 2]). m_sub / m_lim: the reference maximum of rows g and g + 8 (attention_mma.cu).
    float o[4 * ON / 8];
#pragma unroll
    for (int i = 0; i < 4 * ON / 8; ++i) o[i] = 0.f;
    float m_sub[2] = {0.f, 0.f}, m_lim[2] = {neg_inf(), neg_inf()};

    const u32 bias_rows = bias_lane_address(smem_s + BIAS_OFFSET, q_in_tile, lane);

    // The rest of the online softmax's state (rescale, exponentiate). F16X1: S is in units
    // of s_q s_k (log2): log2_per_s converts it back (exact, a power of two). S16: P's
    // offsets ms2 (as fp16 pairs) and msf (as fp32), and 1 / c as an fp16 pair.
    const float log2_per_s = F16X1 ? QK_UNSCALE : 1.f, s_per_log2 = F16X1 ? 1.f / QK_UNSCALE : 1.f;
    const u32 inv_c2 = pack_f16(QK_UNSCALE, QK_UNSCALE);  // (S16) 1 / c (a power of two: exact)
    float msf[2] = {P16_SHIFT, P16_SHIFT};
    u32 ms2[2] = {pack_f16(P16_SHIFT, P16_SHIFT), pack_f16(P16_SHIFT, P16_SHIFT)};

    float ot[PV_GROUPS][4 * ON / 8];  // (F16X3: issue_pv's fresh accumulators)

    // ---- the key loop: one tile at a time, each product waited for where it is issued
    // (a loop keeping the next tile's Q K^T running during this tile's softmax needed
    // ~220 registers, so one block of 8 warps per SM, and was slower: docs/performance.md),
    // the tiles coming through the ring of STAGES stages that warp 0 fills ----
    const u32 full_bar = smem_s + STAGES * STAGE_BYTES, empty_bar = full_bar + 8 * STAGES;
    const int tiles = (keys + BK - 1) / BK;
    const TileSources src = {
        reinterpret_cast<const char*>(vt) + (((i64)b * N + i0) * H + head) * ntiles * KV_TILES,
        (i64)H * ntiles * KV_TILES,
        // (ROW_BLOCK, one row: always 1, kept out of the registers the row mask needs)
        ROW_BLOCK && ROWS == 1 ? 1 : min(ROWS, i_end - i0),
        reinterpret_cast<const char*>(bias)
            + ((((i64)b * H + head) * ((N + BQ - 1) / BQ) + qtile) * ntiles) * BIAS_TILE};
    init_ring(full_bar, empty_bar, tid);
    if constexpr (ROW_MASK) copy_row_mask(smem, ROW_MASK_BITS, b, N, i0, i_end, npk, tid);
    fence_async_shared();  // the ones rows, before any wgmma reads them
    __syncthreads();       // they, the key bits and the mbarriers initialised, for every warp
    if (warp == 0)
        for (int j = 0; j < STAGES - 1 && j < tiles; ++j)
            produce_tile(j, smem_s, full_bar, src, lane);
    int tile = 0;
    u32 pa[NT / 2][4], pl[NT / 2][4];  // P's A fragments, per 16-key k-step of P V (pl: F16X3's lo)
    int stage = 0;
    for (int k0 = 0; k0 < keys; k0 += BK) {
        if (warp == 0 && tile + STAGES - 1 < tiles)  // refill the stage the last tile used
            refill_stage(tile + STAGES - 1, smem_s, full_bar, empty_bar, src, lane);
        mbar_wait(full_bar + 8 * stage, (tile / STAGES) & 1);
        Scores s;
        issue_scores(s, stage, bias_rows, smem_s, q_tile, qa, ql, smem, rw, npk, k0, t);
        wgmma_wait<0>();
        finish_scores(s, o, stage, bias_rows, QK_UNSCALE, smem, rw, npk, k0, N, t);
        rescale(s, o, m_sub, m_lim, log2_per_s, s_per_log2, ms2, msf);
        exponentiate(s, pa, pl, m_sub, log2_per_s, inv_c2, ms2);
        issue_pv(o, ot, pa, pl, stage, smem_s, rw);
        wgmma_wait<0>();  // before the barrier that lets this stage be refilled
        finish_pv(o, ot, pa, pl);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_bar + 8 * stage);  // this warp is done with it
        ++tile;
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }

    // o = O / l. The row sums l are in lanes t = 0 (column d of [O | l]): every lane takes
    // its rows' before the rows past the block's end return.
    const float total[2] = {__shfl_sync(0xffffffffu, o[4 * DT], lane & ~3),
                            __shfl_sync(0xffffffffu, o[4 * DT + 2], lane & ~3)};
    if (!row_ok) return;
#pragma unroll
    for (int r = 0; r < 2; ++r)
        store_o_row(o, r, total[r], row, q0, N, ld, g, t, nan_fully_masked, V_UNSCALE);
}
