// Each batch's key extent under the mask, for the attention kernels' key loops:
//
//   key_extent[b] = 1 + the largest key k with mask[b, j, k] != 0 for some query j
//                   (0 where the mask drops every key of batch b)
//
// Why: every key from key_extent[b] on is masked for every query of batch b, so its score
// is -inf in every head and its term 2^(s - m) is 0 in both the softmax's sum and its
// output: an attention block that stops its key loop at the key tile holding key
// key_extent[b] - 1 computes exactly what it computed before. A padding mask (a crop
// padded to a fixed N, as AlphaFold's and the benchmark's 10%) drops whole trailing key
// tiles that way: 1 of 16 at N = 1024, 6 of 64 at N = 4096.
//
// Launch: grid chunks * B (block x takes chunk x % chunks of batch x / chunks), THREADS
// threads; key_extent [B] int zeroed before (each block folds its largest kept key + 1 in
// with one atomicMax). The mask is read as the
// projection reads it: element (b, j, k) at b mb + j mi + k mj, of the type mask_kind
// names (project_math.cuh mask_keeps), so broadcast and strided masks work.
#include "common.cuh"
#include "project_math.cuh"

#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS)
mask_key_extent(const void* __restrict__ mask, int mask_kind, i64 mb, i64 mi, i64 mj, int N,
                int chunks, int* __restrict__ key_extent) {
    allow_next_kernel();  // (the attention after it waits for it: common.cuh)
    const int b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
    const i64 pairs = (i64)N * N;
    int extent = 0;  // this thread's largest kept key + 1
    for (i64 e = chunk * (i64)THREADS + threadIdx.x; e < pairs; e += (i64)chunks * THREADS) {
        const int j = (int)(e / N), k = (int)(e % N);
        if (k + 1 > extent && mask_keeps(mask, mask_kind, b * mb + j * mi + k * mj))
            extent = k + 1;
    }
#pragma unroll
    for (int step = 16; step > 0; step >>= 1)
        extent = max(extent, __shfl_xor_sync(0xffffffffu, extent, step));
    __shared__ int warp_extent[THREADS / 32];
    if ((threadIdx.x & 31) == 0) warp_extent[threadIdx.x / 32] = extent;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) extent = max(extent, warp_extent[w]);
        if (extent > 0) atomicMax(key_extent + b, extent);
    }
}
