// project_columns on Hopper's warpgroup products (WGMMA_PRODUCTS, sm_90a), for the
// projections of the wgmma attentions (KV_FORMAT 5 to 8), whose products are on fp16
// operands (F16_TERMS). Included by project_mma.cu in place of its mma.sync loop, after
// the ring (WeightRing), the tile (Tile, MT = 1, TROWS = 2) and wg_row0 / wg_col0.
//
// Why: with mma.sync each warp loads the B fragments of its 32 columns from the ring by
// ldmatrix, and the 8 warps of a block load every chunk 2 (BM 128) or 4 (BM 64) times
// over. wgmma reads B from shared memory itself, once per warpgroup, and takes a 64-row A
// per instruction: the ring's stage is already a K-major tile in wgmma's 64-byte swizzle
// (w_piece is sw64), so it is B as it lies, by descriptor (sw64_desc). A stays where it
// is, row-major in As, loaded by ldmatrix as for mma.sync (wgmma's A fragment from
// registers is mma.sync m16n8k16's, per warp of the group).
//
//   F16_TERMS 1: the chunk is two 16-wide k-steps of hi parts; one wgmma per k-step into
//     the accumulator (m64n128k16, 128-row blocks; m64n64k16, 64-row blocks).
//   F16_TERMS 3: one k-step of hi and lo; per 64 columns the three terms (hi*lo, lo*hi,
//     hi*hi, small ones first) into a fresh accumulator t (the first with scale-d 0),
//     added to the accumulator in fp32 as split_terms does (the tensor cores' own chained
//     accumulation lost accuracy with D: project_mma.cu split_terms).
// A chunk's products complete (wgmma_wait<0>) before the next barrier, after which the
// ring refills the stage they read.
#pragma once
#include "wgmma.cuh"

#define WG_ACC (WG_COLS / 2)  // accumulators per thread: 64 rows x WG_COLS over 128 threads

// D (64 x WG_COLS) += A (64 x 16, fp16, registers) B (16 x WG_COLS, descriptor).
__device__ __forceinline__ void wg_product(float (&d)[WG_ACC], const u32 (&a)[4], u64 b) {
#if BM == 128
    wgmma_m64n128k16_f16(d, a, b);
#else
    wgmma_m64n64k16_f16(d, a, b);
#endif
}

// acc += A [this warpgroup's 64 rows, the chunk's RING_K] x chunk [its WG_COLS rows]^T:
// a_lane this lane's ldmatrix address at the chunk's first column of As (as a_lane_addr),
// desc the descriptor of the warpgroup's first row of the stage.
template <int F16>
__device__ __forceinline__ void wg_multiply_chunk(u32 a_lane, u64 desc, float (&acc)[WG_ACC]) {
    if constexpr (F16 == 1) {
        u32 a[2][4];  // k-step s: As's 16-column chunk s, its hi half (64 s bytes on)
        ldsm_x4(a[0], a_lane);
        ldsm_x4(a[1], a_lane + 64);
        wgmma_fence();
        wg_product(acc, a[0], desc);
        wg_product(acc, a[1], desc + 2);  // the ring row's bytes 32 to 63 (32 >> 4)
        wgmma_commit();
        wgmma_wait<0>();
        pin(acc);
        pin(a[0]);
        pin(a[1]);
    } else {
        u32 ah[4], al[4];  // As's chunk: 16 hi (bytes 0-31), then 16 lo
        ldsm_x4(ah, a_lane);
        ldsm_x4(al, a_lane + 32);
#pragma unroll
        for (int h = 0; h < WG_COLS / 64; ++h) {
            const u64 b = desc + h * (64 * 64 >> 4);  // 64 ring rows of 64 bytes further
            float t[32];
            wgmma_fence();
            wgmma_m64n64k16_f16_first(t, ah, b + 2);  // ah * bl (the ring row's lo: + 32 bytes)
            wgmma_m64n64k16_f16(t, al, b);            // al * bh
            wgmma_m64n64k16_f16(t, ah, b);            // ah * bh
            wgmma_commit();
            wgmma_wait<0>();
            pin(t);
#pragma unroll
            for (int e = 0; e < 32; ++e) acc[32 * h + e] += t[e];
        }
        pin(ah);
        pin(al);
    }
}

// As project_mma.cu's project_columns (the same contract), on wgmma.
template <int F16, class Store>
__device__ __forceinline__ void project_columns(const float* As, int astr, const WeightRing& ring,
                                                Store store, float unscale = 1.f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 a_lane = smem_addr(As)
                       + 4 * ((wg_row0() + (warp % 4) * 16 + (lane & 15)) * astr + 4 * (lane >> 4));
    const u32 w_rows = 4 * wg_col0() * WSTR;  // bytes from a stage to this warpgroup's rows
    for (int n0 = 0; n0 < ring.NO; n0 += BN) {
        float acc[WG_ACC];
#pragma unroll
        for (int e = 0; e < WG_ACC; ++e) acc[e] = 0.f;
        for (int kc = 0; kc < ring.nchunks; ++kc) {
            cp_async_wait<WSTAGES - 2>();  // this thread's pieces of chunk kc landed
            fence_async_shared();  // and visible to the tensor cores' reads
            __syncthreads();  // everyone's pieces; chunk kc - 1's products complete
            ring.issue(n0, kc + WSTAGES - 1);  // into the stage chunk kc - 1 used
            const u32 stage = ring.ws + 4 * (kc % WSTAGES) * BN * WSTR;
            wg_multiply_chunk<F16>(a_lane + 4 * kc * RING_K, sw64_desc(stage + w_rows), acc);
        }
        __syncthreads();  // every thread done with the ring
        if (n0 + BN < ring.NO) ring.prime(n0 + BN);
        // 32 columns at a time (accumulators 16 q to 16 q + 15: D's n-tiles 4q to 4q + 3,
        // as Tile's c[0][j][e] for n-tile j of them), times `unscale`.
#pragma unroll
        for (int q = 0; q < WG_COLS / 32; ++q) {
            Tile tile;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) tile.c[0][j][e] = acc[16 * q + 4 * j + e] * unscale;
            const int col0 = n0 + wg_col0() + 32 * q;
            float2 cb[4];
            ring.biases(n0, col0, cb);
            store(tile, col0, cb);
        }
    }
}
