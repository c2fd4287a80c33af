"""The planner's search (:func:`plan`, :func:`plan_from_profiles`) and :func:`verify`; the
method is told in the docstring of :mod:`gpipe.planner`."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gpipe.base import microbatch
from gpipe.base._utils import MiB
from gpipe.base.remat import REMAT_MODES
from gpipe.engine.memory import measure_activations
from gpipe.estimate.balance import BudgetError, balance_profile
from gpipe.estimate.memory_model import (
    MemoryModel,
    held_in,
    held_microbatches,
    stage_memory,
)
from gpipe.estimate.profile import Profile, profile
from gpipe.layout import Layout, check_choices, layouts
from gpipe.parallel import mesh
from gpipe.parallel.launch import launch
from gpipe.pipe import Pipe
from gpipe.planner.machine import Link, Machine, loss_or_stand_in
from gpipe.planner.results import Candidate, Plan, Verified
from gpipe.schedule import SCHEDULES, zb_auto
from gpipe.schedule.simulate import simulate

__all__ = ["plan", "plan_from_profiles", "verify"]

# Every named schedule but those built for measured costs ("zb-auto"), which are built for
# each candidate's own costs: by default only for the (K, M, checkpoint) of the best few
# (``refine``), or everywhere when named in ``schedules``.
SEARCHED = tuple(name for name, spec in SCHEDULES.items() if not spec.takes_costs)
AUTO = "zb-auto"
ProfileSource = Profile | Mapping[int, Profile] | Callable[[int], Profile]


# -- ranking from profiles ------------------------------------------------------------------


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
    machine: Machine | None = None,
    link: Link | None = None,
    overhead: float | None = None,
    refine: int = 3,
) -> Plan:
    """Rank every candidate configuration from known per-layer costs (no model is run).

    ``profiles`` gives the profile of one micro-batch for each M: a mapping M -> Profile,
    a function of M, or one Profile scaled linearly to ``ceil(batch_size / M)`` samples.
    ``machine`` holds what the profile does not: the runtime's time per action and per
    step, the hand-overs' price, and the compute slowdown with K processes at once
    (:meth:`Machine.measure` measures them; by default 0.1 ms per action, gloo-like
    transfers, no slowdown). ``link`` or ``overhead`` (seconds per action) replace the
    machine's own.
    ``zb-auto`` schedules (``gpipe.schedule.zb_auto``) are built from a candidate's own
    per-stage costs and hand-over time, as the machine runs them, under 1F1B's memory (K
    micro-batches a rank), on one stage a rank and on ZB-V's V placement: for the (K, M,
    checkpoint) of the ``refine`` best candidates (K > 1) when ``schedules`` is not given,
    kept where faster than every named schedule of the same layout; or for every
    configuration when ``schedules`` names ``"zb-auto"``.
    The other arguments restrict the search; the defaults try K = 1..devices, M = powers
    of two up to min(batch_size, 32), every schedule but ``"zb-auto"`` (``SEARCHED``; v = 2
    for interleaved 1F1B and the V schedules) and every checkpoint mode. K = 1 is tried
    with ``"gpipe"`` (all M micro-batches held) and ``"1f1b"`` (one at a time: gradient
    accumulation; every other schedule runs as one of the two there), and
    ``"except_last"`` only with M > 1 (at M = 1 it is ``"never"``).
    """
    _check_sizes(devices, batch_size, memory_budget, overhead)
    profile_of = _profile_source(profiles, batch_size)
    machine = machine or Machine()
    given = float(overhead) if overhead is not None else machine.action
    machine = replace(machine, link=link or machine.link, action=given)
    chunk_list, schedule_list, modes, stage_list = _ranges(
        devices, batch_size, stages, chunks, schedules, checkpoints
    )
    settings = {"batch_size": batch_size, "budget": memory_budget,
                "memory": memory or MemoryModel(), "machine": machine}  # fmt: skip
    ranges = {"stages": stage_list, "schedules": schedule_list, "checkpoints": modes,
              "virtual_stages": sorted(set(virtual_stages))}  # fmt: skip
    profiles_used = {m: profile_of(m) for m in chunk_list}
    fitting, rejected = _candidates(profiles_used, ranges, settings)
    fitting.sort(key=Candidate.rank_key)
    if schedules is None and refine > 0:
        fitting += _zb_auto_for_the_best(fitting, profiles_used, virtual_stages, refine, settings)
        fitting.sort(key=Candidate.rank_key)
    rejected.sort(key=lambda c: (max(c.memory) if c.memory else math.inf, c.rank_key()))
    return Plan(fitting, rejected, batch_size, devices, memory_budget, profiles_used,
                machine=machine)  # fmt: skip


def _candidates(
    profiles: dict[int, Profile], ranges: dict[str, list], settings: dict[str, Any]
) -> tuple[list[Candidate], list[Candidate]]:
    """Every layout of ``ranges`` at each M of ``profiles``, evaluated: those that fit the
    budget and those that do not."""
    fitting, rejected = [], []
    for m, prof in profiles.items():
        for layout in layouts(chunks=[m], layers=len(prof.layers), **ranges):
            candidate = _evaluate(prof, layout, **settings)
            (fitting if candidate.fits else rejected).append(candidate)
    return fitting, rejected


def _check_sizes(devices: Any, batch_size: Any, budget: Any, overhead: Any) -> None:
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if budget is not None and not budget > 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {budget!r}")
    if overhead is not None and (not isinstance(overhead, int | float) or overhead < 0):
        raise ValueError(f"overhead must be a non-negative number of seconds, got {overhead!r}")


def _ranges(
    devices: int,
    batch_size: int,
    stages: Iterable[int] | None,
    chunks: Iterable[int] | None,
    schedules: Iterable[str] | None,
    checkpoints: Iterable[str] | None,
) -> tuple[list[int], list[str], list[str], list[int]]:
    """The M, schedules, checkpoint modes and K searched (the defaults where not given)."""
    chunk_list = _chunk_list(chunks, batch_size)
    too_many = [m for m in chunk_list if not 1 <= m <= batch_size]
    if too_many:
        raise ValueError(f"chunks {too_many} are not in 1..batch_size ({batch_size})")
    schedule_list = sorted(set(schedules)) if schedules is not None else sorted(SEARCHED)
    modes = list(checkpoints) if checkpoints is not None else list(REMAT_MODES)
    check_choices(schedules=schedule_list, checkpoints=modes)  # before any profiling
    stage_list = sorted(set(stages)) if stages is not None else list(range(1, devices + 1))
    if any(not 1 <= k <= devices for k in stage_list):
        raise ValueError(f"stages {stage_list} must lie in 1..devices ({devices})")
    return chunk_list, schedule_list, modes, stage_list


def _chunk_list(chunks: Iterable[int] | None, batch_size: int) -> list[int]:
    """The M searched: as given, else the powers of two up to min(batch_size, 32)."""
    if chunks is not None:
        return sorted(set(chunks))
    return [2**e for e in range(6) if 2**e <= batch_size]


def _zb_auto_for_the_best(ranked, profiles, virtual_stages, refine, settings) -> list[Candidate]:
    """zb-auto built for the (K, M, checkpoint) of the ``refine`` best of ``ranked`` (K > 1),
    where it beats every named schedule of its layout."""
    chosen: list[tuple[int, int, str]] = []
    for c in ranked:
        if c.stages > 1 and (c.stages, c.chunks, c.checkpoint) not in chosen:
            chosen.append((c.stages, c.chunks, c.checkpoint))
    fastest: dict[tuple[int, int, int, str], float] = {}
    for c in ranked:
        key = (c.stages, c.virtual_stages, c.chunks, c.checkpoint)
        fastest[key] = max(fastest.get(key, 0.0), c.throughput)
    found = []
    for k, m, mode in chosen[:refine]:
        for layout in layouts(
            stages=[k],
            chunks=[m],
            schedules=[AUTO],
            checkpoints=[mode],
            virtual_stages=sorted(set(virtual_stages)),
            layers=len(profiles[m].layers),
        ):
            candidate = _evaluate(profiles[m], layout, **settings)
            best = fastest.get((k, layout.virtual_stages, m, mode), 0.0)
            if candidate.fits and candidate.throughput > best * (1 + 1e-9):
                found.append(candidate)
    return found


def _evaluate(
    prof: Profile,
    layout: Layout,
    *,
    batch_size: int,
    budget: float | None,
    memory: MemoryModel,
    machine: Machine,
) -> Candidate:
    k, v, m, mode = layout.stages, layout.virtual_stages, layout.chunks, layout.checkpoint
    # zb-auto is cut as the hand-made zero-bubble schedule of its placement, then built for
    # that cut's costs
    auto = layout.schedule == AUTO
    like = replace(layout, schedule="zb-h1" if v == 1 else "zb-v") if auto else layout
    schedule = like.build_schedule()
    try:
        part = balance_profile(
            prof,
            stages=layout.num_stages,
            by="step",
            chunks=m,
            checkpoint=mode,  # type: ignore[arg-type]
            schedule=schedule,
            memory_budget=None if budget is None else budget / v,
            memory=memory,
            held=held_microbatches(schedule, mode),
        )
    except BudgetError as error:
        return _no_cut(layout, schedule, error)
    costs, transfer = machine.stage_costs(prof, part.balance, schedule, mode)
    if auto:
        schedule = zb_auto(k, m, costs=costs, transfer=transfer, virtual_stages=v)
    result = simulate(schedule, costs, transfer=transfer)
    stage_mem = stage_memory(
        prof,
        part.balance,
        held_in(result, mode),
        memory,
        splits_backward=schedule.splits_backward(0, 0),
    )
    per_device = _per_rank(schedule, k, [stage.total for stage in stage_mem])
    fits = budget is None or max(per_device) <= budget
    reason = ""
    if not fits:
        worst = max(range(k), key=per_device.__getitem__)
        reason = f"device {worst} needs {per_device[worst] / MiB:.1f} MiB"
    step = machine.step_time(result.makespan, k, m)
    return Candidate(
        layout=layout,
        balance=tuple(part.balance),
        step_time=step,
        throughput=batch_size / step if step > 0 else math.inf,
        bubble=result.bubble_fraction,
        memory=tuple(per_device),
        stage_memory=tuple(stage_mem),
        fits=fits,
        reason=reason,
        built=schedule if auto else None,
    )


def _per_rank(schedule: Any, ranks: int, per_stage: list[float]) -> list[float]:
    """Bytes per rank: the sum of its stages'."""
    per_device = [0.0] * ranks
    for s, need in enumerate(per_stage):
        per_device[schedule.stage_to_rank[s]] += need
    return per_device


