"""Instructions per warp and 64-key tile in the wgmma attention's key loop, by opcode, from
the machine code (offline: NVRTC and nvdisasm, no GPU). The figures in benchmarks/NOTES.md
("~292 -> ~223 instructions per tile", session 12) come from here.

    python3 scripts/sass_loop_count.py [--nvdisasm PATH] [fp32 tf32 bf16 f16s ...]

Each name a precision (its attention kernel on the H200) or a wgmma variant
(_configs.WGMMA_VARIANTS: "f16s", the bf16 mode's S16 option, "f16", ...).

nvdisasm is not in every CUDA install: `pip install nvidia-cuda-nvdisasm` brings one (it is
looked for on PATH, then in that wheel). The count follows one iteration's common path:
a warp other than the producer, a full tile (no keys past N), no rescale of O (the max
did not move past its slack); the branches are taken or not by the rules in walk().
"""
import argparse
import collections
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from triattn_cupy import _compile, _configs  # noqa: E402

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"BRA(?:\.\w+)*\s+`\((\.L_x_\d+)\)")
GROUPS = (("tensor", lambda op: op.startswith(("HGMMA", "WARPGROUP"))),
          ("sync and branch", lambda op: op in ("SYNCS.PHASECHK", "SYNCS.ARRIVE", "WARPSYNC",
                                                "BSSY", "BSYNC", "YIELD", "NOP", "VOTE", "BRA")),
          ("floating point", lambda op: op in ("MUFU.EX2", "FADD", "FFMA", "FMUL", "FMNMX",
                                               "FSEL", "FSETP", "HADD2", "F2FP", "SHFL",
                                               "HFMA2", "HMNMX2", "VHMNMX")),
          ("shared and local memory", lambda op: op in ("LDS", "LDSM", "LDL", "STL")),
          ("integer and moves", lambda op: True))


def find_nvdisasm(given):
    if given:
        return given
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # the pip wheels' namespace package
        for root in nvidia.__path__:
            for path in pathlib.Path(root).glob("cu*/bin/nvdisasm"):
                return str(path)
    except ImportError:
        pass
    sys.exit("nvdisasm not found: pass --nvdisasm, or pip install nvidia-cuda-nvdisasm")


def disassemble(config, nvdisasm):
    cubin = _compile._nvrtc_compile(config.filename, config.defines, config.arch,
                                    _compile._CUPY_OPTIONS)[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        # CuPy's getCUBIN returns the image one byte short of its program headers' end;
        # nvdisasm rejects it unless padded
        path.write_bytes(cubin + b"\0")
        return subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout


def parse(listing):
    """[(address, instruction)] and {label: address}."""
    instructions, labels, pending = [], {}, []
    for line in listing.splitlines():
        if (m := LABEL.match(line.strip())):
            pending.append(m.group(1))
            continue
        if (m := LINE.search(line)):
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            instructions.append((address, m.group(2).strip().lstrip("{").strip()))
    return instructions, labels


def opname(text):
    tokens = text.split()
    op = tokens[1] if tokens[0].startswith("@") else tokens[0]
    parts = op.split(".")
    if parts[0] in ("SYNCS", "WARPGROUP", "HGMMA", "MUFU"):
        return ".".join(parts[:2])
    return parts[0]


def key_loop(instructions, labels):
    """(first, last address) of the innermost backward branch spanning HGMMA and MUFU.EX2."""
    best = None
    for address, text in instructions:
        m = BRANCH.search(text)
        if not m or labels.get(m.group(1), 1 << 62) >= address or "BRA.U" in text:
            continue
        first = labels[m.group(1)]
        body = [t for a, t in instructions if first <= a <= address]
        if (text.startswith("@") and any("HGMMA" in t for t in body)
                and any("MUFU.EX2" in t for t in body)):
            if best is None or address < best[1]:
                best = (first, address)
    if best is None:
        raise RuntimeError("no key loop found (a loop with HGMMA and MUFU.EX2)")
    return best


def walk(instructions, labels):
    """One iteration's common path. Branch rules: divergent-exit branches (BRA.DIV) fall
    through; an unconditional one is taken; after an mbarrier poll (SYNCS.PHASECHK) the
    poll succeeded; the first other conditional one skips the producer's refill; after
    the vote (VOTE.ANY) the rescale is skipped; the next skips the masking of keys past N."""
    first, last = key_loop(instructions, labels)
    index = {a: i for i, (a, _) in enumerate(instructions)}
    i, path, first_conditional, past_vote_or_s = index[first], [], True, False
    while True:
        address, text = instructions[i]
        path.append(text)
        if address == last:
            return path
        m = BRANCH.search(text)
        if m:
            conditional = text.startswith("@")
            recent = " ".join(t for _, t in instructions[max(0, i - 8):i])
            if "BRA.DIV" in text:
                take = False
            elif not conditional:
                take = True
            elif "PHASECHK" in recent:
                take = False
            elif first_conditional:
                take, first_conditional = True, False
            elif "VOTE.ANY" in instructions[i - 1][1]:
                take = True
            elif not past_vote_or_s:
                take, past_vote_or_s = True, True
            else:
                raise RuntimeError(f"a branch the rules do not cover at {address:#x}: {text}")
            if take:
                i = index[labels[m.group(1)]]
                continue
        i += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvdisasm")
    parser.add_argument("precisions", nargs="*", default=["fp32", "tf32", "bf16"],
                        help="precisions or wgmma variants")
    args = parser.parse_args()
    nvdisasm = find_nvdisasm(args.nvdisasm)
    for precision in args.precisions:
        launch = (_configs.attention_kernel(32, precision, 90)
                  if precision in _configs.PRECISIONS
                  else _configs.attention_wgmma_launch(32, variant=precision))
        counts = collections.Counter(opname(t) for t in walk(*parse(
            disassemble(launch.config, nvdisasm))))
        print(f"{precision} ({launch.name}): {sum(counts.values())} instructions per warp "
              f"and tile")
        rest = dict(counts)
        for group, member in GROUPS:
            mine = {op: rest.pop(op) for op in list(rest) if member(op)}
            listed = ", ".join(f"{op} {n}" for op, n in sorted(mine.items(), key=lambda x: -x[1]))
            print(f"  {group} {sum(mine.values())}: {listed}")


if __name__ == "__main__":
    main()
