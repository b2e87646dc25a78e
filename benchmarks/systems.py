"""The PyTorch-side systems: the reference (eager fp32, eager TF32, torch.compile), SDPA, and
the peers NVIDIA cuEquivariance and trifast, each a whole-module forward (fp32 in and out).

The peers are built as in shared/peers/peer_baselines.py: LayerNorm and one fused projection
GEMM (q, k, v, gate, bias) in PyTorch, the peer's attention core, then gating and out_proj
in PyTorch. The (j, k) pair mask is folded into the (B, h, N, N) bias, which is exact for
this reference: the bias and the mask both are shared by every row i.

The reference module is the spec (shared/spec/reference_module.py), looked for at --spec,
beside the repository, inside it (shared/ or .shared/), and else the project's own statement
of it, tests/torch_spec.py (tests/test_torch_spec.py holds it equal to the spec to the bit),
so a checkout alone runs the peers. Every system loads the same weights (`common.make_weights`), so all
are compared with one float64 reference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import math
import os
import pathlib
import sys

from .common import ROOT, make_weights, short_error

SPEC_NAME = "reference_module.py"
_SPEC_MODULE = "triattn_bench_spec_reference_module"


def spec_candidates(explicit=None) -> list[pathlib.Path]:
    paths = []
    for given in (explicit, os.environ.get("TRIATTN_SPEC")):
        if given:
            p = pathlib.Path(given)
            paths.append(p / SPEC_NAME if p.is_dir() else p)
    paths += [ROOT.parent / "shared" / "spec" / SPEC_NAME,
              ROOT / "shared" / "spec" / SPEC_NAME,
              ROOT / ".shared" / "spec" / SPEC_NAME,
              ROOT / "tests" / "torch_spec.py"]
    return paths


def load_spec(explicit=None):
    """(module, path) of the first spec file found."""
    if _SPEC_MODULE in sys.modules:
        mod = sys.modules[_SPEC_MODULE]
        return mod, mod.__file__
    for path in spec_candidates(explicit):
        if path.is_file():
            spec = importlib.util.spec_from_file_location(_SPEC_MODULE, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[_SPEC_MODULE] = module
            return module, str(path)
    raise FileNotFoundError("reference_module.py not found; looked at "
                            + ", ".join(map(str, spec_candidates(explicit))))


class TorchModel:
    """The reference module with the benchmark's weights for one (D, h), on `device`, plus
    the fused projection weights the peer variants use."""

    def __init__(self, spec, D: int, h: int, device):
        import torch
        params, eps, _ = make_weights(D, h)
        m = spec.TriangleSelfAttention(D, h)
        m.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in params.items()})
        m.layer_norm.eps = eps
        self.m = m.to(device).eval()
        self.D, self.h, self.d = D, h, D // h
        with torch.no_grad():
            mm = self.m
            # [5 * ... ] rows: q, k, v, gate (D each), bias_proj (h)
            self.W = torch.cat([mm.query.weight, mm.key.weight, mm.value.weight,
                                mm.gate.weight, mm.bias_proj.weight]).contiguous()
            self.b = torch.cat([mm.query.bias, mm.key.bias, mm.value.bias, mm.gate.bias,
                                torch.zeros(h, device=device, dtype=mm.query.bias.dtype)])
        self.compiled = None

    def double(self):
        """A float64 copy of the reference module (a second reference, on the device)."""
        import copy
        return copy.deepcopy(self.m).double()


def device_inputs(size, device, seed: int, copies: int = 1):
    """([pair, ...], mask): `copies` standard-normal float32 pairs drawn on the device, and
    the padding mask (float32, 0 = masked) as in `common.padding_mask`."""
    import torch
    from .common import padding_mask
    g = torch.Generator(device=device).manual_seed(seed)
    pairs = [torch.randn(size.B, size.N, size.N, size.D, device=device, dtype=torch.float32,
                         generator=g) for _ in range(copies)]
    mask = torch.from_numpy(padding_mask(size.B, size.N)).to(device)
    return pairs, mask


# -- the forward passes -------------------------------------------------------------------

def _projections(model, x):
    """LayerNorm + one fused GEMM for q, k, v, gate and the pair bias."""
    import torch.nn.functional as F
    m, D = model.m, model.D
    xn = F.layer_norm(x, (D,), m.layer_norm.weight, m.layer_norm.bias, m.layer_norm.eps)
    y = F.linear(xn, model.W, model.b)                       # [B, N, N, 4D + h]
    return y.split([D, D, D, D, model.h], dim=-1)            # q, k, v, g, bias


def _folded_bias(bias, mask, neg):
    """bias [B, N, N, h] -> [B, h, N, N] with the pair mask folded in as `neg`."""
    bb = bias.permute(0, 3, 1, 2)
    return bb.masked_fill((mask == 0)[:, None], neg)


def _finish(model, g, o):
    import torch
    import torch.nn.functional as F
    m = model.m
    return F.linear(torch.sigmoid(g) * o, m.out_proj.weight, m.out_proj.bias)


def fwd_reference(model, x, mask):
    return model.m(x, mask)


def fwd_compiled(model, x, mask):
    import torch
    if model.compiled is None:
        model.compiled = torch.compile(model.m, dynamic=False)
    return model.compiled(x, mask)


def fwd_sdpa(model, x, mask):
    import torch
    import torch.nn.functional as F
    B, N, _, D = x.shape
    h, d = model.h, model.d
    q, k, v, g, bias = _projections(model, x)
    fb = _folded_bias(bias, mask, float("-inf")).contiguous()          # [B, h, N, N]
    outs = []
    for b in range(B):
        qb = q[b].reshape(N, N, h, d).transpose(1, 2)                  # [N(i), h, N(j), d]
        kb = k[b].reshape(N, N, h, d).transpose(1, 2)
        vb = v[b].reshape(N, N, h, d).transpose(1, 2)
        ab = fb[b:b + 1].expand(N, h, N, N)                             # shared by rows i
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=ab)
        outs.append(ob.transpose(1, 2).reshape(N, N, D))
    return _finish(model, g, torch.stack(outs))


def fwd_cueq(model, x, mask, dtype="float32"):
    import torch
    import cuequivariance_torch as cuet
    dtype = getattr(torch, dtype)
    B, N, _, D = x.shape
    h, d = model.h, model.d
    q, k, v, g, bias = _projections(model, x)
    fb = _folded_bias(bias, mask, -1e9)[:, None].contiguous()          # [B, 1, h, N, N]

    def hv(t):  # [B, N, N, D] -> [B, N(i), h, N(j), d]
        return t.reshape(B, N, N, h, d).permute(0, 1, 3, 2, 4).contiguous().to(dtype)

    o = cuet.triangle_attention(hv(q), hv(k), hv(v), fb, mask=None, scale=1 / math.sqrt(d))
    if isinstance(o, (tuple, list)):
        o = o[0]
    o = o.to(torch.float32).permute(0, 1, 3, 2, 4).reshape(B, N, N, D)
    return _finish(model, g, o)


def fwd_trifast(model, x, mask, dtype="float32"):
    import torch
    from trifast import triangle_attention
    dtype = getattr(torch, dtype)
    B, N, _, D = x.shape
    h, d = model.h, model.d
    q, k, v, g, bias = _projections(model, x)
    # trifast's mask is inverted (True = masked out); the pair mask goes into the bias.
    fb = _folded_bias(bias, mask, torch.finfo(dtype).min).to(dtype).contiguous()  # [B,h,N,N]

    def hv(t):  # [B, N, N, D] -> [B, h, N(i), N(j), d]
        return t.reshape(B, N, N, h, d).permute(0, 3, 1, 2, 4).contiguous().to(dtype)

    nomask = torch.zeros(B, N, N, dtype=torch.bool, device=x.device)
    o = triangle_attention(hv(q), hv(k), hv(v), fb, nomask)
    o = o.to(torch.float32).permute(0, 2, 3, 1, 4).reshape(B, N, N, D)
    return _finish(model, g, o)


@dataclasses.dataclass(frozen=True)
class TorchSystem:
    name: str
    label: str
    forward: object                 # forward(model, x, mask)
    kwargs: tuple = ()
    tf32: bool = False              # TF32 matmuls while it runs (matmul_precision)
    needs: str | None = None        # module that must import
    cuda_only: bool = False
    compile: bool = False           # torch.compile: timed in its own phase, small N only

    def bind(self, model):
        kw = dict(self.kwargs)
        return lambda x, mask: self.forward(model, x, mask, **kw)

    def probe(self, device: str) -> str | None:
        """None if usable here, else why not."""
        if self.cuda_only and device != "cuda":
            return "needs a CUDA device"
        if self.needs:
            try:
                importlib.import_module(self.needs)
            except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA queried at import
                return f"not importable ({short_error(exc, 300)})"
        return None


TORCH_SYSTEMS = (
    TorchSystem("ref_eager", "reference eager fp32", fwd_reference),
    TorchSystem("ref_eager_tf32", "reference eager TF32", fwd_reference, tf32=True),
    TorchSystem("sdpa", "PyTorch SDPA", fwd_sdpa),
    TorchSystem("cueq_fp32", "cuEquivariance fp32", fwd_cueq, (("dtype", "float32"),),
                needs="cuequivariance_torch", cuda_only=True),
    TorchSystem("cueq_bf16", "cuEquivariance bf16", fwd_cueq, (("dtype", "bfloat16"),),
                needs="cuequivariance_torch", cuda_only=True),
    TorchSystem("trifast_fp32", "trifast fp32", fwd_trifast, (("dtype", "float32"),),
                needs="trifast", cuda_only=True),
    TorchSystem("trifast_bf16", "trifast bf16", fwd_trifast, (("dtype", "bfloat16"),),
                needs="trifast", cuda_only=True),
    TorchSystem("ref_compile", "torch.compile (reference)", fwd_compiled, compile=True),
)


@contextlib.contextmanager
def matmul_precision(tf32: bool):
    """fp32 matmuls in TF32 (tf32=True) or full fp32 inside the block, full fp32 after it.

    Through the legacy flag `torch.backends.cuda.matmul.allow_tf32` only, as the peers' run
    on torch 2.11 did: torch 2.9+ raises when the legacy and the new fp32_precision APIs are
    mixed (one set, the other read, e.g. by Inductor), so this suite never touches the new
    one and never reads the flag back (the default is False)."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


