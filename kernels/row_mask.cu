// The row mask layout's key bits, for the attention kernels' ROW_MASK (common.cuh):
//
//   row_mask[(b N + i) W + w] bit t = mask[b, i, 32 w + t] != 0     (0 for keys >= N)
//
// W = npk / 32 words per row, over the bias's padded key axis, so that every key tile an
// attention kernel visits has its words. Why bits: the row layout's mask is indexed by the
// row i, which the pair bias [B, H, N, NPK] (shared by every row) cannot hold; the
// attention reads one word per 32 keys of its row instead, next to its bias tile, and sets
// the masked keys' scores to -inf before the row maximum.
//
// Launch: grid ceil(B N W / THREADS), THREADS threads, one word per thread. The mask is
// read as the key extent reads it: element (b, i, k) at b mb + i mi + k mj, of the type
// mask_kind names (project_math.cuh mask_keeps), so any dtype, broadcast and strides
// work (the ending node's transposed mask too).
#include "common.cuh"
#include "project_math.cuh"

#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
row_mask_pack(const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi, i64 mj, int B,
              int N, int words_per_row, unsigned* __restrict__ row_mask) {
    allow_next_kernel();  // (the attention after it waits for it: common.cuh)
    const i64 idx = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (idx >= (i64)B * N * words_per_row) return;
    const int w = (int)(idx % words_per_row);
    const i64 bi = idx / words_per_row;  // b N + i
    const i64 b = bi / N, i = bi % N;
    const i64 base = b * mb + i * mi;
    unsigned bits = 0u;
    for (int t = 0; t < 32; ++t) {
        const int k = 32 * w + t;
        if (k < N && mask_keeps(mask, mask_kind, base + k * mj)) bits |= 1u << t;
    }
    row_mask[idx] = bits;
}
