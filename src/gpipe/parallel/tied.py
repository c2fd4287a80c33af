"""Tied weights: one parameter used by several stages (an embedding and the output head).

A tied parameter cannot live on two devices or in two processes, so every stage that uses
it holds a copy, and the copies are kept equal the way the un-split model keeps its one
tensor: they start equal (the copy of the last stage that uses it is the reference, as
when a model is initialized layer by layer and the last initialization wins), and once
per step each copy's gradient is replaced by the sum over all copies — the gradient of
the one shared tensor. Equal values, equal gradients and the same optimizer keep them
equal, bit for bit.

The holders exchange their copies through the Pipe's group (``gpipe.parallel.group``: on
one process, moves to the reference copy's device; across processes, point to point by the
transport, ``DistributedTransport.swap``) and every holder adds them in the same (stage)
order, so all copies get the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gpipe._utils import local_value

__all__ = ["TiedError", "TiedParameters"]

# (holder stages, {local stage: tensor}) -> {every holder stage: its tensor}
Exchange = Callable[[list[int], dict[int, torch.Tensor]], dict[int, torch.Tensor]]


class TiedError(ValueError):
    """A ``tied=`` declaration that does not match the model."""


@dataclass
class _Tie:
    names: list[str]  # whole-model parameter names, as declared
    stages: list[int]  # the stages holding them, ascending, without repeats
    copies: dict[int, nn.Parameter]  # stage -> this process's copy (local stages only)
    names_at: dict[int, list[str]] = field(default_factory=dict)  # local stage -> its names


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), attr


class TiedParameters:
    """The tie groups of a Pipe and the copies this process holds."""

    def __init__(
        self,
        model: nn.Module,
        groups: Sequence[Sequence[str]],
        *,
        stage_of_layer: dict[str, int],
        local_stages: set[int],
        devices: Sequence[torch.device],
    ) -> None:
        self._model = model
        every = dict(model.named_parameters(remove_duplicate=False))
        problems, self.ties = [], []
        for group in groups:
            names = list(group)
            unknown = [n for n in names if n not in every]
            if unknown:
                problems.append(f"tied names {unknown} are not parameters of the model")
                continue
            shapes = {tuple(every[n].shape) for n in names}
            if len(shapes) > 1:
                problems.append(f"tied parameters {names} have different shapes {sorted(shapes)}")
                continue
            stages = sorted({stage_of_layer[n.split(".")[0]] for n in names})
            self.ties.append(_Tie(names, stages, {}))
        if problems:
            raise TiedError("invalid tied=:\n" + "\n".join(f"- {p}" for p in problems))
        # Every local holder stage needs its own copy (names in one stage share it). Each
        # keeps the caller's Parameter object where it can, so that an optimizer built
        # before the Pipe holds the copy this process trains: only a second holder stage in
        # one process gets a new copy, gpipe's own, which refresh() keeps equal to the
        # reference (the last holder's). In a process that builds only its own layers the
        # reference may be on meta: start from the local value, which sync_values() then
        # replaces.
        for tie in self.ties:
            claimed: set[int] = set()
            for stage in reversed(tie.stages):  # the reference first: it keeps the caller's
                if stage not in local_stages:
                    continue
                here = [n for n in tie.names if stage_of_layer[n.split(".")[0]] == stage]
                copy = every[here[-1]]
                if id(copy) in claimed:
                    source = every[tie.names[-1]]
                    if source.device.type == "meta":
                        source = every[here[0]]
                    copy = nn.Parameter(
                        source.detach().to(devices[stage], copy=True),
                        requires_grad=source.requires_grad,
                    )
                for name in here:
                    module, attr = _owner(model, name)
                    setattr(module, attr, copy)
                claimed.add(id(copy))
                tie.copies[stage] = copy
                tie.names_at[stage] = here

    def rebind(self) -> None:
        """Hold the parameters the model holds now: sharding (``gpipe.parallel.sharded``)
        replaces each by its shard. A sharded copy's exchanges carry its local shard, which
        matches the other holders' (the same replicas, the same layout)."""
        for tie in self.ties:
            for stage, names in tie.names_at.items():
                module, attr = _owner(self._model, names[0])
                tie.copies[stage] = getattr(module, attr)

    def extra_copies(self) -> set[int]:
        """ids of the local copies other than the reference: the un-split model has none."""
        return {
            id(copy)
            for tie in self.ties
            for stage, copy in tie.copies.items()
            if stage != tie.stages[-1]
        }

    def check_one_copy_per_process(self) -> None:
        """Across processes each process may hold one copy of a tie (its exchange is 1:1)."""
        for tie in self.ties:
            if len(tie.copies) > 1:
                raise TiedError(
                    f"tied parameters {tie.names} are used by stages {sorted(tie.copies)}, which "
                    "this process holds together (virtual stages); across processes each "
                    "process may hold one of them: change balance or the schedule"
                )

    def refresh(self) -> None:
        """Before each step: this process's extra copies take the reference's value again,
        and drop the gradient the last step gave them.

        An optimizer built before the Pipe holds the caller's Parameter, the reference, and
        updates only it; the extra copy is gpipe's. Its gradient duplicated the reference's
        sum, which the reference still carries (or the optimizer cleared): kept, it would
        be counted again when gradients accumulate over steps.
        """
        with torch.no_grad():
            for tie in self.ties:
                reference = tie.copies[max(tie.copies)] if tie.copies else None
                for copy in tie.copies.values():
                    if copy is not reference:
                        copy.copy_(reference)
                        copy.grad = None

    def sync_values(self, exchange: Exchange) -> None:
        """Make every copy equal to the reference copy (the last holder's)."""
        for tie in self.ties:
            if tie.copies:
                mine = {stage: local_value(copy.detach()) for stage, copy in tie.copies.items()}
                reference = exchange(tie.stages, mine)[tie.stages[-1]]
                with torch.no_grad():
                    for copy in tie.copies.values():
                        local_value(copy).copy_(reference)

    def sync_gradients(self, exchange: Exchange) -> None:
        """Every copy's gradient becomes the sum over all copies, added in stage order on
        every holder, so that all copies get the same bits."""
        for tie in self.ties:
            if not tie.copies:
                continue
            mine = {
                stage: local_value(copy.grad)
                if copy.grad is not None
                else torch.zeros_like(local_value(copy))
                for stage, copy in tie.copies.items()
            }
            everyone = exchange(tie.stages, mine)
            total = torch.zeros_like(everyone[tie.stages[-1]])
            for holder in tie.stages:
                total += everyone[holder]
            for copy in tie.copies.values():
                if hasattr(copy.grad, "to_local"):  # a shard (its reduce-scatter made it)
                    copy.grad.to_local().copy_(total)
                else:
                    copy.grad = total.to(copy.device, copy=True)
