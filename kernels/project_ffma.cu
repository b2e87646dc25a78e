// The two projection GEMMs of the pipeline. Each block owns BM rows (pair positions),
// holds their whole D-wide row tile in shared memory, and computes every output column
// of those rows, so the pair representation is read from device memory exactly once.
//
//   ln_qkvg_project:   xn = LayerNorm(x)                              # [M, D]
//                      qkvg = xn [Wq; Wk; Wv; Wg]^T + [bq; bk; bv; bg] # [M, 4D]
//                        q columns scaled by log2(e)/sqrt(d), gate columns through sigmoid,
//                        k and v stored as the layout says
//                      bias[b, head, i, j] = log2(e) * xn[m] . Wb[head]  # m = (b, i, j)
//                        -inf where mask[b, i, j] == 0, and on the padded keys j in [N, NPK)
//   gated_out_project: out = (g * o) Wo^T + bo                        # [M, D]
//                        o = qkvg[:, 0:D] (attention output, written over q)
//                        g = the sigmoid gate (fp32 at qkvg[:, 3D:4D], or packed
//                          bf16: the layout's features, project_epilogue.cuh)
//
// The products run on FFMA (8x8 register tiles per thread, fp32: the "fp32" precision
// mode). The tensor-core projections of the "tf32" and "bf16" modes are project_mma.cu,
// whose row-major tiles suit ldmatrix; this k-major tile suits the FFMA threads, which
// read 4 consecutive rows of one k as one float4. LayerNorm statistics, the biases and
// the gate are fp32.
//
// Launch: grid (ceil(M / BM)), block THREADS = 256, dynamic shared memory
//   8*BM + 4*(DPAD*ASTR + WSTAGES*BK*WSTR + THREADS) bytes, DPAD = D rounded up to BK.
// Pointers (float32 unless noted, M = B*N*N rows):
//   x     [B, N, N, D] of pair_t (PAIR_DTYPE, project_math.cuh: float32, float16 or
//         bfloat16; out too) at b*sb + i*si + j*sj + c*sc elements (any strides; x_vec = 1 when
//         sc == 1 and every row starts 16-byte aligned, enabling float4 loads)
//   WT    [D, NO] row-major: the PyTorch weight transposed (NO = 4D, or D for out_proj)
//   mask  [B, N, N] at b*mb + i*mi + j*mj elements, of the type named by mask_kind
//         (MASK_* in project_epilogue.cuh; read as is, so the caller converts nothing), or null
//   qkvg  [M, 4D]; bias [B, H, N, NPK] (fp16 for rows_bf16); out [M, D] contiguous; vt unused (the tiled layouts
//         are written by the tensor-core projections only).
#include "common.cuh"
#include "mma.cuh"

#ifndef BM
#define BM 128          // rows per block: 128, or 64 for large D (shared memory)
#endif
#define BN 128          // output columns per pass
#define BK 16           // reduction chunk of the weight
#ifndef WSTAGES
#define WSTAGES 4       // weight chunks in the shared-memory ring (2 where a wide D needs the room)
#endif
#define THREADS 256
#ifndef PROJECT_MIN_BLOCKS  // resident blocks per SM asked of the compiler (__launch_bounds__):
#define PROJECT_MIN_BLOCKS 2  // 2: at most 128 registers (shared memory allows 2 up to D = 320);
#endif                        // 3 (64-row blocks): at most 85
#define TROWS (BM / 16) // rows of a BM x BN output tile per thread (thread_row)
#define TM TROWS        // FFMA: rows per thread: {hm*64 + ty*4 + r}
// FFMA: columns per thread: 8, as {hn*64 + tx*4 + c}, hn in {0, 1}, c in 0..3.
// Row strides of As ([k][m]) and Ws ([k][n]), padded by PAD words (8, or 4 where the tile
// of a wide D would not fit in shared memory otherwise; the FFMA float4 reads are
// conflict-free either way).
#ifndef PAD
#define PAD 8
#endif
#define ASTR (BM + PAD)
#define WSTR (BN + PAD)

// This thread's share of one BM x BN output tile.
struct Tile {
    float c[TM][8];
    __device__ __forceinline__ void zero() {
        float* p = reinterpret_cast<float*>(c);
#pragma unroll
        for (int i = 0; i < (int)(sizeof(c) / sizeof(float)); ++i) p[i] = 0.f;
    }
};

