// The two projection GEMMs on tensor cores (every precision mode on sm_80 and newer; the
// FFMA projections of older GPUs are project_ffma.cu, which computes the same). Each block owns BM
// rows (pair positions), holds their whole D-wide row tile in shared memory, and computes
// every output column of those rows, so the pair representation is read once.
//
//   ln_qkvg_project:   xn = LayerNorm(x)                              # [M, D]
//                      qkvg = xn [Wq; Wk; Wv; Wg]^T + [bq; bk; bv; bg] # [M, 4D]
//                        q columns scaled by log2(e)/sqrt(d), gate columns through sigmoid,
//                        k and v stored as the layout says (project_epilogue.cuh)
//                      bias[b, head, i, j] = log2(e) * xn[m] . Wb[head]  # m = (b, i, j)
//                        -inf where mask[b, i, j] == 0, and on the padded keys j in [N, NPK)
//   gated_out_project: out = (g * o) Wo^T + bo                        # [M, D]
//                        o = qkvg[:, 0:D] (attention output, written over q; tiles_bf16
//                          and 8: 16-bit, each head's first 16 words, load_o4)
//                        g = the sigmoid gate (fp32 at qkvg[:, 3D:4D] or, tiles_f16_hilo
//                          and 8, [D:2D] of rows of 2D words; or packed
//                          bf16: the layout's features, project_epilogue.cuh)
//
// Products: mma.sync, fp32 accumulation, on
//   F16_TERMS = 0 ("tf32", "bf16" with the mma.sync or FFMA attention): TF32 operands
//     (m16n8k8). The row tile is rounded to TF32 once, where it is normalised (so the pair
//     bias, computed from it, is a TF32 product too, as in PyTorch's TF32 mode); W comes
//     rounded already (DeviceWeights).
//   F16_TERMS = 3 (with SPLIT, "fp32": the fp32 mode's projections in every layout:
//     tiles_f16_hilo for attention_wgmma_f16x3, rows_fp32 for attention_mma_f16x3, the
//     3xTF32 oracle and the FFMA attention, which read q, k, v unscaled): fp32-accurate
//     products of fp16 hi + lo parts, a b taken as hi*lo + lo*hi + hi*hi (the lo*lo term is
//     below fp32 rounding; each k-step's terms summed apart and added to the accumulator
//     in fp32: split_terms), m16n8k16, no split in the loop: LayerNorm writes each
//     16-wide chunk of the row tile as 16 fp16 hi then 16 lo (64 bytes, in place of its 16
//     fp32), scaled by a_scale (a power of two keeping |xn| below 2^14); the host lays W
//     (and the pair-bias weights, split here) out the same way, scaled by a power of two;
//     the accumulators are multiplied by `unscale` = 1 / (both scales) before the epilogue,
//     which then stores fp32-accurate values (tiles_f16_hilo: q, k, v times the attention's
//     scales, which the host folds into W; rows_fp32: as computed).
//     gated_out_project likewise: g * o scaled by the block's own power of two (from its
//     largest |g o|), split after it is loaded (load_gated_tile_f16); `w_unscale` undoes
//     Wo's scale.
//   F16_TERMS = 1 (without SPLIT; "tf32" and "bf16" with the wgmma attention, tiles_f16
//     and tiles_bf16): the same row tile and scales, one product
//     of the hi parts: fp16 keeps 11 significant bits as TF32 does, so the scaled products
//     are as accurate as TF32's, at half the instructions (m16n8k16 against two m16n8k8).
//     The ring then holds W's hi parts alone, 32 per chunk row (RING_K): a chunk is two
//     k-steps, so one barrier and one 8 KiB copy per 32 k values instead of per 16 (the
//     loop was latency bound: 12% of its stalls at the barriers). The host
//     lays W out so only for D % 32 == 0 (head dim 32, where these modes run), and
//     ring_chunks stops the kernel where the row tile's width is no multiple of 32. The
//     row tile's lo halves are neither computed nor written (nothing reads them).
// LayerNorm statistics, the biases and the gate are fp32.
//
// Both operands are row-major with k fastest, as ldmatrix wants them: the row tile As
// [BM][dpad + 4] and the weight W [NO][D] as PyTorch stores it, cut into the chunks
// [BN][BK] that stream through a ring of WSTAGES stages (the host lays them out one after
// another: a chunk is read whole, not as 64-byte pieces of 128 rows). As's row stride of 4
// (mod 8) words, and the ring's swizzled rows (w_piece), put the 8 rows an ldmatrix phase
// reads on distinct 16-byte bank groups, and one ldmatrix.x4 then gives a whole m16n8k8 A
// fragment, or the B fragments of two n-tiles (4 scalar loads each before).
//
// Launch: grid (ceil(M / BM)), block THREADS = 256, dynamic shared memory
//   8*BM + 4*(BM*(DPAD + 4) + WSTAGES*BN*BK + 2*BN) bytes, DPAD = D rounded up to BK.
// Pointers (float32 unless noted, M = B*N*N rows, D % 4 == 0):
//   x     [B, N, N, D] of pair_t (PAIR_DTYPE, project_math.cuh: float32, float16 or
//         bfloat16; out too) at b*sb + i*si + j*sj + c*sc elements (any strides; x_vec = 1 when
//         sc == 1 and every row starts 16-byte aligned: rows copied with cp.async)
//   W     [NO, D] (NO = 4D, or D for out_proj) in the ring's chunk order, rounded to TF32
//         unless SPLIT: [NO / BN][DPAD / BK][BN][BK], zero past NO and D (DeviceWeights
//         projection_weight), so that each chunk is one contiguous 8 KiB; F16_TERMS 3: the
//         same chunks with each row's 16 values as fp16 hi then lo, scaled
//         (gpu/device_weights.py f16_split_chunks); F16_TERMS 1: [NO / BN][D / 32][BN][32] fp16 hi, scaled
//         (gpu/device_weights.py f16_hi_chunks), 8 KiB chunks too
//   mask  [B, N, N] at b*mb + i*mi + j*mj elements, of the type named by mask_kind
//         (MASK_* in project_epilogue.cuh), or null
//   qkvg  [M, 4D] ([M, 2D]: tiles_f16_hilo and tiles_f16; [M, D]: tiles_bf16); bias [B, H, N,
//         NPK] (fp16 for rows_bf16; fp16 tiles for the tiled layouts); out [M, D] contiguous;
//         vt: K and V^T tiles for the tiled layouts (project_epilogue.cuh), else unused.
#include "common.cuh"
#include "mma.cuh"

