// What the two projection kernels (project_ffma.cu: FFMA, project_mma.cu: tensor cores) share:
// their entry points' arguments, a block's rows (block_rows) and where each starts in x,
// and the epilogues that turn a block's output tile into q, k, v, gate or the output
// (store_qkvg, OutRows; the mask reader and the gate's sigmoid: project_math.cuh).
// Included after the kernel file has defined its tile (and BM, its rows per block):
//   Tile (acc.c), TROWS, SLOT_RUN and
//   pair_column(n0, j)  column of this thread's j-th value pair (j < 4) of the pass at n0
//   thread_row(s)       block row of this thread's row slot s < TROWS
//   pair_at(acc, s, j)  the value pair of slot s at column pair j
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "project_math.cuh"
#include "layout_features.cuh"
#include "pair_bias_store.cuh"

// The arguments both kernels' entry points take, in the order the plan passes them
// (gpu/plan.py); W_NAME names the weight as the kernel reads it (project_ffma.cu: WT, [D,
// NO] transposed; project_mma.cu: W, [NO, D]). Each kernel appends its own (scales, and
// the row block's rows or N).
#define LN_QKVG_PARAMS(W_NAME)                                                              \
    const pair_t* __restrict__ x, i64 sb, i64 si, i64 sj, i64 sc, int x_vec,                \
    int B, int N, int D, int H, float eps, float q_scale,                                   \
    const float* __restrict__ gamma, const float* __restrict__ beta,                        \
    const float* __restrict__ W_NAME, const float* __restrict__ b_qkvg,                     \
    const float* __restrict__ Wb,                                                           \
    const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi, i64 mj,                   \
    float* __restrict__ qkvg, float* __restrict__ bias, int npk,                            \
    float* __restrict__ vt
#define GATED_OUT_PARAMS(W_NAME)                                                            \
    const float* __restrict__ qkvg, i64 M, int D,                                           \
    const float* __restrict__ W_NAME, const float* __restrict__ b_out,                      \
    pair_t* __restrict__ out

// The block's rows: the first, m0, and the end M of the launch's rows (the last block's
// rows from M on are padding: zero in, nothing out). ROW_BLOCK (common.cuh): the pair rows
// of (b, i) in [row_begin, row_end) only, else all B N N (NN = N N, from the caller: its
// product there is the one the row offsets and the bias share); an entry point passes its
// own range as ROW_RANGE (unused without ROW_BLOCK).
struct BlockRows {
    i64 m0, M;
    // the block's rows below M: BM, or fewer in the last block
    __device__ __forceinline__ int here() const { return (int)min((i64)BM, M - m0); }
};
__device__ __forceinline__ BlockRows block_rows(int B, int N, i64 NN, i64 row_begin,
                                                i64 row_end) {
    const i64 M = ROW_BLOCK ? row_end * N : (i64)B * NN;  // (M, then m0: as the compiler
    const i64 m0 = ROW_BLOCK ? row_begin * N + (i64)blockIdx.x * BM  // had them, its
                             : (i64)blockIdx.x * BM;                  // result the same)
    return BlockRows{m0, M};
}
#if ROW_BLOCK
#define ROW_RANGE row_begin, row_end  // (ROW_BLOCK_ARGS, common.cuh)
#else
#define ROW_RANGE 0, 0
#endif

// Where each of the block's BM rows (from m0) starts in x, an element offset into
// rowoff[t] by threads t < BM (64-bit: B*N*N*D passes 2^31 at N ~ 4096); rows past the
// last (M) repeat it. The caller makes it visible (barrier) before the row loads.
__device__ __forceinline__ void row_offsets(i64* rowoff, i64 m0, i64 M, int N, i64 sb, i64 si,
                                            i64 sj) {
    const int t = threadIdx.x;
    if (t < BM) {
        const i64 NN = (i64)N * N, m = min(m0 + t, M - 1);
        const i64 b = m / NN, r = m - b * NN, i = r / N, j = r - i * N;
        rowoff[t] = b * sb + i * si + j * sj;
    }
}

