// Hopper's warpgroup tensor-core products (wgmma, sm_90a only) through inline PTX, and the
// shared-memory layout their B operand is read in. A warpgroup is 4 consecutive warps,
// the first a multiple of 4; each wgmma multiplies a 64-row A (warp w of the group holds
// rows 16w..16w+15) by an N-column B read from shared memory by the tensor cores
// themselves, asynchronously: issue, commit the group, wait for it. PTX ISA,
// "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions".
//
// Register fragments (g = lane >> 2, t = lane & 3, rows within the warp's 16):
//   A, 16-bit k16: a0 (g, 2t..2t+1) a1 (g+8, 2t..2t+1) a2 (g, 2t+8..2t+9)
//                  a3 (g+8, 2t+8..2t+9), two values per register, the lower column in the
//                  low half   (as mma.sync m16n8k16)
//   D, f32:        d[4n + 0] (g, 8n+2t) d[4n+1] (g, 8n+2t+1) d[4n+2] (g+8, 8n+2t)
//                  d[4n+3] (g+8, 8n+2t+1), n = 0 .. N/8 - 1   (mma.sync's C, per 8 columns)
// Operands in shared memory are K-major (K fastest along a row).
#pragma once
#include "mma.cuh"

typedef unsigned long long u64;

// K-major tiles in the 128-byte swizzle: rows of 128 bytes (64 16-bit values along K),
// grouped in atoms of 8 rows (1024 bytes, 1024-byte aligned); the 16-byte chunk c of row r
// is stored at chunk c ^ (r % 8), so the 8 rows of a column of chunks fall on all 32 banks.
// Byte offset of (row, byte within the row) from the tile's start:
__device__ __forceinline__ u32 sw128(int row, int byte) {
    return row * 128 + ((((byte >> 4) ^ row) & 7) << 4) + (byte & 15);
}

// The matrix descriptor of such a tile starting at shared address `tile` (1024-aligned):
// start address >> 4 (bits 0-13), leading byte offset (unused by swizzled K-major tiles,
// 1 by convention; bits 16-29), stride byte offset 1024 >> 4 between 8-row atoms (bits
// 32-45), swizzle mode 1 = 128 bytes (bits 62-63). Each 16-wide k-step of 16-bit values
// starts 32 bytes further along the row: add 2 (32 >> 4) per k-step; the hardware applies
// the swizzle to the address it forms, so the 1024-byte alignment is all the atoms need.
__device__ __forceinline__ u64 sw128_desc(u32 tile) {
    return (u64)((tile & 0x3ffff) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32)
           | ((u64)1 << 62);
}

// The same for K-major tiles of 64-byte rows (32 bf16 along K: the bf16 K tile of head dim
// 32), in the 64-byte swizzle: atoms of 8 rows (512 bytes, 512-byte aligned) in which the
// 16-byte chunk c of row r is stored at chunk c ^ ((r / 2) % 4) (the address bits 4-5
// XORed with bits 7-8), so the 8 rows of a column of chunks fall on all 32 banks. Its
// descriptor: stride byte offset 512 between atoms, swizzle mode 2 = 64 bytes; each
// 16-wide k-step of bf16 starts 32 bytes further along the row (add 2).
__device__ __forceinline__ u32 sw64(int row, int byte) {
    return row * 64 + ((((byte >> 4) ^ (row >> 1)) & 3) << 4) + (byte & 15);
}
__device__ __forceinline__ u64 sw64_desc(u32 tile) {
    return (u64)((tile & 0x3ffff) >> 4) | ((u64)1 << 16) | ((u64)(512 >> 4) << 32)
           | ((u64)2 << 62);
}

// Before the first wgmma, and whenever other instructions wrote its accumulator or A
// registers since the last one.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {  // at most N committed groups still running
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Registers a wgmma reads or writes asynchronously, pinned after a wgmma_wait: without
// it the compiler may move their ordinary uses above the wait (the wait names no
// registers), or reuse an A register while the tensor cores may still read it.
template <int N>
__device__ __forceinline__ void pin(float (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i]) :: "memory");
}
template <int N>
__device__ __forceinline__ void pin(u32 (&x)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(x[i]) :: "memory");
}

// Shared memory written by ordinary stores (or cp.async) that a wgmma reads next: each
// writing thread fences before the barrier that publishes it.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One wgmma with A from registers into a 64 x 64 (WGMMA_N64: d[32]) or 64 x 40 (WGMMA_N40:
// d[20]) f32 accumulator: `op` the instruction, `imm` its immediate operands after B's
// descriptor (scale-d, the A and B scales, and for 16-bit types B's transpose flag), `c`
// the accumulator's constraint: "+f" (D += A B) or, with scale-d 0, "=f" (D = A B: the
// compiler then zeroes no registers first). The register lists are written once here for
// every type and k: the accumulator's registers as asm outputs 4, 8 and 32 at a time (from
// index o), and the 32 outputs' placeholders.
#define WGMMA_D4(c, d, o) c(d[o]), c(d[o + 1]), c(d[o + 2]), c(d[o + 3])
#define WGMMA_D8(c, d, o) WGMMA_D4(c, d, o), WGMMA_D4(c, d, o + 4)
#define WGMMA_D32(c, d, o) WGMMA_D8(c, d, o), WGMMA_D8(c, d, o + 8), WGMMA_D8(c, d, o + 16), \
                           WGMMA_D8(c, d, o + 24)
