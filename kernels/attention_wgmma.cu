// The TF32 attention of attention_mma.cu (attention_tf32) on Hopper's warpgroup products
// (wgmma, sm_90a; wgmma.cuh): the same computation, inputs, outputs and edge cases. For
// every row (b, i), head h and query j (q and bias pre-scaled by log2 e):
//
//   s[k]         = q[b,i,j,h] . k[b,i,k,h] + bias[b,h,j,k]    # bias = -inf where masked
//   o[b,i,j,h]   = sum_k 2^(s[k] - max s) v[b,i,k,h] / sum_k 2^(s[k] - max s)
//
// Why: mma.sync keeps each warp issuing its own small products and waiting on them (at
// N = 1024 the TF32 kernel reaches ~27% of the TF32 ceiling, its warps stalled on shared
// memory and on the tensor cores' latency). A wgmma multiplies a 64-query tile by a whole
// key tile in one instruction, reads K and V from shared memory itself, and runs while
// the warps go on.
//
// Work split: a block owns ROWS pair rows i (of one batch b) and BQ = 128 queries of one
// head; each row has 2 warpgroups of 64 queries. Per key tile of BK = 64 keys and
// warpgroup:
//   S (64 x 64) = bias + Q K^T   4 wgmma m64n64k8: Q (TF32, rounded to nearest) in
//                                registers for the whole key loop, K from shared memory
//   online softmax of S in registers, fp32 (as attention_mma.cu, lazy rescaling)
//   [O | l] (64 x 40) += P [V | 1 | 0]   8 wgmma m64n40k8: P straight from S's registers
//                                (as is: the tensor cores truncate it to TF32), V from
//                                shared memory with a column of ones appended, so the row
//                                sums l come out of the same product, from the same
//                                truncated P, as O's numerator (column d of the result).
// tf32 operands must be K-major: K [key][dim] is already (the projection's layout, copied
// with cp.async); V must be read as V^T [dim][key], so each tile is loaded into registers
// during the tile before it and stored transposed. P's register layout (its A fragment
// takes S's columns 2t, 2t+1 as A's t, t+4) fixes which key each V^T position holds:
// within each 8 keys, position p holds key perm(p) = 2p (p < 4), 2(p - 4) + 1 (p >= 4),
// so a key goes to v_position(key) (the inverse, as in attention_mma.cu).
//
// Shared memory, all parts 1024-byte aligned (128-byte swizzle atoms; wgmma.cuh):
//   STAGES x [ROWS x K tile [BK][32] tf32 (8 KiB), bias tile [BQ][BK + 8] fp32]
//   2 buffers x ROWS x V^T tile: BK / 32 columns of [d + 8 rows][32 keys] (row d is ones,
//   d + 1 .. d + 7 zeros: written once)
// The K and bias tiles are copied STAGES - 1 tiles ahead (cp.async); one barrier per tile.
//
// Launch: grid ceil(N/BQ) * H * B * ceil(N/ROWS), flattened, query tile fastest; block
// THREADS = 256 ROWS; dynamic shared memory SMEM_BYTES (triattn_cupy/_configs.py mirrors
// it). Pointers and layouts as attention_tf32 (attention_mma.cu): qkvg [B*N*N, 4D] with
// q fp32, k and v rounded to TF32 (project_epilogue.cuh KV_FORMAT 1), o written over q;
// bias [B, H, N, NPK], NPK a multiple of BK, -inf on the padded keys.
#include "common.cuh"
#include "wgmma.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 32     // d: one 128-byte row of K per key
#endif
#ifndef ROWS
#define ROWS 1          // pair rows per block (1 or 2), sharing the bias tiles
#endif
#ifndef STAGES
#define STAGES 3        // K and bias tiles in the cp.async ring (3 or more when PIPELINE)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2    // __launch_bounds__ occupancy hint
#endif
#ifndef PIPELINE
#define PIPELINE 1      // 1: two products in flight per warpgroup (see the key loop)
#endif
#ifndef BIAS_AFTER
#define BIAS_AFTER 0    // 1: the bias added after Q K^T (issue_s)
#endif
#ifndef PINGPONG
#define PINGPONG 0      // 1: a row's second warpgroup starts its Q K^T when the first's is done
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
#error "attention_wgmma.cu: HEAD_DIM must be 32 (one 128-byte swizzle row of K per key)"
#endif
#if ROWS != 1 && ROWS != 2
#error "attention_wgmma.cu: ROWS must be 1 or 2"
#endif
#if PIPELINE && STAGES < 3
#error "attention_wgmma.cu: the pipelined loop needs STAGES >= 3"
#endif
#define VT_BUFFERS (PIPELINE ? 3 : 2)

