"""The code docs/your-model.md shows runs: plain ``dcp.load`` of a checkpoint gives the weights
``gpipe export`` gives, under the names the page says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gpipe import checkpoint as ckpt

PAGE = Path(__file__).resolve().parents[2] / "docs" / "your-model.md"


def snippet(marker: str) -> str:
    found = re.search(rf"<!-- {marker}:[^>]*-->\n```python\n(.*?)```", PAGE.read_text(), re.S)
    assert found, f"no {marker} snippet in {PAGE}"
    return found.group(1)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_dcp_load_snippet_reads_a_runs_weights(in_process, tmp_path):
    run = tmp_path / "run"
    done = in_process("train", "--size", "tiny", "--steps", "2", "--eval-every", "0",
                      "--sample-tokens", "0", "--progress", "lines", "--no-tensorboard",
                      "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr
    folder = ckpt.find(run)
    code = snippet("dcp-load").replace(
        '"runs/qwen-from-scratch/checkpoints/step-000040"', repr(str(folder))
    )
    scope: dict = {}
    exec(compile(code, str(PAGE), "exec"), scope)  # the page's own code, as a reader runs it
    exported = ckpt.export_state_dict(folder)
    assert set(scope["model"]) == set(exported)
    assert all(torch.equal(scope["model"][k], v) for k, v in exported.items())
