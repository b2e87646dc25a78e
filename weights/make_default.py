"""Regenerate ``default.h5``: the reference module, pair_dim 128, 4 heads, seed 0.

    python weights/make_default.py [--spec PATH/reference_module.py] [--output PATH.h5]

``torch.manual_seed(0)`` then ``TriangleSelfAttention(128, 4)`` with PyTorch's default
initialisation, exported with `triattn_cupy.export.export_weights`. Needs torch.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
# The spec beside the repository, else a copy inside it (the ignored .shared/ folder).
SPEC_CANDIDATES = (REPO.parent / "shared" / "spec" / "reference_module.py",
                   REPO / ".shared" / "spec" / "reference_module.py")
PAIR_DIM, NUM_HEADS, SEED = 128, 4, 0

logger = logging.getLogger("make_default")


def load_spec(path):
    """Import the reference module file at `path`."""
    spec = importlib.util.spec_from_file_location("reference_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_module(spec_module):
    """The module that default.h5 holds, in eval mode."""
    import torch

    torch.manual_seed(SEED)
    return spec_module.TriangleSelfAttention(PAIR_DIM, NUM_HEADS).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=pathlib.Path,
                        help="reference_module.py (default: the first that exists of "
                             + ", ".join(str(p) for p in SPEC_CANDIDATES) + ")")
    parser.add_argument("--output", type=pathlib.Path, default=HERE / "default.h5",
                        help="the file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    spec_path = args.spec or next((p for p in SPEC_CANDIDATES if p.is_file()), None)
    if spec_path is None or not spec_path.is_file():
        print(f"make_default: error: reference module not found at "
              f"{spec_path or ' or '.join(map(str, SPEC_CANDIDATES))}; pass --spec",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))  # this checkout's triattn_cupy, installed or not
    from triattn_cupy.export import export_weights

    logger.info("reference module: %s", spec_path)
    export_weights(make_module(load_spec(spec_path)), args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
