"""PyTorch -> HDF5: `export_weights` and the ``triattn-export`` command.

`export_weights` writes a reference-module instance or its state_dict. The command reads
any checkpoint `triattn_cupy.importing` reads (the reference's names, OpenFold's, OpenFold3's,
Boltz's, Protenix's) and exports one block (``--prefix``), lists them (``--list``) or exports
every one (``--all DIR``). PyTorch is imported only when an export runs, so the package
imports without it; install it with ``pip install "triattn-cupy[export]"`` (``pip install ".[export]"``
from a source checkout).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from collections.abc import Mapping

import numpy as np

from . import importing
from ._install import pip_install
from .conventions import NODES
from .hdf5 import save_weights
from .weights import Weights

logger = logging.getLogger(__name__)

_PREFIX = "module."  # added by torch.nn.DataParallel / DistributedDataParallel


def _import_torch():
    try:
        import torch
    except ImportError as err:
        raise ImportError(
            f"exporting from PyTorch needs torch, which is not installed; "
            f"install it with: {pip_install('export')}") from err
    return torch


def export_weights(module_or_state_dict, path, num_heads=None,
                   layer_norm_eps=None) -> Weights:
    """Write the parameters of a reference-module instance to an HDF5 weights file.

    module_or_state_dict: a ``torch.nn.Module`` shaped like the reference module, or its
    state_dict (a mapping of names to tensors; a leading ``module.`` on every key is
    stripped). num_heads: taken from ``module.num_heads``, else inferred from
    ``bias_proj.weight`` (shape (h, D)); if given it must agree. The head width is
    ``query.weight``'s rows / num_heads (D / h for the spec's module). layer_norm_eps: taken from
    ``module.layer_norm.eps``, else 1e-5; if given for a module it must agree.
    Parameters are rounded to float32. Returns the `Weights` that were written.
    """
    torch = _import_torch()
    if isinstance(module_or_state_dict, torch.nn.Module):
        module = module_or_state_dict
        state_dict = module.state_dict()
        num_heads = _agree("num_heads", num_heads, getattr(module, "num_heads", None),
                           "module.num_heads")
        eps = getattr(getattr(module, "layer_norm", None), "eps", None)
        layer_norm_eps = _agree("layer_norm_eps", layer_norm_eps, eps, "module.layer_norm.eps")
    elif isinstance(module_or_state_dict, Mapping):
        state_dict = module_or_state_dict
    else:
        raise TypeError(f"module_or_state_dict must be a torch.nn.Module or a state_dict "
                        f"mapping, got {type(module_or_state_dict).__name__}")

    keys = list(state_dict)
    if keys and all(isinstance(k, str) and k.startswith(_PREFIX) for k in keys):
        state_dict = {k[len(_PREFIX):]: v for k, v in state_dict.items()}
    # Copies: the Weights must not change when the module is trained further.
    params = {name: importing._to_float32(torch.as_tensor(value), f"state_dict[{name!r}]")
              for name, value in state_dict.items()}

    if "bias_proj.weight" in params and params["bias_proj.weight"].ndim == 2:
        num_heads = _agree("num_heads", num_heads, params["bias_proj.weight"].shape[0],
                           "bias_proj.weight.shape[0]")
    elif num_heads is None:
        raise ValueError("cannot infer num_heads: the state_dict has no 2-D "
                         "'bias_proj.weight' of shape (num_heads, pair_dim)")
    if "layer_norm.weight" not in params or params["layer_norm.weight"].ndim != 1:
        raise ValueError("cannot infer pair_dim: the state_dict has no 1-D "
                         "'layer_norm.weight' of shape (pair_dim,)")
    pair_dim = params["layer_norm.weight"].shape[0]
    if layer_norm_eps is None:
        layer_norm_eps = 1e-5  # torch.nn.LayerNorm's default
    if not (math.isfinite(layer_norm_eps) and layer_norm_eps > 0):
        raise ValueError(f"layer_norm_eps must be a positive finite number, got {layer_norm_eps}")

    weights = Weights(pair_dim, num_heads, layer_norm_eps, params,
                      head_dim=_head_dim(params.get("query.weight"), num_heads))
    save_weights(weights, path)
    logger.info("wrote %s: pair_dim %d, num_heads %d, head width %d, layer_norm_eps %g, "
                "%d parameters", path, pair_dim, num_heads, weights.head_dim, layer_norm_eps,
                sum(np.size(v) for v in weights.params.values()))
    return weights


def _head_dim(query_weight, num_heads: int):
    """The head width a (h x c, D) query weight gives; None where it gives none (Weights
    then names the shape that is wrong)."""
    if query_weight is None or query_weight.ndim != 2 or query_weight.shape[0] % num_heads:
        return None
    return query_weight.shape[0] // num_heads or None


def _agree(arg: str, given, found, source: str):
    """`given` if `found` is None, else `found`, checking that they agree."""
    if found is None:
        return given
    if given is not None and given != found:
        raise ValueError(f"{arg}={given} disagrees with {source} = {found}")
    return found


# --- the triattn-export command ---------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


_BIAS_LETTERS = {"query": "q", "key": "k", "value": "v", "gate": "g", "out_proj": "o"}


def format_blocks(blocks) -> str:
    """The ``--list`` table: one line per block, a note under each that cannot be exported."""
    header = ("prefix", "family", "D", "heads", "head width", "node", "biases")
    rows = []
    for b in blocks:
        node = b.node or (f"{b.family.default_node} (default)" if b.family.default_node
                          else "? (--node)")
        rows.append(((b.prefix or "(root)"), b.family.name, str(b.pair_dim), str(b.num_heads),
                     str(b.head_width or "?"), node,
                     ",".join(_BIAS_LETTERS[n] for n in b.biases) or "none"))
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    lines = ["  ".join(text.ljust(w) for text, w in zip(header, widths)).rstrip()]
    for b, row in zip(blocks, rows):
        lines.append("  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip())
        if b.problem:
            lines.append(f"    cannot be exported: {b.problem}")
    lines.append(f"{len(blocks)} triangle attention block{'s' if len(blocks) != 1 else ''}; "
                 f"biases: those the checkpoint holds (q, k, v, g, o: query, key, value, gate, "
                 f"output projection); absent ones are zeros")
    return "\n".join(lines)


def block_file_name(prefix: str) -> str:
    """``pairformer_module.layers.3.tri_att_start.`` -> ``pairformer_module.layers.3.
    tri_att_start.h5`` (characters other than letters, digits, ``._-`` become ``_``)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", prefix.rstrip(".")) or "triangle_attention"
    return stem + ".h5"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triattn-export",
        description="Convert the triangle attention blocks of a PyTorch checkpoint (the "
                    "reference module's state_dict, or a model's: OpenFold, OpenFold3, Boltz, "
                    "Protenix) into triattn-cupy HDF5 weights files (format version 1) that "
                    "record each block's mask layout and node.",
        epilog="examples: triattn-export model.ckpt --list; "
               "triattn-export model.ckpt tri.h5 --prefix pairformer_module.layers.3.tri_att_start; "
               "triattn-export model.ckpt --all blocks/")
    parser.add_argument("checkpoint",
                        help="a state_dict or full-model .pt / .pth, a Lightning .ckpt, or a "
                             ".safetensors file")
    parser.add_argument("output", nargs="?",
                        help="the HDF5 weights file to write (.h5); replaced atomically if it "
                             "exists")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--list", action="store_true",
                        help="list every triangle attention block found and write nothing")
    action.add_argument("--all", metavar="DIR",
                        help="write one file per block into DIR, named after its prefix")
    parser.add_argument("--prefix", metavar="PREFIX",
                        help="the block to export, by module path (e.g. "
                             "pairformer_module.layers.3.tri_att_start); needed where the "
                             "checkpoint holds several")
    parser.add_argument("--node", choices=NODES,
                        help="the node of a block whose module path does not name it "
                             "(tri_att_start / tri_att_end do); ending_af3: the ending node "
                             "with the pair bias of the untransposed pair (AlphaFold3, "
                             "OpenFold3), in place of the path's own ending node")
    parser.add_argument("--num-heads", type=_positive_int, metavar="H",
                        help="number of attention heads; inferred from the pair bias "
                             "projection, checked against it when given")
    parser.add_argument("--layer-norm-eps", type=_positive_float, metavar="EPS",
                        help="LayerNorm epsilon (not stored in a checkpoint; default 1e-5)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="unpickle a checkpoint that torch.load(weights_only=True) refuses "
                             "(a full model); runs its code: only for files you trust")
    return parser


