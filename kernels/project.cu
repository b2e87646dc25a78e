// The two projection GEMMs of the pipeline. Each block owns BM rows (pair positions),
// holds their whole D-wide row tile in shared memory, and computes every output column
// of those rows, so the pair representation is read from device memory exactly once.
//
//   ln_qkvg_project:   xn = LayerNorm(x)                              # [M, D]
//                      qkvg = xn [Wq; Wk; Wv; Wg]^T + [bq; bk; bv; bg] # [M, 4D]
//                        q columns scaled by log2(e)/sqrt(d), gate columns through sigmoid
//                      bias[b, head, i, j] = log2(e) * xn[m] . Wb[head]  # m = (b, i, j)
//                        -inf where mask[b, i, j] == 0, and on the padded keys j in [N, NPK)
//   gated_out_project: out = (g * o) Wo^T + bo                        # [M, D]
//                        o = qkvg[:, 0:D] (attention output, written over q)
//                        g = qkvg[:, 3D:4D] (sigmoid gate)
//
// Launch: grid (ceil(M / BM)), block THREADS = 256, dynamic shared memory
//   8*BM + 4*(DPAD*BM + 2*BK*BN + THREADS + 2*BM) bytes, DPAD = D rounded up to BK.
// Pointers (float32 unless noted, M = B*N*N rows):
//   x     [B, N, N, D] at b*sb + i*si + j*sj + c*sc elements (any strides; x_vec = 1 when
//         sc == 1 and every row starts 16-byte aligned, enabling float4 loads)
//   WT    [D, NO] row-major: the PyTorch weight transposed (NO = 4D, or D for out_proj)
//   mask  [B, N, N] at b*mb + i*mi + j*mj elements, of the type named by mask_kind
//         (MASK_* below; read as is, so the caller converts nothing), or null
//   qkvg  [M, 4D]; bias [B, H, N, NPK]; out [M, D] contiguous.
#include "common.cuh"

#ifndef BM
#define BM 128          // rows per block: 128, or 64 for large D (shared memory)
#endif
#define BN 128          // output columns per pass
#define BK 16           // reduction chunk of the weight, double-buffered
#define THREADS 256
#define TM (BM / 16)    // rows per thread: {hm*64 + ty*4 + r}
// Columns per thread: 8, as {hn*64 + tx*4 + c}, hn in {0, 1}, c in 0..3.

// acc += As[0:dpad, this thread's rows] x WT[0:D, n0 + this thread's columns].
// As is [dpad][BM] (k-major: a thread's 4 consecutive rows are one float4); Ws is the
// [2][BK][BN] staging buffer for weight chunks. Ends with a barrier, so the caller may
// reuse Ws at once.
__device__ __forceinline__ void block_gemm(const float* As, const float* __restrict__ WT,
                                           int D, int dpad, int NO, int n0, float* Ws,
                                           float (&acc)[TM][8]) {
    const int t = threadIdx.x, ty = t / 16, tx = t % 16;
    // Each thread stages 2 float4 of every BK x BN weight chunk.
    float4 stage[2];
    auto load_chunk = [&](int k0) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int idx = t + p * THREADS;
            const int kk = idx / (BN / 4), n = n0 + (idx % (BN / 4)) * 4;
            // Rows past D and columns past NO are zero: they meet the zero rows of As,
            // and an unread garbage NaN would otherwise poison the sum.
            stage[p] = (k0 + kk < D && n < NO) ? ld4(WT + (i64)(k0 + kk) * NO + n) : zero4();
        }
    };
    auto store_chunk = [&](float* buf) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const int idx = t + p * THREADS;
            st4(buf + (idx / (BN / 4)) * BN + (idx % (BN / 4)) * 4, stage[p]);
        }
    };
    const int nchunks = dpad / BK;
    load_chunk(0);
    store_chunk(Ws);
    __syncthreads();  // chunk 0 visible to all threads
    for (int kc = 0; kc < nchunks; ++kc) {
        const float* buf = Ws + (kc & 1) * BK * BN;
        // The next chunk's global loads are in flight while this one is multiplied.
        if (kc + 1 < nchunks) load_chunk((kc + 1) * BK);
        const float* a_k = As + kc * BK * BM;
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            float a[TM], w[8];
#pragma unroll
            for (int hm = 0; hm < TM / 4; ++hm) {
                const float4 v = *reinterpret_cast<const float4*>(a_k + kk * BM + hm * 64 + ty * 4);
                a[hm * 4 + 0] = v.x; a[hm * 4 + 1] = v.y; a[hm * 4 + 2] = v.z; a[hm * 4 + 3] = v.w;
            }
#pragma unroll
            for (int hn = 0; hn < 2; ++hn) {
                const float4 v = *reinterpret_cast<const float4*>(buf + kk * BN + hn * 64 + tx * 4);
                w[hn * 4 + 0] = v.x; w[hn * 4 + 1] = v.y; w[hn * 4 + 2] = v.z; w[hn * 4 + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < TM; ++r)
#pragma unroll
                for (int c = 0; c < 8; ++c) acc[r][c] = fmaf(a[r], w[c], acc[r][c]);
        }
        // The other buffer was last read in iteration kc - 1, which the barrier that
        // ended it has closed, so it can be overwritten now.
        if (kc + 1 < nchunks) store_chunk(Ws + ((kc + 1) & 1) * BK * BN);
        __syncthreads();  // next chunk visible; this chunk's reads done before reuse
    }
}

