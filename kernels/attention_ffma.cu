// Masked, biased softmax attention along the last pair axis, flash-style, FFMA (fp32).
// For every row (b, i), head h and query j (all pre-scaled by log2 e, so softmax is in
// base 2 and exp2f is one instruction):
//
//   s[k]         = q[b,i,j,h] . k[b,i,k,h] + bias[b,h,j,k]    # bias = -inf where masked
//   o[b,i,j,h]   = sum_k 2^(s[k] - max s) v[b,i,k,h] / sum_k 2^(s[k] - max s)
//
// Keys are visited BK at a time with a running maximum m and running sum l per query
// (online softmax): no N x N score matrix exists beyond one BQ x BK tile in shared memory.
// A query whose every key is masked ends with l = 0: its output is 0 (fully_masked="zero")
// or NaN ("nan", as the PyTorch reference).
//
// Launch: grid (ceil(N/BQ) * N * H * B) flattened (attention_block), query tile fastest, so
// the blocks that share one (row, head)'s keys and values run together and find them in
// L2; block 128
// threads; dynamic shared memory 4*(HEAD_DIM*(BQ + BK) + BK*DV + BK*PSTR) bytes.
// Pointers (float32): qkvg [B*N*N, 4D] with q at column h*d, k at D + h*d, v at 2D + h*d
// (o overwrites q: only this block reads those q values); bias [B, H, N, NPK], NPK a
// multiple of BK with -inf on the padded keys; key_extent [B] (key_extent.cu) or null: the
// key loop stops at the tile holding key key_extent[b] - 1 (visited_keys).
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 32     // d, a multiple of 4, at most 128
#endif
#ifndef BQ
#define BQ 128          // queries per block (16 thread rows x TM)
#endif
#ifndef BK
#define BK 64           // keys per tile (8 thread columns x TN)
#endif
#define THREADS 128
#define TM (BQ / 16)                    // queries per thread: ty*TM + r
#define TN (BK / 8)                     // keys per thread: 32*u + tx*4 + e
#define DV (((HEAD_DIM + 31) / 32) * 32)  // value columns, padded to whole float4 groups
#define CW (DV / 8)                     // value columns per thread: 32*w + tx*4 + e
#define PSTR (BQ + 4)                   // row stride of Pt: +4 staggers the banks of the P stores

// Rows [first, first + ROWS_T) of the column block [col, col + HEAD_DIM) of `row` (row r at
// r ld), transposed into dst [HEAD_DIM][ROWS_T], rows past N zero: the query tile (q's
// columns) and each key tile (k's), so that a thread's TM queries (TN keys) of one column
// are float4 loads of shared memory. Consecutive threads take consecutive rows:
// conflict-free transposed stores.
template <int ROWS_T>
__device__ __forceinline__ void load_transposed(float* dst, const float* row, i64 ld, int col, int first,
                                                int N) {
    for (int idx = threadIdx.x; idx < ROWS_T * (HEAD_DIM / 4); idx += THREADS) {
        const int rl = idx % ROWS_T, c = (idx / ROWS_T) * 4, r = first + rl;
        const float4 v = r < N ? ld4(row + (i64)r * ld + col + c) : zero4();
        dst[(c + 0) * ROWS_T + rl] = v.x;
        dst[(c + 1) * ROWS_T + rl] = v.y;
        dst[(c + 2) * ROWS_T + rl] = v.z;
        dst[(c + 3) * ROWS_T + rl] = v.w;
    }
}

// The value tile of keys [k0, k0 + BK) as is, into Vs [BK][DV]: zero past N and past d (a
// padded column contributes 0 to every output column it does not reach).
__device__ __forceinline__ void load_value_tile(float* Vs, const float* row, i64 ld, int D, int k0, int N) {
    for (int idx = threadIdx.x; idx < BK * (DV / 4); idx += THREADS) {
        const int c = (idx % (DV / 4)) * 4, kl = idx / (DV / 4), k = k0 + kl;
        const float4 v = (k < N && c < HEAD_DIM) ? ld4(row + (i64)k * ld + 2 * D + c) : zero4();
        st4(Vs + kl * DV + c, v);
    }
}

// The online softmax's start: no key seen (m = -inf), sums l and outputs o zero. l is this
// thread's share of its query's row sum; the 8 shares are added at the end.
__device__ __forceinline__ void start_softmax(float (&o)[TM][CW], float (&m)[TM], float (&l)[TM]) {
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        m[r] = neg_inf();
        l[r] = 0.f;
#pragma unroll
        for (int c = 0; c < CW; ++c) o[r][c] = 0.f;
    }
}

// A score tile's start: S = 0, the products added by accumulate_outer.
__device__ __forceinline__ void zero_scores(float (&s)[TM][TN]) {
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
        for (int e = 0; e < TN; ++e) s[r][e] = 0.f;
}