#ifndef BM
#define BM 128          // rows per block: 128, or 64 (small problems, wide D, out_proj)
#endif
#define MAX_DPAD 768    // the widest row tile (gpu/tiles.py MAX_PAIR_DIM), for 16-bit rows
#define BN 128          // output columns per pass
#define BK 16           // reduction chunk of the weight: 2 mma k-steps
#ifndef WSTAGES
#define WSTAGES 4       // weight chunks in the ring (2 where a wide D needs the room)
#endif
#define THREADS 256
#define WARPS (THREADS / 32)
#ifndef PROJECT_MIN_BLOCKS  // resident blocks per SM asked of the compiler (__launch_bounds__):
#define PROJECT_MIN_BLOCKS 2  // 2: at most 128 registers; 3 (64-row blocks): at most 80
#endif
#ifndef OUT_MIN_BLOCKS  // the same for gated_out_project alone: PROJECT_MIN_BLOCKS, or 3 by
#define OUT_MIN_BLOCKS PROJECT_MIN_BLOCKS  // (64-row
#endif                  // F16_TERMS 3 fits 80 registers there unspilled; ln_qkvg_project not)
#define MT (BM / 32)    // 16-row m-tiles per warp; the 8 warps are 2 (rows) x 4 (columns)
#define TROWS (BM / 16) // row slots per thread (thread_row)
#define WSTR BK         // words per row of a weight chunk in the ring (swizzled: w_piece)
#ifndef SPLIT
#define SPLIT 0         // 1: fp32-accurate split products (the fp32 mode: F16_TERMS 3)
#endif
// The products' operands, by name (the plan passes F16_TERMS as its number)
#define F16_TERMS_TF32 0   // TF32 (or, with SPLIT, fp32 split into TF32 parts)
#define F16_TERMS_HI 1     // fp16 hi parts, one product
#define F16_TERMS_HI_LO 3  // fp16 hi and lo parts, three products (with SPLIT: fp32-accurate)
#ifndef F16_TERMS
#define F16_TERMS F16_TERMS_TF32  // products on fp16 operands, below
#endif
#if (SPLIT && F16_TERMS != F16_TERMS_HI_LO) \
    || (!SPLIT && F16_TERMS != F16_TERMS_TF32 && F16_TERMS != F16_TERMS_HI)
#error "project_mma.cu: F16_TERMS is 3 with SPLIT, 1 or 0 without"
#endif
// k values per ring chunk: the WSTR words of a chunk row hold BK fp32 values, or BK fp16 hi
// then BK lo (F16_TERMS 3), or 2 BK fp16 hi (F16_TERMS 1, whose products never read a lo
// part of W: the ring carries none).
#define RING_K (F16_TERMS == F16_TERMS_HI ? 2 * BK : BK)

// This thread's share of one BM x BN output tile: the C fragments of its warp's
// BM/2 x 32 corner, [m-tile][8-column n-tile][fragment].
struct Tile {
    float c[MT][4][4];
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) c[i][j][e] = 0.f;
    }
};

// Column n of this thread's j-th value pair of the pass at n0 (j < 4; the pair is n, n+1).
__device__ __forceinline__ int pair_column(int n0, int j) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    return n0 + (warp % 4) * 32 + j * 8 + 2 * (lane & 3);
}

// Row slot s < TROWS of this thread: its block row, and its value pair at column pair j
// (slot = 2 m-tile + half: rows g and g + 8 of the m-tile, stored together).
#define SLOT_RUN 2
__device__ __forceinline__ int thread_row(int s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    return (warp / 4) * (BM / 2) + (s / 2) * 16 + (lane >> 2) + 8 * (s % 2);
}
__device__ __forceinline__ float* pair_at(Tile& acc, int s, int j) {
    return &acc.c[s / 2][j][2 * (s % 2)];
}

// Entry points by arithmetic: fp16 hi + lo (F16_TERMS 3), one fp16 product (1), TF32 (0)
#if F16_TERMS == F16_TERMS_HI_LO
#define LN_QKVG_ENTRY ln_qkvg_project_mma_f16x3
#define GATED_OUT_ENTRY gated_out_project_mma_f16x3
#elif F16_TERMS == F16_TERMS_HI
#define LN_QKVG_ENTRY ln_qkvg_project_mma_f16
#define GATED_OUT_ENTRY gated_out_project_mma_f16
#else
#define LN_QKVG_ENTRY ln_qkvg_project_mma_tf32
#define GATED_OUT_ENTRY gated_out_project_mma_tf32
#endif
#define EXACT_FP32 SPLIT  // the fp32 mode: exact gate and LayerNorm (project_epilogue.cuh)

// LayerNorm on every thread of a 128-row block, 2 consecutive threads per row, instead of
// one thread per row on half the threads (ln_qkvg_project step 3). Off until measured: the ablation without LayerNorm
// (no_layernorm_mma) took 0.25 ms of 1.38 off the tf32 projection at 1x1024, and its
// barrier held the other half of the threads (ncu: 13% of the stall samples).
// LN_SPLIT=1 turns it on. 64-row blocks keep a thread per row
// (at 4 per row their 80-register kernels spilled 4 bytes).
#ifndef LN_SPLIT
#define LN_SPLIT 0
#endif
#define LN_PAIRS (LN_SPLIT && BM == 128)
#define LN_STEP (LN_PAIRS ? 2 : 1)  // threads per row
#include "project_epilogue.cuh"

// A value of the row tile as the products take it: fp32 to be split (SPLIT), else
// rounded to TF32 here, once.
__device__ __forceinline__ float4 operand4(float4 v) {
    return make_float4(__uint_as_float(to_tf32(v.x)), __uint_as_float(to_tf32(v.y)),
                       __uint_as_float(to_tf32(v.z)), __uint_as_float(to_tf32(v.w)));
}

