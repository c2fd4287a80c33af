"""Where a Pipe's ranks live: all in this process, or one per process of a group.

:func:`pipeline_group` turns ``Pipe(group=...)`` into a :class:`PipelineGroup` (every stage
in this process) or a :class:`MultiProcess` (the stages of one rank of a
``torch.distributed`` group), which answer the same methods: the front end (``gpipe.pipe``)
never asks "which one am I?" and never touches ``torch.distributed``. Everything the ranks
must agree on goes through a ``MultiProcess``: the step's random seed, the loss, who failed
first, the gradient norm, tied copies, the automatic balance.

A failure in one rank is announced to its peers through the transport (``_announce``) and
then agreed on in the step's last row, so that all ranks raise the same first error instead
of waiting for messages that will never come. The step's rows (rank 0's seed first, every
rank's agreement last) travel on the transport's own wire; their failures are named as every
failed wait's (``gpipe.transport.inquest``). Which carrier moves the messages is
``gpipe.transport.choice``'s; how a collective is bounded and named,
``gpipe.parallel.collectives``'.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpipe.base import rng
from gpipe.base._utils import DeviceLike
from gpipe.base.errors import NonFiniteError, PartitionError, PipelineError
from gpipe.engine.runtime import Transport
from gpipe.engine.stage import Stage
from gpipe.parallel.clipping import Edit, check_edits
from gpipe.parallel.collectives import Collectives
from gpipe.parallel.tied import TiedParameters
from gpipe.schedule.ir import Schedule
from gpipe.schedule.routes import Routes
from gpipe.transport.choice import check_choice, open_transport
from gpipe.transport.framing import AGREEMENT, SEED
from gpipe.transport.inquest import said_by, waited_out
from gpipe.transport.local import LocalTransport
from gpipe.transport.peers import PeerTransport

__all__ = ["Agreement", "MultiProcess", "PipelineGroup", "default_device", "pipeline_group"]

T = TypeVar("T")


@dataclass
class Agreement:
    """What every rank agreed on at the end of a step."""

    loss: torch.Tensor | None  # the step's loss (float64), on every rank; None: inference
    nonfinite_grads: bool  # a gradient of some rank holds a NaN or an infinity


def default_device(group: Any) -> torch.device:
    """Where a process computes unless told: with a process group under NCCL, its
    ``cuda:LOCAL_RANK``; otherwise the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def pipeline_group(group: Any, *, timeout: float, transport: str = "auto") -> PipelineGroup:
    """The ranks of a Pipe: ``group=None`` is one process, else a process group."""
    check_choice(transport)
    if group is None:
        return PipelineGroup()
    return MultiProcess(group, timeout=timeout, transport=transport)


