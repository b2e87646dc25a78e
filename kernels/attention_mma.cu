// Masked, biased softmax attention along the last pair axis, flash-style, on tensor cores
// (mma.sync and ldmatrix through inline PTX: NVRTC cannot include <mma.h>). Same
// computation, layouts and edge cases as attention_ffma.cu (FFMA); for every row (b, i), head h
// and query j (q and bias pre-scaled by log2 e, so softmax is in base 2 and 2^x is one
// instruction, fast_exp2):
//
//   s[k]         = q[b,i,j,h] . k[b,i,k,h] + bias[b,h,j,k]    # bias = -inf where masked
//   o[b,i,j,h]   = sum_k 2^(s[k] - max s) v[b,i,k,h] / sum_k 2^(s[k] - max s)
//
// Both products run on mma.sync; the online softmax (running max m, running sum l per
// query) runs on the accumulators in registers, in fp32. Four precisions, one source:
//   PREC 0  attention_mma_tf32x3  fp32-accurate: every operand a = hi + lo with
//           hi = rna_tf32(a), lo = rna_tf32(a - hi), and a.b ~= lo.hi' + hi.lo' + hi.hi'
//           (lo.lo' ~ 2^-22 |a.b| is dropped): three m16n8k8 tf32 mma per product,
//           accumulated where the tensor cores' truncating accumulation cannot build up:
//           Q K^T from zero with the bias added in fp32, each k-step of P V in a fresh
//           fragment added to O in fp32
//   PREC 1  attention_mma_tf32    one m16n8k8 tf32 mma: q, k, v rounded to nearest TF32, P
//           as is (truncated by the tensor cores; its row sums come from the same P)
//   PREC 2  attention_mma_bf16    m16n8k16 bf16 mma, fp32 accumulation
//   PREC 3  attention_mma_f16x3   fp32-accurate as PREC 0, in fp16 at twice TF32's rate: every
//           operand a = hi + lo with hi = rn_f16(a), lo = rn_f16(a - hi) (22 bits where
//           lo is a normal fp16), three m16n8k16 fp16 mma per product, accumulated as
//           PREC 0's. fp16's range is narrow: q, k and v are multiplied by powers of two
//           s_q, s_k, s_v (kernel arguments, from a bound on the weights:
//           gpu/scales.py f16x3_scales) as they are split, which keep every value below 2^14, and
//           undone exactly: S = (Q K^T) / (s_q s_k) + bias, o = O / (s_v l). P is split
//           as 2^(s - m + P_SHIFT) (at most 2^(RESCALE_SLACK + P_SHIFT) = 2^14, its lo
//           parts normal down to 2^(s - m) ~ 2^-8; P_SHIFT cancels in O / l), its row
//           sums exact fp32 adds. Reads what PREC 0 reads (fp32 q, k, v and bias).
// Inputs and outputs stay fp32 in every mode.
//
// Work split: a block of 8 warps owns ROWS pair rows i (of one batch b) and BQ queries of
// one head; the warps of a row split its BQ queries, MT m-tiles of 16 per warp, and keep
// them in registers for the whole head dim. The rows of a block share each bias tile (in
// shared memory): the bias is indexed (j, k) and read again for every row i, and at small
// head dims it is the larger part of the traffic from L2 (4 bytes per score).
//
// Key/value tiles (BK keys) reach shared memory in the form the tensor cores take, once
// per block instead of once per warp, in one of two ways:
//   DIRECT (TF32 and bf16): the projection already wrote k and v in that form (rounded to
//     TF32, or packed bf16 at half the bytes: rows_tf32, rows_bf16), so cp.async copies
//     them as they are into a ring of STAGES tiles (K, V and the bias tile), issued
//     STAGES - 1 tiles ahead: one barrier per tile, no register staging.
//   staged (3xTF32, f16x3): each tile is loaded into registers one tile ahead (in flight
//     while the current tile is multiplied), split into TF32 (or scaled fp16) hi and lo
//     parts and stored; the bias tile is copied with cp.async one tile ahead into one of
//     two buffers.
// Fragments then come from ldmatrix, 4 B operands per instruction, except V in DIRECT
// TF32, which is read with two scalar loads per fragment from V [key][dim]:
//   K  [key][dim]: tf32: a row of 4 fp32 is one 8x8 b16 matrix row, so lane (g, t)
//                  receives K[key g][dim t] = B(k=t, n=g) of QK^T;  bf16: the pair
//                  (dims 2t, 2t+1) of key g = B of m16n8k16
//   V  P is taken straight from the S accumulators: a C fragment holds keys (2t, 2t+1),
//      the A fragment of m16n8k8 columns (t, t+4); so column t is key 2t and t + 4 is key
//      2t + 1 of each 8 keys, a = (c0, c2, c1, c3), and B(k, n=dim g) must be V[key 2t]
//      [dim g], V[key 2t+1][dim g]:
//      staged tf32: V transposed, [dim][key position], positions permuted in each 8 keys
//                  (0 2 4 6 1 3 5 7): B is then a plain ldmatrix
//      DIRECT tf32: V [key][dim], rows of d + 4 words: the 32 lanes' words
//                  (2t) (d+4) + g fall in banks 8t + g, all distinct
//      bf16, f16x3: [key][dim] and ldmatrix.trans; the A fragment of m16n8k16 is exactly
//                  two C fragments of adjacent n-tiles
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k8 / m16n8k16"), with
// g = lane >> 2, t = lane & 3:
//   m16n8k8 tf32:  A a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4);
//                  B b0 (k=t, n=g) b1 (k=t+4, n=g)
//   m16n8k16 bf16: A {a0,a1} (g, 2t..2t+1) {a2,a3} (g+8, 2t..) {a4,a5} (g, 2t+8..)
//                  {a6,a7} (g+8, 2t+8..);  B {b0,b1} (k=2t..2t+1, n=g) {b2,b3} (k=2t+8.., n=g)
//   C (both):      c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)
//
// Launch: grid ceil(N/BQ) * ceil(N/ROWS) * H * B, flattened (attention_block); block
// THREADS; dynamic shared memory SMEM_BYTES (triattn_cupy/gpu/tiles.py mirrors it).
// Pointers: qkvg [B*N*N, 4D] float32 with q at column h*d, k at D + h*d, v at 2D + h*d
// (o overwrites q: only this block reads those q values, and each warp reads its own
// queries into registers before it writes them); k and v already rounded to TF32 for
// attention_mma_tf32; for attention_mma_bf16 the columns [D, 2D) hold them packed as 2D bf16
// values, k at bf16 index h*d and v at D + h*d from column D, and q packed from column 2D
// (bf16 index h*d; project_epilogue.cuh rows_bf16), o still fp32 over [0, D).
// bias [B, H, N, NPK] (fp16 for attention_mma_bf16), NPK a multiple of BK (whole tiles are copied), -inf on the padded
// keys [N, NPK). attention_mma_f16x3 takes s_q, s_k, s_v (powers of two) after
// nan_fully_masked. key_extent [B] (key_extent.cu) or null, last: not read here (every key
// is visited; see the kernel).
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 32     // d, a multiple of 8, at most 128
#endif
// The arithmetic, by name (the plan passes PREC as its number; see the header)
#define PREC_TF32X3 0   // 3xTF32, fp32-accurate
#define PREC_TF32 1     // TF32
#define PREC_BF16 2     // bf16
#define PREC_F16X3 3    // fp16 hi + lo, fp32-accurate
#ifndef PREC
#define PREC PREC_TF32X3
#endif
#ifndef BK
#define BK 64           // keys per tile (a multiple of 16)
#endif
#ifndef MT
#define MT 1            // 16-query m-tiles per warp
#endif
#ifndef ROWS
#define ROWS 1          // pair rows per block (1, 2, 4 or 8)
#endif
#ifndef PREFETCH
#define PREFETCH 1      // staged (3xTF32, f16x3): the next key/value tile is loaded into registers during this one
#endif
#ifndef STAGES
#define STAGES 3        // DIRECT: tiles in the shared-memory ring (2 or more)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1    // __launch_bounds__ occupancy hint
#endif

