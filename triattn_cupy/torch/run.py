"""`triattn-run`: a model's own command, run in this process with its blocks on the kernels.

    triattn-run boltz predict input.yaml --out_dir out
    triattn-run --precision bf16 protenix predict --input in.json --out_dir out
    triattn-run --strict run_openfold predict --query_json q.json
    triattn-run -m some.module ARGS          # as python -m
    triattn-run path/to/script.py ARGS       # as python script.py

The command is a console script of this Python environment (found through its entry
points, as pip's launchers find it), a module (-m) or a script; it runs as it would alone
(sys.argv set, its exit status returned), with every triangle attention block routed by
its class (triattn_cupy.torch.routing), however the command builds or loads its model.
At exit, one line on stderr: blocks accelerated, calls through the kernels, calls that
fell back and why.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import runpy
import shutil
import sys

from .._install import pip_install
from ..gpu.checks import PRECISIONS

PROG = "triattn-run"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, usage=f"{PROG} [--precision P] [--strict] (COMMAND | -m MODULE | "
                         f"SCRIPT.py) [ARGS ...]",
        description="Run a model's own command (boltz, protenix, run_openfold, any console "
                    "script, a module or a script) in this process, with every triangle "
                    "attention block of its models on the GPU kernels. Options go before "
                    "the command; everything after it is the command's.",
        epilog="A block call the kernels do not compute runs the block's own forward, warned "
               "once per block and reason (FallbackWarning). At exit, one line on stderr: "
               "blocks accelerated, calls through the kernels, calls that fell back and why. "
               "The exit status is the command's (1 after a strict failure, 2 for usage).")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="the kernels' arithmetic (default fp32)")
    parser.add_argument("--strict", action="store_true",
                        help="fail (FallbackError) where a block would run its original "
                             "forward instead of the kernels")
    parser.add_argument("-m", dest="module", metavar="MODULE",
                        help="run a module as `python -m MODULE` does")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the console script or script and its arguments")
    return parser


def _split(argv: list) -> tuple:
    """(this tool's options, the command and its arguments): the command starts at the
    first argument that is not an option of ours, or after ``-m MODULE`` or ``--``
    (argparse alone would read the command's own options as ours)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1:]
        if arg == "-m" or arg == "--precision":
            i += 2
            if arg == "-m":
                return argv[:i], argv[i:]
            continue
        if arg.startswith("-m") and not arg.startswith("--"):  # -mMODULE
            return argv[:i + 1], argv[i + 1:]
        if not arg.startswith("-"):
            return argv[:i], argv[i:]
        i += 1
    return argv, []


def _console_script(name: str):
    for entry in importlib.metadata.entry_points(group="console_scripts"):
        if entry.name == name:
            return entry
    return None


def _target(parser, args):
    """(what runs, as a callable returning the exit status)."""
    if args.module:
        argv = [args.module, *args.command]

        def run_module():
            sys.argv = argv  # runpy puts the module's file first, as python -m does
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
            return 0
        return run_module
    if not args.command:
        parser.error("give the command to run (a console script, -m MODULE or a script)")
    name, rest = args.command[0], args.command[1:]
    if name.endswith(".py") or os.sep in name:
        if not os.path.isfile(name):
            parser.error(f"script {name!r} is not a file")

        def run_script():
            sys.argv = [name, *rest]
            sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
            runpy.run_path(name, run_name="__main__")
            return 0
        return run_script
    entry = _console_script(name)
    if entry is None:
        parser.error(f"no console script named {name!r} in this Python environment "
                     f"({sys.prefix}); install the model's package here, or give a module "
                     f"with -m or a script's path")

    def run_console_script():
        main = entry.load()
        sys.argv = [shutil.which(name) or name, *rest]
        return main()  # what a console script's launcher passes to sys.exit
    return run_console_script


def main(argv=None):
    parser = _parser()
    ours, command = _split(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(ours)
    args.command = command
    run = _target(parser, args)
    try:
        import triattn_cupy.torch as tt
    except ImportError as error:
        parser.exit(2, f"{PROG}: error: {error} (triattn_cupy.torch needs PyTorch: "
                       f"{pip_install('torch')})\n")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    tt.enable(precision=args.precision, strict=args.strict)
    try:
        return run()
    except SystemExit as exit_:
        return exit_.code
    except tt.FallbackError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    finally:
        report = tt.report()
        tt.disable()
        sys.argv, sys.path[:] = saved_argv, saved_path
        print(f"{PROG}: {report}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
