"""Training through the output: the stages run so that ``loss(pipe(x)).backward()`` trains.

``Pipe.step`` owns the loss and runs each backward itself. Here the caller owns both: the
stages run every micro-batch's forward in GPipe's clock order (tick t runs micro-batch
t - s on stage s), joined across stages by autograd itself (a device copy is a
differentiable ``Tensor.to``), and return the outputs; a later ``backward()`` of anything
computed from them runs every stage's backward. All forwards in the call, all backwards in
the caller's backward: GPipe's schedule. Several losses, several ``backward()`` calls with
``retain_graph=True``, a loss over the whole batch: whatever autograd does, it does here.

Unlike the engine's other path, the graph spans stages, which is why this one exists only in
one process (``gpipe.pipe.through_output`` refuses it across processes).

Re-materialization: a micro-batch that recomputes (``gpipe.base.remat.recomputes``) runs each stage
under ``torch.utils.checkpoint`` (non-reentrant): its forward keeps only the stage's input, and
autograd recomputes the stage when it first needs an activation. The engine recomputes at
the start of B instead (``gpipe.engine.stage``), but here the backward is autograd's, started
by the caller, so the lazy recomputation is the only one there is. It follows the stage's
rules: the same per-layer seeds (``gpipe.base.rng``, through ``Stage._run``), the buffers the
forward wrote as that forward found them (``gpipe.engine.state``, from a fresh copy at every
recomputation, so that a second ``backward(retain_graph=True)`` replays the same), plain batch
norm's running statistics frozen and ``gpipe.base.remat.is_recomputing()`` true. A stage whose
layers write their input in place runs on a copy, as in the engine.

Tied parameters on several devices (``gpipe.parallel.tied``: a copy per other device): a stage
holding a copy reads ``reference.to(its device)`` in its place (``stand_ins``), so that
autograd sums every use into the reference's gradient, as the un-split model's one tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from gpipe.engine.stage import Stage
from gpipe.engine.state import SavedState, cloned

__all__ = ["StandIn", "forward"]

# A parameter that a stage reads as another tensor moved to its device: (module, name, source).
StandIn = tuple[nn.Module, str, torch.Tensor]


def forward(
    stages: Sequence[Stage],
    microbatches: Sequence[Any],
    *,
    seed: int,
    remat: Sequence[bool],
    stand_ins: Mapping[int, Sequence[StandIn]] | None = None,
) -> list[Any]:
    """Each micro-batch's output of the last stage, connected to autograd.

    ``stages``: every stage of the pipeline (this process holds them all); ``remat[m]``:
    whether micro-batch m recomputes (only meaningful with autograd on).
    """
    stages = sorted(stages, key=lambda stage: stage.index)
    values = list(microbatches)
    stashed: list[dict[str, torch.Tensor]] = [{} for _ in values]  # skip tensors in flight
    count, depth = len(values), len(stages)
    for tick in range(count + depth - 1):
        for s in range(max(0, tick - count + 1), min(depth, tick + 1)):
            m, stage = tick - s, stages[s]
            value = _moved(values[m], stage.device)
            if stage.skips is not None:
                popped = {n: _moved(stashed[m].pop(n), stage.device) for n in stage.skips.inputs}
                value = (value, popped)
            held = (stand_ins or {}).get(stage.index, ())
            out = _stage_forward(stage, m, value, seed=seed, remat=remat[m], stand_ins=held)
            if stage.skips is not None:
                out, sent = out
                stashed[m].update(sent)
            values[m] = out
    return values


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` on ``device``, differentiably (no copy where it is already there)."""
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _stage_forward(
    stage: Stage, m: int, inputs: Any, *, seed: int, remat: bool, stand_ins: Sequence[StandIn]
) -> Any:
    replay: list[frozenset[int]] = [frozenset()]  # layers to replay, set while recomputing

    def run(x: Any) -> Any:
        with _standing_in(stand_ins, stage.device):
            return stage._guarded(x, m, seed, replay[0])

    if not (remat and torch.is_grad_enabled()):
        return run(inputs)
    saved = stage.state.save()
    learned: list[SavedState | None] = []

    def contexts() -> tuple[Any, Any]:  # made as the forward starts, entered in backward
        return nullcontext(), _Recomputation(stage, learned, replay)

    # gpipe seeds each layer itself (gpipe.base.rng): torch's copy of the generators is not needed.
    out = checkpoint(
        run, inputs, use_reentrant=False, preserve_rng_state=False, context_fn=contexts
    )
    learned.append(stage.state.learned(saved))
    return out


class _Recomputation:
    """What a stage's recomputation runs under (``gpipe.engine.stage``'s rules). Entered at
    every recomputation (``backward(retain_graph=True)`` twice recomputes twice), so it is a
    context manager that can be entered again; ``learned`` holds what the forward wrote,
    once it has run."""

    def __init__(
        self, stage: Stage, learned: list[SavedState | None], replay: list[frozenset[int]]
    ) -> None:
        self.stage, self.learned, self.replay = stage, learned, replay

    def __enter__(self) -> None:
        self.entered = self.stage.recomputation(_fresh(self.learned[0]))
        self.replay[0] = self.entered.__enter__()

    def __exit__(self, *exc: object) -> bool | None:
        self.replay[0] = frozenset()
        return self.entered.__exit__(*exc)


def _fresh(saved: SavedState | None) -> SavedState | None:
    """A copy of ``saved`` (a buffer two modules share stays shared): a recomputation writes
    the buffers it restores, and the next one must start from the same values."""
    if saved is None:
        return None
    return dataclasses.replace(saved, values=cloned(saved.values))  # generators': only read


@contextmanager
def _standing_in(stand_ins: Sequence[StandIn], device: torch.device) -> Iterator[None]:
    """Each stand-in's parameter read as its source moved to ``device`` (differentiably)."""
    if not stand_ins:
        yield
        return
    held = [(module, name, module._parameters[name]) for module, name, _ in stand_ins]
    for module, name, source in stand_ins:
        module._parameters[name] = source.to(device)
    try:
        yield
    finally:
        for module, name, parameter in held:
            module._parameters[name] = parameter
