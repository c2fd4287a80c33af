"""A stage: a contiguous slice of an ``nn.Sequential`` on one device.

A stage runs one micro-batch at a time, forward or backward, and keeps per micro-batch
only what its backward needs:

* without re-materialization, the autograd graph of the forward (all inner activations);
* with re-materialization, only its boundary input. The forward runs under
  ``torch.no_grad`` and is recomputed, with the same random numbers, right before that
  micro-batch's backward.

With ``checkpoint_layers=g`` a re-materialized backward recomputes g layers at a time
instead of the whole stage (nested checkpoints): a pass without autograd keeps the input of
each group of g layers, then from the last group down each group is recomputed with autograd
from its input, differentiated with the gradient of its output, and freed. The peak holds
the group inputs and one group's activations instead of the whole stage's, for one more
forward without autograd. A split backward (zero-bubble schedules: W needs every layer's
saved tensors after B) and a stage with skip connections recompute whole.

Why not ``torch.utils.checkpoint``: it recomputes lazily, when autograd first needs a
saved tensor, i.e. in the middle of the backward pass. A pipeline wants to choose when to
recompute (at the start of ``B``, so that with several processes the recomputation can
overlap the wait for the incoming gradient), and it already holds the input itself, so a
plain no-grad forward plus an explicit recomputation is both simpler and earlier.

Stage boundaries carry a tensor or a (nested) tuple/list/dict of tensors. Each stage
runs on detached copies of its inputs (leaves), so autograd graphs never span stages:
the gradient of a stage's inputs is what its backward hands to the previous stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gpipe.base import rng
from gpipe.base._utils import run_keeping_input, tensors_of
from gpipe.base.remat import recomputing, replaying
from gpipe.engine.loss import ForeignParameters, LossSpec, check_loss, compute_loss
from gpipe.engine.skip import SkipError, StageSkips, tracking
from gpipe.engine.split_backward import (
    WeightWork,
    backward_input,
    backward_weight,
    grads_of,
    run_backward,
)
from gpipe.engine.state import ModuleState, SavedState, running_stats_frozen

if TYPE_CHECKING:
    from gpipe.engine.memory import ActivationMeter

__all__ = ["Stage", "detached"]


@dataclass(slots=True)
class _Stored:
    """What a stage keeps between the forward and backward of one micro-batch."""

    inputs: Any
    remat: bool
    seed: int
    loss: LossSpec | None
    outputs: Any = None  # with autograd graph; None until recomputed under remat
    loss_value: torch.Tensor | None = None  # weighted, with graph (last stage)
    held: list[Any] = field(default_factory=list)  # memory-meter tokens
    state: SavedState | None = None  # buffers the forward wrote, as it found them (remat)


class Stage:
    """Layers ``first_layer .. first_layer + len(layers) - 1`` of the model on ``device``.

    ``forward`` and ``backward`` are the F and B actions of a schedule for one
    micro-batch. The last stage also computes the loss: its ``forward`` takes a
    :class:`LossSpec` and its ``backward`` starts from that loss.
    """

    def __init__(
        self,
        index: int,
        layers: Sequence[nn.Module],
        *,
        first_layer: int,
        device: torch.device,
        is_last: bool,
        skips: StageSkips | None = None,
        checkpoint_layers: int | None = None,
    ) -> None:
        self.index = index
        # Layers recomputed at a time in a re-materialized backward (None: the whole stage).
        self.checkpoint_layers = checkpoint_layers
        # With skip connections, inputs and outputs are packets (value, {name: tensor}).
        self.skips = skips
        self.layers = list(layers)
        self.first_layer = first_layer
        self.device = device
        self.is_last = is_last
        self.meter: ActivationMeter | None = None
        self._stored: dict[int, _Stored] = {}
        self._weight_work: dict[int, WeightWork] = {}
        # Do the layers (None: all; a range: a group of checkpoint_layers) write their input?
        self._writes_input: dict[range | None, bool] = {}
        self.state = ModuleState(self.layers, first_layer)  # buffers the forward writes
        # The layers that may draw random numbers: only they are seeded (gpipe.base.rng).
        self._draws = [not rng.draws_nothing(layer) for layer in self.layers]
        self._any_draws = any(self._draws)
        # Set when the stage's parameters are sharded (gpipe.parallel.sharded): the tensors
        # autograd differentiates (the gathered parameters), and a context that gathers
        # them all (for W, whose autograd call the sharding's own hooks do not see).
        self.autograd_parameters: Callable[[], list[torch.Tensor]] | None = None
        self.gathered: Callable[[], Any] = nullcontext
        self.foreign = ForeignParameters()  # the other stages' parameters (the loss's check)

    def parameters(self) -> Iterator[nn.Parameter]:
        for layer in self.layers:
            yield from layer.parameters()

    def needs_grad(self, inputs: Any) -> bool:
        """Whether anything upstream of this stage's outputs needs a gradient."""
        return any(t.requires_grad for t in tensors_of(inputs)) or any(
            p.requires_grad for p in self.parameters()
        )

    def __repr__(self) -> str:
        last = self.first_layer + len(self.layers) - 1
        return f"Stage({self.index}, layers {self.first_layer}..{last}, device={self.device})"

    # -- running layers -------------------------------------------------------------------

    def _run(
        self, inputs: Any, microbatch: int, seed: int, replay: frozenset[int], group=None
    ) -> Any:
        if self.skips is None:  # (groups exist only without skips)
            return self._run_layers(inputs, microbatch, seed, replay, group)
        value, skip_inputs = inputs
        with tracking(self.skips.local, skip_inputs) as tracker:
            value = self._run_layers(value, microbatch, seed, replay)
        missing = [name for name in self.skips.outputs if name not in tracker.outputs]
        if missing:
            raise SkipError(
                f"stage {self.index} declared stashes {missing} but its layers did not stash "
                f"them for micro-batch {microbatch}"
            )
        return value, {name: tracker.outputs[name] for name in self.skips.outputs}

    def _run_layers(
        self, x: Any, microbatch: int, seed: int, replay: frozenset[int], group: range | None = None
    ) -> Any:
        # ``replay``: layers whose buffers were restored for this recomputation run as
        # their first forward did (gpipe.engine.state). ``group``: these layers only.
        offsets = group if group is not None else range(len(self.layers))
        if not replay and not self._any_draws:
            for offset in offsets:
                x = self.layers[offset](x)
            return x
        with rng.preserved(self.device) as generator:
            for offset in offsets:
                if self._draws[offset]:
                    index = self.first_layer + offset
                    generator.manual_seed(rng.layer_seed(seed, index, microbatch))
                if offset in replay:
                    with replaying():
                        x = self.layers[offset](x)
                else:
                    x = self.layers[offset](x)
        return x

    def value_of(self, packet: Any) -> Any:
        """The model's own value in a stage output (without skip tensors)."""
        return packet[0] if self.skips is not None else packet

    @contextmanager
    def recomputation(self, state: SavedState | None) -> Iterator[frozenset[int]]:
        """What a recomputation runs under: ``gpipe.base.remat.is_recomputing()``, plain batch
        norm's running statistics frozen, the buffers ``state`` holds (gpipe.engine.state);
        yields the layers to replay as first forwards."""
        with recomputing(), running_stats_frozen(self.layers), ModuleState.restored(state) as r:
            yield r

    def _metered(self):
        return self.meter.saved_tensors(self.index) if self.meter is not None else _UNMETERED

    def _guarded(
        self,
        x: Any,
        microbatch: int,
        seed: int,
        replay: frozenset[int],
        group: range | None = None,
        *,
        share: bool = False,
    ) -> Any:
        """The layers (of ``group``) on ``x``, or on a copy when they write their input."""
        writes = self._writes_input.get(group)
        if writes is False:  # the common case, without a call more
            return self._run(x, microbatch, seed, replay, group)
        out, self._writes_input[group] = run_keeping_input(
            self._run, x, microbatch, seed, replay, group, writes=writes, share=share
        )
        return out

    def _outputs_and_loss(
        self, stored: _Stored, microbatch: int, replay: frozenset[int] = frozenset()
    ) -> None:
        stored.outputs = self._guarded(stored.inputs, microbatch, stored.seed, replay, share=True)
        self._loss(stored, microbatch)

    def _loss(self, stored: _Stored, microbatch: int) -> None:
        """The last stage's weighted loss of ``stored.outputs``."""
        spec = stored.loss
        if spec is not None and spec.divisor is None and spec.weight == 0:
            # Nothing of this micro-batch counts (e.g. all padding): its mean may be NaN.
            stored.loss_value = torch.zeros((), device=self.device)
        elif spec is not None:
            loss = compute_loss(spec, self.value_of(stored.outputs))
            divisor = spec.divisor
            stored.loss_value = loss / divisor if divisor is not None else loss * spec.weight
            if torch.is_grad_enabled():  # the loss reaches the model, and the model only
                check_loss(stored.loss_value, self, stored.outputs, stored.inputs)

    # -- actions ----------------------------------------------------------------------------

    def forward(
        self,
        microbatch: int,
        inputs: Any,
        *,
        seed: int,
        remat: bool,
        loss: LossSpec | None = None,
        keep: bool = True,
    ) -> tuple[Any, torch.Tensor | None]:
        """Run F for one micro-batch.

        ``inputs`` must already be on this stage's device, as leaves (detached, with
        ``requires_grad`` where the previous stage's output needs a gradient). Returns the
        output and, on the last stage, the weighted loss, both detached. With
        ``keep=False`` (inference) nothing is stored for a backward.
        """
        if loss is not None and not self.is_last:
            raise RuntimeError(f"stage {self.index} is not the last stage; it computes no loss")
        with_graph = bool(keep and not remat)
        if torch.is_grad_enabled() != with_graph:  # (a step runs with autograd on: no switch)
            with torch.set_grad_enabled(with_graph):
                return self.forward(
                    microbatch, inputs, seed=seed, remat=remat, loss=loss, keep=keep
                )
        stored = _Stored(inputs, remat, seed, loss)
        # A re-materialized forward keeps the buffers it writes as it found them.
        saved = self.state.save() if keep and remat else None
        with self._metered():
            self._outputs_and_loss(stored, microbatch)
        stored.state = self.state.learned(saved)
        outputs, loss_value = stored.outputs, stored.loss_value
        if keep:
            if remat:
                stored.outputs = stored.loss_value = None  # dropped: recomputed in backward
            if self.meter is not None:
                stored.held = self.meter.hold(self.index, tensors_of(inputs))
            self._stored[microbatch] = stored
        detached_loss = loss_value.detach() if loss_value is not None else None
        if not keep:
            return detached(outputs, lambda t: False), detached_loss
        if remat:
            # Computed without a graph: a float output will need a gradient whenever
            # anything upstream of it (an input or a parameter of this stage) does.
            upstream = self.needs_grad(inputs)
            return detached(outputs, lambda t: upstream and t.is_floating_point()), detached_loss
        return detached(outputs, _requires_grad), detached_loss

    def backward(
        self,
        microbatch: int,
        grad_outputs: Sequence[torch.Tensor | None] | None,
        *,
        split: bool = False,
    ) -> list[torch.Tensor | None]:
        """Run B for one micro-batch and return the gradients of its inputs.

        ``grad_outputs`` aligns with :func:`tensors_of` of this stage's output (``None``
        for the last stage, whose backward starts from its loss); the result aligns with
        :func:`tensors_of` of its inputs. Parameter gradients are accumulated now, or
        with ``split=True`` left for :meth:`backward_weight` (zero-bubble schedules).
        """
        if not torch.is_grad_enabled():  # B builds graphs (a recomputation, loss * scale)
            with torch.enable_grad():
                return self.backward(microbatch, grad_outputs, split=split)
        stored = self._take(self._stored, microbatch, "stored forward", "F before B")
        if stored.remat and not split and len(self._groups()) > 1:
            return self._backward_by_groups(stored, grad_outputs, microbatch)
        if stored.remat:
            with self.recomputation(stored.state) as replay, self._metered():
                self._outputs_and_loss(stored, microbatch, replay)
        roots, grads = self._roots(stored, grad_outputs, microbatch)
        inputs = tensors_of(stored.inputs)
        if split:
            params = self.autograd_parameters() if self.autograd_parameters else []
            grad_inputs, work = backward_input(roots, grads, inputs, params)
            work.held = stored.held  # activations stay until W has run
            self._weight_work[microbatch] = work
            return grad_inputs
        if roots:
            run_backward(roots, grads)
        stored.held.clear()
        return grads_of(inputs)  # a user's input that requires grad: not a leaf, no .grad

    def _groups(self) -> list[range]:
        """The groups of ``checkpoint_layers`` layers a re-materialized backward recomputes
        one at a time (one group: the whole stage)."""
        n, size = len(self.layers), self.checkpoint_layers
        if size is None or size >= n or self.skips is not None:
            return [range(n)]
        return [range(start, min(start + size, n)) for start in range(0, n, size)]

    def _backward_by_groups(
        self, stored: _Stored, grad_outputs: Sequence[torch.Tensor | None] | None, microbatch: int
    ) -> list[torch.Tensor | None]:
        """B of a re-materialized micro-batch, recomputing one group of layers at a time."""
        groups = self._groups()
        upstream = any(t.requires_grad for t in tensors_of(stored.inputs))
        needs_grad = []  # does the input of each group need a gradient?
        for group in groups:
            needs_grad.append(upstream)
            upstream = upstream or any(
                p.requires_grad for i in group for p in self.layers[i].parameters()
            )
        with self.recomputation(stored.state) as replay, self._metered():
            kept = self._group_inputs(stored, groups, microbatch, replay)
            # Metered until B ends, as the memory model counts it: every group input at once.
            last_held = kept[-1][2]  # noqa: F841
            # From the last group down: recompute with autograd, differentiate, free.
            grads = grad_outputs
            for k in reversed(range(len(groups))):
                x, buffers, _ = kept.pop()
                leaf = (
                    stored.inputs
                    if k == 0
                    else detached(x, lambda t, k=k: needs_grad[k] and t.is_floating_point())
                )
                del x
                ModuleState.rebind(buffers)
                with torch.enable_grad():
                    out = self._guarded(leaf, microbatch, stored.seed, replay, groups[k])
                    if k == len(groups) - 1:
                        stored.outputs = out
                        self._loss(stored, microbatch)
                        roots, root_grads = self._roots(stored, grads, microbatch)
                        stored.outputs = stored.loss_value = None
                    else:
                        roots, root_grads = _differentiable(tensors_of(out), grads)
                    del out
                    if roots:
                        run_backward(roots, root_grads)
                    del roots, root_grads
                grads = grads_of(tensors_of(leaf))
                del leaf
        stored.held.clear()
        return grads

    def _group_inputs(
        self, stored: _Stored, groups: list[range], microbatch: int, replay: frozenset[int]
    ) -> list[tuple[Any, dict, list]]:
        """Without autograd: each group's input, the buffers it found, its meter tokens."""
        kept: list[tuple[Any, dict, list]] = []
        x = stored.inputs
        with torch.no_grad():
            for k, group in enumerate(groups):
                meter = self.meter if k else None  # the stage input is held already
                held = meter.hold(self.index, tensors_of(x)) if meter is not None else []
                kept.append((x, ModuleState.snapshot(stored.state, group), held))
                x = self._guarded(x, microbatch, stored.seed, replay, group)
        return kept

    def backward_weight(self, microbatch: int) -> None:
        """Run W for one micro-batch: the parameter gradients its split B left."""
        work = self._take(self._weight_work, microbatch, "split backward", "B (split) before W")
        with torch.enable_grad(), self.gathered():
            backward_weight(work)
        work.held.clear()

    def _take(self, kept: dict[int, Any], microbatch: int, what: str, order: str) -> Any:
        if microbatch not in kept:
            raise RuntimeError(
                f"stage {self.index} has no {what} of micro-batch {microbatch}; a schedule "
                f"must run {order} for each micro-batch"
            )
        return kept.pop(microbatch)

    def _roots(self, stored: _Stored, grad_outputs, microbatch: int):
        """The tensors backward starts from, with their gradients (None: a scalar loss)."""
        if self.is_last:
            loss = stored.loss_value
            if loss is None or not loss.requires_grad:
                return [], []
            return [loss if stored.loss.scale is None else loss * stored.loss.scale], [None]
        outputs = tensors_of(stored.outputs)
        grads = list(grad_outputs or [])
        if len(grads) != len(outputs):
            raise RuntimeError(
                f"stage {self.index} produced {len(outputs)} output tensors for micro-batch "
                f"{microbatch} but received {len(grads)} gradients"
            )
        return _differentiable(outputs, grads)

    def clear(self) -> None:
        """Forget every stored micro-batch (after a failed step)."""
        self._stored.clear()
        self._weight_work.clear()

    @property
    def pending(self) -> list[int]:
        """Micro-batches whose backward (or weight gradient) has not run yet."""
        return sorted(set(self._stored) | set(self._weight_work))


_UNMETERED = nullcontext()  # reusable: entering it does nothing


def _requires_grad(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad


def _differentiable(outputs: list[torch.Tensor], grads: Sequence) -> tuple[list, list]:
    """The outputs that need a gradient and got one, and those gradients."""
    pairs = [
        (t, g) for t, g in zip(outputs, grads, strict=True) if t.requires_grad and g is not None
    ]
    return [t for t, _ in pairs], [g for _, g in pairs]


def detached(value: Any, needs_grad: Callable[[torch.Tensor], bool]) -> Any:
    """Detached copies for the next stage, marked ``requires_grad`` where it needs a gradient."""

    if isinstance(value, torch.Tensor):  # the common boundary, without a closure or a walk
        return value.detach().requires_grad_(needs_grad(value))

    def detach(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.detach().requires_grad_(needs_grad(leaf))

    return tree_map(detach, value)
