"""`accelerate(model)`: every triangle attention block of a PyTorch model routed to the kernels.

A block is recognised twice: its parameters name a block of a family that
`triattn_cupy.importing` knows (the spec's, OpenFold's, OpenFold3's names), and its class is
one whose forward this module knows how to read (`_KINDS`). A module with the parameters
but an unknown class is left alone (its forward may mean something else), and said so.

The accelerated forward runs the kernels when gradients are off and the tensors are on a
GPU, with arguments the kernels compute the same function for; otherwise the original
forward runs and the reason is logged once per block and reason (logger
"triattn_cupy.torch", level INFO). Arguments that only choose how the original computes
the same function (``chunk_size``, ``inplace_safe``, ``use_kernels``, ``use_flash_attn``,
``use_lma``, ``use_memory_efficient_kernel``, ``use_deepspeed_evo_attention``,
``triangle_attention=...``) are accepted: the kernels compute that function in less memory
than any chunk of the original.

Masks: the models add ``1e9 * (mask - 1)`` to the scores; the kernels remove the masked keys.
The outputs agree wherever a row keeps at least one key; a fully-masked row gets
``fully_masked="zero"``'s output (the output projection's bias) where the models return a
finite average that they discard downstream (triattn_cupy.conventions). The spec's module
returns NaN there, and its accelerated form does too.

Dtypes: the result has the dtype the original forward returns: the pair's, or under
torch.autocast the autocast dtype (the models' last Linear runs in it). With
``precision="bf16"`` under autocast, a float32 pair is cast to the autocast dtype before
the kernels read it (half the bytes; the original's projections read it so rounded too).
"""
from __future__ import annotations

import dataclasses
import logging
import types
import weakref

import torch

from ..gpu.checks import check_dims, check_precision
from ..importing import find_blocks, import_weights
from .ops import IO_DTYPES, _op, register_weights, unregister

__all__ = ["accelerate", "restore", "accelerated_blocks"]

logger = logging.getLogger("triattn_cupy.torch")

# Device types whose tensors go to the op (tests add "cpu", where the op runs the NumPy
# backend, to trace the accelerated path without a GPU).
_ACCELERATED_DEVICES = {"cuda"}
_STATE = "_triattn_accelerated"


@dataclasses.dataclass(frozen=True)
class Kind:
    """A class of block whose forward this module reads."""

    name: str
    module_prefix: str        # the class's module path starts with it ("" = any)
    class_names: tuple        # the class's (or a base class's) name
    forward: str  # "spec": forward(pair_repr, pair_mask); "openfold": (x, mask=None, ...)


_KINDS = (
    Kind("spec", "", ("TriangleSelfAttention",), "spec"),
    Kind("boltz", "boltz.", ("TriangleAttention",), "openfold"),
    Kind("protenix", "protenix.", ("TriangleAttention",), "openfold"),
    Kind("openfold3", "openfold3.", ("TriangleAttention",), "openfold"),
    Kind("openfold", "openfold.", ("TriangleAttention",), "openfold"),
)

# Keyword arguments of the OpenFold-style forwards that choose how the same function is
# computed (chunking, in-place buffers, another kernel): honoured by computing it with ours.
_SAME_FUNCTION = frozenset({"chunk_size", "inplace_safe", "triangle_attention"})


def _kind_of(module) -> Kind | None:
    for cls in type(module).__mro__:
        for kind in _KINDS:
            if cls.__name__ in kind.class_names and cls.__module__.startswith(kind.module_prefix):
                return kind
    return None


@dataclasses.dataclass
class _State:
    """What an accelerated block holds (as the attribute `_STATE`)."""

    name: str
    kind: Kind
    handle: int
    precision: str
    pair_dim: int
    node: str                # "starting" or "ending"
    mask_layout: str
    fully_masked: str
    arg_names: tuple         # the original forward's parameter names
    original: object         # the forward replaced (an instance attribute, or None)
    owner: object            # a weak reference to the block (a deep copy is not its owner)
    logged: set = dataclasses.field(default_factory=set)


# --- finding and importing blocks ----------------------------------------------------------

def _module_node(module, kind: Kind) -> str:
    if kind.forward == "spec":
        return "starting"
    return "starting" if getattr(module, "starting", True) else "ending"


