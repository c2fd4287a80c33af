"""The code docs/your-model.md shows runs: plain ``dcp.load`` of a checkpoint gives the weights
``gpipe export`` gives, under the names the page says; its several-machines command trains
one job with two torchrun agents on this host (the gradients of such a job against the
un-split model: tests/parallel/test_distributed.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpipe.train.checkpoint as ckpt

PAGE = Path(__file__).resolve().parents[2] / "docs" / "your-model.md"


def snippet(marker: str) -> str:
    found = re.search(rf"<!-- {marker}:[^>]*-->\n```python\n(.*?)```", PAGE.read_text(), re.S)
    assert found, f"no {marker} snippet in {PAGE}"
    return found.group(1)


def test_the_dcp_load_snippet_reads_a_runs_weights(tiny_run):
    run, _ = tiny_run  # the session's K=2 run: its newest checkpoint
    folder = ckpt.find(run)
    code = snippet("dcp-load").replace(
        '"runs/qwen-from-scratch/checkpoints/step-000040"', repr(str(folder))
    )
    scope: dict = {}
    exec(compile(code, str(PAGE), "exec"), scope)  # the page's own code, as a reader runs it
    exported = ckpt.export_state_dict(folder)
    assert set(scope["model"]) == set(exported)
    assert all(torch.equal(scope["model"][k], v) for k, v in exported.items())


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_torchrun_agents_on_one_host_train_one_job(tmp_path):
    """The page's several-machines command, both "machines" here: one process each."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
               str(port), "-m", "gpipe", "train", "--stages", "2", "--size", "tiny", "--steps",
               "2", "--eval-every", "0", "--sample-tokens", "0", "--progress", "lines",
               "--report-to", "none", "--out", str(run)]  # fmt: skip
    agents = [
        subprocess.Popen(
            [*command[:5], "--node-rank", str(node), *command[5:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    assert ckpt.read_manifest(ckpt.find(run)).step == 2
