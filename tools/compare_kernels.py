"""Whether every kernel configuration compiles to the same machine code in this tree as in an older one (offline, NVRTC).

    python tools/compare_kernels.py --old OLD_TREE      (e.g. a `git archive REV` unpacked)
    python tools/compare_kernels.py --rev REV           (archived here from this repository)

Each tree lists its own kernel configurations (gpu/kernel_catalog.py's `all_configs` for sm_80
and sm_90) with their full source text, in a process of its own. Both are compiled here
with the same NVRTC options the run-time loader uses, and each kernel's machine code (the
ELF section `.text.<entry>`, with its register count and flags) is compared byte for byte.
Configurations are paired by their file and #defines, less the defines whose value is the
kernels' default or that a kernel no longer reads (DEFAULTS). Symbol names are the only
thing ignored. The older tree is one from the layouts' redesign on (85b05f1 and later): its
kernel files and entry points have the names they have here.

With --variants, the configurations each feature adds (kernel_catalog's OUT_TRANSPOSED,
16-bit pair, ROW_MASK and ROW_BLOCK / BIAS_ONLY lists) are compared too. With --cache DIR,
each compiled source is kept under DIR by the hash of its text, target and options, so a
tree compared again compiles only what changed. With --quick, each variant (file, target
and defines other than the tile shape and head dim) keeps only its first and last
configuration: a fast check while editing, before the full comparison.

Prints "N of N configurations identical", the configurations only in the old tree
(dropped routes) and any only here; exit status 1 if any kernel differs or a
configuration exists only here.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import pathlib
import struct
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ProcessPoolExecutor

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parent.parent

# Defines whose value is the kernel's own default, or which it no longer reads (dropped from
# either side's key)
DEFAULTS = {("PINGPONG", 0), ("BULK", 1)}
ARCHS = ("sm_80", "sm_90")
OPTIONS = ("-std=c++17", "-ftz=true")  # what the run-time loader passes (gpu/compile.py)


def list_configs(root: pathlib.Path, variants: bool = False):
    """[{arch, file, defines, target, source}] of the tree at `root` (run in a process of
    its own, with `root` first on sys.path); with `variants`, each feature's too."""
    sys.path.insert(0, str(root))
    from triattn_cupy.gpu import compile as compiler
    from triattn_cupy.gpu import kernel_catalog as catalog

    def configs_of(arch):
        configs = set(catalog.all_configs(arch))
        if variants:
            configs.update(catalog.transposed_out_configs(arch))
            configs.update(catalog.pair_dtype_configs(arch))
            configs.update(catalog.row_masked_configs(arch, every=True))
            configs.update(catalog.row_blocked_configs(arch))
        return sorted(configs, key=lambda c: (c.filename, c.defines, c.arch))
    # The kernel sources of that tree (a package installed elsewhere must not serve them)
    compiler._kernels_folder = lambda: root / "kernels"
    compiler.kernel_source.cache_clear()
    out = []
    for arch in ARCHS:
        for config in configs_of(arch):
            out.append({"arch": arch, "file": config.filename,
                        "defines": [list(d) for d in config.defines],
                        "target": config.arch or arch,
                        "source": compiler.full_source(config.filename, config.defines)})
    return out


# Defines that size a configuration rather than choose its code path (--quick)
SHAPE = {"HEAD_DIM", "HEADS", "PAIR_DIM", "BM", "BQ", "BK", "MT", "ROWS", "PAD", "STAGES",
         "WSTAGES", "BIAS_STAGES", "MIN_BLOCKS", "PROJECT_MIN_BLOCKS", "PREFETCH", "PV_GROUPS"}


def quick_keys(keyed: dict) -> list:
    """The first and last configuration of each variant among `keyed`'s keys."""
    variants: dict = {}
    for key, entry in sorted(keyed.items()):
        variant = (entry["arch"], entry["file"],
                   tuple(d for d in map(tuple, entry["defines"]) if d[0] not in SHAPE))
        variants.setdefault(variant, []).append(key)
    return sorted({k for keys in variants.values() for k in (keys[0], keys[-1])})


def normalized_key(entry) -> str:
    defines = {name: value for name, value in entry["defines"]
               if (name, value) not in DEFAULTS}
    return f"{entry['arch']} {entry['file']} {json.dumps(sorted(defines.items()))}"


