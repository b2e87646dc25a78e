"""Every triangle attention block of the process routed to the kernels, by its class.

`accelerate(model)` routes the blocks of one model object. A model's own command line
(``boltz predict``, ``protenix predict``, ``run_openfold predict``) builds or loads its model
where no caller can reach it, so `enable` routes the block classes instead: the forward of
each known class (blocks.Kind: Boltz's, Protenix's, OpenFold's, OpenFold3's
``TriangleAttention``, the spec's module) is replaced by one that routes the instance it is
called on, whichever way that instance was made (built, loaded from a checkpoint,
unpickled, copied). Classes already imported are found among torch.nn.Module's subclasses;
classes imported later, as they are defined (an ``__init_subclass__`` on torch.nn.Module
while routing is on). A block's weights are imported at its first call, and re-imported when
its parameters change (a checkpoint loaded after construction).

Messages name a block by its module path in its model, learnt from torch's module
registration hook while routing is on (``tri_att_start`` of layer 3 of a Boltz2:
``Boltz2.pairformer_module.layers.3.tri_att_start``); a block registered before, or never,
is named by its class and a number.

    with triattn_cupy.torch.accelerated(precision="bf16"):
        run_my_pipeline()
    print(triattn_cupy.torch.report())
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import weakref

import torch

from ..gpu.checks import check_precision
from . import blocks
from .fallbacks import process

__all__ = ["enable", "disable", "accelerated", "enabled"]


@dataclasses.dataclass(frozen=True)
class _Settings:
    precision: str
    strict: bool


_lock = threading.RLock()
_settings: list = []             # a stack: nested `accelerated` blocks
_patched: dict = {}              # class -> its own forward before routing (None: inherited)
_registration = None             # torch's module registration hook handle
_subclass_hook_installed = False
# module -> (weak reference to the parent it was last registered in, its name there)
_parents: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_unnamed = itertools.count(1)


def enabled() -> bool:
    """Whether block classes are routed now."""
    return bool(_settings)


def enable(*, precision: str = "fp32", strict: bool = False):
    """Route every triangle attention block of the process to the kernels, by class, until
    `disable`. Calls the kernels do not compute run the block's original forward, warned
    once per block and reason (strict=True: raise `FallbackError`). Resets the counts of
    `report()`. Calls nest: the innermost settings apply until its `disable`."""
    check_precision(precision)
    with _lock:
        if not _settings:
            process.reset()
            _start()
        _settings.append(_Settings(precision, bool(strict)))


def disable():
    """Undo the last `enable`; the last one gives the block classes their forwards back and
    forgets the routed blocks' weights (`report()` keeps its counts)."""
    with _lock:
        if not _settings:
            return
        _settings.pop()
        if not _settings:
            _stop()


@contextlib.contextmanager
def accelerated(*, precision: str = "fp32", strict: bool = False):
    """`enable` for the block of a with statement."""
    enable(precision=precision, strict=strict)
    try:
        yield
    finally:
        disable()


# --- finding classes ---------------------------------------------------------------------

def _subclasses(cls):
    for sub in type.__subclasses__(cls):
        yield sub
        yield from _subclasses(sub)


def _route_class(cls):
    """Replace the forward of `cls` if it is a known block class and no base class is one:
    subclasses inherit the routed forward, or override it with their own meaning (and a
    router is never wrapped in another)."""
    if cls in _patched or not any(kind.names(cls) for kind in blocks._KINDS) \
            or any(blocks.kind_of_class(base) is not None for base in cls.__bases__):
        return
    _patched[cls] = cls.__dict__.get("forward")
    cls.forward = _router(cls.forward)


@classmethod
def _init_subclass(cls, **kwargs):
    super(torch.nn.Module, cls).__init_subclass__(**kwargs)
    with _lock:
        if _settings:
            _route_class(cls)


def _remember_parent(parent, name, submodule):
    if submodule is not None:
        _parents[submodule] = (weakref.ref(parent), name)


def _start():
    global _registration, _subclass_hook_installed
    for cls in list(_subclasses(torch.nn.Module)):
        _route_class(cls)
    if "__init_subclass__" not in torch.nn.Module.__dict__:
        torch.nn.Module.__init_subclass__ = _init_subclass
        _subclass_hook_installed = True
    _registration = torch.nn.modules.module.register_module_module_registration_hook(
        _remember_parent)


def _stop():
    global _registration, _subclass_hook_installed
    if _subclass_hook_installed:
        del torch.nn.Module.__init_subclass__
        _subclass_hook_installed = False
    if _registration is not None:
        _registration.remove()
        _registration = None
    for cls, own in _patched.items():
        if own is None:
            del cls.forward
        else:
            cls.forward = own
    _patched.clear()
    blocks.forget_routed()


# --- the routed forward ------------------------------------------------------------------

def _path(module) -> str:
    """`module`'s path from the outermost module it is registered in, prefixed with that
    module's class name; its class and a number where it was never registered."""
    names, seen, current = [], set(), module
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parent = _parents.get(current)
        if parent is None:
            break
        names.append(parent[1])
        current = parent[0]()
    if not names or current is None:
        return f"{type(module).__qualname__} #{next(_unnamed)}"
    return ".".join([type(current).__name__, *reversed(names)])


def _router(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        settings = _settings[-1] if _settings else None
        # Off, or a block `accelerate` routed itself (its own forward calls this one when
        # it falls back): the original forward
        if settings is None or blocks._STATE in self.__dict__:
            return original(self, *args, **kwargs)
        state = blocks.routed_state(self, functools.partial(_path, self),
                                    settings.precision, settings.strict)
        return blocks.run_block(self, state, functools.partial(original, self), args, kwargs)
    return forward
