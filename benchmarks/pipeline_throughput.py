"""Throughput and pipeline efficiency of gpipe, side by side with torch.distributed.pipelining.

    python benchmarks/pipeline_throughput.py [--quick] [--out docs/benchmarks.md]

A GPT (8 blocks, d_model 256, sequence 128, batch 32) is trained by K=2 processes with
one thread each, for M in {1, 2, 4, 8, 16} micro-batches under every schedule (gpipe,
1f1b, zb-h1, interleaved-1f1b with 2 virtual stages where M % K == 0), without
re-materialization, plus gpipe with ``checkpoint="except_last"`` at M=8 to show its cost.

The peer is PyTorch's own ``torch.distributed.pipelining`` (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` with one stage per rank, the ZB-H1
analogue, ``ScheduleInterleaved1F1B``, and for the V schedules ``ScheduleZBVZeroBubble`` and
``ScheduleDualPipeV``, given gpipe's V placement) on the same two stage modules (the same layers,
copied before gpipe sees them, so the same initial weights), the same batch and loss, in
the same processes: for each configuration the two libraries' steps alternate, so they
see the same machine. Each step is bracketed by barriers, so a step time is that of the
slower rank.

**Pipeline efficiency** = pipelined throughput / (K × throughput of the whole model in one
process with one thread, plain forward and backward of the mini-batch). That one-process
step is timed in the same processes, on both ranks at once (as K devices would each run
the model), in every round: a round is one gpipe step, one peer step and one one-process
step; efficiency and gpipe / peer are ratios of the medians, and the paired gpipe / peer
is the median of each round's own ratio. Next to them: the schedule's
ideal, 1 - bubble of ``gpipe.schedule.simulate`` with equal F, B, W costs (M/(M+K-1) for gpipe and
1f1b), and the same simulation with the per-stage costs measured in a traced gpipe step
of that configuration (stage imbalance and real B/W ratios).

``--ranks 4 --chunks 4 8 16`` runs the same rows with K=4 processes (8 stages for the
interleaved and V schedules), into a section of its own: on a 2-core machine four
processes share two cores, so it measures how each library schedules, not a speed-up.
``--quick`` runs a tiny model for a few steps (well under a minute) to check that it works.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

import gpipe
from gpipe.models import GPTConfig, gpt, lm_loss
from gpipe.parallel.launch import launch
from gpipe.schedule import Schedule, build_schedule
from gpipe.schedule.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measured_timeline import (  # a sibling script
    add_allocator_option,
    allocator_flag,
    allocator_words,
    balance,
    machine,
    measured_costs,
    source,
    write_section,
)

SECTION = "pipeline-throughput"  # the K = 2 table; other K get their own section


@dataclass(frozen=True)
class Case:
    """One row: a gpipe schedule, its peer in torch.distributed.pipelining, M, checkpoint."""

    schedule: str
    chunks: int
    virtual: int = 1
    checkpoint: str = "never"
    ranks: int = 2  # K: processes

    def build(self) -> Schedule:
        return build_schedule(
            self.schedule,
            num_ranks=self.ranks,
            num_microbatches=self.chunks,
            virtual_stages=self.virtual,
        )

    @property
    def label(self) -> str:
        name = self.schedule + (f" (v={self.virtual})" if self.virtual > 1 else "")
        return name + (f", {self.checkpoint}" if self.checkpoint != "never" else "")


PEERS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",  # one stage per rank: ZB-H1's analogue
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-v": "ScheduleZBVZeroBubble",  # V placement: rank r holds stages r and 2K-1-r
    "dualpipe-v": "ScheduleDualPipeV",
}


@dataclass(frozen=True)
class Setup:
    config: GPTConfig
    batch: int
    chunks: tuple[int, ...]
    warmup: int  # untimed steps of each library per case
    steps: int  # timed steps of each library per case, alternating
    only: tuple[str, ...] = ()  # "schedule:M" labels to run (all when empty)
    ranks: int = 2  # K: processes
    allocator: str = "default"  # gpipe.cpu_allocator policy of every process
    transport: str = "auto"  # gpipe's: "auto" (sockets on one machine) or "group" (gloo)

    def cases(self) -> list[Case]:
        every = self._every()
        if not self.only:
            return every
        chosen = [c for c in every if f"{c.schedule}:{c.chunks}" in self.only]
        missing = set(self.only) - {f"{c.schedule}:{c.chunks}" for c in chosen}
        if missing:
            names = sorted({f"{c.schedule}:{c.chunks}" for c in every})
            raise SystemExit(f"--cases: no case {sorted(missing)}; choose from {names}")
        return chosen

    def _every(self) -> list[Case]:
        cases, k = [], self.ranks
        for m in self.chunks:
            cases += [
                Case("gpipe", m, ranks=k),
                Case("1f1b", m, ranks=k),
                Case("zb-h1", m, ranks=k),
            ]
            if m % k == 0:
                cases.append(Case("interleaved-1f1b", m, virtual=2, ranks=k))
            if m >= 2 * k:  # DualPipe-V needs M >= 2K; ZB-V's gain shows from there too
                cases += [
                    Case("zb-v", m, virtual=2, ranks=k),
                    Case("dualpipe-v", m, virtual=2, ranks=k),
                ]
            if m == 8 and k == 2:
                cases.append(Case("gpipe", m, checkpoint="except_last"))
        return cases


FULL = Setup(
    GPTConfig(vocab_size=256, context=128, d_model=256, n_heads=8, n_layers=8, dropout=0.0),
    batch=32,
    chunks=(1, 2, 4, 8, 16),
    warmup=2,
    steps=9,
)
QUICK = Setup(
    GPTConfig(vocab_size=64, context=32, d_model=64, n_heads=4, n_layers=8, dropout=0.0),
    batch=16,
    chunks=(1, 2, 4, 8, 16),
    warmup=1,
    steps=2,
)


# -- inside each launched process ----------------------------------------------------------


@dataclass
class Measured:
    """What one rank measured for one case (times in seconds)."""

    case: Case
    gpipe: list[float] = field(default_factory=list)
    peer: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)  # this rank's own one-process steps
    peer_error: str | None = None
    loss_gpipe: float = float("nan")
    loss_peer: float = float("nan")
    grad_error: float = float("nan")  # worst relative gradient difference, this rank
    trace: list = field(default_factory=list)  # one traced gpipe step


def _timed(step: Callable[[], object]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _peer(rank: int, case: Case, model: nn.Sequential, bounds: list[tuple[int, int]]):
    """The torch.distributed.pipelining schedule for ``case`` on this rank, and its modules."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    num_stages = case.ranks * case.virtual
    mine = [s for s in range(num_stages) if _placement(case)[s] == rank]
    modules = [nn.Sequential(*copy.deepcopy(list(model[a:b]))) for a, b in bounds]
    stages = [
        pipelining.PipelineStage(
            modules[s], s, num_stages, torch.device("cpu"), group=dist.group.WORLD
        )
        for s in mine
    ]
    cls = getattr(pipelining, PEERS[case.schedule])
    if cls in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B):
        schedule = cls(stages[0], n_microbatches=case.chunks, loss_fn=lm_loss)
    else:
        schedule = cls(stages, n_microbatches=case.chunks, loss_fn=lm_loss)
    return schedule, [modules[s] for s in mine]


