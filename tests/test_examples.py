"""The quickest examples, run as a reader runs them (``python examples/NAME.py``, one
process): they print their progress, start at the loss of a guess (ln of the number of
classes) and learn. The Hugging Face ones take longer; their models are tested in
tests/frontend/."""

from __future__ import annotations

import math
import re
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(("name", "classes"), [("gpt_tied", 256), ("unet_skips", 2)])
def test_example_prints_progress_and_learns(name, classes, monkeypatch, capsys):
    path = EXAMPLES / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path)])
    runpy.run_path(str(path), run_name="__main__")
    printed = capsys.readouterr().out
    steps = [float(v) for v in re.findall(r"^step +\d+ +loss ([\d.]+)$", printed, re.M)]
    final = [float(v) for v in re.findall(r"^final loss ([\d.]+)$", printed, re.M)]
    assert len(steps) >= 3 and len(final) == 1, printed
    assert abs(steps[0] - math.log(classes)) < 0.1 * math.log(classes), printed
    assert final[0] < 0.75 * steps[0], printed