#define WGMMA_REGS32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
#define WGMMA_N64(op, imm, c, d, a, b)                                                         \
    asm volatile(op " " WGMMA_REGS32 "{%32,%33,%34,%35}, %36, " imm ";"                     \
        : WGMMA_D32(c, d, 0)                                                                 \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))
#define WGMMA_N40(op, imm, c, d, a, b)                                                         \
    asm volatile(op " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19}, " \
                    "{%20,%21,%22,%23}, %24, " imm ";"                                       \
        : WGMMA_D8(c, d, 0), WGMMA_D8(c, d, 8), WGMMA_D4(c, d, 16)                           \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))

// The same with A from shared memory too (`a` its descriptor, K-major as B; both operands
// by descriptor take no registers for A).
#define WGMMA_N64_SS(op, imm, c, d, a, b)                                                      \
    asm volatile(op " " WGMMA_REGS32 "%32, %33, " imm ";"                                   \
        : WGMMA_D32(c, d, 0)                                                                 \
        : "l"(a), "l"(b))

// The bf16 products (fp32 accumulation), B K-major (the last operand 0: not transposed).
// D (64 x 64, f32) += A (64 x 16, bf16, descriptor) B (16 x 64, bf16, descriptor); the
// immediates: scale-d, the A and B scales, A and B not transposed.
__device__ __forceinline__ void wgmma_m64n64k16_bf16_ss(float (&d)[32], u64 a, u64 b) {
    WGMMA_N64_SS("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "1, 1, 1, 0, 0", "+f", d, a, b);
}
// D (64 x 40, f32) += A (64 x 16, bf16, registers) B (16 x 40, bf16, descriptor).
__device__ __forceinline__ void wgmma_m64n40k16_bf16(float (&d)[20], const u32 (&a)[4], u64 b) {
    WGMMA_N40("wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16", "1, 1, 1, 0", "+f", d, a, b);
}

// The same with fp16 operands (the fp32 mode's split products, attention_wgmma_f16x3):
// fragments and layouts as bf16's.
__device__ __forceinline__ void wgmma_m64n64k16_f16(float (&d)[32], const u32 (&a)[4], u64 b) {
    WGMMA_N64("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", "1, 1, 1, 0", "+f", d, a, b);
}
__device__ __forceinline__ void wgmma_m64n40k16_f16(float (&d)[20], const u32 (&a)[4], u64 b) {
    WGMMA_N40("wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16", "1, 1, 1, 0", "+f", d, a, b);
}
__device__ __forceinline__ void wgmma_m64n64k16_f16_ss(float (&d)[32], u64 a, u64 b) {
    WGMMA_N64_SS("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", "1, 1, 1, 0, 0", "+f", d, a, b);
}
// D (64 x 64) += A B with fp16 operands by descriptor into fp16 accumulators (the bf16 mode's
// S in 16 bits, attention_wgmma_f16s): 16 registers of fp16 pairs, register i holding the
// f32 layout's elements 2i, 2i + 1 above: d[2n] (g, 8n+2t..8n+2t+1), d[2n+1] (g+8, the same
// columns), the lower column in the low half (mma.sync m16n8k16's f16 C, per 8 columns).
__device__ __forceinline__ void wgmma_m64n64k16_f16acc_ss(u32 (&d)[16], u64 a, u64 b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f16.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, 1, 1, 1, 0, 0;"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]),
          "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]),
          "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
        : "l"(a), "l"(b));
}
// D = A B (scale-d 0: D's old values neither read nor needed), for the first product into
// a fresh accumulator.
__device__ __forceinline__ void wgmma_m64n64k16_f16_first(float (&d)[32], const u32 (&a)[4], u64 b) {
    WGMMA_N64("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", "0, 1, 1, 0", "=f", d, a, b);
}
__device__ __forceinline__ void wgmma_m64n40k16_f16_first(float (&d)[20], const u32 (&a)[4], u64 b) {
    WGMMA_N40("wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16", "0, 1, 1, 0", "=f", d, a, b);
}

// mbarriers in shared memory (sm_90) and bulk copies that complete on them. A phase
// completes when its pending arrivals reach zero and every byte announced by expect_tx
// has landed; waiters name the parity of the phase they wait for (0 for the first).
// Arrivals release and the wait acquires (.cta): what a bulk copy wrote, and what threads
// did before arriving, is visible after the wait.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}"
                 :: "r"(bar) : "memory");
}
// One arrival that also announces `bytes` more to land in this phase.
__device__ __forceinline__ void mbar_arrive_expect(u32 bar, u32 bytes) {
    asm volatile("{\n.reg .b64 state;\n"
                 "mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}"
                 :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to shared
// address `dst` by the copy engine, one instruction, counted on mbarrier `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];" :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
