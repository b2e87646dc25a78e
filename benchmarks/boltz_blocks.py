"""A stack of Boltz's own triangle attention blocks, as its pairformer runs them, under
`triattn_cupy.torch.accelerate` against the same model's own forward.

The stack: 2 starting + 2 ending ``TriangleAttention`` blocks of boltz-community
(c_z = 128, c_hidden = 32, 4 heads: Boltz's pairformer), each added to the pair
(``z = z + block(z, mask)``), a padding mask (the last 10% of positions, benchmarks.common).
Modes (each with its precision class):

    eager_fp32        the model's forward                              fp32
    eager_bf16        the model's forward under bf16 autocast          bf16
    cueq_fp32         use_kernels=True (NVIDIA cuEquivariance)         fp32
    cueq_bf16         use_kernels=True under bf16 autocast             bf16
    ours_fp32         accelerate(precision="fp32")                     fp32
    ours_bf16         accelerate(precision="bf16") under bf16 autocast bf16
                      (the pair read and the output written in bf16)

Per mode and N: time per block and end to end (CUDA events between the blocks of one
stack pass, after warm-up, median of the passes), peak memory (torch.cuda.max_memory_allocated
above what was allocated before the pass; ours' weights live in CuPy's pool, outside it,
and its scratch in torch's), and the relative L2 error of the stack's update (out - z)
against the same stack in float64, over the positions whose row and column are kept.

    python3 benchmarks/boltz_blocks.py --wheels .wheels/boltz \\
        --peer-tar .peers/peer_site.tar.xz --out benchmarks/results/NVIDIA-H200 --budget 150

--wheels: a folder of wheels to unpack and import from (boltz-community, einops); scipy,
which Boltz imports only to draw its initial weights, is replaced by a stub where it is
absent (every weight is redrawn here). --peer-tar: the peers' tarball (cuEquivariance).
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import logging
import math
import pathlib
import statistics
import sys
import tarfile
import time
import types
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import envinfo  # noqa: E402
from benchmarks.common import padding_mask  # noqa: E402

log = logging.getLogger("boltz_blocks")

C_Z, C_HIDDEN, HEADS = 128, 32, 4
BACK_TO_BACK = 10  # stack passes timed together, no wait between them
MODES = ("eager_fp32", "eager_bf16", "cueq_fp32", "cueq_bf16", "ours_fp32", "ours_bf16")
CLASS = {"eager_fp32": "fp32", "cueq_fp32": "fp32", "ours_fp32": "fp32",
         "eager_bf16": "bf16", "cueq_bf16": "bf16", "ours_bf16": "bf16"}


# --- imports -----------------------------------------------------------------------------

def prepare_imports(args):
    if args.wheels:
        site = pathlib.Path(args.wheel_site)
        site.mkdir(parents=True, exist_ok=True)
        for wheel in sorted(pathlib.Path(args.wheels).glob("*.whl")):
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site)
        sys.path.insert(0, str(site))
    if args.peer_tar:
        dest = pathlib.Path(args.peer_site)
        if not (dest / ".unpacked").exists():
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(args.peer_tar) as tf:
                try:
                    tf.extractall(dest, filter="data")
                except TypeError:
                    tf.extractall(dest)
            (dest / ".unpacked").write_text(str(args.peer_tar))
        sys.path.insert(0, str(dest))
    try:
        import scipy.stats  # noqa: F401
    except ImportError:
        # Boltz's initialize.py imports truncnorm to draw initial weights; every weight is
        # redrawn below, so a stub that is never called serves.
        log.info("scipy is absent: a stub stands for scipy.stats (Boltz's initial weights)")
        scipy = types.ModuleType("scipy")
        stats = types.ModuleType("scipy.stats")
        stats.truncnorm = None
        scipy.stats = stats
        sys.modules.update({"scipy": scipy, "scipy.stats": stats})


def cueq_available() -> str | None:
    """None where cuEquivariance's triangle attention imports, else why not."""
    try:
        from cuequivariance_torch.primitives.triangle import triangle_attention  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return None


# --- the device ----------------------------------------------------------------------------

