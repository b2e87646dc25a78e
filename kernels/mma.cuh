// Tensor-core building blocks through inline PTX (NVRTC cannot include <mma.h>):
// fp32 -> tf32 / bf16 / fp16 conversions and the m16n8k8 tf32 / m16n8k16 bf16 mma.sync products.
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k8 / m16n8k16"), with
// g = lane >> 2, t = lane & 3:
//   m16n8k8 tf32:  A a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4);
//                  B b0 (k=t, n=g) b1 (k=t+4, n=g)
//   m16n8k16 bf16: A {a0,a1} (g, 2t..2t+1) {a2,a3} (g+8, 2t..) {a4,a5} (g, 2t+8..)
//                  {a6,a7} (g+8, 2t+8..);  B {b0,b1} (k=2t..2t+1, n=g) {b2,b3} (k=2t+8.., n=g)
//   C (both):      c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)
#pragma once

typedef unsigned int u32;

// fp32 -> tf32, round to nearest (ties away): the result is an fp32 bit pattern whose low
// 13 mantissa bits are zero, so (a - hi) is exact and is the next term of the split.
__device__ __forceinline__ u32 to_tf32(float a) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(a));
    return r;
}

// The same, but volatile: the compiler may neither hoist nor merge it. Used on the query
// fragments, whose split is the same for every key tile: hoisted out of the key loop it
// would keep hi and lo of the whole head dim live (d registers instead of d/2) and spill.
__device__ __forceinline__ u32 to_tf32_here(float a) {
    u32 r;
    asm volatile("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(a));
    return r;
}

// D = A B + D, m16n8k8, tf32 operands, fp32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                         u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two fp32 values as one bf16x2 register, round to nearest even; x0 in the low half
// (the lower matrix index, as the fragments expect).
__device__ __forceinline__ u32 pack_bf16(float x0, float x1) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    return r;
}
// One value as bf16 bits, rounded to nearest.
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

// D = A B + D, m16n8k16, 16-bit operands of PTX type `type` (two per register; the
// fragments are the same for bf16 and fp16), fp32 accumulation.
#define MMA_M16N8K16(type, d, a0, a1, a2, a3, b0, b1)                                      \
    asm volatile(                                                                          \
        "mma.sync.aligned.m16n8k16.row.col.f32." type "." type ".f32 "                     \
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                            \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                   \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                         u32 b0, u32 b1) {
    MMA_M16N8K16("bf16", d, a0, a1, a2, a3, b0, b1);
}
__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                        u32 b0, u32 b1) {
    MMA_M16N8K16("f16", d, a0, a1, a2, a3, b0, b1);
}

// Two fp16 (low half first) as floats: the pair bias where it is held in fp16.
__device__ __forceinline__ float2 half2_to_float2(u32 w) {
    float lo, hi;
    asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi) : "r"(w));
    return make_float2(lo, hi);
}

// Two fp32 values as one f16x2 register, round to nearest even; x0 in the low half.
// Finite values past fp16's range become inf: callers keep them in range.
__device__ __forceinline__ u32 pack_f16(float x0, float x1) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    return r;
}
// x0, x1 as fp16 hi + lo pairs (the fp32 mode's split products): hi rounded to nearest,
// lo = x - hi (exact in fp32) rounded again, so hi + lo carries ~22 bits of x where lo is
// a normal fp16 (|x| >= 2^-3), and x to within 2^-25 absolute below.
__device__ __forceinline__ void split_f16(float x0, float x1, u32& hi, u32& lo) {
    hi = pack_f16(x0, x1);
    const float2 h = half2_to_float2(hi);
    lo = pack_f16(x0 - h.x, x1 - h.y);
}

__device__ __forceinline__ float2 ld2(const float* p) {
    return __ldg(reinterpret_cast<const float2*>(p));
}

// Shared-memory address of a generic pointer into shared memory, for ldmatrix.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// The same value, but opaque to the compiler: taken once per loop iteration, it keeps
// `base + constant` fragment addresses inside the loop, where ptxas folds the constant
// into the ldmatrix instruction, instead of one register per address hoisted out of it.
__device__ __forceinline__ u32 opaque(u32 x) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}
template <typename T>
__device__ __forceinline__ T* opaque(T* p) {
    unsigned long long r;
    asm volatile("mov.b64 %0, %1;" : "=l"(r) : "l"(p));
    return reinterpret_cast<T*>(r);
}

// ldmatrix at shared address `a` (see smem_addr): each lane of the quarter-warp q (lanes
// 8q..8q+7) names one 16-byte row of matrix q; lane l receives 32 bits of each matrix:
// row l/4, bytes 4(l%4)..+3. As tf32 (one fp32 per 4 bytes) that is element (l/4, l%4);
// as bf16 the pair (l/4, 2(l%4)..+1); .trans gives the bf16 pair (2(l%4)..+1, l/4).
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// Two matrices (rows named by lanes 0..15; the other lanes' addresses are ignored).
__device__ __forceinline__ void ldsm_x2_trans(u32 (&r)[2], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// 16-byte asynchronous copy global -> shared address `dst` (see smem_addr), cached in L2
// only (.cg); when !valid nothing is read and the 16 bytes are zero-filled. Committed in
// groups, waited for with cp_async_wait<n> (at most n groups still in flight).
__device__ __forceinline__ void cp_async16_or_zero(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// 8 bytes (cp.async.ca: .cg copies 16 only), zeros where !valid
__device__ __forceinline__ void cp_async8_or_zero(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// Where key `key` of a tile sits in a transposed V row (V^T [dim][key position]) that the
// P V product reads with P taken straight from S's accumulators: a C fragment holds keys
// (2t, 2t + 1), the A fragment of a tf32 k8 step columns (t, t + 4), so within each 8
// keys position p holds key 2p (p < 4) or 2(p - 4) + 1: even keys first.
__device__ __forceinline__ int vt_position(int key) {
    return (key & ~7) | ((key & 1) << 2) | ((key >> 1) & 3);
}
