"""Triangle attention blocks of real models' checkpoints as `Weights`.

A checkpoint holds many modules; a triangle attention block is recognised by the names of its
parameters under any prefix (``pairformer_module.layers.3.tri_att_start.``, ...). Naming
families, relative to the block's prefix (every one has ``layer_norm.weight`` and
``layer_norm.bias``):

    family     pair bias         projections q, k, v, gate, output       models
    reference  bias_proj         query, key, value, gate, out_proj       the spec's module
    openfold   linear            mha.linear_q, _k, _v, _g, _o            OpenFold, Boltz-1/2,
                                                                         Protenix
    openfold3  linear_z          mha.linear_q, _k, _v, _g, _o            OpenFold3

A bias the block does not have is zero in `Weights`: OpenFold's q, k, v have none, Boltz's
(boltz-community 2.12), Protenix's (2.0) and OpenFold3's (0.5) gate and output projections
none either (OpenFold's have them). The
reference family computes the spec's conventions ("pair" mask, "starting" node); the OpenFold
families index the mask (b, i, k) ("row") and name the node in the module path
(``tri_att_start`` / ``tri_att_end``, ``triangle_attention_starting_node``, ...); where the
path does not say, the caller names it. OpenFold3's pair blocks run ``tri_att_end`` with the
pair bias of the untransposed pair (``transpose_bias=True``, as AlphaFold3): its ending
blocks import as node "ending_af3". Heads x head width need not be the pair dimension D
(Boltz-2's and Protenix's template stacks: D = 64, 4 heads x 32); the head width is read
from the projections' shapes and kept in `Weights.head_dim` (the NumPy backend computes any;
the GPU kernels take h x c = D only).

PyTorch is needed only for ``.pt`` / ``.pth`` / ``.ckpt`` files and modules, safetensors only
for ``.safetensors`` files; a mapping of NumPy arrays needs neither.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import re
from collections.abc import Mapping

import numpy as np

from ._install import pip_install
from .conventions import ENDING_NODES, check_node
from .hdf5 import MAX_PAIR_DIM
from .weights import LINEAR_NAMES, Weights

logger = logging.getLogger(__name__)

DEFAULT_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's, and every family's LayerNorm's


@dataclasses.dataclass(frozen=True)
class Family:
    """A naming family: our parameter names -> the block's own (relative to its prefix)."""

    name: str
    names: dict
    mask_layout: str
    default_node: str | None  # where neither the module path nor the caller names one
    ending_node: str          # what a module path naming the ending node means
    # Whether a module's `starting` flag is its node: OpenFold3's pair blocks run
    # tri_att_end, a module with starting=True, on the transposed pair.
    flag_is_node: bool

    @property
    def pair_bias(self) -> str:
        return self.names["bias_proj.weight"]


def _family(name, pair_bias, linears, mask_layout, default_node, ending_node,
            flag_is_node) -> Family:
    names = {"layer_norm.weight": "layer_norm.weight", "layer_norm.bias": "layer_norm.bias",
             "bias_proj.weight": f"{pair_bias}.weight"}
    for ours, theirs in zip(LINEAR_NAMES, linears):
        names[f"{ours}.weight"] = f"{theirs}.weight"
        names[f"{ours}.bias"] = f"{theirs}.bias"
    return Family(name, names, mask_layout, default_node, ending_node, flag_is_node)


_MHA = tuple(f"mha.linear_{x}" for x in "qkvgo")  # in LINEAR_NAMES' order
FAMILIES = (
    _family("reference", "bias_proj", LINEAR_NAMES, "pair", "starting", "ending", False),
    _family("openfold", "linear", _MHA, "row", None, "ending", True),
    _family("openfold3", "linear_z", _MHA, "row", None, "ending_af3", False),
)
_REQUIRED = ("layer_norm.weight", "layer_norm.bias", "bias_proj.weight",
             *(f"{name}.weight" for name in LINEAR_NAMES))


