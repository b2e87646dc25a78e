"""Where the persistent projections (kernels/project_tiles.cu, project_tiles_split.cu) depart
from project_mma.cu's, part by part, on the same inputs and scratch, and how long each takes
(a GPU with wgmma: H100/H200). For each size and mode (tf32: KV_FORMAT 8, bf16: 6, fp32: 7,
whose q, K, V^T and bias are fp16 hi + lo pairs, compared as their sums):

  projection      both kernels run on the same pair; q, the gate, the K and V^T tiles and
                  the pair-bias tiles compared (decoded to fp32; the keys past N, which
                  the old kernel leaves unwritten in K, left out)
  out projection  both kernels run on the same qkvg (after the new projection and the
                  attention); the outputs compared
  forward         each plan's whole forward against the float64 NumPy reference

    python3 scripts/tiles_probe.py [--precisions=fp32,tf32,bf16] [--split-defines=NAME=V,...]
                                   [sizes BxNxDxh ...]

--split-defines compiles project_tiles_split.cu with those #defines added (CHAIN_STEPS,
PASSES_IN_FLIGHT: the fp32 kernels' variants, benchmarks/NOTES.md session 17).
"""
import sys

import cupy as cp
import numpy as np

import triattn_cupy as ta
from triattn_cupy import _configs, _gpu, reference
from time_ours import median_ms  # scripts/ is on sys.path when run as a script


def plan_with(dw, tiles, key):
    _configs.PROJECT_TILES = tiles
    dw.plans.clear()
    return _gpu.make_plan(dw, key)


def decode16(words, bf16):
    """uint32 words of two 16-bit values each -> float32 pairs (low half first)."""
    halves = cp.ascontiguousarray(words).view(cp.uint16)
    if bf16:
        return (halves.astype(cp.uint32) << 16).view(cp.float32)
    return halves.view(cp.float16).astype(cp.float32)


def compare(name, got, want, where=None, tol=4e-3):
    got, want = cp.asarray(got, cp.float64), cp.asarray(want, cp.float64)
    if where is not None:
        got, want = got[where], want[where]
    inf_mismatch = int(cp.count_nonzero(cp.isinf(got) != cp.isinf(want)))
    nan_got, nan_want = int(cp.count_nonzero(cp.isnan(got))), int(cp.count_nonzero(cp.isnan(want)))
    finite = cp.isfinite(got) & cp.isfinite(want)
    g, w = got[finite], want[finite]
    scale = float(cp.abs(w).max()) if w.size else 0.0
    diff = float(cp.abs(g - w).max()) if w.size else 0.0
    rel = float(cp.linalg.norm(g - w) / max(float(cp.linalg.norm(w)), 1e-30)) if w.size else 0.0
    ok = inf_mismatch == 0 and nan_got == nan_want and rel < tol
    print(f"    {name:10s} rel L2 {rel:9.2e}  max|diff|/max|ref| {diff / max(scale, 1e-30):9.2e}"
          f"  inf mismatches {inf_mismatch}  NaN {nan_got}/{nan_want}  {'ok' if ok else 'DIFFERS'}",
          flush=True)
    return ok