#define WARPS 8
#define THREADS (32 * WARPS)
#define ROW_WARPS (WARPS / ROWS)
#define BQ (16 * MT * ROW_WARPS)  // queries per row and block
#define NT (BK / 8)               // 8-key n-tiles of S
#define DT (HEAD_DIM / 8)         // 8-column n-tiles of O
#define KS ((HEAD_DIM + 15) / 16)  // 16-wide k-steps; the last is half zero when d % 16 == 8
#define TF32X3 (PREC == PREC_TF32X3)
#define BF16 (PREC == PREC_BF16)
#define F16X3 (PREC == PREC_F16X3)
#define SPLIT (TF32X3 || F16X3)   // three products per product, hi and lo parts of K and V
#define HALF (BF16 || F16X3)      // 16-bit operands, m16n8k16
#define DIRECT (!SPLIT)           // k and v come from the projection in tensor-core form
// The row sums of P on the tensor cores, as P times a B operand of ones (one mma per
// k-step of PV instead of an add per score); the same rounded P as O's numerator. Not for
// the split products, whose sums stay exact fp32 adds.
#define SUM_MMA DIRECT
// How far a tile's maximum may exceed the reference maximum before O and l are rescaled.
#define RESCALE_SLACK 8.f
// f16x3: P scaled by 2^P_SHIFT (its largest value 2^(RESCALE_SLACK + P_SHIFT) = 2^14, inside
// fp16's 65504), so that its fp16 lo parts stay normal down to smaller weights.
#define P_SHIFT 6.f

#if PREC < PREC_TF32X3 || PREC > PREC_F16X3
#error "attention_mma.cu: PREC must be 0, 1, 2 or 3"
#endif
#if HEAD_DIM % 8 != 0 || HEAD_DIM > 128
#error "attention_mma.cu: HEAD_DIM must be a multiple of 8, at most 128"
#endif
#if BK % 16 != 0
#error "attention_mma.cu: BK must be a multiple of 16"
#endif
#if WARPS % ROWS != 0
#error "attention_mma.cu: ROWS must divide the 8 warps"
#endif
#if (BQ * BK / (BF16 ? 8 : 4)) % THREADS != 0
#error "attention_mma.cu: the bias tile must be a whole number of 16-byte copies per thread"
#endif
#if DIRECT && STAGES < 2
#error "attention_mma.cu: the DIRECT ring needs at least 2 stages"
#endif

// Shared memory of one row and tile: K (and its lo part), then V (and its lo part).
#if HALF
typedef unsigned short elem_t;  // bf16 or fp16 bits
// K and V [key][dim], rows of d + 8 halves: a multiple of 16 bytes (ldmatrix rows), and
// the 8 rows an ldmatrix reads land on distinct 16-byte bank groups when d % 16 == 0. For
// d % 16 == 8 the last 16-wide k-step reads columns d..d+7 of K: kept zero (the q fragment
// is zero there too, but 0 times a NaN left in shared memory would not be).
#define KSTR (HEAD_DIM + 8)
#define VSTR (HEAD_DIM + 8)
#define K_ELEMS (BK * KSTR)
#define V_ELEMS (BK * VSTR)
#else
typedef u32 elem_t;  // tf32 bits
// K [key][dim], rows of d + 4 words = 4 * odd (d % 8 == 0): the 8 rows of an ldmatrix
// phase start on distinct 4-bank groups. Staged V: transposed [dim][key position], rows
// of BK + 4 words, likewise; its scalar stores, one key per lane, are conflict-free.
// DIRECT V: [key][dim], rows of d + 4 words (see the header).
#define KSTR (HEAD_DIM + 4)
#define K_ELEMS (BK * KSTR)
#if DIRECT
#define VSTR (HEAD_DIM + 4)
#define V_ELEMS (BK * VSTR)
#else
#define VSTR (BK + 4)
#define V_ELEMS (HEAD_DIM * VSTR)
#endif
#endif
#define ELEM_BYTES ((int)sizeof(elem_t))
#define PARTS (SPLIT ? 2 : 1)
#define ROW_ELEMS (PARTS * (K_ELEMS + V_ELEMS))
// Bias tiles [BQ][BSTR] fp32, or fp16 in bf16 mode (the projection holds the bias in fp16
// there, rows_bf16: half the bytes of the largest copy, at 11 bits of precision where
// the bf16 products have 8), after the rows' K/V.
#if BF16
typedef unsigned short bias_elem;  // fp16 bits
#else
typedef float bias_elem;
#endif
#define BSTR (BK + 8)
#define BIAS_TILE (BQ * BSTR)
#define BIAS_BYTES ((int)sizeof(bias_elem))
#define BIAS_CHUNK (16 / BIAS_BYTES)  // elements per 16-byte copy
// The bias copier: thread tid copies 16 bytes at column BIAS_CHUNK (tid % (BK / BIAS_CHUNK))
// of rows tid / (BK / BIAS_CHUNK) + it * RSTEP.
#define RSTEP (THREADS / (BK / BIAS_CHUNK))
// Shared memory: DIRECT: STAGES x (ROWS rows' K/V, one bias tile); staged: the rows' K/V,
// then two bias tiles. Every part is a multiple of 16 bytes.
#define KV_BYTES (ROWS * ROW_ELEMS * ELEM_BYTES)  // the rows' K/V of one stage
#define STAGE_BYTES (KV_BYTES + BIAS_BYTES * BIAS_TILE)
#define SMEM_BYTES (DIRECT ? STAGES * STAGE_BYTES : KV_BYTES + 2 * BIAS_BYTES * BIAS_TILE)

// 3xTF32: split the query fragments once (2 * MT * d/2 registers) when that is small,
// else again for every key tile (volatile conversions, so they cannot be hoisted).
#define QSPLIT_ONCE (TF32X3 && MT * HEAD_DIM <= 32)

// Staged key/value loader: each thread moves 8 consecutive dims (a whole 32-byte sector)
// of one key, the 32 lanes of a warp 32 consecutive keys.
#define CHUNKS (HEAD_DIM / 8)
#define LOADS (ROWS * BK * CHUNKS)
#define LOADS_PER_THREAD ((LOADS + THREADS - 1) / THREADS)
// DIRECT copier: 16-byte chunks, a key's chunks on consecutive threads (a key's k or v is
// d * ELEM_BYTES contiguous bytes).
#define CHUNKS16 (HEAD_DIM * ELEM_BYTES / 16)
#define COPIES (ROWS * 2 * BK * CHUNKS16)
#define COPIES_PER_THREAD ((COPIES + THREADS - 1) / THREADS)

#define BF16_ONES 0x3f803f80u  // bf16x2 (1, 1)
#define TF32_ONE 0x3f800000u   // 1.0f

#if BF16
#define ENTRY attention_mma_bf16
#elif F16X3
#define ENTRY attention_mma_f16x3
#elif TF32X3
#define ENTRY attention_mma_tf32x3
#else
#define ENTRY attention_mma_tf32
#endif


// ---- the steps of one warp ----
// Warp `warp` works on row rw = warp / ROW_WARPS of the block and its queries q0 .. q0 +
// 16 MT - 1; lane (g, t) holds fragment rows g, g + 8 and columns 2t, 2t + 1 (or t, t + 4).

// The query fragments, read once: tf32 and 3xTF32 keep q in fp32 (f), and its TF32 hi
// (and lo) parts where they are formed once; bf16 keeps the A fragments as stored (hi);
// f16x3 the fp16 hi and lo parts of q s_q. The members a precision does not use are
// never written, and take no register.
struct QueryFragments {
    float f[MT][DT][4];  // a0 (j0, 8kk+t) a1 (j1, ..) a2 (j0, 8kk+t+4) a3 (j1, ..)
    u32 hi[MT][HALF ? KS : DT][4], lo[MT][HALF ? KS : DT][4];
};

