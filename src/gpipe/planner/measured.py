"""Capacity, measured: train the largest model found (and the next size up) for real.

:func:`gpipe.planner.capacity.capacity` predicts, from a profile and the memory model, the
largest member of a family each layout trains within a budget per process.
:func:`verify_capacity` builds that member for real, one process per stage and replica
(``gpipe.launch``; each process builds only its own layers: the Pipe gets a function that
builds the model, see ``gpipe.materialize``), trains ``steps`` steps with the optimizer,
and reports each process's measured peak: the peak resident memory of the *whole* process
(what a budget per process pays: Python, torch and the process group included), and what it
held right before the model was built. The peak is the kernel's high-water mark of the
process's memory (``VmHWM``), reset right before the build (``/proc/self/clear_refs``)
— not ``getrusage``'s ``ru_maxrss``, which a process started by fork and exec inherits
from its parent: a launcher holding 470 MiB made every process "grow" by 240 MiB.
It does the same for the next size up (depth + 1, same layout), which the prediction says
does not fit, to show that its measured peak exceeds the budget too.

A training process needs memory the per-stage memory model does not count: what it holds
before its model (Python, torch, gloo: about 230 MiB on a CPU), the modules imported to
record the model on ``meta``, the allocator's arenas, the autograd engine, the
communication buffers. :func:`calibrate` measures them (see its docstring); pass the
answer to ``capacity(overhead=...)``.

The measured processes start with the allocator policy ``"return"``
(``gpipe.base.allocator.environment``: glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB,
Python's objects from ``malloc``): by default the threshold grows with the largest block
freed, after which large tensors are carved from the heap and their memory stays resident
when freed, so the peak RSS would follow the allocator's history (measured: 30-70 MiB of
scatter between runs, and a GPT that fits under it grows 389.8 MiB against 384 without
it) rather than the tensors alive. A run that must fit what was measured needs it too:
``gpipe train --cpu-allocator return``, which ``gpipe plan --write-config`` writes for a
plan under a memory budget.

Sharded replicas run as ``Pipe(..., group=pp, data_parallel_group=dp, shard="all")``
with the groups of ``gpipe.parallel.mesh.Mesh``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import resource
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from gpipe.base._utils import MiB
from gpipe.base.allocator import started_with
from gpipe.layout import Layout
from gpipe.parallel import mesh
from gpipe.parallel.launch import launch
from gpipe.pipe import Pipe
from gpipe.planner import verify_search
from gpipe.planner.capacity import fit_of, optimizer_state_of
from gpipe.planner.families import Family
from gpipe.planner.results import Fit

__all__ = ["CapacityCheck", "Measured", "measure_fit", "measure_fits", "verify_capacity"]


@dataclass(frozen=True)
class Measured:
    """A row trained for real: per process (rank order), its measured peak (the whole
    process's) and what it held before the model was built."""

    fit: Fit
    measured: tuple[float, ...]  # bytes, rank r is stage r % K of replica r // K
    steps: int
    note: str = ""  # why it was not run, if it was not
    before: tuple[float, ...] = ()  # bytes resident right before the build, per process

    @property
    def growth(self) -> tuple[float, ...]:
        """Per process, its peak over what it held before the model."""
        return tuple(m - b for m, b in zip(self.measured, self.before, strict=True))

    @property
    def ran(self) -> bool:
        return bool(self.measured)

    @property
    def per_stage(self) -> tuple[float, ...]:
        """The largest measured peak of each stage's processes."""
        k = self.fit.layout.stages
        return tuple(max(self.measured[s::k]) for s in range(k))

    @property
    def peak(self) -> float:
        return max(self.measured)

    @property
    def fits(self) -> bool:
        """Measured within the budget, on every process."""
        return self.peak <= self.fit.budget

    @property
    def ratios(self) -> tuple[float, ...]:
        """Measured over predicted, per stage."""
        return tuple(m / p for m, p in zip(self.per_stage, self.fit.peaks, strict=True))

    def describe(self) -> str:
        fit = self.fit
        head = f"{fit.layout.label()} depth {fit.depth} ({fit.parameters:,} parameters)"
        if not self.ran:
            return f"{head}: predicted {fit.peak / MiB:.1f} MiB, not run ({self.note})"
        stages = ", ".join(
            f"{m / MiB:.1f}/{p / MiB:.1f}" for m, p in zip(self.per_stage, fit.peaks, strict=True)
        )
        verdict = "fits" if self.fits else "exceeds"
        return (
            f"{head}: measured/predicted MiB per stage {stages}; measured peak "
            f"{self.peak / MiB:.1f} {verdict} the budget {fit.budget / MiB:.1f}"
        )


@dataclass(frozen=True)
class CapacityCheck:
    """The largest fit measured, and the next size up (predicted not to fit) measured.

    With ``verify_capacity(refine=True)`` the depths are measured ones: ``found`` is the
    deepest member measured within the budget and ``next_size`` one block more, measured
    over it; ``predicted`` is the search's row they started from.
    """

    found: Measured
    next_size: Measured | None
    predicted: Fit | None = None
    again: tuple[Measured, ...] = ()  # the found depth and the next size up, run again
    launches: int = 0  # measured runs in all (each K·R processes), the refinement's included

    @property
    def scatter(self) -> float:
        """Bytes: the most one process's peak moved between runs of one depth (0: none
        repeated). Per process, not the runs' largest peaks: which process peaks highest
        changes from run to run, and K processes at two depths sample the spread 2K times
        where the largest peaks sample it twice; it is never less than their spread. (GPT
        K=4 remat: the largest peaks of two runs spread 0.72 MiB, one process's 1.98, and
        processes started on their own read up to 1.29 MiB above the runs' largest.)"""
        runs: dict[int, list[tuple[float, ...]]] = {}
        for m in (self.found, self.next_size, *self.again):
            if m is not None and m.ran:
                runs.setdefault(m.fit.depth, []).append(m.measured)
        return max(
            (max(p) - min(p) for peaks in runs.values() for p in zip(*peaks, strict=True)),
            default=0.0,
        )

    def _peaks(self, depth: int) -> list[float]:
        runs = (self.found, self.next_size, *self.again)
        return [m.peak for m in runs if m is not None and m.ran and m.fit.depth == depth]

    def _fits_clearly(self) -> bool:
        """The found depth within the budget by at least the scatter in every run."""
        return max(self._peaks(self.found.fit.depth)) <= self.found.fit.budget - self.scatter

    def _over_clearly(self) -> bool:
        """The next size up (one block deeper) over the budget by more than the scatter in
        every run."""
        bigger, found = self.next_size, self.found.fit.depth
        if bigger is None or not bigger.ran or bigger.fit.depth != found + 1:
            return False
        return min(self._peaks(found + 1)) > self.found.fit.budget + self.scatter

    @property
    def exact(self) -> bool:
        """Measured and repeatable: the found member fits, and the next size up (one block
        deeper) exceeds the budget, each by more than the runs' scatter in every run, so
        that another run, or another launch of the same processes, decides the same."""
        return self.found.ran and self._fits_clearly() and self._over_clearly()

    @property
    def depths(self) -> tuple[int, int]:
        """The range the runs decide (one depth when ``exact``): from the one below the found
        depth where that fits by less than the scatter (or went over in a run), to the next
        size up where that is over by less than it."""
        low = self.found.fit.depth
        if self.next_size is None or not self.found.ran:
            return (low, low)
        return (low - (not self._fits_clearly()), low + (not self._over_clearly()))

    def _over_once(self) -> bool:
        """A run of the found depth measured over the budget."""
        return max(self._peaks(self.found.fit.depth)) > self.found.fit.budget

    @property
    def predicted_depth(self) -> int:
        return (self.predicted or self.found.fit).depth

    def describe(self) -> str:
        lines = ["found:     " + self.found.describe()]
        if self.next_size is not None:
            predicted = "does not fit" if not self.next_size.fit.fits else "fits"
            lines.append(f"next size: {self.next_size.describe()} (predicted: {predicted})")
        if self.predicted is not None and self.predicted.depth != self.found.fit.depth:
            moved = self.found.fit.depth - self.predicted.depth
            lines.append(f"predicted depth {self.predicted.depth}: off by {moved:+d} block(s)")
        if self.again:
            low, high = self.depths
            why = "; ".join(w for w, bad in (
                ("a run of the found depth went over the budget", self._over_once()),
                ("the found depth is not within the budget by more than it",
                 not self._over_once() and not self._fits_clearly()),
                ("the next size up is not over the budget by more than it",
                 not self._over_clearly())) if bad)  # fmt: skip
            verdict = f"exact: depth {low}" if self.exact else f"depth {low}-{high}: {why}"
            lines.append(
                f"scatter between runs of one depth {self.scatter / MiB:.1f} MiB; {verdict}"
            )
        return "\n".join(lines)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Start the high-water mark of resident memory afresh (Linux 4.0+); False if not."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_resident_bytes() -> int:
    """The high-water mark of resident memory since the last reset (or the start)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _optimizer(parameters: Any, state: float) -> torch.optim.Optimizer:
    if state == 2:
        return torch.optim.AdamW(parameters, lr=1e-4)
    if state == 1:
        return torch.optim.SGD(parameters, lr=1e-4, momentum=0.9)
    if state == 0:
        return torch.optim.SGD(parameters, lr=1e-4)
    raise ValueError(f"no optimizer keeps {state} states per parameter; use 0, 1 or 2")


def _train_rank(
    rank: int,
    family: Family,
    depth: int,
    layout: Layout,
    balance: tuple[int, ...],
    state: float,
    steps: int,
    timeout: float,
) -> tuple[float, float]:
    """One process of a measured run: its peak resident memory while building and training,
    and what it held before the build."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    groups = mesh.Mesh.build(layout.stages, layout.replicas, timeout=timeout)
    share = family.batch_size // layout.replicas
    replica = rank // layout.stages
    x, y = family.batch(family.batch_size)
    x, y = x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share]
    options: dict[str, Any] = {}
    if layout.shard:
        options["shard"] = layout.shard
    gc.collect()
    _reset_peak()
    before = _resident_bytes()
    pipe = Pipe(
        functools.partial(family.build, depth),
        balance=list(balance),
        chunks=layout.chunks,
        schedule=layout.schedule,
        checkpoint=layout.checkpoint,  # type: ignore[arg-type]
        checkpoint_layers=layout.checkpoint_layers,
        group=groups.pp,
        data_parallel_group=groups.dp,
        timeout=timeout,
        **options,
    )
    parameters = list(pipe.parameters())  # a stage of pooling layers has none
    optimizer = _optimizer(parameters, state) if parameters else None
    for step in range(steps):
        pipe.step(x, y, family.loss_fn, seed=step)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return float(_peak_resident_bytes()), float(before)


