"""`accelerate(model)`: every triangle attention block of a PyTorch model routed to the kernels.

A block is recognised twice: its parameters name a block of a family that
`triattn_cupy.importing` knows (the spec's, OpenFold's, OpenFold3's names), and its class is
one whose forward this module knows how to read (`_KINDS`). A module with the parameters
but an unknown class keeps its own forward (it may mean something else), and says so.

The accelerated forward runs the kernels when gradients are off and the tensors are on a
GPU, with arguments the kernels compute the same function for; otherwise the original
forward runs, and the reason is warned once per block and reason (`FallbackWarning`,
triattn_cupy.torch.fallbacks) and counted (`report`); a strict block raises
`FallbackError` instead. Weights the GPU refuses (its checks raise
`gpu.checks.UnsupportedOnGpu`) are one more reason: at `accelerate`, or at the first call on
a device that refuses them. Arguments that only choose how the original computes the same
function (``chunk_size``, ``inplace_safe``, ``use_kernels``, ``use_flash_attn``,
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
import functools
import logging
import types
import weakref

import torch

from ..gpu.checks import UnsupportedOnGpu, check_precision, check_weights
from ..importing import find_blocks, import_weights
from .fallbacks import Fallback, FallbackError, Report, Tally, announce, process
from .ops import IO_DTYPES, _op, register_weights, unregister

__all__ = ["accelerate", "restore", "accelerated_blocks", "report"]

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

    def names(self, cls) -> bool:
        """Whether `cls` itself is this kind's class."""
        return cls.__name__ in self.class_names and cls.__module__.startswith(self.module_prefix)


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


def kind_of_class(cls) -> Kind | None:
    """The kind `cls` or a base class of it is."""
    for base in cls.__mro__:
        for kind in _KINDS:
            if kind.names(base):
                return kind
    return None


@dataclasses.dataclass
class _State:
    """What a routed block holds: `accelerate`'s as the attribute `_STATE`, the routing's
    (triattn_cupy.torch.routing) as `_ROUTED`."""

    name: str
    kind: Kind | None
    handle: int | None
    precision: str
    strict: bool
    pair_dim: int
    node: str                # "starting" or "ending"
    mask_layout: str
    fully_masked: str
    arg_names: tuple         # the original forward's parameter names
    original: object         # the forward replaced (an instance attribute, or None)
    owner: object            # a weak reference to the block (a deep copy is not its owner)
    refusal: Fallback | None  # why every call runs the original forward, or None
    tally: Tally
    warned: set = dataclasses.field(default_factory=set)


# A block routed by its class (triattn_cupy.torch.routing) holds its state as the attribute
# `_ROUTED`, where torch.compile's guards see it, in a holder that a pickled or copied block
# drops (the copy is routed as itself at its first call). `_routed` lists them for `disable`.
_ROUTED = "_triattn_routed"
_routed: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _unrouted():
    return None


class _Routed:
    __slots__ = ("state",)

    def __init__(self, state: _State):
        self.state = state

    def __reduce__(self):
        return _unrouted, ()

    def __deepcopy__(self, memo):
        return None


def _state_of(module) -> _State | None:
    holder = module.__dict__.get(_ROUTED)
    return module.__dict__.get(_STATE) or (holder.state if holder is not None else None)


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


def _refused_weights(error: UnsupportedOnGpu) -> Fallback:
    return Fallback("weights the GPU refuses",
                    f"{error} (the NumPy backend, triattn_cupy.reference, computes them)")


