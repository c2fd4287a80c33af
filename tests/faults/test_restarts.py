"""A job started again continues by itself: ``gpipe train --resume auto`` under ``torchrun
--max-restarts``, one of whose ranks is killed, resumes from the newest intact checkpoint of
its ``--out`` and trains the steps it lost to the same losses as the uninterrupted attempt.

Its reliability, many times over: ``python benchmarks/fault_stops.py --only restart
--repeat 20``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_runs import SRC

ARGS = ["--size", "tiny", "--steps", "20", "--save-every", "5", "--eval-every", "0",
        "--sample-tokens", "0", "--threads", "1", "--resume", "auto"]  # fmt: skip


def _ranks(torchrun: int) -> list[int]:
    """torchrun's worker processes (`gpipe train` ranks), in start order."""
    found = subprocess.run(["pgrep", "-P", str(torchrun)], capture_output=True, text=True)
    return sorted(int(p) for p in found.stdout.split())


def _losses(out: Path) -> dict[int, float]:
    """The losses logged so far, by step (a line being written is left out)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    records = [json.loads(line) for line in lines if line.strip().endswith("}")]
    return {record["step"]: record["loss"] for record in records}


def _logged(out: Path) -> int:
    return max(_losses(out), default=0)


def _saved(out: Path) -> int:
    """The newest checkpoint's step (its folder renamed into place: committed), or 0."""
    steps = [int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*")
             if p.name.removeprefix("step-").isdigit()]  # fmt: skip
    return max(steps, default=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(400)
@pytest.mark.slow
def test_a_killed_rank_under_torchrun_max_restarts_resumes_from_the_newest_checkpoint(
    cache, tmp_path
):
    out = tmp_path / "run"
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    # One restart: the restarted attempt must form its group in the agent's store, which
    # still holds the dead attempt's keys (gpipe.parallel.store.this_attempt).
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "--max-restarts", "1", "-m", "gpipe", "train", *ARGS, "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        # After the checkpoint of step 5 and a step or two more: those are lost.
        while _logged(out) < 7 and torchrun.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        first = _ranks(torchrun.pid)
        assert len(first) == 2 and _logged(out) < 20, (torchrun.poll(), _logged(out))
        os.kill(first[1], signal.SIGKILL)
        # The first attempt's losses, an uninterrupted run up to here, before the restart
        # keeps only those up to its checkpoint (seconds later: torchrun restarts).
        before, saved = _losses(out), _saved(out)
        printed, _ = torchrun.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)
    assert torchrun.returncode == 0 and "resumed from step " in printed, printed[-3000:]
    # The newest checkpoint at the kill (or one committed by rank 0 as rank 1 died after
    # writing its part), however late a loaded machine let this process kill.
    # (Digits only: the ranks' outputs interleave on torchrun's one stream.)
    resumed = int(re.search(r"resumed from step (\d+)", printed)[1])
    assert "Warning" not in printed, printed[-3000:]  # e.g. torch's on a resumed scheduler
    assert 5 <= resumed <= max(before) and resumed in (saved, saved + 5), printed[-3000:]
    after = _losses(out)
    assert sorted(after) == list(range(1, 21))
    # Bitwise, the steps before the checkpoint and each step the restart lost and trained
    # again: the state it resumed is exactly the uninterrupted run's.
    assert sorted(before) == list(range(1, max(before) + 1))
    assert {step: after[step] for step in before} == before
