"""Simulated bubble and peak activations of every schedule, next to the closed forms.

    python benchmarks/schedules.py [--out docs/schedules.md]

Equal costs per action (F = B = W = 1 per stage; an unsplit backward costs B + W; for
interleaved schedules each virtual stage costs 1/v), no transfer latency: the textbook
setting in which the published formulas hold.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from gpipe.schedule import build_schedule
from gpipe.schedule.simulate import Costs, simulate

K, V = 4, 2


def closed_form(name: str, m: int) -> tuple[float, str]:
    if name in ("gpipe", "1f1b"):
        bubble = (K - 1) / (m + K - 1)
    elif name == "interleaved-1f1b":
        bubble = (K - 1) / (V * m + K - 1)
    else:
        bubble = (K - 1) / (3 * m + K - 1)
    interleaved = min(V * m, 2 * (K - 1) + (V - 1) * K + 1) / V
    peak = {
        "gpipe": f"M = {m}",
        "1f1b": f"min(K, M) = {min(K, m)}",
        "interleaved-1f1b": f"min(vM, 2(K−1)+(v−1)K+1)/v = {interleaved:g}",
        "zb-h1": f"K = {K}",
    }
    return bubble, peak[name]


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
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        for m in (4, 8, 16, 32):
            v = V if name == "interleaved-1f1b" else 1
            schedule = build_schedule(name, num_ranks=K, num_microbatches=m, virtual_stages=v)
            result = simulate(schedule, Costs(1 / v, 1 / v, 1 / v))
            bubble, peak = closed_form(name, m)
            live = result.peak_live_per_rank[0] / v  # (stage, micro-batch) pairs of 1/v each
            lines.append(
                f"| {name} | {m} | {result.bubble_fraction:.4f} | {bubble:.4f} | "
                f"{live:g} | {peak} |"
            )
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
            + table
            + "\n\n![GPipe, 1F1B and ZB-H1 at K=4, M=8](img/timeline-gpipe-vs-1f1b-vs-zbh1.png)\n"
        )


if __name__ == "__main__":
    main()