class _WallEvent:
    """A host-clock stand-in for torch.cuda.Event (--device cpu: a dry run)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


class Device:
    """The device's events, synchronization and memory counters (zeros on the CPU)."""

    def __init__(self, torch, name: str):
        self.torch, self.name, self.cuda = torch, name, name == "cuda"

    def event(self):
        return self.torch.cuda.Event(enable_timing=True) if self.cuda else _WallEvent()

    def synchronize(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else 0

    def reset_peak(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        return self.torch.cuda.max_memory_allocated() if self.cuda else 0

    def empty_cache(self):
        if self.cuda:
            self.torch.cuda.empty_cache()

    def description(self) -> str:
        return self.torch.cuda.get_device_name() if self.cuda else "cpu (dry run)"


# --- the stack ---------------------------------------------------------------------------

def make_stack(torch, device, seed=0):
    from boltz.model.layers.triangular_attention.attention import (
        TriangleAttentionEndingNode, TriangleAttentionStartingNode)

    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(
        [cls(C_Z, C_HIDDEN, HEADS) for cls in (TriangleAttentionStartingNode,
                                               TriangleAttentionEndingNode,
                                               TriangleAttentionStartingNode,
                                               TriangleAttentionEndingNode)])
    with torch.no_grad():  # a trained model's scales: no zero-initialised projections
        for name, p in blocks.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("layer_norm.bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    return blocks.to(device.name).eval()


def stack_pass(blocks, z, mask, events=None, **kwargs):
    """z + each block in turn; events[k] recorded after block k (events[0] before)."""
    if events is not None:
        events[0].record()
    for k, block in enumerate(blocks):
        z = z + block(z, mask, **kwargs)
        if events is not None:
            events[k + 1].record()
    return z


def float64_reference(torch, blocks, z, mask):
    twin = copy.deepcopy(blocks).double()
    N = z.shape[1]
    chunk = max(1, min(N, (1 << 31) // (HEADS * N * N * 8)))  # rows per chunk: <= 2 GiB scores
    with torch.no_grad():
        return stack_pass(twin, z.double(), mask.double(), chunk_size=chunk)


# --- one mode ------------------------------------------------------------------------------

def run_mode(torch, tt, device, mode, blocks, z, mask, ref_update, valid, deadline,
             max_reps):
    import contextlib

    kwargs = {"use_kernels": True} if mode.startswith("cueq") else {}
    autocast = (torch.autocast(device.name, dtype=torch.bfloat16) if mode.endswith("bf16")
                else contextlib.nullcontext())
    if mode.startswith("ours"):
        tt.accelerate(blocks, precision="bf16" if mode.endswith("bf16") else "fp32")
    try:
        with torch.inference_mode(), autocast:
            out = stack_pass(blocks, z, mask, **kwargs)  # first call: compile, plans
            device.synchronize()
            if mode.startswith("cueq"):
                from boltz.model.layers.triangular_attention import primitives

                if primitives._kernel_failure["reason"]:  # Boltz fell back to its eager path
                    raise RuntimeError("cuEquivariance's kernel did not run: "
                                       + primitives._kernel_failure["reason"])
            update = (out.double() - z.double())[valid]
            err = (torch.linalg.vector_norm(update - ref_update)
                   / torch.linalg.vector_norm(ref_update)).item()
            del out, update
            for _ in range(2):
                stack_pass(blocks, z, mask, **kwargs)
            device.synchronize()
            base = device.memory_allocated()
            device.reset_peak()
            passes = []
            while len(passes) < max_reps and (len(passes) < 3 or time.time() < deadline):
                events = [device.event() for _ in range(len(blocks) + 1)]
                stack_pass(blocks, z, mask, events=events, **kwargs)
                device.synchronize()
                passes.append([events[k].elapsed_time(events[k + 1])
                               for k in range(len(blocks))])
            # Back to back: BACK_TO_BACK passes between two events, no wait between them,
            # as a model runs its layers (the host's time per block overlaps the GPU's
            # where it is shorter; a synchronized pass above includes it)
            back_to_back = []
            for _ in range(3):
                start, stop = device.event(), device.event()
                start.record()
                for _ in range(BACK_TO_BACK):
                    stack_pass(blocks, z, mask, **kwargs)
                stop.record()
                device.synchronize()
                back_to_back.append(start.elapsed_time(stop) / BACK_TO_BACK)
            peak = device.peak() - base
    finally:
        if mode.startswith("ours"):
            tt.restore(blocks)
    per_block = [statistics.median(p[k] for p in passes) for k in range(len(blocks))]
    totals = [sum(p) for p in passes]
    return {"ms": statistics.median(totals), "ms_min": min(totals), "ms_max": max(totals),
            "ms_back_to_back": statistics.median(back_to_back),
            "block_ms": [round(t, 4) for t in per_block], "runs": len(passes),
            "peak_mib": round(peak / 2**20, 1), "rel_l2": err}


# --- report ------------------------------------------------------------------------------

def markdown(results) -> str:
    lines = [f"# Boltz triangle attention stack ({results['gpu']})", "",
             "2 starting + 2 ending boltz-community blocks (c_z 128, c_hidden 32, 4 heads) "
             "with residual adds, padding mask, B = 1. Time: median of whole stack passes "
             "(CUDA events), each pass synchronized before the next, so that the host's "
             "time before the GPU starts counts; back to back: "
             f"{BACK_TO_BACK} passes with no wait between them (as a model runs its "
             "layers), per pass; per block: the mean of the four blocks' medians. Error: "
             "rel L2 of the stack's update against float64. Speedup: the cuEquivariance "
             "mode of the same precision class over this one (synchronized; back to "
             "back).", "",
             "| N | mode | class | end to end ms | back to back ms | per block ms | peak MiB "
             "| rel L2 | speedup vs cueq |", "|---|---|---|---|---|---|---|---|---|"]
    for N, modes in results["runs"].items():
        for mode, r in modes.items():
            if "ms" not in r:
                lines.append(f"| {N} | {mode} | {CLASS[mode]} | {r.get('status', '')} "
                             f"| | | | | |")
                continue
            cueq = modes.get(f"cueq_{CLASS[mode]}", {})
            speed = (f"{cueq['ms'] / r['ms']:.2f}x; "
                     f"{cueq['ms_back_to_back'] / r['ms_back_to_back']:.2f}x"
                     if "ms" in cueq else "")
            lines.append(f"| {N} | {mode} | {CLASS[mode]} | {r['ms']:.2f} | "
                         f"{r['ms_back_to_back']:.2f} | "
                         f"{statistics.fmean(r['block_ms']):.2f} | {r['peak_mib']:.0f} | "
                         f"{r['rel_l2']:.2e} | {speed} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="384,768,1024", help="N values (comma-separated)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for the whole run")
    ap.add_argument("--max-reps", type=int, default=20)
    ap.add_argument("--out", required=True, help="folder for boltz_blocks.json / .md")
    ap.add_argument("--wheels", help="folder of wheels to import from (boltz-community, einops)")
    ap.add_argument("--wheel-site", default="/tmp/boltz_site")
    ap.add_argument("--peer-tar", help="the peers' tarball (cuEquivariance)")
    ap.add_argument("--peer-site", default="/tmp/peer_site")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the script (ours falls back to the original)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    start = time.time()
    deadline = start + args.budget
    prepare_imports(args)
    import torch

    import triattn_cupy.torch as tt

    sizes = [int(n) for n in args.sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; expected some of {MODES}")
    no_cueq = cueq_available()
    device = Device(torch, args.device)
    blocks = make_stack(torch, device)
    versions = envinfo.versions()
    for dist in ("boltz-community", "einops", "cuequivariance-torch"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    results = {"gpu": device.description(), "versions": versions,
               "host": envinfo.host_info(sys.argv), "budget_s": args.budget,
               "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "runs": {}}
    # Each size gets an even share of what is left; the modes inside it too.
    for si, N in enumerate(sizes):
        size_deadline = time.time() + (deadline - time.time()) / (len(sizes) - si)
        gen = torch.Generator(device=device.name).manual_seed(N)
        z = torch.randn(1, N, N, C_Z, device=device.name, generator=gen)
        mask = torch.from_numpy(padding_mask(1, N)).to(device.name)
        L = N - int(N * 0.1)
        valid = torch.zeros(1, N, N, dtype=torch.bool, device=device.name)
        valid[:, :L, :L] = True
        ref = float64_reference(torch, blocks, z, mask)
        ref_update = (ref - z.double())[valid]
        del ref
        runs = results["runs"][str(N)] = {}
        for mi, mode in enumerate(modes):
            if mode.startswith("cueq") and no_cueq:
                runs[mode] = {"status": f"absent ({no_cueq[:80]})"}
                continue
            if time.time() > size_deadline and mi:
                runs[mode] = {"status": "skipped (budget)"}
                continue
            mode_deadline = time.time() + (size_deadline - time.time()) / (len(modes) - mi)
            try:
                runs[mode] = run_mode(torch, tt, device, mode, blocks, z, mask, ref_update,
                                      valid, mode_deadline, args.max_reps)
                r = runs[mode]
                log.info("N=%d %-10s %8.2f ms (blocks %s) peak %7.0f MiB rel L2 %.2e", N, mode,
                         r["ms"], r["block_ms"], r["peak_mib"], r["rel_l2"])
            except torch.cuda.OutOfMemoryError as err:
                runs[mode] = {"status": "out of memory"}
                log.info("N=%d %s: out of memory: %s", N, mode, str(err).splitlines()[0])
            except Exception as err:  # noqa: BLE001  (one mode failing keeps the others)
                runs[mode] = {"status": f"error: {type(err).__name__}: {str(err)[:200]}"}
                log.exception("N=%d %s failed", N, mode)
            device.empty_cache()
        del z, mask, valid, ref_update
        device.empty_cache()
    results["elapsed_s"] = round(time.time() - start, 1)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "boltz_blocks.json").write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (out / "boltz_blocks.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