// The epilogues decide what a column pair is once (q, k/v or gate; in range), transform
// its values in place, then store the tile: deciding per value made the epilogue as many
// instructions as the products.

// Every value pair this thread holds at its column pair j becomes f(pair + biases cb).
template <class F>
__device__ __forceinline__ void map_column(Tile& acc, int j, float2 cb, F f) {
#pragma unroll
    for (int s = 0; s < TROWS; ++s) {
        float* const p = pair_at(acc, s, j);
        const float2 v = f(make_float2(p[0] + cb.x, p[1] + cb.y));
        p[0] = v.x;
        p[1] = v.y;
    }
}

// Where the tiles go (vt), and the block's first row (the unused fields of the row layouts).
struct VtTarget {
    float* vt;
    i64 m0;
    int N, H, npk;
};

#define Q_WORD(D) (QG_PACKED ? 2 * (D) : 0)
#define GATE_WORD(D) (QG_PACKED ? 5 * (D) / 2 : F16_QKV ? (D) : 3 * (D))
#define QKVG_LD(D) (F16_QKV ? 2 * (D) : SLOT_ROWS ? (D) : 4 * (D))  // words per qkvg row
#define Q_LO_WORDS 16  // HI_LO: from a q hi word to its lo word (head dim 32: 16 hi words)

// The word of a head-slot row (SLOT_ROWS) holding gate column c (even) and c + 1.
#define GATE_SLOT_WORD(c) (32 * ((c) / 32) + 16 + (c) % 32 / 2)

// Gate values k .. k + 3 of a qkvg row (k % 4 == 0): fp32, or (rows_bf16 and tiles_bf16) two packed
// bf16 words, widened.
__device__ __forceinline__ float4 load_gate4(const float* row, int D, int k) {
#if QG_PACKED
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(
        row + (SLOT_ROWS ? GATE_SLOT_WORD(k) : GATE_WORD(D) + k / 2)));
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                       __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
#else
    return ld4(row + GATE_WORD(D) + k);
#endif
}