def _elf_kernels(cubin: bytes) -> dict:
    """{entry: sha256 of its .text section's bytes, flags and info (registers)}."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
               for i in range(shnum)]
    strtab = headers[shstrndx]
    names = cubin[strtab[4]:strtab[4] + strtab[5]]

    def name_of(h):
        end = names.index(b"\0", h[0])
        return names[h[0]:end].decode()

    kernels = {}
    for h in headers:
        name = name_of(h)
        if name.startswith(".text."):
            body = cubin[h[4]:h[4] + h[5]]
            digest = hashlib.sha256(body + struct.pack("<QI", h[2], h[7])).hexdigest()
            kernels[name[len(".text."):]] = digest
    return kernels


def compile_entry(entry, cache: pathlib.Path | None = None) -> dict:
    from cupy_backends.cuda.libs import nvrtc

    if cache is not None:
        key = hashlib.sha256(json.dumps([entry["source"], entry["target"], OPTIONS,
                                         nvrtc.getVersion()]).encode()).hexdigest()
        kept = cache / f"{key}.json"
        if kept.is_file():
            return json.loads(kept.read_text())
        kernels = compile_entry(entry)
        partial = cache / f"{key}.{os.getpid()}.tmp"
        partial.write_text(json.dumps(kernels))
        os.replace(partial, kept)  # whole or absent, when several comparisons share DIR
        return kernels
    program = nvrtc.createProgram(entry["source"], entry["file"], [], [])
    try:
        nvrtc.compileProgram(program, [f"-arch={entry['target']}", *OPTIONS])
        return _elf_kernels(nvrtc.getCUBIN(program))
    except nvrtc.NVRTCError:
        return {"<compile error>": nvrtc.getProgramLog(program)}
    finally:
        nvrtc.destroyProgram(program)


def tree_configs(root: pathlib.Path, variants: bool):
    out = subprocess.run([sys.executable, str(HERE), "--list", str(root)]
                         + ["--variants"] * variants, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    side = ap.add_mutually_exclusive_group()
    side.add_argument("--old", type=pathlib.Path, help="the older tree's folder")
    side.add_argument("--rev", help="a git revision of this repository (archived to a temporary folder)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--files", nargs="*", help="compare only these kernel files (this tree's names)")
    ap.add_argument("--variants", action="store_true",
                    help="also each feature's configurations (OUT_TRANSPOSED, 16-bit pair, "
                         "ROW_MASK, ROW_BLOCK, BIAS_ONLY)")
    ap.add_argument("--cache", type=pathlib.Path,
                    help="a folder that keeps each compiled source's result by its hash")
    ap.add_argument("--quick", action="store_true",
                    help="only each variant's first and last configuration")
    ap.add_argument("--list", type=pathlib.Path, help=argparse.SUPPRESS)  # internal
    args = ap.parse_args(argv)
    if args.list:
        json.dump(list_configs(args.list.resolve(), args.variants), sys.stdout)
        return 0
    if not (args.old or args.rev):
        ap.error("give --old or --rev")
    with tempfile.TemporaryDirectory() as tmp:
        old_root = args.old
        if args.rev:
            archive = pathlib.Path(tmp) / "old.tar"
            subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), args.rev],
                           check=True)
            with tarfile.open(archive) as tar:
                tar.extractall(pathlib.Path(tmp) / "old")
            old_root = pathlib.Path(tmp) / "old"
        sides = {side: tree_configs(root.resolve(), args.variants)
                 for side, root in (("old", old_root), ("new", REPO))}
    keyed = {side: {normalized_key(e): e for e in entries}
             for side, entries in sides.items()}
    common = sorted(k for k in set(keyed["old"]) & set(keyed["new"])
                    if not args.files or keyed["new"][k]["file"] in args.files)
    if args.quick:
        common = quick_keys({k: keyed["new"][k] for k in common})
    pairs = [(keyed["old"][k], keyed["new"][k]) for k in common]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        if args.cache:
            args.cache.mkdir(parents=True, exist_ok=True)
        compiled = list(pool.map(functools.partial(compile_entry, cache=args.cache),
                                 [e for pair in pairs for e in pair], chunksize=4))
    identical, differ = 0, []
    for index, key in enumerate(common):
        old, new = compiled[2 * index], compiled[2 * index + 1]
        if old == new and "<compile error>" not in new:
            identical += 1
        else:
            differ.append((key, sorted(set(old) | set(new))))
    only_old = sorted(set(keyed["old"]) - set(keyed["new"]))
    only_new = sorted(set(keyed["new"]) - set(keyed["old"]))
    for key in only_old:
        print(f"only in the old tree (dropped): {key}")
    for key in only_new:
        print(f"only in this tree: {key}")
    for key, kernels in differ:
        print(f"differs: {key} {kernels}")
    print(f"{identical} of {len(common)} configurations identical "
          f"({len(only_old)} only in the old tree, {len(only_new)} only in this one)")
    return 1 if differ or only_new else 0


if __name__ == "__main__":
    sys.exit(main())
