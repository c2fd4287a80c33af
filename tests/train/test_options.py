"""gpipe.train.options: how the options a user gave become the run's TrainConfig; a resume
takes the checkpoint's configuration, and a checkpoint without one is named with the remedy
(every option's landing: train/test_config.py; the problems listed together:
faults/test_bad_input.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import gpipe.train.checkpoint as ckpt
from gpipe.train import ConfigError, resolve


def test_resume_takes_the_checkpoints_configuration(tmp_path):
    saved = resolve({"size": "tiny", "seq": 16, "steps": 8, "out": str(tmp_path / "run")})
    root = Path(saved.out) / "checkpoints"
    staging = ckpt.begin(root, 4)
    ckpt.write(staging, model={"0.weight": torch.zeros(1)})
    folder = ckpt.commit(root, staging, ckpt.Manifest(step=4, config=dataclasses.asdict(saved)))
    config = resolve({"resume": str(folder), "steps": 9})
    assert config.resume == str(folder) and config.out == saved.out
    assert (config.size, config.seq, config.steps) == ("tiny", 16, 9)


def test_resume_from_a_checkpoint_without_a_run_configuration_says_so(tmp_path):
    staging = ckpt.begin(tmp_path, 4)
    ckpt.write(staging, model={"0.weight": torch.zeros(1)})
    folder = ckpt.commit(tmp_path, staging, ckpt.Manifest(step=4))  # the library's, no config
    with pytest.raises(ConfigError, match=r"holds no run configuration .*load_tensors"):
        resolve({"resume": str(folder), "steps": 9})
