"""``gpipe demo``: a small GPT trained through a pipeline in this process, its loss and speed
printed; a layout it cannot run is one line."""

from __future__ import annotations

import pytest

from gpipe.__main__ import main


def test_the_demo_trains_through_a_pipeline_and_prints_each_steps_loss(capsys):
    argv = ["--steps", "2", "--batch", "4", "--seq", "8", "--chunks", "2", "--log-every", "1"]
    assert main(["demo", *argv]) == 0
    first, *steps = capsys.readouterr().out.splitlines()
    assert first.startswith("gpipe demo: GPT 6 layers, ") and "balance=[3, 3], chunks=2" in first
    assert [line.split()[:3] for line in steps] == [["step", "1", "loss"], ["step", "2", "loss"]]
    assert all(line.endswith(" tokens/s") for line in steps)


def test_a_layout_the_demo_cannot_run_is_one_line():
    with pytest.raises(SystemExit, match=r"^gpipe demo: .*--stages 9") as stopped:
        main(["demo", "--stages", "9"])
    assert "\n" not in str(stopped.value)
