"""Where gpipe writes: never over what it did not write. ``gpipe export -o`` replaces only its
own exports (or --force), never writes into a checkpoint or over a run's files, and writes
through a temporary file made afresh (a planted link is not followed); ``gpipe train --out``
takes a new or empty folder or a gpipe run, nothing else."""

from __future__ import annotations

import json
import os

import pytest
import torch

import gpipe.train.checkpoint as ckpt
from gpipe.__main__ import main
from gpipe.train import config_file
from gpipe.train.outputs import is_run, run_folder_problems
from saved_checkpoints import make_model, save


@pytest.fixture
def run(tmp_path):
    """A run's folder as gpipe train leaves it: its options, files and a checkpoint."""
    folder = tmp_path / "run"
    save(folder / "checkpoints", 3, make_model())
    (folder / config_file.FILE).write_text('model = "gpt"\nsteps = 3\n')
    (folder / "config.json").write_text('{"model": "gpt"}\n')
    (folder / "metrics.jsonl").write_text("")
    return folder


def export(capsys, *argv):
    code = main(["export", *map(str, argv)])
    return code, capsys.readouterr().err


def test_a_new_export_and_its_own_again(run, tmp_path, capsys):
    out = tmp_path / "m.pt"
    assert export(capsys, run, "-o", out) == (0, "")
    assert json.loads(out.with_suffix(".json").read_text())["step"] == 3
    assert export(capsys, run, "-o", out) == (0, "")  # its own export: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "m.pt", "run"]  # no tmp
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("existing", ["notes.pt", "notes.json"])
def test_export_refuses_a_file_it_did_not_write_unless_forced(run, tmp_path, capsys, existing):
    (tmp_path / existing).write_text("the user's notes")
    out = tmp_path / "notes.pt"
    code, err = export(capsys, run, "-o", out)
    assert code == 2 and err == (
        f"gpipe export: error: -o {out}: {tmp_path / existing} exists and gpipe export did not "
        "write it: choose another -o, or pass --force to replace it\n"
    )
    assert (tmp_path / existing).read_text() == "the user's notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([existing, "run"])
    assert export(capsys, run, "-o", out, "--force")[0] == 0
    assert "step" in (tmp_path / "notes.json").read_text()


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("config.pt", "{run}/config.json is a file of the run {run}: choose another name"),
        ("metrics.jsonl", "{run}/metrics.jsonl is a file of the run {run}: choose another name"),
        ("checkpoints/model.pt", "{run}/checkpoints is a checkpoint or a folder of them: gpipe "
         "export never writes into one"),
        ("checkpoints/step-000003/model.pt", "{run}/checkpoints/step-000003 is a checkpoint"),
        ("checkpoints/step-000003/new/model.pt", "{run}/checkpoints/step-000003 is a checkpoint"),
    ],
)  # fmt: skip
def test_export_never_writes_into_a_checkpoint_or_over_a_run_s_files(run, capsys, where, message):
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for force in ([], ["--force"]):
        code, err = export(capsys, run, "-o", run / where, *force)
        assert code == 2 and err.startswith(
            f"gpipe export: error: -o {run / where}: {message.format(run=run)}"
        ), err
        assert err.count("\n") == 1
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert export(capsys, run)[0] == 0  # the default: beside checkpoints/, by its step
    assert (run / "model-step-000003.pt").is_file()


def test_export_follows_no_planted_link(run, tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "m.pt"
    for guess in (".m.pt.tmp", "m.pt.tmp", ".m.json.tmp"):
        (tmp_path / guess).symlink_to(victim)
    assert export(capsys, run, "-o", out)[0] == 0
    assert victim.read_text() == "precious"
    out.unlink()
    out.symlink_to(victim)  # a link as -o itself, replaced through gpipe's record, not followed
    assert export(capsys, run, "-o", out)[0] == 0
    assert victim.read_text() == "precious" and not out.is_symlink()
    out.unlink()
    out.with_suffix(".json").unlink()
    out.symlink_to(victim)  # without the record: not gpipe's export
    assert export(capsys, run, "-o", out)[0] == 2
    assert export(capsys, run, "-o", out, "--force")[0] == 0
    assert victim.read_text() == "precious" and not out.is_symlink()
    assert torch.load(out, weights_only=True).keys() == make_model().state_dict().keys()


def test_a_run_is_its_options_or_a_checkpoint(run, tmp_path):
    assert is_run(run)
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    assert not is_run(model)
    (model / config_file.FILE).write_text("[tool.other]\nx = 1\n")  # not gpipe's options
    assert not is_run(model)
    assert run_folder_problems(tmp_path / "new") == run_folder_problems(run) == []
    (tmp_path / "empty").mkdir()
    assert run_folder_problems(tmp_path / "empty") == []
    assert run_folder_problems(model) == [
        f"--out {model} holds config.json, config.toml, and is not a gpipe run: gpipe writes a "
        "run only into a new or empty folder or its own run's; choose another --out"
    ]


def test_a_hugging_face_export_never_replaces_the_user_s_model_folder(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    staging = ckpt.begin(root, 3)
    ckpt.write(staging, model=make_model().state_dict())
    hf = {"kind": "hf", "args": {}}  # a Hugging Face model's: exported as a folder
    ckpt.commit(root, staging, ckpt.Manifest(step=3, model=hf))
    model = tmp_path / "my-qwen"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    code, err = export(capsys, tmp_path / "run", "-o", model)
    assert code == 2 and f"{model} exists and gpipe export did not write it" in err
    assert (model / "config.json").read_text() == '{"model_type": "qwen2"}'
