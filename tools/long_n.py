"""Long N in place on one GPU: peak extra memory, time and a float64 spot check of a few rows.

    python tools/long_n.py                       (N = 4096 and 8192, bf16 and fp32)
    python tools/long_n.py --sizes 1x2048x128x4 --precisions fp32 --rows 3
    python tools/long_n.py --sizes 1x16384x128x4 --pair-dtype bfloat16
    python tools/long_n.py --against-single --sizes 1x4096x128x4 --precisions bf16 tf32 fp32

Each size runs `module(pair, mask, out=pair)` (in place; the last N // 10 rows and columns
masked) and prints the rows per block the policy chose, the peak memory above the pair and
mask (the high-water mark of CuPy's pool's bytes in use, and the driver's free memory), the
time of a second call (CUDA events), and the rel L2 error of a few rows i against a
float64 reference computed before the pair is overwritten. The reference is the NumPy
backend's formulas (triattn_cupy/reference.py) in float64 on the device, the bias in
chunks of rows: the NumPy backend itself would hold the whole pair in float64 (69 GB at
N = 8192).

--against-single times, instead, the default forward against the single pass forced with
`max_scratch_bytes` at sizes where both fit (out of place), interleaved: 3 rounds of 2
calls each, medians, and their relative L2 difference.
"""
import argparse
import math
import statistics

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy.gpu.forward import Forward
from time_forward import padding_mask  # (tools/ is the script's folder on sys.path)


def padded_inputs(B, N, D, h, seed=0, pair_dtype="float32"):
    """The module, the pair (normal values, of `pair_dtype`: float32, float16 or bfloat16,
    the last as ml_dtypes.bfloat16) and the padding mask."""
    module = ta.TriangleAttention(ta.random_weights(D, h, seed=seed))
    rng = cp.random.default_rng(seed)
    carrier = cp.uint16 if pair_dtype == "bfloat16" else np.dtype(pair_dtype)
    pair = cp.empty((B, N, N, D), carrier)
    for j0 in range(0, N, 256):  # in slices: no float64 or index temporaries of the whole
        x = rng.standard_normal(pair[:, j0:j0 + 256].shape, dtype=np.float32)
        pair[:, j0:j0 + 256] = bfloat16_bits(x) if pair_dtype == "bfloat16" else x
    if pair_dtype == "bfloat16":
        import ml_dtypes

        pair = pair.view(ml_dtypes.bfloat16)
    return module, pair, padding_mask(B, N)


def bfloat16_bits(x):
    """float32 `x` rounded to bfloat16 (to nearest even; finite values), as uint16 bits."""
    u = x.view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def widened(x):
    """`x` (float32, float16 or bfloat16) as float64 on the device."""
    if x.dtype.name == "bfloat16":
        x = (x.view(cp.uint16).astype(cp.uint32) << 16).view(cp.float32)
    return x.astype(cp.float64)


def _layer_norm(x, p, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / cp.sqrt(var + eps) * p["layer_norm.weight"] + p["layer_norm.bias"]


def reference_rows(weights, pair, mask, b, rows, chunk=16):
    """out[b, i] for i in `rows` in float64 (the starting node, pair mask, fully masked
    queries zero), as reference.triangle_attention computes them."""
    N, D = pair.shape[1], pair.shape[-1]
    h = weights.num_heads
    d = D // h
    p = {name: cp.asarray(v, cp.float64) for name, v in weights.params.items()}
    eps = weights.layer_norm_eps
    bias = cp.empty((h, N, N), cp.float64)                        # [h, j, k]
    for j0 in range(0, N, chunk):
        xn = _layer_norm(widened(pair[b, j0:j0 + chunk]), p, eps)
        bias[:, j0:j0 + chunk] = cp.moveaxis(xn @ p["bias_proj.weight"].T, -1, 0)
    keep = mask[b] != 0
    bias = cp.where(keep[None], bias, -cp.inf)
    fully = ~keep.any(axis=-1)                                    # [N] queries j
    out = []
    for i in rows:
        xn = _layer_norm(widened(pair[b, i]), p, eps)              # [N, D]

        def linear(name):
            return xn @ p[f"{name}.weight"].T + p[f"{name}.bias"]

        q, k, v = (linear(n).reshape(N, h, d).transpose(1, 0, 2) for n in ("query", "key", "value"))
        g = 1 / (1 + cp.exp(-linear("gate")))
        o = cp.empty((h, N, d), cp.float64)
        for head in range(h):  # (one head's [N, N] scores at a time: 2 GiB at N = 16384)
            s = q[head] @ k[head].T / math.sqrt(d) + bias[head]
            m = s.max(axis=-1, keepdims=True)
            e = cp.exp(s - cp.where(cp.isfinite(m), m, 0))
            o[head] = (e @ v[head]) / e.sum(axis=-1, keepdims=True)
            del s, e
        o = cp.where(fully[None, :, None], 0.0, o).transpose(1, 0, 2).reshape(N, D)
        out.append(((g * o) @ p["out_proj.weight"].T + p["out_proj.bias"]).get())
    return np.stack(out)


class PeakUsed:
    """The high-water mark of CuPy's pool's bytes in use while the block runs (every
    allocation goes through the pool's malloc, wrapped here). The pool's total bytes
    would also count free pieces of earlier allocations that it keeps (split blocks whose
    other part is in use), which a forward may reuse."""

    def __enter__(self):
        pool = cp.get_default_memory_pool()
        self.peak = pool.used_bytes()

        def malloc(nbytes):
            memory = pool.malloc(nbytes)
            self.peak = max(self.peak, pool.used_bytes())
            return memory

        cp.cuda.set_allocator(malloc)
        return self

    def __exit__(self, *exc):
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)


