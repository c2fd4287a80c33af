"""Simulated bubble and peak activations of every schedule, next to the closed forms.

    python benchmarks/schedules.py [--out docs/schedules.md]

Equal costs per action (F = B = W = 1 per stage; an unsplit backward costs B + W; for
interleaved schedules each virtual stage costs 1/v), no transfer latency: the textbook
setting in which the published formulas hold. A second table: every schedule, also with
the backward split unevenly between B and W. Simulated only: nothing is timed but the
simulator itself.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from gpipe.schedule import SCHEDULES, ScheduleError, build_schedule
from gpipe.schedule.simulate import Costs, simulate

K, V = 4, 2
ALL = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "zb-auto")
SPLIT = Costs(forward=1.0, backward=1.2, weight=0.8)  # a backward of 2F, split unevenly


ABOUT = """\
## The V schedules and zb-auto

* `zb-v` (ZB-V, Qi et al. 2024, section 6) and `dualpipe-v` (DeepSeek's DualPipe folded
  into a V, as PyTorch's `ScheduleDualPipeV`) place 2K stages on K ranks in a V: rank r
  holds stages r and 2K−1−r. Stage 0 and the loss are both on rank 0, and the hand-off
  from stage K−1 to stage K stays on rank K−1 (the transports' mailbox). A Pipe takes a
  balance of 2K entries; `virtual_stages` defaults to 2 for them.
* DualPipe overlaps the forward of one micro-batch with the backward of another; here such
  a pair is two consecutive actions, in the overlap's order. Its steady-state backwards are
  whole (no `W`); the warm-up's and the drain's later ones are split. It needs M ≥ 2K.
* Their warm-up sends run about 3K actions ahead of the receiving rank, so they are
  validated with `Schedule.buffered_sends`: a send never blocks (as gpipe's transports'
  never do), and only a cycle of ranks waiting to receive is a deadlock
  (`gpipe.schedule.check`).
* With equal costs and M ≥ 2K−1, a ZB-V rank idles only for the V's fill, K−1 forwards of
  half a stage: bubble (K−1)/(6M+K−1), half of ZB-H1's idle time, at 1F1B's peak of K
  micro-batches. DualPipe-V (M ≥ 2K) has the same bubble and holds K+½.
* `zb-auto` is searched for given costs: a greedy list scheduler (B first, then F within a
  memory limit, W in what would be idle time) over a few warm-up and W-deferral settings,
  plus ZB-H1's order, each timed by the simulator; the fastest within the limit wins.
  `Pipe(schedule="zb-auto")` uses equal costs and 1F1B's memory (K micro-batches per
  rank); for measured costs build it and pass the schedule:
  `Pipe(..., schedule=gpipe.schedule.zb_auto(K, M, costs=Costs(...), transfer=...,
  memory_limit=...))`. With equal costs and no latency it finds ZB-H1's makespan; it is
  faster with transfer latency or uneven stages, and it fits memory limits below K.
  `virtual_stages=2` searches on the V placement (ZB-V's order is then among the
  candidates): it beats ZB-V where M < 2K−1, for which ZB-V's warm-up is not sized.

"""


def closed_form(name: str, m: int) -> tuple[float, str]:
    if name in ("gpipe", "1f1b"):
        bubble = (K - 1) / (m + K - 1)
    elif name == "interleaved-1f1b":
        bubble = (K - 1) / (V * m + K - 1)
    elif name == "zb-v":  # (K-1) half-stage forwards idle per rank, once M >= 2K-1
        bubble = (K - 1) / (6 * m + K - 1) if m >= 2 * K - 1 else float("nan")
    else:
        bubble = (K - 1) / (3 * m + K - 1)
    interleaved = min(V * m, 2 * (K - 1) + (V - 1) * K + 1) / V
    peak = {
        "gpipe": f"M = {m}",
        "1f1b": f"min(K, M) = {min(K, m)}",
        "interleaved-1f1b": f"min(vM, 2(K−1)+(v−1)K+1)/v = {interleaved:g}",
        "zb-h1": f"K = {K}",
        "zb-v": f"K = {K}" if m >= 2 * K - 1 else "— (M < 2K−1)",
    }
    return bubble, peak[name]


def every_schedule() -> list[str]:
    """Bubble with equal and with split costs, and peak activations held per rank."""
    lines = [
        "Every schedule at K = 2 and 4 ranks. Costs per rank's share of the model: equal "
        f"(F = B = W = 1), or split (F = {SPLIT.forward:g}, B = {SPLIT.backward:g}, "
        f"W = {SPLIT.weight:g}); a stage of a schedule with v stages per rank costs 1/v of "
        "that; an unsplit backward costs B + W. zb-auto is searched for each costs (memory "
        "limit K). Peak: micro-batches of activations held at once on each rank (equal "
        "costs), a stage's share counting 1/v; — where a schedule does not apply.",
        "",
        "| schedule | K | M | bubble, equal costs | bubble, split costs | peak held per rank |",
        "|---|---|---|---|---|---|",
    ]
    rows = [(name, SCHEDULES[name].default_virtual_stages) for name in ALL] + [("zb-auto", 2)]
    for name, v in rows:
        label = name if v == SCHEDULES[name].default_virtual_stages else f"{name}, v = {v} (a V)"
        for k in (2, 4):
            for m in (4, 8, 16):
                cells = []
                for costs in (Costs(), SPLIT):
                    share = Costs(costs.forward / v, costs.backward / v, costs.weight / v)
                    options = {"costs": share} if name == "zb-auto" else {}
                    try:
                        schedule = build_schedule(
                            name, num_ranks=k, num_microbatches=m, virtual_stages=v, **options
                        )
                    except ScheduleError:
                        cells = []
                        break
                    cells.append(simulate(schedule, share))
                if not cells:
                    lines.append(f"| {label} | {k} | {m} | — | — | — |")
                    continue
                peak = ", ".join(f"{p / v:g}" for p in cells[0].peak_live_per_rank)
                lines.append(
                    f"| {label} | {k} | {m} | {cells[0].bubble_fraction:.4f} | "
                    f"{cells[1].bubble_fraction:.4f} | {peak} |"
                )
    return lines


def searched() -> list[str]:
    """zb-auto against ZB-H1 where they differ: transfer latency, uneven stages, less memory."""
    uneven = Costs(forward=[2, 1, 1, 1], backward=[1, 2, 1, 1], weight=[0.5, 1, 1, 2])
    lines = [
        "zb-auto against ZB-H1 at K = 4 (makespan, lower is better): with a transfer latency "
        "between ranks, with uneven stages (F = 2,1,1,1; B = 1,2,1,1; W = 0.5,1,1,2), and "
        "under a memory limit below 1F1B's K (where ZB-H1 does not fit; 1F1B, which holds "
        "K-r on rank r, for scale).",
        "",
        "| case | M | zb-auto | zb-h1 | 1f1b |",
        "|---|---|---|---|---|",
    ]
    cases = [
        ("transfer 1.0, equal costs", Costs(), 1.0, None),
        ("transfer 0.1, uneven stages", uneven, 0.1, None),
        ("memory limit 3, equal costs", Costs(), 0.0, 3),
        ("memory limit 2, equal costs", Costs(), 0.0, 2),
    ]
    for label, costs, transfer, limit in cases:
        for m in (4, 8, 16):
            auto = build_schedule(
                "zb-auto", num_ranks=K, num_microbatches=m, costs=costs, transfer=transfer,
                memory_limit=limit,
            )  # fmt: skip
            spans = [
                simulate(s, costs, transfer=transfer).makespan
                for s in (
                    auto,
                    build_schedule("zb-h1", num_ranks=K, num_microbatches=m),
                    build_schedule("1f1b", num_ranks=K, num_microbatches=m),
                )
            ]
            h1 = "—" if limit is not None else f"{spans[1]:g}"
            lines.append(f"| {label} | {m} | {spans[0]:g} | {h1} | {spans[2]:g} |")
    return lines


V_PICTURE = "timeline-zbh1-vs-zbv-vs-dualpipev.png"


def draw_v_schedules(path: Path) -> None:
    """ZB-H1 against the V schedules on one time scale (a V stage costs half)."""
    import gpipe.train.timeline as timeline

    runs = [
        simulate(build_schedule("zb-h1", num_ranks=K, num_microbatches=8)),
        simulate(build_schedule("zb-v", num_ranks=K, num_microbatches=8), Costs(0.5, 0.5, 0.5)),
        simulate(
            build_schedule("dualpipe-v", num_ranks=K, num_microbatches=8), Costs(0.5, 0.5, 0.5)
        ),
    ]
    from matplotlib.figure import Figure

    # Wider than timeline.stack_png's: the V panels' legends (two shades per kind) and
    # their titles share a line.
    fig = Figure(figsize=(17, 9), layout="constrained")
    axes = fig.subplots(len(runs), 1, sharex=True)
    for ax, run, name in zip(axes, runs, ("zb-h1", "zb-v", "dualpipe-v"), strict=True):
        timeline.draw(run, title=name, ax=ax)
    for ax in axes[:-1]:
        ax.set_xlabel("")
    axes[0].set_xlim(0, max(run.makespan for run in runs))  # each draw set its own
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines = [
        f"K = {K} ranks; interleaved with v = {V} virtual stages per rank.",
        "",
        "| schedule | M | bubble (simulated) | bubble (closed form) | peak live micro-batches "
        "on rank 0 (simulated) | closed form |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"):
        for m in (4, 8, 16, 32):
            v = V if name in ("interleaved-1f1b", "zb-v") else 1
            schedule = build_schedule(name, num_ranks=K, num_microbatches=m, virtual_stages=v)
            result = simulate(schedule, Costs(1 / v, 1 / v, 1 / v))
            bubble, peak = closed_form(name, m)
            live = result.peak_live_per_rank[0] / v  # (stage, micro-batch) pairs of 1/v each
            lines.append(
                f"| {name} | {m} | {result.bubble_fraction:.4f} | "
                f"{'—' if math.isnan(bubble) else f'{bubble:.4f}'} | "
                f"{live:g} | {peak} |"
            )
    lines += ["", *every_schedule(), "", *searched()]
    start = time.perf_counter()
    big = simulate(build_schedule("zb-h1", num_ranks=64, num_microbatches=512))
    seconds = time.perf_counter() - start
    lines += [
        "",
        f"K = 64, M = 512 (ZB-H1, {len(big.events):,} actions) simulates in {seconds:.2f} s.",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            "# Schedules: simulated against the closed forms\n\n"
            "Regenerate: `python benchmarks/schedules.py --out docs/schedules.md`\n\n"
            + ABOUT
            + table
            + "\n\n![GPipe, 1F1B and ZB-H1 at K=4, M=8](img/timeline-gpipe-vs-1f1b-vs-zbh1.png)\n"
            + f"\n![ZB-H1, ZB-V and DualPipe-V at K=4, M=8](img/{V_PICTURE})\n"
        )
        draw_v_schedules(args.out.parent / "img" / V_PICTURE)


if __name__ == "__main__":
    main()