def _check_usage(parser, args) -> None:
    if args.list or args.all:
        if args.output:
            parser.error(f"--{'list' if args.list else 'all'} takes no OUTPUT "
                         f"(got {args.output!r})")
        if args.prefix:
            parser.error(f"--prefix picks one block for OUTPUT; it does not go with "
                         f"--{'list' if args.list else 'all'}")
    elif not args.output:
        parser.error("OUTPUT is required (or --list, or --all DIR)")


def _export_all(state_dict, args) -> None:
    imported, refused = importing.import_all(state_dict, node=args.node,
                                             layer_norm_eps=args.layer_norm_eps)
    for block in refused:
        logger.warning("skipped %r (%s): %s", block.prefix, block.family.name, block.problem)
    if not imported:
        raise ValueError("no triangle attention block could be exported"
                         + (f" ({len(refused)} refused)" if refused else ""))
    names = {}
    for prefix in imported:
        name = block_file_name(prefix)
        if name in names:
            raise ValueError(f"blocks {names[name]!r} and {prefix!r} would both be written "
                             f"to {name}")
        names[name] = prefix
    os.makedirs(args.all, exist_ok=True)
    for name, prefix in names.items():
        path = os.path.join(args.all, name)
        save_weights(imported[prefix], path)
        weights = imported[prefix]
        logger.info("wrote %s: %s, D %d, %d heads of width %d, mask layout %s, node %s",
                    path, prefix or "(root)", weights.pair_dim, weights.num_heads,
                    weights.head_dim, weights.mask_layout, weights.node)


