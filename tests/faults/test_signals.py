"""Signals: no launched process outlives its launcher (stopped by SIGTERM, or killed
outright), and ``gpipe train`` stopped by Ctrl-C or SIGTERM saves the step in flight."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpipe.train.checkpoint as ckpt
from train_runs import SRC, losses

LONG_JOB = """
import os, time, gpipe

def work(rank):
    print(f"rank {rank} working as {os.getpid()};", flush=True)
    time.sleep(120)

if __name__ == "__main__":
    gpipe.launch(work, 2, timeout=30)
"""


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: ranks, a fork server, multiprocessing's tracker."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_stopped_launcher_leaves_no_process(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(LONG_JOB)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    launcher = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        # Both ranks started. Their prints can interleave on the shared pipe (text and
        # newline are separate writes), so count the words, not the lines.
        seen = ""
        while seen.count("working") < 2:
            line = launcher.stdout.readline()
            assert line, f"the launcher ended before both ranks started: {seen!r}"
            seen += line
        ranks = [int(pid) for pid in re.findall(r"working as (\d+);", seen)]
        started = descendants(launcher.pid)
        assert len(ranks) == 2 and set(ranks) <= set(started), (ranks, started)
        launcher.send_signal(signal.SIGTERM)  # kill -9: the test below
        assert launcher.wait(timeout=30) == 143
        deadline = time.monotonic() + 15
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [_cmdline(p) for p in started if alive(p)]
    finally:
        launcher.kill()


BUSY_JOB = """
import os, signal, time, gpipe

def work(rank):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank that finishes its step first
    print(f"rank {rank} working as {os.getpid()};", flush=True)
    time.sleep(120)

if __name__ == "__main__":
    gpipe.launch(work, 2, timeout=30)
"""


def _started_ranks(launcher: subprocess.Popen) -> list[int]:
    seen = ""
    while seen.count("working") < 2:
        line = launcher.stdout.readline()
        assert line, f"the launcher ended before both ranks started: {seen!r}"
        seen += line
    return [int(pid) for pid in re.findall(r"working as (\d+);", seen)]


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(90)
@pytest.mark.slow
def test_ranks_end_at_once_with_a_killed_launcher_not_after_their_step(tmp_path):
    """kill -9 of the launcher: no rank finishes its step or saves (it would train on), and
    no process it started (a fork server, multiprocessing's tracker) outlives it."""
    script = tmp_path / "job.py"
    script.write_text(BUSY_JOB)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    launcher = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        ranks = _started_ranks(launcher)
        started = descendants(launcher.pid)
        assert len(ranks) == 2 and set(ranks) <= set(started), (ranks, started)
        launcher.kill()
        assert launcher.wait(timeout=30) == -9
        assert not _gone_within(ranks, 10.0)  # far below their 120 s of work
        assert not [_cmdline(p) for p in _gone_within(started, 15.0)]
    finally:
        launcher.kill()
        for pid in ranks if "ranks" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(150)
@pytest.mark.slow
def test_gpipe_train_under_a_killed_torchrun_stops_at_once(cache, tmp_path):
    """torchrun starts its ranks in their own session: killed outright, it once left them
    training on (1000 steps in a minute). Each rank watches torchrun and ends with it."""
    out = tmp_path / "torchrun"
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "gpipe",
         "train", "--size", "tiny", "--steps", "5000", "--save-every", "0", "--eval-every", "0",
         "--sample-tokens", "0", "--progress", "lines", "--log-every", "1", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    ranks = []
    try:
        for line in torchrun.stdout:
            if line.startswith("step     3/"):
                break
        ranks = [p for p in descendants(torchrun.pid) if "gpipe" in _cmdline(p)]
        assert len(ranks) == 2, [_cmdline(p) for p in descendants(torchrun.pid)]
        torchrun.kill()
        torchrun.wait(timeout=30)
        assert not _gone_within(ranks, 10.0)
        assert not (out / "checkpoints").exists()  # nothing trained on to a save
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("how", "code"), [("ctrl-c", 130), ("sigterm", 143)], ids=["ctrl-c", "sigterm"]
)
@pytest.mark.slow
def test_a_signal_saves_the_step_in_flight_and_leaves_no_process(cache, tmp_path, how, code):
    import signal as signals
    import time

    out = tmp_path / "stopped"
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    argv = ["train", "--size", "tiny", "--steps", "5000", "--save-every", "0", "--eval-every",
            "0", "--sample-tokens", "0", "--progress", "lines", "--out", str(out)]  # fmt: skip
    launched = time.monotonic()
    job = subprocess.Popen(
        [sys.executable, "-m", "gpipe", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal gives a job
    )  # fmt: skip
    try:
        for line in job.stdout:
            if line.startswith("step    10/"):
                break
        to_step_10 = time.monotonic() - launched  # start-up and 10 steps, at this load
        if how == "ctrl-c":
            os.killpg(job.pid, signals.SIGINT)  # what a terminal does: every process
        else:
            job.send_signal(signals.SIGTERM)  # what Slurm or Kubernetes does: the launcher
        started = time.monotonic()
        assert job.wait(timeout=60) == code, job.stderr.read()
        assert time.monotonic() - started < 2 * to_step_10  # a step and a save, no more
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signals.SIGKILL)
    manifest = ckpt.read_manifest(out)
    assert manifest.step >= 10  # at most the step in flight was lost
    assert len(losses(out)) == manifest.step
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits last
    while time.monotonic() < deadline:
        leftover = subprocess.run(["pgrep", "-a", "-s", str(job.pid)], capture_output=True)
        if not leftover.stdout.strip():
            break
        time.sleep(0.2)
    assert not leftover.stdout.strip(), leftover.stdout.decode()


