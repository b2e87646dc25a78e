// What the persistent warpgroup projections share (project_wgmma.cu: the tf32 and bf16
// modes, one fp16 product; project_wgmma_split.cu: the fp32 mode, fp16 hi + lo products):
// the block's shape and work split, the wgmma of a warpgroup's 32 columns from shared
// memory, the tiles of 64 keys of one pair row and their rows' bulk copies, the stores
// through shared memory (stmatrix, bulk copies out), the block's prologue, the steps of
// the LayerNorm projections alike in both, and the out projection's whole body
// (gated_out_projection, each file giving its format's steps). A kernel file defines
// PAIR_DIM (128) and includes project_math.cuh (EXACT_FP32 set) before this.
#pragma once
#include "common.cuh"
#include "wgmma.cuh"

#define PD PAIR_DIM
#define THREADS 512
#define ROWS 64                  // keys (rows) per tile
#define PARTS (THREADS / ROWS)   // threads per row in LayerNorm and the gated loads
#define KBLK (PD / 64)           // 128-byte swizzle blocks along K
#define KSTEPS (PD / 16)         // k16 steps of a product
#define NW 32                    // columns of a pass per warpgroup: one head
#define HEADS (PD / 32)
#define RAW_BYTES (ROWS * PD * 4)  // a RAW stage: a tile's 64 rows of x, fp32 (or 16-bit pairs)
#if PD != 128
#error "project_wgmma.cuh: written for D = 128 (4 heads of 32, one per warpgroup)"
#endif

// wgmma m64n32k16, fp16 operands from shared memory (both K-major), fp32 accumulators;
// `first`: D = A B (scale-d 0), else D += A B.
#define WGMMA_SS_N32(first, d, a, b)                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "                       \
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, "         \
                 first ", 1, 1, 0, 0;"                                                        \
                 : WGMMA_D8("+f", d, 0), WGMMA_D8("+f", d, 8) : "l"(a), "l"(b))

// acc = A [64 x D] x B^T: B's 32 K-major rows from `b_rows` (shared address of their
// first 128-byte block; the next block along K `b_step` bytes on): KSTEPS wgmma.
__device__ __forceinline__ void product32(float (&acc)[16], u32 a_tile, u32 b_rows, u32 b_step) {
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        const u64 a = sw128_desc(a_tile + (s / 4) * (ROWS * 128)) + 2 * (s % 4);
        const u64 b = sw128_desc(b_rows + (s / 4) * b_step) + 2 * (s % 4);
        if (s == 0)
            WGMMA_SS_N32("0", acc, a, b);
        else
            WGMMA_SS_N32("1", acc, a, b);
    }
}

// stmatrix: four 8x8 16-bit matrices from the warp's registers (lanes 8j .. 8j + 7 name the
// 16-byte rows of matrix j; each lane holds word (row lane / 4, column pair lane % 4) of
// every matrix, as a C fragment does); .trans stores each matrix transposed.
__device__ __forceinline__ void stsm_x4(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ void stsm_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}

