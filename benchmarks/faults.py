"""The fault matrix: each fault, the promise, and what was measured, into docs/reliability.md.

    python benchmarks/faults.py [--out docs/reliability.md]       # every row, both carriers
    python benchmarks/faults.py --only restart --carrier group     # a group of rows

Library cases run K processes with ``gpipe.launch`` and the fault-injecting functions of
``tests/injected_faults.py``; command-line cases run ``gpipe train --size tiny`` as a user
would and stop or damage it. Each runs on both carriers of the messages between stages
(``benchmarks/fault_jobs.py``). For each case: the seconds until every rank had raised (or the
job had exited), exit codes, processes left behind, and, for signals, the steps of work lost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fault_jobs as jobs  # noqa: E402
from fault_cases import carries_on, faulty_in  # noqa: E402
from fault_checkpoints import rows_checkpoints  # noqa: E402
from fault_errors import rows_errors  # noqa: E402
from fault_inputs import rows_inputs  # noqa: E402
from fault_jobs import TIMEOUT  # noqa: E402
from fault_security import SECTION, rows_security  # noqa: E402
from fault_signals import rows_kill_while_saving, rows_refused, rows_signals  # noqa: E402
from fault_stops import RESTARTS, STORE_NOTE, rows_restart, rows_stops, rows_store  # noqa: E402

from injected_faults import (  # noqa: E402
    data_parallel_stalled,
    disagreeing,
    faulty,
    faulty_backward,
    nonfinite,
    stalled,
)

DP_TIMEOUT = 10.0  # the pipeline's timeout in the data-parallel stall
SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")


def rows_library() -> list[tuple]:
    rows = []
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for stages, fault_stage in ((2, 0), (2, 1), (3, 1)):
            worst, wall, types, left = jobs.library_case(
                faulty_backward, stages, (stages, fault_stage, 1, schedule, "except_last", TIMEOUT)
            )
            rows.append((f"exception in backward, {schedule}, K={stages}, rank {fault_stage}",
                         "every rank raises within 1 s, naming the rank", worst, wall, types, left,
                         worst <= 1.0 and left == 0))  # fmt: skip
    for stages, fault_stage in ((2, 0), (2, 1), (3, 1), (3, 2)):
        worst, wall, types, left = jobs.library_case(
            faulty, stages, (stages, fault_stage, 2, "raise", TIMEOUT)
        )
        rows.append((f"exception in forward, gpipe, K={stages}, rank {fault_stage}",
                     "every rank raises within 1 s, naming the rank", worst, wall, types, left,
                     worst <= 1.0 and left == 0))  # fmt: skip
    same = "every rank raises within 1 s, naming the rank"
    cases = [("loss", schedule, 1) for schedule in SCHEDULES]
    cases += [("forward", schedule, r) for schedule in SCHEDULES[1:] for r in (0, 1)]
    cases += [("backward", "interleaved-1f1b", r) for r in (0, 1)]
    for where, schedule, fault_rank in cases:
        worst, wall, types, left = jobs.library_case(
            faulty_in, 2, (2, where, fault_rank, schedule, TIMEOUT)
        )
        name = {"loss": "the loss (last rank)", "forward": "forward", "backward": "backward"}
        rank = "" if where == "loss" else f", rank {fault_rank}"
        rows.append((f"exception in {name[where]}, {schedule}, K=2{rank}", same, worst, wall,
                     types, left, worst <= 1.0 and left == 0))  # fmt: skip
    promise = "the survivors raise within timeout + 5 s"
    for stages, fault_stage in ((2, 1), (3, 0), (3, 2)):
        worst, wall, types, left = jobs.library_case(
            faulty, stages, (stages, fault_stage, 1, "kill", 10.0), expect_kill=True
        )
        rows.append((f"kill -9 of rank {fault_stage}, K={stages} (pipeline timeout 10 s)",
                     promise, worst, wall, types, left, worst <= 15.0 and left == 0))  # fmt: skip
    for where in ("input", "gradient"):
        worst, wall, types, left = jobs.library_case(nonfinite, 2, (where,))
        refused = types == "NonFiniteError,NonFiniteError"
        rows.append((f"NaN {where}", "every rank refuses the step (NonFiniteError)", worst, wall,
                     types, left, refused and left == 0))  # fmt: skip
    for setting in ("schedule", "balance", "chunks", "batch"):
        worst, wall, types, left = jobs.library_case(disagreeing, 2, (setting,))
        rows.append((f"ranks disagree on {setting}", "every rank refuses, naming the difference",
                     worst, wall, types, left, "None" not in types and left == 0))  # fmt: skip
    return rows


def rows_stalls(work: Path) -> list[tuple]:
    """A rank alive but silent (it sleeps past the timeout) before each collective a Pipe's
    user reaches outside the schedule; a rank that carries on after its own error."""
    rows = []
    # (before what, its words, the collective the waiting rank names, the stalled rank): rank
    # 0 starts a step without waiting (its seed goes ahead of its messages), so the rank
    # that waits at a step's start is one that waits for rank 0.
    cases = [
        ("clip", "clip_grad_norm_", "the clip_grad_norm_ all-reduce", 1),
        ("step", "the next step", "the step-seed broadcast", 0),
        ("save", "gpipe train's checkpoint save", "the checkpoint barrier", 1),
    ]
    os.environ["GPIPE_CACHE_DIR"] = str(work / "cache")
    for before, where, operation, who in cases:
        messages: list[str] = []
        marks = work / f"marks-{before}"  # where the waiting rank says it has its outcome
        marks.mkdir(parents=True, exist_ok=True)
        args = (before, "stall", TIMEOUT, str(marks), str(work / f"stall-{before}"), who)
        worst, wall, types, left = jobs.library_case(stalled, 2, args, messages=messages)
        waiting = messages[1 - who]
        named = operation in waiting and f"rank {who} did not arrive" in waiting
        promise = (
            f"the other rank raises within timeout + 5 s, naming {operation} and rank {who}; "
            "the stalled one as soon as it wakes"
        )
        rows.append((f"rank {who} stalled before {where}", promise, worst, wall, types, left,
                     worst <= TIMEOUT + 5 and named and left == 0))  # fmt: skip
    # Rank 1 dies (rank 0 holds the group's store). Before the next step, rank 0 finds it
    # gone as it sends to it or waits for its gradients: "... rank 1 died or left" (or
    # "which left").
    dying = [("clip", "clip_grad_norm_", "the clip_grad_norm_ all-reduce", "the clip_grad_norm_ "
              "all-reduce"), ("step", "the next step", "left", "rank 1 as gone")]  # fmt: skip
    for before, where, said, naming in dying:
        messages = []
        marks = work / f"marks-die-{before}"
        marks.mkdir(parents=True, exist_ok=True)
        args = (before, "die", TIMEOUT, str(marks))
        worst, wall, types, left = jobs.library_case(
            stalled, 2, args, expect_kill=True, messages=messages
        )
        named = said in messages[0] and "rank 1" in messages[0]
        promise = f"the other rank raises a PipelineError within timeout + 5 s, naming {naming}"
        rows.append((f"rank 1 dead (os._exit) right before {where}", promise, worst, wall, types,
                     left, types.startswith("PipelineError") and named and worst <= TIMEOUT + 5
                     and left == 0))  # fmt: skip
    messages = []
    marks = work / "marks-replicas"
    marks.mkdir(parents=True, exist_ok=True)
    worst, wall, types, left = jobs.library_case(
        data_parallel_stalled, 4, (DP_TIMEOUT, str(marks)), messages=messages
    )
    # Replica 1's first stage waits for rank 3's gradients ("... from rank 3 without an
    # answer"); replica 0 in the all-reduce ("did not arrive").
    # The stalled rank, once awake, takes the notice of the rank that gave up on it and reads
    # that rank's statement.
    said = (
        "did not arrive",
        "left the group",
        "from rank 3 without an answer",
        "gave up on this pipeline",
    )
    named = all(any(s in m for s in said) for m in messages)
    rows.append(("rank 3 (replica 1, stage 1) of 2 replicas x 2 stages stalled before its step: "
                 f"replica 0 waits in the data-parallel gradient all-reduce (timeout "
                 f"{DP_TIMEOUT:g} s)", "every other rank raises a PipelineError within timeout + "
                 "5 s, naming the collective; the stalled one as soon as it wakes", worst, wall,
                 types, left, "None" not in types and named and worst <= DP_TIMEOUT + 5
                 and left == 0))  # fmt: skip
    worst, wall, types, left = jobs.library_case(carries_on, 2, (TIMEOUT,))
    rows.append(("every rank catches its error and carries on (clip_grad_norm_, a step)",
                 "each later call raises at once", worst, wall, types, left,
                 worst <= 1.0 and "None" not in types and left == 0))  # fmt: skip
    return rows


# Each group of rows by name, in the table's order. Those in ONCE do not depend on the
# carrier (refused before any process starts, or torch's own store): run on the first only.
GROUPS = {
    "library": lambda work: rows_library(),
    "stalls": rows_stalls,
    "signals": rows_signals,
    "checkpoints": lambda work: rows_checkpoints(work, jobs.gpipe_train, jobs.left_in),
    "saving": rows_kill_while_saving,
    "refused": rows_refused,
    "inputs": rows_inputs,
    "errors": rows_errors,
    "security": rows_security,
    "store": rows_store,
    "stops": rows_stops,
    "restart": rows_restart,
}
ONCE = ("refused", "inputs", "store")


def run(carriers: tuple[str, ...], only: list[str] | None) -> list[tuple]:
    """The rows of the groups ``only`` (all by default) on each of ``carriers``, each row
    with its carrier second, printed as it comes."""
    rows = []
    work = Path(tempfile.mkdtemp(prefix="gpipe-faults-"))
    for carrier in carriers:
        jobs.CARRIER = carrier
        place = work / carrier  # each carrier's runs apart: --resume auto finds only its own
        place.mkdir()
        for name, group in GROUPS.items():
            if (only and name not in only) or (name in ONCE and carrier != carriers[0]):
                continue
            for row in group(place):
                rows.append((row[0], "either" if name in ONCE else carrier, *row[1:]))
                print(_line(rows[-1]), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def _line(row: tuple) -> str:
    name, carrier, promise, worst, wall, outcome, left, held = row
    return (f"| {name} | {carrier} | {promise} | {worst:.2f} | {wall:.2f} | {outcome} | {left} "
            f"| {'yes' if held else '**no**'} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--carrier",
        choices=(*jobs.CARRIERS, "both"),
        default="both",
        help="what carries the messages between stages (default: both)",
    )
    parser.add_argument(
        "--only",
        choices=GROUPS,
        action="append",
        help="this group of rows only (repeatable; not with --out)",
    )
    args = parser.parse_args()  # fmt: skip
    if args.out and (args.only or args.carrier != "both"):
        parser.error("--out writes the whole matrix: drop --only and --carrier")
    began = time.monotonic()
    rows = run(jobs.CARRIERS if args.carrier == "both" else (args.carrier,), args.only)
    lines = [
        "| case | carrier | promise | every rank raised (s) | whole run, start-up included (s) "
        "| outcome | processes left | held |",
        "|---|---|---|---|---|---|---|---|",
        *map(_line, rows),
    ]
    held = sum(1 for row in rows if row[-1])
    minutes = (time.monotonic() - began) / 60
    summary = f"{held} of {len(rows)} cases held (the whole matrix ran in {minutes:.1f} minutes)."
    print(summary)
    if args.out:
        args.out.write_text(
            "# Reliability: the fault matrix\n\n"
            "Each fault injected into a real run, the promise, and what was measured on this "
            "machine (2 CPU cores, collectives on gloo), on both carriers of the messages "
            "between stages (column carrier): `sockets`, the same-host sockets "
            "(`gpipe.transport.sockets`, the default on one machine), and `group`, "
            "torch.distributed's point-to-point (what crosses machines); rows refused before "
            "any process starts run once (`either`). Library cases: K processes started by "
            f"`gpipe.launch` with a pipeline timeout of {TIMEOUT:g} s unless the row says "
            "otherwise (tests/injected_faults.py); command-line cases: `gpipe train --size "
            "tiny --transport CARRIER`, stopped or damaged as a user or a scheduler would. "
            '"Every rank raised": library cases, the slowest rank\'s time from the start '
            "of the failing step to its exception; command-line cases, from the signal (or the "
            "resume command) until the job had exited. Processes left: the job's processes "
            "still alive afterwards. A stalled rank sleeps for the timeout + 3 s (one that hangs "
            "in a forward: twice the timeout and the grace, + 1 s); its own time "
            "counts from when it wakes. Refusals of bad options: the whole command, Python's "
            "start-up included. "
            + STORE_NOTE
            + "Not covered yet: these cases on NCCL (no GPU here), a machine "
            "that drops off the network (rather than a process), a stall before the "
            "tied-weight exchange (it waits through the same bounded path as the data-parallel "
            "all-reduce and clip_grad_norm_), and kill -9 of a single rank of `gpipe train` "
            "(the library's kill -9 rows, the launcher's and the restart under torchrun are "
            "covered). Bad input to every "
            "command (`benchmarks/fault_inputs.py`) must be one line before any process "
            "starts, leaving nothing behind, and no command may write over what gpipe did not "
            "write (a user's notes, a run's own files, a checkpoint, a planted link). The last "
            "rows are "
            "errors that must name their cause (a rank that hung, raised or died, not a "
            "neighbour that only waited on it; a wrong environment; another model on resume); "
            "each says in its name what the same case printed before (commit 9de4e29), its "
            "outcome what it prints now (`gpipe.transport.inquest`; the grace for a rank's "
            "statement is half the timeout, at most 3.5 s).\n\n" + RESTARTS + "\n\n"
            "Regenerate: `python benchmarks/faults.py --out docs/reliability.md` (a group of "
            "rows alone, on one carrier: `--only errors --carrier group`)\n\n"
            + "\n".join(lines)
            + f"\n\n{summary}\n"
            + SECTION
        )


if __name__ == "__main__":
    main()