def _make_state(module, name: str, kind: Kind | None, block, precision: str,
                strict: bool) -> _State:
    """The state of block `module` (`block`: what find_blocks says of its parameters): its
    weights imported and registered, or the reason every call runs its original forward."""
    refusal, handle, weights = None, None, None
    if kind is None:
        refusal = Fallback("a block class this package does not read", (
            f"{type(module).__module__}.{type(module).__qualname__} has a triangle attention "
            f"block's parameters but a forward triattn_cupy.torch does not read (it reads "
            f"the spec's, Boltz's, Protenix's, OpenFold's and OpenFold3's)"))
    elif block is None or block.problem:
        refusal = Fallback("parameters that do not import", (
            block.problem if block is not None else
            "its parameters are not named as a triangle attention block's"))
    node = _module_node(module, kind) if kind is not None else "starting"
    if refusal is None:
        signature, reimport = _importer(module, node)
        weights = reimport()
        try:
            check_weights(weights)
        except UnsupportedOnGpu as error:
            refusal = _refused_weights(error)
    tally = Tally(parent=process)
    if refusal is None:
        handle = register_weights(weights, (signature, reimport), tally=tally)
        weakref.finalize(module, unregister, handle)
    return _State(
        name=name, kind=kind, handle=handle, precision=precision, strict=strict,
        pair_dim=block.pair_dim if block is not None else 0, node=node,
        mask_layout=weights.mask_layout if weights is not None else "row",
        fully_masked="nan" if kind is not None and kind.forward == "spec" else "zero",
        arg_names=_arg_names(module.forward), original=module.__dict__.get("forward"),
        owner=weakref.ref(module), refusal=refusal, tally=tally)


def accelerate(model, *, precision: str = "fp32", strict: bool = False):
    """Route every triangle attention block of `model` to the kernels; returns `model`.

    Blocks: the spec's module, Boltz's, Protenix's, OpenFold's and OpenFold3's
    ``TriangleAttention`` (found by class and by their parameters' names). Each block's
    weights are imported from its parameters and uploaded to a device on first use there;
    a block whose parameters change afterwards (load_state_dict, in-place edits) is
    re-imported on its next call. precision: the kernels' arithmetic ("fp32", "tf32",
    "bf16"). A call the kernels do not compute runs the block's original forward, warned
    once per block and reason (`FallbackWarning`); strict=True raises `FallbackError`
    instead: here for a block that cannot be routed (nothing is routed then), at the call
    for a call. `report(model)` counts them; `restore(model)` undoes it; accelerating again
    restores first.
    """
    check_precision(precision)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    restore(model)
    routed = []
    for block in find_blocks(model.state_dict(keep_vars=True)):
        name = block.prefix.rstrip(".")
        try:
            module = model.get_submodule(name) if name else model
        except AttributeError:
            continue  # names of a state_dict that are not module paths
        label = name or type(model).__name__
        routed.append((module, _make_state(module, label, kind_of_class(type(module)),
                                           block, precision, strict)))
    refused = [state for _, state in routed if state.refusal is not None]
    if strict and refused:
        for _, state in routed:
            if state.handle is not None:
                unregister(state.handle)
        raise FallbackError("; ".join(f"{state.name}: not accelerated (strict): "
                                       f"{state.refusal.detail}" for state in refused))
    for module, state in routed:
        _install(module, state)
        process.count_block(state.name, state.refusal)
        if state.refusal is not None:
            announce(state.name, state.refusal, state.warned, strict=False)
    logger.info("accelerated %d triangle attention block(s) of %s (precision %s)",
                len(routed) - len(refused), type(model).__name__, precision)
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
        if state.owner() is module and state.handle is not None:
            unregister(state.handle)  # (a deep copy shares the handle of its original)
        del module.__dict__[_STATE]
        if state.original is not None:
            object.__setattr__(module, "forward", state.original)
        else:
            module.__dict__.pop("forward", None)
    return model


def accelerated_blocks(model) -> list:
    """The module paths of the accelerated blocks of `model` ("" for the model itself)."""
    return [name for name, module in model.named_modules()
            if (state := _state_of(module)) is not None and state.refusal is None]


