"""Fault-matrix rows (``benchmarks/faults.py``) for a `gpipe train` job stopped as a user or
a scheduler would (Ctrl-C, SIGTERM to the launcher, to a rank, to torchrun, kill -9 while it
saves) and for options refused before anything starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fault_jobs as jobs
from fault_jobs import TIMEOUT

import gpipe.train.checkpoint as ckpt
import gpipe.train.run_folder as run_folder


def _run_until_step(job: subprocess.Popen, step: int) -> int:
    """Read the job's progress lines until it has printed ``step``; the last one printed."""
    last = 0
    for line in job.stdout:
        if line.startswith("step ") and "/5000" in line:
            last = int(line.split()[1].split("/")[0])
            if last >= step:
                break
    return last


def _saved_step(out: Path) -> int:
    try:
        return ckpt.read_manifest(out).step
    except ckpt.CheckpointError:
        return 0


def rows_signals(work: Path) -> list[tuple]:
    """Ctrl-C and SIGTERM to the launcher, to one rank, to torchrun; kill -9 of the launcher."""
    return _launcher_signals(work) + _rank_signals(work) + _torchrun_signal(work)


def _launcher_signals(work: Path) -> list[tuple]:
    rows = []
    cases = [
        ("Ctrl-C (SIGINT to every process)", lambda p: os.killpg(p.pid, signal.SIGINT), 130),
        ("SIGTERM to the launcher", lambda p: p.send_signal(signal.SIGTERM), 143),
        ("kill -9 of the launcher", lambda p: p.send_signal(signal.SIGKILL), -9),
    ]
    for name, send, expected in cases:
        out = work / name.split()[0].lower().replace("-", "")
        job = jobs.gpipe_train("--size", "tiny", "--steps", "5000", "--save-every", "0",
                          "--eval-every", "0", "--sample-tokens", "0", "--progress", "lines",
                          "--out", str(out), cache=work / "cache")  # fmt: skip
        last = _run_until_step(job, 20)
        send(job)
        started = time.monotonic()
        code = job.wait(timeout=120)
        seconds = time.monotonic() - started
        left = jobs.left_in(job.pid)
        saved = _saved_step(out)
        lost = f"{max(0, last - saved)}+ (last step printed {last}, saved {saved})"
        promise = "exit 130/143 after saving the step in flight; no process left"
        if expected < 0:
            promise = "every rank ends with the launcher; no process left"
        held = left == 0 and code == expected and (expected < 0 or saved >= last)
        rows.append((name, promise, seconds, seconds, f"exit {code}, lost {lost}", left, held))
    return rows


# Each rank of `gpipe train` under torchrun, which reports its own exit code to a file: torchrun,
# stopping on a signal, says nothing of its workers' codes.
_RANK = """
import os, sys
from gpipe.__main__ import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
with open(os.environ["EXIT_CODES"], "a") as codes:
    codes.write(f"{os.environ['RANK']} {code}\\n")
sys.exit(code)
"""


def _torchrun_signal(work: Path) -> list[tuple]:
    """SIGTERM to torchrun, which forwards it to the ranks of `gpipe train`."""
    script, codes, out = work / "rank.py", work / "exit-codes.txt", work / "torchrun"
    script.write_text(_RANK)
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
         *jobs.train(), "--size", "tiny", "--steps", "5000", "--save-every", "0", "--eval-every",
         "0", "--sample-tokens", "0", "--progress", "lines", "--timeout", str(TIMEOUT),
         "--out", str(out)],
        env={**jobs.env(work / "cache"), "EXIT_CODES": str(codes)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    last = _run_until_step(job, 20)
    job.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code = job.wait(timeout=120)
    seconds = time.monotonic() - started
    left = jobs.left_in(job.pid)
    saved = _saved_step(out)
    ranks = sorted(codes.read_text().split("\n")) if codes.exists() else []
    ranks = [line.split()[1] for line in ranks if line]
    outcome = (
        f"ranks exit {','.join(ranks) or '?'} (torchrun {code}), "
        f"lost {max(0, last - saved)}+ (last step printed {last}, saved {saved})"
    )
    held = ranks == ["143", "143"] and saved >= last and left == 0 and seconds <= TIMEOUT
    return [("SIGTERM to torchrun (forwarded to the 2 ranks of gpipe train)",
             "each rank saves the step in flight and exits 143 within the timeout; no process "
             "left", seconds, seconds, outcome, left, held)]  # fmt: skip


def _rank_signals(work: Path) -> list[tuple]:
    """SIGTERM to one rank of `gpipe train` (not its launcher); Ctrl-C twice."""
    rows = []
    out = work / "worker-sigterm"
    job = jobs.long_run(out, work)
    lines = jobs.Lines(job)
    lines.wait_for(20)
    ranks = jobs.ranks(job.pid)
    last = lines.last
    os.kill(ranks[-1], signal.SIGTERM)
    started = time.monotonic()
    code = job.wait(timeout=120)
    seconds = time.monotonic() - started
    left, saved = jobs.left_in(job.pid), _saved_step(out)
    outcome = (f"exit {code} ({len(ranks)} ranks), lost {max(0, last - saved)} (last step "
               f"printed {last}, saved {saved})")  # fmt: skip
    rows.append(("SIGTERM to the last rank of gpipe train (not the launcher)",
                 "every process exits 143 after saving the step in flight (at most one step "
                 "lost); no process left", seconds, seconds, outcome, left,
                 code == 143 and saved >= last - 1 and left == 0))  # fmt: skip

    out = work / "ctrl-c-twice"
    job = jobs.long_run(out, work)
    lines = jobs.Lines(job)
    lines.wait_for(20)
    os.killpg(job.pid, signal.SIGINT)
    first = time.monotonic()
    time.sleep(1.2)  # a second Ctrl-C, not the launcher's SIGTERM that follows the first
    code = job.poll()
    if code is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGINT)
        started = time.monotonic()
        code = job.wait(timeout=120)
        seconds = time.monotonic() - started
        how = f"exit {code}, {seconds:.2f} s after the second Ctrl-C"
    else:
        seconds = time.monotonic() - first
        how = f"exit {code} before the second Ctrl-C (the first one was enough)"
    left = jobs.left_in(job.pid)
    how += f", saved step {_saved_step(out)} (last printed {lines.last})"
    rows.append(("Ctrl-C twice (SIGINT to every process, 1.2 s apart)",
                 "the second Ctrl-C stops every process within 2 s; no process left",
                 seconds, seconds, how, left, seconds <= 2.0 and left == 0))  # fmt: skip
    return rows