def main(argv=None) -> int:
    """``triattn-export CHECKPOINT OUTPUT.h5 [--prefix P]``, ``CHECKPOINT --list``,
    ``CHECKPOINT --all DIR``."""
    parser = _parser()
    try:
        args = parser.parse_intermixed_args(argv)  # OUTPUT may follow the options
        _check_usage(parser, args)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code
    logging.basicConfig(level=logging.INFO, format="triattn-export: %(message)s")
    try:
        logger.info("reading %s", args.checkpoint)
        state_dict = importing.load_checkpoint(args.checkpoint, allow_pickle=args.allow_pickle)
        if args.list:
            blocks = importing.find_blocks(state_dict)
            if not blocks:
                importing.import_weights(state_dict)  # raises: says which names it looked for
            print(format_blocks(blocks))
        elif args.all:
            _export_all(state_dict, args)
        else:
            weights = importing.import_weights(
                state_dict, args.prefix, args.node, num_heads=args.num_heads,
                layer_norm_eps=args.layer_norm_eps)
            save_weights(weights, args.output)
            logger.info("wrote %s: pair_dim %d, num_heads %d, head width %d, layer_norm_eps "
                        "%g, mask layout %s, node %s", args.output, weights.pair_dim,
                        weights.num_heads, weights.head_dim, weights.layer_norm_eps,
                        weights.mask_layout, weights.node)
    except (ImportError, OSError, TypeError, ValueError) as err:
        message = " ".join(str(err).split())  # one line, even for multi-line messages
        print(f"triattn-export: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