def report(model=None) -> Report:
    """What ran where: the blocks of `model` routed to the kernels, their calls through the
    kernels and those that fell back (by reason), the blocks refused. Without a model:
    every block of the process since `enable` (or since import). Calls are counted in
    eager mode and at the op (a compiled graph's fallbacks, decided when tracing, and CUDA
    graph replays are not)."""
    if model is None:
        return Report(process.blocks, process.kernel_calls, dict(process.fallbacks),
                      dict(process.refused))
    blocks, kernel_calls, fallbacks, refused = 0, 0, {}, {}
    for module in model.modules():
        state = _state_of(module)
        if state is None:
            continue
        if state.refusal is None:
            blocks += 1
        else:
            refused[state.name] = state.refusal.reason
        kernel_calls += state.tally.kernel_calls
        for reason, n in state.tally.fallbacks.items():
            fallbacks[reason] = fallbacks.get(reason, 0) + n
    return Report(blocks, kernel_calls, fallbacks, refused)


# --- routing by class (triattn_cupy.torch.routing) ---------------------------------------

def routed_state(module, name, precision: str, strict: bool) -> _State:
    """The state of a block routed by its class: made on its first call (`name()` its
    label), then following the routing's current precision and strictness."""
    holder = module.__dict__.get(_ROUTED)
    state = holder.state if holder is not None else _first_routed_call(module, name, precision,
                                                                     strict)
    state.precision, state.strict = precision, strict
    return state


@torch.compiler.disable  # (imports weights: a graph break where torch.compile meets it)
def _first_routed_call(module, name, precision: str, strict: bool) -> _State:
    holder = module.__dict__.get(_ROUTED)
    if holder is not None:  # a graph compiled before the first call calls this each time
        return holder.state
    label = name()
    block = next((b for b in find_blocks(module.state_dict(keep_vars=True))
                  if b.prefix == ""), None)
    state = _make_state(module, label, kind_of_class(type(module)), block, precision, strict)
    object.__setattr__(module, _ROUTED, _Routed(state))
    _routed.add(module)
    process.count_block(label, state.refusal)
    if state.refusal is not None:
        announce(label, state.refusal, state.warned, strict)
    return state


def forget_routed():
    """Drop every class-routed block's state and weights (the routing is switched off)."""
    for module in list(_routed):
        holder = module.__dict__.pop(_ROUTED, None)
        if holder is not None and holder.state.handle is not None:
            unregister(holder.state.handle)
    _routed.clear()


# --- the accelerated forward -------------------------------------------------------------

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
    """(pair, mask, fallback): the call's tensors, or why the kernels do not take it."""
    names = state.arg_names
    bound = dict(kwargs)
    for name, value in zip(names, args):
        if name in bound:
            return None, None, Fallback(f"argument {name} given twice",
                                        f"argument {name!r} given twice")
        bound[name] = value
    if len(args) > len(names):
        return None, None, Fallback("extra positional arguments",
                                    "more positional arguments than the forward names")
    if state.kind.forward == "spec":
        pair, mask = bound.pop(names[0], None), bound.pop(names[1], None)
        if mask is None:
            return None, None, Fallback("no mask", "no mask: pass the pair mask")
    else:
        pair, mask = bound.pop(names[0], None), bound.pop("mask", None)
    for name, value in bound.items():
        if name in _SAME_FUNCTION or name.startswith("use_"):
            continue
        if name == "transpose_bias":
            if value:
                return None, None, Fallback("transpose_bias=True", (
                    "transpose_bias=True (the pair bias of the untransposed pair, "
                    "AlphaFold3's ending node) is not computed on the GPU; OpenFold3's "
                    "starting blocks run on the kernels"))
            continue
        return None, None, Fallback(f"argument {name}", (
            f"argument {name}={value!r} is not one the kernels honour (call the block "
            f"without it to run the kernels)"))
    return pair, mask, None


