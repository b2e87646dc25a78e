// Masked, biased softmax attention along the last pair axis, flash-style, on tensor cores
// (mma.sync through inline PTX: NVRTC cannot include <mma.h>). Same computation, layouts
// and edge cases as attention.cu (FFMA); for every row (b, i), head h and query j (q and
// bias pre-scaled by log2 e, so softmax is in base 2 and exp2f is one instruction):
//
//   s[k]         = q[b,i,j,h] . k[b,i,k,h] + bias[b,h,j,k]    # bias = -inf where masked
//   o[b,i,j,h]   = sum_k 2^(s[k] - max s) v[b,i,k,h] / sum_k 2^(s[k] - max s)
//
// Both products run on mma.sync; the online softmax (running max m, running sum l per
// query) runs on the accumulators in registers, in fp32. Three precisions, one source:
//   attention_tf32x3  (SPLIT=1)  fp32-accurate: every operand a = hi + lo with
//                     hi = rna_tf32(a), lo = rna_tf32(a - hi), and
//                     a.b ~= lo.hi' + hi.lo' + hi.hi' (lo.lo' ~ 2^-22 |a.b| is dropped),
//                     three m16n8k8 tf32 mma per product, fp32 accumulation
//   attention_tf32    (SPLIT=0)  one m16n8k8 tf32 mma on rna_tf32 operands
//   attention_bf16    (BF16=1)   m16n8k16 bf16 mma (operands rounded to bf16 on the way
//                     from shared memory to registers), fp32 accumulation
// Inputs and outputs stay fp32 in every mode.
//
// Work split: a block of 4 warps owns BQ = 64 queries of one (row, head), 16 per warp;
// each warp keeps its 16 query rows in registers for the whole head dim and visits the
// keys BK at a time. The score tile S (16 x BK per warp) lives in mma C fragments; the
// P V product takes P straight from those registers as its A operand (no shared memory):
//   tf32: a C fragment holds keys (2t, 2t+1) of an 8-key n-tile, an A fragment columns
//         (t, t+4) of an 8-wide k-step. Numbering the keys of each k-step so that A column
//         t is key 2t and column t+4 is key 2t+1 makes a = (c0, c2, c1, c3); the V operand
//         uses the same numbering: b0 = v[2t][g], b1 = v[2t+1][g].
//   bf16: the A fragment of m16n8k16 is exactly two C fragments of adjacent n-tiles.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k8 / m16n8k16"), with
// g = lane >> 2, t = lane & 3:
//   m16n8k8 tf32:  A a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4);
//                  B b0 (k=t, n=g) b1 (k=t+4, n=g)
//   m16n8k16 bf16: A {a0,a1} (g, 2t..2t+1) {a2,a3} (g+8, 2t..) {a4,a5} (g, 2t+8..)
//                  {a6,a7} (g+8, 2t+8..);  B {b0,b1} (k=2t..2t+1, n=g) {b2,b3} (k=2t+8.., n=g)
//   C (both):      c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)
//
// Launch: grid (ceil(N/BQ) * H * B*N) flattened, query tile fastest (as attention.cu);
// block 128 threads; dynamic shared memory 4*BK*(KSTR + VSTR) bytes (K and V tiles).
// Pointers (float32): qkvg [B*N*N, 4D] with q at column h*d, k at D + h*d, v at 2D + h*d
// (o overwrites q: only this block reads those q values, and each warp reads its own
// queries into registers before it writes them); bias [B, H, N, NPK], NPK even, -inf on
// the padded keys [N, NPK); keys at or past NPK are taken as -inf here, so NPK need not
// be a multiple of BK.
#include "common.cuh"
#include "mma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 32     // d, a multiple of 8, at most 128
#endif
#ifndef SPLIT
#define SPLIT 1         // tf32 only: 1 = 3xTF32 (fp32-accurate), 0 = plain TF32
#endif
#ifndef BF16
#define BF16 0          // 1 = bf16 m16n8k16 (SPLIT ignored)
#endif
#ifndef BK
#define BK 64           // keys per tile (a multiple of 16)
#endif
#define BQ 64           // queries per block: 16 per warp
#define THREADS 128
#define NT (BK / 8)     // 8-key n-tiles of S per warp
#define DT (HEAD_DIM / 8)  // 8-column n-tiles of O per warp
// Row strides of the K and V tiles. With d % 8 == 0, d + 4 = 4 * odd words, so the tf32
// fragment loads of a warp hit 32 distinct banks: K b0 = Ks[n0+g][k0+t] is bank
// (4*odd*g + t) mod 32, V b0 = Vs[k0+2t][n0+g] is bank (8*odd*t + g) mod 32 (the permuted
// key order reads V down columns, which d + 8 would make 2-way conflicting). The bf16 K
// loads are float2 (2t, 2t+1) per lane: d + 8 keeps a half-warp's 16 lanes on distinct
// bank pairs when d % 32 == 0.
#ifndef KSTR
#define KSTR (HEAD_DIM + (BF16 ? 8 : 4))
#endif
#define VSTR (HEAD_DIM + 4)

