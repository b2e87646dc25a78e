"""`triattn-infer`: triangle self-attention over saved pair representations.

    triattn-infer INPUT... --output-dir OUT --weights W.h5 [--recursive] [--devices 0,1]
    triattn-infer --demo

Each input file (.npy, .npz, .h5/.hdf5 holding a pair (N, N, D) or (B, N, N, D) and, except
.npy, an optional mask) gives one output file under OUT at the same relative path: HDF5
with the dataset ``out`` and attributes that record how it was made, or a plain .npy.
This module holds the command line; `pipeline` the batch job, `io` the files, `backends`
the devices, `demo` the quick start.

Exit status (also in `--help`): 0 every file computed or skipped, 1 some file failed or
was a conflict, or no input was found, 2 usage or setup error, 130 interrupted (Ctrl-C or
SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from .._version import __version__
from .backends import SetupError, parse_devices, precision_support
from .claims import DEFAULT_TIMEOUT
from .cluster import add_cluster_arguments, run_on_cluster, wants_cluster
from .pipeline import EXIT_INTERRUPTED, EXIT_USAGE, logger, run
from .report import tqdm_or_none


def _devices_arg(text: str):
    if text.strip().lower() == "all":
        return "all"
    try:
        return parse_devices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(unit: str):
    """An argparse type: a finite number above 0, of `unit` (named in the error)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"expected a positive number of {unit}, got {text!r}")
        return value
    return parse


def build_parser(prog: str = "triattn-infer") -> argparse.ArgumentParser:
    precisions, _ = precision_support()
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Triangle self-attention (AlphaFold-style pair attention) over saved pair\n"
            "representations.\n\n"
            "Each INPUT is a file or a folder of files: .npy (the pair array alone), .npz or\n"
            ".h5/.hdf5 (a pair array and an optional mask). A pair is (N, N, D) or\n"
            "(B, N, N, D), float16, float32 or float64 (float16 gives a float16 output); N\n"
            "may differ between files. Each input gives\n"
            "one output at the same relative path under --output-dir. Other files in a\n"
            "folder, and special files (FIFOs, sockets, devices), are skipped and listed in\n"
            "the summary. An HDF5 input must hold its data itself (no external links,\n"
            "external storage or virtual datasets)."),
        epilog=(
            "outputs are written to a temporary file and renamed into place when complete:\n"
            "an interrupted or killed run never leaves a half-written output, and running\n"
            "the same command again skips the finished ones (resume) and removes temporary\n"
            "files whose writer has ended. Ctrl-C or SIGTERM finishes the file in hand and\n"
            "stops; a second one stops at once. A file that cannot be used is reported and\n"
            "the run goes on. A file at an output path that this tool did not write or\n"
            "cannot read (for .npy: one without its <name>.npy.json record, or changed\n"
            "since) is a conflict: reported, left untouched, and the exit status is 1.\n\n"
            "several runs (processes, or hosts sharing the filesystem) may work on the same\n"
            "inputs and output folder at once: each output is claimed before it is computed,\n"
            "so every file is computed by one of them (see --claim-timeout). Something at\n"
            "a claim's name that no run can judge (a folder, a claim dated in the future)\n"
            "is a conflict.\n\n"
            "exit status: 0 every file computed or skipped (done already, claimed by another\n"
            "run, or not an input); 1 some file failed or was a conflict, or no input was\n"
            "found; 2 usage or setup error (bad flags, no --weights, unusable weights, no\n"
            "device); 130 interrupted (Ctrl-C or SIGTERM).\n\n"
            "quick check of the installation:  triattn-infer --demo"))
    add = parser.add_argument
    add("inputs", nargs="*", metavar="INPUT",
        help="input files (.npy, .npz, .h5, .hdf5) and/or folders of them")
    add("-o", "--output-dir", metavar="DIR",
        help="folder for the outputs, mirroring the inputs' relative paths; created if "
             "needed (required, except with --demo)")
    add("-r", "--recursive", action="store_true",
        help="also take input files from the sub-folders of INPUT folders; links to files "
             "and folders are followed wherever they point, each real file and folder "
             "once; hidden files, broken links and cycles are left out and listed")
    add("--pair-key", default="pair", metavar="NAME",
        help="name of the pair array in .npz and .h5 inputs (default: %(default)s)")
    add("--mask-key", default=None, metavar="NAME",
        help="name of the mask (B, N, N) or (N, N) in .npz and .h5 inputs, 0 = masked. "
             "Without this flag the mask 'mask' is optional (a file without it is "
             "computed unmasked); a NAME given here must be in every input, and a file "
             "without it (or a .npy) fails")
    add("--weights", metavar="PATH",
        help="HDF5 weights file (triattn-export writes one from PyTorch); its pair_dim "
             "must match the inputs' D. Required, except with --demo, which uses the "
             "shipped randomly initialised weights (pair_dim 128, 4 heads)")
    add("--fully-masked", choices=("zero", "nan"), default="zero",
        help="output of a query whose keys are all masked: 'zero' attention (the output "
             "is out_proj.bias) or 'nan' as the PyTorch reference (default: %(default)s)")
    if precisions:
        add("--precision", choices=precisions, default=None,
            help="arithmetic of the GPU kernels; inputs and outputs stay float32 "
                 f"(default: {precisions[0]})")
    add("--max-scratch-gib", type=_positive("GiB"), default=None, metavar="GIB",
        help="GPU: working memory per forward in GiB beyond the input, which is computed in "
             "place; an input needing more runs in blocks of pair rows, with the same result "
             "(default: max(input / 2, 256 MiB, GPU memory / 16), within the free memory)")
    add("--output-format", choices=("hdf5", "npy"), default="hdf5",
        help="hdf5: <name>.h5 with dataset 'out' and attributes recording the input, the "
             "weights and their SHA-256, the version and the options; npy: <name>.npy, the "
             "plain float32 array, with the same record and the array's SHA-256 in "
             "<name>.npy.json (default: %(default)s)")
    add("--overwrite", action="store_true",
        help="recompute outputs that exist already (default: skip them, so a run that was "
             "interrupted resumes where it stopped)")
    add("--claim-timeout", type=_positive("seconds"), default=DEFAULT_TIMEOUT, metavar="S",
        help="runs sharing an output folder split the files: each output is claimed "
             "(a hidden .<name>.claim file) before it is computed. A claim of a process "
             "that has ended on this host is taken over at once; one from another host "
             "when it has not been refreshed for S seconds (refreshed every S/10 while "
             "its run lives; default: %(default)g)")
    add("--device", choices=("auto", "gpu", "cpu"), default="auto",
        help="auto: the GPU when one is usable, else the CPU (said in one log line); "
             "gpu: fail if there is none; cpu: the NumPy backend (default: %(default)s)")
    add("--devices", type=_devices_arg, metavar="LIST",
        help="GPUs to spread the files over, one worker each: comma-separated indices "
             "such as 0,1,2,3, or 'all' (default: 0)")
    add("-q", "--quiet", action="store_true",
        help="no progress bar and no summary: only warnings and errors")
    add("-v", "--verbose", action="store_true", help="also log each file as it is done")
    add("--demo", action="store_true",
        help="generate a few small inputs in a temporary folder, run them with the default "
             "weights, check one against the float64 NumPy reference and print the error "
             "and the throughput")
    add("--version", action="version", version=f"%(prog)s (triattn-cupy) {__version__}")
    add_cluster_arguments(parser)
    return parser


