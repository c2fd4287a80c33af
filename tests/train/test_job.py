"""gpipe.train.job: the main job's processes; a run names the rank whose error started a
failure, and two runs into one folder are refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from gpipe.train.job import root_cause
from train_runs import SRC


def test_a_failed_run_reports_the_rank_that_caused_it():
    failures = {
        0: "RuntimeError: [gloo] Connection closed by peer\nTraceback ...",
        1: "CheckpointError: cannot read shard shard-001.pt\nTraceback ...",
        2: "PipelineError: rank 2: the step failed elsewhere",
    }
    assert root_cause(failures) == 1
    assert root_cause({3: "killed by signal 9", 2: "exited with code 1 without a result"}) == 2
    # gloo's words for a wait that ran out while its peer was stuck: a consequence too
    assert root_cause({0: "RuntimeError: Application timeout caused pair closure",
                       3: "KeyError: 'boom'"}) == 3  # fmt: skip


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_two_runs_into_one_folder_are_refused(cache, in_process, tmp_path):
    out, text = tmp_path / "shared", tmp_path / "text.txt"
    text.write_text("a few lines to train on\n" * 400)  # small: both runs read it first
    first = subprocess.Popen(
        [sys.executable, "-m", "gpipe", "train", "--size", "tiny", "--stages", "1",
         "--data", str(text), "--steps", "3000", "--save-every", "0", "--progress", "lines",
         "--out", str(out)],
        env={**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        # Its rank's first line (the run's header) comes after the folder is claimed. Stopped,
        # it holds the folder as a running one does, without taking a core from the second
        # run for its steps (its ranks are in its process group).
        assert first.stdout.readline().startswith("gpipe train: "), first.stderr.read()
        os.killpg(first.pid, signal.SIGSTOP)
        second = in_process("train", "--size", "tiny", "--data", str(text), "--out", str(out))
        assert second.returncode == 2
        assert "is in use by another run" in second.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):  # it failed before its first step
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
