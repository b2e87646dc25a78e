"""The split products' error, emulated in NumPy (offline, no GPU): one head's attention
(d = 16, N = 128 keys and queries, as at 2x128x64x4) in float64 against

  fp32    plain fp32 roundings of S, P, O and the sums
  tf32x3  attention_mma.cu PREC 0: q, k, v, P as TF32 hi + lo (rna), three products
  f16x3   PREC 3: q, k, v times powers of two s_q, s_k, s_v (from a bound ~ sqrt(D) times
          their spread, as _gpu.f16x3_scales), P times 2^6, each as fp16 hi + lo (rn),
          three products, the scales undone in fp32

The products of the splits are exact (as on the tensor cores) and each sum is rounded to
fp32 once; the tensor cores' truncating accumulation is not modelled. Prints the median
and largest relative L2 error of 20 random draws.

    python3 scripts/emulate_f16x3_attention.py [d] [N]
"""
import sys

import numpy as np


def f32(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def f16_split(x):
    hi = x.astype(np.float16).astype(np.float64)
    lo = (x - hi).astype(np.float32).astype(np.float16).astype(np.float64)
    return hi, lo


def tf32(x):
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def tf32_split(x):
    hi = tf32(x)
    return hi, tf32((x - hi).astype(np.float32))


def attention(q, k, v, bias, mode, scales=(1.0, 1.0, 1.0)):
    """q [Q, d], k and v [K, d], bias [Q, K] (log2 units), float32 values held in float64."""
    if mode == "float64":
        s = q @ k.T + bias
        p = 2.0 ** (s - s.max(1, keepdims=True))
        return (p @ v) / p.sum(1, keepdims=True)
    if mode == "fp32":
        s = f32(f32(q @ k.T) + bias)
        p = f32(2.0 ** (s - s.max(1, keepdims=True)))
        return f32(f32(p @ v) / f32(p.sum(1, keepdims=True)))
    f16 = mode == "f16x3"
    s_q, s_k, s_v = scales if f16 else (1.0, 1.0, 1.0)
    split = f16_split if f16 else tf32_split
    qh, ql = split(q * s_q)
    kh, kl = split(k * s_k)
    s = f32(f32(ql @ kh.T + qh @ kl.T + qh @ kh.T) / (s_q * s_k) + bias)
    p = f32(2.0 ** (s - s.max(1, keepdims=True)) * (2.0 ** 6 if f16 else 1.0))
    ph, pl = split(p)
    vh, vl = split(v * s_v)
    o = f32(pl @ vh + ph @ vl + ph @ vh) / s_v
    return f32(o / f32(p.sum(1, keepdims=True)))


def power_of_two_below(top, limit=2.0 ** 14):
    return 2.0 ** np.floor(np.log2(limit / top))


def main(d=16, n=128, draws=20):
    rng = np.random.default_rng(0)
    errors = {m: [] for m in ("fp32", "tf32x3", "f16x3")}
    for _ in range(draws):
        spread = rng.uniform(0.2, 2.0, 3)  # of q (log2 e / sqrt(d) included), k, v
        q = f32(rng.standard_normal((n, d)) * spread[0])
        k = f32(rng.standard_normal((n, d)) * spread[1])
        v = f32(rng.standard_normal((n, d)) * spread[2] + 0.3)
        bias = f32(rng.standard_normal((n, n)) * 2)
        scales = tuple(power_of_two_below(24 * x) for x in spread)  # bound ~ sqrt(64) 3 sigma
        want = attention(q, k, v, bias, "float64")
        for mode, found in errors.items():
            got = attention(q, k, v, bias, mode, scales)
            found.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    for mode, found in errors.items():
        print(f"{mode:7s} rel L2 vs float64: median {np.median(found):.3g}, "
              f"largest {np.max(found):.3g}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