def main(argv=None, *, prog: str = "triattn-infer") -> int:
    """Entry point of `triattn-infer` and `python -m triattn_cupy`; returns the exit
    status (see the module docstring)."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    with _logging_for(args):
        try:
            if args.demo:
                from .demo import run_demo
                return run_demo(args)
            if not args.inputs:
                parser.print_usage(sys.stderr)
                logger.error("no INPUT given (files or folders of .npy, .npz, .h5); "
                             "try --demo for a first run")
                return EXIT_USAGE
            if not args.output_dir:
                parser.print_usage(sys.stderr)
                logger.error("--output-dir is required")
                return EXIT_USAGE
            if not args.weights:
                parser.print_usage(sys.stderr)
                logger.error("--weights is required: the shipped default weights are a "
                             "randomly initialised module, for --demo only")
                return EXIT_USAGE
            if wants_cluster(args):
                return run_on_cluster(args).exit_code
            return run(args).exit_code
        except SetupError as exc:
            logger.error("%s", exc)
            return EXIT_USAGE
        except KeyboardInterrupt:
            logger.error("interrupted")
            return EXIT_INTERRUPTED


# --- logging --------------------------------------------------------------------------------

class _Formatter(logging.Formatter):
    def format(self, record):
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            text = "error: " + text
        elif record.levelno >= logging.WARNING:
            text = "warning: " + text
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return "triattn-infer: " + text


class _Handler(logging.Handler):
    """To stderr, through tqdm.write when tqdm is there so the bar stays intact."""

    def emit(self, record):
        try:
            text = self.format(record)
            tqdm = tqdm_or_none()
            if tqdm is not None:
                tqdm.write(text, file=sys.stderr)
            else:
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _logging_for(args):
    package_logger = logging.getLogger("triattn_cupy")
    handler = _Handler()
    handler.setFormatter(_Formatter())
    old_level = package_logger.level
    package_logger.setLevel(logging.WARNING if args.quiet
                            else logging.DEBUG if args.verbose else logging.INFO)
    package_logger.addHandler(handler)
    try:
        yield
    finally:
        package_logger.removeHandler(handler)
        package_logger.setLevel(old_level)
