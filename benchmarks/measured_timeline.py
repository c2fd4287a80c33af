"""Measured timelines of a 2-process pipeline next to their simulation with measured costs.

    python benchmarks/measured_timeline.py [--quick] [--out docs/benchmarks.md]

Two processes (one thread each) train the GPT of ``benchmarks/pipeline_throughput.py``
with M=8 micro-batches under the schedules gpipe, 1f1b, zb-h1, zb-v and zb-auto (built on
the V placement from the F, B, W and transfer costs measured in the median traced zb-v
step, ``gpipe.schedule.zb_auto``; both ranks build it from both ranks' traces). Each rank
records its actions (``Pipe.step(..., trace=True)``); the parent gathers both ranks' traces, derives
the median cost of F, B and W per stage, simulates the same schedule with those costs
(``gpipe.schedule.simulate``) and draws simulated above measured into
``docs/img/measured-vs-simulated-<schedule>.png``. It prints the predicted and measured
makespan and bubble; with ``--out`` it writes them into the "Measured timelines" section
of that markdown file (the rest of the file is left alone).

A traced action starts when its inputs are there (the runtime's receive has returned),
so the white space in a measured row is time spent waiting: the bubble and transfers.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import gpipe
import gpipe.train.timeline as timeline
from gpipe.base.allocator import POLICIES
from gpipe.models import GPTConfig, gpt, lm_loss
from gpipe.parallel.launch import launch
from gpipe.schedule import Action, Kind, Schedule, TimedAction, build_schedule, zb_auto
from gpipe.schedule.simulate import Costs, SimulationResult, simulate

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-v", "zb-auto")
V_SCHEDULES = ("zb-v", "zb-auto")  # two stages per rank, in a V
SECTION = "measured-timeline"

# -- traces, costs and bubbles -------------------------------------------------------------


def shifted(events: Sequence[TimedAction], origin: float) -> list[TimedAction]:
    return [replace(e, start=e.start - origin, end=e.end - origin) for e in events]


def measured_costs(schedule: Schedule, events: Sequence[TimedAction], scale: float = 1.0) -> Costs:
    """Median duration of F, B and W per stage (times ``scale``), as simulation costs.

    A stage whose backward is not split gets its whole backward as ``backward`` and
    ``weight=0`` (the simulator charges an unsplit B ``backward + weight``).
    """
    durations: dict[tuple[Kind, int], list[float]] = {}
    for e in events:
        durations.setdefault((e.action.kind, e.action.stage), []).append(e.duration * scale)

    def median(kind: Kind, stage: int) -> float:
        values = durations.get((kind, stage))
        return statistics.median(values) if values else 0.0

    stages = range(schedule.num_stages)
    return Costs(
        forward=[median(Kind.FORWARD, s) for s in stages],
        backward=[median(Kind.BACKWARD, s) for s in stages],
        weight=[median(Kind.WEIGHT, s) for s in stages],
    )


def bubble(events: Sequence[TimedAction], num_ranks: int) -> tuple[float, float]:
    """(makespan, idle share 1 - busy / (ranks * makespan)) of a measured step."""
    start = min(e.start for e in events)
    makespan = max(e.end for e in events) - start
    busy = sum(e.duration for e in events)
    return makespan, 1.0 - busy / (num_ranks * makespan)


def transfer_latency(events: Sequence[TimedAction], schedule: Schedule) -> float:
    """Median seconds from a producer's end to the start of its consumer on another rank.

    Counted only where the consumer's rank was idle when the producer ended (it was
    waiting for that message), so the gap is the transfer as the runtime sees it.
    """
    ends = {e.action: e.end for e in events}
    by_rank: dict[int, list[TimedAction]] = {}
    for e in sorted(events, key=lambda e: e.start):
        by_rank.setdefault(e.rank, []).append(e)
    gaps = []
    for rank_events in by_rank.values():
        for before, e in itertools.pairwise(rank_events):
            kind, stage, m = e.action.kind, e.action.stage, e.action.microbatch
            if kind is Kind.FORWARD and stage > 0:
                producer = Action(Kind.FORWARD, stage - 1, m)
            elif kind is Kind.BACKWARD and stage < schedule.num_stages - 1:
                producer = Action(Kind.BACKWARD, stage + 1, m)
            else:
                continue
            if schedule.stage_to_rank[producer.stage] == e.rank or producer not in ends:
                continue
            if before.end <= ends[producer] <= e.start:
                gaps.append(e.start - ends[producer])
    return statistics.median(gaps) if gaps else 0.0


@dataclass
class Timeline:
    """One measured step of one schedule, both ranks, with its simulation."""

    schedule: str
    measured: list[TimedAction]  # shifted to start at 0, seconds
    simulated: SimulationResult  # with the measured per-stage costs, in ms
    transfer_ms: float

    def row(self) -> list[str]:
        span, idle = bubble(self.measured, self.simulated.schedule.num_ranks)
        predicted = self.simulated.makespan
        return [
            self.schedule,
            f"{predicted:.0f}",
            f"{span * 1e3:.0f}",
            f"{span * 1e3 / predicted:.3f}",
            f"{self.simulated.bubble_fraction:.1%}",
            f"{idle:.1%}",
            f"{self.transfer_ms:.2f}",
        ]


# -- the run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    config: GPTConfig
    batch: int
    chunks: int
    warmup: int
    steps: int  # traced steps; the one with the median makespan is drawn
    allocator: str = "default"  # gpipe.cpu_allocator policy of both processes


FULL = Setup(
    GPTConfig(vocab_size=256, context=128, d_model=256, n_heads=8, n_layers=8, dropout=0.0),
    batch=32,
    chunks=8,
    warmup=2,
    steps=3,
)
QUICK = Setup(
    GPTConfig(vocab_size=64, context=32, d_model=64, n_heads=4, n_layers=4),
    batch=16,
    chunks=8,
    warmup=1,
    steps=2,
)


def balance(num_layers: int, num_stages: int) -> list[int]:
    """Blocks split evenly; the embedding joins the first stage and the head the last."""
    blocks = num_layers - 2
    if blocks % num_stages:
        raise ValueError(f"{blocks} blocks do not split evenly into {num_stages} stages")
    cut = [blocks // num_stages] * num_stages
    cut[0] += 1
    cut[-1] += 1
    return cut


def _median_step(steps: Sequence[Sequence[TimedAction]]) -> list[TimedAction]:
    """Of several steps (each both ranks' events), the one with the median makespan."""
    ordered = sorted(steps, key=lambda events: bubble(events, 2)[0])
    return list(ordered[len(ordered) // 2])


def _zb_auto_from(steps: Sequence[Sequence[TimedAction]], chunks: int) -> Schedule:
    """zb-auto on the V, for the per-stage costs and transfer of a measured zb-v step."""
    events = _median_step(steps)
    v_shape = build_schedule("zb-v", num_ranks=2, num_microbatches=chunks, virtual_stages=2)
    costs = measured_costs(v_shape, events, scale=1e3)
    transfer = transfer_latency(events, v_shape) * 1e3
    return zb_auto(2, chunks, costs=costs, transfer=transfer, virtual_stages=2)


def _traced(rank: int, setup: Setup) -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    gpipe.cpu_allocator(setup.allocator)
    generator = torch.Generator().manual_seed(0)
    shape = (setup.batch, setup.config.context)
    x = torch.randint(0, setup.config.vocab_size, shape, generator=generator)
    y = torch.randint(0, setup.config.vocab_size, shape, generator=generator)
    results = []
    for name in SCHEDULES:
        torch.manual_seed(0)
        model = gpt(setup.config)
        v = 2 if name in V_SCHEDULES else 1
        schedule: str | Schedule = name
        if name == "zb-auto":
            mine = [r["trace"] for r in results if r["schedule"] == "zb-v"]
            both: list = [None, None]
            dist.all_gather_object(both, mine)
            schedule = _zb_auto_from([a + b for a, b in zip(*both, strict=True)], setup.chunks)
        pipe = gpipe.Pipe(
            model,
            balance=balance(len(model), 2 * v),
            chunks=setup.chunks,
            checkpoint="never",
            schedule=schedule,
            virtual_stages=v,
            group=dist.group.WORLD,
        )
        for step in range(setup.warmup + setup.steps):
            pipe.zero_grad(set_to_none=True)
            dist.barrier()
            pipe.step(x, y, lm_loss, trace=step >= setup.warmup)
            if step >= setup.warmup:
                results.append({"schedule": name, "trace": pipe.last_trace, "built": schedule})
    return results


def timelines(setup: Setup) -> list[Timeline]:
    """Run the traced steps in 2 launched processes and simulate each schedule."""
    per_rank = launch(_traced, 2, args=(setup,), timeout=600)
    out = []
    for name in SCHEDULES:
        kept = [[r for r in ranks if r["schedule"] == name] for ranks in per_rank]
        steps = [kept[0][i]["trace"] + kept[1][i]["trace"] for i in range(setup.steps)]
        events = _median_step(steps)
        schedule = kept[0][0]["built"]
        if isinstance(schedule, str):
            v = 2 if name in V_SCHEDULES else 1
            schedule = build_schedule(
                name, num_ranks=2, num_microbatches=setup.chunks, virtual_stages=v
            )
        transfer = transfer_latency(events, schedule)
        simulated = simulate(
            schedule, measured_costs(schedule, events, scale=1e3), transfer=transfer * 1e3
        )
        origin = min(e.start for e in events)
        out.append(Timeline(name, shifted(events, origin), simulated, transfer * 1e3))
    return out


# -- report -------------------------------------------------------------------------------------


def write_section(path: Path, name: str, text: str) -> None:
    """Replace the section between ``<!-- name:begin -->`` and ``<!-- name:end -->``.

    Appends it when the file has no such section (creating the file if needed).
    """
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + block + ("\n" + tail if tail else "")
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + block
    path.write_text(new)


def add_allocator_option(parser: argparse.ArgumentParser, processes: str) -> None:
    """``--cpu-allocator``: the ``gpipe.cpu_allocator`` policy of ``processes``."""
    parser.add_argument(
        "--cpu-allocator",
        choices=POLICIES,
        default="default",
        help=f"gpipe.cpu_allocator policy of {processes}",
    )


def allocator_flag(policy: str) -> str:
    """The option that regenerates a run under ``policy`` (nothing for the default)."""
    return "" if policy == "default" else f" --cpu-allocator {policy}"


def allocator_words(policy: str, where: str = "") -> str:
    """How a doc names the allocator a run used."""
    if policy == "default":
        return "glibc's default allocator"
    return f'`gpipe.cpu_allocator("{policy}")`{where}'


def machine() -> str:
    import platform

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{model or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores, "
        f"Linux {platform.release()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def source() -> str:
    """The gpipe commit measured, and whether src/ had uncommitted changes."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "gpipe (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "src")
    return f"gpipe at commit {commit}" + (" with uncommitted changes in src/" if dirty else "")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one traced step")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to update")
    parser.add_argument(
        "--img",
        type=Path,
        default=None,
        help="folder for the pictures (default with --out: img/ next to it; else none)",
    )
    add_allocator_option(parser, "both processes")
    args = parser.parse_args(argv)
    setup = replace(QUICK if args.quick else FULL, allocator=args.cpu_allocator)
    if args.img is None and args.out is not None:
        args.img = args.out.parent / "img"
    if args.img is not None:
        args.img.mkdir(parents=True, exist_ok=True)
    load_before, code = os.getloadavg()[0], source()
    header = [
        "schedule",
        "predicted makespan (ms)",
        "measured makespan (ms)",
        "measured / predicted",
        "predicted bubble",
        "measured bubble",
        "transfer (ms)",
    ]
    rows = []
    images = []
    for line in timelines(setup):
        if args.img is not None:
            path = args.img / f"measured-vs-simulated-{line.schedule}.png"
            timeline.compare_png(
                line.simulated,
                line.measured,
                path,
                titles=(
                    f"{line.schedule} simulated with measured costs",
                    f"{line.schedule} measured",
                ),
                simulated_unit="ms",
            )
            images.append(path)
        rows.append(line.row())
        print(" | ".join(rows[-1]), flush=True)
    table = "\n".join(
        ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        + ["| " + " | ".join(r) + " |" for r in rows]
    )
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"1-minute load average {load}")
    if args.out is None:
        return
    cfg = setup.config
    command = "python benchmarks/measured_timeline.py" + (" --quick" if args.quick else "")
    command += allocator_flag(setup.allocator)
    allocator = allocator_words(setup.allocator)
    pictures = "\n\n".join(
        f"![{p.stem}]({p.resolve().relative_to(args.out.resolve().parent).as_posix()})"
        if p.resolve().is_relative_to(args.out.resolve().parent)
        else f"![{p.stem}]({p})"
        for p in images
    )
    text = f"""## Measured timelines

Regenerate: `{command} --out docs/benchmarks.md`

GPT {cfg.n_layers} blocks, d_model {cfg.d_model}, sequence {cfg.context}, batch {setup.batch}, \
M={setup.chunks}, K=2 processes × 1 thread, {allocator}, `checkpoint="never"`, balance \
{balance(cfg.n_layers + 2, 2)} (zb-v and zb-auto: {balance(cfg.n_layers + 2, 4)} over 4 stages in \
a V); {code}. Machine: {machine()}; measured on a shared 2-core machine \
(1-minute load average {load}), so timings vary from run to run.

Each schedule ran {setup.warmup} warm-up steps and {setup.steps} traced steps \
(`Pipe.step(..., trace=True)`, both ranks' `pipe.last_trace` on one clock); the step with the \
median makespan is drawn, shifted to start at 0. A measured box starts when the action's \
inputs had arrived, so white space is waiting. The simulation (`gpipe.simulate`) replays the \
same schedule with that step's median F, B and W per stage and the median transfer (a \
producer's end to its consumer's start, where the consumer was waiting): it is what the \
schedule allows for the measured compute, and the gap to the measured makespan is what the \
runtime loses on top (jitter, slower first actions, per-action overhead). zb-auto is \
built in the run itself, from the zb-v step with the median makespan: its measured \
per-stage F, B and W and transfer (`gpipe.schedule.zb_auto(2, M, costs=..., transfer=..., \
virtual_stages=2)`, memory limit K as 1F1B).

{table}

{pictures}
"""
    write_section(args.out, SECTION, text)


if __name__ == "__main__":
    sys.exit(main())