def _check_call(state: _State, module, pair, mask):
    """Why the kernels do not take this call (a Fallback), or None."""
    if not isinstance(pair, torch.Tensor):
        return Fallback("a pair that is not a tensor",
                        f"the pair is a {type(pair).__name__}, not a tensor")
    if torch.is_grad_enabled():
        return Fallback("gradients enabled", (
            "gradients are enabled: run the model under torch.inference_mode() or "
            "torch.no_grad() (model.eval() alone keeps them on)"))
    if pair.device.type not in _ACCELERATED_DEVICES:
        return Fallback(f"tensors on {pair.device.type}", (
            f"the pair is on {pair.device.type}, not on a GPU: move the model and its "
            f"inputs to a CUDA device"))
    if pair.dtype not in IO_DTYPES:
        return Fallback(f"pair dtype {str(pair.dtype).replace('torch.', '')}", (
            f"the pair is {pair.dtype}; the kernels read float32, bfloat16 and float16: "
            f"run the model in one of them"))
    if pair.dim() < 3 or pair.shape[-3] != pair.shape[-2] or pair.shape[-1] != state.pair_dim:
        return Fallback("pair shape", f"the pair has shape {tuple(pair.shape)}, expected "
                                      f"(*, N, N, {state.pair_dim})")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            return Fallback("mask", f"the mask is a {type(mask).__name__}, not a tensor")
        if mask.device != pair.device:
            return Fallback("mask", f"the mask is on {mask.device}, the pair on {pair.device}")
        if tuple(mask.shape) != tuple(pair.shape[:-1]):
            return Fallback("mask", f"the mask has shape {tuple(mask.shape)}, expected "
                                    f"{tuple(pair.shape[:-1])}")
        if mask.dtype.is_complex:
            return Fallback("mask", f"the mask is {mask.dtype}")
    if module.training and getattr(getattr(module, "dropout", None), "p", 0.0) > 0:
        return Fallback("training with dropout",
                        "training mode with dropout: call model.eval() for inference")
    return None


def _fallback_of(module, state: _State, args, kwargs):
    """(pair, x, m, fallback) of a call: the pair, and the merged pair and mask the op takes,
    or why not."""
    if state.refusal is not None:
        return None, None, None, state.refusal
    pair, mask, fallback = _split_call(state, args, kwargs)
    if fallback is None and state.owner() is not module:
        fallback = Fallback("a copied block", "a copy of an accelerated block: accelerate "
                                              "the copy (triattn_cupy.torch.accelerate)")
    if fallback is None:
        fallback = _check_call(state, module, pair, mask)
    if fallback is None:
        x = _merge_leading(pair, 3)
        m = None if mask is None else _merge_leading(mask, 2)
        if x is None or (mask is not None and m is None):
            return None, None, None, Fallback("leading dimensions", (
                "leading dimensions that do not merge into one without a copy: pass a "
                "contiguous pair and mask"))
        return pair, x, m, None
    return None, None, None, fallback


def _fall_back(state: _State, fallback: Fallback, original, args, kwargs):
    if not torch.compiler.is_compiling():  # (decided once when tracing: not counted)
        state.tally.count_fallback(fallback.reason)
        announce(state.name, fallback, state.warned, state.strict)
    return original(*args, **kwargs)


def run_block(module, state: _State, original, args, kwargs):
    """One call of a routed block: the kernels, or `original` (the block's own forward,
    bound) and the reason said."""
    pair, x, m, fallback = _fallback_of(module, state, args, kwargs)
    if fallback is not None:
        return _fall_back(state, fallback, original, args, kwargs)
    out_dtype = pair.dtype
    device_type = pair.device.type
    if torch.is_autocast_enabled(device_type):
        out_dtype = torch.get_autocast_dtype(device_type)
        if state.precision == "bf16" and x.dtype == torch.float32 and out_dtype in IO_DTYPES:
            x = x.to(out_dtype)
    call = functools.partial(_op, x, m, state.handle, state.precision, state.fully_masked,
                             state.mask_layout, state.node)
    if torch.compiler.is_compiling():
        out = call()
    else:
        try:
            out = call()
        except UnsupportedOnGpu as error:  # this device refuses the weights: from now on
            state.refusal = _refused_weights(error)
            process.refuse(state.name, state.refusal)
            return _fall_back(state, state.refusal, original, args, kwargs)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out.view(pair.shape)


def _original_forward(module, state: _State):
    if state.original is not None:
        return state.original
    return functools.partial(type(module).forward, module)


def _accelerated_forward(module, *args, **kwargs):
    state = module.__dict__[_STATE]
    return run_block(module, state, _original_forward(module, state), args, kwargs)
