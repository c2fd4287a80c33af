"""Plan a pipeline: choose K, M, schedule, re-materialization and cuts for the user.

Given a model, a sample mini-batch, the number of devices and a memory budget per device,
:func:`plan` profiles the model (``gpipe.profile``) at each micro-batch size it considers,
and for every candidate configuration

    (stages K ≤ devices, virtual stages v, micro-batches M, schedule, checkpoint mode)

1. cuts the model with the exact time balance (``gpipe.balance``), honouring the budget;
2. simulates the schedule (``gpipe.simulate``) with the profiled per-stage costs — forward,
   backward (input and weight parts for zero-bubble schedules), one more forward per
   re-materialized micro-batch, a per-action overhead, and a transfer time for each
   hand-over between devices (``latency + bytes / bandwidth``);
3. predicts the step time (the makespan), the throughput (samples/s), the bubble, and the
   peak memory of each device (parameters, gradients, optimizer state, and the
   activations the simulated schedule holds; see ``gpipe.balance``).

Candidates that fit the budget are ranked by predicted throughput; ties (equal to nine
significant digits) go to fewer stages, then fewer micro-batches, then the schedule's name,
the checkpoint mode and fewer virtual stages. :func:`verify` runs the top ones for real, one
process per device (``gpipe.launch``), and puts measured next to predicted::

    result = gpipe.plan(model, x, devices=4, memory_budget=8 * 2**30, target=y,
                        loss_fn=F.cross_entropy, verify=3)
    print(result.table())
    pipe = gpipe.Pipe(model, **result.best.pipe_kwargs(), devices=[...])

``gpipe plan`` is the command-line front end, for the preset models.

What the prediction leaves out: the optimizer step, the per-step agreement (a small
all-reduce) and contention between processes sharing a machine's cores or memory bandwidth.
Times measured in one process are used for every stage's process: profile with the thread
count each process will have (the CLI uses one thread, as :func:`verify` runs).

``gpipe.plan`` is this module's :func:`plan`; its other names come from here, e.g.
``from gpipe.planner import Plan, plan_from_profiles, verify`` (the module was
``gpipe.plan`` before the redesign).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpipe import microbatch
from gpipe._utils import MiB, tensors_of
from gpipe.engine.memory import measure_activations
from gpipe.parallel import mesh
from gpipe.parallel.launch import launch
from gpipe.pipe import Pipe
from gpipe.planning.balance import BudgetError, balance_profile
from gpipe.planning.memory_model import (
    MemoryModel,
    StageMemory,
    held_in,
    held_microbatches,
    stage_memory,
)
from gpipe.planning.profile import Profile, profile
from gpipe.remat import REMAT_MODES, recompute_fraction
from gpipe.schedule import SCHEDULES, Schedule, build_schedule
from gpipe.schedule.simulate import Costs, simulate

__all__ = ["Candidate", "Link", "Plan", "Verified", "plan", "plan_from_profiles", "verify"]

DEFAULT_OVERHEAD = 100e-6  # seconds of runtime bookkeeping per action, measured on a CPU
ProfileSource = Profile | Mapping[int, Profile] | Callable[[int], Profile]


@dataclass(frozen=True)
class Link:
    """Time to hand a boundary tensor to the next device: ``latency + bytes / bandwidth``.

    The defaults suit processes on one machine over gloo; for NVLink use e.g.
    ``Link(latency=10e-6, bandwidth=100e9)``.
    """

    latency: float = 100e-6  # seconds per message
    bandwidth: float = 2e9  # bytes per second

    def __post_init__(self) -> None:
        if not self.latency >= 0 or not self.bandwidth > 0:
            raise ValueError(
                f"Link needs latency >= 0 and bandwidth > 0, got {self.latency!r}, "
                f"{self.bandwidth!r}"
            )

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    @classmethod
    def measure(
        cls, *, nbytes: int = 4 << 20, rounds: int = 20, backend: str | None = None
    ) -> Link:
        """Ping-pong between two new local processes (``gpipe.launch``): the latency of a
        tiny message, and the bandwidth of an ``nbytes`` one — on this machine, as loaded
        as it is now."""
        sizes = (64, int(nbytes))
        times = launch(mesh.ping_pong, 2, args=(sizes, rounds), backend=backend)[0]
        latency = times[sizes[0]]
        bandwidth = (sizes[1] - sizes[0]) / max(times[sizes[1]] - latency, 1e-9)
        return cls(latency=latency, bandwidth=bandwidth)

    def __str__(self) -> str:
        return f"{self.latency * 1e6:.0f} us + bytes / {self.bandwidth / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class Candidate:
    """One configuration with its predicted cost."""

    stages: int  # K: devices (processes) used
    virtual_stages: int  # v: stages per device (interleaved 1F1B)
    chunks: int  # M: micro-batches per mini-batch
    schedule: str
    checkpoint: str
    balance: tuple[int, ...]  # layers per stage (K·v entries)
    step_time: float  # predicted seconds per mini-batch
    throughput: float  # predicted samples per second
    bubble: float  # idle fraction of the devices
    memory: tuple[float, ...]  # predicted peak bytes per device
    stage_memory: tuple[StageMemory, ...] = field(repr=False, default=())
    fits: bool = True
    reason: str = ""  # why it does not fit

    def pipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``gpipe.Pipe`` (add ``devices`` or ``group``)."""
        return {
            "balance": list(self.balance),
            "chunks": self.chunks,
            "schedule": self.schedule,
            "checkpoint": self.checkpoint,
            "virtual_stages": self.virtual_stages,
        }

    def rank_key(self) -> tuple:
        return (
            -float(f"{self.throughput:.9g}"),
            self.stages,
            self.chunks,
            self.schedule,
            self.checkpoint,
            self.virtual_stages,
        )

    def label(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"K={self.stages}{v} M={self.chunks} {self.schedule} {self.checkpoint}"


@dataclass(frozen=True)
class Verified:
    """A candidate run for real: measured step time and activation memory."""

    candidate: Candidate
    step_time: float  # median seconds per step, measured
    throughput: float  # samples per second, measured
    activation_bytes: tuple[int, ...]  # peak stored activations per device, measured
    steps: int

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
    link: Link = field(default_factory=lambda: Link())
    overhead: float = 0.0

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
            f"predicted with transfers of {self.link}, {self.overhead * 1e6:.0f} us per action",
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


# -- ranking from profiles ------------------------------------------------------------------


def _default_chunks(batch_size: int) -> list[int]:
    out, m = [], 1
    while m <= min(batch_size, 32):
        out.append(m)
        m *= 2
    return out


def _profile_source(source: ProfileSource, batch_size: int) -> Callable[[int], Profile]:
    if isinstance(source, Profile):
        if source.batch_size is None:
            raise ValueError("a single Profile needs its batch_size to be scaled to each M")

        def scaled(m: int) -> Profile:
            return source.scaled(math.ceil(batch_size / m) / source.batch_size)

        return scaled
    if isinstance(source, Mapping):
        return lambda m: source[m]
    return source


def plan_from_profiles(
    profiles: ProfileSource,
    *,
    batch_size: int,
    devices: int,
    memory_budget: float | None = None,
    stages: Iterable[int] | None = None,
    chunks: Iterable[int] | None = None,
    schedules: Iterable[str] | None = None,
    checkpoints: Iterable[str] | None = None,
    virtual_stages: Iterable[int] = (1, 2),
    memory: MemoryModel | None = None,
    link: Link | None = None,
    overhead: float = DEFAULT_OVERHEAD,
) -> Plan:
    """Rank every candidate configuration from known per-layer costs (no model is run).

    ``profiles`` gives the profile of one micro-batch for each M: a mapping M -> Profile,
    a function of M, or one Profile scaled linearly to ``ceil(batch_size / M)`` samples.
    ``overhead`` (seconds) is added to every action: gpipe's runtime costs about 0.1 ms
    per action on a CPU (``DEFAULT_OVERHEAD``); ``link`` prices the hand-overs between
    devices (:meth:`Link.measure` measures this machine's).
    The other arguments restrict the search; the defaults try K = 1..devices, M = powers
    of two up to min(batch_size, 32), every schedule (v = 2 for interleaved 1F1B) and
    checkpoint mode. K = 1 is tried with ``"gpipe"`` only (every schedule is the same
    there), and ``"except_last"`` only with M > 1 (at M = 1 it is ``"never"``).
    """
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    if not isinstance(overhead, int | float) or overhead < 0:
        raise ValueError(f"overhead must be a non-negative number of seconds, got {overhead!r}")
    profile_of = _profile_source(profiles, batch_size)
    memory = memory or MemoryModel()
    link = link or Link()
    chunk_list = sorted(set(chunks)) if chunks is not None else _default_chunks(batch_size)
    too_many = [m for m in chunk_list if not 1 <= m <= batch_size]
    if too_many:
        raise ValueError(f"chunks {too_many} are not in 1..batch_size ({batch_size})")
    schedule_list = sorted(set(schedules)) if schedules is not None else sorted(SCHEDULES)
    unknown = [s for s in schedule_list if s not in SCHEDULES]
    modes = list(checkpoints) if checkpoints is not None else list(REMAT_MODES)
    unknown += [c for c in modes if c not in REMAT_MODES]
    if unknown:
        raise ValueError(
            f"unknown schedule or checkpoint {unknown}; schedules: {', '.join(SCHEDULES)}; "
            f"checkpoints: {', '.join(REMAT_MODES)}"
        )
    stage_list = sorted(set(stages)) if stages is not None else list(range(1, devices + 1))
    if any(not 1 <= k <= devices for k in stage_list):
        raise ValueError(f"stages {stage_list} must lie in 1..devices ({devices})")

    profiles_used: dict[int, Profile] = {}
    fitting, rejected = [], []
    settings = {
        "batch_size": batch_size,
        "budget": memory_budget,
        "memory": memory,
        "link": link,
        "overhead": overhead,
    }
    for m in chunk_list:
        prof = profiles_used[m] = profile_of(m)
        for k, v, name, mode in _configurations(
            len(prof.layers), m, stage_list, sorted(set(virtual_stages)), schedule_list, modes
        ):
            candidate = _evaluate(prof, k, v, m, name, mode, **settings)
            (fitting if candidate.fits else rejected).append(candidate)
    fitting.sort(key=Candidate.rank_key)
    rejected.sort(key=lambda c: (max(c.memory) if c.memory else math.inf, c.rank_key()))
    return Plan(
        fitting,
        rejected,
        batch_size,
        devices,
        memory_budget,
        profiles_used,
        link=link,
        overhead=float(overhead),
    )


def _configurations(layers, m, stage_list, virtual_list, schedule_list, modes):
    """(K, v, schedule, checkpoint) worth simulating for M = m micro-batches."""
    for k in stage_list:
        for v in virtual_list:
            if k * v > layers:
                continue
            for name in schedule_list:
                if k == 1:  # one stage: every schedule is the same
                    applies = name == "gpipe" and v == 1
                elif name == "interleaved-1f1b":
                    applies = v > 1 and m % k == 0
                else:
                    applies = v == 1
                if not applies:
                    continue
                for mode in modes:
                    if mode == "except_last" and m == 1:  # the same as "never"
                        continue
                    yield k, v, name, mode


def _evaluate(
    prof: Profile,
    k: int,
    v: int,
    m: int,
    name: str,
    mode: str,
    *,
    batch_size: int,
    budget: float | None,
    memory: MemoryModel,
    link: Link,
    overhead: float,
) -> Candidate:
    schedule = build_schedule(name, num_ranks=k, num_microbatches=m, virtual_stages=v)
    num_stages = k * v
    base = {"stages": k, "virtual_stages": v, "chunks": m, "schedule": name, "checkpoint": mode}
    try:
        part = balance_profile(
            prof,
            stages=num_stages,
            by="time",
            chunks=m,
            checkpoint=mode,  # type: ignore[arg-type]
            schedule=schedule,
            memory_budget=None if budget is None else budget / v,
            memory=memory,
            held=held_microbatches(schedule, mode),
        )
    except BudgetError as error:
        per_device = [0.0] * k
        for s, need in enumerate(error.needed):
            per_device[schedule.stage_to_rank[s]] += need
        return Candidate(
            **base,
            balance=tuple(error.balance),
            step_time=math.inf,
            throughput=0.0,
            bubble=math.nan,
            memory=tuple(per_device),
            fits=False,
            reason=f"no cut fits: {max(error.missing) / MiB:.1f} MiB missing on a stage",
        )
    costs, transfer = _stage_costs(prof, part.balance, schedule, mode, link, overhead)
    result = simulate(schedule, costs, transfer=transfer)
    stage_mem = stage_memory(prof, part.balance, held_in(result, mode), memory)
    per_device = [0.0] * k
    for s, stage in enumerate(stage_mem):
        per_device[schedule.stage_to_rank[s]] += stage.total
    fits = budget is None or max(per_device) <= budget
    reason = ""
    if not fits:
        worst = max(range(k), key=per_device.__getitem__)
        reason = f"device {worst} needs {per_device[worst] / MiB:.1f} MiB"
    step = result.makespan
    return Candidate(
        **base,
        balance=tuple(part.balance),
        step_time=step,
        throughput=batch_size / step if step > 0 else math.inf,
        bubble=result.bubble_fraction,
        memory=tuple(per_device),
        stage_memory=tuple(stage_mem),
        fits=fits,
        reason=reason,
    )


def _stage_costs(
    prof: Profile,
    balance: Sequence[int],
    schedule: Schedule,
    checkpoint: str,
    link: Link,
    overhead: float,
) -> tuple[Costs, float]:
    """Per-stage costs of one micro-batch, and the transfer time between devices."""
    again = recompute_fraction(checkpoint, schedule.num_microbatches)
    split = schedule.splits_backward(0, 0)
    forward, backward, weight = [], [], []
    boundary = 0.0
    start = 0
    for s, size in enumerate(balance):
        layers = prof.layers[start : start + size]
        start += size
        f = sum(lay.forward for lay in layers)
        forward.append(f + overhead)
        if split:
            backward.append(sum(lay.backward_input for lay in layers) + f * again + overhead)
            weight.append(sum(lay.backward_weight for lay in layers) + overhead)
        else:
            backward.append(sum(lay.backward for lay in layers) + f * again + overhead)
            weight.append(0.0)
        last = s == len(balance) - 1
        if not last and schedule.stage_to_rank[s] != schedule.stage_to_rank[s + 1]:
            boundary = max(boundary, layers[-1].output_bytes)
    transfer = link.time(boundary) if schedule.num_ranks > 1 else 0.0
    return Costs(forward=forward, backward=backward, weight=weight), transfer


# -- measuring -------------------------------------------------------------------------------


def plan(
    model: nn.Sequential,
    sample: Any,
    *,
    devices: int,
    memory_budget: float | None = None,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    device: Any = None,
    repeats: int = 5,
    warmup: int = 2,
    verify: int = 0,
    verify_steps: int = 10,
    **search: Any,
) -> Plan:
    """Profile ``model`` and rank configurations for ``devices`` devices (see module doc).

    ``sample`` is one mini-batch of inputs (``target`` its targets, ``loss_fn`` the loss;
    without them the last layer's backward starts from a random gradient and
    :func:`verify` trains on the mean square of the output). The model is profiled on
    ``device`` once per micro-batch count M, on the first micro-batch of
    ``sample`` split M ways. ``search`` takes the keyword arguments of
    :func:`plan_from_profiles` (``stages``, ``chunks``, ``schedules``, ``checkpoints``,
    ``virtual_stages``, ``memory``, ``link``, ``overhead``). ``verify=N`` runs the top N
    for ``verify_steps`` steps each (:func:`verify`).
    """
    batch_size = microbatch.batch_size(sample, name="sample")
    cache: dict[int, Profile] = {}

    def profile_of(m: int) -> Profile:
        if m not in cache:
            x = microbatch.split(sample, m, name="sample")[0]
            y = None if target is None else microbatch.split(target, m, name="target")[0]
            cache[m] = profile(
                model, x, device, target=y, loss_fn=loss_fn, repeats=repeats, warmup=warmup
            )
        return cache[m]

    result = plan_from_profiles(
        profile_of, batch_size=batch_size, devices=devices, memory_budget=memory_budget, **search
    )
    if verify:
        result.verified = _verify(
            result, model, sample, target, loss_fn, top=verify, steps=verify_steps
        )
    return result


def _output_square(output: Any, target: Any) -> torch.Tensor:
    """A stand-in loss when none is given: mean square of the output's float tensors."""
    del target
    return sum(t.float().pow(2).mean() for t in tensors_of(output) if t.is_floating_point())  # type: ignore[return-value]


def verify(
    result: Plan,
    model: nn.Sequential | Callable[[], nn.Sequential],
    sample: Any,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    top: int = 3,
    steps: int = 10,
    warmup: int = 3,
    timeout: float = 300.0,
) -> list[Verified]:
    """Run the top ``top`` candidates of ``result``: K local processes, one thread each.

    ``model`` (or a function building it) and ``loss_fn`` must be picklable: they are sent
    to the processes. Each process trains ``warmup`` + ``steps`` steps on ``sample``; the
    median step time of rank 0 gives the measured throughput (every rank ends a step
    together). One more step is run under ``gpipe.measure_activations``.
    """
    if target is None or loss_fn is None:
        loss_fn = _output_square
        target = torch.zeros(microbatch.batch_size(sample, name="sample"))
    verified = []
    for candidate in result.candidates[:top]:
        outcome = launch(
            _measure_rank,
            candidate.stages,
            args=(model, sample, target, loss_fn, candidate.pipe_kwargs(), steps, warmup),
            timeout=timeout,
        )
        times = outcome[0]["times"]
        step = statistics.median(times)
        activations = [0] * candidate.stages
        for rank, r in enumerate(outcome):
            activations[rank] = r["activations"]
        verified.append(
            Verified(
                candidate,
                step_time=step,
                throughput=result.batch_size / step,
                activation_bytes=tuple(activations),
                steps=steps,
            )
        )
    return verified


_verify = verify  # plan()'s own ``verify`` argument hides the function's name


def _measure_rank(
    rank: int,
    model: Any,
    sample: Any,
    target: Any,
    loss_fn: Callable,
    kwargs: dict[str, Any],
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    del rank
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pipe = Pipe(model, group=mesh.world(), **kwargs)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        pipe.step(sample, target, loss_fn, seed=step)
        elapsed = time.perf_counter() - start
        pipe.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(elapsed)
    with measure_activations(pipe) as meter:
        pipe.step(sample, target, loss_fn, seed=0)
    pipe.zero_grad(set_to_none=True)
    held = sum(meter.peak_bytes[s.index] for s in pipe.stages)
    return {"times": times, "activations": held}