// acc += (ah + al)(bh + bl) for one fragment pair split into hi and lo: the three terms,
// small ones first, summed by the tensor cores (MMA: mma_tf32 for m16n8k8 TF32 parts,
// mma_f16 for m16n8k16 fp16 ones, F16_TERMS 3) into a fresh fragment, then added to acc in
// fp32. The tensor cores' own accumulation does not round to nearest; chained through acc
// over D / 8 k-steps, its error grew with D (1.2e-5 at D = 768 against the fp32 mode's
// 1e-5 bound), where one fp32 add per k-step keeps it at the size of one step's.
typedef void (*mma_fn)(float (&)[4], u32, u32, u32, u32, u32, u32);
template <mma_fn MMA>
__device__ __forceinline__ void split_terms(float (&acc)[4], const u32 (&ah)[4],
                                            const u32 (&al)[4], const u32 (&bh)[2],
                                            const u32 (&bl)[2]) {
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    MMA(t, ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
    MMA(t, al[0], al[1], al[2], al[3], bh[0], bh[1]);
    MMA(t, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] += t[e];
}

// acc += a b for one m16n8k8 fragment pair of TF32 values (pair_bias's TF32 products; the
// split products of SPLIT are fp16 ones: split_terms).
__device__ __forceinline__ void mma_product(float (&acc)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    mma_tf32(acc, a[0], a[1], a[2], a[3], b[0], b[1]);
}

// Byte offset, in a ring stage, of 16-byte piece c (< 4) of chunk row r: rows of 64 bytes,
// unpadded, the piece at c ^ (r / 2) % 4 (wgmma.cuh's sw64 pattern). The 8 rows an
// ldmatrix phase reads then fall on distinct 16-byte bank groups, as with the padded rows
// of 80 bytes before, and a warp's cp.async of 512 contiguous bytes of the chunk writes
// 512 distinct bytes of the stage (the padded rows took ~3.7x the shared-memory
// wavefronts for it, and ncu counted 1.5x the L2 sectors for those copies).
__device__ __forceinline__ u32 w_piece(int r, int c) { return r * 64 + (((c ^ (r >> 1)) & 3) << 4); }

// Chunks of W per pass over BN columns: dpad / RING_K. F16_TERMS 1 takes D % 32 == 0 (head
// dim 32 only; gpu/device_weights.py f16_hi_chunks checks it on the host): with dpad an odd multiple of 16
// the last 16 columns would be dropped, so the kernel stops with an error instead.
__device__ __forceinline__ int ring_chunks(int dpad) {
#if F16_TERMS == F16_TERMS_HI
    if (dpad % RING_K != 0) __trap();
#endif
    return dpad / RING_K;
}

// The weight W [NO][D], BN rows (output columns) x RING_K at a time, through a cp.async
// ring of WSTAGES chunks [BN][WSTR], and the pass's BN output biases with its first chunk. A
// pass over the columns at n0 is primed with the first WSTAGES - 1 chunks (prime), then
// each chunk kc is waited for and chunk kc + WSTAGES - 1 issued into the stage kc - 1
// used: a chunk is little work, and one chunk ahead left each waiting on its L2 latency.
// Priming the next pass before this pass's epilogue overlaps the copies with the stores.
struct WeightRing {
    u32 ws;                      // shared address of the ring
    float* cbias;                // the biases [2][BN] in shared memory, by pass parity
    const float* __restrict__ W;
    const float* __restrict__ bvec;  // [NO]
    int D, NO, nchunks;          // chunks per pass: ring_chunks(dpad)

    // Chunk kc of the pass at n0 into its stage, one commit group (empty past the last
    // chunk, so every wait counts the same groups): each thread copies 2 of the BN x WSTR / 4
    // 16-byte pieces of the contiguous chunk. Its rows past NO and columns past D are
    // zero in W (they meet the zero columns of As; an unread garbage NaN would otherwise
    // poison the sum).
    __device__ __forceinline__ void issue(int n0, int kc) const {
        if (kc < nchunks) {
            const u32 stage = ws + 4 * (kc % WSTAGES) * BN * WSTR;
            const float* const chunk = W + ((i64)(n0 / BN) * nchunks + kc) * (BN * WSTR);
#pragma unroll
            for (int p = 0; p < BN * WSTR / 4 / THREADS; ++p) {
                const int idx = threadIdx.x + p * THREADS;
                const int nl = idx / (WSTR / 4), kl = (idx % (WSTR / 4)) * 4;
                cp_async16_or_zero(stage + w_piece(nl, kl / 4), chunk + 4 * idx, true);
            }
        }
        cp_async_commit();
    }
    // The pass's biases (threads t < BN / 4, 16 bytes each; zero past NO, NO % 4 == 0) into
    // buffer (n0 / BN) % 2, in chunk 0's group, then the first chunks. Two buffers: the
    // next pass is primed while threads may still read this pass's biases.
    __device__ __forceinline__ void prime(int n0) const {
        const int t = threadIdx.x;
        if (t < BN / 4) {
            const int n = n0 + 4 * t;
            cp_async16_or_zero(smem_addr(cbias + ((n0 / BN) % 2) * BN + 4 * t),
                               n < NO ? bvec + n : bvec, n < NO);
        }
#pragma unroll
        for (int kc = 0; kc < WSTAGES - 1; ++kc) issue(n0, kc);
    }
    // This thread's biases of its value pairs in the pass at n0 (landed with chunk 0, whose
    // wait and barrier every thread has passed).
    __device__ __forceinline__ void biases(int n0, float2 (&cb)[4]) const {
        const float* const buf = cbias + ((n0 / BN) % 2) * BN - n0;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            cb[j] = *reinterpret_cast<const float2*>(buf + pair_column(n0, j));
    }
};

// This lane's ldmatrix row addresses (bytes, shared) for warp w: in As, row
// (w / 4) * BM/2 + (lane & 15) at column 4 (lane >> 4) (A fragment: matrices rows 0-7 and
// 8-15 at k, then at k + 4); in a ring stage (an offset from the stage), row (w % 4) * 32
// + (lane & 7) + 8 (lane >> 4) at piece (lane >> 3) & 1 (B fragments of n-tiles j and
// j + 1, each at k and k + 4); k + 8 is piece + 2, the offset XOR 32 (w_piece). In fp16
// halves (F16_TERMS) the pieces hold k to k + 7 and k + 8 to k + 15; piece + 2 is then
// the lo half of k to k + 7 in As and in the F16_TERMS 3 ring, and k + 16 in the F16_TERMS
// 1 ring (32 hi values per row).
__device__ __forceinline__ u32 a_lane_addr(const float* As, int astr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    return smem_addr(As) + 4 * (((warp / 4) * (BM / 2) + (lane & 15)) * astr + 4 * (lane >> 4));
}
__device__ __forceinline__ u32 w_lane_offset() {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    return w_piece((warp % 4) * 32 + (lane & 7) + 8 * (lane >> 4), (lane >> 3) & 1);
}

// acc += As[warp's rows, kc*RING_K + 0:RING_K] x chunk[warp's columns, 0:RING_K]^T (a_lane
// at the chunk's first column). With SPLIT the B fragments of a k-step are split once,
// and each m-tile's A fragment just before its products (all MT split at once would not
// fit in the registers of 3 blocks per SM).
// F16 3: the chunk is one 16-wide k-step of fp16 hi (its first 32 bytes per row, in A and
// in the ring) and lo (the next 32: A + 32, the ring's offset XOR 32), the split's three
// products. F16 1: two 16-wide k-steps of hi parts, one product each: step s takes A's
// 16-column chunk s (its hi half: A + 64 s bytes; the lo half is not read) and the ring
// row's bytes 32 s to 32 s + 31 (the offset XOR 32 s: w_piece's pieces 2 and 3).
template <int F16>
__device__ __forceinline__ void multiply_chunk(u32 a_lane, int astr, u32 w_stage, u32 w_lane,
                                               Tile& acc) {
    if constexpr (F16 == F16_TERMS_HI) {
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            u32 b[4][2];
#pragma unroll
            for (int jp = 0; jp < 2; ++jp) {
                u32 r[4];
                ldsm_x4(r, w_stage + ((w_lane + jp * 16 * 4 * WSTR) ^ (32 * s)));
                b[2 * jp][0] = r[0], b[2 * jp][1] = r[1], b[2 * jp + 1][0] = r[2], b[2 * jp + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                u32 a[4];
                ldsm_x4(a, a_lane + 4 * (i * 16 * astr + s * BK));
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma_f16(acc.c[i][j], a[0], a[1], a[2], a[3], b[j][0], b[j][1]);
            }
        }
        return;
    }
    if constexpr (F16 == F16_TERMS_HI_LO) {
        u32 bh[4][2], bl[4][2];
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
            u32 r[4];
            ldsm_x4(r, w_stage + w_lane + jp * 16 * 4 * WSTR);
            bh[2 * jp][0] = r[0], bh[2 * jp][1] = r[1], bh[2 * jp + 1][0] = r[2], bh[2 * jp + 1][1] = r[3];
            ldsm_x4(r, w_stage + ((w_lane + jp * 16 * 4 * WSTR) ^ 32));
            bl[2 * jp][0] = r[0], bl[2 * jp][1] = r[1], bl[2 * jp + 1][0] = r[2], bl[2 * jp + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            u32 ah[4], al[4];
            ldsm_x4(ah, a_lane + 4 * (i * 16 * astr));
            ldsm_x4(al, a_lane + 4 * (i * 16 * astr) + 32);
#pragma unroll
            for (int j = 0; j < 4; ++j) split_terms<mma_f16>(acc.c[i][j], ah, al, bh[j], bl[j]);
        }
        return;
    }
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
        u32 b[4][2];
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
            u32 r[4];
            ldsm_x4(r, w_stage + ((w_lane + jp * 16 * 4 * WSTR) ^ (4 * kk)));
            b[2 * jp][0] = r[0];
            b[2 * jp][1] = r[1];
            b[2 * jp + 1][0] = r[2];
            b[2 * jp + 1][1] = r[3];
        }
        u32 a[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) ldsm_x4(a[i], a_lane + 4 * (i * 16 * astr + kk));
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                mma_tf32(acc.c[i][j], a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], b[j][1]);
    }
}