// o in 16 bits (tiles_bf16 and tiles_f16; attention_wgmma.cu O16): bf16, or fp16 in v's units
// (tiles_f16: the out projection's unscale undoes s_v), a head's 32 values in the 16 words
// [32 h, 32 h + 16) of the row (head dim 32), as the attention's lanes hold them: its dim
// pair p (dims 2p, 2p + 1) in word 4 (p % 4) + p / 4 (one 16-byte store per lane and row;
// 4-byte stores pushed attention_wgmma_f16 into spills). Values k .. k + 3 of a qkvg row
// (k % 4 == 0: pairs p and p + 1, 4 words apart), widened.
__device__ __forceinline__ float4 load_o4(const float* row, int k) {
#if O16
    const int p = (k % 32) / 2;
    const u32* const word = reinterpret_cast<const u32*>(row + 32 * (k / 32) + 4 * (p % 4) + p / 4);
    const uint2 w = make_uint2(__ldg(word), __ldg(word + 4));
#if TILES_BF16
    return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                       __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
#else
    const float2 lo = half2_to_float2(w.x), hi = half2_to_float2(w.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
#endif
#else
    return ld4(row + k);
#endif
}

#if KV_TILED
// V^T (the tiled layouts; head dim 32): per (b, i, head, 64 keys) after the K tile, [32
// dims][64 keys] 16-bit in rows of 128 bytes in the 128-byte swizzle (sw128), keys in
// order (below). Keys [N, npk) are zero: the attention multiplies them by P = 0, and
// the scratch memory is not cleared (it may hold NaN). Here: this thread's value pairs,
// rows below rows_here, where vcol0 >= 0 is the v column (from 0) of its first pair: its
// pairs j are 8j further, all of one head, dims c + 8j and c + 8j + 1 (c = vcol0 % 32 <
// 8), which sit 1024 j bytes apart in a column (sw128 swizzles by row % 8). Rows m =
// (b * N + i) * N + k are below 2^31 wherever qkvg fits in memory (16 D bytes a row).
// Which pair (b, i) = bi and key k block row r holds (rows m = bi N + k from m0): one
// division per call, then a few subtractions per row (a block spans rows of ceil(BM / N)
// + 1 pairs).
struct RowPairs {
    unsigned N, bi_first, k_first;
    __device__ __forceinline__ explicit RowPairs(const VtTarget& to)
        : N((unsigned)to.N), bi_first((unsigned)to.m0 / N),
          k_first((unsigned)to.m0 - bi_first * N) {}
    __device__ __forceinline__ void of(int r, unsigned& bi, unsigned& k) const {
        k = k_first + r, bi = bi_first;
        while (k >= N) k -= N, ++bi;
    }
    // f(s, bi, k) for each of this thread's row slots s whose block row is below rows_here.
    template <class F>
    __device__ __forceinline__ void each_slot(int rows_here, F f) const {
#pragma unroll
        for (int s = 0; s < TROWS; ++s) {
            const int r = thread_row(s);
            if (r >= rows_here) continue;
            unsigned bi, k;
            of(r, bi, k);
            f(s, bi, k);
        }
    }
};

// tiles_bf16 (bf16): one column of 64 keys, [32 dims][64 keys] bf16, key k at position k;
// tiles_f16 the same in fp16; tiles_f16_hilo too, hi, then lo HALF_PART bytes further.
// pack_vt: two values as one word of the tile's element type.
#if TILES_BF16
typedef unsigned short vt_t;  // bf16 bits
__device__ __forceinline__ vt_t to_vt(float x) { return bf16_bits(x); }
__device__ __forceinline__ u32 pack_vt(float x0, float x1) { return pack_bf16(x0, x1); }
#elif F16_QKV
typedef unsigned short vt_t;  // fp16 bits
__device__ __forceinline__ vt_t to_vt(float x) { return (vt_t)pack_f16(x, 0.f); }
__device__ __forceinline__ u32 pack_vt(float x0, float x1) { return pack_f16(x0, x1); }
#else
typedef float vt_t;
__device__ __forceinline__ vt_t to_vt(float x) { return x; }
#endif
#define VT_DIM8 (1024 / (int)sizeof(vt_t))  // elements from dim c to dim c + 8: 8 rows of 128 bytes

__device__ __forceinline__ void store_vt(Tile& acc, int vcol0, const VtTarget& to, int rows_here) {
    if (vcol0 < 0) return;
    const int h = vcol0 / 32, c = vcol0 % 32, ntiles = to.npk / 64;
    const RowPairs rows(to);
    // Where key `key` of pair (b, i) = bi goes: its dims c + 8j at d0[VT_DIM8 j], c + 8j + 1
    // at d1[VT_DIM8 j].
    auto at = [&](unsigned bi, int key, vt_t*& d0, vt_t*& d1) {
        // 16-bit elements, keys in order
        const int byte = 2 * (key % 64);
        char* const column = reinterpret_cast<char*>(to.vt) + VT_IN_TILE
                             + (((i64)bi * to.H + h) * ntiles + key / 64) * KV_TILE_BYTES;
        d0 = reinterpret_cast<vt_t*>(column + sw128(c, byte));
        d1 = reinterpret_cast<vt_t*>(column + sw128(c + 1, byte));
    };
    if (to.N % 2 == 0) {
        // N even: a block row and its key have the same parity (m0 and N are even), so
        // lanes g and g ^ 1 (4 apart) hold keys k, k + 1 of one pair (b, i): the even lane
        // stores both keys of dim c + 8j, the odd lane both of dim c + 8j + 1, in one
        // 32-bit word each (two 16-bit stores each took the projection ~0.1 ms longer at
        // 1x1024 than rows_bf16's packed k/v words). Rows past rows_here come in pairs too.
        const bool odd = (threadIdx.x >> 2) & 1;
#pragma unroll
        for (int s = 0; s < TROWS; ++s) {
            const int r = thread_row(s);
            unsigned bi, k;
            rows.of(r, bi, k);
            vt_t *d0, *d1;
            at(bi, (int)(k & ~1u), d0, d1);  // the word of keys k & ~1, k | 1
            u32* const word = reinterpret_cast<u32*>(odd ? d1 : d0);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float* const p = pair_at(acc, s, j);
                const float other = __shfl_xor_sync(0xffffffffu, odd ? p[0] : p[1], 4);
#if HI_LO
                u32 hi, lo;
                split_f16(odd ? other : p[0], odd ? p[1] : other, hi, lo);
                if (r < rows_here) {
                    word[VT_DIM8 / 2 * j] = hi;
                    word[VT_DIM8 / 2 * j + HALF_PART / 4] = lo;
                }
#else
                if (r < rows_here)
                    word[VT_DIM8 / 2 * j] = odd ? pack_vt(other, p[1]) : pack_vt(p[0], other);
#endif
            }
        }
    } else {
        rows.each_slot(rows_here, [&](int s, unsigned bi, unsigned k) {
            vt_t *d0, *d1;
            at(bi, (int)k, d0, d1);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float* const p = pair_at(acc, s, j);
#if HI_LO  // the pair's hi and lo halves, each a 16-bit store of its own
                u32 hi, lo;
                split_f16(p[0], p[1], hi, lo);
                d0[VT_DIM8 * j] = (vt_t)hi, d1[VT_DIM8 * j] = (vt_t)(hi >> 16);
                d0[VT_DIM8 * j + HALF_PART / 2] = (vt_t)lo;
                d1[VT_DIM8 * j + HALF_PART / 2] = (vt_t)(lo >> 16);
#else
                d0[VT_DIM8 * j] = to_vt(p[0]);
                d1[VT_DIM8 * j] = to_vt(p[1]);
#endif
            }
        });
    }
    // Zeros on the keys [N, npk) of the pair (b, i) of each row slot holding key N - 1.
    for (int s = 0; s < TROWS; ++s) {
        const int r = thread_row(s);
        if (r >= rows_here) continue;
        unsigned bi, k;
        rows.of(r, bi, k);
        if (k != rows.N - 1) continue;
        for (int key = to.N; key < to.npk; ++key) {
            vt_t *d0, *d1;
            at(bi, key, d0, d1);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                d0[VT_DIM8 * j] = d1[VT_DIM8 * j] = 0;
#if HI_LO
                d0[VT_DIM8 * j + HALF_PART / 2] = d1[VT_DIM8 * j + HALF_PART / 2] = 0;
#endif
            }
        }
    }
}