// acc += a_k[0:BK, thread's rows] x w_k[0:BK, thread's columns], 8x8 outer products.
__device__ __forceinline__ void multiply_chunk(const float* a_k, const float* w_k, Tile& acc) {
    const int ty = threadIdx.x / 16, tx = threadIdx.x % 16;
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
        float a[TM], w[8];
#pragma unroll
        for (int hm = 0; hm < TM / 4; ++hm) {
            const float4 v = *reinterpret_cast<const float4*>(a_k + kk * ASTR + hm * 64 + ty * 4);
            a[hm * 4 + 0] = v.x; a[hm * 4 + 1] = v.y; a[hm * 4 + 2] = v.z; a[hm * 4 + 3] = v.w;
        }
#pragma unroll
        for (int hn = 0; hn < 2; ++hn) {
            const float4 v = *reinterpret_cast<const float4*>(w_k + kk * WSTR + hn * 64 + tx * 4);
            w[hn * 4 + 0] = v.x; w[hn * 4 + 1] = v.y; w[hn * 4 + 2] = v.z; w[hn * 4 + 3] = v.w;
        }
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int c = 0; c < 8; ++c) acc.c[r][c] = fmaf(a[r], w[c], acc.c[r][c]);
    }
}

// Column n of this thread's j-th value pair of the pass at n0 (j < 4; the pair is n, n+1).
__device__ __forceinline__ int pair_column(int n0, int j) {
    return n0 + (j / 2) * 64 + (threadIdx.x % 16) * 4 + 2 * (j % 2);
}

// Row slot s < TROWS of this thread: its block row, and its value pair at column pair j.
#define SLOT_RUN 1
__device__ __forceinline__ int thread_row(int s) {
    return (s / 4) * 64 + (threadIdx.x / 16) * 4 + (s % 4);
}
__device__ __forceinline__ float* pair_at(Tile& acc, int s, int j) { return &acc.c[s][2 * j]; }

#include "project_epilogue.cuh"
#if KV_TILED || F16_QKV  // its stores assume qkvg rows of 4D words (block_out, ld below)
#error "project_ffma.cu: the tiled layouts (K, V^T and bias tiles) are written by project_mma.cu only"
#endif

// acc += As[0:dpad, the block's rows] x WT[0:D, n0 + the block's columns].
// As is [dpad][ASTR] (k-major: an FFMA thread's 4 consecutive rows are one float4); Ws is
// a ring of WSTAGES weight chunks [BK][WSTR], copied with cp.async WSTAGES - 1 chunks
// ahead of their product: a chunk is little work, so one chunk ahead left each waiting on
// its L2 latency. Ends with a barrier, so the caller may reuse Ws at once.
__device__ __forceinline__ void block_gemm(const float* As, const float* __restrict__ WT,
                                           int D, int dpad, int NO, int n0, float* Ws,
                                           Tile& acc) {
    const int t = threadIdx.x;
    const u32 ws = smem_addr(Ws);
    const int nchunks = dpad / BK;
    // Chunk kc into its stage: each thread copies 2 of its BK x BN / 4 16-byte pieces; rows
    // past D and columns past NO are zero (they meet the zero rows of As, and an unread
    // garbage NaN would otherwise poison the sum). Committed as one group either way.
    auto issue = [&](int kc) {
        if (kc < nchunks) {
            const u32 stage = ws + 4 * (kc % WSTAGES) * BK * WSTR;
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const int idx = t + p * THREADS;
                const int kk = idx / (BN / 4), n = n0 + (idx % (BN / 4)) * 4, k = kc * BK + kk;
                const bool ok = k < D && n < NO;
                cp_async16_or_zero(stage + 4 * (kk * WSTR + (idx % (BN / 4)) * 4),
                                   ok ? WT + (i64)k * NO + n : WT, ok);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int kc = 0; kc < WSTAGES - 1; ++kc) issue(kc);
    for (int kc = 0; kc < nchunks; ++kc) {
        cp_async_wait<WSTAGES - 2>();  // this thread's pieces of chunk kc landed
        __syncthreads();  // everyone's pieces visible; chunk kc - 1 read by every thread
        issue(kc + WSTAGES - 1);  // into the stage chunk kc - 1 used
        multiply_chunk(As + kc * BK * ASTR, Ws + (kc % WSTAGES) * BK * WSTR, acc);
    }
    __syncthreads();  // every thread done with Ws
}

// The output biases of this thread's value pairs in the pass at n0 (0 past NO): four
// independent loads, so the epilogue waits for them once (a load per value pair, each
// waited for in turn, was ~8% of the projection's stalls). Loaded after the pass's
// product: kept live across it they push the FFMA tiles into spills. (The tensor-core
// kernel stages its biases in shared memory with the pass's first weight chunk.)
__device__ __forceinline__ void load_column_biases(const float* __restrict__ bvec, int n0,
                                                   int NO, float2 (&cb)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int n = pair_column(n0, j);  // even, NO even: n < NO covers n + 1
        cb[j] = n < NO ? ld2(bvec + n) : make_float2(0.f, 0.f);
    }
}

