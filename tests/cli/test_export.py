"""``gpipe export``: a run's newest checkpoint as one plain state dict and the constructor
that loads it; a bad name, an unwritable path or a damaged checkpoint is one line and writes
nothing (what it never overwrites: train/test_outputs.py)."""

from __future__ import annotations

import json

import pytest

from gpipe.__main__ import main
from saved_checkpoints import make_model, save


def test_export_command(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    assert main(["export", str(out), "-o", str(tmp_path / "m.pt")]) == 0
    printed = capsys.readouterr().out
    assert "gpipe.models.gpt(gpipe.models.GPTConfig(vocab_size=256, context=32" in printed
    assert json.loads((tmp_path / "m.json").read_text())["step"] == 10
    assert main(["export", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_export_refuses_a_json_name_for_the_weights(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    assert main(["export", str(out), "-o", str(tmp_path / "weights.json")]) == 2
    assert "another name than the .json file" in capsys.readouterr().err
    assert not (tmp_path / "weights.json").exists()


@pytest.mark.parametrize("where", ["/sys/x.pt", "{tmp}/a-file/x.pt"])
def test_export_to_an_unwritable_path_is_one_line(tmp_path, capsys, where):
    save(tmp_path / "checkpoints", 3, make_model())
    (tmp_path / "a-file").write_text("not a folder")
    out = where.format(tmp=tmp_path)
    assert main(["export", str(tmp_path), "-o", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpipe export: error: -o {out}: cannot write there (")
    assert err.endswith("; choose a writable path\n") and err.count("\n") == 1


def test_export_of_a_damaged_checkpoint_names_the_file(tmp_path, capsys):
    folder = save(tmp_path / "checkpoints", 3, make_model())
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    data[-10] ^= 0xFF  # in a tensor's bytes: DCP would read it without a word
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    assert main(["export", str(tmp_path), "-o", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err
    assert "is damaged: __0_0.distcp is not the file saved (checksum differs)" in err
    assert not (tmp_path / "m.pt").exists()