#define K_TILE (BK * 128)                 // bytes
#define BSTR (BK + 8)                     // words per bias row (conflict-free float2 reads)
#define BIAS_TILE (BQ * BSTR * 4)         // bytes
#define STAGE_BYTES (ROWS * K_TILE + BIAS_TILE)
#define VT_COLUMN (ON * 128)              // one 32-key column of V^T
#define VT_TILE ((BK / 32) * VT_COLUMN)
#define VT_OFFSET (STAGES * STAGE_BYTES)
// + 1024: the dynamic shared memory is aligned up to 1024 bytes at run time
#define SMEM_BYTES (VT_OFFSET + VT_BUFFERS * ROWS * VT_TILE + 1024)

// Per row, BK keys of 8 16-byte chunks (4 dims) each of K (copied) and of V (loaded).
#define COPIES (ROWS * BK * 8)
#define COPIES_PER_THREAD (COPIES / THREADS)
#if COPIES % THREADS != 0 || BIAS_TILE % 1024 != 0 || VT_COLUMN % 1024 != 0
#error "attention_wgmma.cu: the tile shapes must give whole copies and 1024-byte parts"
#endif

#define TF32_ONE 0x3f800000u

// Position of `key` in its V^T row (see the header): within each 8 keys, even keys first.
__device__ __forceinline__ int v_position(int key) {
    return (key & ~7) | ((key & 1) << 2) | ((key >> 1) & 3);
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
attention_tf32_wgmma(float* qkvg, const float* __restrict__ bias, int B, int N, int H,
                     int npk, int nan_fully_masked) {
    extern __shared__ float4 smem4[];
    const u32 raw_s = smem_addr(smem4);
    const u32 align = (1024u - (raw_s & 1023u)) & 1023u;
    char* const smem = reinterpret_cast<char*>(smem4) + align;
    const u32 smem_s = raw_s + align;

    const int D = H * HEAD_DIM;
    const i64 ld = 4LL * D;
    const int nq = (N + BQ - 1) / BQ, nr = (N + ROWS - 1) / ROWS;
    const int qtile = (int)(blockIdx.x % nq);
    i64 rest = blockIdx.x / nq;
    const int head = (int)(rest % H);
    rest /= H;
    const int i0 = (int)(rest % nr) * ROWS;
    const int b = (int)(rest / nr);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;

    // qkvg at (b, i0 + r, j = 0), this head's q columns.
    auto row_base = [&](int r) { return qkvg + ((i64)b * N + i0 + r) * N * ld + head * HEAD_DIM; };

    // This warp: warpgroup wg, row rw of the block, queries q0 .. q0 + 15.
    const int wg = warp / 4, rw = wg / ROW_GROUPS;
    const bool row_ok = i0 + rw < N;
    float* const row = row_base(rw);
    const int q_in_tile = (wg % ROW_GROUPS) * 64 + (warp % 4) * 16;
    const int q0 = qtile * BQ + q_in_tile;

    // ---- the bias tile of the block's BQ queries, shared by its rows (attention_mma.cu) ----
    const float* const bias_bh = bias + ((i64)b * H + head) * N * npk;
#define RSTEP (THREADS / (BK / 4))
    const int copy_col = 4 * (tid % (BK / 4)), copy_row = tid / (BK / 4);
    const int copy_q = qtile * BQ + copy_row;
    const float* const bias_src = bias_bh + (i64)copy_q * npk + copy_col;
    const u32 bias_dst = 4 * (copy_row * BSTR + copy_col);
    auto copy_bias = [&](int k0, u32 tile) {
        const float* const src = opaque(bias_src + k0);
#pragma unroll
        for (int it = 0; it < BQ / RSTEP; ++it)
            cp_async16_or_zero(tile + bias_dst + 4 * it * RSTEP * BSTR,
                               src + (i64)(it * RSTEP) * npk, copy_q + it * RSTEP < N);
    };

    // ---- Q: A fragments per 8-dim k-step, rounded to TF32 (zero past N) ----
    u32 qa[DT][4];
    {
        const int j0 = q0 + g, j1 = j0 + 8;
        const bool ok0 = row_ok && j0 < N, ok1 = row_ok && j1 < N;
#pragma unroll
        for (int kk = 0; kk < DT; ++kk) {
            const int c = 8 * kk + t;
            qa[kk][0] = to_tf32(ok0 ? row[(i64)j0 * ld + c] : 0.f);
            qa[kk][1] = to_tf32(ok1 ? row[(i64)j1 * ld + c] : 0.f);
            qa[kk][2] = to_tf32(ok0 ? row[(i64)j0 * ld + c + 4] : 0.f);
            qa[kk][3] = to_tf32(ok1 ? row[(i64)j1 * ld + c + 4] : 0.f);
        }
    }

    // ---- this thread's K copies and V loads: chunk c (4 dims) of key `key` of row r0;
    // its copy `it` is it * THREADS / 8 keys further: 32 keys on in the same row (ROWS 1)
    // or the same key of the next row (ROWS 2), so every address below is the first
    // copy's plus a constant (kept as one value each: arrays of them cost registers) ----
#define KEY_STEP ((THREADS / 8) % BK)
#define ROW_STEP ((THREADS / 8) / BK)
#if KEY_STEP % 32 != 0 || COPIES_PER_THREAD * KEY_STEP > BK
#error "attention_wgmma.cu: a thread's copies must keep its key position in a 32-key column"
#endif
    const int cc = tid % 8, key = (tid / 8) % BK, r0 = tid / (8 * BK);
    // Sources as 32-bit byte offsets from k of row i0 at key 0 (attention_mma.cu: fine
    // unless N > 43000); V is D floats after K.
    const char* const k_base = reinterpret_cast<const char*>(row_base(0) + D);
    const u32 copy_src = (u32)(((i64)r0 * N + key) * ld * 4) + 16 * cc;
    const u32 src_step = (u32)((i64)(ROW_STEP * N + KEY_STEP) * ld * 4);
    const u32 k_dst = r0 * K_TILE + sw128(key, 16 * cc);
#define K_DST_STEP (ROW_STEP * K_TILE + KEY_STEP * 128)
    // V^T: dim 4c + e goes to row 4c + e of key column p / 32, position p % 32, p =
    // v_position(key): byte vt_dst + 128 e + 16 ((p % 32) / 4 ^ (4c + e) % 8) (sw128),
    // with vt_chunk = (p % 32) / 4 ^ (4c % 8) and (4c + e) % 8 = 4c % 8 + e.
    const int p = v_position(key);
    const u32 vt_dst = r0 * VT_TILE + (p / 32) * VT_COLUMN + 4 * cc * 128 + 4 * (p % 4);
    const u32 vt_chunk = ((p % 32) / 4) ^ (4 * cc % 8);
#define VT_DST_STEP (ROW_STEP * VT_TILE + (KEY_STEP / 32) * VT_COLUMN)
    // Whether copy `it` of the tile at k0 holds a key (else zeros): its row and key below N.
    auto holds = [&](int it, int k0) {
        return k0 + key + it * KEY_STEP < N && (ROW_STEP == 0 || i0 + r0 + it * ROW_STEP < N);
    };

    auto issue = [&](int k0, int stage) {  // K and bias of the tile at k0, then commit
        if (k0 < N) {
            const u32 st = smem_s + stage * STAGE_BYTES;
            const char* const tile_base = k_base + (i64)k0 * ld * 4 + copy_src;
#pragma unroll
            for (int it = 0; it < COPIES_PER_THREAD; ++it) {
                const bool ok = holds(it, k0);
                cp_async16_or_zero(st + k_dst + it * K_DST_STEP,
                                   ok ? tile_base + it * src_step : k_base, ok);
            }
            copy_bias(k0, st + ROWS * K_TILE);
        }
        cp_async_commit();
    };
    float4 vreg[COPIES_PER_THREAD];
    auto load_v = [&](int k0) {
        const char* const tile_base = k_base + (i64)k0 * ld * 4 + 4 * D + copy_src;
#pragma unroll
        for (int it = 0; it < COPIES_PER_THREAD; ++it)
            vreg[it] = holds(it, k0)
                ? ld4(reinterpret_cast<const float*>(tile_base + it * src_step)) : zero4();
    };
    auto store_vt = [&](int buffer) {
        char* const vt = smem + VT_OFFSET + buffer * ROWS * VT_TILE + vt_dst;
#pragma unroll
        for (int it = 0; it < COPIES_PER_THREAD; ++it) {
            const float x[4] = {vreg[it].x, vreg[it].y, vreg[it].z, vreg[it].w};
#pragma unroll
            for (int e = 0; e < 4; ++e)
                *reinterpret_cast<float*>(vt + it * VT_DST_STEP + 128 * e + ((vt_chunk ^ e) << 4)) = x[e];
        }
    };

    // The ones row (d) and zero rows (d + 1 .. d + 7) of every V^T tile, once.
    for (int idx = tid; idx < VT_BUFFERS * ROWS * (BK / 32) * 8 * 32; idx += THREADS) {
        const int key = idx % 32, n = HEAD_DIM + (idx / 32) % 8, column = idx / 256;
        *reinterpret_cast<u32*>(smem + VT_OFFSET + column * VT_COLUMN + sw128(n, 4 * key)) =
            n == HEAD_DIM ? TF32_ONE : 0u;
    }

    // [O | l] in wgmma's accumulator layout (wgmma.cuh): o[4v + 0..1] row g, o[4v + 2..3]
    // row g + 8, columns 8v + 2t, + 1; the row sums at column d (lanes t = 0: o[4 DT],
    // o[4 DT + 2]). m_sub / m_lim: the reference maximum of rows g and g + 8 (attention_mma.cu).
    float o[4 * ON / 8];
#pragma unroll
    for (int i = 0; i < 4 * ON / 8; ++i) o[i] = 0.f;
    float m_sub[2] = {0.f, 0.f}, m_lim[2] = {neg_inf(), neg_inf()};

    // S = bias + Q K^T of the tile in ring stage `stage`. BIAS_AFTER 0: S starts as the
    // bias tile and the products accumulate onto it (as attention_tf32); issue_s issues
    // them (not waited for). BIAS_AFTER 1: the products start from zero and the bias is
    // added in fp32 once they are done (add_bias): its shared-memory reads then run during
    // the products instead of before them.
    const float* const bias_base = reinterpret_cast<const float*>(smem + ROWS * K_TILE)
                                   + (q_in_tile + g) * BSTR + 2 * t;
    auto load_bias = [&](float (&x)[4 * NT], int stage) {
        const float* const bias_tile = bias_base + stage * (STAGE_BYTES / 4);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float2 x0 = *reinterpret_cast<const float2*>(bias_tile + 8 * n);
            const float2 x1 = *reinterpret_cast<const float2*>(bias_tile + 8 * BSTR + 8 * n);
            x[4 * n] = x0.x, x[4 * n + 1] = x0.y, x[4 * n + 2] = x1.x, x[4 * n + 3] = x1.y;
        }
    };
    auto issue_s = [&](float (&s)[4 * NT], int stage) {
        if (!BIAS_AFTER) load_bias(s, stage);
        const u64 k_desc = sw128_desc(smem_s + stage * STAGE_BYTES + rw * K_TILE);
        wgmma_fence();
        wgmma_m64n64k8_tf32<!BIAS_AFTER>(s, qa[0], k_desc);
#pragma unroll
        for (int kk = 1; kk < DT; ++kk) wgmma_m64n64k8_tf32(s, qa[kk], k_desc + 2 * kk);
        wgmma_commit();
    };

    // The online softmax of S (its product done), in two parts. rescale: the reference
    // maximum m of rows g and g + 8 moves (lazily, as attention_mma.cu) and O is rescaled
    // with it, so no P V product may be running, nor any other product (a wgmma in flight
    // while other instructions write accumulators is serialized by the compiler).
    // exponentiate: P = 2^(S - m) as the A fragments of the 8 k-steps of P V, (c0, c2, c1,
    // c3) of S's column group kk; it may overlap any product.
    auto rescale = [&](const float (&s)[4 * NT]) {
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
                const float alpha = m_new == neg_inf() ? 1.f : fast_exp2(m_old - m_new);
                m_sub[r] = m_new == neg_inf() ? 0.f : m_new;
                m_lim[r] = m_new + RESCALE_SLACK;
#pragma unroll
                for (int v = 0; v < ON / 8; ++v) {
                    o[4 * v + 2 * r] *= alpha;
                    o[4 * v + 2 * r + 1] *= alpha;
                }
            }
        }
    };
    auto exponentiate = [&](const float (&s)[4 * NT], u32 (&pa)[NT][4]) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            pa[n][0] = __float_as_uint(fast_exp2(s[4 * n] - m_sub[0]));
            pa[n][2] = __float_as_uint(fast_exp2(s[4 * n + 1] - m_sub[0]));
            pa[n][1] = __float_as_uint(fast_exp2(s[4 * n + 2] - m_sub[1]));
            pa[n][3] = __float_as_uint(fast_exp2(s[4 * n + 3] - m_sub[1]));
        }
    };

    // [O | l] += P [V | 1 | 0], issued: k-step kk takes keys 8kk .. 8kk + 7 of V^T buffer
    // `buffer`, 32 bytes along the rows of its 32-key column.
    auto issue_pv = [&](const u32 (&pa)[NT][4], int buffer) {
        const u32 vt = smem_s + VT_OFFSET + (buffer * ROWS + rw) * VT_TILE;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < NT; ++kk)
            wgmma_m64n40k8_tf32(o, pa[kk], sw128_desc(vt + (kk / 4) * VT_COLUMN) + 2 * (kk % 4));
        wgmma_commit();
    };

    // ---- the key loop: K and bias through the ring, V through registers ----
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) issue(st * BK, st);
    load_v(0);
    store_vt(0);
    u32 pa[NT][4];
