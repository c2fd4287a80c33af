"""A run folder's names and where a checkpoint sits in it (train/run_folder.py)."""

from __future__ import annotations

from pathlib import Path

import gpipe.train.run_folder as run_folder


def test_a_step_names_its_checkpoint_folder():
    assert run_folder.step_folder(200) == "step-000200"
    assert Path(run_folder.step_folder(7)).match(run_folder.STEPS)


def test_the_checkpoints_a_path_designates(tmp_path):
    assert run_folder.checkpoints(tmp_path) == tmp_path  # a folder of checkpoints itself
    (tmp_path / "checkpoints").mkdir()
    assert run_folder.checkpoints(tmp_path) == tmp_path / "checkpoints"  # a run's


def test_the_run_of_a_checkpoint_and_the_export_beside_it(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000300"
    assert run_folder.run_of(checkpoint) == tmp_path / "run"
    assert run_folder.run_of(tmp_path / "step-000300") is None  # not in a run's checkpoints/
    assert run_folder.export_target(checkpoint, 300, folder=False) == (
        tmp_path / "run" / "model-step-000300.pt"
    )
    assert run_folder.export_target(checkpoint, 300, folder=True).name == "model-step-000300"
    assert run_folder.export_target(tmp_path / "x", 3, folder=False) == Path("model-step-000003.pt")


def test_the_files_a_run_writes_are_named_once():
    assert len(set(run_folder.FILES)) == len(run_folder.FILES)
    assert {run_folder.CONFIG, run_folder.OPTIONS, run_folder.METRICS} <= set(run_folder.FILES)
    assert run_folder.CHECKPOINTS not in run_folder.FILES  # a folder, with best/