// All NO output columns of the block's rows, BN at a time: acc = As x W[n0 + ..., :]^T,
// handed with the biases of this thread's column pairs (ring.bvec, staged in ring.cbias)
// to store(acc, n0, cb), which may change acc. The caller has primed the ring for n0 = 0 (and may have used the wait
// for its own copies); As is complete and visible.
// F16 (F16_TERMS): fp16 products (multiply_chunk), the accumulators times `unscale`, then
// times `unscale2`, before the store: two factors one after the other, as their product
// may be below fp32's range where each result is not (gated_out_project).
template <int F16, class Store>
__device__ __forceinline__ void project_columns(const float* As, int astr, const WeightRing& ring,
                                                Store store, float unscale = 1.f,
                                                float unscale2 = 1.f) {
    const u32 a_lane = a_lane_addr(As, astr), w_lane = w_lane_offset();
    for (int n0 = 0; n0 < ring.NO; n0 += BN) {
        Tile acc;
        acc.zero();
        for (int kc = 0; kc < ring.nchunks; ++kc) {
            cp_async_wait<WSTAGES - 2>();  // this thread's pieces of chunk kc landed
            __syncthreads();  // everyone's pieces visible; chunk kc - 1 read by every thread
            ring.issue(n0, kc + WSTAGES - 1);  // into the stage chunk kc - 1 used
            multiply_chunk<F16>(a_lane + 4 * kc * RING_K, astr,
                           ring.ws + 4 * (kc % WSTAGES) * BN * WSTR, w_lane, acc);
        }
        __syncthreads();  // every thread done with the ring
        if (n0 + BN < ring.NO) ring.prime(n0 + BN);
        if constexpr (F16 != F16_TERMS_TF32) {
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc.c[i][j][e] = acc.c[i][j][e] * unscale * unscale2;
        }
        float2 cb[4];
        ring.biases(n0, cb);  // from shared memory: no L2 latency to wait on
        store(acc, n0, cb);
    }
}