#if PIPELINE
    // Each warpgroup keeps two products on the tensor cores while it computes: in the step
    // of tile t, S(t + 1) runs during the softmax of tile t, and P V of tile t during the
    // next step's barrier, copies and bias loads. The step's one wait (for S(t) and
    // P V(t - 1)) frees the registers S(t + 1) is issued into (they held S(t - 1), whose
    // P is in pa until P V(t - 1) is done); the rescaling of O comes before S(t + 1) is
    // issued, the exponentials after. Tile t + 1's K and bias must be in shared
    // memory at step t: STAGES >= 3. V^T has 3 buffers: the one step t fills (t + 1) was
    // last read by P V(t - 2), which every warpgroup waited for before this step's barrier.
    cp_async_wait<STAGES - 2>();  // tile 0's copies
    fence_async_shared();
    __syncthreads();
    float s_a[4 * NT], s_b[4 * NT];
    pin(o);  // zeroed here: the compiler would sink the zeros past the first product
    issue_s(s_a, 0);
    auto step = [&](float (&cur)[4 * NT], float (&next)[4 * NT], int k0, int tile, int stage) {
        const bool more = k0 + BK < N;
        if (more) load_v(k0 + BK);           // V(t + 1), in flight during this step
        cp_async_wait<STAGES - 3>();          // tile t + 1's K and bias (this thread's)
        fence_async_shared();                 // and V^T(t), stored last step
        __syncthreads();
        issue(k0 + (STAGES - 1) * BK, stage == 0 ? STAGES - 1 : stage - 1);
        wgmma_wait<0>();                      // S(t), P V(t - 1)
        pin(cur);
        pin(o);
#pragma unroll
        for (int n = 0; n < NT; ++n) pin(pa[n]);
#if BIAS_AFTER
        {
            float bias_s[4 * NT];
            load_bias(bias_s, stage);
#pragma unroll
            for (int i = 0; i < 4 * NT; ++i) cur[i] += bias_s[i];
        }
#endif
        rescale(cur);
        // Unconditional: past the last tile it multiplies a stale stage, never used; a
        // conditional issue would make the compiler merge two versions of `next` with
        // moves while the products run, and serialize them.
        issue_s(next, stage == STAGES - 1 ? 0 : stage + 1);
        exponentiate(cur, pa);
        issue_pv(pa, tile % VT_BUFFERS);
        if (more) store_vt((tile + 1) % VT_BUFFERS);
    };
    for (int k0 = 0, tile = 0, stage = 0;; ) {
        step(s_a, s_b, k0, tile, stage);
        k0 += BK, ++tile, stage = stage == STAGES - 1 ? 0 : stage + 1;
        if (k0 >= N) break;
        step(s_b, s_a, k0, tile, stage);
        k0 += BK, ++tile, stage = stage == STAGES - 1 ? 0 : stage + 1;
        if (k0 >= N) break;
    }
    wgmma_wait<0>();
    pin(o);
