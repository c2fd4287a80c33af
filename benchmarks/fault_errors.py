"""Fault-matrix rows (``benchmarks/faults.py``) for errors that must name their cause: a rank
that hung, raised or died, not a neighbour that only waited on it; a wrong environment;
another model on resume; the ranks of a killed torchrun.

    python benchmarks/faults.py --only errors      # these rows alone
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fault_jobs as jobs

from injected_faults import data_parallel_fault, stalled_two_hops

# What each case of rows_errors printed before the errors named their cause (commit 9de4e29).
_BEFORE = {
    "hops": "rank 0 blamed rank 1 (`rank 0 waited 10 s … from rank 1`), or in the agreement "
    "`a peer did not arrive`; the job: `failed in rank 0: …` after 37 s",
    "dp": "rank 0 named rank 2, the replica peer that only learnt of rank 3's error",
    "sharded": "`… over ranks [1, 3]`: no rank named",
    "stop": "`gpipe train: failed in rank 0: … a peer did not arrive` after 37 s",
    "env": "torch's store or socket error, or a traceback; a missing peer after the timeout",
    "resume": "`KeyError: 'hidden_size'` (a traceback)",
    "torchrun": "the ranks trained on (1,020 steps a minute later)",
}


def _first_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("gpipe train: ")]
    return (lines[-1] if lines else "?")[:300]


def rows_errors(work: Path) -> list[tuple]:
    """Errors that name the rank that caused them, not a neighbour that waited too; a wrong
    environment named before anything waits; ranks gone with a killed torchrun."""
    rows, timeout = [], 10.0
    late = timeout + 5

    def before(key: str) -> str:
        return f" (before: {_BEFORE[key]})"

    cases = [
        ("hops", stalled_two_hops, 3, (timeout, str(work / "hops")),
         "rank 2 of K=3 hangs in a forward; rank 1 waits on it, rank 0 on rank 1",
         lambda m: m[0].startswith("rank 2 did not answer") and "rank 2" in m[1]),
        ("dp", data_parallel_fault, 4, ("raise", False, timeout, str(work / "dp")),
         "rank 3 of 2 replicas x 2 stages raises in a forward (and stays alive)",
         lambda m: all(x.startswith("rank 3 failed") for x in m[:2])),
        ("sharded", data_parallel_fault, 4, ("stall", True, timeout, str(work / "sharded")),
         "rank 3 of 2 sharded replicas x 2 stages stalls before its step",
         lambda m: all("rank 3" in x for x in m[:3])),
    ]  # fmt: skip
    for key, fn, nprocs, args, name, named in cases:
        Path(args[-1]).mkdir(parents=True, exist_ok=True)
        messages: list[str] = []
        worst, wall, _, left = jobs.library_case(fn, nprocs, args, messages=messages)
        rows.append((name + before(key), "every rank names the rank that caused it, within "
                     "timeout + 5 s", worst, wall, messages[0][:300], left,
                     named(messages) and worst <= late and left == 0))  # fmt: skip
    for key, argv, victim, signum, name, culprit in [
        ("stop", ("-K", "3"), 2, signal.SIGSTOP, "gpipe train -K 3: rank 2 stopped (kill -STOP)",
         "rank 2"),
        ("sharded", ("-K", "2", "-R", "2", "--shard", "all"), 3, signal.SIGKILL,
         "gpipe train -K 2 -R 2 --shard all: kill -9 of rank 3", "rank 3"),
    ]:  # fmt: skip
        out = work / f"cli-{key}"
        job = jobs.long_run(out, work, "--save-every", "0", "--timeout", str(timeout), *argv)
        lines = jobs.Lines(job)
        lines.wait_for(10)
        os.kill(jobs.ranks(job.pid)[victim], signum)
        started = time.monotonic()
        job.wait(timeout=300)
        seconds = time.monotonic() - started
        said = _first_error(job.stderr.read())
        rows.append((name + before(key), f"the job stops, naming {culprit}, within timeout + "
                     "5 s", seconds, seconds, said, jobs.left_in(job.pid),
                     culprit in said and seconds <= late))  # fmt: skip
    env = jobs.env(work / "cache")
    for name, variables, extra in [
        ("RANK=2 WORLD_SIZE=2", {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": "29531"}, ()),
        ("RANK=0 WORLD_SIZE=2, no MASTER_ADDR", {"RANK": "0", "WORLD_SIZE": "2"}, ()),
        (f"RANK=0 WORLD_SIZE=2 and no peer (--timeout {timeout:g})",
         {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29532"},
         ("--timeout", str(timeout))),
    ]:  # fmt: skip
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "gpipe", *jobs.train(), "--size", "tiny",
                               "--out", str(work / "env"), *extra], env={**env, **variables},
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        seconds = time.monotonic() - started
        said = _first_error(done.stderr)
        rows.append((name + before("env"), "exit 2 with one line naming the cause and the "
                     "remedy, at once (a missing peer: within the timeout)", seconds, seconds,
                     f"exit {done.returncode}: {said}", 0,
                     done.returncode == 2 and seconds <= late + 10))  # fmt: skip
    run = work / "for-resume"
    jobs.gpipe_train("--size", "tiny", "--steps", "2", "--sample-tokens", "0", "--out", str(run),
                cache=work / "cache").communicate(timeout=300)  # fmt: skip
    started = time.monotonic()
    resumed = jobs.gpipe_train("--resume", str(run), "--model", "hf-llama", "--steps", "4",
                          cache=work / "cache")  # fmt: skip
    _, stderr = resumed.communicate(timeout=300)
    seconds = time.monotonic() - started
    said = " ".join(stderr.split())[:300]
    rows.append(("--resume of a GPT run with --model hf-llama" + before("resume"),
                 "exit 2 naming the option and the remedy", seconds, seconds,
                 f"exit {resumed.returncode}: {said}", 0,
                 resumed.returncode == 2 and "drop --model" in said))  # fmt: skip
    rows.append(_torchrun_killed(work))
    return rows


def _torchrun_killed(work: Path) -> tuple:
    out = work / "torchrun-killed"
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "gpipe",
         *jobs.train(), "--size", "tiny", "--steps", "5000", "--save-every", "0", "--eval-every",
         "0", "--sample-tokens", "0", "--progress", "lines", "--out", str(out)],
        env=jobs.env(work / "cache"), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines = jobs.Lines(job)
    lines.wait_for(10)
    ranks = jobs.children(job.pid)
    job.kill()
    started = time.monotonic()
    while any(jobs.running(p) for p in ranks) and time.monotonic() - started < 60:
        time.sleep(0.01)
    seconds = time.monotonic() - started
    left = sum(jobs.running(p) for p in ranks)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    return ("kill -9 of torchrun (2 ranks of gpipe train)" + f" (before: {_BEFORE['torchrun']})",
            "every rank ends at once with torchrun (no step more)", seconds, seconds,
            f"ranks gone {seconds:.2f} s after the kill", left,
            left == 0 and seconds <= 1.0)  # fmt: skip
