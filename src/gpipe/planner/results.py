"""What the planner returns: candidate configurations with their predicted cost, the ranked
plan with its tables, and measured verifications."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpipe._utils import MiB
from gpipe.layout import Layout
from gpipe.planner.machine import Machine
from gpipe.planning.memory_model import StageMemory
from gpipe.planning.profile import Profile
from gpipe.schedule import Schedule

__all__ = ["Candidate", "Plan", "Verified"]


@dataclass(frozen=True)
class Candidate:
    """One configuration (a layout and its cut) with its predicted cost."""

    layout: Layout  # K, v, M, schedule (by name), checkpoint
    balance: tuple[int, ...]  # layers per stage (K·v entries)
    step_time: float  # predicted seconds per mini-batch
    throughput: float  # predicted samples per second
    bubble: float  # idle fraction of the devices
    memory: tuple[float, ...]  # predicted peak bytes per device
    stage_memory: tuple[StageMemory, ...] = field(repr=False, default=())
    fits: bool = True
    reason: str = ""  # why it does not fit
    built: Schedule | None = field(default=None, repr=False, compare=False)  # zb-auto's own

    def __post_init__(self) -> None:
        if self.schedule == "zb-auto" and self.fits and self.built is None:
            raise ValueError("a zb-auto candidate carries the schedule built for its costs")

    # The layout's settings, read as the candidate's.
    stages = property(lambda self: self.layout.stages)
    virtual_stages = property(lambda self: self.layout.virtual_stages)
    chunks = property(lambda self: self.layout.chunks)
    schedule = property(lambda self: self.layout.schedule_name)
    checkpoint = property(lambda self: self.layout.checkpoint)

    def pipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``gpipe.Pipe`` (add ``devices`` or ``group``)."""
        return {
            "balance": list(self.balance),
            "chunks": self.chunks,
            "schedule": self.built if self.built is not None else self.schedule,
            "checkpoint": self.checkpoint,
            "virtual_stages": self.virtual_stages,
        }

    def rank_key(self) -> tuple:
        return (
            -float(f"{self.throughput:.9g}"),
            self.stages,
            self.chunks,
            self.schedule == "zb-auto",  # on a tie, the hand-made schedule first
            self.schedule,
            self.checkpoint,
            self.virtual_stages,
        )

    def label(self) -> str:
        return self.layout.label()


@dataclass(frozen=True)
class Verified:
    """A candidate run for real: measured step time and activation memory."""

    candidate: Candidate
    step_time: float  # median seconds per step, measured
    throughput: float  # samples per second, measured
    activation_bytes: tuple[int, ...]  # peak stored activations per device, measured
    steps: int
    step_times: tuple[float, ...] = ()  # every timed step, seconds, in the order run

    @property
    def ratio(self) -> float:
        """Measured over predicted throughput."""
        return self.throughput / self.candidate.throughput

    @property
    def predicted_activation_bytes(self) -> tuple[float, ...]:
        """Per device, the stored activations the memory model predicts (no weights)."""
        c = self.candidate
        per_device = [0.0] * c.stages
        for s, stage in enumerate(c.stage_memory):
            per_device[s % c.stages] += stage.boundary + stage.inner
        return tuple(per_device)

    def activations(self) -> str:
        """``measured/predicted`` MiB per device."""
        return ", ".join(
            f"{got / MiB:.1f}/{want / MiB:.1f}"
            for got, want in zip(
                self.activation_bytes, self.predicted_activation_bytes, strict=True
            )
        )


@dataclass
class Plan:
    """Ranked candidates (those that fit first), and what they were computed from."""

    candidates: list[Candidate]  # fit the budget, best first
    rejected: list[Candidate]  # over the budget, least memory first
    batch_size: int
    devices: int
    memory_budget: float | None
    profiles: dict[int, Profile] = field(repr=False, default_factory=dict)  # by M
    verified: list[Verified] = field(default_factory=list)
    machine: Machine = field(default_factory=Machine)

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            raise ValueError("no candidate fits the memory budget:\n" + self.table(top=5))
        return self.candidates[0]

    def table(self, top: int | None = 10) -> str:
        """The ranked candidates as a text table (rejected ones too when none fits)."""
        budget = (
            "no memory budget"
            if self.memory_budget is None
            else (f"budget {self.memory_budget / MiB:,.0f} MiB per device")
        )
        lines = [
            f"batch {self.batch_size}, up to {self.devices} devices, {budget}; "
            f"{len(self.candidates)} of {len(self.candidates) + len(self.rejected)} "
            "candidates fit",
            f"predicted with {self.machine}",
            "",
            f"{'#':>3} {'K':>2} {'v':>2} {'M':>3} {'schedule':<17}{'checkpoint':<12}"
            f"{'balance':<20}{'samples/s':>10} {'step ms':>9} {'bubble':>7}  peak MiB per device",
        ]
        shown = self.candidates[:top] if top is not None else self.candidates
        for n, c in enumerate(shown, 1):
            lines.append(_row(n, c))
        if len(self.candidates) > len(shown):
            lines.append(f"    ... {len(self.candidates) - len(shown)} more")
        if not self.candidates and self.rejected:
            lines.append("none fits; closest:")
            for c in self.rejected[: top or 5]:
                lines.append(_row(None, c) + f"  ({c.reason})")
        if self.verified:
            lines += ["", self.verify_table()]
        return "\n".join(lines)

    def verify_table(self) -> str:
        lines = [
            f"verified on 1 process per device, 1 thread each (median of "
            f"{self.verified[0].steps} steps):",
            f"{'#':>3} {'configuration':<40}{'predicted':>10} {'measured':>9} {'ratio':>6}"
            "  activations MiB per device (measured / predicted)",
        ]
        for n, v in enumerate(self.verified, 1):
            c = v.candidate
            lines.append(
                f"{n:>3} {c.label():<40}{c.throughput:>10.1f} {v.throughput:>9.1f} "
                f"{v.ratio:>6.2f}  {v.activations()}"
            )
        lines.append("(samples/s)")
        return "\n".join(lines)


def _row(n: int | None, c: Candidate) -> str:
    balance = str(list(c.balance))
    if len(balance) > 19:
        balance = balance[:16] + "..."
    memory = " / ".join(f"{m / MiB:.1f}" for m in c.memory)
    mark = f"{n:>3}" if n is not None else "  -"
    return (
        f"{mark} {c.stages:>2} {c.virtual_stages:>2} {c.chunks:>3} {c.schedule:<17}"
        f"{c.checkpoint:<12}{balance:<20}{c.throughput:>10.1f} {c.step_time * 1e3:>9.2f} "
        f"{c.bubble:>7.1%}  {memory}"
    )
