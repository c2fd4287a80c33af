"""The code docs/your-model.md shows runs: plain ``dcp.load`` of a checkpoint gives the weights
``gpipe export`` gives, under the names the page says. (Its several-machines command, two
torchrun agents with ``--master-addr``: tests/parallel/test_distributed.py.)"""

from __future__ import annotations

import re
from pathlib import Path

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
