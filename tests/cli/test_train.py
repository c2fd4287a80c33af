"""``gpipe train``'s command line (gpipe.cli.train): one generated flag per field of
TrainConfig (each one's landing in the config: train/test_config.py), each built-in model a
choice, and --help that shows each field's default and says that -M is gradient
accumulation."""

from __future__ import annotations

import argparse

import pytest

from gpipe.__main__ import main
from gpipe.cli import train as train_cli
from gpipe.train import RECIPES, resolve


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    return parser.parse_args(argv)


def test_help_says_that_m_is_gradient_accumulation(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "gradient accumulation" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("model", sorted(RECIPES))
def test_each_model_is_a_choice(model, tmp_path):
    config = resolve(vars(parse("--model", model, "--size", "tiny", "--out", str(tmp_path))))
    assert (config.model, config.size) == (model, "tiny")


def test_help_shows_each_default_of_the_field(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "--timeout TIMEOUT seconds a rank waits for another (default: 120)" in text
    assert "--shard {params,all} shard each stage's" in text
    assert "(default: none: every replica holds all)" in text
    assert "--steps STEPS optimizer steps in all; on --resume" in text
    assert "at the new last step (default: preset)" in text