class PipelineGroup:
    """What the front end asks of a Pipe's ranks, wherever they are; here, every stage in
    this process: its transport is device copies, and a failed step leaves it ready for the
    next one. :class:`MultiProcess` overrides each method but those written through
    ``gather`` (``check_same``, ``decide``)."""

    rank: int | None = None  # this process's rank in the pipeline; None: every rank is here
    clock_origin: float | None = None  # where traces count from (None: each step's start)
    broken: str | None = None  # why a step failed such that no further step can run

    def default_devices(self, num_ranks: int) -> list[DeviceLike]:
        """Devices when the user gave none."""
        return ["cpu"] * num_ranks

    def device_problems(self, devices: list[DeviceLike]) -> list[str]:
        """What is wrong with the user's ``devices`` here (bulleted lines)."""
        return []

    def local_stages(self, schedule: Schedule) -> list[int]:
        """The stages this process builds and runs."""
        return list(range(schedule.num_stages))

    def connect(
        self, schedule: Schedule, stage_devices: list[torch.device], routes: Routes
    ) -> Transport:
        """The transport of this process's stages."""
        return LocalTransport(stage_devices)

    def begin_step(self, seed: int | None, batch: int | None) -> tuple[int, int | None]:
        """The step's seed, and the batch size of the first stage's inputs, on every rank."""
        return (rng.draw_step_seed() if seed is None else seed), batch

    def check_same(self, configuration: dict[str, Any]) -> None:
        """Refuse to start unless every rank was given the same configuration (each value
        written as the user would, ``gpipe.pipe.partition.fingerprint``; through ``gather``:
        one process has nothing to compare)."""
        everyone = self.gather(configuration, "every rank's configuration")
        differences = [
            f"- {key}: rank {rank} has {theirs[key]}, rank 0 has {everyone[0][key]}"
            for rank, theirs in enumerate(everyone)
            for key in configuration
            if theirs.get(key) != everyone[0].get(key)
        ]
        if differences:
            raise PartitionError(
                "the ranks of this pipeline were built differently; every rank must run the "
                "same script with the same model and Pipe arguments:\n" + "\n".join(differences)
            )

    def agree(
        self,
        local_loss: torch.Tensor | None,
        loss_value: float | None,
        trouble: str | None,
        *,
        refuse_nonfinite: bool = True,
        why: str = "",
    ) -> Agreement:
        """The step's loss on every rank (``loss_value``: this rank's ``local_loss``, read
        already). A failure anywhere raises; so does a non-finite loss or gradient anywhere
        unless ``refuse_nonfinite`` is False (a GradScaler skips such steps; ``why`` says
        what made the loss non-finite, when known)."""
        loss = None if local_loss is None else local_loss.detach().to(torch.float64)
        if refuse_nonfinite:
            found = f"a non-finite gradient of {trouble!r}" if trouble else ""
            refuse_step(loss_value if loss_value is not None else 0.0, [why, found])
        return Agreement(loss, trouble is not None)

    def check_edit(self, edit: Edit) -> None:
        """Before an optimizer step: refuse, on every rank alike, a per-stage clip of the
        step's gradients (``edit``: what this rank's script did to them since the step,
        ``gpipe.parallel.clipping``). One process: torch's own clip sees the whole model."""

    def fail(self, error: BaseException, stages: list[Stage]) -> None:
        """This process's step failed with ``error``: tell whoever must know (nobody here)."""

    def norm_total(self, local: torch.Tensor, *, maximum: bool) -> torch.Tensor:
        """A gradient norm's term summed (or maxed) over the pipeline's ranks."""
        return local

    def exchange(
        self, holders: list[int], mine: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Every holder stage's tensor of a tie, from this process's (``mine``): here all,
        gathered on the last holder's device."""
        device = mine[holders[-1]].device
        return {stage: mine[stage].to(device) for stage in holders}

    def decide(self, choose: Callable[[], T]) -> T:
        """``choose()`` on rank 0, its answer on every rank (timings differ by process)."""
        mine = choose() if self.rank in (None, 0) else None
        return self.gather(mine, "the automatic balance (balance='auto')")[0]

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (plain data), by rank, while building: what each rank found
        (``what`` names it in a timeout's error)."""
        return [value]

    def tie(self, tied: TiedParameters) -> None:
        """Make the tied copies equal before the first step."""
        tied.sync_values(self.exchange)

    def __str__(self) -> str:
        return "one process"


class MultiProcess(PipelineGroup):
    """The stages of one rank of a ``torch.distributed`` process group."""

    rank: int | None
    clock_origin: float | None = 0.0  # perf_counter is one clock per machine: traces line up
    broken: str | None = None  # what failed, once a step has: the ranks may disagree

    def __init__(self, group: Any, *, timeout: float, transport: str = "auto") -> None:
        self.group, self.timeout, self.wanted_transport = group, timeout, transport
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.steps = 0  # steps begun, for errors that say what this rank was doing
        self.transport: PeerTransport | None = None
        self.ops = Collectives(group, timeout=timeout, device=default_device(group))

    def _collective(self, run: Callable[..., T], *args: Any, failing: bool = False, **kw: Any) -> T:
        """``run(*args, **kw)``'s collectives once connected, refused after a failed step
        (unless ``failing``: that step's own agreement); one that does not complete breaks
        this pipeline, and the peers are told (they would wait in vain)."""
        if self.broken is not None and not failing:
            raise PipelineError(f"rank {self.rank}: this pipeline failed in an earlier step "
                                f"({self.broken}); build a new Pipe")  # fmt: skip
        try:
            return run(*args, **kw)
        except PipelineError as error:
            if self.broken is None:
                self._announce(error, gave_up=True)
            raise

    def _announce(self, error: PipelineError, *, gave_up: bool) -> int:
        """Break this pipeline with ``error`` and tell the peers (``gave_up``: this rank
        leaves without agreeing on it); the pipeline rank that failed first."""
        origin, culprit = error.rank, error.global_rank
        if culprit is None and origin is not None:
            culprit = dist.get_global_rank(self.group, origin)
        origin = self.rank if origin is None else origin
        self.broken = str(error)
        self.transport.announce_failure(origin, culprit, self.broken, gave_up=gave_up)
        return origin

    # -- the end of a step: the loss, who failed first, a non-finite gradient anywhere -----

    def _gather(self, value: float, failed: int, troubled: bool = False) -> torch.Tensor:
        """Every rank's (value, failed rank + 1 or 0, non-finite gradient), one row per
        pipeline rank. The rows themselves say who failed (a failed rank sends its row after
        its notice)."""
        row = torch.tensor([value, failed + 1, troubled], dtype=torch.float64)
        operation = "the end-of-step agreement (all-gather)"
        doing = f"ending step {self.steps} of this Pipe"
        send = self.transport.row  # failed: this rank's row after its notice
        return self._collective(send, AGREEMENT, row, operation, doing, failing=failed >= 0)

    def agree(
        self,
        local_loss: torch.Tensor | None,
        loss_value: float | None,
        trouble: str | None,
        *,
        refuse_nonfinite: bool = True,
        why: str = "",
    ) -> Agreement:
        """The loss on every rank (it lives on the last stage's), and a last health check:
        a failure or a non-finite loss or gradient (``trouble``) anywhere (unless
        ``refuse_nonfinite`` is False) refuses the step on every rank."""
        value = loss_value if loss_value is not None else 0.0
        rows = self._gather(value, -1, troubled=trouble is not None)
        table = rows.tolist()  # one read of the agreement
        if failed := [int(row[1]) - 1 for row in table if row[1]]:
            # The failed ranks' words came in their notices, ahead of their rows.
            origin = min(failed)
            said = said_by(dist.get_global_rank(self.group, origin))
            self.broken = said or f"rank {origin} failed"
            raise PipelineError(
                f"rank {self.rank}: the step failed elsewhere: {self.broken}", rank=origin
            )
        loss = table[self.schedule.stage_to_rank[-1]][0]
        nonfinite_grads = any(row[2] for row in table)
        if refuse_nonfinite and (nonfinite_grads or not math.isfinite(loss)):
            found = f"rank {self.rank}: a non-finite gradient of {trouble!r}" if trouble else ""
            if why:
                found = f"rank {self.rank}: {why}" + (f"; {found}" if found else "")
            what = "the gather of what made the step non-finite"
            doing = f"ending step {self.steps}"
            refuse_step(
                loss, self._collective(self.ops.all_gather_object, found, what, doing=doing)
            )
        # The same on every rank; float64 holds a float32 or float64 loss exactly.
        return Agreement(torch.tensor(loss, dtype=torch.float64), nonfinite_grads)

    def check_edit(self, edit: Edit) -> None:
        """Every rank's edit of the step's gradients, gathered when its optimizer steps (one
        row each); a per-stage clip raises on every rank before any weight changes."""
        doing = f"checking the gradients of step {self.steps} before the optimizer step"
        row = torch.tensor(edit.row(), dtype=torch.float64)
        # A collective, not the transport's rows: those are frames of a step's sequences,
        # and this row comes between two steps (and is of another length).
        operation = "the clip check (all-gather)"
        rows = self._collective(self.ops.all_gather, row, operation, doing=doing)
        check_edits(rows, describe=lambda rank: f"rank {rank}")

    def fail(self, error: BaseException, stages: list[Stage]) -> None:
        """Tell the other ranks this step failed here (or upstream), then agree on who."""
        if self.broken is not None:  # a collective of this step failed here: peers told
            return
        me = dist.get_global_rank(self.group, self.rank)
        if not isinstance(error, PipelineError):  # raised here (else this rank only waited)
            held = ", ".join(str(s.index) for s in stages)
            words = f"rank {me} (stage {held}) raised {type(error).__name__}: {error}"
            error.add_note(f"raised in pipeline rank {self.rank} (stage {held})")
            error = PipelineError(words, rank=self.rank, global_rank=me)
        # Its own wait failed: it waited a timeout for a rank that may never answer. It gives
        # up (and says so) instead of waiting for that rank again in the agreement; so it
        # does when a peer gave up (a collective of its failed): nobody would come to agree.
        # Either way the ranks still waiting on it hear its words.
        gave_up = waited_out(me, timeout=self.timeout) or self.transport.peer_gave_up()
        origin = self._announce(error, gave_up=gave_up)
        if not gave_up:  # the peers have its words; the original error is what it raises
            with contextlib.suppress(Exception):
                self._gather(0.0, failed=origin)

    # -- devices and stages -------------------------------------------------------------------

    def default_devices(self, num_ranks: int) -> list[DeviceLike]:
        return [default_device(self.group)] * self.num_ranks

    def device_problems(self, devices: list[DeviceLike]) -> list[str]:
        if len(devices) == self.num_ranks:
            return []
        return [
            f"devices has {len(devices)} entries but the process group has "
            f"{self.num_ranks} ranks; give one device per rank"
        ]

    def local_stages(self, schedule: Schedule) -> list[int]:
        return list(schedule.stages_of(self.rank))

    def connect(
        self, schedule: Schedule, stage_devices: list[torch.device], routes: Routes
    ) -> PeerTransport:
        self.schedule = schedule
        self.transport = open_transport(
            schedule, self.rank, self.group, stage_devices, routes=routes, timeout=self.timeout,
            wanted=self.wanted_transport, gather=self.gather,
        )  # fmt: skip
        self.ops.device = self.transport.wire_device  # where collectives take tensors
        return self.transport

    # -- what every rank must agree on ----------------------------------------------------

    def begin_step(self, seed: int | None, batch: int | None) -> tuple[int, int | None]:
        """The step's seed (``seed``, or rank 0's draw) and the batch size of the inputs,
        which rank 0 (the first stage's) has, on every rank. Rank 0's row goes ahead of its
        first message: no rank waits for the others to come to the step.

        Every rank draws (and all but rank 0 discard it), so that every rank's global
        generator advances alike: what a script samples from it after the step (its next
        batch, a shuffled DataLoader's order) stays the same on every rank.
        """
        drawn = rng.draw_step_seed() if seed is None else seed
        values = torch.tensor([drawn, -1 if batch is None else batch], dtype=torch.int64)
        self.steps += 1
        doing = f"starting step {self.steps} of this Pipe"
        send = self.transport.row
        values = self._collective(send, SEED, values, "the step-seed broadcast", doing)
        seed, first_batch = values.tolist()
        return seed, (None if first_batch < 0 else first_batch)

    def norm_total(self, local: torch.Tensor, *, maximum: bool) -> torch.Tensor:
        """Replicas hold equal gradients after averaging: reducing over the pipeline suffices
        (after a failed step: refused, as every collective is)."""
        total = self._collective(
            self.ops.all_reduce,
            local.reshape(1),
            "the clip_grad_norm_ all-reduce",
            maximum=maximum,
            doing=f"clip_grad_norm_ after step {self.steps} of this Pipe",
        )
        return total.reshape(())

    def exchange(
        self, holders: list[int], mine: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Swap this process's tensor (``mine`` has one entry: checked by ``tie``) with every
        other holder stage's rank: between steps, through the group's own point-to-point
        (not the step's frames); the wait is a collective's, bounded and named."""
        ((stage, tensor),) = mine.items()
        rank_of = self.schedule.stage_to_rank
        doing = f"step {self.steps} of this Pipe" if self.steps else "building the Pipe"
        wire = tensor.to(self.transport.wire_device).contiguous()
        by_rank, ops = {self.rank: wire}, []
        for other in holders:
            if other != stage:
                peer = dist.get_global_rank(self.group, rank_of[other])
                by_rank[rank_of[other]] = received = torch.empty_like(wire)
                ops += [dist.P2POp(dist.isend, wire, peer, self.group),
                        dist.P2POp(dist.irecv, received, peer, self.group)]  # fmt: skip
        if ops:
            start = lambda: dist.batch_isend_irecv(ops)  # noqa: E731
            self._collective(self.ops.wait, "the tied-weight exchange", start, doing=doing)
        return {holder: by_rank[rank_of[holder]] for holder in holders}

    def tie(self, tied: TiedParameters) -> None:
        tied.check_one_copy_per_process()
        tied.sync_values(self.exchange)

    def __str__(self) -> str:
        return f"rank {self.rank}"

    def gather(self, value: Any, what: str) -> list[Any]:
        # Before the transport (a build that fails leaves no Pipe to break): a plain collective.
        return self.ops.all_gather_object(value, f"the gather of {what}", doing="building the Pipe")


def refuse_step(loss: float, troubles: list[str]) -> None:
    found = [t for t in troubles if t]
    if found or not math.isfinite(loss):
        raise NonFiniteError(
            f"the step was refused (the loss is {loss:g}"
            + (f"; {'; '.join(found)}" if found else "")
            + "): its gradients were dropped, so the weights stay as they were; lower the "
            "learning rate, clip gradients, or look for the layer or input that overflows "
            "(mixed precision with a torch.amp.GradScaler: pass step(..., scaler=scaler), "
            "which skips such steps and lowers the scale instead)"
        )