def _placement(case: Case) -> list[int]:
    """The rank of each stage, as gpipe's schedule places them (the peer is given the same)."""
    schedule = build_schedule(
        case.schedule,
        num_ranks=case.ranks,
        num_microbatches=case.chunks,
        virtual_stages=case.virtual,
    )
    return list(schedule.stage_to_rank)


def _relative_error(ours: Sequence[nn.Parameter], theirs: Sequence[nn.Parameter]) -> float:
    worst = 0.0
    for a, b in zip(ours, theirs, strict=True):
        if a.grad is None or b.grad is None:
            return float("inf")
        scale = b.grad.abs().max().clamp_min(1e-12)
        worst = max(worst, float((a.grad - b.grad).abs().max() / scale))
    return worst


def _worker(rank: int, setup: Setup) -> list[Measured]:
    torch.set_num_threads(1)
    gpipe.cpu_allocator(setup.allocator)  # both libraries run in these processes
    cfg = setup.config
    generator = torch.Generator().manual_seed(0)
    shape = (setup.batch, cfg.context)
    x = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    y = torch.randint(0, cfg.vocab_size, shape, generator=generator)
    torch.manual_seed(0)
    whole = gpt(cfg)  # every rank builds the same weights
    lm_loss(whole(x), y).backward()  # warm-up of the one-process step
    results = []
    for case in setup.cases():
        results.append(_measure(rank, case, setup, whole, x, y))
        out = results[-1]
        print(
            f"rank {rank}: {case.label} M={case.chunks}: gpipe "
            f"{statistics.median(out.gpipe):.3f} s"
            + (f", peer {statistics.median(out.peer):.3f} s" if out.peer else "")
            + f", one process {statistics.median(out.baseline):.3f} s",
            flush=True,
        )
    return results