def _no_cut(layout: Layout, schedule: Any, error: BudgetError) -> Candidate:
    """The candidate of a layout no cut of which fits the budget."""
    return Candidate(
        layout=layout,
        balance=tuple(error.balance),
        step_time=math.inf,
        throughput=0.0,
        bubble=math.nan,
        memory=tuple(_per_rank(schedule, layout.stages, list(error.needed))),
        fits=False,
        reason=f"no cut fits: {max(error.missing) / MiB:.1f} MiB missing on a stage",
    )


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
    calibrate: bool = False,
    **search: Any,
) -> Plan:
    """Profile ``model`` and rank configurations for ``devices`` devices (see module doc).

    ``sample`` is one mini-batch of inputs (``target`` its targets, ``loss_fn`` the loss;
    without them the last layer's backward starts from a random gradient and
    :func:`verify` trains on the mean square of the output). The model is profiled on
    ``device`` once per micro-batch count M, on the first micro-batch of
    ``sample`` split M ways. ``search`` takes the keyword arguments of
    :func:`plan_from_profiles` (``stages``, ``chunks``, ``schedules``, ``checkpoints``,
    ``virtual_stages``, ``memory``, ``machine``, ``link``, ``overhead``). ``verify=N``
    runs the top N for ``verify_steps`` steps each (:func:`verify`).

    ``calibrate=True`` first measures the machine (:meth:`Machine.measure`, in
    ``devices`` local processes) against the profile of each micro-batch count searched,
    and predicts with it; ``model`` and ``loss_fn`` must then be picklable.
    """
    batch_size = microbatch.batch_size(sample, name="sample")

    @functools.cache  # each M profiled once, for the calibration and the search
    def profile_of(m: int) -> Profile:
        x = microbatch.split(sample, m, name="sample")[0]
        y = None if target is None else microbatch.split(target, m, name="target")[0]
        return profile(model, x, device, target=y, loss_fn=loss_fn, repeats=repeats,
                       warmup=warmup)  # fmt: skip

    if calibrate:
        if search.get("machine") is not None:
            raise ValueError("give a measured machine or calibrate=True, not both")
        profiles = {m: profile_of(m) for m in _chunk_list(search.get("chunks"), batch_size)}
        search["machine"] = Machine.measure(
            model, sample, profiles, devices=devices, target=target, loss_fn=loss_fn
        )
    result = plan_from_profiles(
        profile_of, batch_size=batch_size, devices=devices, memory_budget=memory_budget, **search
    )
    if verify:
        result.verified = _verify(
            result, model, sample, target, loss_fn, top=verify, steps=verify_steps
        )
    return result


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
    rounds: int = 2,
    timeout: float = 300.0,
) -> list[Verified]:
    """Run the top ``top`` candidates of ``result``: K local processes, one thread each.

    ``model`` (or a function building it) and ``loss_fn`` must be picklable: they are sent
    to the processes. The candidates take turns for ``rounds`` rounds (so that a slow
    spell of a shared machine does not fall on one of them); in each, every process
    trains ``warmup`` + ``steps`` steps on ``sample``. The median step time of rank 0 over
    all rounds gives the measured throughput (every rank ends a step together). One
    more step is run under ``gpipe.measure_activations``.
    """
    target, loss_fn = loss_or_stand_in(sample, target, loss_fn)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    chosen = result.candidates[:top]
    times: list[list[float]] = [[] for _ in chosen]
    activations: list[tuple[int, ...]] = [() for _ in chosen]
    for _ in range(rounds):
        for n, candidate in enumerate(chosen):
            outcome = launch(
                _measure_rank,
                candidate.stages,
                args=(model, sample, target, loss_fn, candidate.pipe_kwargs(), steps, warmup),
                timeout=timeout,
            )
            times[n] += outcome[0]["times"]
            activations[n] = tuple(r["activations"] for r in outcome)
    verified = []
    for candidate, measured, held in zip(chosen, times, activations, strict=True):
        step = statistics.median(measured)
        verified.append(
            Verified(
                candidate,
                step_time=step,
                throughput=result.batch_size / step,
                activation_bytes=held,
                steps=len(measured),
                step_times=tuple(measured),
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
