"""Evaluate a model through a pipeline of K processes: loss, perplexity and tokens/s.

    gpipe eval runs/gpt-small-20250101-120000 --data notes.txt   # its newest checkpoint
    gpipe eval runs/.../checkpoints/step-000300 --data val.jsonl -K 4 -M 8
    gpipe eval ./my-qwen --data val.jsonl                        # a Hugging Face folder
    gpipe eval runs/.../model-step-000300 --data val.jsonl       # what gpipe export wrote

The data is read and cut into windows as ``gpipe train --data`` reads it (the model's
tokenizer, its --seq); every window is evaluated, by the same code as gpipe train's
validation (``gpipe.train.evaluation``): the loss is the mean over every target, the plain
model's on the same windows whatever K and M. A run's checkpoint keeps its own model and
sequence length; any K evaluates it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from gpipe.cli.train import add_config_options, config_of
from gpipe.train import TrainingError
from gpipe.train.eval_job import EvalConfig, resolve_eval, run_eval

__all__ = ["add_model_argument", "configure", "run"]


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The model a command reads (``gpipe eval``, ``gpipe generate``)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "model", metavar="RUN|DIR",
        help="a run folder (its newest intact checkpoint), a checkpoint folder, or a Hugging "
        "Face model folder (save_pretrained's, or gpipe export's)",
    )  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_config_options(parser, EvalConfig)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")


def run(args: argparse.Namespace) -> int:
    config = resolve_eval(config_of(args, EvalConfig))
    try:
        result = run_eval(config)
    except TrainingError as error:
        print(f"gpipe eval: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    unit = config.task.unit
    print(f"{args.model}: {result['samples']} windows of {config.seq} ({result['targets']:,} "
          f"targets), K={config.stages}, M={config.chunks}")  # fmt: skip
    print(f"  loss        {result['loss']:.6f}")
    if "perplexity" in result:
        print(f"  perplexity  {result['perplexity']:.4f}")
    if "accuracy" in result:
        print(f"  accuracy    {result['accuracy']:.2%}")
    speed = result[f"{unit}_per_s"]
    print(f"  {unit}/s{' ' * max(1, 10 - len(unit))}{speed:,.0f} ({result['seconds']:.2f} s)")
    return 0 if math.isfinite(result["loss"]) else 1