#if HEAD_DIM % 8 != 0 || HEAD_DIM > 128
#error "attention_mma.cu: HEAD_DIM must be a multiple of 8, at most 128"
#endif
#if BK % 16 != 0
#error "attention_mma.cu: BK must be a multiple of 16"
#endif

#if BF16
#define ENTRY attention_bf16
#elif SPLIT
#define ENTRY attention_tf32x3
#else
#define ENTRY attention_tf32
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
ENTRY(float* qkvg, const float* __restrict__ bias, int B, int N, int H, int npk,
      int nan_fully_masked) {
    extern __shared__ float4 smem4[];
    float* Ks = reinterpret_cast<float*>(smem4);  // [BK][KSTR]  k of one key tile
    float* Vs = Ks + BK * KSTR;                   // [BK][VSTR]  v of one key tile

    const int D = H * HEAD_DIM;
    const i64 ld = 4LL * D;
    const int nq = (N + BQ - 1) / BQ;
    const int qtile = (int)(blockIdx.x % nq);
    const i64 rest = blockIdx.x / nq;
    const int head = (int)(rest % H);
    const i64 bi = rest / H;  // b*N + i: the row of the pair this block attends along
    const int b = (int)(bi / N);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;  // fragment row group, thread in group
    const int j0 = qtile * BQ + warp * 16 + g, j1 = j0 + 8;  // this lane's two query rows
    float* row = qkvg + bi * N * ld + head * HEAD_DIM;  // + j*ld: position (b, i, j), head
    // Bias rows of the two queries; queries past N read row N-1 (finite, never written).
    const float* bias_bh = bias + ((i64)b * H + head) * N * npk;
    const float* brow0 = bias_bh + (i64)min(j0, N - 1) * npk;
    const float* brow1 = bias_bh + (i64)min(j1, N - 1) * npk;

    // Q fragments for the whole head dim, read once from global memory (queries past N
    // are zero). tf32: fp32 values, split per k-step where used; bf16: packed once.
#if BF16
#define KS ((HEAD_DIM + 15) / 16)  // 16-wide k-steps; the last is half zero when d % 16 == 8
    u32 qa[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        const int c = 16 * kk + 2 * t;
        float2 x0 = make_float2(0.f, 0.f), x1 = x0, x2 = x0, x3 = x0;
        if (j0 < N) x0 = ld2(row + (i64)j0 * ld + c);
        if (j1 < N) x1 = ld2(row + (i64)j1 * ld + c);
        if (16 * kk + 16 <= HEAD_DIM) {  // else the upper half of the k-step is past d: 0
            if (j0 < N) x2 = ld2(row + (i64)j0 * ld + c + 8);
            if (j1 < N) x3 = ld2(row + (i64)j1 * ld + c + 8);
        }
        qa[kk][0] = pack_bf16(x0.x, x0.y);
        qa[kk][1] = pack_bf16(x1.x, x1.y);
        qa[kk][2] = pack_bf16(x2.x, x2.y);
        qa[kk][3] = pack_bf16(x3.x, x3.y);
    }
#else
    float qf[DT][4];
#pragma unroll
    for (int kk = 0; kk < DT; ++kk) {
        const int c = 8 * kk + t;
        qf[kk][0] = j0 < N ? row[(i64)j0 * ld + c] : 0.f;
        qf[kk][1] = j1 < N ? row[(i64)j1 * ld + c] : 0.f;
        qf[kk][2] = j0 < N ? row[(i64)j0 * ld + c + 4] : 0.f;
        qf[kk][3] = j1 < N ? row[(i64)j1 * ld + c + 4] : 0.f;
    }
#endif

    // O (16 x d per warp) in C fragments: o[v][0..1] row j0, o[v][2..3] row j1, columns
    // 8v + 2t, 8v + 2t + 1. m, l: running max and this lane's share of the running sum of
    // rows j0 (index 0) and j1 (index 1); the 4 lanes of a quad hold the shares of a row.
    float o[DT][4];
#pragma unroll
    for (int v = 0; v < DT; ++v) o[v][0] = o[v][1] = o[v][2] = o[v][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};

    for (int k0 = 0; k0 < N; k0 += BK) {
        // S starts as the bias (-inf where masked, on padded keys and past NPK), so the
        // products accumulate onto it; loaded before the barrier to hide its latency.
        float s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int k = k0 + 8 * n + 2 * t;  // even; npk even: both keys in or both out
            float2 x0 = make_float2(neg_inf(), neg_inf()), x1 = x0;
            if (k < npk) {
                x0 = ld2(brow0 + k);
                x1 = ld2(brow1 + k);
            }
            s[n][0] = x0.x; s[n][1] = x0.y; s[n][2] = x1.x; s[n][3] = x1.y;
        }

        __syncthreads();  // every warp is done reading the previous tile's Ks and Vs
        // K and V tiles, row-major, one float4 per thread and step (coalesced along d).
        // Keys past N are zero, so their scores are 0 + (-inf) and their values 0 * 0.
        for (int idx = tid; idx < BK * (HEAD_DIM / 4); idx += THREADS) {
            const int kl = idx / (HEAD_DIM / 4), c = (idx % (HEAD_DIM / 4)) * 4, k = k0 + kl;
            const float* src = row + (i64)k * ld + D + c;
            st4(Ks + kl * KSTR + c, k < N ? ld4(src) : zero4());
            st4(Vs + kl * VSTR + c, k < N ? ld4(src + D) : zero4());
        }
        __syncthreads();  // Ks and Vs visible to every warp

        // S += Q K^T (16 x BK per warp).
#if BF16
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const int c = 16 * kk + 2 * t;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const float* kr = Ks + (8 * n + g) * KSTR + c;
                const float2 x0 = *reinterpret_cast<const float2*>(kr);
                const float2 x1 = 16 * kk + 16 <= HEAD_DIM
                                      ? *reinterpret_cast<const float2*>(kr + 8)
                                      : make_float2(0.f, 0.f);  // past d: never read Ks there
                mma_bf16(s[n], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                         pack_bf16(x0.x, x0.y), pack_bf16(x1.x, x1.y));
            }
        }