// q of this warp's queries (queries past N and rows past i_end are zero). `row`: qkvg at
// (b, i0 + rw, j = 0), this head's q columns.
__device__ __forceinline__ void load_queries(QueryFragments& q, const float* row, int D,
                                             int head, int q0, bool row_ok, int N, i64 ld,
                                             int g, int t) {
    if constexpr (BF16) {
        // q packed by the projection (bf16 index h d + c from word 2D): each A fragment
        // register, the pair (c, c + 1), is one word as stored.
        const u32* const qrow = reinterpret_cast<const u32*>(row - head * HEAD_DIM + 2 * D)
                                + head * HEAD_DIM / 2;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int j0 = q0 + 16 * mt + g, j1 = j0 + 8;
            const bool ok0 = row_ok && j0 < N, ok1 = row_ok && j1 < N;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                const int c = 16 * kk + 2 * t;
                const u32* const p0 = qrow + (i64)j0 * ld + c / 2;
                const u32* const p1 = qrow + (i64)j1 * ld + c / 2;
                const bool upper = 16 * kk + 16 <= HEAD_DIM;  // else past d: zero
                q.hi[mt][kk][0] = ok0 ? __ldg(p0) : 0u;
                q.hi[mt][kk][1] = ok1 ? __ldg(p1) : 0u;
                q.hi[mt][kk][2] = ok0 && upper ? __ldg(p0 + 4) : 0u;
                q.hi[mt][kk][3] = ok1 && upper ? __ldg(p1 + 4) : 0u;
            }
        }
    } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int j0 = q0 + 16 * mt + g, j1 = j0 + 8;
            const bool ok0 = row_ok && j0 < N, ok1 = row_ok && j1 < N;
#pragma unroll
            for (int kk = 0; kk < DT; ++kk) {
                const int c = 8 * kk + t;
                q.f[mt][kk][0] = ok0 ? row[(i64)j0 * ld + c] : 0.f;
                q.f[mt][kk][1] = ok1 ? row[(i64)j1 * ld + c] : 0.f;
                q.f[mt][kk][2] = ok0 ? row[(i64)j0 * ld + c + 4] : 0.f;
                q.f[mt][kk][3] = ok1 ? row[(i64)j1 * ld + c + 4] : 0.f;
            }
        }
        if constexpr (!SPLIT || QSPLIT_ONCE) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int kk = 0; kk < DT; ++kk)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        q.hi[mt][kk][e] = to_tf32(q.f[mt][kk][e]);
                        if constexpr (SPLIT)
                            q.lo[mt][kk][e] = to_tf32(q.f[mt][kk][e] - __uint_as_float(q.hi[mt][kk][e]));
                    }
        }
    }
}

