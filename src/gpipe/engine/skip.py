"""Skip connections across stages: a layer stashes a named tensor, a later layer pops it.

U-Nets and ResNets with long skips are not chains: a tensor made early is used much later.
A layer declares what it stashes and pops, and calls :func:`stash` / :func:`pop` in its
forward::

    @gpipe.skippable(stash=["down1"])
    class Down(nn.Module):
        def forward(self, x):
            x = self.conv(x)
            gpipe.stash("down1", x)
            return self.pool(x)

    @gpipe.skippable(pop=["down1"])
    class Up(nn.Module):
        def forward(self, x):
            return self.conv(torch.cat([self.up(x), gpipe.pop("down1")], dim=1))

Outside a pipeline (the un-split model) a stashed tensor simply waits, per thread, until it
is popped. In a pipeline the tensor travels straight from the producing stage to the
consuming one — a device copy in one process, one point-to-point message between ranks —
and its gradient comes back the same way; stages in between never see it. Within one
stage it never leaves the stage.

How: a stage's inputs and outputs become a packet ``(value, {name: tensor})``, so that the
stage's forward, backward, re-materialization and B/W split treat skip tensors like any
other boundary tensor; only the runtime knows where each one comes from and goes to.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["SkipError", "SkipLayout", "pop", "skippable", "stash"]

_local = threading.local()


class SkipError(ValueError):
    """Skip connections declared or used inconsistently."""


def skippable(*, stash: Sequence[str] = (), pop: Sequence[str] = ()):
    """Class decorator: the module stashes the names in ``stash`` and pops those in ``pop``."""

    def decorate(cls: type[nn.Module]) -> type[nn.Module]:
        cls.gpipe_stashes = tuple(stash)
        cls.gpipe_pops = tuple(pop)
        return cls

    return decorate


class _Tracker:
    """Where stash/pop go while one stage runs one micro-batch."""

    def __init__(self, local: set[str], inputs: dict[str, torch.Tensor]) -> None:
        self.local = local  # names stashed and popped within this stage
        self.inputs = dict(inputs)  # popped here, stashed by an earlier stage
        self.kept: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}  # stashed here, popped by a later stage

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        (self.kept if name in self.local else self.outputs)[name] = tensor

    def pop(self, name: str) -> torch.Tensor:
        if name in self.kept:
            return self.kept.pop(name)
        if name in self.inputs:
            return self.inputs.pop(name)
        raise SkipError(f"pop({name!r}): nothing was stashed under that name for this micro-batch")


class _Unsplit:
    """Outside a pipeline: a plain per-thread dictionary."""

    def __init__(self) -> None:
        self.waiting: dict[str, torch.Tensor] = {}

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        self.waiting[name] = tensor

    def pop(self, name: str) -> torch.Tensor:
        if name not in self.waiting:
            raise SkipError(f"pop({name!r}) before stash({name!r}) in this forward")
        return self.waiting.pop(name)


def _tracker() -> _Tracker | _Unsplit:
    tracker = getattr(_local, "tracker", None)
    if tracker is not None:
        return tracker
    if not hasattr(_local, "unsplit"):
        _local.unsplit = _Unsplit()
    return _local.unsplit


def stash(name: str, tensor: torch.Tensor) -> None:
    """Keep ``tensor`` under ``name`` for a later layer of the same micro-batch."""
    if not isinstance(tensor, torch.Tensor):
        raise SkipError(f"stash({name!r}, ...) takes a tensor, got {type(tensor).__name__}")
    _tracker().stash(name, tensor)


def pop(name: str) -> torch.Tensor:
    """Take the tensor an earlier layer stashed under ``name``."""
    return _tracker().pop(name)


@contextmanager
def tracking(local: set[str], inputs: dict[str, torch.Tensor]) -> Iterator[_Tracker]:
    tracker = _Tracker(local, inputs)
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous


@dataclass
class SkipLayout:
    """Which layer stashes and which pops each name; per stage, what enters and leaves."""

    producer: dict[str, int] = field(default_factory=dict)  # name -> layer index
    consumer: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> SkipLayout:
        """Read the declarations of every layer (and its submodules); check them all."""
        stashed: dict[str, list[int]] = {}
        popped: dict[str, list[int]] = {}
        for index, layer in enumerate(layers):
            for module in layer.modules():
                for name in getattr(module, "gpipe_stashes", ()):
                    stashed.setdefault(name, []).append(index)
                for name in getattr(module, "gpipe_pops", ()):
                    popped.setdefault(name, []).append(index)
        problems = []
        for name, where in sorted(stashed.items()):
            if len(where) > 1:
                problems.append(f"{name!r} is stashed by layers {where}; stash each name once")
            if name not in popped:
                problems.append(f"{name!r} is stashed by layer {where[0]} but never popped")
        for name, where in sorted(popped.items()):
            if len(where) > 1:
                problems.append(f"{name!r} is popped by layers {where}; pop each name once")
            if name not in stashed:
                problems.append(f"{name!r} is popped by layer {where[0]} but never stashed")
            elif where[0] < stashed[name][0]:
                problems.append(
                    f"{name!r} is popped by layer {where[0]} before layer {stashed[name][0]} "
                    "stashes it"
                )
        if problems:
            raise SkipError(
                "skip connections are inconsistent:\n" + "\n".join(f"- {p}" for p in problems)
            )
        return cls({n: w[0] for n, w in stashed.items()}, {n: w[0] for n, w in popped.items()})

    def __bool__(self) -> bool:
        return bool(self.producer)

    def stage_view(self, stage_of_layer: Sequence[int], stage: int) -> StageSkips:
        local, inputs, outputs = set(), {}, {}
        for name, produced in self.producer.items():
            consumed = self.consumer[name]
            source, target = stage_of_layer[produced], stage_of_layer[consumed]
            if source == target == stage:
                local.add(name)
            elif target == stage:
                inputs[name] = source
            elif source == stage:
                outputs[name] = target
        return StageSkips(local, dict(sorted(inputs.items())), dict(sorted(outputs.items())))


@dataclass(frozen=True)
class StageSkips:
    """One stage's skip traffic: names kept inside, received (from stage), sent (to stage)."""

    local: set[str]
    inputs: dict[str, int]
    outputs: dict[str, int]