def rows_kill_while_saving(work: Path) -> list[tuple]:
    """kill -9 of the whole job while it writes a checkpoint (every step), then resume."""
    out = work / "killed-saving"
    job = jobs.long_run(out, work, "--save-every", "1")
    lines = jobs.Lines(job)
    lines.wait_for(10)
    root = out / run_folder.CHECKPOINTS
    deadline, caught = time.monotonic() + 60, False
    while time.monotonic() < deadline:
        if any(p.name.endswith(".tmp") for p in root.glob(run_folder.STEPS)):
            os.killpg(job.pid, signal.SIGKILL)
            caught = True
            break
        time.sleep(0.002)
    if not caught:
        os.killpg(job.pid, signal.SIGKILL)
    job.wait(timeout=60)
    last = lines.last
    staged = sorted(p.name for p in root.glob(f"{run_folder.STEPS}.tmp"))
    left = jobs.left_in(job.pid)
    started = time.monotonic()
    resumed = jobs.gpipe_train("--resume", str(out), "--steps", str(last + 2), "--sample-tokens",
                          "0", cache=work / "cache")  # fmt: skip
    stdout, _ = resumed.communicate(timeout=300)
    seconds = time.monotonic() - started
    found = [w for w in stdout.split("resumed from step ")[1:]]
    start = int(found[0].split()[0].rstrip(",.)")) if found else None
    outcome = (f"killed with {', '.join(staged) or 'no checkpoint'} unfinished; resume exit "
               f"{resumed.returncode}, resumed from step {start} (last step printed {last}, "
               f"lost {last - start if start is not None else '?'})")  # fmt: skip
    held = caught and bool(staged) and resumed.returncode == 0 and start is not None
    held = held and last - start <= 1 and left == 0 and jobs.left_in(resumed.pid) == 0
    return [("kill -9 of the whole job while it writes a checkpoint (--save-every 1), then "
             "--resume", "the resume starts from the newest intact checkpoint (at most the "
             "step being saved lost); no process left", seconds, seconds, outcome, left,
             held)]  # fmt: skip


def rows_refused(work: Path) -> list[tuple]:
    """Bad output folders and sizes: refused with a clear error, before anything starts."""
    rows = []
    promise = "refused with a clear error in < 5 s (exit 2); nothing started"
    unwritable = Path("/proc/gpipe-run")  # not writable, even for root
    blocked = work / "busy"
    cases = [
        (f"--out under an unwritable folder ({unwritable})", ["--out", str(unwritable)],
         unwritable, "not writable"),
        ("--seq 1000000", ["--seq", "1000000", "--out", str(work / "long")], work / "long",
         "--seq 1000000"),
        ("a second run into the --out of a running one", ["--out", str(blocked)], None,
         "is in use by another run"),
    ]  # fmt: skip
    for name, argv, folder, expected in cases:
        if folder is None:  # the first run, training
            first = jobs.long_run(blocked, work)
            jobs.Lines(first).wait_for(1)
        started = time.monotonic()
        job = jobs.gpipe_train("--size", "tiny", "--steps", "5", *argv, cache=work / "cache")
        _, stderr = job.communicate(timeout=120)
        seconds = time.monotonic() - started
        message = " ".join(stderr.split()).replace("gpipe train: error: ", "")
        nothing = folder is None or not folder.exists()
        left = jobs.left_in(job.pid)
        held = job.returncode == 2 and expected in stderr and seconds < 5 and nothing
        message = message.replace(str(work), "<tmp>").replace("|", "/")
        outcome = f"exit {job.returncode}: {message[:200]}"
        rows.append((name, promise, seconds, seconds, outcome, left, held and left == 0))
    first.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    return rows
