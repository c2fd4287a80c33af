"""gpipe.train.memory_checks: sizes this machine cannot hold (one micro-batch in the largest
layer, the processes themselves) are one line before any process starts (the peak of the
model's own state: train/test_inputs.py)."""

from __future__ import annotations

import pytest

from gpipe.__main__ import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--size", "tiny", "--seq", "1000000"],  # 2 x 2 heads x 10^12 scores: 29 TiB
            "--seq 1000000, --batch 8 (--chunks 4): one micro-batch of 2 samples needs at least",
        ),
        (["--size", "tiny", "--batch", str(10**12)], f"--batch {10**12} (--chunks 4)"),
        (
            ["--model", "hf-llama", "--size", "tiny", "--seq", "1000000"],
            "--seq 1000000, --batch 8 (--chunks 4): one micro-batch of 2 samples needs at least",
        ),
        (
            ["--size", "tiny", "--replicas", "100000", "--batch", "100000", "--chunks", "1"],
            "= 200000 processes need about",
        ),
    ],
)
def test_what_this_machine_cannot_hold_is_refused_before_anything_starts(
    argv, message, capsys, tmp_path
):
    assert main(["train", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpipe train: error:") and message in err
    assert not (tmp_path / "x").exists()  # nothing was started
