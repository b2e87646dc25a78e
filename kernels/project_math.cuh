// What every projection kernel (project_ffma.cu, project_mma.cu, project_wgmma.cu) computes
// the same way: the mask reader, the gate's sigmoid, LayerNorm's 1/sqrt and the pair bias
// in fp16. Kernel files set EXACT_FP32 before the include.
#pragma once
#include "common.cuh"

// mask_kind: how to read one mask element; "masked" means the element equals zero.
#define MASK_NONE 0
#define MASK_1BYTE 1   // bool, int8, uint8
#define MASK_2BYTE 2   // int16, uint16
#define MASK_4BYTE 3   // int32, uint32
#define MASK_8BYTE 4   // int64, uint64
#define MASK_F16 5
#define MASK_F32 6
#define MASK_F64 7

__device__ __forceinline__ bool mask_keeps(const void* mask, int kind, i64 off) {
    switch (kind) {
        case MASK_NONE: return true;
        case MASK_1BYTE: return static_cast<const unsigned char*>(mask)[off] != 0;
        case MASK_2BYTE: return static_cast<const unsigned short*>(mask)[off] != 0;
        case MASK_4BYTE: return static_cast<const unsigned int*>(mask)[off] != 0u;
        case MASK_8BYTE: return static_cast<const unsigned long long*>(mask)[off] != 0ull;
        // +0 and -0 are the only half-precision zeros; NaN keeps, as in the reference.
        case MASK_F16: return (static_cast<const unsigned short*>(mask)[off] & 0x7fffu) != 0u;
        case MASK_F32: return static_cast<const float*>(mask)[off] != 0.f;
        default: return static_cast<const double*>(mask)[off] != 0.0;
    }
}

// Whether the fp32 parts (gate, LayerNorm's 1/sigma) are exact to ~1 ulp, as PyTorch's,
// or fast (MUFU approximations, ~2^-22 relative). The fp32 mode needs them exact: the fast
// sigmoid alone adds ~1.4e-7 to the output's error (NumPy emulation), about PyTorch's
// whole fp32 error (docs/performance.md). Kernel files set it before the include.
#ifndef EXACT_FP32
#define EXACT_FP32 1
#endif

// 1 / (1 + e^-z): EXACT_FP32: expf and an IEEE division; else one MUFU exp2 and a fast
// reciprocal (relative error ~1e-7, far inside the tf32 / bf16 bounds). e^-z overflowing
// to inf gives 0, as it should.
__device__ __forceinline__ float sigmoid(float z) {
#if EXACT_FP32
    return 1.0f / (1.0f + expf(-z));
#else
    return __fdividef(1.0f, 1.0f + fast_exp2(-z * LOG2E_F));
#endif
}

// 1 / sqrt(x) for LayerNorm: EXACT_FP32: IEEE sqrt and division; else rsqrtf (MUFU).
__device__ __forceinline__ float inverse_sqrt(float x) {
#if EXACT_FP32
    return 1.0f / sqrtf(x);
#else
    return rsqrtf(x);
#endif
}

// LayerNorm's range. In fp32 the row's sum overflows from |x| ~ 3e36 and its squared
// deviations from |x| ~ 1e18 (D = 128). LayerNorm is unchanged by x -> x f when eps becomes
// eps f^2, so a row whose largest magnitude passes 2^40 is first multiplied by a power of
// two f that brings it into [1, 2) (exact, as reference.layer_norm divides). Other rows
// skip this: their arithmetic, and so their bits, are the plain formula's. A row holding
// inf or NaN is left alone (its result is NaN, as the reference's).
#define LN_RESCALE_ABOVE 1099511627776.f  // 2^40

__device__ __forceinline__ bool ln_row_is_huge(float amax) {
    return amax > LN_RESCALE_ABOVE && amax <= 3.402823466e38f;  // finite
}

// f = 2^-floor(log2 amax), at least 2^-126 so that f stays normal under -ftz (amax >= 2^127
// then lands in [2, 4)): built from amax's exponent bits, no rounding anywhere.
__device__ __forceinline__ float ln_row_scale(float amax) {
    const int biased = (__float_as_int(amax) >> 23) & 0xff;
    return __int_as_float(max(254 - biased, 1) << 23);
}

// eps f^2, kept at least the smallest normal float when eps > 0, so that a constant huge
// row gives 0 * finite (beta), not 0 * inf.
__device__ __forceinline__ float ln_scaled_eps(float eps, float f) {
    return eps > 0.f ? fmaxf(eps * f * f, 1.17549435e-38f) : eps;
}

// A row's values scaled in place where the row passes 2^40 (above): rescale(f) multiplies
// the row by f and returns its new sum, which replaces `sum`. Returns eps for the row:
// eps f^2 where it was scaled, else eps (and `sum` unchanged).
template <class Rescale>
__device__ __forceinline__ float ln_rescale_huge(float amax, float eps, float& sum,
                                                 Rescale rescale) {
    float eps_row = eps;
    if (ln_row_is_huge(amax)) {
        const float f = ln_row_scale(amax);
        eps_row = ln_scaled_eps(eps, f);
        sum = rescale(f);
    }
    return eps_row;
}