// Global stores of 8 and 16 bytes (C++ float2 stores came out of NVRTC as two 4-byte ones:
// half sectors, ncu's "excessive sectors").
__device__ __forceinline__ void st_global2(float* p, float x, float y) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(x), "f"(y) : "memory");
}
// Two output elements of the pair's type (PAIR_DTYPE, project_math.cuh): 8 bytes, or
// one 4-byte word of 16-bit elements.
__device__ __forceinline__ void st_global_pair2(pair_t* p, float x, float y) {
#if PAIR_DTYPE == PAIR_F32
    st_global2(p, x, y);
#else
    asm volatile("st.global.b32 [%0], %1;" :: "l"(p), "r"(pair_bits2(make_float2(x, y))) : "memory");
#endif
}
__device__ __forceinline__ void st_global4(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Bulk copies shared -> global (the K and V^T tiles), one commit group per tile; the
// issuing thread waits for their reads of shared memory before the stage is refilled.
__device__ __forceinline__ void bulk_store(void* dst, u32 src, u32 bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Both kernels' work split is written for THREADS threads: another launch stops here, loud,
// instead of leaving heads unwritten.
__device__ __forceinline__ void check_block() {
    if (blockDim.x != THREADS) __trap();
}

// The block's three mbarriers from `first` (two stages, then the weights), one arrival each.
__device__ __forceinline__ void init_barriers(u32 first) {
    if (threadIdx.x == 0)
#pragma unroll
        for (int b = 0; b < 3; ++b) mbar_init(first + 8 * b, 1);
}

// The warpgroup of this thread, as a value the compiler knows is the same across the warp
// (the wgmma descriptors built from it stay in uniform registers).
__device__ __forceinline__ int warpgroup() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }

// Byte offset in a [D / 64][64 rows][128 B] sw128 tile of column c (c % 4 == 0: 4 fp16,
// 8 bytes) of row r.
__device__ __forceinline__ u32 a_offset(int r, int c) {
    return (c / 64) * (ROWS * 128) + sw128(r, 2 * (c % 64));
}

// The float4 piece of a D-float row that thread part p (of 8 per row) takes in its step k
// (k < D / 32): 8 (k ^ (r % 2)) + p, columns 4 (that) .. + 3. The 8 lanes of a quarter warp
// (one row) read distinct bank groups, and the 16 of a half warp (two rows) write the
// pieces' 4 fp16 to distinct banks of A's swizzled rows (checked by enumeration).
__device__ __forceinline__ int row_piece(int r, int p, int k) { return 8 * (k ^ (r & 1)) + p; }

// What both kernels start with: the dynamic shared memory aligned up to 1024 bytes (the
// swizzle atoms' alignment) as `smem` (generic) and `smem_s` (shared address), and this
// thread's place: tid, lane, warp, its warpgroup wg, w4 = warp % 4, g, t (the fragments'
// lane / 4 and lane % 4). A macro: as a function returning the two addresses, ptxas took
// them out of the uniform registers and the kernel's code changed throughout.
#define BLOCK_PROLOGUE()                                                                   \
    extern __shared__ float4 smem4[];                                                      \
    const u32 raw_s = smem_addr(smem4);                                                    \
    const u32 align = (1024u - (raw_s & 1023u)) & 1023u;                                   \
    char* const smem = reinterpret_cast<char*>(smem4) + align;                             \
    const u32 smem_s = raw_s + align;                                                      \
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;                         \
    const int wg = warpgroup(), w4 = warp % 4, g = lane >> 2, t = lane & 3

// The key tiles [t0, ntiles) of ln_qkvg_project_wgmma (nc per pair row): under ROW_BLOCK those
// of the rows (b, i) in [row_begin, row_end) only (common.cuh). A macro, as BLOCK_PROLOGUE.
#if ROW_BLOCK
#define KEY_TILE_RANGE() const int nc = (N + 63) / 64, t0 = (int)row_begin * nc, ntiles = (int)row_end * nc
#else
#define KEY_TILE_RANGE() const int nc = (N + 63) / 64, t0 = 0, ntiles = B * N * nc
#endif

// One tile of ln_qkvg_project_wgmma: pair row (b, i), keys key0 .. key0 + valid - 1.
struct KeyTile {
    int b, i, c, key0, valid;
    i64 bi;  // b N + i
    __device__ __forceinline__ KeyTile(int T, int N, int nc) {
        bi = T / nc;
        c = (int)(T - bi * nc);
        b = (int)(bi / N);
        i = (int)(bi - (i64)b * N);
        key0 = 64 * c;
        valid = min(64, N - key0);
    }
};

// x rows of tile T into RAW stage `stage` (by warp 0): one bulk copy where the keys' rows
// are contiguous (sj == D), else one per row; counted on the stage's mbarrier.
// (16-bit pairs: rows of PD elements in the stage's first half, widened by row_moments.)
__device__ __forceinline__ void load_rows(const pair_t* x, i64 sb, i64 si, i64 sj, const KeyTile& kt,
                                          u32 raw, u32 bar) {
    const int lane = threadIdx.x & 31;
    const int row_bytes = PD * (int)sizeof(pair_t);
    const pair_t* const src = x + kt.b * sb + kt.i * si + kt.key0 * sj;
    if (lane == 0) mbar_arrive_expect(bar, kt.valid * row_bytes);
    __syncwarp();  // lane 0's expected bytes announced before any copy can complete
    if (sj == PD) {
        if (lane == 0) bulk_copy(raw, src, kt.valid * row_bytes, bar);
    } else {
        for (int r = lane; r < kt.valid; r += 32) bulk_copy(raw + r * row_bytes, src + r * sj, row_bytes, bar);
    }
}
// This warp's 16 rows x 32 columns of 16-bit pairs (w[n][h]: column pair 8n + 2t of row g
// + 8h) through its 1 KiB of staging [16 rows][64 B] (chunks swizzled as sw64: conflict
// free both ways), then to global memory, 64 bytes of each row at `dst(row)`, whole
// sectors. valid: rows from it on are not stored.
template <class Dst>
__device__ __forceinline__ void store_rows16(const u32 (&w)[4][2], u32 stage, char* smem_stage,
                                             int valid_rows, Dst dst) {
    const int lane = threadIdx.x & 31, jm = lane >> 3, jr = lane & 7;
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // matrix j: column group n = 2u + j / 2, rows + 8 (j % 2)
        const int n = 2 * u + jm / 2, row = 8 * (jm % 2) + jr;
        stsm_x4(stage + sw64(row, 16 * n), w[2 * u][0], w[2 * u][1], w[2 * u + 1][0], w[2 * u + 1][1]);
    }
    __syncwarp();  // the staged rows written before any lane reads them back
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int row = lane / 4 + 8 * u, chunk = lane % 4;
        const uint4 v = *reinterpret_cast<const uint4*>(smem_stage + sw64(row, 16 * chunk));
        if (row < valid_rows) st_global4(dst(row) + 16 * chunk, v);
    }
    __syncwarp();  // read out before the warp writes its staging again
}

