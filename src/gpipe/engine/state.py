"""Module state that a forward reads and writes, kept exact under re-materialization.

A layer may write its own buffers in forward: spectral norm's power iteration (its ``_u`` and
``_v``), an exponential moving average, a counter. A recomputation that simply ran the forward
again would start from the buffers as the *later* micro-batches' forwards left them, and write
them a second time. So a stage learns, on its first re-materialized forward, which buffers its
forward writes (their version counters move, or the module rebinds them); from then on it keeps
a copy of just those buffers as each re-materialized forward found them, and the recomputation
runs from that copy, as the first forward ran: ``gpipe.base.remat.is_recomputing()`` is False inside
a layer whose buffers were restored (:func:`gpipe.base.remat.replaying`), so that a layer which
skips its update when recomputing still reads what its first forward read. Afterwards the
buffers the later forwards left are put back, so every micro-batch writes them once, in order,
as in the un-split model. A stage whose forward writes nothing pays nothing after its first
re-materialized forward.

A layer's private ``torch.Generator`` (an attribute of one of its modules) is such state
too: its draws advance it, so a recomputation puts back its state as the first forward found
it, and afterwards the state the later forwards left.

Restoring rebinds the buffers (``module._buffers[name]``) instead of copying into them: nothing
that autograd saved in another micro-batch's graph is written to.

What cannot be restored is refused: a forward that writes a *parameter* in place (the
optimizer holds it, it cannot be rebound) raises on the first re-materialized forward, naming
it and the remedies (a buffer, or ``checkpoint="never"``). Plain batch norm's running
statistics are written but never read in training: they are frozen for the recomputation
(:func:`running_stats_frozen`) instead of copied.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from gpipe.engine.batchnorm import DeferredBatchNorm

__all__ = ["ModuleState", "SavedState", "cloned", "running_stats_frozen"]


@dataclass(frozen=True)
class _Slot:
    """One buffer of one module: where it is registered, and which layer holds it."""

    module: nn.Module
    name: str
    layer: int  # offset of the stage's layer whose subtree holds the module


@dataclass
class SavedState:
    """The written buffers as one re-materialized forward found them."""

    values: dict[_Slot, torch.Tensor]
    layers: frozenset[int]  # the layers whose buffers these are
    generators: dict[torch.Generator, torch.Tensor]  # the layers' own, as found


@dataclass
class _Learning:
    """What a stage's first re-materialized forward needs to find what it writes."""

    mode: tuple[bool, ...]
    before: dict[_Slot, torch.Tensor]  # every buffer object, as registered before the forward
    versions: dict[_Slot, int]
    copies: dict[_Slot, torch.Tensor]
    parameters: list[tuple[str, nn.Parameter, int]]
    generators: dict[torch.Generator, torch.Tensor]