def _measure(
    rank: int, case: Case, setup: Setup, whole: nn.Sequential, x: torch.Tensor, y: torch.Tensor
) -> Measured:
    """Alternate gpipe, peer and one-process steps for one case, in both processes."""
    import torch.distributed as dist

    out = Measured(case)
    bal = balance(len(whole), case.ranks * case.virtual)
    starts = [sum(bal[:s]) for s in range(len(bal))]
    model = copy.deepcopy(whole)
    try:
        bounds = [(a, a + n) for a, n in zip(starts, bal, strict=True)]
        peer, peer_modules = _peer(rank, case, model, bounds)
    except Exception as error:  # e.g. a schedule it lacks for this M: shown in the table
        peer, peer_modules = None, []
        out.peer_error = f"{type(error).__name__}: {error}".splitlines()[0]
    pipe = gpipe.Pipe(
        model,
        balance=bal,
        chunks=case.chunks,
        checkpoint=case.checkpoint,
        schedule=case.schedule,
        virtual_stages=case.virtual,
        group=dist.group.WORLD,
        transport=setup.transport,
    )
    placement = _placement(case)
    holds_first, holds_last = rank == placement[0], rank == placement[-1]
    losses: list[torch.Tensor] = []

    def gpipe_step() -> None:
        out.loss_gpipe = float(pipe.step(x, y, lm_loss))

    def peer_step() -> None:
        losses.clear()
        inputs = (x,) if holds_first else ()
        targets = {"target": y, "losses": losses} if holds_last else {}
        peer.step(*inputs, **targets, return_outputs=False)
        if holds_last:  # micro-batch losses are means over equal micro-batches
            out.loss_peer = float(torch.stack(losses).detach().mean())

    def one_process() -> float:  # this rank's own time; both ranks run it at once
        whole.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        lm_loss(whole(x), y).backward()
        return time.perf_counter() - start

    def zero() -> None:
        pipe.zero_grad(set_to_none=True)
        for module in peer_modules:
            module.zero_grad(set_to_none=True)

    for i in range(setup.warmup):
        zero()
        _timed(gpipe_step)
        if peer is not None:
            _timed(peer_step)
            if i == 0:  # same gradients after one step from the same weights?
                ours = list(pipe.parameters())
                theirs = [p for module in peer_modules for p in module.parameters()]
                out.grad_error = _relative_error(ours, theirs)
    for _ in range(setup.steps):  # one round: the three steps see the same machine
        zero()
        out.gpipe.append(_timed(gpipe_step))
        if peer is not None:
            out.peer.append(_timed(peer_step))
        out.baseline.append(one_process())
    zero()
    dist.barrier()
    pipe.step(x, y, lm_loss, trace=True)
    out.trace = pipe.last_trace
    return out


# -- in the parent: the table and the plot --------------------------------------------------


@dataclass
class Row:
    case: Case
    gpipe: float  # median step seconds
    peer: float | None
    single: float  # median one-process step seconds, timed in the same rounds
    efficiency: float  # single / (K * gpipe)
    peer_efficiency: float | None
    ratio: float | None  # peer / gpipe step time: gpipe's throughput over the peer's
    paired: float | None  # median over rounds of that round's peer / gpipe step time
    paired_ci: tuple[float, float] | None  # its 95% bootstrap interval
    faster: int  # rounds in which gpipe's step was the shorter
    rounds: tuple[list[float], list[float], list[float]]  # gpipe, peer, one-process
    ideal: float
    simulated: float  # 1 - bubble with the measured per-stage costs
    loss_error: float
    grad_error: float
    peer_error: str | None