// K tiles (the tiled layouts): key k of pair (b, i) = bi, dims c + 8j, c + 8j + 1 of head h
// (kcol0 = 32 h + c, as store_vt) at row k % 64 of its tile, packed 16-bit at byte 2 (c +
// 8j) in the 64-byte swizzle (tiles_f16_hilo: the hi tile, then the lo one).
__device__ __forceinline__ void store_kt(Tile& acc, int kcol0, const VtTarget& to, int rows_here) {
    if (kcol0 < 0) return;
    const int h = kcol0 / 32, c = kcol0 % 32, ntiles = to.npk / 64;
    RowPairs(to).each_slot(rows_here, [&](int s, unsigned bi, unsigned k) {
        char* const tile = reinterpret_cast<char*>(to.vt)
                           + (((i64)bi * to.H + h) * ntiles + k / 64) * KV_TILE_BYTES;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float* const p = pair_at(acc, s, j);
#if HI_LO
            u32 hi, lo;
            split_f16(p[0], p[1], hi, lo);
            *reinterpret_cast<u32*>(tile + sw64(k % 64, 2 * (c + 8 * j))) = hi;
            *reinterpret_cast<u32*>(tile + HALF_PART + sw64(k % 64, 2 * (c + 8 * j))) = lo;
#else
            *reinterpret_cast<u32*>(tile + sw64(k % 64, 2 * (c + 8 * j))) = pack_vt(p[0], p[1]);
#endif
        }
    });
}
#endif