// All NO output columns of the block's rows, BN at a time: acc = As x WT[:, n0 + ...],
// handed with the biases bvec of this thread's column pairs to store(acc, n0, cb), which
// may change acc.
template <class Store>
__device__ __forceinline__ void project_columns(const float* As, const float* __restrict__ WT,
                                                int D, int dpad, int NO,
                                                const float* __restrict__ bvec, float* Ws,
                                                Store store) {
    for (int n0 = 0; n0 < NO; n0 += BN) {
        Tile acc;
        acc.zero();
        block_gemm(As, WT, D, dpad, NO, n0, Ws, acc);
        float2 cb[4];
        load_column_biases(bvec, n0, NO, cb);
        store(acc, n0, cb);
    }
}

// As[k][m] = the float4 load(ml, k) gives for columns k..k+3 of block row ml, for every
// ml < BM and k < dpad (step 4). Loads go out in batches of BATCH per thread before any
// store, so that many are in flight at once (one per trip stalls on each load in turn).
// Consecutive threads take consecutive rows: the shared-memory stores are conflict-free.
template <int BATCH, class Load>
__device__ __forceinline__ void load_tile_transposed(float* As, int dpad, Load load) {
    const int total = (dpad / 4) * BM;
    for (int base = threadIdx.x; base < total; base += BATCH * THREADS) {
        float4 v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int idx = base + u * THREADS;
            v[u] = idx < total ? load(idx % BM, (idx / BM) * 4) : zero4();
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int idx = base + u * THREADS;
            if (idx >= total) break;
            const int ml = idx % BM, k = (idx / BM) * 4;
            As[(k + 0) * ASTR + ml] = v[u].x;
            As[(k + 1) * ASTR + ml] = v[u].y;
            As[(k + 2) * ASTR + ml] = v[u].z;
            As[(k + 3) * ASTR + ml] = v[u].w;
        }
    }
}

struct SmemLayout {
    i64* rowoff;    // [BM]   element offset of each row's first value in x
    float* As;      // [dpad][ASTR]
    float* Ws;      // [WSTAGES][BK][WSTR]
    float* red;     // [THREADS]
};

__device__ __forceinline__ SmemLayout smem_layout(int dpad) {
    extern __shared__ float4 smem4[];
    SmemLayout s;
    s.rowoff = reinterpret_cast<i64*>(smem4);  // first: keeps 8- and 16-byte alignment
    s.As = reinterpret_cast<float*>(s.rowoff + BM);
    s.Ws = s.As + dpad * ASTR;
    s.red = s.Ws + WSTAGES * BK * WSTR;
    return s;
}