// Columns d..d+7 of K (and of its lo part) are read by the last 16-wide k-step when d %
// 16 == 8: zero them once (neither the tile copies nor the staged stores write there; the
// q fragment is zero there too, but 0 times a NaN left in shared memory would not be).
__device__ __forceinline__ void zero_k_padding(char* smem, int tid) {
    if (!HALF || HEAD_DIM % 16 != 8) return;
    if constexpr (DIRECT) {  // bf16: in every stage
        for (int idx = tid; idx < STAGES * ROWS * BK; idx += THREADS) {
            const int key = idx % BK, r = (idx / BK) % ROWS, stage = idx / (BK * ROWS);
            *reinterpret_cast<uint4*>(smem + stage * STAGE_BYTES + r * ROW_ELEMS * ELEM_BYTES
                                      + (key * KSTR + HEAD_DIM) * ELEM_BYTES) =
                make_uint4(0u, 0u, 0u, 0u);
        }
    } else {  // f16x3: hi and lo parts
        for (int idx = tid; idx < ROWS * BK * PARTS; idx += THREADS) {
            const int key = idx % BK, part = (idx / BK) % PARTS, r = idx / (BK * PARTS);
            *reinterpret_cast<uint4*>(smem + (r * ROW_ELEMS + part * K_ELEMS + key * KSTR + HEAD_DIM)
                                      * ELEM_BYTES) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// The online softmax's state of rows j0 (index 0) and j1 (1) of each m-tile: the reference
// maximum m, kept as the two forms the key loop uses: m_sub, what the scores subtract (m,
// or 0 while every key so far is masked and m is -inf: 2^-inf = 0 per term), and m_lim =
// m + RESCALE_SLACK, the bound a score must pass to move m (-inf while m is).
// l: their running sums, laid out as a C fragment: SUM_MMA: P times a B of ones, so every
// element of a row holds the row's whole sum; else l[mt][0] and l[mt][2] hold this lane's
// share of rows j0 and j1 (the 4 lanes of a quad hold a row's shares).
// O (16 x d per m-tile) in C fragments: o[mt][v][0..1] row j0, [2..3] row j1, columns
// 8v + 2t, 8v + 2t + 1. All start at zero, with no maximum yet.
__device__ __forceinline__ void start_rows(float (&o)[MT][DT][4], float (&m_sub)[MT][2],
                                           float (&m_lim)[MT][2], float (&l)[MT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int v = 0; v < DT; ++v) o[mt][v][0] = o[mt][v][1] = o[mt][v][2] = o[mt][v][3] = 0.f;
        m_sub[mt][0] = m_sub[mt][1] = 0.f;
        m_lim[mt][0] = m_lim[mt][1] = neg_inf();
        l[mt][0] = l[mt][1] = l[mt][2] = l[mt][3] = 0.f;
    }
}

// Copy the bias tile at key k0 into the bias tile at shared address `tile` (queries past N:
// zeros, never written). Not committed here. src: this thread's source at key 0, dst its
// offset in a tile, copy_q its first query.
__device__ __forceinline__ void copy_bias_tile(const bias_elem* bias_src, u32 bias_dst,
                                               int copy_q, int k0, u32 tile, int npk, int N) {
    // opaque: the addresses are formed here, per tile, not hoisted out of the key loop as
    // BQ / RSTEP live registers.
    const bias_elem* const src = opaque(bias_src + k0);
#pragma unroll
    for (int it = 0; it < BQ / RSTEP; ++it)
        cp_async16_or_zero(tile + bias_dst + BIAS_BYTES * it * RSTEP * BSTR,
                           src + (i64)(it * RSTEP) * npk, copy_q + it * RSTEP < N);
}

// DIRECT: this thread's copies of a K/V tile into a ring stage, the same in every tile:
// chunk c of k or v (kv) of key `key` of row r, from its source at key 0 (k at column D + h
// d, v at 2D + h d in fp32 / tf32; at bf16 index h d, v at D + h d, from column D in bf16)
// to its place in a stage. Sources as 32-bit byte offsets from the block's first row at
// key 0 (qkvg at row i0, key 0, column D), one register each instead of a 64-bit pointer:
// ROWS <= 8 rows of N keys of 4D <= 3072 floats stay under 2^32 bytes unless N > 43000,
// where qkvg alone would need petabytes. Tiles with k0 < copy_end copy this key, the others
// zeros (copy_end is 0 where the row is past i_end).
__device__ __forceinline__ void plan_ring_copies(u32 (&copy_src)[COPIES_PER_THREAD],
                                                 u32 (&copy_dst)[COPIES_PER_THREAD],
                                                 int (&copy_end)[COPIES_PER_THREAD], int tid,
                                                 int i0, int i_end, int head, int D, int N, i64 ld) {
#pragma unroll
    for (int it = 0; it < COPIES_PER_THREAD; ++it) {
        const int idx = tid + it * THREADS;
        const int c = idx % CHUNKS16, key = (idx / CHUNKS16) % BK;
        const int kv = (idx / (CHUNKS16 * BK)) & 1, r = min(idx / (CHUNKS16 * BK * 2), ROWS - 1);
        copy_src[it] = (u32)(((i64)r * N + key) * ld * 4) + (kv * D + head * HEAD_DIM) * ELEM_BYTES + 16 * c;
        copy_dst[it] = r * ROW_ELEMS * ELEM_BYTES + 16 * c
                       + (kv ? (K_ELEMS + key * VSTR) * ELEM_BYTES : key * KSTR * ELEM_BYTES);
        copy_end[it] = i0 + r < i_end ? N - key : 0;
    }
}

// Copies the K/V tile at k0 into the stage at shared address st (plan_ring_copies);
// not committed here.
__device__ __forceinline__ void copy_kv_tile(u32 st, const char* copy_base,
                                             const u32 (&copy_src)[COPIES_PER_THREAD],
                                             const u32 (&copy_dst)[COPIES_PER_THREAD],
                                             const int (&copy_end)[COPIES_PER_THREAD], int k0,
                                             i64 ld, int tid) {
    const char* const tile_base = copy_base + (i64)k0 * ld * 4;  // key k0 of row i0
#pragma unroll
    for (int it = 0; it < COPIES_PER_THREAD; ++it) {
        if (COPIES % THREADS != 0 && tid + it * THREADS >= COPIES) break;
        const bool ok = k0 < copy_end[it];
        cp_async16_or_zero(st + copy_dst[it], ok ? tile_base + copy_src[it] : copy_base, ok);
    }
}

// Staged (3xTF32, f16x3) key/value tiles, global -> registers -> shared memory: each
// thread moves 8 consecutive dims (a whole 32-byte sector) of one key, the 32 lanes of a
// warp 32 consecutive keys. kv[it]: k dims 0..3, k dims 4..7, v dims 0..3, v dims 4..7.
// Loads the tile at k0 (zeros past N and for rows past i_end). row_base(r): qkvg at row
// i0 + r, key 0, this head's q columns.
template <class RowBase>
__device__ __forceinline__ void fetch_kv(float4 (&kv)[LOADS_PER_THREAD][4], int k0,
                                         const RowBase& row_base, int i0, int i_end, int D,
                                         int N, i64 ld, int tid) {
#pragma unroll
    for (int it = 0; it < LOADS_PER_THREAD; ++it) {
        const int idx = tid + it * THREADS;
        const int key = idx % BK, c = (idx / BK) % CHUNKS, r = idx / (BK * CHUNKS);
        const bool ok = (LOADS % THREADS == 0 || idx < LOADS) && i0 + r < i_end && k0 + key < N;
        const float* src = row_base(r) + (i64)(k0 + key) * ld + D + 8 * c;
        kv[it][0] = ok ? ld4(src) : zero4();
        kv[it][1] = ok ? ld4(src + 4) : zero4();
        kv[it][2] = ok ? ld4(src + D) : zero4();
        kv[it][3] = ok ? ld4(src + D + 4) : zero4();
    }
}

// Stores the fetched tile as hi and lo parts into the rows' K and V in shared memory.
__device__ __forceinline__ void store_kv(char* smem, const float4 (&kv)[LOADS_PER_THREAD][4],
                                         int tid, float s_k, float s_v) {
#pragma unroll
    for (int it = 0; it < LOADS_PER_THREAD; ++it) {
        const int idx = tid + it * THREADS;
        if (LOADS % THREADS != 0 && idx >= LOADS) break;
        const int key = idx % BK, c = (idx / BK) % CHUNKS, r = idx / (BK * CHUNKS);
        elem_t* const K = reinterpret_cast<elem_t*>(smem) + r * ROW_ELEMS;
        elem_t* const V = K + PARTS * K_ELEMS;
        const float x[2][8] = {
            {kv[it][0].x, kv[it][0].y, kv[it][0].z, kv[it][0].w,
             kv[it][1].x, kv[it][1].y, kv[it][1].z, kv[it][1].w},
            {kv[it][2].x, kv[it][2].y, kv[it][2].z, kv[it][2].w,
             kv[it][3].x, kv[it][3].y, kv[it][3].z, kv[it][3].w}};
        if constexpr (F16X3) {
            // k times s_k and v times s_v as fp16 hi and lo: 16 bytes of each part per row
            // (K and V both [key][dim]); the 8 lanes of a store phase write 8 consecutive
            // keys, rows (d + 8) * 2 bytes = 16 * odd apart (d % 16 == 0): no bank conflict.
#pragma unroll
            for (int m2 = 0; m2 < 2; ++m2) {
                const float scale = m2 ? s_v : s_k;
                u32 hi[4], lo[4];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    split_f16(x[m2][2 * e] * scale, x[m2][2 * e + 1] * scale, hi[e], lo[e]);
                elem_t* const dst = (m2 ? V : K) + key * KSTR + 8 * c;  // KSTR = VSTR
                *reinterpret_cast<uint4*>(dst) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
                *reinterpret_cast<uint4*>(dst + (m2 ? V_ELEMS : K_ELEMS)) =
                    make_uint4(lo[0], lo[1], lo[2], lo[3]);
            }
        } else {
            // TF32 hi parts stored before the lo parts are formed: fewer live registers. V
            // transposed, at its key position (vt_position).
            u32 hi[2][8];
#pragma unroll
            for (int m2 = 0; m2 < 2; ++m2)
#pragma unroll
                for (int e = 0; e < 8; ++e) hi[m2][e] = to_tf32(x[m2][e]);
            uint4* const kdst = reinterpret_cast<uint4*>(K + key * KSTR + 8 * c);
            kdst[0] = make_uint4(hi[0][0], hi[0][1], hi[0][2], hi[0][3]);
            kdst[1] = make_uint4(hi[0][4], hi[0][5], hi[0][6], hi[0][7]);
            const int p = vt_position(key);
#pragma unroll
            for (int e = 0; e < 8; ++e) V[(8 * c + e) * VSTR + p] = hi[1][e];
            u32 lo[2][8];
#pragma unroll
            for (int m2 = 0; m2 < 2; ++m2)
#pragma unroll
                for (int e = 0; e < 8; ++e) lo[m2][e] = to_tf32(x[m2][e] - __uint_as_float(hi[m2][e]));
            uint4* const kdst_lo = reinterpret_cast<uint4*>(K + K_ELEMS + key * KSTR + 8 * c);
            kdst_lo[0] = make_uint4(lo[0][0], lo[0][1], lo[0][2], lo[0][3]);
            kdst_lo[1] = make_uint4(lo[0][4], lo[0][5], lo[0][6], lo[0][7]);
#pragma unroll
            for (int e = 0; e < 8; ++e) V[V_ELEMS + (8 * c + e) * VSTR + p] = lo[1][e];
        }
    }
}

// ---- one key tile ----
// S (MT m-tiles x NT n-tiles of 16 x 8 scores, C fragments) as the bias (ONTO false), or
// plus the bias (ONTO true). `bias_tile`: this lane's first element, at query row
// bias_row and column 2t of the tile. TF32 and bf16: the products accumulate onto the
// bias. 3xTF32 and f16x3: onto zero, and the bias is added after them in fp32: the tensor
// cores' accumulation does not round to nearest, and its error is relative to the
// accumulator, which the bias would make larger (f16x3: the products in units of s_q s_k,
// undone in the same instruction). fp32: rows 8 bytes apart in a lane pair, BSTR = 8 mod
// 32 words: each half-warp's float2 reads hit 32 distinct banks; fp16: rows of BSTR / 2 =
// 4 (mod 8) words, a lane's pair one word: the warp's 32 words on 32 banks.
template <bool ONTO>
__device__ __forceinline__ void add_bias(float (&s)[MT][NT][4], const bias_elem* bias_tile,
                                         float qk_unscale) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float2 x0, x1;
            if constexpr (BF16) {
                x0 = half2_to_float2(*reinterpret_cast<const u32*>(bias_tile + 16 * mt * BSTR + 8 * n));
                x1 = half2_to_float2(*reinterpret_cast<const u32*>(bias_tile + (16 * mt + 8) * BSTR + 8 * n));
            } else {
                x0 = *reinterpret_cast<const float2*>(bias_tile + 16 * mt * BSTR + 8 * n);
                x1 = *reinterpret_cast<const float2*>(bias_tile + (16 * mt + 8) * BSTR + 8 * n);
            }
            const float b[4] = {x0.x, x0.y, x1.x, x1.y};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (!ONTO) s[mt][n][e] = b[e];
                else if constexpr (F16X3) s[mt][n][e] = fmaf(s[mt][n][e], qk_unscale, b[e]);
                else s[mt][n][e] = s[mt][n][e] + b[e];
            }
        }
}