def run_size(size, precision, n_rows, seed=0, pair_dtype="float32"):
    B, N, D, h = map(int, size.split("x"))
    module, pair, mask = padded_inputs(B, N, D, h, seed, pair_dtype)
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(N - N // 10, n_rows, replace=False))
    expected = reference_rows(module.weights, pair, mask, 0, rows)
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base_used, base_free = pool.used_bytes(), cp.cuda.runtime.memGetInfo()[0]
    forward = Forward(module._dw, pair, mask, "zero", pair, precision)
    rows_per_block = forward.rows_per_block
    del forward
    pool.free_all_blocks()
    with PeakUsed() as peak:
        module(pair, mask, out=pair, precision=precision)        # in place
        cp.cuda.Device().synchronize()
    pool_extra = peak.peak - base_used
    driver_extra = base_free - cp.cuda.runtime.memGetInfo()[0]
    got = widened(pair[0, rows]).get()
    err = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
    finite = bool(np.isfinite(got).all())
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    module(pair, mask, out=pair, precision=precision)            # again, on its output
    stop.record()
    stop.synchronize()
    ms = cp.cuda.get_elapsed_time(start, stop)
    input_bytes = pair.nbytes
    print(f"{size} {precision}, {pair_dtype} pair: rows per block "
          f"{rows_per_block or 'all (single pass)'}; peak extra memory {pool_extra / 2**30:.2f} GiB in use, "
          f"{driver_extra / 2**30:.2f} GiB from the driver ({pool_extra / input_bytes:.2f}x the "
          f"{input_bytes / 2**30:.1f} GiB input); {ms:.1f} ms; rows {rows.tolist()} rel L2 "
          f"{err:.2e}{'' if finite else ' NOT FINITE'}", flush=True)
    del pair, mask
    pool.free_all_blocks()
    return err, finite


def against_single(size, precision, rounds=3, calls=2):
    """The default forward (row blocks where the policy takes them) against the single
    pass, interleaved: `rounds` rounds of `calls` calls of each. Prints both medians, the
    rows per block, their difference, and the round-by-round ratio (median and quartiles):
    at 1x4096 the H200 runs at its power limit, its SM clock moving by ~20% within a
    second, so a difference of 1-2% needs rounds that see the same clocks."""
    B, N, D, h = map(int, size.split("x"))
    module, pair, mask = padded_inputs(B, N, D, h)
    out = cp.empty_like(pair)
    forms = {"single pass": dict(max_scratch_bytes=1 << 62), "default": {}}
    for options in forms.values():  # compiled and planned outside the timing
        module(pair, mask, out=out, precision=precision, **options)
    times = {name: [] for name in forms}
    ratios = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(rounds):
        this_round = {}
        for name, options in forms.items():
            this_round[name] = []
            for _ in range(calls):
                start.record()
                module(pair, mask, out=out, precision=precision, **options)
                stop.record()
                stop.synchronize()
                this_round[name].append(cp.cuda.get_elapsed_time(start, stop))
            times[name] += this_round[name]
        ratios.append(statistics.median(this_round["default"])
                      / statistics.median(this_round["single pass"]))
    rows_per_block = Forward(module._dw, pair, mask, "zero", None, precision).rows_per_block
    single = module(pair, mask, precision=precision, **forms["single pass"]).astype(cp.float64)
    default = module(pair, mask, precision=precision)
    diff = float(cp.linalg.norm(default - single) / cp.linalg.norm(single))
    a, b = statistics.median(times["single pass"]), statistics.median(times["default"])
    q1, q2, q3 = (statistics.quantiles(ratios, n=4) if len(ratios) > 1
                  else ratios * 3)
    print(f"{size} {precision}: rows per block {rows_per_block or 'all (single pass)'}; "
          f"single pass {a:.2f} ms, default {b:.2f} ms ({100 * (b / a - 1):+.1f}%); "
          f"by round {100 * (q2 - 1):+.1f}% [{100 * (q1 - 1):+.1f}, {100 * (q3 - 1):+.1f}] "
          f"of {rounds}; rel L2 difference {diff:.2e}", flush=True)
    del module, pair, mask, out, single, default
    cp.get_default_memory_pool().free_all_blocks()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["1x4096x128x4", "1x8192x128x4"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--rows", type=int, default=3, help="rows i checked against float64")
    ap.add_argument("--pair-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="the pair's (and the output's) element type")
    ap.add_argument("--against-single", action="store_true",
                    help="time the default forward against the single pass instead")
    ap.add_argument("--rounds", type=int, default=3,
                    help="--against-single: interleaved rounds of 2 calls each")
    args = ap.parse_args(argv)
    if args.against_single:
        for size in args.sizes:
            for precision in args.precisions:
                against_single(size, precision, rounds=args.rounds)
        return
    # (a 16-bit output adds its own rounding: half an ulp, 2^-9 of bfloat16's, 2^-12 of
    # float16's, at most; rel L2 below that)
    rounding = {"float32": 0.0, "float16": 2.0 ** -12, "bfloat16": 2.0 ** -9}[args.pair_dtype]
    tolerance = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}
    bad = 0
    for size in args.sizes:
        for precision in args.precisions:
            err, finite = run_size(size, precision, args.rows, pair_dtype=args.pair_dtype)
            bad += not finite or not err <= tolerance[precision] + rounding
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