def ideal(case: Case) -> float:
    """1 - bubble of the schedule with equal F, B, W costs (M/(M+K-1) for gpipe, 1f1b)."""
    schedule = build_schedule(
        case.schedule,
        num_ranks=case.ranks,
        num_microbatches=case.chunks,
        virtual_stages=case.virtual,
    )
    return 1.0 - simulate(schedule).bubble_fraction


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the median (2000 resamples, fixed seed)."""
    import random

    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(2000))
    tail = (1.0 - level) / 2
    return medians[int(tail * len(medians))], medians[int((1.0 - tail) * len(medians)) - 1]


def rows(per_rank: list[list[Measured]]) -> list[Row]:
    """Both ranks' measurements of each case, reduced to medians and their ratios."""
    median = statistics.median
    out = []
    for index, measured in enumerate(per_rank[0]):
        both = [ranks[index] for ranks in per_rank]
        case = measured.case
        schedule = build_schedule(
            case.schedule,
            num_ranks=case.ranks,
            num_microbatches=case.chunks,
            virtual_stages=case.virtual,
        )
        trace = [e for m in both for e in m.trace]
        sim = simulate(schedule, measured_costs(schedule, trace))
        # One round = a gpipe step, a peer step and a one-process step (on both ranks).
        single = [statistics.mean(r) for r in zip(*(m.baseline for m in both), strict=True)]
        ours, peer = median(measured.gpipe), median(measured.peer) if measured.peer else None
        # (gpipe, peer) of each round; none where the peer could not run
        pairs = list(zip(measured.gpipe, measured.peer, strict=False))
        loss_p = next((m.loss_peer for m in both if m.loss_peer == m.loss_peer), float("nan"))
        out.append(
            Row(
                case,
                gpipe=ours,
                peer=peer,
                single=median(single),
                efficiency=median(single) / (case.ranks * ours),
                peer_efficiency=median(single) / (case.ranks * peer) if peer else None,
                ratio=peer / ours if peer else None,
                # Both steps of a round ran back to back: their ratio cancels slow drifts
                # of the shared machine that the two medians do not.
                paired=median(b / a for a, b in pairs) if pairs else None,
                paired_ci=median_interval([b / a for a, b in pairs]) if pairs else None,
                faster=sum(a < b for a, b in pairs),
                rounds=(measured.gpipe, measured.peer, single),
                ideal=ideal(case),
                simulated=1.0 - sim.bubble_fraction,
                loss_error=abs(measured.loss_gpipe - loss_p) / abs(loss_p),
                grad_error=max(m.grad_error for m in both),
                peer_error=next((m.peer_error for m in both if m.peer_error), None),
            )
        )
    return out


