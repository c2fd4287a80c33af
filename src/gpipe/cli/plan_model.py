"""``gpipe plan``'s model: the very one ``gpipe train`` would train with the same ``--model``,
``--size``, ``--model-config``, ``--seq`` and ``--batch`` (built by ``gpipe.train``'s own
configuration and task, a Hugging Face model captured as ``Pipe.from_model`` cuts it), one
mini-batch of its own data, and its loss; and the TOML file that trains the plan's choice.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["TrainedModel", "not_ours", "trained_model", "write_train_config"]

# What names the model and its data shape, as gpipe train's options (TrainConfig fields).
MODEL_OPTIONS = ("model", "size", "model_config", "seq", "batch")
# The first words of every file --write-config writes: how a later plan knows it may replace it.
_MARK = "gpipe plan's first choice for "


@dataclass
class TrainedModel:
    model: nn.Sequential  # its units, as the Pipe of gpipe train cuts them
    inputs: Any  # one mini-batch
    targets: Any
    loss_fn: Any
    options: dict[str, Any]  # the gpipe train options that build it and its data
    what: str


def trained_model(args: argparse.Namespace) -> TrainedModel:
    """The model, one mini-batch of its data and its loss, as ``gpipe train`` builds them."""
    from gpipe.frontend import capture
    from gpipe.train import resolve

    given = {k: getattr(args, k, None) for k in MODEL_OPTIONS}
    # one stage and no replicas: the layout is what the plan chooses, not a given
    config = resolve({**given, "stages": 1, "replicas": 1, "chunks": 1})
    task = config.task
    torch.manual_seed(args.seed)
    prepared = task.prepare()
    data = task.data(batch=config.batch, eval_batches=1, prepared=prepared)
    inputs, targets = task.batch(data.train, torch.arange(config.batch), seed=args.seed)
    model = task.model.build()
    if not isinstance(model, nn.Sequential):  # a Hugging Face model: its captured units
        example = task.objective.example(task.seq)
        model = capture(model, example, split=task.model.split(model))
    if len(model) != task.units():
        raise ValueError(
            f"--model {args.model}: {len(model)} units profiled where gpipe train cuts "
            f"{task.units()}; plan it with --split as gpipe train would"
        )
    options = {
        "model": config.model, "size": config.size, "model_config": config.model_config,
        "seq": config.seq if "seq" in task.size_options else None, "batch": config.batch,
    }  # fmt: skip
    shape = f"seq {config.seq}, " if "seq" in task.size_options else ""
    what = f"{config.model_name} ({config.size}, {shape}batch {config.batch})"
    return TrainedModel(model, inputs, targets, task.loss, options, what)


def write_train_config(path: str, trained: TrainedModel, best: Any, *, budget: bool) -> None:
    """The planned model and the ``best`` candidate's layout, as ``gpipe train --config``
    reads them: it trains exactly what was planned."""
    from gpipe.train.config_file import write_options

    options = {**trained.options, **best.layout.to_dict(), "balance": list(best.balance)}
    if budget:
        # planned within a budget: peaks as measured need freed memory given back
        options["cpu_allocator"] = "return"
    header = (
        f"{_MARK}{trained.what} (predicted "
        f"{best.throughput:,.1f} samples/s).\n"
        "gpipe train --config THIS; flags on the command line override these (another "
        "--stages needs another --balance)."
    )
    write_options(path, options, header=header)


def not_ours(path: str) -> str | None:
    """Why ``--write-config PATH`` must not be written (checked before planning), or None: a
    file is replaced only where an earlier ``gpipe plan`` wrote it."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as file:
            ours = file.read(len(_MARK) + 2) == f"# {_MARK}".encode()
    except OSError:
        ours = False
    if ours and not os.path.islink(path):
        return None
    return (
        f"--write-config {path}: it exists and gpipe plan did not write it; choose another "
        "file, or move it away first"
    )
