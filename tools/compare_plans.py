"""Whether this tree's forwards build the same launches as an older tree's, offline (no GPU): every kernel, grid, block, shared memory and argument byte.

    python tools/compare_plans.py --old OLD_TREE     (a `git archive REV | tar -x -C OLD_TREE`
                                                     of a tree from the redesign on, such as 85b05f1)

Each tree runs in a process of its own with CuPy replaced by NumPy (arrays whose device
address is a checksum of their contents, so that weight images compare by value) and each
kernel handle by a record of what was asked for. Compared per plan: its scratch and its
launches (key extent, row mask, the three stages) and its row blocks' launches (bias pass,
projection, attention, out projection, rows per block); over the default plans of a grid
of GPUs (compute capability 9.0, 8.0, 8.6, 7.5 with their shared memory), shapes, N,
precisions, alignments, masks, policies and weights (with and without the f16s attention's
scales), and every route forced by name (the older tree's names mapped by
tools/compare_routes.py ROUTE_RENAMES). Exit status 1 if any plan differs.
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
    stream = types.SimpleNamespace(synchronize=lambda: None, ptr=0)
    fake.cuda = types.SimpleNamespace(Device=Device, get_current_stream=lambda: stream,
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


def _plan_maker(side: str, fake):
    """(DeviceWeights, make(dw, case, route)) of a tree:
    this tree's through its PlanKey, an older one (from the redesign on) through its
    positional plan_key tuple."""
    from triattn_cupy.gpu import device_weights
    device_weights._cupy = lambda: fake
    if side == "new":
        from triattn_cupy.gpu import launch_plan

        def make(dw, case, route):
            shape, strides, aligned, mask_key, precision, nan = case
            return launch_plan.make_plan(dw, launch_plan.PlanKey(
                shape, strides, aligned, mask_key, precision, nan, route))
        return device_weights.DeviceWeights, make
    from triattn_cupy.gpu import plan

    def make(dw, case, route):
        return plan.make_plan(dw, case + (route,))
    return device_weights.DeviceWeights, make


def run_side(tree: pathlib.Path, side: str, group: str):
    """{case: {records, scratch} or an error} of one tree (in this process)."""
    sys.path.insert(0, str(tree))
    import triattn_cupy as ta
    from triattn_cupy.gpu import compile as compiler, row_blocks

    device = {"now": (90, 227 * 1024)}
    DeviceWeights, make_plan = _plan_maker(side, _fake_cupy(device))
    # Each kernel handle a record of what was asked for (no GPU, no compilation)
    compiler.KernelConfig.get = lambda config, name, smem=0: types.SimpleNamespace(
        kernel=types.SimpleNamespace(ptr=0), config=config, name=name)

    def described(launch):
        """A launch (or an older tree's row-block launch) as compared."""
        config, name = launch.kernel.config, launch.kernel.name
        grid = getattr(launch, "grid", None)
        return dict(file=config.filename, defines=[list(d) for d in config.defines],
                    arch=config.arch, name=name, grid=None if grid is None else int(grid),
                    block=int(launch.block), smem=int(launch.smem),
                    args=[int(v) for v in launch.args.template],
                    slots=[list(s) for s in launch.args.slots])

    def launches(plan, dw):
        """The plan's launches in stage order, then its row blocks'."""
        out = [described(getattr(plan, stage)) for stage in
               ("key_extent", "row_mask", "project", "attention", "out_project")
               if getattr(plan, stage) is not None]
        blocks = row_blocks.RowBlockLaunches.of(plan, dw)
        out += [described(getattr(blocks, stage)) for stage in
                ("bias_pass", "project", "attention", "out_project")]
        out.append(dict(file="(row blocks)", defines=[], arch="", name="", grid=None,
                        block=blocks.bias_rows, smem=blocks.bias_blocks or 0,
                        args=[blocks.project_rows or 0], slots=[]))
        return out

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

    def record(name, dw, make):
        try:
            p = make()
            result[name] = dict(records=launches(p, dw), scratch=p.scratch_bytes)
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
            record(name, dw, lambda: make_plan(dw, k, None))
        return result
    routes = _tool("compare_routes")
    for name, ((engine, variant, _), _, _) in routes._OLD_MEANS.items():
        wide = engine == "wgmma" or name.endswith(("_tiles", "_slots"))
        D, h = (128, 4) if wide else (64, 4)
        precisions = _PRECISIONS.get(name) or _PRECISIONS[variant]
        route = name if side == "old" else routes.ROUTE_RENAMES.get(name, name)
        for precision, table, (B, N, masked, policy), aligned in itertools.product(
                precisions, ["", "@sm_80"] if engine == "mma" else [""], routes._FORCED_CASES,
                (True, False)):
            if (D, h) not in modules:
                modules[(D, h)] = DeviceWeights(weights(D, h, False), 0)
            dw = modules[(D, h)]
            k = key((B, N, N, D), aligned, "bool" if masked else None, precision, policy == "nan")
            record(f"{name}{table} {precision} {B}x{N} mask={masked} {policy} aligned={aligned}",
                   dw, lambda: make_plan(dw, k, route + table))
    return result


def compare(old, new) -> tuple[int, list]:
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
        bad = [(f, a["name"]) for a, b in zip(o["records"], n["records"])
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
    total_same, total, failures = 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for group in ("default", "forced"):
            sides = {}
            for side in ("old", "new"):
                out = pathlib.Path(tmp) / f"{side}_{group}.json"
                subprocess.run([sys.executable, str(HERE), "--side", side, "--group", group,
                                "--out", str(out), "--old", str(args.old)],
                               env={**os.environ, "PYTHONPATH": ""}, check=True)
                sides[side] = json.loads(out.read_text())
            same, differ = compare(sides["old"], sides["new"])
            print(f"{group}: {same} of {len(sides['old'])} plans identical")
            total_same, total = total_same + same, total + len(sides["old"])
            failures += differ
    for name, what, detail in failures[:20]:
        print(f"differs: {name}: {what} {detail}")
    print(f"{total_same} of {total} plans identical")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