// 4 W consecutive floats of shared memory from `at`, the float4 w at at + STRIDE w, into x.
template <int W, int STRIDE>
__device__ __forceinline__ void load_strided4(float (&x)[4 * W], const float* at) {
#pragma unroll
    for (int w = 0; w < W; ++w) {
        const float4 v = *reinterpret_cast<const float4*>(at + STRIDE * w);
        x[4 * w + 0] = v.x; x[4 * w + 1] = v.y; x[4 * w + 2] = v.z; x[4 * w + 3] = v.w;
    }
}

// acc += A B over STEPS steps, the product of both tile products of an iteration (S = Q K^T
// with STEPS = d, O += P V with STEPS = BK): at step c this thread's TM rows of A
// (A + c LDA + ty TM, consecutive) into a and NB columns of B (B + c LDB + 32 w + tx 4,
// float4 groups 32 apart: the 8 lanes of a row read one 128-byte line) into b, then their
// outer product. (a and b are the caller's: arrays declared here came before the caller's
// own in the compiler's order of promotion, and the registers were numbered otherwise.)
template <int STEPS, int LDA, int LDB, int NB>
__device__ __forceinline__ void accumulate_outer(float (&acc)[TM][NB], float (&a)[TM], float (&b)[NB],
                                                 const float* A, const float* B, int ty, int tx) {
#pragma unroll 4
    for (int c = 0; c < STEPS; ++c) {
        load_strided4<TM / 4, 4>(a, A + c * LDA + ty * TM);
        load_strided4<NB / 4, 32>(b, B + c * LDB + tx * 4);
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int e = 0; e < NB; ++e) acc[r][e] = fmaf(a[r], b[e], acc[r][e]);
    }
}

// x combined over the 8 lanes that share ty (lanes ^ 1, 2, 4): they hold one query's keys.
__device__ __forceinline__ float max_over_row_lanes(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
}
__device__ __forceinline__ float sum_over_row_lanes(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    return x;
}

// Keys masked for every query of this row i: -inf, as a masked bias entry, before the bias
// is added (-inf + a finite bias stays -inf; here, not after the bias, one word live at a
// time: the words of the whole tile held through the bias loop pushed the 255-register
// kernels into spills). This thread's keys k0 + 32 u + 4 tx + e are bits 4 tx + e of word
// (k0 + 32 u) / 32 (BK a multiple of 32). keep_row: this row's key bits (common.cuh).
__device__ __forceinline__ void mask_row_keys(float (&s)[TM][TN], const unsigned* __restrict__ keep_row, int k0,
                                              int tx) {
#pragma unroll
    for (int u = 0; u < TN / 4; ++u) {
        const unsigned keep = __ldg(keep_row + (k0 >> 5) + u) >> (4 * tx);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (!((keep >> e) & 1u))
#pragma unroll
                for (int r = 0; r < TM; ++r) s[r][4 * u + e] = neg_inf();
    }
}

// One query's scores of keys [k0, k0 + BK), + its pair-bias row brow (shared by every row
// i; -inf where masked), then the online softmax: s becomes 2^(s - m) with m the running maximum,
// and l (this thread's share of the row sum) and the query's outputs o are rescaled to it.
__device__ __forceinline__ void bias_and_online_softmax_row(float (&s)[TN], const float* brow, int k0, int tx,
                                                            float& m, float& l, float (&o)[CW]) {
#pragma unroll
    for (int u = 0; u < TN / 4; ++u) {
        const float4 v = ld4(brow + k0 + 32 * u + tx * 4);
        s[4 * u + 0] += v.x; s[4 * u + 1] += v.y;
        s[4 * u + 2] += v.z; s[4 * u + 3] += v.w;
    }
    float mx = s[0];
#pragma unroll
    for (int e = 1; e < TN; ++e) mx = fmaxf(mx, s[e]);
    mx = max_over_row_lanes(mx);
    float alpha;
    const float m_ref = online_max_update(m, mx, alpha);
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < TN; ++e) {
        s[e] = exp2f(s[e] - m_ref);
        sum += s[e];
    }
    l = fmaf(l, alpha, sum);
#pragma unroll
    for (int c = 0; c < CW; ++c) o[c] *= alpha;
}

// Every query of this thread: bias_and_online_softmax_row, with its row of the pair bias
// bias_bh [N][npk] of this (b, head) (queries past N: row N - 1, any finite row).
__device__ __forceinline__ void bias_and_online_softmax(float (&s)[TM][TN], const float* bias_bh, int npk,
                                                        int q0, int k0, int ty, int tx, int N, float (&m)[TM],
                                                        float (&l)[TM], float (&o)[TM][CW]) {
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        const int j = min(q0 + ty * TM + r, N - 1);
        bias_and_online_softmax_row(s[r], bias_bh + (i64)j * npk, k0, tx, m[r], l[r], o[r]);
    }
}