// BYTES of weights (an image laid out by the host) from src into shared memory at dst (one
// thread), 16 KiB a bulk copy, counted on the mbarrier bar.
template <u32 BYTES>
__device__ __forceinline__ void load_weights(u32 dst, const char* src, u32 bar) {
    mbar_arrive_expect(bar, BYTES);
    for (u32 off = 0; off < BYTES; off += 16384)
        bulk_copy(dst + off, src + off, BYTES % 16384 ? min(16384u, BYTES - off) : 16384u, bar);
}

// Warp 0, from a block's second tile on, past the barrier after LayerNorm, before it
// refills the RAW stage the previous tile used (one tile ahead, without a wait at the end
// of a tile: that held every warp at its barrier): lane 0 waits for the reads of that
// stage by the previous tile's bulk copies out (long done), then the warp for lane 0.
__device__ __forceinline__ void wait_stage_reads() {
    if ((threadIdx.x & 31) == 0) bulk_wait_read();
    __syncwarp();  // lane 0 past its wait before the warp issues the copies
}

// The gate in fp32 at words [D, 2D) of its qkvg rows (row_words words a row, the tile's
// first at m_first): this thread's rows r0 and r1 = r0 + 8 (those below `valid`), columns
// col0 + 8n and + 1, the values gate(n, e) of accumulator element 4n + e.
template <class Gate>
__device__ __forceinline__ void store_gate_f32(float* qkvg, i64 m_first, int row_words, int r0, int r1, int valid,
                                               int col0, Gate gate) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if ((h ? r1 : r0) >= valid) continue;
        float* const row = qkvg + (m_first + (h ? r1 : r0)) * row_words + PD + col0;
