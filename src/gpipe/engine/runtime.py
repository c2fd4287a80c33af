"""Runtime: walks each rank's action list, asking the transport for inputs.

The runtime knows nothing about schedules beyond their data (``gpipe.schedule``) and
nothing about where the neighbouring stages live (``gpipe.transport``). It drives:

* one process holding every stage: the ranks' lists are advanced round-robin, one
  action per rank per sweep, an action running as soon as its input has arrived. That
  is the clock-cycle order of the schedule, so on accelerators, where kernels are
  launched asynchronously, the devices work at once;
* one process per stage (or per group of virtual stages): a single list whose receives
  block until the neighbour has sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gpipe.base._utils import synchronize
from gpipe.engine.loss import LossSpec
from gpipe.engine.stage import Stage
from gpipe.schedule.ir import Action, Kind, Schedule, TimedAction
from gpipe.schedule.routes import Message, Routes

__all__ = ["Runtime", "StepInputs", "StepResult", "Transport"]


class Transport(Protocol):
    """What the runtime and the front end need from a transport (``gpipe.transport``)."""

    def begin(self, training: bool) -> None:
        """Start a step (training, or forwards only)."""

    def prepare(self, action: Action) -> None:
        """This rank is about to run ``action``: post what receives are due."""

    def send(self, message: Message, value: Any) -> None: ...

    def ready(self, message: Message) -> bool:
        """Whether ``recv(message)`` would return without waiting for another rank."""

    def recv(self, message: Message) -> Any: ...

    def finish(self) -> None:
        """End a step, once every rank has received all of its messages: complete every
        send."""

    def clear(self) -> None:
        """Drop whatever a failed step left in flight."""


@dataclass
class StepInputs:
    """Everything a step needs besides the model: micro-batches, losses, policy."""

    microbatches: Sequence[Any]  # inputs of stage 0, one per micro-batch
    seed: int
    remat: Sequence[bool]  # re-materialize micro-batch m?
    losses: Sequence[LossSpec] | None = None  # None: inference (forward only)


@dataclass
class StepResult:
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # weighted, detached
    outputs: dict[int, Any] = field(default_factory=dict)  # inference outputs
    trace: list[TimedAction] = field(default_factory=list)
    loss: torch.Tensor | None = None  # the mini-batch loss, filled in by the front end


@dataclass(frozen=True, slots=True)
class _Planned:
    """One action with what running it looks up, found once per runtime instead of at every
    step (a step of small micro-batches is mostly such bookkeeping)."""

    action: Action
    stage: Stage
    incoming: tuple[Message, ...]
    outgoing: tuple[Message, ...]
    final: bool  # its stage's last backward-side action of the step: gradients final after
    split: bool  # a backward of input gradients only (a W computes the weights')


class Runtime:
    """Executes ``schedule`` for the stages this process holds."""

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, Stage],
        transport: Transport,
        *,
        routes: Routes | None = None,
        before_final_backward: Callable[[Stage], None] | None = None,
        after_backward: Callable[[Stage], None] | None = None,
    ) -> None:
        self.schedule = schedule
        self.stages = dict(stages)
        self.transport = transport
        self.routes = routes or Routes(schedule.num_stages)
        self.ranks = sorted({schedule.stage_to_rank[s] for s in self.stages})
        # Called around a stage's last backward action of the step, after which its
        # gradients are final (data parallelism reduces them as they become so).
        self._before_final_backward = before_final_backward
        self._after_backward = after_backward
        final_backward: set[Action] = set()
        for stage in self.stages:
            rank = schedule.stage_to_rank[stage]
            done = [
                a for a in schedule.actions[rank] if a.stage == stage and a.kind is not Kind.FORWARD
            ]
            if done:
                final_backward.add(done[-1])
        # Each rank's actions, of a training step and of a forward-only one
        self._plans = {
            training: {
                rank: [
                    self._planned(a, final=a in final_backward)
                    for a in schedule.actions[rank]
                    if training or a.kind is Kind.FORWARD
                ]
                for rank in self.ranks
            }
            for training in (True, False)
        }

    def _planned(self, action: Action, *, final: bool) -> _Planned:
        split = action.kind is Kind.BACKWARD and self.schedule.splits_backward(
            action.stage, action.microbatch
        )
        incoming, outgoing = self.routes.incoming(action), self.routes.outgoing(action)
        return _Planned(action, self.stages[action.stage], incoming, outgoing, final, split)

    def run(
        self, step: StepInputs, *, trace: bool = False, clock_origin: float | None = None
    ) -> StepResult:
        """Run every local action of one step.

        With ``trace`` each action's start and end are recorded, in seconds since
        ``clock_origin`` (default: the start of this call). ``time.perf_counter`` is one
        clock for all processes of a machine, so ``clock_origin=0.0`` gives traces of
        several ranks that line up.
        """
        training = step.losses is not None
        lists = self._plans[training]
        cursors = dict.fromkeys(self.ranks, 0)
        result = StepResult()
        origin = time.perf_counter() if clock_origin is None else clock_origin
        remaining = sum(len(actions) for actions in lists.values())
        while remaining:
            progressed = False
            for rank in self.ranks:
                actions = lists[rank]
                if cursors[rank] == len(actions) or not self._ready(actions[cursors[rank]]):
                    continue
                planned = actions[cursors[rank]]
                if self._before_final_backward is not None and planned.final:
                    self._before_final_backward(planned.stage)
                self._execute(planned, step, result, training)
                if self._after_backward is not None and planned.final:
                    self._after_backward(planned.stage)
                if trace:
                    synchronize(planned.stage.device)
                    end = time.perf_counter() - origin
                    # From the moment its inputs were there: waiting is idle, not work.
                    start = self._inputs_ready_at - origin
                    result.trace.append(TimedAction(rank, planned.action, start, end))
                cursors[rank] += 1
                remaining -= 1
                progressed = True
            if not progressed:
                waiting = ", ".join(
                    f"rank {r}: {lists[r][cursors[r]].action}"
                    for r in self.ranks
                    if cursors[r] < len(lists[r])
                )
                raise RuntimeError(
                    f"schedule {self.schedule.name!r} cannot make progress; waiting: {waiting}. "
                    "Check it with Schedule.validate()."
                )
        return result

    def _ready(self, planned: _Planned) -> bool:
        return all(self.transport.ready(message) for message in planned.incoming)

    def _execute(
        self, planned: _Planned, step: StepInputs, result: StepResult, training: bool
    ) -> None:
        action, stage, m = planned.action, planned.stage, planned.action.microbatch
        self.transport.prepare(action)
        received = [self.transport.recv(message) for message in planned.incoming]
        self._inputs_ready_at = time.perf_counter()
        if action.kind is Kind.FORWARD:
            if stage.index == 0:
                received.insert(0, step.microbatches[m])
            value, popped = received[0], received[1:]
            if stage.skips is not None:
                value = (value, dict(zip(stage.skips.inputs, popped, strict=True)))
            loss = step.losses[m] if training and stage.is_last else None
            outputs, loss_value = stage.forward(
                m, value, seed=step.seed, remat=step.remat[m], loss=loss, keep=training
            )
            if stage.is_last:
                if training:
                    result.losses[m] = loss_value
                else:
                    result.outputs[m] = stage.value_of(outputs)
            sent = [stage.value_of(outputs)] if not stage.is_last else []
            if stage.skips is not None:
                sent += list(outputs[1].values())
        elif action.kind is Kind.BACKWARD:
            # Gradients of this stage's output tensors, then of its stashes (one each).
            grads = None
            if received:
                head = [] if stage.is_last else list(received.pop(0))
                grads = head + [g for (g,) in received]
            grad_inputs = stage.backward(m, grads, split=planned.split)
            popped = len(stage.skips.inputs) if stage.skips is not None else 0
            value_grads = grad_inputs[: len(grad_inputs) - popped]
            sent = ([value_grads] if stage.index > 0 else []) + [
                [g] for g in grad_inputs[len(grad_inputs) - popped :]
            ]
        else:
            stage.backward_weight(m)
            sent = []
        for message, value in zip(planned.outgoing, sent, strict=True):
            self.transport.send(message, value)
