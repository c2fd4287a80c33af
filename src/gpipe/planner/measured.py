"""Capacity, measured: train the largest model found (and the next size up) for real.

:func:`gpipe.planner.capacity.capacity` predicts, from a profile and the memory model, the
largest member of a family each layout trains within a budget per process.
:func:`verify_capacity` builds that member for real, one process per stage and replica
(``gpipe.launch``; each process builds only its own layers: the Pipe gets a function that
builds the model, see ``gpipe.materialize``), trains ``steps`` steps with the optimizer,
and reports each process's measured peak: the growth of its peak resident memory over its
resident memory right before the model was built. The peak is the kernel's high-water mark
of the process's memory (``VmHWM``), reset right before the build (``/proc/self/clear_refs``)
— not ``getrusage``'s ``ru_maxrss``, which a process started by fork and exec inherits
from its parent: a launcher holding 470 MiB made every process "grow" by 240 MiB.
It does the same for the next size up (depth + 1, same layout), which the prediction says
does not fit, to show that its measured peak exceeds the budget too.

A training process needs memory the per-stage memory model does not count: the modules
imported to record the model on ``meta`` (about 70 MiB), the allocator's arenas, the
autograd engine, the communication buffers. :func:`calibrate` measures it as the peak growth
of a one-stage run of the family's smallest member minus that member's predicted memory;
pass it to ``capacity(overhead=...)``.

The measured processes run with ``gpipe.cpu_allocator("return")`` (glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB): by
default the threshold grows with the largest block freed, after which large tensors are
carved from the heap and their memory stays resident when freed, so the peak RSS would
follow the allocator's history (measured: 30-70 MiB of scatter between runs) rather than
the tensors alive. Set it for training runs that must fit what was measured.

Sharded replicas run as ``Pipe(..., group=pp, data_parallel_group=dp, shard="params")``
with the groups of ``gpipe.parallel.mesh.Mesh``; with a Pipe that has no ``shard`` option
their rows are returned unmeasured (:class:`Measured` says so).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import resource
from dataclasses import dataclass
from typing import Any

import torch

from gpipe._utils import MiB
from gpipe.allocator import started_with
from gpipe.estimate.memory_model import Calibration
from gpipe.layout import Layout
from gpipe.parallel import mesh
from gpipe.parallel.launch import launch
from gpipe.pipe import Pipe
from gpipe.planner.capacity import fit_of, optimizer_state_of
from gpipe.planner.families import Family
from gpipe.planner.results import Fit

__all__ = ["CapacityCheck", "Measured", "calibrate", "measure_fit", "verify_capacity"]

SHARDING = "shard" in inspect.signature(Pipe).parameters  # Pipe(shard="params") has landed


@dataclass(frozen=True)
class Measured:
    """A row trained for real: per process (rank order), its measured peak growth."""

    fit: Fit
    measured: tuple[float, ...]  # bytes, rank r is stage r % K of replica r // K
    steps: int
    note: str = ""  # why it was not run, if it was not

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
    """The largest fit measured, and the next size up (predicted not to fit) measured."""

    found: Measured
    next_size: Measured | None

    def describe(self) -> str:
        lines = ["found:     " + self.found.describe()]
        if self.next_size is not None:
            predicted = "does not fit" if not self.next_size.fit.fits else "fits"
            lines.append(f"next size: {self.next_size.describe()} (predicted: {predicted})")
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
) -> float:
    """One process of a measured run: its peak memory growth while building and training."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    groups = mesh.Mesh.build(layout.stages, layout.replicas, timeout=timeout)
    share = family.batch_size // layout.replicas
    replica = rank // layout.stages
    x, y = family.batch(family.batch_size)
    x, y = x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share]
    options: dict[str, Any] = {}
    if layout.shard:
        options["shard"] = "params"
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
    return float(_peak_resident_bytes() - before)