// bias[b, head, i, j] for every row (b, i, j) = m0 + ml of the block and every head:
// log2(e) * As[ml] . Wb[head] on tensor cores (xn as As holds it, Wb rounded here; or
// both split, SPLIT), -inf where the mask drops the row (store_pair_bias). Warp w takes the m-tiles
// w, w + 8, ... (16 rows each) and the heads 8 at a time (the B fragment's n = g).
// Not inlined: inlined, its registers pushed the kernel's 128-register products into
// spills (ptxas); called once per block, the call costs nothing that shows.
// F16_TERMS: As in fp16 hi and lo chunks (F16_TERMS 1: hi only, its lo words stale), Wb
// scaled on the host, split here (F16_TERMS 3) or rounded to fp16 (1); the products times
// `unscale`. Wb's B fragments (b0 = Wb[h0 + g][k + t], b1 = ...[k + t + 4]; F16_TERMS:
// pairs at k + 2t and k + 2t + 8) come straight from global memory, a small array every
// block reads (L1). As per-thread FFMA dot products, each thread loading all of Wb, this
// was ~40% of the kernel's stall samples (the loads waited for one at a time).
__device__ __noinline__ void pair_bias(const float* As, int astr, const float* __restrict__ Wb,
                                          int D, int dpad, int H, i64 m0, i64 M, int N,
                                          const void* __restrict__ mask, int mask_kind,
                                          i64 mb, i64 mi, i64 mj, bias_t* __restrict__ bias,
                                          int npk
#if F16_TERMS
                                          , float unscale
#endif
                                          ) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const i64 NN = (i64)N * N;
    for (int ml0 = warp * 16; ml0 < BM; ml0 += WARPS * 16) {
        const u32 a_row = smem_addr(As) + 4 * ((ml0 + (lane & 15)) * astr + 4 * (lane >> 4));
        // This lane's rows of the C fragment, g and g + 8: where their bias rows start
        // (head 0; a head is N * npk further) and their mask elements, loaded first, in
        // flight during the products.
        bias_t* brow[2];
        int j[2], rows[2];
        bool keep[2], ok[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 m = m0 + ml0 + g + 8 * h;
            ok[h] = m < M;
            const i64 mc = ok[h] ? m : M - 1, b = mc / NN, r = mc - b * NN, i = r / N;
            j[h] = (int)(r - i * N);
            if constexpr (KV_TILED) {  // tiles: where they start is worked out per value
                brow[h] = bias + b * H;  // (store_pair_bias_tiled): only to carry b H,
                rows[h] = (int)i;        // brow[h] - bias + head = b H + head
            } else {
                brow[h] = bias + (b * H * N + i) * (i64)npk;
            }
            keep[h] = mask_keeps(mask, mask_kind, b * mb + i * mi + j[h] * mj);
        }
        for (int h0 = 0; h0 < H; h0 += 8) {
            const bool head_ok = h0 + g < H;
            const float* const w = Wb + (i64)(head_ok ? h0 + g : 0) * D + t;
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#if F16_TERMS
            const float* const w2 = w + t;  // this lane's k pairs: 2t, 2t + 1 (+ 8)
#pragma unroll 2
            for (int k0 = 0; k0 < dpad; k0 += 16) {
                u32 ah[4], al[4], bh[2], bl[2];  // (al: F16_TERMS 3's lo parts)
                ldsm_x4(ah, a_row + 4 * k0);
                if constexpr (F16_TERMS == F16_TERMS_HI_LO) ldsm_x4(al, a_row + 4 * k0 + 32);
                // D % 4 == 0: k0 + 2t < D covers k0 + 2t + 1
                const float2 w0 = head_ok && k0 + 2 * t < D ? ld2(w2 + k0) : make_float2(0.f, 0.f);
                const float2 w1 = head_ok && k0 + 2 * t + 8 < D ? ld2(w2 + k0 + 8) : make_float2(0.f, 0.f);
                split_f16(w0.x, w0.y, bh[0], bl[0]);
                split_f16(w1.x, w1.y, bh[1], bl[1]);
                if constexpr (F16_TERMS == F16_TERMS_HI_LO)
                    split_terms<mma_f16>(c, ah, al, bh, bl);
                else
                    mma_f16(c, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) c[e] *= unscale;
#else
#pragma unroll 4
            for (int k0 = 0; k0 < dpad; k0 += 8) {  // D % 4 == 0: k0 < D covers k0 + t
                u32 a[4];
                ldsm_x4(a, a_row + 4 * k0);
                const float w0 = head_ok && k0 < D ? __ldg(w + k0) : 0.f;
                const float w1 = head_ok && k0 + 4 < D ? __ldg(w + k0 + 4) : 0.f;
                const u32 b[2] = {to_tf32(w0), to_tf32(w1)};
                mma_product(c, a, b);
            }
#endif
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)
                const int h = e / 2, head = h0 + 2 * t + e % 2;
                if (ok[h] && head < H)
#if KV_TILED  // (store_pair_bias_tiled exists only then)
                    store_pair_bias_tiled(bias, brow[h] - bias + head, rows[h], j[h], N, npk,
                                          keep[h], c[e]);
#else
                    store_pair_bias(brow[h] + (i64)head * N * npk, j[h], N, npk, keep[h], c[e]);
#endif
            }
        }
    }
}

// As[ml][k] = op(g * o) of block row ml (zero past M and past D), o from qkvg[m] (load_o4),
// g the gate (load_gate4): a float4 piece per thread, consecutive threads on consecutive
// pieces of a row (conflict-free stores), in batches of BATCH per thread (2 BATCH loads in
// flight): the out projection waits on these loads.
template <int BATCH, class Op>
__device__ __forceinline__ void load_gated_pieces(const float* __restrict__ qkvg, i64 M, int D,
                                                  int dpad, int astr, i64 m0, float* As, Op op) {
    const i64 ld = (F16_QKV ? 2LL : SLOT_ROWS ? 1LL : 4LL) * D;  // QKVG_LD
    const int per_row = dpad / 4, total = BM * per_row;
    for (int base = threadIdx.x; base < total; base += BATCH * THREADS) {
        float4 v[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int idx = base + u * THREADS, ml = idx / per_row, k = (idx % per_row) * 4;
            v[u] = zero4();
            if (idx < total && m0 + ml < M && k < D) {
                const float* row = qkvg + (m0 + ml) * ld;
                const float4 o = load_o4(row, k), g = load_gate4(row, D, k);
                v[u] = op(make_float4(g.x * o.x, g.y * o.y, g.z * o.z, g.w * o.w));
            }
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int idx = base + u * THREADS;
            if (idx < total) st4(As + (idx / per_row) * astr + (idx % per_row) * 4, v[u]);
        }
    }
}

// As = TF32(g * o) (operand4). Not inlined: inlined, its registers pushed the kernel's
// products into spills (ptxas).
__device__ __noinline__ void load_gated_tile(const float* __restrict__ qkvg, i64 M, int D,
                                             int dpad, int astr, i64 m0, float* As) {
    load_gated_pieces<8>(qkvg, M, D, dpad, astr, m0, As, [](float4 x) { return operand4(x); });
}