// LayerNorm of the row tile in place, THREADS / BM threads per row (thread t: row t % BM,
// columns k = t / BM + p * parts), partial sums combined through `red`: the mean, then the
// squared deviations (two passes: no cancellation), then normalisation in place: xn =
// (x - mean) * rstd * gamma + beta (pad rows k >= D stay 0). The row's mean and rstd stay
// in registers. Rows past 2^40 are scaled first (project_math.cuh); whether any row of the
// block may be is block-uniform (a barrier), and rare. The caller's barrier makes the
// tile visible.
__device__ __forceinline__ void layernorm_columns(float* As, float* red, int D, float eps,
                                                  const float* __restrict__ gamma,
                                                  const float* __restrict__ beta) {
    const int t = threadIdx.x;
    const int ml = t % BM, part = t / BM, parts = THREADS / BM;
    float* const col = As + ml;
    float acc = 0.f, amax = 0.f;
#pragma unroll 8  // the loads of 8 trips in flight, not one trip's latency per trip
    for (int k = part; k < D; k += parts) {
        const float v = col[k * ASTR];
        acc += v;
        amax = fmaxf(amax, fabsf(v));
    }
    red[t] = acc;
    float eps_row = eps;  // eps f^2 for a row scaled by f (project_math.cuh)
    // Partial sums visible, and whether any row of the block may pass 2^40 (this
    // thread's part of it does). Then each thread finds its row's largest magnitude, and
    // a row past 2^40 is scaled in place, its sums again.
    if (__syncthreads_or(ln_row_is_huge(amax))) {
        float row_max = 0.f;
        for (int k = 0; k < D; ++k) row_max = fmaxf(row_max, fabsf(col[k * ASTR]));
        __syncthreads();  // every row read whole before any is scaled
        if (ln_row_is_huge(row_max)) {
            const float f = ln_row_scale(row_max);
            eps_row = ln_scaled_eps(eps, f);
            acc = 0.f;
            for (int k = part; k < D; k += parts) {
                const float v = col[k * ASTR] * f;
                col[k * ASTR] = v;
                acc += v;
            }
            red[t] = acc;
        }
        __syncthreads();  // scaled rows and their partial sums visible
    }
    float tot = 0.f;
    for (int p = 0; p < parts; ++p) tot += red[p * BM + ml];
    const float mu = tot / D;
    __syncthreads();  // every row's sums read; red free again
    acc = 0.f;
#pragma unroll 8
    for (int k = part; k < D; k += parts) {
        const float dev = col[k * ASTR] - mu;
        acc = fmaf(dev, dev, acc);
    }
    red[t] = acc;
    __syncthreads();  // partial sums visible
    tot = 0.f;
    for (int p = 0; p < parts; ++p) tot += red[p * BM + ml];
    const float rstd = inverse_sqrt(tot / D + eps_row);  // biased variance, as torch.nn.LayerNorm
    // gamma[k], beta[k]: one address per warp, a broadcast load; unrolled, so that the
    // loads of several trips are in flight together (one at a time, their latency was 8%
    // of the kernel's stall samples).
#pragma unroll 4
    for (int k = part; k < D; k += parts)
        col[k * ASTR] = (col[k * ASTR] - mu) * rstd * __ldg(gamma + k) + __ldg(beta + k);
}

// The pair bias with the mask folded in: one dot product of length D per (row, head) of
// the block, log2(e) folded into Wb, -inf where the mask drops the row
// (store_pair_bias). A thread per (row, head), rows fastest.
__device__ __forceinline__ void pair_bias(const float* As, const float* __restrict__ Wb, int D,
                                          int H, BlockRows rows, int N, i64 NN,
                                          const void* __restrict__ mask, int mask_kind, i64 mb,
                                          i64 mi, i64 mj, bias_t* __restrict__ bias, int npk) {
    // (ROW_BLOCK: none with a null bias, a block's projection after the bias pass)
    for (int p = threadIdx.x; p < (ROW_BLOCK && bias == nullptr ? 0 : BM * H); p += THREADS) {
        const int ml = p % BM, head = p / BM;
        const i64 m = rows.m0 + ml;
        if (m >= rows.M) continue;
        const i64 b = m / NN, r = m - b * NN, i = r / N, j = r - i * N;
        // The mask element first: its load is in flight during the dot product.
        const bool keep = mask_keeps(mask, mask_kind, b * mb + i * mi + j * mj);
        const float* w = Wb + (i64)head * D;  // one address per warp: a broadcast
        float4 part = zero4();  // four chains in flight (D % 4 == 0)
        // Unrolled: 4 trips' weight loads in flight together (loaded one trip ahead, each
        // trip waited on its load: 20% of the kernel's stall samples).
#pragma unroll 4
        for (int k = 0; k < D; k += 4) {
            const float4 wk = ld4(w + k);
            part.x = fmaf(As[(k + 0) * ASTR + ml], wk.x, part.x);
            part.y = fmaf(As[(k + 1) * ASTR + ml], wk.y, part.y);
            part.z = fmaf(As[(k + 2) * ASTR + ml], wk.z, part.z);
            part.w = fmaf(As[(k + 3) * ASTR + ml], wk.w, part.w);
        }
        const float dot = (part.x + part.y) + (part.z + part.w);
        store_pair_bias(bias + ((b * H + head) * N + i) * (i64)npk, j, N, npk, keep, dot);
    }
}