// ROW_MASK: the keys masked for every query of this warp's row i (keep_row: its key bits)
// set to -inf in S, as a masked bias entry: on S's start (the bias) before the products
// accumulate onto it, where fewer registers are live than after them (TF32 and bf16);
// after add_bias for the split products, which start from zero. This lane's keys kc, kc +
// 1 (kc even: one word) are columns 2t, 2t + 1 of n-tile n of the tile at k0.
__device__ __forceinline__ void mask_row_keys(float (&s)[MT][NT][4], const unsigned* keep_row,
                                              int k0, int t) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int kc = k0 + 8 * n + 2 * t;
        const unsigned bits = __ldg(keep_row + (kc >> 5)) >> (kc & 31);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (!(bits & 1u)) s[mt][n][0] = s[mt][n][2] = neg_inf();
            if (!(bits & 2u)) s[mt][n][1] = s[mt][n][3] = neg_inf();
        }
    }
}

// ---- the online softmax of rows j0 (r = 0: s[..][0..1]) and j1 (r = 1: s[..][2..3]) ----

// This lane's share of the tile's row maxima (the 4 lanes of a quad hold a row's BK keys),
// in two interleaved chains: more operations in flight than one serial chain. Returns
// whether any exceeds m_lim: that needs no exchange between the lanes; only a rescale
// (rare) needs the row's whole maximum.
__device__ __forceinline__ bool tile_maxima(float (&mx)[MT][2], const float (&s)[MT][NT][4],
                                            const float (&m_lim)[MT][2]) {
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                mx0 = fmaxf(mx0, s[mt][n][2 * r]);
                mx1 = fmaxf(mx1, s[mt][n][2 * r + 1]);
            }
            mx[mt][r] = fmaxf(mx0, mx1);
            grow |= mx[mt][r] > m_lim[mt][r];
        }
    return grow;
}

// Moves the reference maximum of every row of the warp to its maximum so far (mx: this
// lane's share of the tile's), and rescales O and l to it.
__device__ __forceinline__ void rescale(const float (&mx)[MT][2], float (&m_sub)[MT][2],
                                        float (&m_lim)[MT][2], float (&l)[MT][4],
                                        float (&o)[MT][DT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float x = mx[mt][r];  // the row's maximum, from the quad's shares
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
            x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
            const float m_old = m_lim[mt][r] == neg_inf() ? neg_inf() : m_sub[mt][r];
            const float m_new = fmaxf(m_old, x);
            // m_new = -inf: every key so far masked, nothing summed to rescale
            // (and -inf - -inf would be NaN).
            const float alpha = m_new == neg_inf() ? 1.f : fast_exp2(m_old - m_new);
            m_sub[mt][r] = m_new == neg_inf() ? 0.f : m_new;
            m_lim[mt][r] = m_new + RESCALE_SLACK;  // -inf + slack = -inf
            l[mt][2 * r] *= alpha;
            l[mt][2 * r + 1] *= alpha;
#pragma unroll
            for (int v = 0; v < DT; ++v) {
                o[mt][v][2 * r] *= alpha;
                o[mt][v][2 * r + 1] *= alpha;
            }
        }
}

// S becomes P = 2^(s - m) (f16x3: 2^(s - m + P_SHIFT)); without SUM_MMA its row sums are
// added to l here (this lane's share).
__device__ __forceinline__ void exponentiate(float (&s)[MT][NT][4], const float (&m_sub)[MT][2],
                                             float (&l)[MT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float m_ref;
            if constexpr (F16X3) m_ref = m_sub[mt][r] - P_SHIFT;  // 2^(s - m + P_SHIFT)
            else m_ref = m_sub[mt][r];
            if constexpr (SUM_MMA) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    s[mt][n][2 * r] = fast_exp2(s[mt][n][2 * r] - m_ref);
                    s[mt][n][2 * r + 1] = fast_exp2(s[mt][n][2 * r + 1] - m_ref);
                }
            } else {
                float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    s[mt][n][2 * r] = fast_exp2(s[mt][n][2 * r] - m_ref);
                    s[mt][n][2 * r + 1] = fast_exp2(s[mt][n][2 * r + 1] - m_ref);
                    sum0 += s[mt][n][2 * r];
                    sum1 += s[mt][n][2 * r + 1];
                }
                l[mt][2 * r] += sum0 + sum1;
            }
        }
}

// The split products' P V step: acc += P_lo V_hi + P_hi V_lo + P_hi V_hi of one k-step
// (MMA: mma_tf32 or mma_f16), summed in a fragment of its own and added to O in fp32:
// chained through O over every key (3 N / 8 mma), the tensor cores' accumulation, which
// does not round to nearest, made the fp32 mode's error grow with N, to 2-2.6x PyTorch's
// fp32 error at N = 64-75 (the projections' grew with D the same way; docs/performance.md).
template <void (*MMA)(float (&)[4], u32, u32, u32, u32, u32, u32)>
__device__ __forceinline__ void add_split_pv(float (&acc)[4], const u32 (&a_hi)[4],
                                             const u32 (&a_lo)[4], u32 h0, u32 h1, u32 l0,
                                             u32 l1) {
    float f[4] = {0.f, 0.f, 0.f, 0.f};
    MMA(f, a_lo[0], a_lo[1], a_lo[2], a_lo[3], h0, h1);
    MMA(f, a_hi[0], a_hi[1], a_hi[2], a_hi[3], l0, l1);
    MMA(f, a_hi[0], a_hi[1], a_hi[2], a_hi[3], h0, h1);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] += f[e];
}

// bf16 and f16x3: S += Q K^T, m16n8k16 (process_tile says how). (The TF32 products stay
// in process_tile: as a function of their own they reordered the ROW_MASK selects.)
__device__ __forceinline__ void add_products_16(float (&s)[MT][NT][4], const QueryFragments& q,
                                                u32 k_lane, int lane) {
    if constexpr (BF16) {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
#pragma unroll
            for (int n2 = 0; n2 < NT / 2; ++n2) {
                u32 kb[4];
                ldsm_x4(kb, k_lane + ELEM_BYTES * ((16 * n2 + 8 * (lane >> 4) + (lane & 7)) * KSTR
                                                   + 16 * kk + 8 * ((lane >> 3) & 1)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(s[mt][2 * n2], q.hi[mt][kk][0], q.hi[mt][kk][1], q.hi[mt][kk][2],
                             q.hi[mt][kk][3], kb[0], kb[1]);
                    mma_bf16(s[mt][2 * n2 + 1], q.hi[mt][kk][0], q.hi[mt][kk][1], q.hi[mt][kk][2],
                             q.hi[mt][kk][3], kb[2], kb[3]);
                }
            }
    } else {
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
#pragma unroll
            for (int n2 = 0; n2 < NT / 2; ++n2) {
                const u32 a = k_lane + ELEM_BYTES * ((16 * n2 + 8 * (lane >> 4) + (lane & 7)) * KSTR
                                                     + 16 * kk + 8 * ((lane >> 3) & 1));
                u32 kh[4], kl[4];
                ldsm_x4(kh, a);
                ldsm_x4(kl, a + ELEM_BYTES * K_ELEMS);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float (&acc)[4] = s[mt][2 * n2 + h];
                        const u32 (&ah)[4] = q.hi[mt][kk], (&al)[4] = q.lo[mt][kk];
                        mma_f16(acc, al[0], al[1], al[2], al[3], kh[2 * h], kh[2 * h + 1]);
                        mma_f16(acc, ah[0], ah[1], ah[2], ah[3], kl[2 * h], kl[2 * h + 1]);
                        mma_f16(acc, ah[0], ah[1], ah[2], ah[3], kh[2 * h], kh[2 * h + 1]);
                    }
            }
    }
}