#if F16_TERMS
// load_gated_tile for F16_TERMS: each 16-wide chunk's 64 bytes of As as 16 fp16 hi then 16
// lo of a * g * o; returns 1 / a. a is the block's own power of two, putting its largest
// |g o| in [2^13, 2^14): a scale fixed from the weights (|g o| <= max |v|) left g o among
// fp16's subnormals where every gate is near 0 (relative error 2.7e-2
// in fp32 mode with every gate bias at -20). Two passes: g o in fp32 into As with each
// thread's largest magnitude (batches of 4: 8 took the 64-row blocks past 80 registers),
// the block's maximum (`red`: a word per warp), then the split in place, piece by piece as
// pass 1 wrote them (a chunk's 4 pieces are 4 lanes of one warp, so a warp barrier orders
// their reads before the chunk is overwritten). A thread per 64-byte chunk instead cost
// ~0.2 ms at 1x1024 (its 16-byte stores at a 64-byte stride conflict 4-way, twice).
__device__ __noinline__ float load_gated_tile_f16(const float* __restrict__ qkvg, i64 M, int D,
                                                  int dpad, int astr, i64 m0, float* As,
                                                  float* red) {
    float top = 0.f;  // (NaN, where a fully masked query's o is, drops out of fmaxf)
    load_gated_pieces<4>(qkvg, M, D, dpad, astr, m0, As, [&](float4 x) {
        top = fmaxf(top, fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w))));
        return x;
    });
#pragma unroll
    for (int lanes = 16; lanes; lanes >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, lanes));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = top;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, red[w]);
    int e;
    frexpf(top, &e);  // top < 2^e
    // (at least 2^-126 for a's inverse to stay normal: below that, g o is at most 2^-112)
    const float a = top > 0.f ? ldexpf(1.f, min(14 - e, 126)) : 1.f;
    const int per_row = dpad / 4, total = BM * per_row;  // total % THREADS == 0: every lane
    for (int idx = threadIdx.x; idx < total; idx += THREADS) {  // reaches each __syncwarp
        float* const piece = As + (idx / per_row) * astr + (idx % per_row) * 4;
        const float4 x = *reinterpret_cast<const float4*>(piece);
        u32 hi[2], lo[2];
        if (F16_TERMS == F16_TERMS_HI) {  // (its products read the hi parts alone)
            hi[0] = pack_f16(x.x * a, x.y * a), hi[1] = pack_f16(x.z * a, x.w * a);
        } else {
            split_f16(x.x * a, x.y * a, hi[0], lo[0]);
            split_f16(x.z * a, x.w * a, hi[1], lo[1]);
        }
        __syncwarp();  // the chunk's 4 pieces read before any of them is overwritten
        const int q = idx % 4;  // (per_row % 4 == 0: the piece's place in its chunk)
        u32* const chunk = reinterpret_cast<u32*>(piece - 4 * q);
        *reinterpret_cast<uint2*>(chunk + 2 * q) = make_uint2(hi[0], hi[1]);
        if (F16_TERMS == F16_TERMS_HI_LO) *reinterpret_cast<uint2*>(chunk + 8 + 2 * q) = make_uint2(lo[0], lo[1]);
    }
    return 1.f / a;
}
#endif

struct SmemLayout {
    i64* rowoff;    // [BM]   element offset of each row's first value in x
    float* As;      // [BM][dpad + 4]
    float* Ws;      // [WSTAGES][BN][WSTR]
    float* cbias;   // [2][BN] output biases of the current and next pass
};

__device__ __forceinline__ SmemLayout smem_layout(int dpad) {
    extern __shared__ float4 smem4[];
    SmemLayout s;
    s.rowoff = reinterpret_cast<i64*>(smem4);  // first: 8 * BM bytes keep 16-byte alignment
    s.As = reinterpret_cast<float*>(s.rowoff + BM);
    s.Ws = s.As + BM * (dpad + 4);
    s.cbias = s.Ws + WSTAGES * BN * WSTR;
    return s;
}

// LayerNorm's mean and 1 / sigma (x: mean, y: rstd) of a row of As, a thread alone: its
// float4 reads are conflict-free (8 consecutive rows fall on distinct bank groups) and
// need no reduction across threads (a warp per row, reducing by shuffles after every
// pass, made this phase a chain of latencies: docs/performance.md). The mean, then the
// squared deviations (two passes: no cancellation); a row past 2^40 scaled in place first
// (project_math.cuh).
__device__ __forceinline__ float2 row_stats(float* row, int D, float eps) {
    float acc = 0.f, amax = 0.f;
#pragma unroll 8
    for (int k = 0; k < D; k += 4) {
        const float4 v = *reinterpret_cast<const float4*>(row + k);
        acc += sum4(v);
        amax = absmax4(amax, v);
    }
    const float eps_row = ln_rescale_huge(amax, eps, acc, [&](float f) {
        float sum = 0.f;
        for (int k = 0; k < D; k += 4) {
            const float4 v = scale4(*reinterpret_cast<const float4*>(row + k), f);
            *reinterpret_cast<float4*>(row + k) = v;
            sum += sum4(v);
        }
        return sum;
    });
    const float mu = acc / D;
    acc = 0.f;
#pragma unroll 8
    for (int k = 0; k < D; k += 4)
        acc = sum_squares4(acc, minus4(*reinterpret_cast<const float4*>(row + k), mu));
    return make_float2(mu, inverse_sqrt(acc / D + eps_row));  // biased variance, as torch
}

// row_stats with 2 threads per row (LN_PAIRS): thread `part` of a row takes its 16-wide
// chunks part, part + 2, ... (the 8 lanes of a quarter warp read distinct bank groups);
// each pass's sums meet by one shuffle.
__device__ __forceinline__ float2 row_stats_pair(float* row, int D, float eps, int part) {
    float acc = 0.f, amax = 0.f;
    for (int c0 = 16 * part; c0 < D; c0 += 32)
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (c0 + 4 * q < D) {
                const float4 v = *reinterpret_cast<const float4*>(row + c0 + 4 * q);
                acc += sum4(v);
                amax = absmax4(amax, v);
            }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const float eps_row = ln_rescale_huge(amax, eps, acc, [&](float f) {  // (both threads)
        float sum = 0.f;
        for (int c0 = 16 * part; c0 < D; c0 += 32)
            for (int q = 0; q < 4; ++q)
                if (c0 + 4 * q < D) {
                    float4* const p = reinterpret_cast<float4*>(row + c0 + 4 * q);
                    const float4 v = scale4(*p, f);
                    *p = v;
                    sum += sum4(v);
                }
        return sum;
    });
    const float mu = (acc + __shfl_xor_sync(0xffffffffu, acc, 1)) / D;
    acc = 0.f;
    for (int c0 = 16 * part; c0 < D; c0 += 32)
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (c0 + 4 * q < D)
                acc = sum_squares4(acc, minus4(*reinterpret_cast<const float4*>(row + c0 + 4 * q), mu));
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    return make_float2(mu, inverse_sqrt(acc / D + eps_row));
}