#pragma unroll
        for (int n = 0; n < 4; ++n) st_global2(row + 8 * n, gate(n, 2 * h), gate(n, 2 * h + 1));
    }
}

// Thread 0, once a tile's K and V^T tiles (or one part of them) are staged and every warp
// is past the barrier: each head's part_bytes at raw + head part_bytes to its tile in vt
// (tile_bytes per (b, i, head, 64 keys); this part at + part_offset), one commit group.
__device__ __forceinline__ void store_head_tiles(char* vt, const KeyTile& kt, int H, int npk, u32 raw,
                                                 int tile_bytes, int part_offset, int part_bytes) {
    for (int head = 0; head < HEADS; ++head)
        bulk_store(vt + ((kt.bi * H + head) * (npk / 64) + kt.c) * tile_bytes + part_offset,
                   raw + head * part_bytes, part_bytes);
    bulk_commit();
}

// Row r of a RAW stage of 64 x D floats: this thread's (part p's) PD / 32 float4 pieces of
// it (row_piece) in v, and the row's LayerNorm statistics, combined over its PARTS threads
// (consecutive lanes): the mean, then the squared deviations from it (two passes: no
// cancellation), rstd = 1 / sqrt(biased variance + eps), as torch.nn.LayerNorm.
__device__ __forceinline__ void row_moments(const pair_t* raw, int r, int p, float eps,
                                            float4 (&v)[PD / 32], float& mu, float& rstd) {
#if PAIR_DTYPE == PAIR_F32
    const float4* const row = reinterpret_cast<const float4*>(raw + r * PD);
#pragma unroll
    for (int k = 0; k < PD / 32; ++k) v[k] = row[row_piece(r, p, k)];
#else  // (4 16-bit elements per piece, widened)
    const uint2* const row = reinterpret_cast<const uint2*>(raw + r * PD);
#pragma unroll
    for (int k = 0; k < PD / 32; ++k) {
        const uint2 u = row[row_piece(r, p, k)];
        v[k] = make_float4(pair_value((unsigned short)(u.x & 0xffffu)), pair_value((unsigned short)(u.x >> 16)),
                           pair_value((unsigned short)(u.y & 0xffffu)), pair_value((unsigned short)(u.y >> 16)));
    }
#endif
    float sum = 0.f, amax = 0.f;
#pragma unroll
    for (int k = 0; k < PD / 32; ++k) {
        sum += (v[k].x + v[k].y) + (v[k].z + v[k].w);
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w))));
    }
#pragma unroll
    for (int lanes = 1; lanes < PARTS; lanes <<= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, lanes));
    }
    // A row past 2^40 (project_math.cuh, LayerNorm's range): v scaled by f, the sum again.
    // Warp-uniform, so the shuffles see every lane; the warp's other rows take f = 1 (v
    // and the sum as they were, bit for bit).
    if (__any_sync(0xffffffffu, ln_row_is_huge(amax))) {
        const bool huge = ln_row_is_huge(amax);
        const float f = huge ? ln_row_scale(amax) : 1.f;
        if (huge) eps = ln_scaled_eps(eps, f);
        sum = 0.f;
#pragma unroll
        for (int k = 0; k < PD / 32; ++k) {
            v[k] = make_float4(v[k].x * f, v[k].y * f, v[k].z * f, v[k].w * f);
            sum += (v[k].x + v[k].y) + (v[k].z + v[k].w);
        }
#pragma unroll
        for (int lanes = 1; lanes < PARTS; lanes <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, lanes);
    }
    mu = sum / PD;
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < PD / 32; ++k) {
        const float dx = v[k].x - mu, dy = v[k].y - mu, dz = v[k].z - mu, dw = v[k].w - mu;
        sq = fmaf(dx, dx, fmaf(dy, dy, fmaf(dz, dz, fmaf(dw, dw, sq))));
    }
#pragma unroll
    for (int lanes = 1; lanes < PARTS; lanes <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, lanes);
    rstd = inverse_sqrt(sq / PD + eps);
}