// P^T to shared memory: the P V product needs every key of a query, held by 8 lanes.
__device__ __forceinline__ void store_pt(float* Pt, const float (&s)[TM][TN], int ty, int tx) {
#pragma unroll
    for (int u = 0; u < TN / 4; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int w = 0; w < TM / 4; ++w)
                st4(Pt + (32 * u + tx * 4 + e) * PSTR + ty * TM + 4 * w,
                    make_float4(s[4 * w + 0][4 * u + e], s[4 * w + 1][4 * u + e],
                                s[4 * w + 2][4 * u + e], s[4 * w + 3][4 * u + e]));
}

// o / l of this thread's queries, written over their q. l = 0 only when every key was masked
// (the maximum term of a row with any unmasked key is 2^0 = 1): 0, or NaN (nan_fully_masked).
__device__ __forceinline__ void store_output(float* row, i64 ld, const float (&o)[TM][CW], const float (&l)[TM],
                                             int q0, int ty, int tx, int N, int nan_fully_masked) {
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        const float total = sum_over_row_lanes(l[r]);
        const int j = q0 + ty * TM + r;
        if (j >= N) continue;
        const bool fully_masked = total == 0.f;
        const float inv = fully_masked ? 0.f : 1.0f / total;
        const float fill = nan_fully_masked ? quiet_nan() : 0.f;
        float* out = row + (i64)j * ld;
#pragma unroll
        for (int w = 0; w < CW / 4; ++w) {
            const int c = 32 * w + tx * 4;
            if (c >= HEAD_DIM) continue;
            float4 v = make_float4(o[r][4 * w + 0] * inv, o[r][4 * w + 1] * inv,
                                   o[r][4 * w + 2] * inv, o[r][4 * w + 3] * inv);
            if (fully_masked) v = make_float4(fill, fill, fill, fill);
            st4(out + c, v);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attention_ffma_fp32(float* qkvg, const float* __restrict__ bias, int B, int N, int H, int npk,
               int nan_fully_masked
               ATTENTION_TAIL_ARGS  // key_extent, row_mask, row range (common.cuh)
               ) {
    wait_for_previous_kernel();  // q, k, v, the bias and the key extent come from it
    allow_next_kernel();
    extern __shared__ float4 smem4[];
    float* Qt = reinterpret_cast<float*>(smem4);  // [HEAD_DIM][BQ]  q^T of this query tile
    float* Kt = Qt + HEAD_DIM * BQ;               // [HEAD_DIM][BK]  k^T of one key tile
    float* Vs = Kt + HEAD_DIM * BK;               // [BK][DV]        v, zero past d
    float* Pt = Vs + BK * DV;                     // [BK][PSTR]      p^T = 2^(s - m)

    const int D = H * HEAD_DIM;
    const i64 ld = 4LL * D;
    ATTENTION_BLOCK(blk, i_end, N, H, BQ, 1);  // (one row per block: never past i_end)
    (void)i_end;
    const int qtile = blk.qtile, head = blk.head, b = blk.b;
    const i64 bi = (i64)b * N + blk.i0;  // the row of the pair this block attends along
    const int t = threadIdx.x, lane = t & 31, tx = lane & 7, ty = (t >> 5) * 4 + (lane >> 3);
    const int q0 = qtile * BQ;
    float* row = qkvg + bi * N * ld + head * HEAD_DIM;  // + j*ld: position (b, i, j), head
    const float* bias_bh = bias + ((i64)b * H + head) * N * npk;
    const int keys = visited_keys(key_extent, b, N);
#if ROW_MASK
    const unsigned* const keep_row = row_mask + bi * (npk / 32);  // this row's key bits
#endif

    load_transposed<BQ>(Qt, row, ld, 0, q0, N);

    float o[TM][CW], m[TM], l[TM];
    start_softmax(o, m, l);

    for (int k0 = 0; k0 < keys; k0 += BK) {
        __syncthreads();  // the previous tile's Kt, Vs and Pt are no longer read
        // Key tile transposed (as Qt); value tile as is. Keys past N are zero, so their
        // scores are 0 + bias = -inf and their values contribute 0 * 0.
        load_transposed<BK>(Kt, row, ld, D, k0, N);
        load_value_tile(Vs, row, ld, D, k0, N);
        __syncthreads();  // Qt (first pass), Kt and Vs visible to every thread

        // S = Q K^T for this thread's TM queries x TN keys.
        float s[TM][TN];
        zero_scores(s);
        float a[TM], kv[TN];
        accumulate_outer<HEAD_DIM, BQ, BK>(s, a, kv, Qt, Kt, ty, tx);

#if ROW_MASK
        mask_row_keys(s, keep_row, k0, tx);
#endif
        bias_and_online_softmax(s, bias_bh, npk, q0, k0, ty, tx, N, m, l, o);
        store_pt(Pt, s, ty, tx);
        __syncthreads();  // all of P written before any thread reads a row it did not write

        // O += P V for this thread's TM queries x CW value columns.
        float p[TM], v[CW];
        accumulate_outer<BK, PSTR, DV>(o, p, v, Pt, Vs, ty, tx);
    }

    store_output(row, ld, o, l, q0, ty, tx, N, nan_fully_masked);
}