// The raw row tile of the block's rows (rowoff: where each starts in x), transposed into
// As[k][m]; zero past M and past D.
__device__ __forceinline__ void load_row_tile(float* As, int dpad, const i64* rowoff,
                                              const pair_t* __restrict__ x, i64 sc, int x_vec,
                                              int D, BlockRows rows) {
    load_tile_transposed<8>(As, dpad, [&](int ml, int k) {
        if (rows.m0 + ml >= rows.M || k >= D) return zero4();
        const pair_t* p = x + rowoff[ml];
        if (x_vec) return pair_ld4(p + k);
        return make_float4(pair_value(p[k * sc]), pair_value(p[(k + 1) * sc]),
                           pair_value(p[(k + 2) * sc]), pair_value(p[(k + 3) * sc]));
    });
}

extern "C" __global__ void __launch_bounds__(THREADS, PROJECT_MIN_BLOCKS)
ln_qkvg_project_ffma_fp32(LN_QKVG_PARAMS(WT)  // (project_epilogue.cuh)
                ROW_BLOCK_ARGS  // (common.cuh ROW_BLOCK: the rows [row_begin, row_end))
                ) {
    allow_next_kernel();  // the attention may launch (it waits for this kernel: common.cuh)
    const int dpad = (D + BK - 1) / BK * BK;
    const SmemLayout s = smem_layout(dpad);
    const i64 NN = (i64)N * N;  // (N N: rows per batch)
    const BlockRows rows = block_rows(B, N, NN, ROW_RANGE);

    // 1. Where each row starts in x.
    row_offsets(s.rowoff, rows.m0, rows.M, N, sb, si, sj);
    __syncthreads();  // rowoff visible to every loader

    // 2. The raw row tile, transposed into As[k][m]; zero past M and past D.
    load_row_tile(s.As, dpad, s.rowoff, x, sc, x_vec, D, rows);
    __syncthreads();  // tile complete before the statistics read it

    // 3. LayerNorm, in place (xn as the products take it).
    layernorm_columns(s.As, s.red, D, eps, gamma, beta);
    __syncthreads();  // normalised tile complete

    // 4. The pair bias with the mask folded in (ROW_BLOCK: none with a null bias, a
    //    block's projection after the bias pass: common.cuh).
    pair_bias(s.As, Wb, D, H, rows, N, NN, mask, mask_kind, mb, mi, mj,
              reinterpret_cast<bias_t*>(bias), npk);

    // 5. q, k, v and gate: every 4D output column of these rows, BN at a time.
    if constexpr (!BIAS_ONLY) {
        const int NO = 4 * D, rows_here = rows.here();
        float* const block_out = qkvg + rows.m0 * NO;  // row r at r NO (< 2^31: BM 4D)
        project_columns(s.As, WT, D, dpad, NO, b_qkvg, s.Ws,
                        [&](Tile& acc, int n0, const float2 (&cb)[4]) {
            store_qkvg(acc, n0, cb, D, q_scale, block_out, rows_here,
                       VtTarget{vt, rows.m0, N, H, npk});
        });
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, PROJECT_MIN_BLOCKS)
gated_out_project_ffma_fp32(GATED_OUT_PARAMS(WT) OUT_TRANSPOSED_ARGS) {  // (project_epilogue.cuh)
    const int dpad = (D + BK - 1) / BK * BK;
    const SmemLayout s = smem_layout(dpad);
    const i64 m0 = (i64)blockIdx.x * BM, ld = 4LL * D;
    wait_for_previous_kernel();  // o comes from the attention (common.cuh)

    // 1. A = g * o, transposed into As[k][m]: the gated intermediate exists only here.
    //    Batches of 8 (16 loads in flight per thread): this kernel waits on these loads.
    load_tile_transposed<8>(s.As, dpad, [&](int ml, int k) {
        if (m0 + ml >= M || k >= D) return zero4();
        const float* row = qkvg + (m0 + ml) * ld;
        const float4 o = ld4(row + k), g = load_gate4(row, D, k);
        return make_float4(g.x * o.x, g.y * o.y, g.z * o.z, g.w * o.w);
    });
    __syncthreads();  // tile complete before the product reads it

    // 2. out = A Wo^T + bo.
    const int rows_here = (int)min((i64)BM, M - m0);
    project_columns(s.As, WT, D, dpad, D, b_out, s.Ws, out_rows(out, m0, D, OUT_N, rows_here));
}