#else
#pragma unroll
        for (int kk = 0; kk < DT; ++kk) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const float* kr = Ks + (8 * n + g) * KSTR + 8 * kk + t;
                mma_f32<true, SPLIT>(s[n], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], kr[0], kr[4]);
            }
        }
#endif

        // Online softmax of rows j0 (r = 0: s[n][0..1]) and j1 (r = 1: s[n][2..3]).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = neg_inf();
#pragma unroll
            for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            // The 4 lanes of a quad hold this row's BK keys.
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float alpha;
            const float m_ref = online_max_update(m[r], mx, alpha);
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                s[n][2 * r] = exp2f(s[n][2 * r] - m_ref);
                s[n][2 * r + 1] = exp2f(s[n][2 * r + 1] - m_ref);
                sum += s[n][2 * r] + s[n][2 * r + 1];
            }
            l[r] = fmaf(l[r], alpha, sum);
#pragma unroll
            for (int v = 0; v < DT; ++v) {
                o[v][2 * r] *= alpha;
                o[v][2 * r + 1] *= alpha;
            }
        }

        // O += P V, P taken from the S accumulators (see the header for the key order).
#if BF16
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            const u32 a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            const u32 a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            const u32 a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const u32 a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const float* vr = Vs + (16 * kk + 2 * t) * VSTR + g;
#pragma unroll
            for (int v = 0; v < DT; ++v)
                mma_bf16(o[v], a0, a1, a2, a3,
                         pack_bf16(vr[8 * v], vr[VSTR + 8 * v]),
                         pack_bf16(vr[8 * VSTR + 8 * v], vr[9 * VSTR + 8 * v]));
        }
#else
#pragma unroll
        for (int kk = 0; kk < NT; ++kk) {
            const float* vr = Vs + (8 * kk + 2 * t) * VSTR + g;
#pragma unroll
            for (int v = 0; v < DT; ++v)
                mma_f32<false, SPLIT>(o[v], s[kk][0], s[kk][2], s[kk][1], s[kk][3],
                        vr[8 * v], vr[VSTR + 8 * v]);
        }
#endif
    }

    // o / l, written over q. l = 0 only when every key was masked (the maximum term of a
    // row with any unmasked key is 2^0 = 1).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = l[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int j = r ? j1 : j0;
        if (j >= N) continue;
        const bool fully_masked = total == 0.f;
        const float inv = fully_masked ? 0.f : 1.0f / total;
        const float fill = nan_fully_masked ? quiet_nan() : 0.f;
        float* out = row + (i64)j * ld + 2 * t;
#pragma unroll
        for (int v = 0; v < DT; ++v) {
            float2 x = make_float2(o[v][2 * r] * inv, o[v][2 * r + 1] * inv);
            if (fully_masked) x = make_float2(fill, fill);
            *reinterpret_cast<float2*>(out + 8 * v) = x;
        }
    }
}