// f16x3: O += P V (process_tile says how).
__device__ __forceinline__ void add_pv_f16x3(float (&o)[MT][DT][4], const float (&s)[MT][NT][4],
                                             u32 v_lane, int lane) {
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        // A fragments of k-step kk (keys 16 kk ..), hi and lo: S n-tiles 2 kk and 2 kk + 1
        u32 ph[MT][4], pl[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            split_f16(s[mt][2 * kk][0], s[mt][2 * kk][1], ph[mt][0], pl[mt][0]);
            split_f16(s[mt][2 * kk][2], s[mt][2 * kk][3], ph[mt][1], pl[mt][1]);
            split_f16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1], ph[mt][2], pl[mt][2]);
            split_f16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3], ph[mt][3], pl[mt][3]);
        }
        // matrices: keys 16 kk + 0..7 and + 8..15 (b0, b1) of d-tiles 2 v2 and 2 v2 + 1
        const u32 vrow = v_lane + ELEM_BYTES * (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * VSTR;
#pragma unroll
        for (int v2 = 0; v2 < DT / 2; ++v2) {
            u32 vh[4], vl[4];
            ldsm_x4_trans(vh, vrow + ELEM_BYTES * 8 * (2 * v2 + (lane >> 4)));
            ldsm_x4_trans(vl, vrow + ELEM_BYTES * (V_ELEMS + 8 * (2 * v2 + (lane >> 4))));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                add_split_pv<mma_f16>(o[mt][2 * v2], ph[mt], pl[mt], vh[0], vh[1], vl[0], vl[1]);
                add_split_pv<mma_f16>(o[mt][2 * v2 + 1], ph[mt], pl[mt], vh[2], vh[3], vl[2], vl[3]);
            }
        }
        if constexpr (DT % 2) {
            u32 vh[2], vl[2];
            ldsm_x2_trans(vh, vrow + ELEM_BYTES * 8 * (DT - 1));
            ldsm_x2_trans(vl, vrow + ELEM_BYTES * (V_ELEMS + 8 * (DT - 1)));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                add_split_pv<mma_f16>(o[mt][DT - 1], ph[mt], pl[mt], vh[0], vh[1], vl[0], vl[1]);
        }
    }
}

// TF32 (DIRECT): O += P V of k-steps 2 kk and 2 kk + 1 and l += P times ones, P's A
// fragments ph as is; V [key][dim] of row rw at v_offset bytes into kv.
__device__ __forceinline__ void add_pv_tf32_step(float (&o)[MT][DT][4], float (&l)[MT][4],
                                                 const u32 (&ph)[MT][2][4], const char* kv,
                                                 int v_offset, int kk, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            mma_tf32(l[mt], ph[mt][h][0], ph[mt][h][1], ph[mt][h][2], ph[mt][h][3],
                     TF32_ONE, TF32_ONE);
    // B of key step 2 kk + h: V[key 2t][dim 8v + g] and V[key 2t + 1][dim 8v + g]
    // of its 8 keys (scalar loads, conflict-free: see the header).
    const u32* const vs = reinterpret_cast<const u32*>(kv + v_offset) + 2 * t * VSTR + g;
#pragma unroll
    for (int v = 0; v < DT; ++v)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32* const p = vs + 8 * (2 * kk + h) * VSTR + 8 * v;
            const u32 b0 = p[0], b1 = p[VSTR];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                mma_tf32(o[mt][v], ph[mt][h][0], ph[mt][h][1], ph[mt][h][2], ph[mt][h][3],
                         b0, b1);
        }
}

// 3xTF32 (staged): O += P V of k-steps 2 kk and 2 kk + 1, P's hi and lo A fragments ph, pl;
// V^T's positions 16 kk + 0..3, 4..7 (b0, b1 of k-step 2 kk), 8..11, 12..15 by ldmatrix.
__device__ __forceinline__ void add_pv_tf32x3_step(float (&o)[MT][DT][4], const u32 (&ph)[MT][2][4],
                                                   const u32 (&pl)[MT][2][4], u32 v_lane,
                                                   int lane, int kk) {
    // matrices: positions 16 kk + 0..3, 4..7 (b0, b1 of k-step 2 kk), 8..11, 12..15
    const u32 a = v_lane + ELEM_BYTES * ((lane & 7) * VSTR + 16 * kk + 4 * (lane >> 3));
#pragma unroll
    for (int v = 0; v < DT; ++v) {
        u32 vh[4], vl[4];
        ldsm_x4(vh, a + ELEM_BYTES * 8 * v * VSTR);
        ldsm_x4(vl, a + ELEM_BYTES * (V_ELEMS + 8 * v * VSTR));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                add_split_pv<mma_tf32>(o[mt][v], ph[mt][h], pl[mt][h], vh[2 * h],
                                       vh[2 * h + 1], vl[2 * h], vl[2 * h + 1]);
    }
}

