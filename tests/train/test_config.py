"""``gpipe train``'s options are :class:`TrainConfig`'s fields: one flag per field, generated
(``gpipe.cli.train``), whose parsed value lands in the resolved configuration."""

from __future__ import annotations

import argparse
import dataclasses

from gpipe.cli import train as train_cli
from gpipe.train import TrainConfig, resolve
from gpipe.train.config import flag, option

# A value other than the default for every option, as typed and as it lands in the config;
# all of them together make one valid run (base GPT: 10 layers = 3 stages x 2 virtual).
GIVEN = {
    "size": (["--size", "base"], "base"),
    "seq": (["--seq", "16"], 16),
    "stages": (["-K", "3"], 3),
    "chunks": (["-M", "6"], 6),
    "schedule": (["--schedule", "interleaved-1f1b"], "interleaved-1f1b"),
    "virtual_stages": (["--virtual-stages", "2"], 2),
    "checkpoint": (["--checkpoint", "always"], "always"),
    "checkpoint_layers": (["--checkpoint-layers", "2"], 2),
    "balance": (["--balance", "2,2,2,2,1,1"], [2, 2, 2, 2, 1, 1]),
    "replicas": (["-R", "2"], 2),
    "shard": (["--shard", "params"], "params"),
    "compile": (["--compile"], True),
    "batch": (["--batch", "24"], 24),
    "steps": (["--steps", "7"], 7),
    "lr": (["--lr", "0.01"], 0.01),
    "lr_schedule": (["--lr-schedule", "linear"], "linear"),
    "warmup": (["--warmup", "2"], 2),
    "optimizer": (["--optimizer", "adam"], "adam"),
    "weight_decay": (["--weight-decay", "0.2"], 0.2),
    "beta1": (["--beta1", "0.8"], 0.8),
    "beta2": (["--beta2", "0.99"], 0.99),
    "eps": (["--eps", "1e-6"], 1e-6),
    "grad_clip": (["--grad-clip", "0.5"], 0.5),
    "freeze": (["--freeze", "0.*"], "0.*"),
    "skip_nonfinite": (["--skip-nonfinite", "2"], 2),
    "seed": (["--seed", "3"], 3),
    "dtype": (["--dtype", "bfloat16"], "bfloat16"),
    "save_every": (["--save-every", "3"], 3),
    "keep": (["--keep", "1"], 1),
    "keep_best": (["--keep-best"], True),
    "save_on_exit": (["--no-save-on-exit"], False),
    "eval_every": (["--eval-every", "4"], 4),
    "eval_batches": (["--eval-batches", "2"], 2),
    "sample_tokens": (["--sample-tokens", "5"], 5),
    "prompt": (["--prompt", "x = "], "x = "),
    "temperature": (["--temperature", "0.5"], 0.5),
    "progress": (["--progress", "lines"], "lines"),
    "log_every": (["--log-every", "2"], 2),
    "report_to": (["--report-to", "none"], "none"),
    "threads": (["--threads", "1"], 1),
    "cpu_allocator": (["--cpu-allocator", "cache"], "cache"),
    "timeout": (["--timeout", "30"], 30.0),
    "transport": (["--transport", "group"], "group"),
    "init": (["--init", "random"], "random"),
    "model_config": (["--model-config", "n_layers=8"], "n_layers=8"),
    "family": (["--family", "causal-lm"], "causal-lm"),
    "text_field": (["--text-field", "body"], "body"),
    "target_field": (["--target-field", "summary"], "summary"),
    "val_fraction": (["--val-fraction", "0.1"], 0.1),
    "tokenizer": (["--tokenizer", "bytes"], "bytes"),
    "packing": (["--packing", "pad"], "pad"),
    "mask_prob": (["--mask-prob", "0.2"], 0.2),
}
# Tested on their own: --model (one run per built-in model; Hugging Face folders in
# test_hf.py), --split (a Hugging Face model's), --data and --val-data (files), --out
# and --resume (a checkpoint), --momentum (SGD's, in test_optimizers.py), --lora (test_lora.py).
APART = {"model", "split", "data", "val_data", "out", "resume", "momentum", "lora"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    return parser.parse_args(argv)


def options() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(TrainConfig) if option(f) is not None]


def test_every_field_is_an_option_but_the_model_arguments():
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    actions = {a.dest: a for a in parser._actions}
    assert {f.name for f in dataclasses.fields(TrainConfig)} - {f.name for f in options()} == {
        "model_args"  # from the preset, or the checkpoint on resume
    }
    for f in options():
        action = actions[f.name]
        assert flag(f.name) in action.option_strings, f.name
        assert action.default is None, f"{f.name}: None is 'not given', for presets and resume"
        assert "(default: " in action.help or f.name == "resume", f.name
    assert {f.name for f in options()} == set(GIVEN) | APART  # each one tested below
    assert parse().__dict__ == {
        **{f.name: None for f in options()},
        "strict_resume": False,
        "config": None,
    }


def test_each_option_lands_in_the_config(tmp_path):
    argv = [word for words, _ in GIVEN.values() for word in words]
    config = resolve(vars(parse(*argv, "-o", str(tmp_path / "run"))))
    for name, (words, value) in GIVEN.items():
        assert getattr(config, name) == value, words
        assert value != getattr(TrainConfig(), name), f"{words}: the default proves nothing"
    assert config.out == str(tmp_path / "run")
    # The layout's options make the run's Layout, the one value Pipe and the manifest take.
    assert config.layout.to_dict() == {name: GIVEN[name][1] for name in config.layout.to_dict()}