# -- trifast's autotuning -----------------------------------------------------------------

def _dtypes_match(tail, dtype: str) -> bool:
    """Whether the tensor dtypes in an autotuner key are those of a `dtype` run: a bf16 run
    also has float32 tensors (the log-sum-exp), a float32 run has no 16-bit ones."""
    names = set(map(str, tail))
    if dtype == "float32":
        return "torch.float32" in names and not names & {"torch.bfloat16", "torch.float16"}
    return f"torch.{dtype}" in names


def trifast_tuning(N: int, h: int, d: int, dtype: str, tune_max_n: int):
    """(note, skip_reason) before running trifast at sequence length N, h heads of dim d.

    trifast autotunes its forward kernel over ~10 configurations for each key
    (H, DIM, CLOSEST_N = next power of two of N) and dtype, running each candidate several
    times: minutes at N = 4096 in fp32. Above `tune_max_n`, the tuned configuration of the
    largest tuned CLOSEST_N (same H, DIM, dtypes) is copied into Triton's autotuner cache, so
    only one configuration compiles. Without one to copy, the run is skipped with a reason.
    """
    closest = 1 << max(0, (N - 1).bit_length())
    if closest <= tune_max_n:
        return None, None
    try:
        mod = importlib.import_module("trifast.triton")
        cache = getattr(getattr(mod, "_fwd", None), "cache", None)
    except Exception as exc:  # noqa: BLE001
        return None, f"cannot reach trifast's autotuner ({short_error(exc, 200)})"
    if not isinstance(cache, dict):
        return None, "trifast's autotuner has no cache dict (unknown Triton version)"
    best = {}
    for key, cfg in list(cache.items()):
        if (isinstance(key, tuple) and len(key) >= 3 and tuple(key[:2]) == (h, d)
                and isinstance(key[2], int) and key[2] <= tune_max_n):
            group = (key[:2], key[3:])
            if group not in best or key[2] > best[group][0]:
                best[group] = (key[2], cfg)
    sources = []
    for (head, tail), (n_src, cfg) in best.items():
        cache.setdefault(head + (closest,) + tail, cfg)
        sources.append(n_src)
    ready = any(isinstance(k, tuple) and len(k) >= 3 and tuple(k[:3]) == (h, d, closest)
                and _dtypes_match(k[3:], dtype) for k in cache)
    if not ready:
        return None, (f"trifast would autotune ~10 configs at CLOSEST_N={closest} ({dtype}), "
                      f"minutes; no tuned config at N <= {tune_max_n} to reuse (run a size "
                      f"with N in ({tune_max_n // 2}, {tune_max_n}] first, or "
                      f"--trifast-tune-max-n)")
    return (f"trifast's autotune skipped at CLOSEST_N={closest}: reused the config tuned at "
            f"CLOSEST_N={max(sources) if sources else '?'}"), None