__device__ __forceinline__ void st2(float* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }

// store_pairs' common case, every pass of D % 32 == 0: the four column pairs at col0 +
// STRIDE j, all stored, all packed (PACKED) or none (a warp's 32 columns lie within one of
// q, k, v and the gate). Each row's address is worked out once, and each store takes its
// column as an immediate offset. (Per store, its own address, its column and row tested
// and the packed choice made in branches of their own took ~1500 instructions per warp
// and block at 1x1024, a sixth of the projection's; and the one address register all
// stores shared made each wait for the one before to read it: ncu.)
// Only in ln_qkvg_project's stores of tiles_bf16 and tiles_f16 (bf16 and tf32 past N = 128), where
// it was measured faster (1x1024 tf32 1.38 -> 1.35 ms, bf16 1.238 -> 1.227; 1x384 tf32
// 0.228 -> 0.219). It was slower in tiles_f16_hilo's (fp32: 2.38 -> 2.40) and in the out
// projection's store_out (+0.005 to +0.026 ms in every mode), and in the row layouts it
// pushed the 128-row kernels into spills (to 104 bytes).
// docs/performance.md.
#define STORE_RUNS (KV_TILED && !HI_LO)
template <int STRIDE, bool PACKED>
__device__ __forceinline__ void store_pair_run(Tile& acc, float* base, int col0, int ld,
                                               int rows_here) {
#pragma unroll
    for (int s0 = 0; s0 < TROWS; s0 += SLOT_RUN) {
        float* row[SLOT_RUN];
        bool ok[SLOT_RUN];
#pragma unroll
        for (int h = 0; h < SLOT_RUN; ++h) {
            const int r = thread_row(s0 + h);
            ok[h] = r < rows_here;
            row[h] = base + (r * ld + col0);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < SLOT_RUN; ++h) {
                if (!ok[h]) continue;
                const float* const p = pair_at(acc, s0 + h, j);
                float* const dst = row[h] + STRIDE * j;
                if (PACKED) {
                    *dst = p[0];
#if HI_LO  // q's fp16 hi word, and its lo word after the head's hi words
                    dst[Q_LO_WORDS] = p[1];
#endif
                } else {
                    st2(dst, make_float2(p[0], p[1]));
                }
            }
    }
}

// Store this thread's value pairs: column pair j of block row r at base + r * ld + col[j]
// (in floats), as a float pair, or only its first word where packed[j] (two bf16; HI_LO:
// q's fp16 hi word, and its lo word Q_LO_WORDS on). Column
// pairs with col[j] < 0 and rows from rows_here on are skipped. A row's column pairs go
// out one after another, as the fragments hold them: storing column pair by column pair
// (every row of one pair, then the next) made the stores take about twice as long
// (measured, docs/performance.md).
// RUNS: take store_pair_run where it applies (STORE_RUNS).
template <bool RUNS>
__device__ __forceinline__ void store_pairs(Tile& acc, float* base, const int (&col)[4],
                                            const bool (&packed)[4], int ld, int rows_here) {
    if constexpr (RUNS) {
        const int stride = col[1] - col[0];
        const bool run = col[0] >= 0 && col[2] == col[0] + 2 * stride && col[3] == col[0] + 3 * stride
                         && packed[1] == packed[0] && packed[2] == packed[0] && packed[3] == packed[0];
        if (run && stride == 8 && !packed[0])
            return store_pair_run<8, false>(acc, base, col[0], ld, rows_here);
        if (run && stride == 4 && packed[0])
            return store_pair_run<4, true>(acc, base, col[0], ld, rows_here);
        if (col[0] < 0 && col[1] < 0 && col[2] < 0 && col[3] < 0) return;  // (k, v in tiles)
        // Any other case (a D whose regions cut a warp's columns), pair by pair:
    }
#pragma unroll
    for (int s0 = 0; s0 < TROWS; s0 += SLOT_RUN)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int h = 0; h < SLOT_RUN; ++h) {
                const int r = thread_row(s0 + h);
                if (col[j] < 0 || r >= rows_here) continue;
                const float* const p = pair_at(acc, s0 + h, j);
                float* const dst = base + (r * ld + col[j]);
                if (packed[j]) {
                    *dst = p[0];
#if HI_LO  // q's fp16 hi word, and its lo word after the head's hi words
                    dst[Q_LO_WORDS] = p[1];
#endif
                } else
                    st2(dst, make_float2(p[0], p[1]));
            }
}

