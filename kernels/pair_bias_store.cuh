// Where the pair bias goes and in what form: its element type and the store of one value
// in the row-major [B, H, N, npk] layout or in the tiled layouts' bias tiles. Used by every
// kernel that writes the bias (the LayerNorm projections, layernorm_bias_ffma.cu).
#pragma once
#include "common.cuh"
#include "project_math.cuh"
#include "layout_features.cuh"

// The pair bias's element type: fp32, or fp16 (BIAS_F16: rows_bf16 and the tiled layouts):
// fp16 has TF32's 10-bit mantissa (the TF32 mode's products round
// to it anyway; bf16's have 7), at half the bytes of a bias tile, the largest part of what
// those kernels copy. Finite values beyond fp16's range saturate to +-65504 (2^-65504 is 0
// in any softmax), -inf and NaN stay.
#if BIAS_F16
typedef unsigned short bias_t;  // fp16 bits
__device__ __forceinline__ bias_t to_bias(float x) { return f16_bias_bits(x); }
#else
typedef float bias_t;
__device__ __forceinline__ bias_t to_bias(float x) { return x; }
#endif

// One pair-bias value: *at(j) = log2(e) * dot, or -inf where the mask drops (b, i, j);
// at(jj) is where key jj of the row (b, head, i) goes. The key axis is padded to a whole
// number of attention tiles (npk); -inf there makes the padded keys weigh exactly 0, so
// the attention kernel needs no bounds test.
// *at(jj) = x as the bias's type; HI_LO: the value as fp16 hi, and at 8192 elements (16
// KiB, the tile's lo part) the rest rounded again (0 where hi is infinite): hi + lo holds
// ~22 bits of it, to +-131008.
template <class At>
__device__ __forceinline__ void put_bias(At at, i64 jj, float x) {
#if HI_LO
    bias_t hi, lo;
    f16_bias_split(x, hi, lo);
    bias_t* const p = at(jj);
    p[0] = hi;
    p[BIAS_TILE_BYTES / 2 / sizeof(bias_t)] = lo;  // the lo half of the tile
#else
    *at(jj) = to_bias(x);
#endif
}
template <class At>
__device__ __forceinline__ void store_pair_bias_at(At at, i64 j, int N, int npk, bool keep,
                                                   float dot) {
    put_bias(at, j, keep ? dot * LOG2E_F : neg_inf());
    if (j == N - 1)
        for (int jj = N; jj < npk; ++jj) put_bias(at, jj, neg_inf());
}
// The same in the row-major layout [B, H, N, npk]: brow = &bias[b, head, i, 0].
__device__ __forceinline__ void store_pair_bias(bias_t* __restrict__ brow, i64 j, int N, int npk,
                                                bool keep, float dot) {
    store_pair_bias_at([&](i64 jj) { return brow + jj; }, j, N, npk, keep, dot);
}

#if KV_TILED
// The pair bias in tiles (the tiled layouts): per (b, head, 128 queries i, 64 keys j) 16 KiB
// (tiles_f16_hilo: 32 KiB, this tile and its lo parts after it: put_bias),
// [128 rows i][64 keys j] fp16 in the 128-byte swizzle (wgmma.cuh sw128: rows of 128
// bytes, read conflict-free by the attention's fragments without padding), so that one
// bulk copy moves a tile. bh = b H + head. Query rows past N in the last tile stay unwritten.
__device__ __forceinline__ bias_t* bias_element(bias_t* bias, i64 bh, int i, int j, int N, int npk) {
    const i64 tile = (bh * ((N + 127) / 128) + i / 128) * (npk / 64) + j / 64;
    return reinterpret_cast<bias_t*>(reinterpret_cast<char*>(bias) + tile * BIAS_TILE_BYTES
                                     + sw128(i % 128, 2 * (j % 64)));
}
__device__ __forceinline__ void store_pair_bias_tiled(bias_t* __restrict__ bias, i64 bh, int i,
                                                      int j, int N, int npk, bool keep, float dot) {
    store_pair_bias_at([&](i64 jj) { return bias_element(bias, bh, i, (int)jj, N, npk); }, j, N,
                       npk, keep, dot);
}
#endif