#else
    // One tile at a time: each product waited for where it was issued.
    int stage = 0;
    for (int k0 = 0, tile = 0; k0 < N; k0 += BK, ++tile) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of this tile landed
        fence_async_shared();         // its copies and V^T stores, before wgmma reads them
        __syncthreads();              // everyone's; every warpgroup done with the last tile
        issue(k0 + (STAGES - 1) * BK, stage == 0 ? STAGES - 1 : stage - 1);
        const bool more = k0 + BK < N;
        if (more) load_v(k0 + BK);    // in flight while this tile is multiplied
        // PINGPONG: the barrier above starts both warpgroups of a row together, and they
        // would contend for the tensor cores, then for the exponentials, then again; the
        // second instead waits (named barrier 1 + row) until the first has its S, so that
        // one's products overlap the other's softmax.
        const bool second = PINGPONG && wg % ROW_GROUPS == 1;
        if (second) asm volatile("bar.sync %0, %1;" :: "r"(1 + rw), "n"(128 * ROW_GROUPS));
        float s[4 * NT];
        issue_s(s, stage);
#if BIAS_AFTER
        float bias_s[4 * NT];
        load_bias(bias_s, stage);
#endif
        wgmma_wait<0>();
        pin(s);
        pin(o);
        if (PINGPONG && !second) asm volatile("bar.arrive %0, %1;" :: "r"(1 + rw), "n"(128 * ROW_GROUPS));