def measure_fit(
    family: Family, fit: Fit, *, optimizer: str | float = "adamw", steps: int = 2,
    timeout: float = 300.0,
) -> Measured:  # fmt: skip
    """Train ``fit`` (its layout, depth and balance) for ``steps`` steps on K·R local
    processes and measure each one's peak memory growth."""
    layout = fit.layout
    if layout.shard and not SHARDING:
        return Measured(fit, (), steps, note="sharding is not in Pipe yet: predicted only")
    state = optimizer_state_of(optimizer)
    args = (family, fit.depth, layout, fit.balance, state, steps, timeout)
    with started_with("return"):  # read by glibc when each launched process starts
        measured = launch(_train_rank, layout.processes, args=args, timeout=timeout)
    return Measured(fit, tuple(measured), steps)


def verify_capacity(
    family: Family,
    fit: Fit,
    *,
    optimizer: str | float = "adamw",
    steps: int = 2,
    next_size: bool = True,
    timeout: float = 300.0,
) -> CapacityCheck:
    """Measure ``fit`` (a row of a capacity search) and, with ``next_size``, the same
    layout at depth + 1 (cut as lightly as it can be; predicted not to fit)."""
    found = measure_fit(family, fit, optimizer=optimizer, steps=steps, timeout=timeout)
    bigger = None
    if next_size:
        row = fit_of(
            family,
            fit.layout,
            fit.depth + 1,
            optimizer=optimizer,
            budget=fit.budget,
            overhead=fit.calibration,
        )
        bigger = measure_fit(family, row, optimizer=optimizer, steps=steps, timeout=timeout)
    return CapacityCheck(found, bigger)


def calibrate(
    family: Family,
    *,
    processes: int = 1,
    layers: int = 64,
    optimizer: str | float = "adamw",
    steps: int = 2,
    timeout: float = 300.0,
) -> Calibration:
    """What a training process needs beyond the memory model's terms, measured in
    micro-batches of one sample with re-materialization (where the terms are smallest, so
    the excess shows most): a constant, a cost per layer of its stage and one per layer of
    the whole model. On one process (every layer local) at the shallowest member and the
    first with ``layers`` layers, the slope is the sum of the two per-layer costs; on a
    pipeline of ``processes`` stages (as many processes as the rows will use: each peer
    costs connection buffers) at the same two depths, the slope of the stages' mean excess
    separates them. The constant is the largest excess of a stage, less its layers' share.
    With one process the whole slope is charged to the stage's layers.
    """
    batch = family.batch_size

    def first_depth(n: int) -> int:
        depth = 1
        while len(family.kinds(depth)) < n:
            depth += 1
        return depth

    one = Layout(stages=1, chunks=batch, checkpoint="always")
    runs = [(one, first_depth(1)), (one, first_depth(layers))]
    if processes > 1:
        pipeline = Layout(stages=processes, chunks=batch, checkpoint="always")
        runs += [(pipeline, first_depth(processes)), (pipeline, first_depth(layers))]
    stages = []  # per run: (model layers, [(excess, stage layers) per stage])
    for layout, depth in runs:
        row = fit_of(family, layout, depth, optimizer=optimizer, budget=float("inf"))
        measured = measure_fit(family, row, optimizer=optimizer, steps=steps, timeout=timeout)
        excess = [m - p.total for m, p in zip(measured.per_stage, row.memory, strict=True)]
        stages.append((len(family.kinds(depth)), list(zip(excess, row.balance, strict=True))))

    def mean(run: int) -> tuple[float, float, int]:
        n, per_stage = stages[run]
        count = len(per_stage)
        return sum(e for e, _ in per_stage) / count, sum(l for _, l in per_stage) / count, n

    (e0, _, n0), (e1, _, n1) = mean(0), mean(1)
    both = max(0.0, (e1 - e0) / (n1 - n0))  # per layer that is both local and the model's
    whole = 0.0
    if processes > 1:
        (e2, l2, n2), (e3, l3, n3) = mean(2), mean(3)
        # e3 - e2 = whole · (n3 - n2) + (both - whole) · (l3 - l2)
        whole = (e3 - e2 - both * (l3 - l2)) / ((n3 - n2) - (l3 - l2))
        whole = min(max(0.0, whole), both)
    local = both - whole
    process = max(e - local * l - whole * n for n, per_stage in stages for e, l in per_stage)
    return Calibration(max(0.0, process), whole, local)
