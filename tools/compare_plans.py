"""Whether this tree's forwards build the same launches as an older tree's, offline (no GPU): every kernel, grid, block, shared memory and argument byte.

    python tools/compare_plans.py --old OLD_TREE     (e.g. a `git archive REV` unpacked)

Each tree runs in a process of its own with CuPy replaced by NumPy (arrays whose device
address is a checksum of their contents, so that weight images compare by value) and the
kernel launch replaced by a recorder. Compared: the default plans over a grid of GPUs
(compute capability 9.0, 8.0, 8.6, 7.5 with their shared memory), shapes, N, precisions,
alignments, masks, policies and weights (with and without the f16s attention's scales);
and every route forced (this tree's route=, the older tree's own means as in
tools/compare_routes.py). Kernel files and entry points are mapped as tools/compare_kernels.py
maps them. Exit status 1 if any plan differs.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import types
import zlib

import numpy as np

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parent.parent


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, HERE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _DeviceArray(np.ndarray):
    """A NumPy array standing in for a CuPy one: .data.ptr is a checksum of its bytes."""

    @property
    def data(self):
        raw = np.ascontiguousarray(self).view(np.uint8).tobytes()
        return types.SimpleNamespace(ptr=zlib.crc32(raw) + 1)


def _fake_cupy(device):
    def wrap(x):
        if isinstance(x, np.ndarray) and not isinstance(x, _DeviceArray):
            return x.view(_DeviceArray)
        return tuple(wrap(e) for e in x) if isinstance(x, tuple) else x

    class Device:
        def __init__(self, device_id=None):
            cc, optin = device["now"]
            self.attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": optin}
            self.compute_capability = str(cc)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.SimpleNamespace()
    for name in dir(np):
        value = getattr(np, name)
        if callable(value) and not isinstance(value, type):
            value = (lambda f: lambda *a, **k: wrap(f(*a, **k)))(value)
        setattr(fake, name, value)
    fake.asarray = lambda a, dtype=None: np.asarray(a, dtype=dtype).view(_DeviceArray)
    fake.get_array_module = lambda *a: fake
    fake.cuda = types.SimpleNamespace(Device=Device,
                                      runtime=types.SimpleNamespace(getDevice=lambda: 0))
    return fake


# The precisions each route serves (by name, else by its attention's arithmetic)
_PRECISIONS = {"ffma": ("fp32", "tf32", "bf16"), "mma_tf32_ffma": ("tf32", "bf16"),
               "mma_f16x3_ffma": ("fp32",), "f16x3": ("fp32",), "tf32x3": ("fp32",),
               "tf32": ("tf32",), "f16": ("tf32",), "bf16": ("bf16",), "f16s": ("bf16",)}


def _geometries():
    """(cc, optin, D, h, f16s scales, N, precision, aligned, mask, nan) of the default plans."""
    devices = [(90, 227 * 1024), (80, 163 * 1024), (86, 99 * 1024), (75, 64 * 1024)]
    dims = [(128, 4), (64, 2), (64, 4), (40, 2), (96, 1), (256, 2), (768, 24), (32, 8)]
    for (cc, optin), (D, h), big in itertools.product(devices, dims, (False, True)):
        if big and (D, h) not in ((128, 4), (64, 2)):
            continue
        for N, precision, aligned, mask, nan in itertools.product(
                [1, 17, 128, 129, 200, 384, 512, 767, 768, 1030], ("fp32", "tf32", "bf16"),
                (True, False), (None, "bool", "f4"), (False, True)):
            if (N > 200 and (D >= 256 or cc == 75) and N not in (384, 768)) or (nan and mask != "bool"):
                continue
            yield cc, optin, D, h, big, N, precision, aligned, mask, nan


def run_side(tree: pathlib.Path, side: str, group: str):
    """{case: {records, scratch} or an error} of one tree (in this process)."""
    sys.path.insert(0, str(tree))
    import triattn_cupy as ta

    device = {"now": (90, 227 * 1024)}
    fake = _fake_cupy(device)
    records = []

    if side == "old":
        from triattn_cupy import _configs, _gpu
        from triattn_cupy._launch import KernelArgs
        _gpu._cupy = lambda: fake
        target, DeviceWeights, make_plan = _gpu, _gpu.DeviceWeights, _gpu.make_plan
    else:
        from triattn_cupy.gpu import device_weights, plan
        from triattn_cupy.gpu.launch import KernelArgs
        device_weights._cupy = lambda: fake
        target, DeviceWeights, make_plan = plan, device_weights.DeviceWeights, plan.make_plan

    class Recorder:
        def __init__(self, config, name, grid, block, smem, *rest):
            args, slots = rest[:2] if side == "old" else rest[0]
            kernel_args = KernelArgs(args, slots)
            records.append(dict(file=config.filename, defines=[list(d) for d in config.defines],
                                arch=config.arch, name=name, grid=int(grid), block=int(block),
                                smem=int(smem), args=[int(v) for v in kernel_args.template],
                                slots=[list(s) for s in kernel_args.slots]))

    target.Launch = Recorder

    def weights(D, h, big):
        w = ta.random_weights(D, h, seed=3 if group == "default" else 7)
        if big:  # scores past fp16's range: no f16s scales
            w.params["bias_proj.weight"] = w.params["bias_proj.weight"] * 1e5
        return w

    def key(shape, aligned, mask, precision, nan):
        B, N, _, D = shape
        width = D if aligned else D + 1
        strides = (N * N * width * 4, N * width * 4, width * 4, 4)
        mask_key = None if mask is None else (
            (np.dtype(bool), (N * N, N, 1)) if mask == "bool" else (np.dtype(np.float32), (N * 4, 4)))
        return (shape, strides, True, mask_key, precision, nan)

    result, modules = {}, {}

    def record(name, make):
        records.clear()
        try:
            p = make()
            result[name] = dict(records=list(records), scratch=p.scratch_bytes)
        except Exception as error:  # noqa: BLE001 (compared as such)
            result[name] = f"error: {type(error).__name__} {str(error)[:120]}"

    if group == "default":
        for cc, optin, D, h, big, N, precision, aligned, mask, nan in _geometries():
            device["now"] = (cc, optin)
            if (cc, D, h, big) not in modules:
                try:
                    modules[(cc, D, h, big)] = DeviceWeights(weights(D, h, big), 0)
                except ValueError as error:
                    modules[(cc, D, h, big)] = error
            dw = modules[(cc, D, h, big)]
            k = key((2 if N < 300 else 1, N, N, D), aligned, mask, precision, nan)
            name = f"{cc} {D}x{h} big={big} N={N} {precision} aligned={aligned} mask={mask} nan={nan}"
            if isinstance(dw, ValueError):
                result[name] = f"error: {dw}"[:120]
                continue
            record(name, lambda: make_plan(dw, k if side == "old" else k + (None,)))
        return result
    routes = _tool("compare_routes")
    for name, ((engine, variant, slot_rows), mma_projections, ffma_projections) in routes._OLD_MEANS.items():
        if mma_projections != (group == "mma_projections"):
            continue
        wide = engine == "wgmma" or name.endswith(("_tiles", "_slots"))
        D, h = (128, 4) if wide else (64, 4)
        precisions = _PRECISIONS.get(name) or _PRECISIONS[variant]
        for precision, table, (B, N, masked, policy), aligned in itertools.product(
                precisions, ["", "@sm_80"] if engine == "mma" else [""], routes._FORCED_CASES,
                (True, False)):
            if (D, h) not in modules:
                modules[(D, h)] = DeviceWeights(weights(D, h, False), 0)
            dw = modules[(D, h)]
            k = key((B, N, N, D), aligned, "bool" if masked else None, precision, policy == "nan")

            def make():
                if side == "new":
                    return make_plan(dw, k + (name + table,))
                d = D // h
                if engine == "ffma":
                    launch = _configs.attention_ffma_launch(d)
                elif engine == "mma":
                    launch = _configs.attention_mma_launch(d, variant, n=N,
                                                           compute_capability=80 if table else 90)
                else:
                    launch = _configs.attention_wgmma_launch(d, variant=variant, slot_rows=slot_rows)
                saved = _configs.project_uses_tensor_cores
                if ffma_projections:
                    _configs.project_uses_tensor_cores = lambda *args: False
                try:
                    return make_plan(dw, k, launch)
                finally:
                    _configs.project_uses_tensor_cores = saved
            record(f"{name}{table} {precision} {B}x{N} mask={masked} {policy} aligned={aligned}",
                   make)
    return result


def _normalized_old(record, kernels):
    """An older tree's launch record in this tree's names (compare_kernels' mapping)."""
    defines = {name: value for name, value in record["defines"]}
    entry = {"arch": "sm_90", "file": record["file"], "defines": record["defines"]}
    key = kernels.normalized_key(entry, old=True)
    filename = kernels.FILE_RENAMES.get(record["file"], record["file"])
    defines = dict(json.loads(key.split(" ", 2)[2]))
    return dict(record, file=filename, defines=sorted(defines.items()),
                name=kernels.entry_rename(record["name"], key))


def compare(old, new, kernels) -> tuple[int, list]:
    same, differ = 0, []
    for name in old:
        o, n = old[name], new.get(name, "missing")
        if isinstance(o, str) or isinstance(n, str):
            if isinstance(o, str) and isinstance(n, str):
                same += 1
            else:
                differ.append((name, "one side fails", o if isinstance(o, str) else n))
            continue
        if o["scratch"] != n["scratch"] or len(o["records"]) != len(n["records"]):
            differ.append((name, "scratch or stages", (o["scratch"], n["scratch"])))
            continue
        fields = ("file", "defines", "arch", "name", "grid", "block", "smem", "args", "slots")
        bad = [(f, a["name"]) for a, b in zip((_normalized_old(r, kernels) for r in o["records"]),
                                              n["records"])
               for f in fields if (sorted(map(tuple, b[f])) if f == "defines" else b[f])
               != (sorted(map(tuple, a[f])) if f == "defines" else a[f])]
        if bad:
            differ.append((name, "launches", bad[:3]))
        else:
            same += 1
    return same, differ


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=pathlib.Path, help="the older tree's folder")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: one side's process
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        tree = REPO if args.side == "new" else args.old.resolve()
        pathlib.Path(args.out).write_text(json.dumps(run_side(tree, args.side, args.group)))
        return 0
    if not args.old:
        ap.error("give --old")
    kernels = _tool("compare_kernels")
    sys.path.insert(0, str(REPO))  # (compare_kernels' layout names: this tree's)
    total_same, total, failures = 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for group, env in (("default", {}), ("forced", {}),
                           ("mma_projections", {"TRIATTN_PROJECT_TILES": "0"})):
            sides = {}
            for side in ("old", "new"):
                out = pathlib.Path(tmp) / f"{side}_{group}.json"
                subprocess.run([sys.executable, str(HERE), "--side", side, "--group", group,
                                "--out", str(out), "--old", str(args.old)],
                               env={**os.environ, **(env if side == "old" else {}),
                                    "PYTHONPATH": ""}, check=True)
                sides[side] = json.loads(out.read_text())
            same, differ = compare(sides["old"], sides["new"], kernels)
            print(f"{group}: {same} of {len(sides['old'])} plans identical")
            total_same, total = total_same + same, total + len(sides["old"])
            failures += differ
    for name, what, detail in failures[:20]:
        print(f"differs: {name}: {what} {detail}")
    print(f"{total_same} of {total} plans identical")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
