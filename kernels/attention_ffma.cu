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

extern "C" __global__ void __launch_bounds__(THREADS, 1)
attention_ffma_fp32(float* qkvg, const float* __restrict__ bias, int B, int N, int H, int npk,
               int nan_fully_masked, const int* __restrict__ key_extent
#if ROW_MASK
               , const unsigned* __restrict__ row_mask  // [B N][npk / 32] key bits (common.cuh)
#endif
               ROW_BLOCK_ARGS  // (common.cuh ROW_BLOCK: the rows [row_begin, row_end))
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

    // Query tile, transposed so that a thread's TM queries are TM/4 float4 loads.
    // Consecutive threads take consecutive queries: conflict-free transposed stores.
    for (int idx = t; idx < BQ * (HEAD_DIM / 4); idx += THREADS) {
        const int jl = idx % BQ, c = (idx / BQ) * 4, j = q0 + jl;
        const float4 v = j < N ? ld4(row + (i64)j * ld + c) : zero4();
        Qt[(c + 0) * BQ + jl] = v.x;
        Qt[(c + 1) * BQ + jl] = v.y;
        Qt[(c + 2) * BQ + jl] = v.z;
        Qt[(c + 3) * BQ + jl] = v.w;
    }

    float o[TM][CW], m[TM], l[TM];
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        m[r] = neg_inf();
        l[r] = 0.f;  // this thread's share of the row sum; the 8 shares are added at the end
#pragma unroll
        for (int c = 0; c < CW; ++c) o[r][c] = 0.f;
    }

    for (int k0 = 0; k0 < keys; k0 += BK) {
        __syncthreads();  // the previous tile's Kt, Vs and Pt are no longer read
        // Key tile transposed (as Qt); value tile as is. Keys past N are zero, so their
        // scores are 0 + bias = -inf and their values contribute 0 * 0.
        for (int idx = t; idx < BK * (HEAD_DIM / 4); idx += THREADS) {
            const int kl = idx % BK, c = (idx / BK) * 4, k = k0 + kl;
            const float4 v = k < N ? ld4(row + (i64)k * ld + D + c) : zero4();
            Kt[(c + 0) * BK + kl] = v.x;
            Kt[(c + 1) * BK + kl] = v.y;
            Kt[(c + 2) * BK + kl] = v.z;
            Kt[(c + 3) * BK + kl] = v.w;
        }
        for (int idx = t; idx < BK * (DV / 4); idx += THREADS) {
            const int c = (idx % (DV / 4)) * 4, kl = idx / (DV / 4), k = k0 + kl;
            const float4 v = (k < N && c < HEAD_DIM) ? ld4(row + (i64)k * ld + 2 * D + c) : zero4();
            st4(Vs + kl * DV + c, v);
        }
        __syncthreads();  // Qt (first pass), Kt and Vs visible to every thread

        // S = Q K^T for this thread's TM queries x TN keys.
        float s[TM][TN];
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int e = 0; e < TN; ++e) s[r][e] = 0.f;
#pragma unroll 4
        for (int c = 0; c < HEAD_DIM; ++c) {
            float a[TM], kv[TN];
#pragma unroll
            for (int w = 0; w < TM / 4; ++w) {
                const float4 v = *reinterpret_cast<const float4*>(Qt + c * BQ + ty * TM + 4 * w);
                a[4 * w + 0] = v.x; a[4 * w + 1] = v.y; a[4 * w + 2] = v.z; a[4 * w + 3] = v.w;
            }
#pragma unroll
            for (int u = 0; u < TN / 4; ++u) {
                const float4 v = *reinterpret_cast<const float4*>(Kt + c * BK + 32 * u + tx * 4);
                kv[4 * u + 0] = v.x; kv[4 * u + 1] = v.y; kv[4 * u + 2] = v.z; kv[4 * u + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < TM; ++r)
#pragma unroll
                for (int e = 0; e < TN; ++e) s[r][e] = fmaf(a[r], kv[e], s[r][e]);
        }

#if ROW_MASK
        // Keys masked for every query of this row i: -inf, as a masked bias entry, before
        // the bias is added (-inf + a finite bias stays -inf; here, not after the bias, one
        // word live at a time: the words of the whole tile held through the bias loop
        // pushed the 255-register kernels into spills). This thread's keys k0 + 32 u +
        // 4 tx + e are bits 4 tx + e of word (k0 + 32 u) / 32 (BK a multiple of 32).
#pragma unroll
        for (int u = 0; u < TN / 4; ++u) {
            const unsigned keep = __ldg(keep_row + (k0 >> 5) + u) >> (4 * tx);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!((keep >> e) & 1u))
#pragma unroll
                    for (int r = 0; r < TM; ++r) s[r][4 * u + e] = neg_inf();
        }