// xn = (x - mean) rstd gamma + beta of a row of As (stats: mean, rstd), in place, as the
// TF32 products take it (operand4; pad columns stay 0): this thread's 16-wide chunks,
// `part` of LN_STEP. (F16_TERMS writes fp16 chunks: ln_qkvg_project step 3.)
__device__ __forceinline__ void normalise_row_tf32(float* row, int D, float2 stats,
                                                   const float* __restrict__ gamma,
                                                   const float* __restrict__ beta, int part) {
    const float mu = stats.x, rstd = stats.y;
#pragma unroll 4  // gamma and beta are the same for every thread: loads of 4 trips in flight
    for (int k = 0; k < D; k += 4) {
        if (LN_STEP > 1 && (k / 16) % LN_STEP != part) continue;  // (this thread's chunks)
        st4(row + k, operand4(ln_affine4(*reinterpret_cast<const float4*>(row + k), mu, rstd,
                                         ld4(gamma + k), ld4(beta + k))));
    }
}

// F16_TERMS: the row tile's scale a_scale and the products' unscale = 1 / (a_scale W's
// scale), two more arguments of ln_qkvg_project (TF32: none; the functions that take
// them ignore theirs, F16_SCALES gives them 1).
#if F16_TERMS
#define F16_SCALE_PARAMS , float a_scale, float unscale
#define F16_SCALES a_scale, unscale
#define F16_SCALE_ARG(x) , x
#else
#define F16_SCALE_PARAMS
#define F16_SCALES 1.f, 1.f
#define F16_SCALE_ARG(x)
#endif
struct F16Scales {
    float a, un;  // a_scale, unscale
};

// q, k, v and gate: every 4D output column of the block's rows, BN at a time, into qkvg
// (store_qkvg: rows of QKVG_LD(D) words from the block's first, < 2^31 words: BM 4D) and
// vt. The ring is primed for the first pass.
__device__ __forceinline__ void project_qkvg(const float* As, int astr, const WeightRing& ring,
                                             BlockRows rows, int D, int N, int H, int npk,
                                             float q_scale, float* __restrict__ qkvg,
                                             float* __restrict__ vt, float unscale) {
    const int rows_here = rows.here();
    float* const block_out = qkvg + rows.m0 * QKVG_LD(D);
    auto store = [&](Tile& acc, int n0, const float2 (&cb)[4]) {
        store_qkvg(acc, n0, cb, D, q_scale, block_out, rows_here,
                   VtTarget{vt, rows.m0, N, H, npk});
    };
    project_columns<F16_TERMS>(As, astr, ring, store, unscale);
}

extern "C" __global__ void __launch_bounds__(THREADS, PROJECT_MIN_BLOCKS)
LN_QKVG_ENTRY(LN_QKVG_PARAMS(W)  // (project_epilogue.cuh)
              F16_SCALE_PARAMS
              ROW_BLOCK_ARGS  // (common.cuh ROW_BLOCK: the rows [row_begin, row_end))
              ) {
    allow_next_kernel();  // the attention may launch (it waits for this kernel: common.cuh)
    const int dpad = (D + BK - 1) / BK * BK, astr = dpad + 4;
    const SmemLayout s = smem_layout(dpad);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const BlockRows rows = block_rows(B, N, (i64)N * N, ROW_RANGE);
    const F16Scales scales{F16_SCALES};
    const int NO = 4 * D;
    const WeightRing ring{smem_addr(s.Ws), s.cbias, W, b_qkvg, D, NO, ring_chunks(dpad)};

    // 1. Where each row starts in x.
    row_offsets(s.rowoff, rows.m0, rows.M, N, sb, si, sj);
    __syncthreads();  // rowoff visible to every loader

    // 2. The raw row tile As[m][k], a warp per row, its lanes over consecutive 16 bytes
    //    (coalesced); zero past M and past D. One commit group, then the first weight
    //    chunks behind it, so they travel during the LayerNorm (BIAS_ONLY: none, no q, k,
    //    v or gate). 16-bit pairs (PAIR_DTYPE) with aligned rows: copied into each row's
    //    upper half (bytes 2 dpad on), widened in place once they land, a warp per row:
    //    every lane reads its pieces before any writes (a piece's floats cover other
    //    lanes' halves). (This step is written here, not in functions of its own: there,
    //    the compiler arranged the loops' address arithmetic and the widened halves'
    //    registers otherwise, and the machine code changed.)
    for (int ml = warp; ml < BM; ml += WARPS) {
        const bool row_ok = rows.m0 + ml < rows.M;
        const pair_t* const p = x + s.rowoff[ml];
        float* const dst = s.As + ml * astr;
        for (int k = 4 * lane; k < dpad; k += 128) {
            const bool ok = row_ok && k < D;
            if (x_vec) {
                if constexpr (PAIR_DTYPE == PAIR_F32)
                    cp_async16_or_zero(smem_addr(dst + k), ok ? p + k : x, ok);
                else
                    cp_async8_or_zero(smem_addr(dst) + 2 * (dpad + k), ok ? p + k : x, ok);
            } else
                st4(dst + k, ok ? make_float4(pair_value(p[k * sc]), pair_value(p[(k + 1) * sc]),
                                              pair_value(p[(k + 2) * sc]),
                                              pair_value(p[(k + 3) * sc]))
                                : zero4());
        }
    }
    cp_async_commit();
    if constexpr (BIAS_ONLY) {
        cp_async_wait<0>();  // the row tile landed
    } else {
        ring.prime(0);
        cp_async_wait<WSTAGES - 1>();  // the row tile landed (the weight chunks may not have)
    }
    __syncthreads();  // every warp's rows visible
    if constexpr (PAIR_DTYPE != PAIR_F32) if (x_vec) {
        for (int ml = warp; ml < BM; ml += WARPS) {
            float* const row = s.As + ml * astr;
            const char* const halves = reinterpret_cast<const char*>(row) + 2 * dpad;
            uint2 u[(MAX_DPAD + 127) / 128];
#pragma unroll
            for (int q = 0; q < (MAX_DPAD + 127) / 128; ++q) {
                const int k = 4 * lane + 128 * q;
                if (k < dpad) u[q] = *reinterpret_cast<const uint2*>(halves + 2 * k);
            }
            __syncwarp();  // the row's halves all read before they are overwritten
#pragma unroll
            for (int q = 0; q < (MAX_DPAD + 127) / 128; ++q) {
                const int k = 4 * lane + 128 * q;
                if (k < dpad)
                    st4(row + k, make_float4(pair_value((pair_t)(u[q].x & 0xffffu)),
                                             pair_value((pair_t)(u[q].x >> 16)),
                                             pair_value((pair_t)(u[q].y & 0xffffu)),
                                             pair_value((pair_t)(u[q].y >> 16))));
            }
        }
        __syncthreads();  // widened rows visible to the LayerNorm threads
    }

    // 3. LayerNorm in place, a thread per row (threads t < BM; row_stats), or (LN_PAIRS,
    //    off: LN_SPLIT) every thread, 2 per row: the statistics, then xn = (x - mean) rstd
    //    gamma + beta as the products take it.
    if (LN_PAIRS || t < BM) {
        const int part = LN_PAIRS ? t % 2 : 0;
        float* const row = s.As + (t / LN_STEP) * astr;
        float2 stats;
        if constexpr (LN_PAIRS) stats = row_stats_pair(row, D, eps, part);
        else stats = row_stats(row, D, eps);
        if constexpr (F16_TERMS != F16_TERMS_TF32) {
            // Each 16-wide chunk's 64 bytes in place: its 16 values (zero past D) times
            // a_scale as fp16 hi pairs, then lo pairs (F16_TERMS 3). (Here, not in a
            // function of its own: there, the compiler numbered the products' accumulator
            // registers otherwise, and the machine code of every F16_TERMS kernel changed.)
            const float mu = stats.x, rstd = stats.y;
            for (int c0 = 16 * part; c0 < dpad; c0 += 16 * LN_STEP) {  // (this thread's chunks)
                float y[16];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int k = c0 + 4 * q;
                    float4 x = zero4();
                    if (k < D) {
                        const float4 v = *reinterpret_cast<const float4*>(row + k);
                        const float4 g = ld4(gamma + k), c = ld4(beta + k);
                        x = make_float4((v.x - mu) * rstd * g.x + c.x, (v.y - mu) * rstd * g.y + c.y,
                                        (v.z - mu) * rstd * g.z + c.z, (v.w - mu) * rstd * g.w + c.w);
                    }
                    y[4 * q] = x.x * scales.a, y[4 * q + 1] = x.y * scales.a;
                    y[4 * q + 2] = x.z * scales.a, y[4 * q + 3] = x.w * scales.a;
                }
                u32 hi[8], lo[8];
#pragma unroll
                for (int p = 0; p < 8; ++p) {
                    if (F16_TERMS == F16_TERMS_HI)  // (its products read the hi parts alone)
                        hi[p] = pack_f16(y[2 * p], y[2 * p + 1]);
                    else
                        split_f16(y[2 * p], y[2 * p + 1], hi[p], lo[p]);
                }
                uint4* const chunk = reinterpret_cast<uint4*>(row + c0);
                chunk[0] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
                chunk[1] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
                if (F16_TERMS == F16_TERMS_HI_LO) {
                    chunk[2] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
                    chunk[3] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
                }
            }
        } else {
            normalise_row_tf32(row, D, stats, gamma, beta, part);
        }
    }
    __syncthreads();  // normalised tile complete

    // 4. The pair bias on tensor cores, with the mask folded in (pair_bias; ROW_BLOCK:
    //    none with a null bias, a block's projection after the bias pass: common.cuh).
    if (!ROW_BLOCK || bias != nullptr)
        pair_bias(s.As, astr, Wb, D, dpad, H, rows.m0, rows.M, N, mask, mask_kind, mb, mi, mj,
                  reinterpret_cast<bias_t*>(bias), npk F16_SCALE_ARG(scales.un));

    // 5. q, k, v and gate: every 4D output column of these rows, BN at a time.
    if constexpr (!BIAS_ONLY)
        project_qkvg(s.As, astr, ring, rows, D, N, H, npk, q_scale, qkvg, vt, scales.un);
}