// ---- one key tile, whole ----
// S = bias + Q K^T of this warp's queries (q) and the tile's keys, the online softmax's
// step, O += P V. kv: the stage (or the staged buffer) holding the rows' K and V, row
// rw's at k_offset and v_offset bytes; bias_tile_base: its bias tile, this lane's rows
// from bias_row; keep_row: ROW_MASK's key bits of row i, k0 the tile's first key.
// (The TF32 products, the bf16 P V and the TF32 P V's key-step loop are written out here:
// as functions of their own they changed the order of the loop's registers or of the
// ROW_MASK selects, and so the machine code.)
__device__ __forceinline__ void process_tile(float (&o)[MT][DT][4], float (&m_sub)[MT][2],
                                             float (&m_lim)[MT][2], float (&l)[MT][4],
                                             const QueryFragments& q, const char* kv,
                                             const bias_elem* bias_tile_base,
                                             const unsigned* keep_row, int k0, int k_offset,
                                             int v_offset, int bias_row, int lane, int g, int t,
                                             float qk_unscale) {
    // S starts as the bias (-inf where masked and on the padded keys [N, NPK)), or as zero
    // for the split products (add_bias says why).
    float s[MT][NT][4];
    const bias_elem* const bias_tile = bias_tile_base + bias_row * BSTR + 2 * t;
    if constexpr (SPLIT) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
    } else {
        add_bias<false>(s, bias_tile, qk_unscale);
    }
    if constexpr (ROW_MASK && !SPLIT) mask_row_keys(s, keep_row, k0, t);

    // This lane's ldmatrix rows in K and V (byte addresses; see opaque()).
    const u32 k_lane = opaque(smem_addr(kv + k_offset));
    u32 v_lane = 0;  // (DIRECT TF32 reads V with scalar loads)
    if constexpr (BF16 || SPLIT) v_lane = opaque(smem_addr(kv + v_offset));

    // ---- S += Q K^T ----
    // K [key][dim] at k_lane, each ldmatrix x4 the b0, b1 of n-tiles 2 n2 and 2 n2 + 1.
    // bf16: one m16n8k16 per product; f16x3: three (hi and lo parts, the two small cross
    // terms first, so they are not rounded away against hi.hi); TF32: one m16n8k8,
    // 3xTF32 three likewise, q split here per tile unless QSPLIT_ONCE.
    if constexpr (HALF) {
        add_products_16(s, q, k_lane, lane);
    } else {
#pragma unroll
        for (int kk = 0; kk < DT; ++kk) {
            u32 ah[MT][4], al[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if constexpr (!SPLIT || QSPLIT_ONCE) {
                        ah[mt][e] = q.hi[mt][kk][e];
                        if constexpr (SPLIT) al[mt][e] = q.lo[mt][kk][e];
                    } else {
                        ah[mt][e] = to_tf32_here(q.f[mt][kk][e]);
                        al[mt][e] = to_tf32_here(q.f[mt][kk][e] - __uint_as_float(ah[mt][e]));
                    }
                }
#pragma unroll
            for (int n2 = 0; n2 < NT / 2; ++n2) {
                const u32 a = k_lane + ELEM_BYTES * ((16 * n2 + 8 * (lane >> 4) + (lane & 7)) * KSTR
                                                     + 8 * kk + 4 * ((lane >> 3) & 1));
                u32 kh[4], kl[4];
                ldsm_x4(kh, a);
                if constexpr (SPLIT) ldsm_x4(kl, a + ELEM_BYTES * K_ELEMS);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if constexpr (SPLIT) {
                            mma_tf32(s[mt][2 * n2 + h], al[mt][0], al[mt][1], al[mt][2], al[mt][3],
                                     kh[2 * h], kh[2 * h + 1]);
                            mma_tf32(s[mt][2 * n2 + h], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3],
                                     kl[2 * h], kl[2 * h + 1]);
                        }
                        mma_tf32(s[mt][2 * n2 + h], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3],
                                 kh[2 * h], kh[2 * h + 1]);
                    }
            }
        }
    }

    if constexpr (SPLIT) add_bias<true>(s, bias_tile, qk_unscale);
    if constexpr (ROW_MASK && SPLIT) mask_row_keys(s, keep_row, k0, t);

    // ---- the online softmax: S becomes P ----
    // Lazy rescaling: the reference maximum m moves, and O and l are rescaled, only when
    // a row of the warp exceeds it by more than RESCALE_SLACK; below that the terms are
    // 2^(s - m) <= 2^RESCALE_SLACK, as exact in fp32 (and bf16) as any other. After the
    // first tiles the branch is rarely taken, and it is warp-uniform. (Not a function of
    // its own: one more level of inlining reordered the ROW_MASK selects.)
    float mx[MT][2];
    const bool grow = tile_maxima(mx, s, m_lim);
    if (__any_sync(0xffffffffu, grow)) rescale(mx, m_sub, m_lim, l, o);
    exponentiate(s, m_sub, l);

    // ---- O += P V, P taken from the S accumulators ----
    // SUM_MMA: l += P times ones too. bf16: P packed to bf16 A fragments, V by
    // ldmatrix.trans; f16x3: P and V split into fp16 hi and lo, three products per k-step
    // (add_split_pv); TF32: P's fragments (c0, c2, c1, c3) as is, V read with scalar
    // loads (DIRECT); 3xTF32: P split, V^T by ldmatrix, three products per k-step.
    if constexpr (BF16) {
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            u32 pa[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                mma_bf16(l[mt], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], BF16_ONES, BF16_ONES);
            }
            // matrices: keys 16 kk + 0..7 and + 8..15 (b0, b1) of d-tiles 2 v2 and 2 v2 + 1
            const u32 vrow = v_lane + ELEM_BYTES * (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * VSTR;
#pragma unroll
            for (int v2 = 0; v2 < DT / 2; ++v2) {
                u32 vb[4];
                ldsm_x4_trans(vb, vrow + ELEM_BYTES * 8 * (2 * v2 + (lane >> 4)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(o[mt][2 * v2], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vb[0], vb[1]);
                    mma_bf16(o[mt][2 * v2 + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vb[2], vb[3]);
                }
            }
            if constexpr (DT % 2) {
                u32 vb[2];
                ldsm_x2_trans(vb, vrow + ELEM_BYTES * 8 * (DT - 1));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    mma_bf16(o[mt][DT - 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vb[0], vb[1]);
            }
        }
    } else if constexpr (F16X3) {
        add_pv_f16x3(o, s, v_lane, lane);
    } else {
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            // A fragments of k-steps 2 kk and 2 kk + 1: (c0, c2, c1, c3) of their S n-tiles
            u32 ph[MT][2][4], pl[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float* c = s[mt][2 * kk + h];
                    const float a[4] = {c[0], c[2], c[1], c[3]};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if constexpr (SPLIT) {
                            ph[mt][h][e] = to_tf32(a[e]);
                            pl[mt][h][e] = to_tf32(a[e] - __uint_as_float(ph[mt][h][e]));
                        } else {
                            // As is: the tensor cores read the top 19 bits (truncation). The
                            // row sums come from the same truncated P (SUM_MMA), so its bias
                            // (< 2^-10 relative, always down) cancels in O / l.
                            ph[mt][h][e] = __float_as_uint(a[e]);
                        }
                    }
                }
            if constexpr (DIRECT) {
                add_pv_tf32_step(o, l, ph, kv, v_offset, kk, g, t);
            } else {  // staged: 3xTF32
                add_pv_tf32x3_step(o, ph, pl, v_lane, lane, kk);
            }
        }
    }
}

// ---- the key loops ----

// Staged (3xTF32, f16x3): K/V tiles through registers, loaded one tile ahead (fetch_kv,
// with PREFETCH) and stored split (store_kv); bias tiles in two buffers, copied one tile
// ahead; process(the rows' K/V, the bias tile, k0) runs on each tile in turn.
template <class Process, class CopyBias, class RowBase>
__device__ __forceinline__ void staged_loop(const Process& process, const CopyBias& copy_bias,
                                            const RowBase& row_base, char* smem, u32 smem_s,
                                            int tid, int i0, int i_end, int D, int N, i64 ld,
                                            float s_k, float s_v) {
    const bias_elem* const bias_tiles = reinterpret_cast<const bias_elem*>(smem + KV_BYTES);
    const u32 bias_tiles_s = smem_s + KV_BYTES;
    float4 kv[LOADS_PER_THREAD][4];
    if (PREFETCH) fetch_kv(kv, 0, row_base, i0, i_end, D, N, ld, tid);
    copy_bias(0, bias_tiles_s);
    cp_async_commit();
    for (int k0 = 0, tile = 0; k0 < N; k0 += BK, ++tile) {
        const bool more = k0 + BK < N;
        if (!PREFETCH) fetch_kv(kv, k0, row_base, i0, i_end, D, N, ld, tid);
        __syncthreads();  // every warp is done with the previous tile (and bias buffer)
        store_kv(smem, kv, tid, s_k, s_v);
        if (more) {
            copy_bias(k0 + BK, bias_tiles_s + BIAS_BYTES * ((tile + 1) & 1) * BIAS_TILE);
            cp_async_commit();
        }
        if (more) cp_async_wait<1>(); else cp_async_wait<0>();  // this tile's bias landed
        __syncthreads();  // K, V and bias tiles visible to every warp
        // in flight while this tile is multiplied
        if (PREFETCH && more) fetch_kv(kv, k0 + BK, row_base, i0, i_end, D, N, ld, tid);
        process(smem, bias_tiles + (tile & 1) * BIAS_TILE, k0);
    }
}

// o / l of this warp's rows, written over q (`row`: qkvg at (b, i0 + rw, j = 0), this
// head's columns). l = 0 only when every key was masked (the maximum term of a row with
// any unmasked key is 2^0 = 1): then 0, or NaN where nan_fully_masked. f16x3: O in units
// of s_v, undone by v_unscale.
__device__ __forceinline__ void write_output(const float (&o)[MT][DT][4], const float (&l)[MT][4],
                                             float* row, int q0, int N, i64 ld, int g, int t,
                                             int nan_fully_masked, float v_unscale) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float total = l[mt][2 * r];
            if constexpr (!SUM_MMA) {  // the quad's shares
                total += __shfl_xor_sync(0xffffffffu, total, 1);
                total += __shfl_xor_sync(0xffffffffu, total, 2);
            }
            const int j = q0 + 16 * mt + 8 * r + g;
            if (j >= N) continue;
            const bool fully_masked = total == 0.f;
            const float inv = fully_masked ? 0.f : v_unscale / total;
            const float fill = nan_fully_masked ? quiet_nan() : 0.f;
            float* out = row + (i64)j * ld + 2 * t;
#pragma unroll
            for (int v = 0; v < DT; ++v) {
                float2 x = make_float2(o[mt][v][2 * r] * inv, o[mt][v][2 * r + 1] * inv);
                if (fully_masked) x = make_float2(fill, fill);
                *reinterpret_cast<float2*>(out + 8 * v) = x;
            }
        }
}

