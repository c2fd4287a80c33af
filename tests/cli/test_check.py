"""``gpipe check``: "exact" and exit 0, or the inexact parameters by name and exit 1; missing
or bad import paths are one line; a ``gpipe train`` config checked as train builds it. The
model, loss and batch are test_exactness.py's, imported by their paths as a user's are."""

from __future__ import annotations

import pytest

from gpipe.__main__ import main


def test_the_command_prints_exact_and_exits_0(capsys):
    argv = ["check", "--model", "pipe.test_exactness:tiny", "--loss", "torch.nn:CrossEntropyLoss",
            "--batch", "pipe.test_exactness:tiny_batch", "--chunks", "3",
            "--schedule", "1f1b"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpipe check: exact (worst |Δ| = ") and "schedule 1f1b" in out


def test_the_command_names_an_inexact_parameter_and_exits_1(capsys):
    argv = ["check", "--model", "pipe.test_exactness:tiny", "--loss", "pipe.test_exactness:summed",
            "--batch", "pipe.test_exactness:tiny_batch", "--chunks", "2", "--optimizer",
            "torch.optim:Adam", "--steps", "2"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "NOT exact" in out and "5.weight" in out and "reduction='sum'" in out


def test_the_command_refuses_missing_imports_in_one_line(capsys):
    assert main(["check", "--model", "pipe.test_exactness:tiny"]) == 2
    assert "missing --loss, --batch" in capsys.readouterr().err
    assert main(["check", "--model", "tiny", "--loss", "x:y", "--batch", "x:y"]) == 2
    assert "--model 'tiny' is not module:name" in capsys.readouterr().err
    assert main(["check", "--model", "nowhere:tiny", "--loss", "x:y", "--batch", "x:y"]) == 2
    assert "--model nowhere:tiny: No module named 'nowhere'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_checks_a_gpipe_train_config(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("\n".join(f"line {i}: the pipeline carries micro-batches" for i in range(300)))
    config = tmp_path / "run.toml"
    config.write_text(f'model = "gpt"\nsize = "tiny"\ndata = "{text}"\nbatch = 4\nchunks = 2\n')
    assert main(["check", "--config", str(config), "--schedule", "zb-h1", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "exact" in out and "K=2, M=2, schedule zb-h1" in out