def measure_fit(
    family: Family, fit: Fit, *, optimizer: str | float = "adamw", steps: int = 2,
    timeout: float = 300.0,
) -> Measured:  # fmt: skip
    """Train ``fit`` (its layout, depth and balance) for ``steps`` steps on K·R local
    processes and measure each one's peak resident memory (the whole process's)."""
    state = optimizer_state_of(optimizer)
    args = (family, fit.depth, fit.layout, fit.balance, state, steps, timeout)
    with started_with("return"):  # read by glibc and Python when each process starts
        measured = launch(_train_rank, fit.layout.processes, args=args, timeout=timeout)
    peaks, before = zip(*measured, strict=True)
    return Measured(fit, tuple(peaks), steps, before=tuple(before))


def verify_capacity(
    family: Family,
    fit: Fit,
    *,
    optimizer: str | float = "adamw",
    steps: int = 2,
    next_size: bool = True,
    refine: bool = False,
    moves: int = 4,
    repeats: int = 2,
    parallel: int = 1,
    timeout: float = 300.0,
) -> CapacityCheck:
    """Measure ``fit`` (a row of a capacity search) and, with ``next_size``, the same
    layout at depth + 1 (cut as lightly as it can be; predicted not to fit).

    ``repeats``: runs of the found depth and of the next size up, for the scatter of a
    peak between runs (one process's largest spread); ``exact`` then holds only where the
    found depth fits and the next size up exceeds the budget, each by more than that scatter
    in every run (``depths`` says the range the runs decide).

    ``refine``: the answer exact to one block, measured, in at most ``moves`` runs after
    the first two (``exact`` says whether it got there): each round measures two adjacent
    depths aimed at the budget from the measured peaks (``gpipe.planner.verify_search``),
    until the found depth fits and the next one does not. Where it ran out of moves,
    ``found`` is the deepest measured within the budget (or the shallowest over it, if
    none fit) and ``next_size`` the shallowest deeper one measured, which may still fit.

    ``parallel``: runs measured at once (the two depths of a round, a round's repeats):
    each process's peak is its own (``VmHWM``), so runs side by side measure what they
    measure alone, in less time where one run leaves cores idle; each needs its K·R
    processes' memory.
    """

    launches = 0

    def measure(depths: list[int]) -> list[Measured]:
        nonlocal launches
        launches += len(depths)
        rows = [fit if d == fit.depth else fit_of(
            family, fit.layout, d, optimizer=optimizer, budget=fit.budget,
            overhead=fit.calibration) for d in depths]  # fmt: skip
        return measure_fits(family, rows, optimizer=optimizer, steps=steps,
                            timeout=timeout, parallel=parallel)  # fmt: skip

    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    first = measure([fit.depth, fit.depth + 1] if next_size else [fit.depth])
    found, bigger = first[0], (first[1] if next_size else None)
    if refine and found.ran:

        def peak(depth: int) -> float:
            return fit_of(family, fit.layout, depth, optimizer=optimizer, budget=fit.budget,
                          overhead=fit.calibration).peak  # fmt: skip

        found, bigger = verify_search.refine(first, measure, peak, moves)
    check = CapacityCheck(found, bigger, fit)
    depths = [m.fit.depth for m in (found, bigger) if m is not None and m.ran]
    again = tuple(measure(depths * (repeats - 1)))
    return replace(check, again=again, launches=launches)


def measure_fits(
    family: Family, fits: list[Fit], *, parallel: int = 1, **options: Any
) -> list[Measured]:
    """:func:`measure_fit` of each of ``fits``, ``parallel`` at a time, in their order."""
    if parallel <= 1 or len(fits) <= 1:
        return [measure_fit(family, f, **options) for f in fits]
    with started_with("return"), ThreadPoolExecutor(parallel) as pool:  # one environment
        return list(pool.map(lambda f: measure_fit(family, f, **options), fits))
