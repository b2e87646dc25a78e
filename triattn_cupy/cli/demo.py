"""`triattn-infer --demo`: the quick start. Generates a few inputs of mixed sizes and
formats, runs them through the same pipeline as a real run (default weights, the GPU when
there is one), checks one output against the float64 NumPy reference and prints what it
did, the error and the throughput. Exit status 0 when the error is within the tolerance of
the precision used."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile

import numpy as np

from .. import reference
from . import pipeline
from .outputs import OUTPUT_DATASET
from .report import si

# Relative L2 error against float64 allowed per precision mode (the GPU pipeline's
# contract); the CPU backend computes in float32 and meets the fp32 bound.
TOLERANCES = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}
CHECKED = "b2_n16_masked"  # the input checked against the reference


def make_demo_inputs(folder: str, pair_dim: int, seed: int = 0) -> list[tuple[str, str]]:
    """Write the demo inputs into `folder`; [(file name, description)].

    Sizes miss every power of two and differ per file; the formats cover .npy, .npz and
    HDF5, float32 and float64, no mask, a bool mask with a fully-masked query row
    (padding), and an int8 mask.
    """
    import h5py

    rng = np.random.default_rng(seed)
    D = pair_dim

    def pair(*shape):
        return rng.standard_normal(shape + (D,))

    files = []
    x = pair(24, 24).astype(np.float32)
    np.save(os.path.join(folder, "n24.npy"), x)
    files.append(("n24.npy", f"pair {x.shape} float32"))

    x = pair(37, 37)  # float64 on disk: converted to float32 once, when read
    with h5py.File(os.path.join(folder, "n37.h5"), "w") as f:
        f["pair"] = x
    files.append(("n37.h5", f"pair {x.shape} float64, no mask"))

    # Batch of 2 with padding: element 1 holds 13 real positions of 16, so its queries
    # 13..15 have every key masked (fully-masked rows); element 0 has random holes.
    x = pair(2, 16, 16).astype(np.float32)
    mask = np.ones((2, 16, 16), bool)
    mask[0] = rng.random((16, 16)) > 0.1
    valid = np.arange(16) < 13
    mask[1] = valid[:, None] & valid[None, :]
    np.savez(os.path.join(folder, f"{CHECKED}.npz"), pair=x, mask=mask)
    files.append((f"{CHECKED}.npz", f"pair {x.shape} float32, bool mask with "
                                    f"fully-masked query rows"))

    x = pair(45, 45).astype(np.float32)
    mask = (rng.random((45, 45)) > 0.2).astype(np.int8)
    with h5py.File(os.path.join(folder, "n45_masked.hdf5"), "w") as f:
        f["pair"] = x
        f["mask"] = mask
    files.append(("n45_masked.hdf5", f"pair {x.shape} float32, int8 mask"))
    return files


def rel_l2_error(actual, expected) -> float:
    """Relative L2 error in float64 over the finite positions of `expected`; inf when
    the NaN positions differ or `actual` has a NaN or Inf where `expected` is finite."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return math.inf
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(actual)):
        return math.inf
    den = np.linalg.norm(expected[finite])
    num = np.linalg.norm(actual[finite] - expected[finite])
    return float(num / den) if den else (0.0 if num == 0 else math.inf)


def run_demo(args) -> int:
    if args.inputs:
        pipeline.logger.error("--demo makes its own inputs; drop the INPUT arguments")
        return pipeline.EXIT_USAGE
    out = sys.stdout
    precision = getattr(args, "precision", None) or "fp32"
    tolerance = TOLERANCES.get(precision, 1e-5)
    with contextlib.ExitStack() as stack:
        weights, weights_path, sha = pipeline.load_weights(args.weights, stack)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="triattn-demo-"))
        in_dir = os.path.join(tmp, "inputs")
        os.makedirs(in_dir)
        files = make_demo_inputs(in_dir, weights.pair_dim)
        out_dir = os.path.abspath(args.output_dir) if args.output_dir else os.path.join(
            tmp, "outputs")

        run_args = argparse.Namespace(**vars(args))
        run_args.inputs = [in_dir]
        run_args.output_dir = out_dir
        run_args.overwrite = True  # fresh inputs every time
        run_args.recursive = False

        print("triattn-infer demo: triangle self-attention on generated pair "
              "representations\n", file=out)
        print(f"  weights  {weights_path}", file=out)
        print(f"           pair_dim {weights.pair_dim}, {weights.num_heads} heads, "
              f"sha256 {sha[:16]}...", file=out)
        print(f"  inputs   {len(files)} files in {in_dir}", file=out)
        width = max(len(name) for name, _ in files)
        for name, what in files:
            print(f"           {name:<{width}}  {what}", file=out)
        out.flush()

        result = pipeline.run(run_args, summary=False)
        done = result.count("done")
        devices = ", ".join(result.devices) or "(none)"
        print(f"  device   {devices}" + (f", precision {precision}"
                                         if result.devices and "GPU" in devices else ""),
              file=out)
        keep = "" if args.output_dir else "; deleted at exit, keep them with --output-dir"
        print(f"  outputs  {out_dir}  (HDF5, dataset {OUTPUT_DATASET!r}{keep})"
              if args.output_format == "hdf5" else f"  outputs  {out_dir}  (.npy{keep})",
              file=out)
        if done:
            rate = result.positions / max(result.seconds, 1e-9)
            print(f"  ran      {done} of {len(files)} files, {result.positions:,} pair "
                  f"positions in {result.seconds:.3f} s: {si(rate)} pair "
                  f"positions/s", file=out)
            print("           (tiny inputs, so per-file overhead dominates; the "
                  "benchmarks measure speed)", file=out)
        if result.count("failed") or done < len(files):
            print(f"\nDemo FAILED: {len(files) - done} of {len(files)} files were not "
                  f"computed (the errors are above).", file=out)
            return pipeline.EXIT_FAILED

        # The check: the output file read back, against float64 NumPy on the same input.
        with np.load(os.path.join(in_dir, f"{CHECKED}.npz")) as z:
            pair, mask = z["pair"], z["mask"]
        suffix = ".h5" if args.output_format == "hdf5" else ".npy"
        got = _read_output(os.path.join(out_dir, CHECKED + suffix))
        expected = reference.triangle_attention(pair, mask, weights,
                                                fully_masked=args.fully_masked,
                                                dtype=np.float64)
        error = rel_l2_error(got, expected)
        ok = error <= tolerance
        print(f"  check    {CHECKED}{suffix} against the float64 NumPy reference:", file=out)
        print(f"           relative L2 error {error:.2e} (tolerance {tolerance:.0e} for "
              f"{precision}): {'OK' if ok else 'TOO LARGE'}", file=out)
        if not ok:
            print("\nDemo FAILED: the output does not match the reference.", file=out)
            return pipeline.EXIT_FAILED
        print("\nDemo passed. Run it on your own files and weights (triattn-export writes "
              "them from PyTorch) with:\n"
              "  triattn-infer INPUT_FOLDER --output-dir OUTPUT_FOLDER --weights WEIGHTS.h5\n"
              "(triattn-infer --help lists the options)", file=out)
        return pipeline.EXIT_OK


def _read_output(path):
    if path.endswith(".npy"):
        return np.load(path)
    import h5py
    with h5py.File(path, "r") as f:
        return f[OUTPUT_DATASET][()]