// The out projections' power of two a for a tile of g o: its largest |g o| (`top`, this
// thread's; the block's through `red`, a word per warp, and one barrier) into [2^13,
// 2^14), so that gates near 0 keep their bits in fp16 (project_mma.cu load_gated_tile_f16);
// at least 2^-126 for a's inverse to stay normal (below that, g o is at most 2^-112).
// NaN, where a fully masked query's o is, drops out of fmaxf.
__device__ __forceinline__ float tile_scale(float top, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int lanes = 16; lanes; lanes >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, lanes));
    if (lane == 0) red[warp] = top;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) top = fmaxf(top, red[w]);
    int e;
    frexpf(top, &e);  // top < 2^e
    return top > 0.f ? ldexpf(1.f, min(14 - e, 126)) : 1.f;
}

// After the Wo copy (thread 0): the attention's o awaited (common.cuh; Wo need not wait),
// then the block's first two tiles into IN stages 0 and 1 by `load_tile`.
template <class LoadTile>
__device__ __forceinline__ void load_first_out_tiles(i64 ntiles, LoadTile load_tile) {
    wait_for_previous_kernel();
    for (int s = 0; s < 2; ++s)
        if (blockIdx.x + s * gridDim.x < ntiles) load_tile(blockIdx.x + s * gridDim.x, s);
}

// `top` and the largest |element| of `v` (NaN drops out of fmaxf).
__device__ __forceinline__ float abs_max4(float top, float4 v) {
    return fmaxf(top, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
}

// Tile T's A written (k: the block's count of tiles): A made visible to the tensor cores,
// every thread past the barrier (A complete, RED read, the IN stage read), Wo awaited at
// the first tile, and the IN stage refilled with tile T + 2 gridDim.x (thread 0).
template <class LoadTile>
__device__ __forceinline__ void out_tile_written(int k, i64 T, i64 ntiles, int stage, u32 bar_w,
                                                 LoadTile load_tile) {
    fence_async_shared();
    __syncthreads();
    if (k == 0) mbar_wait(bar_w, 0);
    if (threadIdx.x == 0 && T + 2 * gridDim.x < ntiles) load_tile(T + 2 * gridDim.x, stage);
}

// The column biases of this thread's columns col0 + 8n, + 1 (b_out: a projection's [D]).
__device__ __forceinline__ void column_biases(float2 (&bo)[4], const float* b_out, int col0) {
#pragma unroll
    for (int n = 0; n < 4; ++n) bo[n] = ld2(b_out + col0 + 8 * n);
}

// The out projections' tile T of qkvg rows (row_words words each) into the IN stage s at
// `in_s` + s in_bytes (one thread), counted on the mbarrier bar_in + 8 s.
__device__ __forceinline__ void load_out_tile(const float* qkvg, i64 M, i64 T, int s, u32 in_s, u32 in_bytes,
                                              int row_words, u32 bar_in) {
    const u32 bytes = (u32)min((i64)ROWS, M - T * ROWS) * row_words * 4;
    mbar_arrive_expect(bar_in + 8 * s, bytes);
    bulk_copy(in_s + s * in_bytes, qkvg + T * ROWS * row_words, bytes, bar_in + 8 * s);
}

// The out projections' result for this thread's two rows of tile T (16 w4 + g + 8h, those
// below rows_here), columns col0 + 8n and + 1: acc w_unscale, then a_unscale (one after the
// other: their product may fall below fp32's range), + bo. `N`: the pair's N under
// OUT_TRANSPOSED (rows to caller_row, common.cuh), else unused.
__device__ __forceinline__ void store_out_rows(pair_t* out, i64 T, int rows_here, int N, int col0, int w4, int g,
                                               const float (&acc)[16], float w_unscale, float a_unscale,
                                               const float2 (&bo)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int rr = 16 * w4 + g + 8 * h;
        if (rr >= rows_here) continue;
#if OUT_TRANSPOSED  // the ending node: the caller's row (common.cuh)
        pair_t* const dst = out + caller_row(T * ROWS + rr, N) * PD + col0;
#else
        pair_t* const dst = out + (T * ROWS + rr) * PD + col0;
#endif
#pragma unroll
        for (int n = 0; n < 4; ++n)
            st_global_pair2(dst + 8 * n, acc[4 * n + 2 * h] * w_unscale * a_unscale + bo[n].x,
                            acc[4 * n + 2 * h + 1] * w_unscale * a_unscale + bo[n].y);
    }
}