@dataclasses.dataclass(frozen=True)
class Block:
    """One triangle attention block found in a checkpoint."""

    prefix: str
    family: Family
    pair_dim: int
    num_heads: int
    head_width: int           # c: the projections' width / heads (0 where that is no width)
    node: str | None          # named by the module path (in the family's sense), else None
    biases: tuple             # our linear names ("query", ...) whose bias the block holds
    problem: str | None       # why it cannot be imported, None if it can


# --- reading checkpoints ------------------------------------------------------------------

def _import_torch():
    try:
        import torch
    except ImportError as err:
        raise ImportError(
            f"reading PyTorch checkpoints needs torch, which is not installed; "
            f"install it with: {pip_install('export')}") from err
    return torch


def load_checkpoint(path, *, allow_pickle: bool = False) -> dict:
    """The parameters of a checkpoint file as a flat {dotted name: tensor} dict.

    ``.safetensors``: read with safetensors. Anything else: ``torch.load(weights_only=True)``
    of a state_dict, a Lightning checkpoint (``{"state_dict": ...}``), or nested dicts of
    tensors (``{"model": ...}``). A pickled module (``torch.save(model)``) needs
    ``allow_pickle=True``, which runs ``torch.load(weights_only=False)``: only for files you
    trust, with the model's classes importable. Errors are one-sentence ValueErrors.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"checkpoint {path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"checkpoint {path}: is a folder, expected a checkpoint file")
    if not os.path.isfile(path):  # a FIFO or a device: opening it could block
        raise ValueError(f"checkpoint {path}: not a regular file; not opened")
    if path.endswith(".safetensors"):
        return _load_safetensors(path)
    torch = _import_torch()
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # torch's long message: keep its one useful line
        if not allow_pickle:
            detail = re.search(r"WeightsUnpickler error:\s*([^\n]*[^\s])", str(err))
            raise ValueError(
                f"cannot load checkpoint {path} with torch.load(weights_only=True); expected a "
                f"torch.save'd state_dict (a pickled module is refused)"
                + (f": {detail.group(1).split('. ')[0]}" if detail else "")
                + "; for a file you trust, allow_pickle=True (--allow-pickle) unpickles it"
            ) from None
        loaded = _torch_load_pickle(torch, path)
    except Exception as err:  # zip, EOF and torch errors alike
        raise ValueError(f"cannot load checkpoint {path}: {_first_line(err)}") from None
    return state_dict_of(loaded, path)


def _torch_load_pickle(torch, path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a class the pickle names may not be importable here
        raise ValueError(f"cannot unpickle checkpoint {path}: {_first_line(err)}") from None


def _first_line(err: Exception) -> str:
    lines = str(err).strip().splitlines()
    return type(err).__name__ + (f": {lines[0]}" if lines else "")


def _load_safetensors(path: str) -> dict:
    try:
        from safetensors import safe_open
    except ImportError as err:
        raise ImportError(f"reading .safetensors files needs safetensors, which is not "
                          f"installed; install it with: {pip_install('safetensors')}"
                          ) from err
    try:  # torch tensors keep bfloat16, which NumPy cannot hold
        import torch  # noqa: F401
        framework = "pt"
    except ImportError:
        framework = "numpy"
    try:
        with safe_open(path, framework=framework) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:
        raise ValueError(f"cannot load checkpoint {path}: {_first_line(err)}") from None


def _is_tensor(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, Mapping)


def state_dict_of(obj, source: str = "the checkpoint") -> dict:
    """A flat {dotted name: tensor} dict from a module, a state_dict, a Lightning checkpoint
    (its ``state_dict``) or nested dicts (names joined with dots; non-tensors dropped)."""
    if hasattr(obj, "state_dict") and callable(obj.state_dict) and not isinstance(obj, Mapping):
        obj = obj.state_dict()  # a torch.nn.Module
    if not isinstance(obj, Mapping):
        raise ValueError(f"{source} holds a {type(obj).__name__}, expected a state_dict "
                         f"(torch.save(module.state_dict(), ...)) or a Lightning checkpoint")
    if isinstance(obj.get("state_dict"), Mapping):  # Lightning: {"state_dict": ..., ...}
        obj = obj["state_dict"]
    flat = {}

    def walk(mapping, prefix):
        for key, value in mapping.items():
            if not isinstance(key, str):
                continue
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            elif _is_tensor(value):
                flat[prefix + key] = value
    walk(obj, "")
    return flat


# --- finding blocks -------------------------------------------------------------------------

_NODE_WORDS = {"start": "starting", "starting": "starting", "end": "ending", "ending": "ending"}


def node_from_path(prefix: str):
    """The node a module path names (``...tri_att_end.`` -> "ending"), else None.

    Read from the last component that is not a list index, split into words at ``_`` and
    at lower-to-upper case changes."""
    for part in reversed([p for p in prefix.split(".") if p]):
        if part.isdigit():
            continue
        words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", part).lower())
        found = {_NODE_WORDS[w] for w in words if w in _NODE_WORDS}
        return found.pop() if len(found) == 1 else None
    return None


def _shape(value) -> tuple:
    return tuple(int(n) for n in value.shape)


def _describe(family: Family, prefix: str, state_dict) -> Block:
    """The block of `family` at `prefix` (every required name present), shapes checked."""
    names = family.names
    sd = {ours: state_dict[prefix + theirs] for ours, theirs in names.items()
          if prefix + theirs in state_dict}
    ln = _shape(sd["layer_norm.weight"])
    bias = _shape(sd["bias_proj.weight"])
    q = _shape(sd["query.weight"])
    D = ln[0] if len(ln) == 1 else 0
    h = bias[0] if len(bias) == 2 else 0
    hidden = q[0] if len(q) == 2 else 0
    problems = []
    if D < 1:
        problems.append(f"{names['layer_norm.weight']} has shape {ln}, expected (D,)")
    if len(bias) != 2 or h < 1 or bias[1] != D:
        problems.append(f"{names['bias_proj.weight']} has shape {bias}, expected (heads, {D})")
    expected = {"layer_norm.bias": (D,), "out_proj.weight": (D, hidden), "out_proj.bias": (D,)}
    for name in LINEAR_NAMES[:4]:  # query, key, value, gate
        expected[f"{name}.weight"] = (hidden, D)
        expected[f"{name}.bias"] = (hidden,)
    for ours, want in expected.items():
        if ours in sd and _shape(sd[ours]) != want:
            problems.append(f"{names[ours]} has shape {_shape(sd[ours])}, expected {want}")
    width = hidden // h if h and hidden % h == 0 else 0
    if not problems:
        if hidden < 1 or hidden % h:
            problems.append(f"the projections' width {hidden} is not a positive multiple of "
                            f"the {h} heads")
    biases = tuple(name for name in LINEAR_NAMES if f"{name}.bias" in sd)
    node = node_from_path(prefix)
    if node == "ending":
        node = family.ending_node
    return Block(prefix, family, D, h, width, node, biases,
                 "; ".join(problems) if problems else None)


def find_blocks(state_dict) -> list:
    """Every triangle attention block of a flat state_dict, in the order of its names."""
    blocks, seen = [], set()
    for key in state_dict:
        for family in FAMILIES:
            anchor = family.names["query.weight"]
            if not key.endswith(anchor):
                continue
            prefix = key[:-len(anchor)]
            if (prefix and not prefix.endswith(".")) or (prefix, family.name) in seen:
                continue
            if all(prefix + family.names[name] in state_dict for name in _REQUIRED):
                seen.add((prefix, family.name))
                blocks.append(_describe(family, prefix, state_dict))
    return blocks


def _normalize_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    return prefix if not prefix or prefix.endswith(".") else prefix + "."


def _select(blocks: list, prefix, state_dict) -> Block:
    if prefix is None:
        if len(blocks) == 1:
            return blocks[0]
        if not blocks:
            raise ValueError(
                "no triangle attention block found: expected layer_norm, bias_proj, query, "
                "key, value, gate, out_proj (the reference's names) or layer_norm, linear / "
                "linear_z, mha.linear_q, _k, _v, _g, _o (OpenFold's) under one prefix")
        shown = ", ".join(repr(b.prefix) for b in blocks[:4])
        raise ValueError(f"{len(blocks)} triangle attention blocks found ({shown}"
                         f"{', ...' if len(blocks) > 4 else ''}); pick one with prefix= "
                         f"(--prefix; --list lists them)")
    prefix = _normalize_prefix(prefix)
    for block in blocks:
        if block.prefix == prefix:
            return block
    # Not a block: say what the nearest family misses there.
    missing = min(([family.names[n] for n in _REQUIRED if prefix + family.names[n]
                    not in state_dict] for family in FAMILIES), key=len)
    found = ", ".join(repr(b.prefix) for b in blocks[:4]) or "none"
    raise ValueError(f"no triangle attention block at prefix {prefix!r}: missing "
                     f"{', '.join(missing)}; blocks found: {found}"
                     f"{', ...' if len(blocks) > 4 else ''}")


# --- building Weights ------------------------------------------------------------------------

def _to_float32(value, name: str) -> np.ndarray:
    """A float32 NumPy copy of a (CPU or CUDA, any float dtype) tensor or array.

    Refused before anything is converted: a tensor larger than any parameter a weights
    file holds (an expanded, stride-0 tensor of a few bytes can declare gigabytes; within
    the bound it is copied whole, its values real), and a meta tensor (no values)."""
    size = math.prod(int(n) for n in value.shape)
    if size > MAX_PAIR_DIM ** 2:
        raise ValueError(f"{name}: shape {tuple(value.shape)} holds {size} values, more than "
                         f"any parameter of a weights file (pair_dim at most {MAX_PAIR_DIM})")
    if getattr(value, "is_meta", False):
        raise ValueError(f"{name}: a meta tensor, which holds no values (a model built on "
                         f"the meta device whose weights were never loaded)")
    if hasattr(value, "detach"):  # torch.Tensor
        if not value.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got dtype {value.dtype}")
        return value.detach().float().cpu().numpy().copy()
    array = np.asarray(value)
    if array.dtype.kind != "f":
        raise ValueError(f"{name}: expected a floating-point array, got dtype {array.dtype}")
    return array.astype(np.float32)


def block_weights(state_dict, block: Block, *, node=None, layer_norm_eps=None,
                  num_heads=None) -> Weights:
    """The `Weights` of one found block, with its family's mask layout and its node.

    node: "starting" / "ending" / "ending_af3" for a block whose module path does not name
    its node; where the path names it, a node of the other direction is an error (one of
    the two ending nodes replaces the other). The reference family's default is
    "starting" (the spec's module); the OpenFold families' blocks need a node named.
    num_heads: checked if given. layer_norm_eps: not stored in checkpoints; 1e-5 (every
    family's default) if None.
    """
    where = f"block {block.prefix!r} ({block.family.name})"
    if block.problem:
        raise ValueError(f"{where}: {block.problem}")
    if node is not None:
        check_node(node)
        if block.node is not None and (node in ENDING_NODES) != (block.node in ENDING_NODES):
            raise ValueError(f"node={node!r} disagrees with {where}: its module path says "
                             f"{block.node!r}")
    node = node or block.node or block.family.default_node
    if node is None:
        raise ValueError(f"{where}: its module path does not name the node; pass "
                         f"node='starting', 'ending' or 'ending_af3' (--node)")
    if num_heads is not None and num_heads != block.num_heads:
        raise ValueError(f"num_heads={num_heads} disagrees with {block.family.pair_bias}"
                         f".shape[0] = {block.num_heads}")
    eps = DEFAULT_LAYER_NORM_EPS if layer_norm_eps is None else float(layer_norm_eps)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"layer_norm_eps must be a positive finite number, got {eps}")
    params = {}
    for ours, theirs in block.family.names.items():
        name = block.prefix + theirs
        if name in state_dict:
            params[ours] = _to_float32(state_dict[name], name)
    ignored = sorted(k for k in state_dict if k.startswith(block.prefix)
                     and k[len(block.prefix):] not in block.family.names.values())
    if ignored and block.prefix:
        logger.warning("%s: ignored %d parameters under its prefix: %s", where, len(ignored),
                       ", ".join(ignored[:5]) + (", ..." if len(ignored) > 5 else ""))
    return Weights(block.pair_dim, block.num_heads, eps, params,
                   mask_layout=block.family.mask_layout, node=node, head_dim=block.head_width)


def _source(state_dict_or_path, allow_pickle):
    """(flat state_dict, module or None) of a path, a module or a mapping."""
    if isinstance(state_dict_or_path, (str, os.PathLike)):
        return load_checkpoint(state_dict_or_path, allow_pickle=allow_pickle), None
    if isinstance(state_dict_or_path, Mapping) or hasattr(state_dict_or_path, "state_dict"):
        module = None if isinstance(state_dict_or_path, Mapping) else state_dict_or_path
        return state_dict_of(state_dict_or_path, "the argument"), module
    raise TypeError(f"state_dict_or_path must be a checkpoint path, a state_dict mapping or a "
                    f"torch.nn.Module, got {type(state_dict_or_path).__name__}")


def _submodule(module, prefix: str):
    if module is None:
        return None
    try:
        return module.get_submodule(prefix.rstrip(".")) if prefix else module
    except AttributeError:
        return None


def _module_eps(module, prefix: str):
    """The block's LayerNorm epsilon where `module` holds it, else None."""
    eps = getattr(getattr(_submodule(module, prefix), "layer_norm", None), "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else None


def _module_node(module, block: Block):
    """The block's node where `module` holds it (the models' ``starting`` flag) and its
    family means it, else None."""
    if not block.family.flag_is_node:
        return None
    starting = getattr(_submodule(module, block.prefix), "starting", None)
    return {True: "starting", False: "ending"}.get(starting) if isinstance(starting, bool) \
        else None


def import_weights(state_dict_or_path, prefix=None, node=None, *, layer_norm_eps=None,
                   num_heads=None, allow_pickle: bool = False) -> Weights:
    """The `Weights` of one triangle attention block of a model.

    state_dict_or_path: a checkpoint path (see `load_checkpoint`), a state_dict (names to
    tensors or arrays, nested dicts and Lightning's ``{"state_dict": ...}`` included) or a
    ``torch.nn.Module``. prefix: the block's module path (``"pairformer_module.layers.3.
    tri_att_start."``; the final dot optional); None where the checkpoint holds one block.
    node: "starting" / "ending", for a block whose module path does not name its node (a
    module's block that has the models' ``starting`` flag names its own).
    The returned weights carry the block's mask layout and node, so
    ``triangle_attention(pair, mask, weights)`` computes what the block computes.
    """
    state_dict, module = _source(state_dict_or_path, allow_pickle)
    block = _select(find_blocks(state_dict), prefix, state_dict)
    if layer_norm_eps is None:
        layer_norm_eps = _module_eps(module, block.prefix)
    if node is None and block.node is None:
        node = _module_node(module, block)
    return block_weights(state_dict, block, node=node, layer_norm_eps=layer_norm_eps,
                         num_heads=num_heads)


def import_all(state_dict_or_path, node=None, *, layer_norm_eps=None,
               allow_pickle: bool = False) -> tuple:
    """({prefix: Weights} of every block that can be imported, [Block] of those that cannot).

    node: for the blocks whose module path does not name their node (a block that needs one
    without it is an error); blocks whose path names it keep their own."""
    state_dict, module = _source(state_dict_or_path, allow_pickle)
    imported, refused = {}, []
    for block in find_blocks(state_dict):
        if block.problem:
            refused.append(block)
            continue
        eps = layer_norm_eps if layer_norm_eps is not None else _module_eps(module, block.prefix)
        own = None if block.node else _module_node(module, block)
        imported[block.prefix] = block_weights(
            state_dict, block, node=None if block.node else (own or node), layer_norm_eps=eps)
    return imported, refused
