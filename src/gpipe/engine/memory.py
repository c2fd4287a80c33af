"""Measure the activation memory each stage holds, rather than assume it.

:class:`ActivationMeter` counts two kinds of stored tensors per stage:

* tensors autograd saves for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` while the stage runs its forward (or its
  recomputation), and released when autograd frees them;
* boundary inputs a stage keeps for its backward (the only thing it keeps per
  micro-batch under re-materialization).

Tensors are counted once per underlying storage (a tensor saved by three ops, or both
saved and kept as an input, is one allocation), and parameters are excluded: they are
weights, not activations. Example::

    with gpipe.measure_activations(pipe) as meter:
        pipe.step(x, y, loss_fn)
    print(meter.peak_bytes)   # one entry per stage
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from gpipe.base._utils import storage_key

__all__ = ["ActivationMeter", "measure_activations"]


class _HasStages(Protocol):
    num_stages: int
    stages: list[Any]  # gpipe.engine.stage.Stage, whose ``meter`` this sets

    def parameters(self) -> Iterator[torch.Tensor]: ...


class _Held:
    """What autograd stores instead of a saved tensor: the tensor plus a release on free."""

    __slots__ = ("__weakref__", "key", "meter", "stage", "tensor")

    def __init__(self, meter: ActivationMeter, stage: int, tensor: torch.Tensor) -> None:
        # Detached: a saved *output* keeps its grad_fn, and that node keeps what we
        # return here — a reference cycle through C++ that no garbage collector breaks
        # when the graph is retained (split backward).
        self.meter, self.stage, self.tensor = meter, stage, tensor.detach()
        self.key = meter._acquire(stage, tensor)

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.stage, self.key)


class ActivationMeter:
    """Live and peak bytes of stored activations, per stage."""

    def __init__(self, num_stages: int, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {storage_key(p) for p in parameters}
        self._refs: list[dict[tuple[torch.device, int], list[int]]] = [
            {} for _ in range(num_stages)
        ]
        self.live_bytes = [0] * num_stages
        self.peak_bytes = [0] * num_stages

    def _acquire(self, stage: int, tensor: torch.Tensor) -> tuple[torch.device, int] | None:
        key = storage_key(tensor)
        if key in self._excluded or tensor.device.type == "meta":
            return None
        entry = self._refs[stage].setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live_bytes[stage] += entry[1]
            self.peak_bytes[stage] = max(self.peak_bytes[stage], self.live_bytes[stage])
        entry[0] += 1
        return key

    def _release(self, stage: int, key: tuple[torch.device, int]) -> None:
        entry = self._refs[stage][key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes[stage] -= entry[1]
            del self._refs[stage][key]

    @contextmanager
    def saved_tensors(self, stage: int) -> Iterator[None]:
        """Count what autograd saves for backward inside this block against ``stage``."""

        def pack(tensor: torch.Tensor) -> _Held:
            return _Held(self, stage, tensor)

        def unpack(held: _Held) -> torch.Tensor:
            return held.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def hold(self, stage: int, tensors: Iterable[torch.Tensor]) -> list[_Held]:
        """Count tensors a stage keeps itself; they stay counted while the result lives."""
        return [_Held(self, stage, t) for t in tensors]


@contextmanager
def measure_activations(pipe: _HasStages) -> Iterator[ActivationMeter]:
    """Attach an :class:`ActivationMeter` to every local stage of ``pipe`` for the block.

    ``pipe`` is a :class:`gpipe.Pipe`, or anything with its ``num_stages``, ``stages`` and
    ``parameters()``.
    """
    # What autograd saves of the weights is not an activation (for a sharded stage: the
    # gathered copies, see Stage.autograd_parameters).
    weights = [
        p
        for stage in pipe.stages
        for p in (
            stage.autograd_parameters()
            if getattr(stage, "autograd_parameters", None)
            else stage.parameters()
        )
    ]
    meter = ActivationMeter(pipe.num_stages, weights)
    for stage in pipe.stages:
        stage.meter = meter
    try:
        yield meter
    finally:
        for stage in pipe.stages:
            stage.meter = None