// The pass at n0 of ln_qkvg_project (acc = xn [Wq; Wk; Wv; Wg]^T at columns n0 + ...,
// cb their biases) into the block's rows of qkvg (block_out, rows of QKVG_LD(D) floats):
// q scaled by q_scale, k and v as the layout says, the gate through sigmoid.
__device__ __forceinline__ void store_qkvg(Tile& acc, int n0, const float2 (&cb)[4], int D,
                                           float q_scale, float* block_out, int rows_here,
                                           const VtTarget& vt) {
    const int NO = 4 * D;
    int col[4];
    bool packed[4];
    int vcol0 = -1;  // KV_TILED: the v column of this thread's first pair, where this pass
    int kcol0 = -1;  // holds v; the same for k
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int n = pair_column(n0, j);
        col[j] = n < NO ? n : -1;
        packed[j] = false;
        // n even, D % 4 == 0: no pair straddles two of q (n < D), k, v, gate (n >= 3D).
        if (n >= NO) continue;
        if (n < D) {
            if constexpr (QG_PACKED) {  // packed bf16 from Q_WORD, or in head n / 32's slot
                map_column(acc, j, cb[j], [&](float2 v) {  // (n even: a whole word)
                    return make_float2(__uint_as_float(pack_bf16(v.x * q_scale, v.y * q_scale)), 0.f);
                });
                col[j] = SLOT_ROWS ? n / 32 * 32 + n % 32 / 2 : Q_WORD(D) + n / 2;
                packed[j] = true;
            } else if constexpr (F16_QKV) {  // head n / 32's fp16 hi word (tiles_f16_hilo:
                // its lo Q_LO_WORDS further, store_pairs)
                map_column(acc, j, cb[j], [&](float2 v) {
                    u32 hi, lo = 0u;
                    if constexpr (HI_LO) split_f16(v.x * q_scale, v.y * q_scale, hi, lo);
                    else hi = pack_f16(v.x * q_scale, v.y * q_scale);
                    return make_float2(__uint_as_float(hi), __uint_as_float(lo));
                });
                col[j] = n / 32 * 32 + n % 32 / 2;
                packed[j] = true;
            } else {
                map_column(acc, j, cb[j], [&](float2 v) {
                    return make_float2(v.x * q_scale, v.y * q_scale);
                });
            }
        } else if (n >= 3 * D) {
            if constexpr (QG_PACKED) {  // packed bf16 from GATE_WORD, or in the head's slot after its q
                map_column(acc, j, cb[j], [](float2 v) {
                    return make_float2(__uint_as_float(pack_bf16(sigmoid(v.x), sigmoid(v.y))), 0.f);
                });
                col[j] = SLOT_ROWS ? GATE_SLOT_WORD(n - 3 * D) : GATE_WORD(D) + (n - 3 * D) / 2;
                packed[j] = true;
            } else {
                map_column(acc, j, cb[j], [](float2 v) {
                    return make_float2(sigmoid(v.x), sigmoid(v.y));
                });
                if constexpr (F16_QKV) col[j] = GATE_WORD(D) + (n - 3 * D);
            }
        } else {
            if constexpr (KV_BF16_ROWS) {  // bf16 index n - D from column D; a row is NO words
                map_column(acc, j, cb[j], [](float2 v) {
                    return make_float2(__uint_as_float(pack_bf16(v.x, v.y)), 0.f);
                });
                col[j] = D + (n - D) / 2;  // n - D even: a whole word
                packed[j] = true;
            } else {
                map_column(acc, j, cb[j], [](float2 v) {
                    if constexpr (KV_TF32)  // (tiles_bf16: rounded to bf16 where stored)
                        v = make_float2(__uint_as_float(to_tf32(v.x)), __uint_as_float(to_tf32(v.y)));
                    return v;
                });
                if constexpr (KV_TILED) {
                    if (n >= 2 * D) {  // v: into vt, transposed (store_vt)
                        if (j == 0) vcol0 = n - 2 * D;
                        col[j] = -1;
                    }
                    if (n < 2 * D) {  // k: into its tiles (store_kt)
                        if (j == 0) kcol0 = n - D;
                        col[j] = -1;
                    }
                }
            }
        }
    }
    store_pairs<STORE_RUNS>(acc, block_out, col, packed, QKVG_LD(D), rows_here);