#endif
        // + pair bias (shared by every row i; -inf where masked), then the online softmax.
#pragma unroll
        for (int r = 0; r < TM; ++r) {
            const int j = min(q0 + ty * TM + r, N - 1);  // queries past N: any finite row
            const float* brow = bias_bh + (i64)j * npk + k0;
#pragma unroll
            for (int u = 0; u < TN / 4; ++u) {
                const float4 v = ld4(brow + 32 * u + tx * 4);
                s[r][4 * u + 0] += v.x; s[r][4 * u + 1] += v.y;
                s[r][4 * u + 2] += v.z; s[r][4 * u + 3] += v.w;
            }
            float mx = s[r][0];
#pragma unroll
            for (int e = 1; e < TN; ++e) mx = fmaxf(mx, s[r][e]);
            // The 8 lanes sharing ty hold this query's BK keys.
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            float alpha;
            const float m_ref = online_max_update(m[r], mx, alpha);
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < TN; ++e) {
                s[r][e] = exp2f(s[r][e] - m_ref);
                sum += s[r][e];
            }
            l[r] = fmaf(l[r], alpha, sum);
#pragma unroll
            for (int c = 0; c < CW; ++c) o[r][c] *= alpha;
        }

        // P^T to shared memory: the P V product needs every key of a query, held by 8 lanes.
#pragma unroll
        for (int u = 0; u < TN / 4; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e)
#pragma unroll
                for (int w = 0; w < TM / 4; ++w)
                    st4(Pt + (32 * u + tx * 4 + e) * PSTR + ty * TM + 4 * w,
                        make_float4(s[4 * w + 0][4 * u + e], s[4 * w + 1][4 * u + e],
                                    s[4 * w + 2][4 * u + e], s[4 * w + 3][4 * u + e]));
        __syncthreads();  // all of P written before any thread reads a row it did not write

        // O += P V for this thread's TM queries x CW value columns.
#pragma unroll 4
        for (int kk = 0; kk < BK; ++kk) {
            float p[TM], v[CW];
#pragma unroll
            for (int w = 0; w < TM / 4; ++w) {
                const float4 x = *reinterpret_cast<const float4*>(Pt + kk * PSTR + ty * TM + 4 * w);
                p[4 * w + 0] = x.x; p[4 * w + 1] = x.y; p[4 * w + 2] = x.z; p[4 * w + 3] = x.w;
            }
#pragma unroll
            for (int w = 0; w < CW / 4; ++w) {
                const float4 x = *reinterpret_cast<const float4*>(Vs + kk * DV + 32 * w + tx * 4);
                v[4 * w + 0] = x.x; v[4 * w + 1] = x.y; v[4 * w + 2] = x.z; v[4 * w + 3] = x.w;
            }
#pragma unroll
            for (int r = 0; r < TM; ++r)
#pragma unroll
                for (int c = 0; c < CW; ++c) o[r][c] = fmaf(p[r], v[c], o[r][c]);
        }
    }

    // o / l, written over q. l = 0 only when every key was masked (the maximum term of a
    // row with any unmasked key is 2^0 = 1).
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        float total = l[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        total += __shfl_xor_sync(0xffffffffu, total, 4);
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