// An out projection's whole body, both formats: out = (g o) Wo^T + bo over tiles of 64 qkvg
// rows (Steps: the kernel's layout of shared memory, off_* and in_bytes, row_words, and
// its format's steps). The prologue (BLOCK_PROLOGUE, the mbarriers bar_in (IN stage s at
// + 8 s) and bar_w (Wo), RED, load_tile: load_out_tile into IN stage s), Wo's copy
// (Steps::load_wo) and the block's first two tiles (load_first_out_tiles);
// then each tile T of this block (k its count, in IN stage k % 2), once its rows are in:
// g o of this thread's pieces of row r (Steps::gated_pieces), the tile's power of two a
// (tile_scale; rows past M: whatever the stage held, counted as 0; the barrier inside:
// also every thread is past the previous tile's products), g o a into A
// (Steps::write_a), out_tile_written, A Wo^T (Steps::product, this warpgroup's 32 columns,
// waited for) and store_out_rows. The scratch the steps take (Steps::AScratch, Products)
// is declared here, in this order: declared in the steps, the compiler took it up
// otherwise and the machine code changed.
template <class Steps>
__device__ __forceinline__ void gated_out_projection(const float* __restrict__ qkvg, i64 M,
                                                     const uint4* __restrict__ wo_image,
                                                     const float* __restrict__ b_out, pair_t* __restrict__ out,
                                                     float w_unscale, int N) {
    BLOCK_PROLOGUE();
    const i64 ntiles = (M + ROWS - 1) / ROWS;
    const u32 bar_w = smem_s + Steps::off_bar + 16, bar_in = smem_s + Steps::off_bar;
    float* const red = reinterpret_cast<float*>(smem + Steps::off_red);
    check_block();
    auto load_tile = [&](i64 T, int s) {
        load_out_tile(qkvg, M, T, s, smem_s + Steps::off_in, Steps::in_bytes, Steps::row_words, bar_in);
    };
    init_barriers(bar_in);
    __syncthreads();  // the mbarriers initialised before thread 0 counts copies on them
    if (tid == 0) {
        Steps::load_wo(smem_s, wo_image, bar_w);
        load_first_out_tiles(ntiles, load_tile);
    }
    const int col0 = NW * wg + 2 * t;
    float2 bo[4];
    column_biases(bo, b_out, col0);

    const int r = tid / PARTS, p = tid % PARTS;
    int k = 0;
    for (i64 T = blockIdx.x; T < ntiles; T += gridDim.x, ++k) {
        const int stage = k & 1;
        const int rows_here = (int)min((i64)ROWS, M - T * ROWS);
        mbar_wait(bar_in + 8 * stage, (k >> 1) & 1);

        float4 go[PD / 32];
        const float top = Steps::gated_pieces(go, smem + Steps::off_in + stage * Steps::in_bytes, r, p);
        const float a = tile_scale(r < rows_here ? top : 0.f, red);
        typename Steps::AScratch hi, lo;
        Steps::write_a(hi, lo, smem, go, a, r, p, rows_here);
        out_tile_written(k, T, ntiles, stage, bar_w, load_tile);

        typename Steps::Products products;
        float acc[16];
        Steps::product(products, acc, smem_s + Steps::off_a, smem_s + Steps::off_wo + wg * NW * 128);
        const float a_unscale = 1.f / a;
        store_out_rows(out, T, rows_here, N, col0, w4, g, acc, w_unscale, a_unscale, bo);
    }
}