#if KV_TILED  // (store_kt and store_vt exist only then)
    store_kt(acc, kcol0, vt, rows_here);
    store_vt(acc, vcol0, vt, rows_here);
#else
    (void)vt, (void)kcol0, (void)vcol0;
#endif
}

// The pass at n0 of gated_out_project (acc = (g * o) Wo^T, cb the biases bo) into the
// block's rows of out (rows of D floats).
__device__ __forceinline__ void store_out(Tile& acc, int n0, const float2 (&cb)[4], int D,
                                          pair_t* block_out, int rows_here) {
    int col[4];
    const bool packed[4] = {false, false, false, false};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int n = pair_column(n0, j);
        col[j] = n < D ? n : -1;
        if (n < D) map_column(acc, j, cb[j], [](float2 v) { return v; });
    }
#if PAIR_DTYPE == PAIR_F32
    store_pairs<false>(acc, block_out, col, packed, D, rows_here);
#else  // (rounded to the pair's 16 bits, two per word)
    (void)packed;
#pragma unroll
    for (int s = 0; s < TROWS; ++s) {
        const int r = thread_row(s);
        if (r >= rows_here) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (col[j] < 0) continue;
            const float* const p = pair_at(acc, s, j);
            pair_st2(block_out + (r * D + col[j]), make_float2(p[0], p[1]));
        }
    }
#endif
}

#if OUT_TRANSPOSED
// store_out for the ending node: block row r (pair row m0 + r of the transposed pair) into
// the caller's row caller_row(m0 + r, N) of out (common.cuh), a row's address each.
__device__ __forceinline__ void store_out_transposed(Tile& acc, int n0, const float2 (&cb)[4],
                                                     int D, pair_t* out, i64 m0, int N,
                                                     int rows_here) {
    int col[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int n = pair_column(n0, j);
        col[j] = n < D ? n : -1;
        if (n < D) map_column(acc, j, cb[j], [](float2 v) { return v; });
    }
#pragma unroll
    for (int s = 0; s < TROWS; ++s) {
        const int r = thread_row(s);
        if (r >= rows_here) continue;
        pair_t* const row = out + caller_row(m0 + r, N) * D;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (col[j] < 0) continue;
            const float* const p = pair_at(acc, s, j);
            pair_st2(row + col[j], make_float2(p[0], p[1]));
        }
    }
}
#endif

// gated_out_project's store of a pass (store(acc, n0, cb), as project_columns calls it):
// into the block's rows of out (store_out; `out` its first row), or (OUT_TRANSPOSED) each
// into the caller's row (store_out_transposed; `out` the whole output). out_rows makes one.
struct OutRows {
    pair_t* out;
    i64 m0;
    int D, N, rows_here;
    __device__ __forceinline__ void operator()(Tile& acc, int n0, const float2 (&cb)[4]) const {
#if OUT_TRANSPOSED
        store_out_transposed(acc, n0, cb, D, out, m0, N, rows_here);
#else
        store_out(acc, n0, cb, D, out, rows_here);
#endif
    }
};
__device__ __forceinline__ OutRows out_rows(pair_t* out, i64 m0, int D, int N, int rows_here) {
    return OutRows{OUT_TRANSPOSED ? out : out + m0 * D, m0, D, N, rows_here};
}