class ModuleState:
    """The buffers a stage's layers write in forward, per training mode of its layers."""

    def __init__(self, layers: Sequence[nn.Module], first_layer: int) -> None:
        self._layers = list(layers)
        self._first_layer = first_layer
        self._written: dict[tuple[bool, ...], list[_Slot]] = {}
        self.generators = list(
            {
                id(value): value
                for layer in self._layers
                for module in layer.modules()
                for value in vars(module).values()
                if isinstance(value, torch.Generator)
            }.values()
        )

    def _mode(self) -> tuple[bool, ...]:
        return tuple(layer.training for layer in self._layers)

    def save(self) -> SavedState | _Learning | None:
        """Before a re-materialized forward: a copy of what it will write (None: nothing)."""
        mode = self._mode()
        written = self._written.get(mode)
        generators = _states(self.generators)
        if written is None:
            return self._start_learning(mode, generators)
        if not written and not generators:
            return None
        return SavedState(_copies(written), frozenset(s.layer for s in written), generators)

    def learned(self, saved: SavedState | _Learning | None) -> SavedState | None:
        """After that forward: what it wrote, as it found it (None: nothing)."""
        if not isinstance(saved, _Learning):
            return saved
        changed = [name for name, p, version in saved.parameters if p._version != version]
        if changed:
            raise RuntimeError(
                f"the forward writes parameters in place ({', '.join(changed)}): a "
                "re-materialized forward would write them again, and gpipe restores buffers, "
                "not parameters; move the write out of forward (after optimizer.step()), make "
                "the tensor a buffer, or pass checkpoint='never' (one write per micro-batch)"
            )
        written = [
            slot
            for slot, tensor in saved.before.items()
            if slot.module._buffers.get(slot.name) is not tensor
            or tensor._version != saved.versions[slot]
        ]
        self._written[saved.mode] = written
        if not written and not saved.generators:
            return None
        return SavedState(
            {slot: saved.copies[slot] for slot in written},
            frozenset(slot.layer for slot in written),
            saved.generators,
        )

    def _start_learning(self, mode: tuple[bool, ...], generators: dict) -> _Learning:
        frozen = {id(m) for m in frozen_batch_norms(self._layers)}
        slots = [
            _Slot(module, name, offset)
            for offset, layer in enumerate(self._layers)
            for module in layer.modules()
            if id(module) not in frozen
            for name, tensor in module._buffers.items()
            if tensor is not None
        ]
        before = {slot: slot.module._buffers[slot.name] for slot in slots}
        parameters = [
            (f"{i}.{name}", p, p._version)
            for i, layer in enumerate(self._layers, start=self._first_layer)
            for name, p in layer.named_parameters()
        ]
        versions = {s: t._version for s, t in before.items()}
        return _Learning(mode, before, versions, _copies(slots), parameters, generators)

    @staticmethod
    @contextmanager
    def restored(saved: SavedState | None) -> Iterator[frozenset[int]]:
        """The buffers as ``saved`` holds them while the recomputation runs, then the later
        ones back; yields the layers to replay as first forwards."""
        if saved is None:
            yield frozenset()
            return
        later = {slot: slot.module._buffers[slot.name] for slot in saved.values}
        later_generators = _states(saved.generators)
        ModuleState.rebind(_Snapshot(saved.values, saved.generators))
        try:
            yield saved.layers
        finally:
            ModuleState.rebind(_Snapshot(later, later_generators))

    @staticmethod
    def snapshot(saved: SavedState | None, layers: range) -> _Snapshot:
        """While ``saved`` is restored: a copy of the buffers of ``layers`` (and the state of
        the generators) as they are now, for a recomputation of those layers alone
        (``checkpoint_layers``)."""
        if saved is None:
            return _Snapshot({}, {})
        buffers = _copies([slot for slot in saved.values if slot.layer in layers])
        return _Snapshot(buffers, _states(saved.generators))

    @staticmethod
    def rebind(snapshot: _Snapshot) -> None:
        """Put a :meth:`snapshot` back (inside :meth:`restored`, which puts the later
        buffers back at its end)."""
        for slot, value in snapshot.buffers.items():
            slot.module._buffers[slot.name] = value
        for generator, state in snapshot.generators.items():
            generator.set_state(state)


@dataclass
class _Snapshot:
    buffers: dict[_Slot, torch.Tensor]
    generators: dict[torch.Generator, torch.Tensor]


def _states(generators) -> dict[torch.Generator, torch.Tensor]:
    return {generator: generator.get_state() for generator in generators}


def _copies(slots: list[_Slot]) -> dict[_Slot, torch.Tensor]:
    """A copy of each slot's buffer; a buffer two modules hold is copied once, for both."""
    return cloned({slot: slot.module._buffers[slot.name] for slot in slots})


def cloned(values: dict[_Slot, torch.Tensor]) -> dict[_Slot, torch.Tensor]:
    """A copy of each tensor; a tensor held in several slots is copied once, for all."""
    by_tensor: dict[int, torch.Tensor] = {}
    for tensor in values.values():
        if id(tensor) not in by_tensor:
            by_tensor[id(tensor)] = tensor.detach().clone()
    return {slot: by_tensor[id(tensor)] for slot, tensor in values.items()}


def frozen_batch_norms(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The plain batch norms whose running statistics a recomputation must not update."""
    return [
        m
        for layer in layers
        for m in layer.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and not isinstance(m, DeferredBatchNorm)
        and m.track_running_stats
    ]


@contextmanager
def running_stats_frozen(layers: Sequence[nn.Module]) -> Iterator[None]:
    """A plain BatchNorm updates its running statistics on every forward; a recomputation
    must not update them a second time. With track_running_stats off it still normalizes
    by batch statistics (training mode) but leaves the buffers alone. DeferredBatchNorm
    checks gpipe.base.remat.rematerializing() itself."""
    frozen = frozen_batch_norms(layers)
    for module in frozen:
        module.track_running_stats = False
    try:
        yield
    finally:
        for module in frozen:
            module.track_running_stats = True
