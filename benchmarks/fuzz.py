"""Many generated cases against plain PyTorch (tests/fuzz_cases.py), failures grouped by feature.

    python benchmarks/fuzz.py --cases 200                 # seeds 0..199, 1 or 2 processes
    python benchmarks/fuzz.py --cases 50 --seed 1000 --processes 1
    python benchmarks/fuzz.py --seed 17 --schedule zb-v --remat always --processes 1 --cases 1
    python benchmarks/fuzz.py --sweep --processes 1        # each feature alone, every layout

Each case is drawn from its seed and what is pinned here; every case that is not exact prints
its one-line reproduction. The tables count, per feature and per feature x schedule, the cases
that were exact, inexact (the worst relative error), refused (a gpipe error) or crashed, and
how many of the failures are known gaps (``fuzz_cases.KNOWN_GAPS``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch

import fuzz_cases

STATUSES = ("exact", "inexact", "refused", "crashed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed")
    parser.add_argument("--processes", type=int, choices=(1, 2))
    parser.add_argument("--schedule", choices=sorted(fuzz_cases.SCHEDULES))
    parser.add_argument("--remat", choices=fuzz_cases.REMATS)
    parser.add_argument("--frontend", choices=fuzz_cases.FRONTENDS)
    parser.add_argument(
        "--features", help="comma-separated, e.g. bias,hooks; 'none' (default: drawn)"
    )
    parser.add_argument(
        "--sweep", action="store_true",
        help="instead: no feature, then each feature alone (or each of --features), x every "
        "schedule x remat x front end (the pinned ones only), --cases seeds each",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pins = {
        "processes": args.processes, "schedule": args.schedule, "remat": args.remat,
        "frontend": args.frontend,
        "features": None if args.features is None else [
            f for f in args.features.split(",") if f != "none"
        ],
    }  # fmt: skip
    outcomes, start = [], time.monotonic()
    for seed, case_pins in _cases(args, pins):
        case = fuzz_cases.draw_case(seed, **case_pins)
        outcome = fuzz_cases.run_case(case)
        outcomes.append(outcome)
        if not outcome.accepted:
            gap = fuzz_cases.known_gap(case)
            print(f"[{outcome.status}{' known' if gap else ''}] {outcome.report()}", flush=True)
    elapsed = time.monotonic() - start
    failed = sum(not o.accepted for o in outcomes)
    print(f"\n{len(outcomes)} cases in {elapsed:.0f} s: {failed} not exact")
    print(table(outcomes, lambda o: o.case.features or ["none"], "feature"))
    for other in ("schedule", "remat", "frontend", "processes"):
        print(table(outcomes, lambda o, a=other: [f"{f} x {getattr(o.case, a)}"
                    for f in o.case.features or ["none"]], f"feature x {other}",
                    failures_only=True))  # fmt: skip
    unknown = [o for o in outcomes if not o.accepted and fuzz_cases.known_gap(o.case) is None]
    print(f"\n{len(unknown)} failures outside the known gaps")
    return 1 if unknown else 0


def _cases(args, pins):
    """(seed, pins) of each case: --cases seeds from --seed, or the sweep."""
    if not args.sweep:
        return [(seed, pins) for seed in range(args.seed, args.seed + args.cases)]
    cases = []
    alone = [[f] for f in pins["features"] or fuzz_cases.FEATURES]
    for features in [[], *alone] if pins["features"] is None else alone:
        for schedule in [pins["schedule"]] if pins["schedule"] else fuzz_cases.SCHEDULES:
            for remat in [pins["remat"]] if pins["remat"] else fuzz_cases.REMATS:
                for frontend in [pins["frontend"]] if pins["frontend"] else fuzz_cases.FRONTENDS:
                    if frontend == "from_model" and set(features) & fuzz_cases._NOT_CAPTURED:
                        continue
                    pinned = {**pins, "features": features, "schedule": schedule,
                              "remat": remat, "frontend": frontend}  # fmt: skip
                    cases += [(s, pinned) for s in range(args.seed, args.seed + args.cases)]
    return cases


def table(outcomes, keys_of, title: str, failures_only: bool = False) -> str:
    """Markdown: per key, the cases of each status, the known gaps and the worst error."""
    rows: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for outcome in outcomes:
        for key in keys_of(outcome):
            row = rows[key]
            row[outcome.status] += 1
            if not outcome.accepted and fuzz_cases.known_gap(outcome.case):
                row["known"] += 1
            if outcome.status == "inexact":
                row["worst"] = max(row["worst"], outcome.worst)
    lines = [f"\n| {title} | cases | {' | '.join(STATUSES)} | known gap | worst inexact |",
             "|---|" + "---|" * (len(STATUSES) + 3)]  # fmt: skip
    for key in sorted(rows):
        row = rows[key]
        total = sum(row[s] for s in STATUSES)
        if failures_only and row["exact"] == total:
            continue
        counts = " | ".join(str(int(row[s])) for s in STATUSES)
        worst = f"{row['worst']:.2g}" if row["worst"] else "-"
        lines.append(f"| {key} | {int(total)} | {counts} | {int(row['known'])} | {worst} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
