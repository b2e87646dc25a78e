"""Whether every route of this tree gives the same bits on the GPU as an older tree's forward with the same kernels forced.

    python tools/compare_routes.py --old OLD_TREE     (e.g. `git archive 85b05f1` unpacked)

For every route of the route table (triattn_cupy.gpu.routes.ROUTES, and the mma.sync
routes with the sm_80 tile tables) and a small case list (sizes off the tiles, B = 2,
fully masked queries under both policies, a mask and none, N on both sides of the
thresholds that shape a forward), this tree's forward runs with the route forced through
the public `route=` argument, and the older tree's with the same kernels forced by its own
means: a tree from the redesign on by its own name of the route (ROUTE_RENAMES), an older
one by its Forward's `attention=` launch, its compute-capability argument of the tile
table, TRIATTN_PROJECT_TILES=0 before its import for the project_mma.cu projections, its
projection switch for the FFMA projections. The default routes are compared too, at N
on both sides of every N threshold, unforced on both sides. Each side runs in its own
process on the same inputs and weights; the report gives per route and case whether the
outputs are bit-identical, and the largest absolute difference where not. Exit status 1
if any differs.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parent.parent

# route -> (the older tree's attention launch: (engine, variant, slot rows), projections
# on project_mma.cu where the route has no persistent projections, FFMA projections)
_OLD_MEANS = {
    "ffma": (("ffma", None, False), False, True),
    "mma_f16x3": (("mma", "f16x3", False), False, False),
    "mma_tf32": (("mma", "tf32", False), False, False),
    "mma_bf16": (("mma", "bf16", False), False, False),
    "mma_f16x3_ffma": (("ffma", None, False), False, False),
    "mma_tf32_ffma": (("ffma", None, False), False, False),
    "wgmma_f16x3": (("wgmma", "f16x3", False), True, False),
    "wgmma_f16x3_tiles": (("wgmma", "f16x3", False), False, False),
    "wgmma_f16": (("wgmma", "f16", False), True, False),
    "wgmma_f16_tiles": (("wgmma", "f16", False), False, False),
    "wgmma_bf16": (("wgmma", "bf16", False), True, False),
    "wgmma_bf16_tiles": (("wgmma", "bf16", False), False, False),
    "wgmma_f16s": (("wgmma", "f16s", False), True, False),
    "wgmma_f16s_tiles": (("wgmma", "f16s", False), False, False),
    "wgmma_f16s_slots": (("wgmma", "f16s", True), False, False),
    "mma_tf32x3": (("mma", "tf32x3", False), False, False),
}
# Route names of the older trees that this tree calls otherwise (docs/design.md)
ROUTE_RENAMES = {f"wgmma_{a}_tiles": f"wgmma_{a}_persistent" for a in ("f16x3", "f16", "bf16", "f16s")}
_OLD_NAMES = {new: old for old, new in ROUTE_RENAMES.items()}
# (B, N, masked, fully_masked): off the 64/128 tiles, at and past N = 128 (the mma.sync
# tile table's small-N shapes), past the key extent's N = 512, B = 2
_FORCED_CASES = [(2, 45, True, "zero"), (2, 128, False, "zero"), (1, 129, True, "nan"),
                 (2, 200, True, "zero"), (1, 513, True, "nan")]
# the default routes: N on both sides of every threshold (128, 384, 512, 768)
_DEFAULT_N = [64, 128, 129, 383, 384, 511, 512, 767, 768]


def cases():
    """[{name, precision, route (this tree's), old (the older tree's means), B, N, D, h,
    masked, policy, aligned}]"""
    sys.path.insert(0, str(REPO))
    from triattn_cupy.gpu import routes

    out = []
    for name in routes.ROUTES:
        parts = routes.route_parts(name)
        wide = parts["project"] == "persistent" or parts["attention"].startswith("wgmma")
        D, h = (128, 4) if wide else (64, 4)
        tables = [""] + (["@sm_80"] if parts["attention"].startswith("mma") else [])
        for precision in parts["precisions"]:
            for table in tables:
                for B, N, masked, policy in _FORCED_CASES:
                    out.append(dict(name=f"{name}{table}", precision=precision,
                                    route=name + table, old=[_OLD_NAMES.get(name, name), table],
                                    B=B, N=N, D=D, h=h,
                                    masked=masked, policy=policy, aligned=True))
    for precision in ("fp32", "tf32", "bf16"):
        for D, h, Ns in ((128, 4, _DEFAULT_N), (64, 2, [383, 384, 767, 768]), (64, 4, [128, 129])):
            for N in Ns:
                for aligned in ((True, False) if N in (384, 768) and D == 128 else (True,)):
                    out.append(dict(name="default", precision=precision, route=None, old=None,
                                    B=1, N=N, D=D, h=h, masked=True,
                                    policy="nan" if N % 2 else "zero", aligned=aligned))
    for index, case in enumerate(out):
        case["id"] = index
    return out


def _inputs(case):
    """(pair, mask) of a case on the host, the same for both trees (seeded by case)."""
    rng = np.random.default_rng(1000 + case["id"])
    B, N, D = case["B"], case["N"], case["D"]
    pair = (rng.standard_normal((B, N, N, D + (0 if case["aligned"] else 1)), np.float32)
            * 2 + 0.5).astype(np.float32)
    mask = None
    if case["masked"]:
        mask = rng.random((B, N, N)) > 0.2
        mask[:, rng.integers(N), :] = False   # a fully masked query
        if N > 64:
            j = rng.integers(N)
            mask[:, j, :64] = False           # a query whose first key tile is all masked
    return pair, mask


def run_side(tree: pathlib.Path, side: str, todo, folder: pathlib.Path):
    """Run this side's forwards (in this process) and save each output."""
    sys.path.insert(0, str(tree))
    import cupy as cp

    import triattn_cupy as ta

    # Every allocation zeroed on both sides: the older tree read scratch it never wrote (the
    # bias tiles' rows past N, which this tree zeroes itself), so its bits depended on what
    # the pool held before.
    pool = cp.get_default_memory_pool()

    def zeroed(size):
        memory = pool.malloc(size)
        cp.cuda.runtime.memsetAsync(memory.ptr, 0, size, cp.cuda.get_current_stream().ptr)
        return memory

    cp.cuda.set_allocator(zeroed)
    # A tree from the redesign on forces its routes by name too (the older names)
    by_name = side == "new" or (tree / "triattn_cupy" / "gpu" / "routes.py").exists()

    weights_of = {}
    for case in todo:
        key = (case["D"], case["h"])
        if key not in weights_of:
            weights_of[key] = ta.random_weights(*key, seed=7)
        weights = weights_of[key]
        pair, mask = _inputs(case)
        pair_d = cp.asarray(pair)
        if not case["aligned"]:
            pair_d = pair_d[..., 1:]          # rows one channel off: not 16-byte aligned
        mask_d = None if mask is None else cp.asarray(mask)
        if side == "old" and not case["aligned"]:
            # this tree reads unaligned rows from an aligned copy, whose route the older
            # tree takes for aligned rows
            pair_d = cp.ascontiguousarray(pair_d)
        try:
            if by_name or case["old"] is None:
                module = ta.TriangleAttention(weights)
                route = case["route"] if side == "new" else "".join(case["old"] or ())
                forced = {} if case["route"] is None else {"route": route}
                out = module(pair_d, mask_d, fully_masked=case["policy"],
                             precision=case["precision"], **forced)
            else:
                out = _old_forward(cp, weights, pair_d, mask_d, case)
            np.save(folder / f"{side}_{case['id']}.npy", cp.asnumpy(out))
        except Exception as error:  # reported by the parent
            (folder / f"{side}_{case['id']}.err").write_text(f"{type(error).__name__}: {error}")