// LayerNorm's pieces of 4 values, in the order every kernel sums them: their sum, the
// largest magnitude so far, the values times f, the sum of squared deviations so far.
__device__ __forceinline__ float sum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }
__device__ __forceinline__ float absmax4(float amax, float4 v) {
    return fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
}
__device__ __forceinline__ float4 scale4(float4 v, float f) {
    return make_float4(v.x * f, v.y * f, v.z * f, v.w * f);
}
__device__ __forceinline__ float4 minus4(float4 v, float mu) {
    return make_float4(v.x - mu, v.y - mu, v.z - mu, v.w - mu);
}
__device__ __forceinline__ float sum_squares4(float acc, float4 d) {
    return fmaf(d.x, d.x, fmaf(d.y, d.y, fmaf(d.z, d.z, fmaf(d.w, d.w, acc))));
}
// (x - mu) rstd gamma + beta: LayerNorm's output
__device__ __forceinline__ float4 ln_affine4(float4 v, float mu, float rstd, float4 g, float4 c) {
    return make_float4((v.x - mu) * rstd * g.x + c.x, (v.y - mu) * rstd * g.y + c.y,
                       (v.z - mu) * rstd * g.z + c.z, (v.w - mu) * rstd * g.w + c.w);
}

// The pair bias as fp16 bits (the bf16 and wgmma attentions hold it so): fp16 has TF32's
// 10-bit mantissa at half the bytes of a bias tile; finite values beyond fp16's range
// saturate to +-65504 (2^-65504 is 0 in any softmax), -inf and NaN stay.
__device__ __forceinline__ unsigned short f16_bias_bits(float x) {
    x = x > 65504.f ? 65504.f : x < -65504.f && x != neg_inf() ? -65504.f : x;
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// The pair bias as fp16 hi and lo bits (the fp32 mode's tiles): hi as f16_bias_bits, lo the
// rest rounded again (0 where hi is infinite): hi + lo holds ~22 bits of x, to +-131008.
__device__ __forceinline__ void f16_bias_split(float x, unsigned short& hi, unsigned short& lo) {
    hi = f16_bias_bits(x);
    float h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(h) : "h"(hi));
    lo = f16_bias_bits(isinf(h) ? 0.f : x - h);
}

// PAIR_DTYPE: the element type of the pair x the projections read and of the output the
// out projections write, the caller's own: float32 (PAIR_F32, the default), float16 or
// bfloat16. A 16-bit element travels as its bits (unsigned short), is widened to fp32
// where it is loaded and rounded (to nearest even) where the output is stored; everything
// between is the kernel's own arithmetic. Off (float32), every helper below is the plain
// fp32 load or store it replaces, so the float32 machine code is the same.
#define PAIR_F32 0
#define PAIR_F16 1
#define PAIR_BF16 2
#ifndef PAIR_DTYPE
#define PAIR_DTYPE PAIR_F32
#endif

#if PAIR_DTYPE == PAIR_F32
typedef float pair_t;
__device__ __forceinline__ float pair_value(float v) { return v; }
// 4 consecutive elements at p, 16-byte aligned (4-element aligned for 16-bit elements)
__device__ __forceinline__ float4 pair_ld4(const pair_t* p) { return ld4(p); }
// 2 consecutive elements at p (8-byte aligned; 4-byte for 16-bit elements)
__device__ __forceinline__ void pair_st2(pair_t* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }
#else
typedef unsigned short pair_t;
__device__ __forceinline__ float pair_value(unsigned short h) {
#if PAIR_DTYPE == PAIR_F16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else  // bfloat16: the upper half of a float, exactly
    return __uint_as_float((unsigned)h << 16);
#endif
}
__device__ __forceinline__ float4 pair_ld4(const pair_t* p) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    return make_float4(pair_value((unsigned short)(u.x & 0xffffu)), pair_value((unsigned short)(u.x >> 16)),
                       pair_value((unsigned short)(u.y & 0xffffu)), pair_value((unsigned short)(u.y >> 16)));
}
// x rounded to the pair's type, to nearest even (overflow to inf, NaN stays NaN).
__device__ __forceinline__ unsigned short pair_bits(float x) {
    unsigned short h;
#if PAIR_DTYPE == PAIR_F16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
#elif __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
#else  // (no bf16 conversion before sm_80: the same rounding in integers)
    const unsigned u = __float_as_uint(x);
    h = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)  // quiet NaN
                                        : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
    return h;
}
// Two elements as one 32-bit word (v.x at the lower address)
__device__ __forceinline__ unsigned pair_bits2(float2 v) {
    return (unsigned)pair_bits(v.x) | ((unsigned)pair_bits(v.y) << 16);
}
__device__ __forceinline__ void pair_st2(pair_t* p, float2 v) {
    *reinterpret_cast<unsigned*>(p) = pair_bits2(v);
}
#endif
