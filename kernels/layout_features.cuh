// The scratch layouts' features: what ln_qkvg_project writes and the attention and out
// projections read (triattn_cupy/gpu/layouts.py sets them per layout). Shared by the
// projection epilogues (project_epilogue.cuh) and the pair bias stores (pair_bias_store.cuh).
#pragma once
#include "common.cuh"

// How ln_qkvg_project stores q, k, v and the gate, for the kernels that read them: the
// layouts of triattn_cupy/gpu/layouts.py, told apart by their features below (a qkvg row
// is 4D words, D with SLOT_ROWS, 2D with F16_QKV: QKVG_LD; the attention writes o over
// [0, D), in 16 bits over each head's first 16 words with O16):
// rows_fp32 as computed (fp32): q, k, v, gate at words [0, D), [D, 2D), [2D, 3D), [3D, 4D).
// rows_tf32 the same, k and v rounded to TF32 (KV_TF32; attention_mma_tf32 copies them as
//   they are).
// rows_bf16 packed bf16 (QG_PACKED, KV_BF16_ROWS; attention_mma_bf16; half the bytes):
//   bf16 index c from word D holds k column c for c < D and v column c - D after it; q from
//   word 2D (Q_WORD), the gate from word 5D/2 (GATE_WORD); [3D, 4D) unused. The attention
//   rounds q to bf16 anyway; the gate in bf16 adds ~1e-3 to the mode's error. The pair bias
//   in fp16 (BIAS_F16).
// tiles_bf16 (KV_TILED: attention_wgmma_bf16; head dim 32): k and v in tiles only, per (b,
//   i, head, 64 keys) 8 KiB, the K tile [64 keys][32 dims] bf16 in the 64-byte swizzle
//   (sw64, store_kt), then the V^T tile [32 dims][64 keys] bf16 in the 128-byte swizzle,
//   keys in their own order (store_vt); the pair bias in fp16 tiles of [128 queries][64
//   keys] (bias_element). Keys past N are zero in V^T, left unwritten in K. qkvg rows of D
//   words, a 32-word slot per head (SLOT_ROWS): q packed bf16 at [32 h, 32 h + 16) (dims
//   2w, 2w + 1 in word w), where the attention writes the head's o in bf16 (O16, load_o4),
//   and the gate packed bf16 at [32 h + 16, 32 h + 32) (rows of 4D words with k and v in
//   tiles would leave 2D of every row unused: 3.0 GiB of scratch at 1x1024 against 1.5).
// tiles_f16_hilo (HI_LO: attention_wgmma_f16x3, the fp32 mode): tiles_bf16's tiles in fp16
//   hi + lo pairs (split_f16): per (b, i, head, 64 keys) 16 KiB, the K hi tile, the K lo
//   tile, the V^T hi tile, the V^T lo tile; the pair bias as fp16 hi and lo tiles (32 KiB
//   per tile: hi, then lo). A qkvg row is 2D words (F16_QKV): per head 16 words of q's hi
//   pairs then 16 of its lo pairs, at [32 h, 32 h + 32), where the attention writes that
//   head's o; the gate fp32 at [D, 2D). So the scratch stays ~4x the input with the tiles
//   (4D words a row would make it 6x). q, k and v arrive scaled by powers of two that keep
//   them inside fp16's range (the weights are: DeviceWeights.f16x3_scales).
// tiles_f16 (attention_wgmma_f16, the tf32 mode; f16s, the bf16 mode): the hi parts only:
//   fp16 keeps TF32's 11 significant bits, so q, k and v scaled into its range lose no
//   more than TF32 rounding would. Per (b, i, head, 64 keys) 8 KiB, tiles_bf16's tiles in
//   fp16; qkvg rows of 2D words, q's 16 fp16 words per head at [32 h, 32 h + 16), the gate
//   fp32 at [D, 2D) (in fp16, gates below fp16's normal range lost their bits and below
//   ~6e-8 became 0); the pair bias in fp16 tiles, stored times s_b = s_q s_k (the units
//   the attention accumulates S in). The scales are DeviceWeights.qkv_scales'. The
//   attention writes o in fp16, in v's units, over q (O16, load_o4).
// (tiles_f16_slots, tiles_f16's tiles in tiles_bf16's rows with the gate in bf16, is
// written by project_wgmma.cu only.)
// The layout's features (triattn_cupy/gpu/layouts.py defines them per layout; all 0: the
// fp32 rows, rows_fp32):
#ifndef KV_TILED
#define KV_TILED 0      // k, V^T and the pair bias in 64-key tiles after qkvg
#endif
#ifndef QG_PACKED
#define QG_PACKED 0     // q and the gate packed bf16
#endif
#ifndef KV_BF16_ROWS
#define KV_BF16_ROWS 0  // k and v packed bf16 in the rows, from column D
#endif
#ifndef KV_TF32
#define KV_TF32 0       // k and v rounded to TF32 where stored
#endif
#ifndef F16_QKV
#define F16_QKV 0       // q, k, v scaled, in fp16; rows of 2D words
#endif
#ifndef SLOT_ROWS
#define SLOT_ROWS 0     // q and the gate in each head's 32-word slot; rows of D words
#endif
#ifndef HI_LO
#define HI_LO 0         // q, k, v and the bias as fp16 hi and lo
#endif
#ifndef BIAS_F16
#define BIAS_F16 0      // the pair bias in fp16
#endif
#ifndef O16
#define O16 0           // the attention writes o in 16 bits over each head's first 16 words
#endif
#ifndef TILES_BF16
#define TILES_BF16 0    // the tiles (and o) in bf16, else fp16
#endif
#if KV_TILED
#include "wgmma.cuh"
#endif
#define KV_TILE_BYTES (HI_LO ? 16384 : 8192)  // per (b, i, head, 64 keys)
#define VT_IN_TILE (HI_LO ? 8192 : KV_TILED ? 4096 : 0)
#define HALF_PART 4096  // HI_LO: bytes from a hi K or V^T tile to its lo tile
#define BIAS_TILE_BYTES (HI_LO ? 32768 : 16384)  // KV_TILED: per (b, head, 128 i, 64 j)