def _old_forward(cp, weights, pair, mask, case):
    """The older tree's forward with the kernels of `case`'s route forced by its means."""
    from triattn_cupy import _configs, _gpu

    name, table = case["old"]
    (engine, variant, slot_rows), _, ffma_projections = _OLD_MEANS[name]
    d = case["D"] // case["h"]
    if engine == "ffma":
        launch = _configs.attention_ffma_launch(d)
    elif engine == "mma":
        launch = _configs.attention_mma_launch(d, variant, n=case["N"],
                                               compute_capability=80 if table else 90)
    else:
        launch = _configs.attention_wgmma_launch(d, variant=variant, slot_rows=slot_rows)
    saved = _configs.project_uses_tensor_cores
    if ffma_projections:
        _configs.project_uses_tensor_cores = lambda *args: False
    try:
        dw = _gpu.DeviceWeights(weights, cp.cuda.runtime.getDevice())
        return _gpu.Forward(dw, pair, mask, case["policy"], None, case["precision"],
                            attention=launch).run()
    finally:
        _configs.project_uses_tensor_cores = saved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=pathlib.Path, help="the older tree's folder")
    ap.add_argument("--side", help=argparse.SUPPRESS)    # internal: one side's process
    ap.add_argument("--todo", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.side:
        todo = json.loads(pathlib.Path(args.todo).read_text())
        tree = REPO if args.side == "new" else args.old.resolve()
        run_side(tree, args.side, todo, pathlib.Path(args.folder))
        return 0
    if not args.old:
        ap.error("give --old")
    all_cases = cases()
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        groups = {"new": (all_cases, {}),
                  "old": ([c for c in all_cases if c["old"] is None
                           or not _OLD_MEANS[c["old"][0]][1]], {}),
                  "old_mma_projections": ([c for c in all_cases if c["old"] is not None
                                           and _OLD_MEANS[c["old"][0]][1]],
                                          {"TRIATTN_PROJECT_TILES": "0"})}
        children = []  # the sides at once: their kernel compilations dominate, on the CPU
        for group, (todo, env) in groups.items():
            todo_file = folder / f"{group}.json"
            todo_file.write_text(json.dumps(todo))
            side = "new" if group == "new" else "old"
            children.append(subprocess.Popen(
                [sys.executable, str(HERE), "--side", side, "--todo", str(todo_file),
                 "--folder", str(folder), "--old", str(args.old)],
                env={**os.environ, **env, "PYTHONPATH": ""}))
        if any(child.wait() for child in children):
            raise SystemExit("a side's process failed")
        differ = 0
        for case in all_cases:
            label = (f"{case['name']:22s} {case['precision']:4s} {case['B']}x{case['N']}x"
                     f"{case['D']}x{case['h']} mask={case['masked']!s:5s} {case['policy']:4s}"
                     f"{'' if case['aligned'] else ' unaligned'}")
            results = []
            for side in ("new", "old"):
                err = folder / f"{side}_{case['id']}.err"
                results.append(err.read_text() if err.exists()
                               else np.load(folder / f"{side}_{case['id']}.npy"))
            new, old = results
            if isinstance(new, str) or isinstance(old, str):
                same = isinstance(new, str) and isinstance(old, str)
                print(f"{label}: {'both refuse' if same else 'ERROR'}: new {new if isinstance(new, str) else 'ran'}; "
                      f"old {old if isinstance(old, str) else 'ran'}")
                differ += not same
                continue
            if new.shape == old.shape and np.array_equal(new.view(np.uint32), old.view(np.uint32)):
                print(f"{label}: bit-identical")
                continue
            differ += 1
            diff = np.nanmax(np.abs(new.astype(np.float64) - old)) if new.shape == old.shape else "shapes"
            print(f"{label}: DIFFERS, max abs difference {diff}")
    print(f"{len(all_cases) - differ} of {len(all_cases)} cases bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
