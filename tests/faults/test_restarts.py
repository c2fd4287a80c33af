"""A job started again continues by itself: ``gpipe train --resume auto`` under ``torchrun
--max-restarts``, one of whose ranks is killed, resumes from the newest intact checkpoint of
its ``--out`` and trains the steps it lost to the same losses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_runs import SRC, gpipe_command, losses

ARGS = ["--size", "tiny", "--steps", "12", "--save-every", "5", "--eval-every", "0",
        "--sample-tokens", "0", "--threads", "1", "--resume", "auto"]  # fmt: skip


def _ranks(torchrun: int) -> list[int]:
    """torchrun's worker processes (`gpipe train` ranks), in start order."""
    found = subprocess.run(["pgrep", "-P", str(torchrun)], capture_output=True, text=True)
    return sorted(int(p) for p in found.stdout.split())


def _logged(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.strip().endswith("}")]
    return max(steps, default=0)


@pytest.mark.skip(
    reason="intermittent: in about 1 run of 4 the attempt torchrun restarts fails to form gloo's "
    "mesh ('connectFullMesh ... Connection refused') or hangs in it; run it alone until mended"
)
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
    # Two restarts, as a user would allow: on a loaded machine gloo's mesh can fail to form
    # ("connectFullMesh ... Connection refused", seen once in the suite) and cost one.
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "--max-restarts", "2", "-m", "gpipe", "train", *ARGS, "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        # After the checkpoint of step 5, before the next one: steps 6 and 7 are lost.
        while _logged(out) < 7 and torchrun.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        first = _ranks(torchrun.pid)
        assert len(first) == 2 and _logged(out) >= 7, torchrun.poll()
        os.kill(first[1], signal.SIGKILL)
        before = losses(out)  # the first attempt's: an uninterrupted run up to here
        printed, _ = torchrun.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)
    assert torchrun.returncode == 0, printed[-3000:]
    assert "resumed from step 5" in printed, printed[-3000:]
    after = losses(out)
    assert sorted(after) == list(range(1, 13))
    assert {step: after[step] for step in before} == before  # bitwise: the steps it lost too
    # A fresh start where --out holds no checkpoint yet: the same losses
    fresh = gpipe_command("train", *ARGS, "--out", str(tmp_path / "fresh"), cache=cache,
                          timeout=300)  # fmt: skip
    assert fresh.returncode == 0, fresh.stderr
    assert losses(tmp_path / "fresh") == after