// Row index of accumulator row r of thread ty within the block.
__device__ __forceinline__ int acc_row(int r, int ty) { return (r / 4) * 64 + ty * 4 + (r % 4); }

// mask_kind: how to read one mask element; "masked" means the element equals zero.
#define MASK_NONE 0
#define MASK_1BYTE 1   // bool, int8, uint8
#define MASK_2BYTE 2   // int16, uint16
#define MASK_4BYTE 3   // int32, uint32
#define MASK_8BYTE 4   // int64, uint64
#define MASK_F16 5
#define MASK_F32 6
#define MASK_F64 7

__device__ __forceinline__ bool mask_keeps(const void* mask, int kind, i64 off) {
    switch (kind) {
        case MASK_NONE: return true;
        case MASK_1BYTE: return static_cast<const unsigned char*>(mask)[off] != 0;
        case MASK_2BYTE: return static_cast<const unsigned short*>(mask)[off] != 0;
        case MASK_4BYTE: return static_cast<const unsigned int*>(mask)[off] != 0u;
        case MASK_8BYTE: return static_cast<const unsigned long long*>(mask)[off] != 0ull;
        // +0 and -0 are the only half-precision zeros; NaN keeps, as in the reference.
        case MASK_F16: return (static_cast<const unsigned short*>(mask)[off] & 0x7fffu) != 0u;
        case MASK_F32: return static_cast<const float*>(mask)[off] != 0.f;
        default: return static_cast<const double*>(mask)[off] != 0.0;
    }
}

__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

struct SmemLayout {
    i64* rowoff;    // [BM]   element offset of each row's first value in x
    float* As;      // [dpad][BM]
    float* Ws;      // [2][BK][BN]
    float* red;     // [THREADS]
    float* mean;    // [BM]
    float* rstd;    // [BM]
};

__device__ __forceinline__ SmemLayout smem_layout(int dpad) {
    extern __shared__ float4 smem4[];
    SmemLayout s;
    s.rowoff = reinterpret_cast<i64*>(smem4);  // first: keeps 8- and 16-byte alignment
    s.As = reinterpret_cast<float*>(s.rowoff + BM);
    s.Ws = s.As + dpad * BM;
    s.red = s.Ws + 2 * BK * BN;
    s.mean = s.red + THREADS;
    s.rstd = s.mean + BM;
    return s;
}