// gated_out_project's A = op(g * o) (load_gated_tile: TF32; F16_TERMS: load_gated_tile_f16,
// scaled fp16 hi and lo, hi only for F16_TERMS 1; its maximum in rowoff, which is free
// here: a word per warp). Returns 1 / the block's scale a (F16_TERMS), else 1.
__device__ __forceinline__ float load_gated_operands(const float* __restrict__ qkvg, i64 M, int D,
                                                     int dpad, int astr, i64 m0,
                                                     const SmemLayout& s) {
#if F16_TERMS
    return load_gated_tile_f16(qkvg, M, D, dpad, astr, m0, s.As,
                               reinterpret_cast<float*>(s.rowoff));
#else
    load_gated_tile(qkvg, M, D, dpad, astr, m0, s.As);
    return 1.f;
#endif
}

// F16_TERMS: gated_out_project's w_unscale, 1 / Wo's scale (the block scales g o itself);
// F16_OUT_SCALE passes it on (TF32: none, 1).
#if F16_TERMS
#define F16_OUT_SCALE_PARAMS , float w_unscale
#define F16_OUT_SCALE w_unscale
#else
#define F16_OUT_SCALE_PARAMS
#define F16_OUT_SCALE 1.f
#endif

extern "C" __global__ void __launch_bounds__(THREADS, OUT_MIN_BLOCKS)
GATED_OUT_ENTRY(GATED_OUT_PARAMS(W)  // (project_epilogue.cuh)
                F16_OUT_SCALE_PARAMS OUT_TRANSPOSED_ARGS) {
    const int dpad = (D + BK - 1) / BK * BK, astr = dpad + 4;
    const SmemLayout s = smem_layout(dpad);
    const i64 m0 = (i64)blockIdx.x * BM;
    const WeightRing ring{smem_addr(s.Ws), s.cbias, W, b_out, D, D, ring_chunks(dpad)};
    ring.prime(0);  // the first weight chunks and biases travel while the row tile loads
    wait_for_previous_kernel();  // (and while the attention drains: o comes from it, common.cuh)

    // 1. A = g * o, row-major: the gated intermediate exists only here.
    const float a_unscale = load_gated_operands(qkvg, M, D, dpad, astr, m0, s);
    __syncthreads();  // tile complete before the products read it

    // 2. out = A Wo^T + bo. (F16_TERMS: w_unscale * a_unscale underflowed to 0 where a
    //    block's largest |g o| was below ~2^-96, its own scale a past 2^110: every output
    //    of the block 0, relative error 1; so the two factors one after the other.)
    const int rows_here = (int)min((i64)BM, M - m0);
    project_columns<F16_TERMS>(s.As, astr, ring, out_rows(out, m0, D, OUT_N, rows_here),
                               F16_OUT_SCALE, a_unscale);
}
