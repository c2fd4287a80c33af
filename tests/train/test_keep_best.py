"""``gpipe train --keep-best``: the checkpoint of the best validation loss is kept as
``OUT/best/step-NNNNNN/`` (intact, and never deleted by ``--keep``), its step and loss in
``best.json``."""

from __future__ import annotations

import json

import pytest

import gpipe.train.checkpoint as ckpt
from gpipe.train.checkpoint_integrity import problems


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_keep_best_keeps_the_checkpoint_of_the_lowest_validation_loss(in_process, tmp_path):
    run = tmp_path / "run"
    done = in_process("train", "--size", "tiny", "--steps", "6", "--eval-every", "1",
                      "--eval-batches", "1", "--save-every", "0", "--keep", "1", "--lr", "0.3",
                      "--sample-tokens", "0", "--progress", "lines", "--keep-best",
                      "--report-to", "none", "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    best = min(records, key=lambda r: r["val_loss"])
    assert best["step"] < 6  # a rate too high: the loss climbs after it (seeded, the same)
    kept = json.loads((run / "best.json").read_text())
    assert (kept["step"], kept["val_loss"]) == (best["step"], best["val_loss"])
    folder = ckpt.find(run / "best")  # best/step-NNNNNN/: eval, export and --resume take it
    assert ckpt.read_manifest(folder).step == best["step"]
    assert problems(folder) == []  # every file as its manifest says
    # --keep 1: only the last step's in checkpoints/ (the best one's name there is gone)
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-000006"]
