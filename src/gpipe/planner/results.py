"""What the planner returns: candidate configurations with their predicted cost, the ranked
plan with its tables, and measured verifications; the capacity search's rows and answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpipe.base._utils import MiB
from gpipe.base.remat import REMAT_MODES
from gpipe.estimate.memory_model import Calibration, StageMemory
from gpipe.estimate.profile import Profile
from gpipe.layout import Layout
from gpipe.planner.families import Family
from gpipe.planner.machine import Machine
from gpipe.schedule import Schedule

__all__ = [
    "TERMS",
    "Candidate",
    "Capacity",
    "Fit",
    "NothingFits",
    "Plan",
    "Verified",
    "cheaper_first",
]

# A process's predicted peak by term: the memory model's, and the process's own overhead.
TERMS = ("parameters", "gradients", "optimizer", "buffers", "inputs", "activations",
         "workspace", "gathered", "reduction", "layers", "model layers", "process",
         "before the model")  # fmt: skip


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
            lines.append(_candidate_row(n, c))
        if len(self.candidates) > len(shown):
            lines.append(f"    ... {len(self.candidates) - len(shown)} more")
        if not self.candidates and self.rejected:
            lines.append("none fits; closest:")
            for c in self.rejected[: top or 5]:
                lines.append(_candidate_row(None, c) + f"  ({c.reason})")
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


def _candidate_row(n: int | None, c: Candidate) -> str:
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


# -- capacity ---------------------------------------------------------------------------------


def cheaper_first(layout: Layout) -> tuple:
    """Ties of capacity go to the cheaper layout: fewer processes, no sharding, less
    recomputation (a whole stage at once before a few layers at a time: one forward
    fewer), fewer micro-batches."""
    per = layout.checkpoint_layers
    return (
        layout.processes,
        layout.shard is not None,
        -REMAT_MODES.index(layout.checkpoint),  # REMAT_MODES: most recomputation first
        per is not None,
        -(per or 0),
        layout.chunks,
        layout.schedule_name,
        layout.replicas,
    )


@dataclass(frozen=True)
class Fit:
    """A member of the family in a layout: the largest that fits, in a capacity row.

    ``memory`` is the predicted peak of each stage's processes without ``overhead`` (what
    a training process needs beyond the model's terms: ``calibration.at(layers)``);
    ``peak`` adds it. When it does not fit (``fits``
    false; in a capacity row: not even the smallest member), ``balance`` and ``memory``
    are those of the partition that misses the budget by the least, ``missing`` what each
    of its stages lacks.
    """

    layout: Layout
    depth: int
    parameters: int
    balance: tuple[int, ...]
    memory: tuple[StageMemory, ...] = field(repr=False)
    overhead: float
    budget: float
    fits: bool = True
    missing: tuple[float, ...] = ()
    calibration: Calibration = field(default_factory=Calibration)

    @property
    def peaks(self) -> tuple[float, ...]:
        return tuple(m.total + self.overhead for m in self.memory)

    @property
    def peak(self) -> float:
        return max(self.peaks)

    @property
    def fullest(self) -> int:
        """The stage whose processes need the most."""
        return max(range(len(self.memory)), key=lambda s: self.memory[s].total)

    def terms(self, stage: int | None = None) -> dict[str, float]:
        """The predicted peak of a stage's process by term (default: the fullest stage)."""
        memory = self.memory[self.fullest if stage is None else stage]
        c = self.calibration
        layers = self.overhead - c.process - c.baseline
        return {**memory.terms(), "model layers": layers, "process": c.process,
                "before the model": c.baseline}  # fmt: skip


class NothingFits(ValueError):
    """No layout trains even the smallest member; the message says why and what would."""


@dataclass
class Capacity:
    """The capacity search's answer: one :class:`Fit` per layout, the largest first."""

    family: Family
    budget: float  # bytes per process
    processes: int
    optimizer_state: float
    calibration: Calibration  # what a process needs beyond the memory model's terms
    rows: list[Fit]
    advice: str = ""  # what would fit, when nothing does

    @property
    def best(self) -> Fit:
        if not self.rows or not self.rows[0].fits:
            raise NothingFits(self.explain())
        return self.rows[0]

    def table(self, top: int | None = 12) -> str:
        """Rows as text: layout, depth, parameters, balance and the fullest process's terms."""
        lines = [
            f"capacity of {self.family.describe()}: budget {self.budget / MiB:,.1f} MiB per "
            f"process, {self.processes} processes, optimizer state {self.optimizer_state:g}x "
            f"parameters; beyond the model {self.calibration}",
            "",
            f"{'layout':<36}{'depth':>6} {'parameters':>12} {'peak MiB':>9}  {'balance':<22}"
            "fullest process (MiB): " + " + ".join(TERMS),
        ]
        shown = self.rows if top is None else self.rows[:top]
        for row in shown:
            lines.append(_fit_row(row))
        if len(self.rows) > len(shown):
            lines.append(f"... {len(self.rows) - len(shown)} more layouts")
        if not self.rows or not self.rows[0].fits:
            lines += ["", self.explain()]
        return "\n".join(lines)

    def explain(self) -> str:
        """Why nothing fits: the closest layout's stage, its largest term, the shortfall,
        and what would fit."""
        if self.rows and self.rows[0].fits:
            return f"the largest fit is {_fit_row(self.rows[0]).strip()}"
        if not self.rows:
            return "no layout was searched: widen stages, replicas, chunks or schedules"
        closest = min(self.rows, key=lambda r: (max(r.missing), cheaper_first(r.layout)))
        stage = max(range(len(closest.missing)), key=closest.missing.__getitem__)
        terms = closest.terms(stage)
        # the process's own overhead is fixed: name the largest term the layout can change
        fixed = ("process", "model layers", "before the model")
        term = max((k for k in terms if k not in fixed), key=terms.__getitem__)
        over = closest.missing[stage]
        fixed_cost = sum(terms[k] for k in fixed)
        return (
            f"nothing fits {self.budget / MiB:.1f} MiB per process: even depth {closest.depth} of "
            f"{self.family.name} does not. Closest: {closest.layout.label()}, balance "
            f"{list(closest.balance)}; stage {stage} needs "
            f"{(closest.memory[stage].total + closest.overhead) / MiB:.1f} MiB, "
            f"{over / MiB:.1f} MiB over, its largest term {term} "
            f"({terms[term] / MiB:.1f} MiB; "
            + ", ".join(f"{k} {v / MiB:.1f}" for k, v in terms.items() if v)
            + f"); {fixed_cost / MiB:.1f} MiB of it is fixed per process, whatever the layout "
            f"(before the model {terms['before the model'] / MiB:.1f}, process "
            f"{terms['process'] / MiB:.1f}, model layers {terms['model layers'] / MiB:.1f})."
            f"\nTo fit: a budget of {(self.budget + over) / MiB:.1f} MiB"
            + (f"; {self.advice}" if self.advice else "")
        )


def _fit_row(row: Fit) -> str:
    balance = str(list(row.balance))
    if len(balance) > 21:
        balance = balance[:18] + "..."
    terms = " + ".join(f"{v / MiB:.1f}" for v in row.terms().values())
    depth = str(row.depth) if row.fits else "-"
    params = f"{row.parameters:,}" if row.fits else "-"
    return (
        f"{row.layout.label():<36}{depth:>6} {params:>12} {row.peak / MiB:>9.1f}  "
        f"{balance:<22}{terms}"
    )
