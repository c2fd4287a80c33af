"""``gpipe train --config FILE`` (``gpipe.train.config_file``): every option in TOML, flags
over the file, errors that name the key, the file and the remedy, a run's ``config.toml``
that trains the same run again, and ``gpipe plan --write-config``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from gpipe.__main__ import main
from gpipe.cli import train as train_cli
from gpipe.train import ConfigError, TrainConfig, config_file, resolve
from train.test_config import GIVEN


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    return parser.parse_args(argv)


def options_of(config: TrainConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("out", "resume")}


def test_every_option_reads_from_the_file_as_from_its_flag(tmp_path):
    file = tmp_path / "run.toml"
    config_file.write_options(file, {name: value for name, (_, value) in GIVEN.items()})
    from_file = resolve(config_file.merge(file, {"out": str(tmp_path / "a")}))
    argv = [word for words, _ in GIVEN.values() for word in words]
    from_flags = resolve(vars(parse(*argv, "--out", str(tmp_path / "b"))))
    assert options_of(from_file) == options_of(from_flags)


def test_flags_override_the_file(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('size = "tiny"\nstages = 2\nchunks = 2\nlr = 1\nprompt = "a \\"b\\"\\n"\n')
    args = parse("--config", str(file), "-M", "4", "--out", str(tmp_path / "run"))
    config = resolve(config_file.merge(args.config, vars(args)))
    assert (config.size, config.stages, config.chunks) == ("tiny", 2, 4)
    assert config.lr == 1.0 and isinstance(config.lr, float)  # an int where a float goes
    assert config.prompt == 'a "b"\n'


def test_a_runs_config_toml_gives_back_the_same_run(tmp_path):
    given = {"size": "tiny", "balance": "1,3", "model_config": "n_layers=2,d_model=16",
             "prompt": 'é "\\\x7f\t', "save_on_exit": False, "lr": 1e-5,
             "out": str(tmp_path / "a")}  # fmt: skip
    config = resolve(given)
    file = tmp_path / config_file.FILE
    config_file.write(file, config)
    text = file.read_text()
    assert "\nout =" not in text and "balance = [1, 3]" in text and "lr = 1e-05" in text
    again = resolve(config_file.merge(file, {"out": str(tmp_path / "b")}))
    assert options_of(again) == options_of(config)


@pytest.mark.parametrize("model", ["resnet", "hf-llama"])
def test_each_built_in_models_config_toml_gives_back_the_same_run(model, tmp_path):
    config = resolve({"model": model, "size": "tiny", "out": str(tmp_path / "a")})
    config_file.write(tmp_path / config_file.FILE, config)
    again = resolve(config_file.merge(tmp_path / config_file.FILE, {"out": str(tmp_path / "b")}))
    assert options_of(again) == options_of(config)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("virtual-stages = 2", "unknown key 'virtual-stages': did you mean virtual_stages?"),
        ("stagez = 2", "unknown key 'stagez': did you mean stages?"),
        ('stages = "2"', 'stages = "2" is a string; give an integer, e.g. stages = 2'),
        ("compile = 1", "compile = 1 is an integer; give true or false, e.g. compile = false"),
        ("lr = true", "lr = true is a boolean; give a number, e.g. lr = 0.003"),
        ('balance = "3,3"', "is a string; give a list of integers, e.g. balance = [3, 3]"),
        ("steps = 1.5", "steps = 1.5 is a number; give an integer, e.g. steps = 500"),
        ("[model]\nsize = 1", "model = {...} is a table; give a string (in quotes)"),
        ("stages = ", "not TOML (Invalid value (at line 1, column 10)); fix the file"),
    ],
)
def test_a_bad_key_or_value_names_the_key_the_file_and_the_remedy(tmp_path, text, expected):
    file = tmp_path / "bad.toml"
    file.write_text(text + "\n")
    with pytest.raises(ConfigError) as error:
        config_file.read(file)
    assert f"--config {file}: " in str(error.value) and expected in str(error.value)


def test_a_value_outside_an_options_choices_is_named_with_them(tmp_path, capsys):
    file = tmp_path / "run.toml"
    file.write_text('transport = "tcp"\nschedule = "1F1B"\nsize = "tiny"\n')
    assert main(["train", "--config", str(file), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--transport 'tcp': choose one of auto, sockets, group" in err
    assert "unknown schedule '1F1B'; known: gpipe, 1f1b," in err
    assert not (tmp_path / "x").exists()


def test_every_problem_of_a_file_is_listed_and_a_missing_file_is_named(tmp_path, capsys):
    file = tmp_path / "bad.toml"
    file.write_text('stagez = 2\nchunks = "4"\n')
    with pytest.raises(ConfigError) as error:
        config_file.read(file)
    assert len(error.value.problems) == 2
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert f"--config {tmp_path / 'none.toml'}: No such file or directory" in (
        capsys.readouterr().err
    )


@pytest.mark.timeout(120)
def test_plan_writes_its_first_choice_for_train(tmp_path, capsys):
    file = tmp_path / "plan.toml"
    shape = ["--model-config", "n_layers=2,d_model=16,n_heads=2", "--seq", "8"]
    search = ["--batch", "8", "--processes", "2", "--search-chunks", "2,4"]
    profile = ["--profile-repeats", "1", "--profile-warmup", "0"]
    assert main(["plan", *shape, *search, *profile, "--write-config", str(file)]) == 0
    assert f"gpipe train --config {file}" in capsys.readouterr().out
    written = config_file.read(file)
    config = resolve(config_file.merge(file, {"out": str(tmp_path / "run")}))
    for name in ("stages", "chunks", "schedule", "virtual_stages", "checkpoint", "balance"):
        assert getattr(config, name) == written[name], name
    assert (config.model, config.seq, config.batch) == ("gpt", 8, 8)
    assert config.model_args["n_layers"] == 2 and sum(config.balance) == 4
    assert config.cpu_allocator == "default"  # no budget: nothing to fit


@pytest.mark.timeout(120)
def test_a_plan_within_a_budget_carries_the_allocator_it_was_planned_with(tmp_path, capsys):
    file = tmp_path / "plan.toml"
    shape = ["--model-config", "n_layers=2,d_model=16,n_heads=2", "--seq", "8"]
    search = ["--batch", "8", "--processes", "2", "--search-chunks", "2", "--profile-repeats", "1"]
    budget = ["--memory", "1GiB", "--search-schedules", "gpipe", "--search-checkpoints", "always"]
    assert main(["plan", *shape, *search, *budget, "--profile-warmup", "0", "--write-config",
                 str(file)]) == 0  # fmt: skip
    config = resolve(config_file.merge(file, {"out": str(tmp_path / "run")}))
    assert config.cpu_allocator == "return"