STEPPING_JOB = """
import os, sys, time, torch, torch.distributed as dist, gpipe
from torch import nn
from torch.nn import functional as F

TIMEOUT = float(sys.argv[1])

def work(rank):
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2, group=dist.group.WORLD, timeout=TIMEOUT)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe.step(x, y, F.mse_loss)
    print(f"rank {rank} working as {os.getpid()};", flush=True)
    while True:
        pipe.step(x, y, F.mse_loss)
        time.sleep(0.01)

if __name__ == "__main__":
    gpipe.launch(work, 2, timeout=TIMEOUT)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_stopped_rank_0_ends_the_job_within_the_timeout_naming_it(tmp_path):
    """SIGSTOP of rank 0, which held the job's store once (then the others could not tell
    who stopped, and every process waited on, 150 s and more): the launcher holds it now,
    rank 1 names rank 0 within the timeout + 5 s, and the stopped rank is killed."""
    timeout = 4.0  # the stalls' pipeline timeout
    script = tmp_path / "job.py"
    script.write_text(STEPPING_JOB)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    began = time.monotonic()
    launcher = subprocess.Popen(
        [sys.executable, str(script), str(timeout)], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    ranks = {}
    try:
        seen = ""
        while seen.count("working") < 2:
            line = launcher.stdout.readline()
            assert line, f"the launcher ended before both ranks started: {seen!r}"
            seen += line
        ranks = {int(r): int(p) for r, p in re.findall(r"rank (\d) working as (\d+);", seen)}
        start_up = time.monotonic() - began  # this machine's load, in the same test
        started = descendants(launcher.pid)
        os.kill(ranks[0], signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = launcher.communicate(timeout=90)
        seconds = time.monotonic() - stopped
        assert launcher.returncode == 1, stderr
        assert seconds < timeout + 5 + start_up, (seconds, start_up, stderr)
        assert "- rank 0: stopped (SIGSTOP, or a debugger)" in stderr, stderr
        said = next(line for line in stderr.splitlines() if line.startswith("- rank 1: "))
        assert "rank 0" in said and "PipelineError" in said, said
        assert not _gone_within(started, 10.0)
    finally:
        launcher.kill()
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
