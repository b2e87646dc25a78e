"""PyTorch -> HDF5: `export_weights` and the ``triattn-export`` command.

PyTorch is imported only when an export runs, so the package imports without it; install
it with ``pip install triattn-cupy[export]``.
"""
from __future__ import annotations

import argparse
import logging
import math
import pickle
import re
import sys
from collections.abc import Mapping

import numpy as np

from .hdf5 import save_weights
from .weights import Weights

logger = logging.getLogger(__name__)

_PREFIX = "module."  # added by torch.nn.DataParallel / DistributedDataParallel


def _import_torch():
    try:
        import torch
    except ImportError as err:
        raise ImportError(
            "exporting from PyTorch needs torch, which is not installed; "
            "install it with: pip install triattn-cupy[export]") from err
    return torch


def export_weights(module_or_state_dict, path, num_heads=None,
                   layer_norm_eps=None) -> Weights:
    """Write the parameters of a reference-module instance to an HDF5 weights file.

    module_or_state_dict: a ``torch.nn.Module`` shaped like the reference module, or its
    state_dict (a mapping of names to tensors; a leading ``module.`` on every key is
    stripped). num_heads: taken from ``module.num_heads``, else inferred from
    ``bias_proj.weight`` (shape (h, D)); if given it must agree. layer_norm_eps: taken from
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
    params = {}
    for name, value in state_dict.items():
        tensor = torch.as_tensor(value)
        if not tensor.is_floating_point():
            raise ValueError(f"state_dict[{name!r}]: expected a floating-point tensor, "
                             f"got dtype {tensor.dtype}")
        # A copy: the Weights must not change when the module is trained further.
        params[name] = tensor.detach().to("cpu", torch.float32).numpy().copy()

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

    weights = Weights(pair_dim, num_heads, layer_norm_eps, params)
    save_weights(weights, path)
    logger.info("wrote %s: pair_dim %d, num_heads %d, layer_norm_eps %g, %d parameters",
                path, pair_dim, num_heads, layer_norm_eps,
                sum(np.size(v) for v in weights.params.values()))
    return weights


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


def _load_state_dict(torch, path: str):
    """torch.load(weights_only=True) of a state_dict, or a ValueError in one sentence."""
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path}: no such file") from None
    except pickle.UnpicklingError as err:  # torch's long message: keep its one useful line
        detail = re.search(r"WeightsUnpickler error:\s*([^\n]*[^\s])", str(err))
        raise ValueError(
            f"cannot load checkpoint {path} with torch.load(weights_only=True); expected a "
            f"torch.save'd state_dict (a pickled module is refused)"
            + (f": {detail.group(1).split('. ')[0]}" if detail else "")) from None
    except Exception as err:  # zip, EOF and torch errors alike
        lines = str(err).strip().splitlines()
        raise ValueError(f"cannot load checkpoint {path}: {type(err).__name__}"
                         + (f": {lines[0]}" if lines else "")) from None
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"checkpoint {path} holds a {type(state_dict).__name__}, expected a "
                         f"state_dict (torch.save(module.state_dict(), ...))")
    return state_dict


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triattn-export",
        description="Convert a PyTorch checkpoint of the reference triangle self-attention "
                    "module (saved with torch.save(module.state_dict(), ...)) into a "
                    "triattn-cupy HDF5 weights file (format version 1).")
    parser.add_argument("checkpoint", help="the torch.save'd state_dict (.pt / .pth)")
    parser.add_argument("output", help="the HDF5 weights file to write (.h5); replaced "
                                       "atomically if it exists")
    parser.add_argument("--num-heads", type=_positive_int, metavar="H",
                        help="number of attention heads; inferred from bias_proj.weight, "
                             "checked against it when given")
    parser.add_argument("--layer-norm-eps", type=_positive_float, metavar="EPS",
                        help="LayerNorm epsilon (not stored in a state_dict; default 1e-5)")
    return parser


def main(argv=None) -> int:
    """``triattn-export CHECKPOINT OUTPUT.h5 [--num-heads H] [--layer-norm-eps EPS]``."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code
    logging.basicConfig(level=logging.INFO, format="triattn-export: %(message)s")
    try:
        torch = _import_torch()
        logger.info("reading %s", args.checkpoint)
        state_dict = _load_state_dict(torch, args.checkpoint)
        export_weights(state_dict, args.output, num_heads=args.num_heads,
                       layer_norm_eps=args.layer_norm_eps)
    except (ImportError, OSError, TypeError, ValueError) as err:
        message = " ".join(str(err).split())  # one line, even for multi-line messages
        print(f"triattn-export: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
