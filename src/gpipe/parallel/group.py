"""Where a Pipe's ranks live: all in this process, or one per process of a group.

:func:`pipeline_group` turns ``Pipe(group=...)`` into one of two objects with the same
methods (:class:`PipelineGroup`), so that the front end (``gpipe.pipe``) never asks "which
one am I?" and never touches ``torch.distributed``:

* :class:`SingleProcess` holds every stage; its transport is device copies, and a failed
  step leaves it ready for the next one;
* :class:`MultiProcess` holds the stages of one rank of a ``torch.distributed`` group.
  Everything the ranks must agree on goes through it: the step's random seed, the loss,
  who failed first, the gradient norm, tied copies, the automatic balance.

A failure in one rank is announced to its peers through the transport and then agreed on
by every rank (``fail``/``agree``), so that all ranks raise the same first error instead
of waiting for messages that will never come. Every collective waits at most the Pipe's
``timeout`` (``gpipe.parallel.collectives``): one that does not complete names itself and
breaks the pipeline, and its rank tells the others, which then raise at once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from gpipe import rng
from gpipe._utils import DeviceLike
from gpipe.engine.runtime import Transport
from gpipe.engine.stage import Stage
from gpipe.errors import NonFiniteError, PartitionError, PipelineError
from gpipe.parallel.clipping import Edit, check_edits
from gpipe.parallel.collectives import Collectives
from gpipe.parallel.tied import TiedParameters
from gpipe.schedule.ir import Schedule
from gpipe.schedule.routes import Routes
from gpipe.transport import handshake
from gpipe.transport.distributed import DistributedTransport
from gpipe.transport.inquest import state, waited_out
from gpipe.transport.local import LocalTransport
from gpipe.transport.peers import PeerTransport
from gpipe.transport.sockets import SocketTransport

__all__ = [
    "Agreement",
    "MultiProcess",
    "PipelineGroup",
    "SingleProcess",
    "default_device",
    "pipeline_group",
]

T = TypeVar("T")
ByStage = dict[int, torch.Tensor]  # a tensor per stage


@dataclass
class Agreement:
    """What every rank agreed on at the end of a step."""

    loss: torch.Tensor | None  # the step's loss (float64), on every rank; None: inference
    nonfinite_grads: bool  # a gradient of some rank holds a NaN or an infinity


class PipelineGroup(Protocol):
    """What the front end asks of a Pipe's ranks, wherever they are."""

    rank: int | None  # this process's rank in the pipeline; None: every rank is here
    clock_origin: float | None  # where traces count from (None: each step's start)
    broken: str | None  # why a step failed such that no further step can run

    def default_devices(self, num_ranks: int) -> list[DeviceLike]:
        """Devices when the user gave none."""

    def device_problems(self, devices: list[DeviceLike]) -> list[str]:
        """What is wrong with the user's ``devices`` here (bulleted lines)."""

    def local_stages(self, schedule: Schedule) -> list[int]:
        """The stages this process builds and runs."""

    def connect(
        self, schedule: Schedule, stage_devices: list[torch.device], routes: Routes
    ) -> Transport:
        """The transport of this process's stages."""

    def check_same(self, configuration: dict[str, Any]) -> None:
        """Refuse to start unless every rank was given the same configuration."""

    def decide(self, choose: Callable[[], T]) -> T:
        """``choose()``, one answer for every rank."""

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (plain data), by rank, while building: what each rank found
        (``what`` names it in a timeout's error)."""

    def tie(self, tied: TiedParameters) -> None:
        """Make the tied copies equal before the first step."""

    def begin_step(self, seed: int | None, batch: int | None) -> tuple[int, int | None]:
        """The step's seed, and the batch size of the first stage's inputs, on every rank."""

    def exchange(
        self, holders: list[int], mine: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Every holder stage's tensor of a tie, from this process's (``mine``)."""

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

    def check_edit(self, edit: Edit) -> None:
        """Before an optimizer step: refuse, on every rank alike, a per-stage clip of the
        step's gradients (``edit``: what this rank's script did to them since the step,
        ``gpipe.parallel.clipping``)."""

    def fail(self, error: BaseException, stages: list[Stage]) -> None:
        """This process's step failed with ``error``: tell whoever must know."""

    def norm_total(self, local: torch.Tensor, *, maximum: bool) -> torch.Tensor:
        """A gradient norm's term summed (or maxed) over the pipeline's ranks."""


def default_device(group: Any) -> torch.device:
    """Where a process computes unless told: with a process group under NCCL, its
    ``cuda:LOCAL_RANK``; otherwise the CPU."""
    if group is None:
        return torch.device("cpu")
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


TRANSPORTS = ("auto", "sockets", "group")


def pipeline_group(
    group: Any, *, timeout: float, receive_ahead: bool | None = None, transport: str = "auto"
) -> PipelineGroup:
    """The ranks of a Pipe: ``group=None`` is one process, else a process group."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "sockets" and receive_ahead is False:
        raise ValueError(
            "receive_ahead=False posts receives in NCCL's order, which only the process "
            "group's transport does; use transport='group' (or 'auto') with it"
        )
    if group is None:
        return SingleProcess()
    return MultiProcess(group, timeout=timeout, receive_ahead=receive_ahead, transport=transport)


class SingleProcess:
    """Every stage in this process."""

    rank: int | None = None
    clock_origin: float | None = None  # traces count from each step's start
    broken: str | None = None  # never: a failed step is cleared and the next one runs

    def default_devices(self, num_ranks: int) -> list[DeviceLike]:
        return ["cpu"] * num_ranks

    def device_problems(self, devices: list[DeviceLike]) -> list[str]:
        return []

    def local_stages(self, schedule: Schedule) -> list[int]:
        return list(range(schedule.num_stages))

    def connect(
        self, schedule: Schedule, stage_devices: list[torch.device], routes: Routes
    ) -> LocalTransport:
        self.schedule = schedule
        self.transport = LocalTransport(stage_devices)
        return self.transport

    def begin_step(self, seed: int | None, batch: int | None) -> tuple[int, int | None]:
        """The step's seed, and the batch size of the inputs (both are local here)."""
        return (rng.draw_step_seed() if seed is None else seed), batch

    def check_same(self, configuration: dict[str, Any]) -> None:
        pass  # one process: one configuration

    def agree(
        self,
        local_loss: torch.Tensor | None,
        loss_value: float | None,
        trouble: str | None,
        *,
        refuse_nonfinite: bool = True,
        why: str = "",
    ) -> Agreement:
        loss = None if local_loss is None else local_loss.detach().to(torch.float64)
        if refuse_nonfinite:
            found = f"a non-finite gradient of {trouble!r}" if trouble else ""
            _refuse_nonfinite(loss_value if loss_value is not None else 0.0, [why, found])
        return Agreement(loss, trouble is not None)

    def check_edit(self, edit: Edit) -> None:
        pass  # one process: torch's own clip sees the whole model

    def fail(self, error: BaseException, stages: list[Stage]) -> None:
        pass  # nobody else to tell

    def norm_total(self, local: torch.Tensor, *, maximum: bool) -> torch.Tensor:
        return local

    def exchange(
        self, holders: list[int], mine: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Every holder stage's tensor, on the last holder's device (all are local here)."""
        device = mine[holders[-1]].device
        return {stage: mine[stage].to(device) for stage in holders}

    def decide(self, choose: Callable[[], T]) -> T:
        return choose()

    def gather(self, value: Any, what: str) -> list[Any]:
        return [value]

    def tie(self, tied: TiedParameters) -> None:
        """Make the tied copies equal before the first step."""
        tied.sync_values(self.exchange)

    def __str__(self) -> str:
        return "one process"


class MultiProcess:
    """The stages of one rank of a ``torch.distributed`` process group."""

    rank: int | None
    clock_origin: float | None = 0.0  # perf_counter is one clock per machine: traces line up
    broken: str | None = None  # what failed, once a step has: the ranks may disagree

    def __init__(
        self, group: Any, *, timeout: float, receive_ahead: bool | None, transport: str = "auto"
    ) -> None:
        import torch.distributed as dist

        self.group = group
        self.timeout = timeout
        self.receive_ahead = receive_ahead
        self.wanted_transport = transport
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.steps = 0  # steps begun, for errors that say what this rank was doing
        self.transport: PeerTransport | None = None
        self.ops = Collectives(group, timeout=timeout, device=self._own_device())

    def _collective(self, run: Callable[[], T], *, notices: bool = True) -> T:
        """``run()``'s collectives, after any failure a peer announced (unless ``notices``
        is False: the collective itself carries the failures); one that does not complete
        breaks this pipeline, and the peers are told (they would wait in vain)."""
        if self.transport is not None and notices:
            self.transport.check_notices()
        try:
            return run()
        except PipelineError as error:
            if self.broken is None:
                self.broken = str(error)
                if self.transport is not None:
                    self.transport.announce_failure(
                        {"rank": self.rank if error.rank is None else error.rank,
                         "global_rank": error.global_rank, "message": str(error),
                         "gave_up": True}
                    )  # fmt: skip
            raise

    # -- devices and stages -------------------------------------------------------------------

    def _own_device(self) -> torch.device:
        return default_device(self.group)

    def default_devices(self, num_ranks: int) -> list[DeviceLike]:
        return [self._own_device()] * self.num_ranks

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
        links = self._socket_links(schedule, stage_devices)
        if links is not None:
            self.transport = SocketTransport(
                schedule, self.rank, self.group, stage_devices, links,
                timeout=self.timeout, routes=routes,
            )  # fmt: skip
        else:
            self.transport = DistributedTransport(
                schedule, self.rank, self.group, stage_devices,
                timeout=self.timeout, routes=routes, receive_ahead=self.receive_ahead,
            )  # fmt: skip
        self.ops.device = self.transport.wire_device  # where collectives take tensors
        return self.transport

    def _socket_links(
        self, schedule: Schedule, stage_devices: list[torch.device]
    ) -> dict[int, Any] | None:
        """A Unix socket to every peer, or None: the process group carries the messages
        (``gpipe.transport.handshake``)."""
        # NCCL's order on gloo (receive_ahead=False) is the group's transport's alone.
        wanted = "group" if self.receive_ahead is False else self.wanted_transport
        mine = [stage_devices[s] for s in schedule.stages_of(self.rank)]
        on_cpu = self.backend == "gloo" and all(d.type == "cpu" for d in mine)
        return handshake.links(wanted, on_cpu, self.rank, self.num_ranks, self.timeout,
                               self.gather)  # fmt: skip

    # -- what every rank must agree on ----------------------------------------------------

    def begin_step(self, seed: int | None, batch: int | None) -> tuple[int, int | None]:
        """The step's seed (``seed``, or rank 0's draw) and the batch size of the inputs,
        which rank 0 (the first stage's) has, on every rank.

        Every rank draws (and all but rank 0 discard it), so that every rank's global
        generator advances alike: what a script samples from it after the step (its next
        batch, a shuffled DataLoader's order) stays the same on every rank.
        """
        drawn = rng.draw_step_seed() if seed is None else seed
        values = torch.tensor([drawn, -1 if batch is None else batch], dtype=torch.int64)
        self.steps += 1
        doing = f"starting step {self.steps} of this Pipe"
        operation = "the step-seed broadcast"
        # Rank 0's row goes ahead of its first message: no rank waits for the others to come
        # to the step (one that does not is named by whoever waits on it first).
        values = self._collective(
            lambda: self._on_wire(lambda: self.transport.broadcast_row(values), operation, doing)
        )
        first_batch = int(values[1])
        return int(values[0]), (None if first_batch < 0 else first_batch)

    def check_same(self, configuration: dict[str, Any]) -> None:
        """Refuse to start unless every rank was given the same configuration."""
        everyone = self._collective(
            lambda: self.ops.all_gather_object(
                configuration, "the configuration check (all-gather)", doing="building the Pipe"
            )
        )
        differences = [
            f"- {key}: rank {rank} has {theirs[key]!r}, rank 0 has {everyone[0][key]!r}"
            for rank, theirs in enumerate(everyone)
            for key in configuration
            if theirs.get(key) != everyone[0].get(key)
        ]
        if differences:
            raise PartitionError(
                "the ranks of this pipeline were built differently; every rank must run the "
                "same script with the same model and Pipe arguments:\n" + "\n".join(differences)
            )

    def _gather(self, value: float, failed: int, troubled: bool = False) -> torch.Tensor:
        """Every rank's (value, failed rank + 1 or 0, non-finite gradient), one row per
        pipeline rank."""
        row = torch.tensor([value, failed + 1, troubled], dtype=torch.float64)
        doing = f"ending step {self.steps} of this Pipe"
        operation = "the end-of-step agreement (all-gather)"
        return self._on_wire(lambda: self.transport.all_gather_row(row), operation, doing)

    def _on_wire(self, run: Callable[[], T], operation: str, doing: str) -> T:
        """``run()``: a row of the step through the transport's own wire, its failures named
        as the group's collective's would be."""
        try:
            return run()
        except (TimeoutError, ConnectionError) as error:
            if self.transport is not None and self.transport.peer_gave_up():
                self.transport.check_notices()  # its words: it looked for the cause already
            timed_out = isinstance(error, TimeoutError)
            raise self.ops.error(operation, error, doing=doing, timed_out=timed_out) from error

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
        # The rows themselves say who failed (a failed rank sends its row after its
        # notice): a notice raised first would leave this rank's row out.
        rows = self._collective(
            lambda: self._gather(value, -1, troubled=trouble is not None),
            notices=False,
        )
        table = rows.tolist()  # one read of the agreement
        if any(row[1] for row in table):
            self._raise_remote(rows)
        loss = table[self.schedule.stage_to_rank[-1]][0]
        nonfinite_grads = any(row[2] for row in table)
        if refuse_nonfinite and (nonfinite_grads or not math.isfinite(loss)):
            found = f"rank {self.rank}: a non-finite gradient of {trouble!r}" if trouble else ""
            if why:
                found = f"rank {self.rank}: {why}" + (f"; {found}" if found else "")
            _refuse_nonfinite(loss, self._share_failures(found))
        # The same on every rank; float64 holds a float32 or float64 loss exactly.
        return Agreement(torch.tensor(loss, dtype=torch.float64), nonfinite_grads)

    def check_edit(self, edit: Edit) -> None:
        """Every rank's edit of the step's gradients, gathered when its optimizer steps (one
        row each); a per-stage clip raises on every rank before any weight changes."""
        doing = f"checking the gradients of step {self.steps} before the optimizer step"
        row = torch.tensor(edit.row(), dtype=torch.float64)
        # A collective, not the transport's rows: those are posted ahead for the next step's
        # agreement, which this row (between two steps, of another length) must not take.
        operation = "the clip check (all-gather)"
        rows = self._collective(lambda: self.ops.all_gather(row, operation, doing=doing))
        check_edits(rows, describe=lambda rank: f"rank {rank}")

    def fail(self, error: BaseException, stages: list[Stage]) -> None:
        """Tell the other ranks this step failed here (or upstream), then agree on who."""
        import torch.distributed as dist

        if self.broken is not None or self.transport.peer_gave_up():
            # A collective of this step failed here (the peers have been told), or a peer's
            # did: nobody would come to agree.
            self.broken = self.broken or str(error)
            return
        me = dist.get_global_rank(self.group, self.rank)
        if isinstance(error, PipelineError):  # from elsewhere: this rank only waited
            origin, message = error.rank, str(error)
            culprit = error.global_rank
            if culprit is None and origin is not None:
                culprit = dist.get_global_rank(self.group, origin)
            waited = [culprit] if culprit is not None else self._global_others()
            state(me, waited, message)
            origin = self.rank if origin is None else origin
        else:
            origin, culprit = self.rank, me
            held = ", ".join(str(s.index) for s in stages)
            message = f"rank {me} (stage {held}) raised {type(error).__name__}: {error}"
            if hasattr(error, "add_note"):
                error.add_note(f"raised in pipeline rank {self.rank} (stage {held})")
            state(me, [], message)  # before the news: whoever asks finds the cause
        self.broken = message
        # Its own wait failed: it waited a timeout for a rank that may never answer. It gives
        # up (and says so) instead of waiting for that rank again in the agreement.
        gave_up = waited_out(me, timeout=self.timeout)
        self.transport.announce_failure(
            {"rank": origin, "global_rank": culprit, "message": message, "gave_up": gave_up}
        )
        if gave_up:
            return
        try:
            self._gather(0.0, failed=origin)
            self._share_failures(message if origin == self.rank else "")
        except Exception:
            pass  # the peers have the announcement; the original error is what we raise

    def _global_others(self) -> list[int]:
        import torch.distributed as dist

        return [dist.get_global_rank(self.group, r) for r in range(self.num_ranks)
                if r != self.rank]  # fmt: skip

    def _share_failures(self, message: str) -> list[str]:
        try:
            return self.ops.all_gather_object(
                message, "the gather of failure messages", doing=f"ending step {self.steps}"
            )
        except PipelineError as error:
            self.broken = self.broken or str(error)
            raise

    def _raise_remote(self, rows: torch.Tensor) -> None:
        origin = int(rows[rows[:, 1] > 0, 1].min().item()) - 1
        messages = self._share_failures("")
        message = messages[origin] or next((m for m in messages if m), f"rank {origin} failed")
        self.broken = message
        raise PipelineError(f"rank {self.rank}: the step failed elsewhere: {message}", rank=origin)

    def norm_total(self, local: torch.Tensor, *, maximum: bool) -> torch.Tensor:
        """Sum (or max) of a per-rank gradient norm term over the pipeline's ranks.

        Replicas hold equal gradients after averaging: reducing over the pipeline suffices.
        """
        if self.broken is not None:
            raise PipelineError(
                f"rank {self.rank}: clip_grad_norm_ after a failed step ({self.broken}); "
                "build a new Pipe"
            )
        doing = f"clip_grad_norm_ after step {self.steps} of this Pipe"
        total = self._collective(
            lambda: self.ops.all_reduce(
                local.reshape(1), "the clip_grad_norm_ all-reduce", maximum=maximum, doing=doing
            )
        )
        return total.reshape(())

    def exchange(
        self, holders: list[int], mine: dict[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """Swap this process's tensor with every other holder stage's rank (the transport
        carries them; the wait is a collective's, bounded and named).

        ``mine`` has one entry: a process holds one copy of a tie (checked by the caller).
        """
        ((stage, tensor),) = mine.items()
        rank_of = self.schedule.stage_to_rank
        doing = f"step {self.steps} of this Pipe" if self.steps else "building the Pipe"

        def wait(start: Callable[[], Any]) -> None:
            self._collective(lambda: self.ops.wait("the tied-weight exchange", start, doing=doing))

        peers = [rank_of[other] for other in holders if other != stage]
        by_rank = self.transport.swap(tensor, peers, wait=wait)
        return {holder: by_rank[rank_of[holder]] for holder in holders}

    def tie(self, tied: TiedParameters) -> None:
        """Make the tied copies equal before the first step; each process may hold one."""
        tied.check_one_copy_per_process()
        tied.sync_values(self.exchange)

    def __str__(self) -> str:
        return f"rank {self.rank}"

    def decide(self, choose: Callable[[], T]) -> T:
        """``choose()`` on rank 0, its answer on every rank (timings differ by process)."""
        return self._collective(
            lambda: self.ops.broadcast_object(
                choose() if self.rank == 0 else None,
                "the broadcast of the automatic balance (balance='auto')",
                doing="building the Pipe",
            )
        )

    def gather(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (one bounded all-gather), by rank."""
        return self._collective(
            lambda: self.ops.all_gather_object(
                value, f"the gather of {what}", doing="building the Pipe"
            )
        )


def _refuse_nonfinite(loss: float, troubles: list[str]) -> None:
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
