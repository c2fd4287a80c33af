"""Check that a pipelined step of your model is the plain model's step, in float64.

    gpipe check --model mypkg.nets:build --loss torch.nn:CrossEntropyLoss \\
        --batch mypkg.data:one_batch --chunks 4 --schedule zb-h1
    gpipe check --config runs/gpt-small-.../config.toml     # a gpipe train run's model and data
    gpipe check --config run.toml --schedule zb-v           # the same, another schedule

Trains two float64 copies of the model a few steps in this process, one through a Pipe and
one plain (``gpipe.check``), and prints "exact (...)" or the worst parameters by name and the
likely causes; the exit status is 0 when exact, 1 when not. ``--model``, ``--loss``,
``--batch`` and ``--optimizer`` are import paths ``module:name`` (the current folder is
importable): a model or a function that builds one; a loss function, or a loss class built
with no arguments; a function returning ``(inputs, targets)``, or that pair; an optimizer
class or a function of the parameters (default SGD, lr 0.1). With ``--config``, the model,
loss and a batch of the data are built as ``gpipe train`` builds them, in float64; the flags
here override the file's settings.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import typing
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gpipe.base.errors import PartitionError, PipelineError
from gpipe.base.remat import Remat
from gpipe.cli.train import add_config_options, config_of
from gpipe.pipe.exactness import check
from gpipe.schedule.registry import SCHEDULES
from gpipe.train.config import _option

__all__ = ["CheckConfig", "configure", "run"]


def _help(text: str, **more: Any) -> Any:
    return _option(None, text, "check", **more)  # an option of gpipe check, none given


@dataclass
class CheckConfig:
    """The options of ``gpipe check``: each field is a flag (``--virtual-stages``)."""

    model: str | None = _help("the model, or a function building it: module:name")
    loss: str | None = _help("the loss function or class: module:name")
    batch: str | None = _help("(inputs, targets), or a function returning them: module:name")
    optimizer: str | None = _help("an optimizer class or a function of the parameters")
    config: str | None = _help("a gpipe train TOML file: its model, loss, data and layout")
    stages: int | None = _help("pipeline ranks K (default 2)")
    chunks: int | None = _help("micro-batches M (default 4)")
    schedule: str | None = _help("the schedule (default gpipe)", choices=tuple(sorted(SCHEDULES)))
    checkpoint: str | None = _help("remat (default except_last)", choices=typing.get_args(Remat))
    virtual_stages: int | None = _help("stages per rank (default: the schedule's)")
    balance: str | None = _help("layers (units) per stage, e.g. 3,3 (default: even)")
    split: str | None = _help("a model that is not a sequence: the module to cut at")
    steps: int | None = _help("steps compared (default 3)")
    reduction: str | None = _help("as Pipe.step's (default mean)", choices=("mean", "sum"))
    tolerance: float | None = _help("largest relative error per tensor (default 1e-10)")
    seed: int | None = _help("seed of the factory, the batch and the dropout (default 0)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_config_options(parser, CheckConfig)


# Not check()'s keywords: what is checked, and --balance (read as ints below).
_NOT_SETTINGS = ("model", "loss", "batch", "optimizer", "config", "balance")


def run(args: argparse.Namespace) -> int:
    given = config_of(args, CheckConfig)
    try:
        model, loss, batch, settings = _from_train_config(given) if given.config else (
            _from_imports(given)
        )  # fmt: skip
        made = _imported(given.optimizer, "optimizer") if given.optimizer else None
    except (ValueError, TypeError) as error:
        print(f"gpipe check: error: {error}", file=sys.stderr)
        return 2
    settings = {k: v for k, v in settings.items() if v is not None}
    settings.update(
        (k, v) for k, v in asdict(given).items() if k not in _NOT_SETTINGS and v is not None
    )
    if given.balance is not None:
        settings["balance"] = [int(b) for b in given.balance.split(",")]
    settings.setdefault("chunks", 4)
    optimizer = (lambda params: made(params)) if made is not None else None
    try:
        report = check(model, loss, optimizer, batch, **settings)
    except PartitionError as error:  # the settings: before any step
        print(f"gpipe check: error: {error}", file=sys.stderr)
        return 2
    except PipelineError as error:  # the Pipe refused what the plain model does
        print(f"gpipe check: the pipelined step was refused: {error}")
        return 1
    print(f"gpipe check: {report}")
    return 0 if report.exact else 1


def _imported(path: str, flag: str) -> Any:
    """``module:name`` (``name`` may be dotted), the current folder importable."""
    module_name, _, name = path.partition(":")
    if not name:
        raise ValueError(f"--{flag} {path!r} is not module:name, e.g. mypkg.nets:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value: Any = importlib.import_module(module_name)
        for part in name.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--{flag} {path}: {error}") from None
    return value


def _from_imports(given: CheckConfig):
    missing = [n for n in ("model", "loss", "batch") if getattr(given, n) is None]
    if missing:
        flags = ", ".join(f"--{n}" for n in missing)
        raise ValueError(f"missing {flags} (module:name each), or a gpipe train --config")
    model = _imported(given.model, "model")
    loss = _imported(given.loss, "loss")
    if isinstance(loss, type):
        loss = loss()
    batch = _imported(given.batch, "batch")
    if callable(batch):
        batch = batch()
    return model, loss, tuple(batch), {}


def _from_train_config(given: CheckConfig):
    """The model, loss, first batch and layout of a ``gpipe train`` config, in float64, as
    the trainer builds them (``gpipe.train.tasks``)."""
    from gpipe.train import config_file, resolve, task_of
    from gpipe.train.config import ConfigError

    try:
        config = resolve({**config_file.read(given.config), "dtype": "float64"})
    except ConfigError as error:
        raise ValueError(f"--config {given.config}: {error}") from None
    task = task_of(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(config.seed)
        model = task.model.build()
    finally:
        torch.set_default_dtype(previous)
    data = task.data(batch=config.batch, eval_batches=1, prepared=task.prepare(),
                     chunks=config.chunks)  # fmt: skip
    batch = task.batch(data.train, torch.arange(config.batch), seed=config.seed)
    layout = {
        "stages": config.stages, "chunks": config.chunks, "schedule": config.schedule,
        "checkpoint": config.checkpoint, "virtual_stages": config.virtual_stages,
        "balance": config.balance, "count": task.count,
        "deferred_batch_norm": task.deferred_batch_norm or None,
    }  # fmt: skip
    return model, task.loss, batch, layout
