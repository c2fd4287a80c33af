"""Tied weights: one parameter used by several stages (an embedding and the output head).

Stages that share a device share the tensor itself: in one process on one device a tie is the
caller's one Parameter, autograd sums its uses, and nothing can ever differ. A tensor cannot
live on two devices or in two processes, so there every holder keeps a copy, and the copies
are kept equal the way the un-split model keeps its one tensor: they start equal (to the last
stage's value, as when a model is initialized layer by layer and the last initialization
wins), and once per step the copies' gradients are summed:

* across processes each process holds one copy, the caller's Parameter (its optimizer holds
  it, built before or after the Pipe); each copy's gradient becomes the sum over all copies,
  added in stage order on every holder, so equal values, equal gradients and the same
  optimizer keep the copies equal, bit for bit;
* in one process, the first holder's copy is the caller's Parameter (the reference) and a copy
  on another device is gpipe's own: not among the Pipe's ``parameters()`` (a tied tensor is
  one parameter under its first name, as in the un-split model, so an optimizer or a norm
  counts it once), its gradient moved into the reference's, its value the reference's again
  after every optimizer step (a global post-step hook) and before every step.

A frozen tie (``requires_grad=False``) keeps ``grad`` None and exchanges nothing (freeze it on
every rank alike). The holders exchange their copies through the Pipe's group
(``gpipe.parallel.group``: across processes through the group's point-to-point,
``MultiProcess.exchange``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from gpipe.base._utils import local_value

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

    @property
    def reference(self) -> nn.Parameter:
        """This process's reference copy: its first holder's, the caller's Parameter (so it
        has the name the un-split model lists it under)."""
        return self.copies[min(self.copies)]

    def extras(self) -> list[nn.Parameter]:
        """This process's copies other than the reference (one per other device)."""
        reference, seen, extras = self.reference, set(), []
        for copy in self.copies.values():
            if copy is not reference and id(copy) not in seen:
                seen.add(id(copy))
                extras.append(copy)
        return extras


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, attr = name.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), attr


def _place_copies(
    tie: _Tie,
    model: nn.Module,
    every: dict[str, nn.Parameter],
    stage_of_layer: dict[str, int],
    local_stages: set[int],
    devices: Sequence[torch.device],
) -> None:
    """Each local holder stage holds the tensor on its device: the caller's Parameter where
    it can (an optimizer built before the Pipe holds it), shared by the stages on one
    device; a stage on another device gets gpipe's own copy (of the last name's value,
    which sync_values() gives every copy). In a process that builds only its own layers
    the reference may be on meta: start from the local value, which sync_values() then
    replaces."""
    held: dict[torch.device, nn.Parameter] = {}  # this process's copy on each device
    for stage in tie.stages:  # the reference first: it keeps the caller's
        if stage not in local_stages:
            continue
        here = [n for n in tie.names if stage_of_layer[n.split(".")[0]] == stage]
        device = _placed(devices[stage])
        copy = held.get(device)
        if copy is None:
            copy = every[here[-1]]
            if not held and copy.device.type != "meta" and copy.device != device:
                # placed with a later stage that uses it: the reference lives here
                copy.data = copy.data.to(device)
            elif any(copy is other for other in held.values()):
                source = every[tie.names[-1]]
                if source.device.type == "meta":
                    source = every[here[0]]
                copy = nn.Parameter(
                    source.detach().to(device, copy=True),
                    requires_grad=source.requires_grad,
                )
            held[device] = copy
        for name in here:
            module, attr = _owner(model, name)
            setattr(module, attr, copy)
        tie.copies[stage] = copy
        tie.names_at[stage] = here


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
        for tie in self.ties:
            _place_copies(tie, model, every, stage_of_layer, local_stages, devices)
        if self.extra_copies():
            self._follow_optimizers()

    def _follow_optimizers(self) -> None:
        """After any optimizer step that updated a reference copy, the extra copies take its
        value: the caller's model, ``state_dict()`` and the next forward read equal copies."""
        references = {id(tie.reference) for tie in self.ties if tie.extras()}
        this = weakref.ref(self)

        def after_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
            tied = this()
            if tied is not None and any(
                id(p) in references for group in optimizer.param_groups for p in group["params"]
            ):
                tied.refresh_values()

        weakref.finalize(self, register_optimizer_step_post_hook(after_step).remove)

    def rebind(self) -> None:
        """Hold the parameters the model holds now: sharding (``gpipe.parallel.sharded``)
        replaces each by its shard. A sharded copy's exchanges carry its local shard, which
        matches the other holders' (the same replicas, the same layout)."""
        for tie in self.ties:
            for stage, names in tie.names_at.items():
                module, attr = _owner(self._model, names[0])
                tie.copies[stage] = getattr(module, attr)

    def extra_copies(self) -> set[int]:
        """ids of gpipe's own copies (another device than the reference's, in this process):
        the un-split model has none, and the Pipe does not list them as parameters."""
        return {id(copy) for tie in self.ties if tie.copies for copy in tie.extras()}

    def counted_elsewhere(self) -> set[int]:
        """ids of this process's copies that another process's copy stands for in a norm over
        the whole model: every copy but the last holder's (a tied tensor counts once)."""
        return {
            id(copy)
            for tie in self.ties
            if tie.copies and tie.stages[-1] not in tie.copies
            for copy in tie.copies.values()
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
        """Before each step: the extra copies take the reference's value and freezing again,
        and hold no gradient (theirs went into the reference's)."""
        self.refresh_values()
        for tie in self.ties:
            for copy in tie.extras() if tie.copies else ():
                copy.grad = None
                copy.requires_grad_(tie.reference.requires_grad)

    def refresh_values(self) -> None:
        """The extra copies take the reference's value (it is the one the optimizer holds)."""
        with torch.no_grad():
            for tie in self.ties:
                for copy in tie.extras() if tie.copies else ():
                    copy.copy_(tie.reference)

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
        """The reference's gradient becomes the gradient of the one shared tensor: the extra
        copies' gradients move into it, and across processes each copy's gradient becomes
        the sum over all copies, added in stage order on every holder (the same bits)."""
        for tie in self.ties:
            if not tie.copies:
                continue
            reference = tie.reference
            for copy in tie.extras():
                if copy.grad is not None and reference.requires_grad:
                    moved = copy.grad.to(reference.device)
                    reference.grad = moved if reference.grad is None else reference.grad + moved
                copy.grad = None
            if not reference.requires_grad or len(tie.copies) == len(tie.stages):
                continue  # frozen, or every holder is here: nothing to exchange
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


def _placed(device: torch.device) -> torch.device:
    """The device a tensor placed on ``device`` reports (``cuda`` -> ``cuda:0``, ``cpu:0`` ->
    ``cpu``): stages on one device share a tied tensor."""
    return torch.empty(0, device=device).device
