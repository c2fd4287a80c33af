"""What the planner knows of the machine beyond the profile, measured on the machine itself.

A profile times each layer alone, in one process, over and over. A pipeline step differs
in ways the profile cannot see, and :meth:`Machine.measure` measures each of them in the
processes a pipeline uses (one :func:`gpipe.launch` of ``devices`` processes, one thread
each, as :func:`gpipe.planner.verify` runs):

* ``slowdown[K, M]``: the time K processes spend in their actions during a 1F1B step of
  the model itself (cut K ways, M micro-batches, traced), less the runtime's part, over
  the profile's time for the same work. It holds what K processes sharing the cores and
  the memory bandwidth cost (on 2 cores, K = 4 takes twice as long), what running a
  stage's layers one after another with fresh gradients costs over timing each layer
  alone, and any drift of the machine's speed since the profiles were taken;
* ``link``: the latency and bandwidth of a hand-over between two processes (ping-pong);
* ``action``: the runtime's time per action, and ``step``: the time a step spends outside
  its actions (splitting the mini-batch, the loss's sum, the ranks' agreement). Both come
  from a pipeline of tiny layers timed at several micro-batch counts, where the runtime's
  time is all there is: the simulated steps, linear in the time per action, are fitted to
  the measured ones by least squares.

The planner's prediction of a step with K processes and M micro-batches is then the
simulated makespan of the profiled costs × ``slowdown[K, M]`` plus ``action`` per action,
with ``link`` per hand-over, plus ``step``.

What it still leaves out: the optimizer step, and how much a schedule loses when its ranks
wait on each other while the machine's speed varies from action to action (measured on 2
shared cores: about 4 % for 1F1B and 8 % for interleaved 1F1B, whose ranks hand over
three times as often); see ``docs/planner.md``.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gpipe.base import microbatch
from gpipe.base._utils import tensors_of
from gpipe.estimate.balance import balance_profile
from gpipe.estimate.costs import stage_costs
from gpipe.estimate.profile import Profile
from gpipe.parallel import mesh
from gpipe.parallel.launch import launch
from gpipe.pipe import Pipe
from gpipe.schedule import Schedule, build_schedule
from gpipe.schedule.simulate import Costs, simulate

__all__ = ["DEFAULT_OVERHEAD", "Link", "Machine"]

DEFAULT_OVERHEAD = 100e-6  # seconds of runtime bookkeeping per action, measured on a CPU
_TINY_CHUNKS = (2, 4, 8, 16, 32)  # micro-batch counts of the tiny pipeline, fitted together
_TINY_WIDTH = 4


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

    PING_PONG_SIZES = (64, 4 << 20)  # bytes: a tiny message for latency, a large one

    @classmethod
    def measure(cls, *, rounds: int = 20, backend: str | None = None) -> Link:
        """Ping-pong between two new local processes (``gpipe.launch``): the latency of a
        tiny message, and the bandwidth of a 4 MiB one — on this machine, as loaded as
        it is now."""
        times = launch(mesh.ping_pong, 2, args=(cls.PING_PONG_SIZES, rounds), backend=backend)
        return cls.from_ping_pong(times[0])

    @classmethod
    def from_ping_pong(cls, times: dict[int, float]) -> Link:
        """The link of ``mesh.ping_pong``'s one-way times for ``PING_PONG_SIZES``."""
        small, large = cls.PING_PONG_SIZES
        latency = times[small]
        bandwidth = (large - small) / max(times[large] - latency, 1e-9)
        return cls(latency=latency, bandwidth=bandwidth)

    def __str__(self) -> str:
        return f"{self.latency * 1e6:.0f} us + bytes / {self.bandwidth / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class Machine:
    """The machine's terms of a step that a profile does not hold (see the module doc).

    The defaults (nothing measured) suit processes on one machine over gloo; for GPUs
    over NVLink give e.g. ``Machine(link=Link(latency=10e-6, bandwidth=100e9))``.
    """

    link: Link = field(default_factory=Link)
    action: float = DEFAULT_OVERHEAD  # seconds per action
    step: float = 0.0  # seconds per step outside the actions
    slowdown: Mapping[tuple[int, int], float] = field(default_factory=dict)  # by (K, M)
    waiting: Mapping[tuple[int, int], float] = field(default_factory=dict)  # by (K, M)
    measured: bool = False

    def __post_init__(self) -> None:
        if not self.action >= 0 or not self.step >= 0:
            raise ValueError(
                f"Machine needs action >= 0 and step >= 0 seconds, got {self.action!r}, "
                f"{self.step!r}"
            )
        for name in ("slowdown", "waiting"):
            bad = {k: s for k, s in getattr(self, name).items() if not s > 0}
            if bad:
                raise ValueError(f"{name} factors must be positive, got {bad}")

    def slowdown_at(self, processes: int, chunks: int) -> float:
        """The compute slowdown with ``processes`` at once and ``chunks`` micro-batches:
        as measured, else at the nearest micro-batch count measured for as many
        processes, else 1.0."""
        return _nearest(self.slowdown, processes, chunks)

    def stage_costs(
        self, prof: Profile, balance: Sequence[int], schedule: Schedule, checkpoint: str
    ) -> tuple[Costs, float]:
        """Per-stage costs of one micro-batch as this machine runs them
        (``gpipe.estimate.costs``), and the time of the largest hand-over between ranks."""
        costs = stage_costs(
            prof,
            balance,
            schedule,
            checkpoint,
            overhead=self.action,
            slowdown=self.slowdown_at(schedule.num_ranks, schedule.num_microbatches),
        )
        boundary, start = 0.0, 0
        for s, size in enumerate(balance[:-1]):
            start += size
            if schedule.stage_to_rank[s] != schedule.stage_to_rank[s + 1]:
                boundary = max(boundary, prof.layers[start - 1].output_bytes)
        transfer = self.link.time(boundary) if schedule.num_ranks > 1 else 0.0
        return costs, transfer

    def step_time(self, makespan: float, processes: int, chunks: int) -> float:
        """A step's predicted seconds from its simulated makespan: times the time ranks lose
        waiting on each other (looked up as :meth:`slowdown_at`), plus the step's own."""
        return makespan * _nearest(self.waiting, processes, chunks) + self.step

    def __str__(self) -> str:
        def table(factors: Mapping[tuple[int, int], float]) -> str:
            return ", ".join(f"K={k} M={m}: x{f:.2f}" for (k, m), f in sorted(factors.items()))

        return (
            f"transfers of {self.link}, {self.action * 1e6:.0f} us per action, "
            f"{self.step * 1e3:.1f} ms per step"
            + (f", compute slowdown {table(self.slowdown)}" if self.slowdown else "")
            + (f", waiting {table(self.waiting)}" if self.waiting else "")
            + (" (measured)" if self.measured else "")
        )

    @classmethod
    def measure(
        cls,
        model: nn.Module,
        sample: Any,
        profiles: Mapping[int, Profile],
        *,
        devices: int,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        rounds: int = 5,
        timeout: float = 300.0,
    ) -> Machine:
        """Measure this machine's terms in ``devices`` new local processes (module doc).

        ``sample`` (and ``target``) is one mini-batch, ``profiles`` maps a micro-batch
        count M to the profile of the first of M micro-batches of ``sample``: the
        slowdown at M is measured against that profile's times. ``model`` and
        ``loss_fn`` must be picklable.
        """
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be a positive int, got {devices!r}")
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds must be a positive int, got {rounds!r}")
        if not profiles:
            raise ValueError("give the profile of at least one micro-batch count to compare with")
        counts = sorted(profiles)
        middle = counts[len(counts) // 2]
        stages = range(1, min(devices, len(profiles[middle].layers)) + 1)
        cuts = {
            k: balance_profile(
                profiles[middle], stages=k, checkpoint="never", schedule="1f1b"
            ).balance
            for k in stages
        }
        target, loss_fn = loss_or_stand_in(sample, target, loss_fn)
        results = launch(
            _measure_rank,
            devices,
            args=(model, sample, target, loss_fn, cuts, counts, rounds),
            timeout=timeout,
        )
        link = Link.from_ping_pong(results[0]["ping_pong"]) if devices > 1 else Link()
        action, step = _solve_runtime(results[0]["tiny"], devices, link.latency)
        slowdown = _slowdown(results, profiles, stages)
        machine = cls(link=link, action=action, step=step, slowdown=slowdown, measured=True)
        return replace(machine, waiting=_waiting(machine, results[0]["steps"], profiles, cuts))


def _slowdown(
    results: list[dict[str, Any]], profiles: Mapping[int, Profile], stages: range
) -> dict[tuple[int, int], float]:
    """Per (K, M): the time the K ranks spent computing over the profile's time for it."""
    inside = results[0]["tiny_inside"]  # the part of the time per action within a traced one
    slowdown = {}
    for k in stages:
        for m in sorted(profiles):
            busy = sum(r["busy"][k, m] for r in results[:k])
            # Less the runtime's part (F and B of each micro-batch on each rank). With
            # layers as small as the tiny pipeline's that difference is noise: keep half.
            compute = max(busy - 2 * m * k * inside, busy / 2)
            profiled = m * sum(lay.forward + lay.backward for lay in profiles[m].layers)
            slowdown[k, m] = compute / profiled
    return slowdown


def _waiting(
    machine: Machine,
    steps: Mapping[tuple[int, int], float],
    profiles: Mapping[int, Profile],
    cuts: Mapping[int, Sequence[int]],
) -> dict[tuple[int, int], float]:
    """Per (K, M): the measured 1F1B step over the one simulated with every other term."""
    waiting = {}
    for k, cut in cuts.items():
        for m in sorted(profiles):
            schedule = build_schedule("1f1b", num_ranks=k, num_microbatches=m)
            costs, transfer = machine.stage_costs(profiles[m], cut, schedule, "never")
            makespan = simulate(schedule, costs, transfer=transfer).makespan
            waiting[k, m] = max(steps[k, m] - machine.step, 1e-9) / makespan
    return waiting


def _measure_rank(
    rank: int,
    model: nn.Module,
    sample: Any,
    target: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    cuts: Mapping[int, Sequence[int]],
    counts: Sequence[int],
    rounds: int,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    devices = mesh.world_size()
    out: dict[str, Any] = {"busy": {}, "steps": {}}
    for k, cut in cuts.items():  # every rank creates every group, in the same order
        group = mesh.first_ranks(k)
        for m in counts:
            if rank < k:
                out["busy"][k, m], out["steps"][k, m] = _busy(
                    model, group, cut, m, sample, target, loss_fn, rounds
                )
            mesh.barrier()

    if devices > 1:
        pairs = rank < 2  # rank 0 and rank 1 measure the link
        out["ping_pong"] = mesh.ping_pong(rank, Link.PING_PONG_SIZES, 20) if pairs else {}
        mesh.barrier()
    out["tiny"], out["tiny_inside"] = _tiny_pipeline(devices, rounds)
    return out


def _busy(model, group, cut, chunks, sample, target, loss_fn, rounds) -> tuple[float, float]:
    """Median seconds this rank spends in its actions (from their inputs' arrival to
    their outputs' send) in a 1F1B step of the model cut by ``cut`` over ``group``, and
    the median seconds of the step."""
    torch.manual_seed(0)
    pipe = Pipe(copy.deepcopy(model), group=group, balance=list(cut), chunks=chunks,
                schedule="1f1b", checkpoint="never")  # fmt: skip
    busy, steps = [], []
    for step in range(1 + rounds):
        start = time.perf_counter()
        pipe.step(sample, target, loss_fn, seed=step, trace=True)
        steps.append(time.perf_counter() - start)
        busy.append(sum(a.end - a.start for a in pipe.last_trace))
        pipe.zero_grad(set_to_none=True)  # as an optimizer does: the next step allocates
    return statistics.median(busy[1:]), statistics.median(steps[1:])


def _nearest(factors: Mapping[tuple[int, int], float], processes: int, chunks: int) -> float:
    measured = {m: f for (k, m), f in factors.items() if k == processes}
    if not measured:
        return 1.0
    nearest = min(measured, key=lambda m: (abs(math.log(m / chunks)), m))
    return float(measured[nearest])


def _output_square(output: Any, target: Any) -> torch.Tensor:
    """A stand-in loss when none is given: mean square of the output's float tensors."""
    del target
    return sum(t.float().pow(2).mean() for t in tensors_of(output) if t.is_floating_point())  # type: ignore[return-value]


def loss_or_stand_in(sample: Any, target: Any, loss_fn: Callable | None) -> tuple[Any, Callable]:
    """(target, loss_fn) as given, or the mean square of the output against nothing."""
    if target is None or loss_fn is None:
        return torch.zeros(microbatch.batch_size(sample, name="sample")), _output_square
    return target, loss_fn


def _tiny_model(devices: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(_TINY_WIDTH, _TINY_WIDTH) for _ in range(devices)))


def _tiny_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def _tiny_pipeline(devices: int, rounds: int) -> tuple[dict[int, float], float]:
    """Median step seconds of a pipeline of tiny layers (one per process) under 1F1B at
    each of ``_TINY_CHUNKS`` micro-batch counts: all of it is the runtime's time; and
    the median time of an action from its inputs' arrival to its outputs' send."""
    torch.manual_seed(0)
    batch = max(_TINY_CHUNKS)
    x, y = torch.randn(batch, _TINY_WIDTH), torch.randn(batch, _TINY_WIDTH)
    out, inside = {}, []
    for chunks in _TINY_CHUNKS:
        pipe = Pipe(_tiny_model(devices), chunks=chunks, schedule="1f1b", group=mesh.world(),
                    balance=[1] * devices)  # fmt: skip
        times = []
        for step in range(3 + 2 * rounds):
            start = time.perf_counter()
            pipe.step(x, y, _tiny_loss, seed=step, trace=True)
            times.append(time.perf_counter() - start)
            inside += [a.end - a.start for a in pipe.last_trace]
            pipe.zero_grad(set_to_none=False)
        out[chunks] = statistics.median(times[3:])
    return out, statistics.median(inside)


def _solve_runtime(times: Mapping[int, float], devices: int, latency: float) -> tuple[float, float]:
    """(seconds per action, seconds per step outside actions) whose simulated 1F1B steps
    of the tiny pipeline fit ``times`` (by micro-batch count) best, by least squares.
    With equal costs the simulated step is linear in the cost of an action."""
    probe = 1e-3
    intercept, slope = {}, {}
    for chunks in times:
        schedule = build_schedule("1f1b", num_ranks=devices, num_microbatches=chunks)
        transfer = latency if devices > 1 else 0.0

        def makespan(cost: float, schedule=schedule, transfer=transfer) -> float:
            costs = Costs(forward=cost, backward=cost, weight=0.0)
            return simulate(schedule, costs, transfer=transfer).makespan

        intercept[chunks] = makespan(0.0)
        slope[chunks] = (makespan(probe) - intercept[chunks]) / probe
    xs = [slope[m] for m in times]
    ys = [times[m] - intercept[m] for m in times]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    action = max(
        0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    )
    step = max(0.0, mean_y - action * mean_x)
    return action, step