extern "C" __global__ void __launch_bounds__(THREADS)
ln_qkvg_project(const float* __restrict__ x, i64 sb, i64 si, i64 sj, i64 sc, int x_vec,
                int B, int N, int D, int H, float eps, float q_scale,
                const float* __restrict__ gamma, const float* __restrict__ beta,
                const float* __restrict__ WT, const float* __restrict__ b_qkvg,
                const float* __restrict__ Wb,
                const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi, i64 mj,
                float* __restrict__ qkvg, float* __restrict__ bias, int npk) {
    const int dpad = (D + BK - 1) / BK * BK;
    const SmemLayout s = smem_layout(dpad);
    const int t = threadIdx.x;
    const i64 NN = (i64)N * N, M = (i64)B * NN;
    const i64 m0 = (i64)blockIdx.x * BM;

    // 1. Where each row starts in x (64-bit: B*N*N*D passes 2^31 at N ~ 4096).
    if (t < BM) {
        const i64 m = min(m0 + t, M - 1);
        const i64 b = m / NN, r = m - b * NN, i = r / N, j = r - i * N;
        s.rowoff[t] = b * sb + i * si + j * sj;
    }
    __syncthreads();  // rowoff visible to every loader

    // 2. The raw row tile, transposed into As[k][m]; zero past M and past D. Consecutive
    //    threads take consecutive rows, so the shared-memory stores are conflict-free.
    for (int idx = t; idx < (dpad / 4) * BM; idx += THREADS) {
        const int ml = idx % BM, k = (idx / BM) * 4;
        float4 v = zero4();
        if (m0 + ml < M && k < D) {
            const float* p = x + s.rowoff[ml];
            if (x_vec) v = ld4(p + k);
            else v = make_float4(p[k * sc], p[(k + 1) * sc], p[(k + 2) * sc], p[(k + 3) * sc]);
        }
        s.As[(k + 0) * BM + ml] = v.x;
        s.As[(k + 1) * BM + ml] = v.y;
        s.As[(k + 2) * BM + ml] = v.z;
        s.As[(k + 3) * BM + ml] = v.w;
    }
    __syncthreads();  // tile complete before the statistics read it

    // 3. LayerNorm statistics, two passes (mean, then squared deviations: no cancellation),
    //    THREADS / BM threads per row, combined through `red`.
    {
        const int ml = t % BM, part = t / BM, parts = THREADS / BM;
        float acc = 0.f;
        for (int k = part; k < D; k += parts) acc += s.As[k * BM + ml];
        s.red[t] = acc;
        __syncthreads();  // partial sums visible
        if (t < BM) {
            float tot = 0.f;
            for (int p = 0; p < parts; ++p) tot += s.red[p * BM + t];
            s.mean[t] = tot / D;
        }
        __syncthreads();  // mean visible; red free again
        const float mu = s.mean[ml];
        acc = 0.f;
        for (int k = part; k < D; k += parts) {
            const float dev = s.As[k * BM + ml] - mu;
            acc = fmaf(dev, dev, acc);
        }
        s.red[t] = acc;
        __syncthreads();  // partial sums visible
        if (t < BM) {
            float tot = 0.f;
            for (int p = 0; p < parts; ++p) tot += s.red[p * BM + t];
            s.rstd[t] = rsqrtf(tot / D + eps);  // biased variance, as torch.nn.LayerNorm
        }
        __syncthreads();  // rstd visible
    }

    // 4. Normalise in place: xn = (x - mean) * rstd * gamma + beta (pad rows k >= D stay 0).
    for (int idx = t; idx < D * BM; idx += THREADS) {
        const int ml = idx % BM, k = idx / BM;
        s.As[idx] = (s.As[idx] - s.mean[ml]) * s.rstd[ml] * __ldg(gamma + k) + __ldg(beta + k);
    }
    __syncthreads();  // normalised tile complete

    // 5. Pair bias with the mask folded in: one dot product of length D per (row, head).
    for (int p = t; p < BM * H; p += THREADS) {
        const int ml = p % BM, head = p / BM;
        const i64 m = m0 + ml;
        if (m >= M) continue;
        const float* w = Wb + (i64)head * D;
        float dot = 0.f;
        for (int k = 0; k < D; ++k) dot = fmaf(s.As[k * BM + ml], __ldg(w + k), dot);
        const i64 b = m / NN, r = m - b * NN, i = r / N, j = r - i * N;
        float* brow = bias + ((b * H + head) * N + i) * (i64)npk;
        brow[j] = mask_keeps(mask, mask_kind, b * mb + i * mi + j * mj) ? dot * LOG2E_F : neg_inf();
        // The key axis is padded to a whole number of attention tiles; -inf there makes
        // the padded keys weigh exactly 0, so the attention kernel needs no bounds test.
        if (j == N - 1)
            for (int jj = N; jj < npk; ++jj) brow[jj] = neg_inf();
    }

    // 6. q, k, v and gate: every 4D output column of these rows, BN at a time.
    const int NO = 4 * D, ty = t / 16, tx = t % 16;
    for (int n0 = 0; n0 < NO; n0 += BN) {
        float acc[TM][8];
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;
        block_gemm(s.As, WT, D, dpad, NO, n0, s.Ws, acc);
#pragma unroll
        for (int hn = 0; hn < 2; ++hn) {
            const int n = n0 + hn * 64 + tx * 4;
            if (n >= NO) continue;
            const int group = n / D;  // 0 q, 1 k, 2 v, 3 gate; D % 4 == 0: no float4 straddles
            const float4 bb = ld4(b_qkvg + n);
#pragma unroll
            for (int r = 0; r < TM; ++r) {
                const i64 m = m0 + acc_row(r, ty);
                if (m >= M) continue;
                float4 v = make_float4(acc[r][hn * 4 + 0] + bb.x, acc[r][hn * 4 + 1] + bb.y,
                                       acc[r][hn * 4 + 2] + bb.z, acc[r][hn * 4 + 3] + bb.w);
                if (group == 0) {
                    v.x *= q_scale; v.y *= q_scale; v.z *= q_scale; v.w *= q_scale;
                } else if (group == 3) {
                    v.x = sigmoid(v.x); v.y = sigmoid(v.y); v.z = sigmoid(v.z); v.w = sigmoid(v.w);
                }
                st4(qkvg + m * NO + n, v);
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
gated_out_project(const float* __restrict__ qkvg, i64 M, int D,
                  const float* __restrict__ WT, const float* __restrict__ b_out,
                  float* __restrict__ out) {
    const int dpad = (D + BK - 1) / BK * BK;
    const SmemLayout s = smem_layout(dpad);
    const int t = threadIdx.x;
    const i64 m0 = (i64)blockIdx.x * BM, ld = 4LL * D;

    // 1. A = g * o, transposed into As[k][m]: the gated intermediate exists only here.
    for (int idx = t; idx < (dpad / 4) * BM; idx += THREADS) {
        const int ml = idx % BM, k = (idx / BM) * 4;
        float4 v = zero4();
        if (m0 + ml < M && k < D) {
            const float* row = qkvg + (m0 + ml) * ld;
            const float4 o = ld4(row + k), g = ld4(row + 3 * D + k);
            v = make_float4(g.x * o.x, g.y * o.y, g.z * o.z, g.w * o.w);
        }
        s.As[(k + 0) * BM + ml] = v.x;
        s.As[(k + 1) * BM + ml] = v.y;
        s.As[(k + 2) * BM + ml] = v.z;
        s.As[(k + 3) * BM + ml] = v.w;
    }
    __syncthreads();  // tile complete before the product reads it

    // 2. out = A Wo^T + bo.
    const int ty = t / 16, tx = t % 16;
    for (int n0 = 0; n0 < D; n0 += BN) {
        float acc[TM][8];
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;
        block_gemm(s.As, WT, D, dpad, D, n0, s.Ws, acc);
#pragma unroll
        for (int hn = 0; hn < 2; ++hn) {
            const int n = n0 + hn * 64 + tx * 4;
            if (n >= D) continue;
            const float4 bb = ld4(b_out + n);
#pragma unroll
            for (int r = 0; r < TM; ++r) {
                const i64 m = m0 + acc_row(r, ty);
                if (m >= M) continue;
                st4(out + m * D + n, make_float4(acc[r][hn * 4 + 0] + bb.x, acc[r][hn * 4 + 1] + bb.y,
                                                 acc[r][hn * 4 + 2] + bb.z, acc[r][hn * 4 + 3] + bb.w));
            }
        }
    }
}
