"""Fallbacks one can see: why a block ran its original forward, said once, and counted.

A block routed to the kernels runs its original forward for a call the kernels do not
compute (CPU tensors, gradients enabled, a dtype or argument they do not take, weights the
GPU refuses). Each reason is warned once per block (`FallbackWarning`, through `warnings`
as PyTorch warns of its own fallbacks: filters, `-W error` and pytest's capture apply); a
strict block raises `FallbackError` instead. Every call is counted, per block and for the
process, so that `report` says what ran where.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import warnings

import torch.nn.modules.module

__all__ = ["FallbackWarning", "FallbackError", "Fallback", "Report"]


class FallbackWarning(UserWarning):
    """A triangle attention block ran its original forward instead of the kernels."""


class FallbackError(RuntimeError):
    """A strict block (accelerate(strict=True), triattn-run --strict) met a call or weights
    the kernels do not compute."""


@dataclasses.dataclass(frozen=True)
class Fallback:
    """Why a call runs the original forward: `reason`, short and the same for every call of
    its kind (the report's key), and `detail`: what was found and what to change."""

    reason: str
    detail: str


class Tally:
    """Calls of one block (or of the process): through the kernels, and fallen back by
    reason. Increments come from eager calls and from the op's implementation; a lock
    keeps counts whole when threads share a model."""

    def __init__(self, parent: "Tally | None" = None):
        self.kernel_calls = 0
        self.fallbacks: collections.Counter = collections.Counter()
        self.parent = parent
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return self  # a deep copy of a block counts with its original (and falls back)

    def count_kernel_call(self):
        with self._lock:
            self.kernel_calls += 1
        if self.parent is not None:
            self.parent.count_kernel_call()

    def count_fallback(self, reason: str):
        with self._lock:
            self.fallbacks[reason] += 1
        if self.parent is not None:
            self.parent.count_fallback(reason)


class ProcessTally(Tally):
    """Every block's calls since `reset` (triattn_cupy.torch.enable resets it), and how many
    blocks were routed or refused."""

    def __init__(self):
        super().__init__()
        self.reset()

    def reset(self):
        with self._lock:
            self.kernel_calls = 0
            self.fallbacks = collections.Counter()
            self.blocks = 0
            self.refused: dict = {}

    def count_block(self, name: str, refusal: "Fallback | None"):
        with self._lock:
            if refusal is None:
                self.blocks += 1
            else:
                self.refused[name] = refusal.reason

    def refuse(self, name: str, refusal: Fallback):
        """A routed block that a device refuses at its first call there."""
        with self._lock:
            self.blocks = max(self.blocks - 1, 0)  # (it may have been counted before reset)
            self.refused[name] = refusal.reason


process = ProcessTally()


def announce(name: str, fallback: Fallback, warned: set, strict: bool):
    """Raise (strict) or warn once per block and reason that `name` runs its original
    forward."""
    if strict:
        raise FallbackError(f"{name}: the kernels do not compute this call (strict): "
                            f"{fallback.detail}")
    if fallback.reason in warned:
        return
    warned.add(fallback.reason)
    warnings.warn(f"{name}: the original forward runs, not the kernels: {fallback.detail}",
                  FallbackWarning, stacklevel=_caller_level())


# Frames a warning is not attributed to: this package's, and torch's Module.__call__
_INNER_FILES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                torch.nn.modules.module.__file__)


def _caller_level() -> int:
    """The stacklevel of the code that called the block (or `accelerate`): the model's line,
    which a warning names, rather than this package's."""
    level, frame = 2, sys._getframe(2)  # (the caller of announce)
    while frame is not None and frame.f_code.co_filename.startswith(_INNER_FILES):
        frame, level = frame.f_back, level + 1
    return level


@dataclasses.dataclass(frozen=True)
class Report:
    """What ran where: `blocks` routed to the kernels, `kernel_calls` computed by them,
    `fallbacks` (reason -> calls that ran the original forward) and `refused` (block ->
    why every call of it runs the original forward). str(): one line."""

    blocks: int
    kernel_calls: int
    fallbacks: dict
    refused: dict

    @property
    def fallback_calls(self) -> int:
        return sum(self.fallbacks.values())

    def __str__(self) -> str:
        line = (f"{_count(self.blocks, 'triangle attention block')} accelerated, "
                f"{_count(self.kernel_calls, 'call')} through the kernels, "
                f"{self.fallback_calls} fell back")
        if self.fallbacks:
            line += " (" + "; ".join(f"{n}: {reason}" for reason, n in
                                     sorted(self.fallbacks.items(), key=lambda kv: -kv[1])) \
                + ")"
        if self.refused:
            reasons = collections.Counter(self.refused.values())
            line += f", {_count(len(self.refused), 'block')} refused (" + "; ".join(
                f"{n}: {reason}" for reason, n in reasons.most_common()) + ")"
        return line


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