// The kernel: each warp loads its queries, then for every key tile (the DIRECT ring or
// the staged loop) forms S, runs the online softmax and accumulates P V; it writes o / l.
// Every key is visited here (key_extent, for attention_wgmma.cu and attention_ffma.cu, is
// not read): a key loop ending at a loaded value is no longer uniform, and ptxas moved the
// loop's address arithmetic from uniform to per-thread registers (tf32 at d = 16,
// 2x128x64x4: 21 -> 30 µs; in shared memory, the value's barrier and static shared memory
// pushed the 3xTF32 spills up and the 48 KiB bf16 tiles past the default limit:
// docs/performance.md).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
ENTRY(float* qkvg, const bias_elem* __restrict__ bias, int B, int N, int H, int npk,
      int nan_fully_masked
#if F16X3
      , float s_q, float s_k, float s_v
#endif
      ATTENTION_TAIL_ARGS  // key_extent, row_mask, row range (common.cuh)
      ) {
#if !F16X3
    const float s_q = 1.f, s_k = 1.f, s_v = 1.f;  // (unscaled)
#endif
    extern __shared__ float4 smem4[];
    char* const smem = reinterpret_cast<char*>(smem4);
    wait_for_previous_kernel();  // q, k, v and the bias come from it (common.cuh)
    allow_next_kernel();
    const u32 smem_s = smem_addr(smem);  // the same, as a shared-memory address

    const int D = H * HEAD_DIM;
    const i64 ld = 4LL * D;
    // i_end: this batch's rows end there (N, or the row block's end: common.cuh)
    ATTENTION_BLOCK(blk, i_end, N, H, BQ, ROWS);
    const int qtile = blk.qtile, i0 = blk.i0, head = blk.head, b = blk.b;  // i0: first row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    (void)key_extent;  // every key is visited (see above)
    const int g = lane >> 2, t = lane & 3;  // fragment row group, thread in group

    // qkvg at (b, i0 + r, j = 0), this head's q columns.
    auto row_base = [&](int r) { return qkvg + ((i64)b * N + i0 + r) * N * ld + head * HEAD_DIM; };

    // This warp: row rw of the block, queries q0 .. q0 + 16 MT - 1.
    const int rw = warp / ROW_WARPS;
    const bool row_ok = i0 + rw < i_end;
    float* const row = row_base(rw);
    const int q0 = qtile * BQ + (warp % ROW_WARPS) * 16 * MT;
    const int k_offset = rw * ROW_ELEMS * ELEM_BYTES;  // row rw's K and V in a stage
    const int v_offset = k_offset + PARTS * K_ELEMS * ELEM_BYTES;

    // The bias tile of this block's BQ queries and BK keys, copied with cp.async ahead of
    // its use and read by the warps of all ROWS rows.
    const bias_elem* const bias_bh = bias + ((i64)b * H + head) * N * npk;
    const int copy_col = BIAS_CHUNK * (tid % (BK / BIAS_CHUNK)), copy_row = tid / (BK / BIAS_CHUNK);
    const int copy_q = qtile * BQ + copy_row;
    const bias_elem* const bias_src = bias_bh + (i64)copy_q * npk + copy_col;  // at key 0
    const u32 bias_dst = BIAS_BYTES * (copy_row * BSTR + copy_col);  // in a bias tile
    auto copy_bias = [&](int k0, u32 tile) {
        copy_bias_tile(bias_src, bias_dst, copy_q, k0, tile, npk, N);
    };
    const int bias_row = (warp % ROW_WARPS) * 16 * MT + g;  // + 16 mt + 8 r: this lane's rows

    // The undoing factors of the scales: powers of two, so exact, and so are the products.
    const float qk_unscale = 1.f / (s_q * s_k), v_unscale = 1.f / s_v;
    QueryFragments q;
    if constexpr (F16X3) {
        // (Written out here: as part of load_queries the two halves of each float2 load
        // swapped registers, and the machine code changed.)
        // q (fp32, times log2 e / sqrt(d)) times s_q, split into fp16 hi and lo A fragments
        // once: hi and lo of the head dim take as many registers as q itself in fp32.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int j0 = q0 + 16 * mt + g, j1 = j0 + 8;
            const bool ok0 = row_ok && j0 < N, ok1 = row_ok && j1 < N;
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                const int c = 16 * kk + 2 * t;  // {a0,a1} (j0, c..c+1) {a2,a3} (j1, ..) {a4,a5} (j0, c+8..)
                const float* const p0 = row + (i64)j0 * ld + c;
                const float* const p1 = row + (i64)j1 * ld + c;
                const bool upper = 16 * kk + 16 <= HEAD_DIM;  // else past d: zero
                const float2 zero = make_float2(0.f, 0.f);
                const float2 x[4] = {ok0 ? *reinterpret_cast<const float2*>(p0) : zero,
                                     ok1 ? *reinterpret_cast<const float2*>(p1) : zero,
                                     ok0 && upper ? *reinterpret_cast<const float2*>(p0 + 8) : zero,
                                     ok1 && upper ? *reinterpret_cast<const float2*>(p1 + 8) : zero};
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    split_f16(x[e].x * s_q, x[e].y * s_q, q.hi[mt][kk][e], q.lo[mt][kk][e]);
            }
        }
    } else {
        load_queries(q, row, D, head, q0, row_ok, N, ld, g, t);
    }
    zero_k_padding(smem, tid);

    float o[MT][DT][4];
    float m_sub[MT][2], m_lim[MT][2], l[MT][4];
    start_rows(o, m_sub, m_lim, l);
#if ROW_MASK
    // Row rw's key bits (rows past i_end: row i_end - 1's, read and never written out)
    const unsigned* const keep_row = row_mask + ((i64)b * N + min(i0 + rw, i_end - 1)) * (npk / 32);
#else
    const unsigned* const keep_row = nullptr;
#endif

    // One key tile (process_tile): `kv` the stage or staged buffer holding it, k0 its first key.
    auto process = [&](const char* kv, const bias_elem* bias_tile_base, int k0) {
        process_tile(o, m_sub, m_lim, l, q, kv, bias_tile_base, keep_row, k0, k_offset,
                     v_offset, bias_row, lane, g, t, qk_unscale);
    };

    if constexpr (DIRECT) {
        // ---- the ring: tile `tile` lives in stage tile % STAGES, copied STAGES - 1 ahead ----
        const char* const copy_base = reinterpret_cast<const char*>(row_base(0) - head * HEAD_DIM + D);
        u32 copy_src[COPIES_PER_THREAD], copy_dst[COPIES_PER_THREAD];
        int copy_end[COPIES_PER_THREAD];
        plan_ring_copies(copy_src, copy_dst, copy_end, tid, i0, i_end, head, D, N, ld);
        // Copy the tile at k0 into stage `stage` (nothing past the last tile), then commit
        // a group either way, so that the group count stays in step with the tiles.
        auto issue = [&](int k0, int stage) {
            if (k0 < N) {
                const u32 st = smem_s + stage * STAGE_BYTES;
                copy_kv_tile(st, copy_base, copy_src, copy_dst, copy_end, k0, ld, tid);
                copy_bias(k0, st + KV_BYTES);
            }
            cp_async_commit();
        };
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) issue(s * BK, s);
        int stage = 0;
        for (int k0 = 0; k0 < N; k0 += BK) {
            cp_async_wait<STAGES - 2>();  // this thread's copies of this tile landed
            __syncthreads();  // everyone's copies visible; every warp is done with the last tile
            // The stage freed by the last tile takes the tile STAGES - 1 ahead.
            issue(k0 + (STAGES - 1) * BK, stage == 0 ? STAGES - 1 : stage - 1);
            const char* const st = smem + stage * STAGE_BYTES;
            process(st, reinterpret_cast<const bias_elem*>(st + KV_BYTES), k0);
            stage = stage == STAGES - 1 ? 0 : stage + 1;
        }
    } else {
        staged_loop(process, copy_bias, row_base, smem, smem_s, tid, i0, i_end, D, N, ld, s_k, s_v);
    }

    if (!row_ok) return;
    write_output(o, l, row, q0, N, ld, g, t, nan_fully_masked, v_unscale);
}