def _importer(module, node: str):
    """(signature, reimport) of a block module, holding it weakly."""
    ref = weakref.ref(module)
    # The block's modules, listed once: their parameter dictionaries are read at every
    # call (a parameter replaced shows there), the recursive walk of m.parameters() cost
    # more host time per call than a small block's kernels
    submodules = [weakref.ref(m) for m in module.modules()]

    def signature():
        if ref() is None:
            return None
        return tuple((id(p), p.data_ptr(), p._version) for r in submodules
                     for p in (r()._parameters.values() if r() is not None else ())
                     if p is not None)

    def reimport():
        m = ref()
        if m is None:
            raise RuntimeError("the accelerated block no longer exists")
        return import_weights(m, node=node)
    return signature, reimport


def _arg_names(forward) -> tuple:
    import inspect

    try:
        return tuple(name for name, p in inspect.signature(forward).parameters.items()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    except (TypeError, ValueError):
        return ()


def accelerate(model, *, precision: str = "fp32"):
    """Route every triangle attention block of `model` to the kernels; returns `model`.

    Blocks: the spec's module, Boltz's, Protenix's, OpenFold's and OpenFold3's
    ``TriangleAttention`` (found by class and by their parameters' names). Each block's
    weights are imported from its parameters and uploaded to a device on first use there;
    a block whose parameters change afterwards (load_state_dict, in-place edits) is
    re-imported on its next call. precision: the kernels' arithmetic ("fp32", "tf32",
    "bf16"). `restore(model)` undoes it; accelerating again restores first.
    """
    check_precision(precision)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    restore(model)
    state_dict = model.state_dict(keep_vars=True)
    count = 0
    for block in find_blocks(state_dict):
        name = block.prefix.rstrip(".")
        try:
            module = model.get_submodule(name) if name else model
        except AttributeError:
            continue  # names of a state_dict that are not module paths
        label = name or type(model).__name__
        kind = _kind_of(module)
        if kind is None:
            logger.info("%s: left alone: %s.%s has a triangle attention block's parameters "
                        "but a forward this module does not read", label,
                        type(module).__module__, type(module).__qualname__)
            continue
        if block.problem:
            logger.info("%s: left alone: %s", label, block.problem)
            continue
        try:
            check_dims(block.pair_dim, block.num_heads, block.head_width)
        except ValueError as err:
            logger.info("%s: left alone: %s", label, err)
            continue
        node = _module_node(module, kind)
        signature, reimport = _importer(module, node)
        weights = reimport()
        handle = register_weights(weights, (signature, reimport))
        weakref.finalize(module, unregister, handle)
        _install(module, _State(
            name=label, kind=kind, handle=handle, precision=precision,
            pair_dim=block.pair_dim, node=node, mask_layout=weights.mask_layout,
            fully_masked="nan" if kind.forward == "spec" else "zero",
            arg_names=_arg_names(module.forward), original=module.__dict__.get("forward"),
            owner=weakref.ref(module)))
        count += 1
    logger.info("accelerated %d triangle attention block(s) of %s (precision %s)", count,
                type(model).__name__, precision)
    return model


def _install(module, state: _State):
    object.__setattr__(module, _STATE, state)
    # An instance attribute: nn.Module.__call__ reads self.forward, so hooks keep working,
    # and restore only deletes it.
    object.__setattr__(module, "forward", types.MethodType(_accelerated_forward, module))


def restore(model):
    """Undo `accelerate`: every block's original forward back, its weights forgotten."""
    for module in model.modules():
        state = module.__dict__.get(_STATE)
        if state is None:
            continue
        if state.owner() is module:  # a deep copy shares the handle of its original
            unregister(state.handle)
        del module.__dict__[_STATE]
        if state.original is not None:
            object.__setattr__(module, "forward", state.original)
        else:
            module.__dict__.pop("forward", None)
    return model


def accelerated_blocks(model) -> list:
    """The module paths of the accelerated blocks of `model` ("" for the model itself)."""
    return [name for name, module in model.named_modules() if _STATE in module.__dict__]


# --- the accelerated forward -------------------------------------------------------------

def _log_once(state: _State, reason: str):
    if torch.compiler.is_compiling() or reason in state.logged:
        return
    state.logged.add(reason)
    logger.info("%s: the original forward runs: %s", state.name, reason)


def _merge_leading(t, trailing: int):
    """`t` with its leading dims merged into one (a view), or None where that would copy."""
    lead = t.dim() - trailing
    if lead <= 1:
        return t if lead == 1 else t.unsqueeze(0)
    # Merging is a view where each leading dim of size > 1 steps over the next such dim whole
    dims = [axis for axis in range(lead) if t.shape[axis] != 1]
    for outer, inner in zip(dims, dims[1:]):
        if t.stride(outer) != t.stride(inner) * t.shape[inner]:
            return None
    return t.view(-1, *t.shape[lead:])


def _split_call(state: _State, args, kwargs):
    """(pair, mask, reason): the call's tensors, or why the kernels do not take it."""
    names = state.arg_names
    bound = dict(kwargs)
    for name, value in zip(names, args):
        if name in bound:
            return None, None, f"argument {name!r} given twice"
        bound[name] = value
    if len(args) > len(names):
        return None, None, "more positional arguments than the forward names"
    if state.kind.forward == "spec":
        pair, mask = bound.pop(names[0], None), bound.pop(names[1], None)
        if mask is None:
            return None, None, "no mask"
    else:
        pair, mask = bound.pop(names[0], None), bound.pop("mask", None)
    for name, value in bound.items():
        if name in _SAME_FUNCTION or name.startswith("use_"):
            continue
        if name == "transpose_bias":
            if value:
                return None, None, ("transpose_bias=True (the pair bias of the untransposed "
                                    "pair, AlphaFold3's ending node) is not computed on the GPU")
            continue
        return None, None, f"argument {name}={value!r} is not one the kernels honour"
    return pair, mask, None


def _check_call(state: _State, module, pair, mask):
    """Why the kernels do not take this call, or None."""
    if not isinstance(pair, torch.Tensor):
        return f"the pair is a {type(pair).__name__}, not a tensor"
    if torch.is_grad_enabled():
        return "gradients are enabled (under torch.no_grad() or torch.inference_mode() the " \
               "kernels run)"
    if pair.device.type not in _ACCELERATED_DEVICES:
        return f"the pair is on {pair.device.type}, not on a GPU"
    if pair.dtype not in IO_DTYPES:
        return f"the pair is {pair.dtype}; the kernels read float32, bfloat16, float16"
    if pair.dim() < 3 or pair.shape[-3] != pair.shape[-2] or pair.shape[-1] != state.pair_dim:
        return f"the pair has shape {tuple(pair.shape)}, expected (*, N, N, {state.pair_dim})"
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            return f"the mask is a {type(mask).__name__}, not a tensor"
        if mask.device != pair.device:
            return f"the mask is on {mask.device}, the pair on {pair.device}"
        if tuple(mask.shape) != tuple(pair.shape[:-1]):
            return f"the mask has shape {tuple(mask.shape)}, expected {tuple(pair.shape[:-1])}"
        if mask.dtype.is_complex:
            return f"the mask is {mask.dtype}"
    if module.training and getattr(getattr(module, "dropout", None), "p", 0.0) > 0:
        return "training mode with dropout"
    return None


def _accelerated_forward(module, *args, **kwargs):
    state = module.__dict__[_STATE]
    pair, mask, reason = _split_call(state, args, kwargs)
    if reason is None and state.owner() is not module:
        reason = "a copy of an accelerated block (accelerate the copy to route it)"
    if reason is None:
        reason = _check_call(state, module, pair, mask)
    if reason is None:
        x = _merge_leading(pair, 3)
        m = None if mask is None else _merge_leading(mask, 2)
        if x is None or (mask is not None and m is None):
            reason = "leading dimensions that do not merge into one without a copy"
    if reason is not None:
        _log_once(state, reason)
        if state.original is not None:
            return state.original(*args, **kwargs)
        return type(module).forward(module, *args, **kwargs)
    out_dtype = pair.dtype
    device_type = pair.device.type
    if torch.is_autocast_enabled(device_type):
        out_dtype = torch.get_autocast_dtype(device_type)
        if state.precision == "bf16" and x.dtype == torch.float32 and out_dtype in IO_DTYPES:
            x = x.to(out_dtype)
    out = _op(x, m, state.handle, state.precision, state.fully_masked, state.mask_layout,
              state.node)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out.view(pair.shape)