#if BIAS_AFTER
#pragma unroll
        for (int i = 0; i < 4 * NT; ++i) s[i] += bias_s[i];
#endif
        rescale(s);
        exponentiate(s, pa);
        issue_pv(pa, tile & 1);
        wgmma_wait<0>();  // before the barrier that lets this tile's buffers be refilled
        pin(o);
#pragma unroll
        for (int n = 0; n < NT; ++n) pin(pa[n]);
        if (more) store_vt((tile + 1) & 1);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
#endif

    // o / l over q; l = 0 only where every key was masked. The sums are in lanes t = 0.
    const float total[2] = {__shfl_sync(0xffffffffu, o[4 * DT], lane & ~3),
                            __shfl_sync(0xffffffffu, o[4 * DT + 2], lane & ~3)};
    if (!row_ok) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = q0 + 8 * r + g;
        if (j >= N) continue;
        const bool fully_masked = total[r] == 0.f;
        const float inv = fully_masked ? 0.f : 1.0f / total[r];
        const float fill = nan_fully_masked ? quiet_nan() : 0.f;
        float* const out = row + (i64)j * ld + 2 * t;
#pragma unroll
        for (int v = 0; v < DT; ++v) {
            float2 x = make_float2(o[4 * v + 2 * r] * inv, o[4 * v + 2 * r + 1] * inv);
            if (fully_masked) x = make_float2(fill, fill);
            *reinterpret_cast<float2*>(out + 8 * v) = x;
        }
    }
}