def table(results: list[Row], batch: int) -> str:
    lines = [
        "| schedule | M | gpipe samples/s | efficiency | ideal | sim. (measured costs) | "
        "peer samples/s | peer efficiency | gpipe / peer | paired gpipe / peer | "
        "paired 95% interval | rounds gpipe faster | 1-process samples/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.peer:
            peer = [
                f"{batch / r.peer:.2f}",
                f"{r.peer_efficiency:.3f}",
                f"{r.ratio:.3f}",
                f"{r.paired:.3f}",
                f"{r.paired_ci[0]:.3f}–{r.paired_ci[1]:.3f}",
                f"{r.faster} of {len(r.rounds[0])}",
            ]
        else:
            peer = ["n/a (below)", "", "", "", "", ""]
        cells = [
            r.case.label,
            str(r.case.chunks),
            f"{batch / r.gpipe:.2f}",
            f"{r.efficiency:.3f}",
            f"{r.ideal:.3f}",
            f"{r.simulated:.3f}",
            *peer,
            f"{batch / r.single:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        f"Peer n/a for {r.case.label} M={r.case.chunks}: {r.peer_error}"
        for r in results
        if r.peer_error
    ]
    return "\n".join(lines + (["", *notes] if notes else []))


def raw(results: list[Row]) -> str:
    """Every timed step, for re-analysis: a collapsed block of the markdown."""
    lines = [
        "<details><summary>Every timed step (seconds; one-process: mean of the two ranks)"
        "</summary>",
        "",
        "| schedule | M | gpipe | peer | one process |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        cells = [" ".join(f"{t:.3f}" for t in times) for times in r.rounds]
        lines.append(f"| {r.case.label} | {r.case.chunks} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", "</details>"])


def targets(results: list[Row]) -> list[str]:
    """The two targets, each as a sentence with the numbers."""
    lines = []
    for r in results:
        if r.case == Case("gpipe", 8, ranks=r.case.ranks):
            gap = 1.0 - r.efficiency / r.ideal
            verdict = "met" if gap <= 0.05 else "missed"
            where = f"{gap:.1%} below" if gap > 0 else f"{-gap:.1%} above"
            lines.append(
                f"Target gpipe efficiency at M=8 within 5% of M/(M+K-1): {verdict} "
                f"({r.efficiency:.3f} vs {r.ideal:.3f}, {where})."
            )
    # Re-materialization is not a schedule: its row is compared for information only.
    compared = [r for r in results if r.ratio is not None and r.case.checkpoint == "never"]
    for name, attr in (("ratio of medians", "ratio"), ("paired ratio", "paired")):
        behind = [r for r in compared if getattr(r, attr) < 1.0]
        lines.append(
            f"Target gpipe at least as fast as the peer for every (schedule, M), by the {name}: "
            f"{len(compared) - len(behind)} of {len(compared)} rows"
            + (
                "; behind in "
                + ", ".join(
                    f"{r.case.label} M={r.case.chunks} ({getattr(r, attr):.3f})" for r in behind
                )
                if behind
                else ""
            )
            + "."
        )
    # What the noise allows to say: a row is behind (ahead) only if the whole interval is.
    behind = [r for r in compared if r.paired_ci[1] < 1.0]
    ahead = [r for r in compared if r.paired_ci[0] > 1.0]
    label = lambda rs: ", ".join(f"{r.case.label} M={r.case.chunks}" for r in rs)  # noqa: E731
    lines.append(
        f"Beyond noise (95% interval of the paired ratio entirely below or above 1): gpipe "
        f"behind in {len(behind)} of {len(compared)} rows"
        + (f" ({label(behind)})" if behind else "")
        + f", ahead in {len(ahead)}"
        + (f" ({label(ahead)})" if ahead else "")
        + "."
    )
    return lines


def plot(results: list[Row], path: Path) -> None:
    """Efficiency vs M with the ideal curves; gpipe / peer throughput vs M."""
    from matplotlib.figure import Figure

    colours = {
        "gpipe": "#0072B2",
        "1f1b": "#E69F00",
        "zb-h1": "#009E73",
        "interleaved-1f1b": "#CC79A7",
    }
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    for name, colour in colours.items():
        mine = [r for r in results if r.case.schedule == name and r.case.checkpoint == "never"]
        if not mine:
            continue
        ms = [r.case.chunks for r in mine]
        label = mine[0].case.label
        left.plot(ms, [r.efficiency for r in mine], "o-", color=colour, label=label)
        left.plot(ms, [r.ideal for r in mine], "--", color=colour, alpha=0.7, linewidth=1)
        ratios = [(r.case.chunks, r.ratio) for r in mine if r.ratio is not None]
        right.plot(*zip(*ratios, strict=True), "o-", color=colour, label=label)
    for r in results:
        if r.case.checkpoint != "never" and r.ratio is not None:
            right.plot(
                [r.case.chunks],
                [r.ratio],
                "s",
                color=colours[r.case.schedule],
                fillstyle="none",
                label=r.case.label,
            )
    right.axhline(1.0, color="#555555", linewidth=0.8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 16], ["1", "2", "4", "8", "16"])
        ax.set_xlabel("micro-batches M")
        ax.grid(color="#dddddd", linewidth=0.6)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    left.set_ylim(0, max([1.0] + [r.efficiency + 0.02 for r in results]))
    left.set_ylabel("pipeline efficiency")
    left.set_title("gpipe efficiency (solid) and the schedule's ideal (dashed)", loc="left")
    left.legend(fontsize=8, loc="lower right", frameon=False)
    low = min([r.ratio for r in results if r.ratio is not None] + [0.9])
    high = max([r.ratio for r in results if r.ratio is not None] + [1.1])
    right.set_ylim(low - 0.05, high + 0.05)
    right.set_ylabel("gpipe samples/s ÷ peer samples/s")
    right.set_title("gpipe vs the peer (above 1: gpipe is faster)", loc="left")
    right.legend(fontsize=8, loc="best", frameon=False, ncol=2)
    fig.savefig(path, dpi=150, facecolor="white")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (< 1 min)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to update")
    parser.add_argument(
        "--img",
        type=Path,
        default=None,
        help="where the plot goes (default with --out: img/benchmark-throughput.png next to it)",
    )
    parser.add_argument(
        "--cases",
        default="",
        help="only these rows, e.g. 'zb-h1:2,gpipe:8' (schedule:M), to recheck them; "
        "the docs section is written only for a full run",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per case")
    parser.add_argument(
        "--ranks",
        type=int,
        default=2,
        help="K processes (the doc's table is K=2; K=4 on 2 cores measures scheduling, "
        "not speed-up, and --out writes it into a section of its own)",
    )
    parser.add_argument("--chunks", type=int, nargs="+", help="micro-batch counts M to run")
    add_allocator_option(parser, "every process (both libraries run in them)")
    parser.add_argument(
        "--transport", choices=["auto", "group"], default="auto",
        help="gpipe's carrier: auto (same-host sockets) or group (the process group's gloo, as "
        "between machines); the docs table is auto's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    if args.cases:
        setup = replace(setup, only=tuple(c.strip() for c in args.cases.split(",") if c.strip()))
        setup.cases()  # unknown names fail here, before any process starts
        if args.out is not None:
            parser.error("--out writes the full table: run without --cases")
    if args.ranks not in (2, 4):
        parser.error(f"--ranks must be 2 or 4 (8 blocks split evenly), got {args.ranks}")
    if args.transport != "auto" and args.out is not None:
        parser.error("--out writes the table of the default carrier: leave out --transport")
    setup = replace(setup, ranks=args.ranks, allocator=args.cpu_allocator, transport=args.transport)
    if args.chunks:
        setup = replace(setup, chunks=tuple(sorted(set(args.chunks))))
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        setup = replace(setup, steps=args.rounds)
    started, load_before, code = time.perf_counter(), os.getloadavg()[0], source()
    per_rank = launch(_worker, setup.ranks, args=(setup,), timeout=1200)
    minutes = (time.perf_counter() - started) / 60
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    results = rows(per_rank)
    text = table(results, setup.batch)
    verdicts = targets(results)
    print(text)
    print("\n".join(verdicts))
    print(f"run took {minutes:.1f} min; 1-minute load average {load}")
    for r in results:
        print(
            f"sanity {r.case.label} M={r.case.chunks}: loss differs by {r.loss_error:.1e}, "
            f"gradients by {r.grad_error:.1e} (relative)"
        )
    if args.out is None:
        return
    if args.img is None:
        suffix = "" if setup.ranks == 2 else f"-k{setup.ranks}"
        args.img = args.out.parent / "img" / f"benchmark-throughput{suffix}.png"
    args.img.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.img)
    cfg = setup.config
    folder = args.out.resolve().parent
    image = (
        args.img.resolve().relative_to(folder).as_posix()
        if args.img.resolve().is_relative_to(folder)
        else str(args.img)
    )
    command = "python benchmarks/pipeline_throughput.py" + (" --quick" if args.quick else "")
    if setup.ranks != 2:
        command += f" --ranks {setup.ranks} --chunks {' '.join(map(str, setup.chunks))}"
    elif args.chunks:
        command += f" --chunks {' '.join(map(str, setup.chunks))}"
    if args.rounds is not None:
        command += f" --rounds {args.rounds}"
    command += allocator_flag(setup.allocator)
    compared = [r for r in results if r.peer]
    worst_loss = max((r.loss_error for r in compared), default=float("nan"))
    worst_grad = max((r.grad_error for r in compared), default=float("nan"))
    singles = [r.single for r in results]
    peers = ", ".join(f"{k} → `{v}`" for k, v in PEERS.items())
    k = setup.ranks
    title = "Throughput and pipeline efficiency" + (
        ""
        if k == 2
        else f" at K={k} processes on {os.cpu_count()} cores (scheduling, not speed-up)"
    )
    sharing = (
        ""
        if k <= (os.cpu_count() or 1)
        else f" With {k} processes on {os.cpu_count()} cores the one-process reference also "
        f"runs {k} at once, so efficiency compares schedules under the same sharing, not "
        "with a device per stage."
    )
    allocator = allocator_words(setup.allocator, " in every process")
    section = f"""## {title}

Regenerate: `{command} --out docs/benchmarks.md` ({minutes:.0f} minutes; with `--quick`, a \
tiny model and few steps, it checks in under a minute that everything runs).

GPT {cfg.n_layers} blocks, d_model {cfg.d_model}, {cfg.n_heads} heads, sequence {cfg.context}, \
vocabulary {cfg.vocab_size}, float32, mini-batch {setup.batch} sequences; K={k} processes × 1 \
thread, gloo; {allocator}; `checkpoint="never"` unless stated; \
balance {balance(cfg.n_layers + 2, k)} \
(interleaved and V: {balance(cfg.n_layers + 2, 2 * k)} over {2 * k} stages); {code}. \
Machine: {machine()}. \
**Measured on a shared {os.cpu_count()}-core machine**, {k} processes (1-minute load \
average {load}), so absolute numbers move from run to run.{sharing} Each row alternates, \
in the same {k} processes, rounds of one gpipe step, one peer step and one one-process step \
({setup.steps} rounds, after {setup.warmup} warm-up steps of each library); samples/s are \
medians, and efficiency and gpipe / peer are ratios of those medians. **paired gpipe / peer** \
is the median \
over rounds of each round's peer step time / gpipe step time: the two steps of a round ran \
back to back, so their ratio is not moved by the machine getting slower or faster between \
rounds; **rounds gpipe faster** counts the rounds in which gpipe's step was the shorter. \
**paired 95% interval** is a percentile bootstrap interval of that median (2000 resamples \
of the rounds); a row is behind or ahead beyond noise only when the whole interval lies \
below or above 1. Rounds of one run share the machine's state of those minutes, so a rerun \
moves a row by more than its interval suggests.

* **efficiency** = gpipe samples/s / (K × samples/s of the whole model in one process with \
one thread: plain forward and backward of the mini-batch, no micro-batches). That \
one-process step runs on both ranks at once, as K devices would each run it; its throughput is \
the last column (its step took {statistics.median(singles):.2f} s, median over rows, \
{min(singles):.2f}–{max(singles):.2f} s).
* **ideal** = 1 − bubble of the schedule with equal F, B, W costs (`gpipe.simulate`): \
M/(M+K−1) for gpipe and 1f1b. **sim. (measured costs)** = the same with the median F, B and W \
per stage of a traced gpipe step of that row (stage imbalance, the real B : W split, no \
communication). Below it, the measured efficiency loses what the runtime adds: waiting on \
messages, per-action overhead, compute slower than in one process.
* **peer** = `torch.distributed.pipelining` ({peers}) on the same stage modules with the \
same initial weights, batch and loss. Both compute the same numbers: worst relative \
difference of the loss {worst_loss:.1e}, of any gradient {worst_grad:.1e} (float32). The \
peer does no re-materialization; the `except_last` row shows what gpipe's re-materialization costs.

{text}

{chr(10).join(f"* {v}" for v in verdicts)}

![throughput]({image})

{raw(results)}
"""
    write_section(args.out, SECTION if k == 2 else f"{SECTION}-k{k}", section)


if __name__ == "__main__":
    main()
