"""Which kernels a change touches, offline (no GPU): every kernel of every configuration
(`_configs.all_configs`, NVRTC for sm_80 and sm_90) disassembled in the working tree and at
a git revision, and compared instruction by instruction (nvdisasm; addresses dropped and
branch labels renumbered, so that code moved by an unrelated kernel still compares equal).

A kernel whose machine code equals the revision's runs exactly what ran there: where the
revision passed the GPU suite, so does this kernel. Session 15 used this (by hand) to land
a change whose every kernel matched a tested one, when no device time was left.

    python3 scripts/compare_kernels.py REV [--nvdisasm PATH]

Prints the kernels that differ and those on one side only; exit status 1 if any differ.
"""
import argparse
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve()
SECTION = re.compile(r"^\s*\.text\.(\w+):\s*$", re.MULTILINE)
ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
LABEL = re.compile(r"\.L_x_\d+")


def normalized(listing):
    """{kernel: sha256 of its instructions}, addresses dropped, labels renumbered."""
    parts = SECTION.split(listing)
    kernels = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        numbers = {}
        body = LABEL.sub(lambda m: numbers.setdefault(m.group(0), f"L{len(numbers)}"),
                         ADDRESS.sub("", body))
        kernels[name] = hashlib.sha256(body.encode()).hexdigest()
    return kernels


def dump(root, nvdisasm):
    """{"arch file defines target": {kernel: hash}} of the package under `root` (run in a
    process of its own: the package imported is that tree's)."""
    sys.path.insert(0, str(root))
    from triattn_cupy import _compile, _configs  # noqa: E402 (the tree under root)

    # The kernels of that tree too: an editable install maps triattn_cupy.kernels to its
    # own checkout whatever sys.path says, which would compile one tree's kernels twice.
    _compile._kernels_folder = lambda: root / "kernels"
    _compile.kernel_source.cache_clear()

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        for arch in ("sm_80", "sm_90"):
            for config in _configs.all_configs(arch):
                target = config.arch or arch
                # built as the run-time loader builds it (CuPy's options), from its cache
                cubin = _compile._cubin_file(config.filename, config.defines, target)
                path.write_bytes(cubin.read_bytes() + b"\0")  # (one byte short: sass_loop_count.py)
                listing = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True,
                                         text=True, check=True).stdout
                key = f"{arch} {config.filename} {dict(config.defines)} {target}"
                result[key] = normalized(listing)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", nargs="?", help="git revision to compare the working tree with")
    ap.add_argument("--nvdisasm", help="nvdisasm to use (default: PATH, then the pip wheel)")
    ap.add_argument("--dump", help=argparse.SUPPRESS)  # internal: write one tree's hashes
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dump:  # (the parent names nvdisasm: sass_loop_count would import this tree's package)
        pathlib.Path(args.dump).write_text(json.dumps(dump(pathlib.Path(args.root),
                                                           args.nvdisasm)))
        return 0
    sys.path.insert(0, str(HERE.parent))
    from sass_loop_count import find_nvdisasm

    nvdisasm = find_nvdisasm(args.nvdisasm)
    if not args.rev:
        ap.error("name a git revision")
    repo = HERE.parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(tree),
                        args.rev], check=True)
        try:
            sides = {}
            for name, root in (("here", repo), (args.rev, tree)):
                out = pathlib.Path(tmp) / f"{name}.json"
                subprocess.run([sys.executable, str(HERE), "--dump", str(out), "--root",
                                str(root), "--nvdisasm", nvdisasm], check=True)
                sides[name] = json.loads(out.read_text())
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                           check=True)
    here, there = sides["here"], sides[args.rev]
    differ = 0
    for key in sorted(set(here) | set(there)):
        if key not in there or key not in here:
            differ += 1
            print(f"only {'here' if key in here else 'at ' + args.rev}: {key}")
            continue
        for kernel in sorted(set(here[key]) | set(there[key])):
            if here[key].get(kernel) != there[key].get(kernel):
                differ += 1
                print(f"differs: {kernel} in {key}")
    print(f"{differ} kernels differ from {args.rev}; {len(here)} configurations here, "
          f"{len(there)} there")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