def scratch_views(fwd):
    plan = fwd.plan
    base = fwd._scratch
    qkvg = cp.ndarray(plan.qkvg_shape, cp.float32, memptr=base).copy()
    bias = cp.ndarray(plan.bias_shape, plan.bias_dtype, memptr=base + plan.qkvg_bytes).copy()
    vt = cp.ndarray((plan.vt_bytes // 2,), cp.uint16,
                    memptr=base + plan.qkvg_bytes + plan.bias_bytes).copy()
    return qkvg, bias, vt


def decode_parts(qkvg, bias, vt, kv, B, N, D, h, npk):
    """{part: (fp32 values, where to compare or None)} of one projection's scratch: q, the
    gate, the K and V^T tiles (the keys past N, which project_mma.cu leaves unwritten in K,
    left out) and the bias tiles (the query rows past N left out); fp32's hi + lo pairs
    (format 7) as their sums."""
    bf16, split = kv == _configs.KV_BF16_TILES, kv == _configs.KV_F16X3_TILES
    words = qkvg.view(cp.uint32)

    def head_words(first, count):  # those words of every head's 32-word slot, decoded
        return decode16(cp.concatenate([words[:, 32 * hd + first:32 * hd + first + count]
                                        for hd in range(h)], axis=1), bf16)
    q = head_words(0, 16) + head_words(16, 16) if split else head_words(0, 16)
    gate = head_words(16, 16) if bf16 else qkvg[:, D:2 * D]
    nc = npk // 64
    tiles = vt.reshape(B * N, h, nc, -1)  # per tile: K then V^T (format 7: each hi, lo)
    dec = (lambda t: (t.astype(cp.uint32) << 16).view(cp.float32)) if bf16 else \
        (lambda t: t.view(cp.float16).astype(cp.float32))
    quarter = tiles.shape[-1] // (4 if split else 2)

    def piece(k):
        return dec(cp.ascontiguousarray(tiles[..., k * quarter:(k + 1) * quarter]))
    k_tile, vt_tile = (piece(0) + piece(1), piece(2) + piece(3)) if split else (piece(0), piece(1))
    k_tile = k_tile.reshape(B * N, h, nc * 64, 32)
    valid_keys = cp.broadcast_to((cp.arange(nc * 64) < N)[None, None, :, None], k_tile.shape)
    b = bias.astype(cp.float32)
    if split:
        b = b[:, :, :, :, 0] + b[:, :, :, :, 1]  # hi + lo (-inf + 0 where masked)
    rows = (cp.arange(b.shape[2])[:, None] * 128 + cp.arange(128)[None, :] < N)
    where = cp.broadcast_to(rows[None, None, :, None, :, None], b.shape)
    return {"q": (q, None), "gate": (gate, None), "K tiles": (k_tile, valid_keys),
            "V^T tiles": (vt_tile, None), "bias": (b, where)}


def probe(size, precision, rng):
    B, N, D, h = map(int, size.split("x"))
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    module = ta.TriangleAttention(weights)
    dw = module._dw
    pair_h = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
    keep = rng.random((B, N, N)) > 0.25
    keep[:, rng.integers(N), :] = False
    pair, mask = cp.asarray(pair_h), cp.asarray(keep)
    key = _gpu.plan_key(pair, mask, precision, False)
    old = plan_with(dw, False, key)
    new = plan_with(dw, True, key)
    kv = new.kv_format
    print(f"{size} {precision}: format {kv}, tiles projection {new.project_tiles}, "
          f"out {new.tiles}", flush=True)
    if not new.tiles:
        return True
    dw.plans[key] = new
    fwd = _gpu.Forward(dw, pair, mask, "zero", None, precision)
    assert fwd.plan is new
    cp.cuda.Device().synchronize()
    ptrs = fwd._pointers
    # -- the projection: new, then old, on the same scratch (poisoned before each)
    results = {}
    for label, plan in (("new", new), ("old", old)):
        cp.ndarray((new.scratch_bytes // 4,), cp.float32, memptr=fwd._scratch).fill(np.nan)
        plan.project(ptrs)
        cp.cuda.Device().synchronize()
        results[label] = scratch_views(fwd)
    ok = True
    tol = 1e-5 if precision == "fp32" else 4e-3  # (fp32: both kernels' parts to ~2^-22)
    parts = {label: decode_parts(*results[label], kv, B, N, D, h, new.npk) for label in results}
    for name in ("q", "gate", "K tiles", "V^T tiles", "bias"):
        (got, where), (want, _) = parts["new"][name], parts["old"][name]
        ok &= compare(name, got, want, where, tol)
    t_new = median_ms(lambda: new.project(ptrs), 20)
    t_old = median_ms(lambda: old.project(ptrs), 20)
    print(f"    projection: new {t_new:.3f} ms, old {t_old:.3f} ms", flush=True)
    # -- the out projection on one qkvg (the new projection's, then the attention)
    new.project(ptrs)
    new.attention(ptrs)
    outs = {}
    for label, plan in (("new", new), ("old", old)):
        fwd.out.fill(np.nan)
        plan.out_project(ptrs)
        cp.cuda.Device().synchronize()
        outs[label] = fwd.out.copy()
    ok &= compare("out", outs["new"], outs["old"], tol=tol)
    t_new = median_ms(lambda: new.out_project(ptrs), 20)
    t_old = median_ms(lambda: old.out_project(ptrs), 20)
    print(f"    out projection: new {t_new:.3f} ms, old {t_old:.3f} ms", flush=True)
    # -- whole forwards against the float64 reference (small enough sizes only)
    if B * N * N <= 400 * 400:
        expected = reference.triangle_attention(pair_h, keep, weights)
        for label, plan in (("new", new), ("old", old)):
            dw.plans[key] = plan
            got = module(pair, mask, precision=precision).get()
            err = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
            bound = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}[precision]
            print(f"    forward {label}: rel L2 {err:.3g} (bound {bound})", flush=True)
            ok &= err <= bound
    _configs.PROJECT_TILES = True
    dw.plans.clear()
    return ok


def with_split_defines(extra):
    """_configs.project_tiles_config with `extra` ((name, value) pairs) added to the split
    kernels' defines."""
    plain = _configs.project_tiles_config

    def config(kv_format):
        c = plain(kv_format)
        if _configs.project_tiles_split(kv_format):
            c = _configs.KernelConfig(c.filename, c.defines + extra, c.arch)
        return c
    _configs.project_tiles_config = config


def main(args):
    precisions = ["fp32", "tf32", "bf16"]
    for arg in list(args):
        if arg.startswith("--precisions="):
            precisions = arg.split("=", 1)[1].split(",")
        elif arg.startswith("--split-defines="):
            extra = tuple((k, int(v)) for k, v in (kv.split("=") for kv in arg.split("=", 1)[1].split(",")))
            with_split_defines(extra)
            print("split kernels' defines +", dict(extra))
        else:
            continue
        args.remove(arg)
    sizes = args or ["1x129x128x4", "2x192x128x4", "1x200x128x4", "1x320x128x4", "1x1024x128x4"]
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy", cp.__version__)
    rng = np.random.default_rng(2026)
    bad = [(s, p) for s in sizes for p in precisions if not probe(s, p, rng)]
    print("all parts agree" if not bad else f"DIFFERS: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
