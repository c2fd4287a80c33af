"""``gpipe eval``'s job: a run's checkpoint or a model folder evaluated through a pipeline of
K processes on a file of text: loss, perplexity and tokens per second.

:func:`resolve_eval` turns an :class:`EvalConfig` into the :class:`TrainConfig` of the model
(a run's, or a fresh one of a Hugging Face folder) whose validation data is the file;
:func:`run_eval` starts the K processes, each of which runs the trainer's own validation
(:func:`gpipe.train.evaluation.validate`) over every window of the file.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import gpipe.train.checkpoint as ckpt
import gpipe.train.inputs as inputs
from gpipe.layout import Layout
from gpipe.parallel.launch import threads_per_process
from gpipe.parallel.mesh import Mesh
from gpipe.pipe import Pipe
from gpipe.train.checkpoint_integrity import choose
from gpipe.train.config import ConfigError, TrainConfig, _option, model_spec, num_layers
from gpipe.train.evaluation import build_pipe, validate
from gpipe.train.job import launched
from gpipe.train.options import resolve
from gpipe.train.precision import autocast_of

__all__ = ["EvalConfig", "load_pipe", "resolve_eval", "resolve_model", "run_eval"]

_DATA, _PIPELINE = "data", "pipeline"


@dataclass
class EvalConfig:
    """What ``gpipe eval`` evaluates, and how; each field but ``model`` is an option."""

    model: str = ""  # a run folder, a checkpoint, or a Hugging Face model folder
    data: str | None = _option(
        None, "the text to evaluate on: a file or folder, read as gpipe train --data reads it",
        _DATA, metavar="FILE|DIR",
    )  # fmt: skip
    text_field: str = _option("text", "the JSONL field or dataset column of the text", _DATA)
    seq: int | None = _option(
        None, "tokens per window; a run's own is fixed", _DATA,
        default_text="the run's, or the preset's for a folder",
    )  # fmt: skip
    batch: int = _option(8, "windows per pipelined forward", _PIPELINE)
    stages: int = _option(2, "K: pipeline stages, one process each", _PIPELINE, flags=("-K",))
    chunks: int = _option(4, "M: micro-batches per forward", _PIPELINE, flags=("-M",))
    dtype: str = _option(
        "float32", "weights' dtype, or float32 under bfloat16 or float16 autocast", _PIPELINE,
        choices=("float32", "bfloat16", "float16", "float64"),
    )  # fmt: skip
    timeout: float = _option(120.0, "seconds a rank waits for another", _PIPELINE)


def resolve_eval(e: EvalConfig) -> TrainConfig:
    """The model's configuration with ``e.data`` as its validation data; raises
    :class:`ConfigError` for what cannot run."""
    if not e.data:
        raise ConfigError(["--data is required: the text to evaluate on (a file or folder)"])
    if not Path(e.data).exists():
        raise ConfigError([f"--data {e.data}: no such file or folder"])
    data = str(Path(e.data).resolve())
    pipeline = {"stages": e.stages, "chunks": e.chunks, "batch": e.batch, "dtype": e.dtype,
                "timeout": e.timeout}  # fmt: skip
    config = resolve_model(e.model, pipeline, seq=e.seq, data=data)
    return replace(config, data=data, val_data=data, text_field=e.text_field)


def resolve_model(
    model: str, pipeline: dict[str, Any], *, seq: int | None, data: str | None = None
) -> TrainConfig:
    """The configuration of ``model`` (a run, a checkpoint or a model folder) as K processes
    that only run forwards (``pipeline``: stages, chunks, batch, dtype, timeout) build it."""
    pipeline = {**pipeline, "replicas": 1, "report_to": "none"}
    if not ckpt.holds(model):
        return resolve({**pipeline, "model": model, "seq": seq, "data": data,
                        "out": str(Path(tempfile.gettempdir()) / "gpipe-eval")})  # fmt: skip
    try:
        folder, _ = choose(model)
    except ckpt.CheckpointError as error:
        raise ConfigError([f"{model}: {error}"]) from None
    if seq is not None:
        raise ConfigError([f"--seq: {model}'s model is fixed by its run; drop --seq"])
    manifest = ckpt.read_manifest(folder)
    # Any K: the default cut of its layers, a plain schedule (a forward only).
    layout = Layout(stages=pipeline["stages"], schedule="gpipe", virtual_stages=1)
    balance = layout.default_balance(num_layers(manifest.model))
    return resolve({
        **pipeline, "resume": str(folder), "steps": manifest.step + 1, "schedule": "gpipe",
        "virtual_stages": 1, "balance": ",".join(map(str, balance)),
    })  # fmt: skip


def run_eval(config: TrainConfig) -> dict[str, Any]:
    """Evaluate in K new local processes; rank 0's result (loss, perplexity, speed)."""
    return launched(evaluate, config, inputs.check(config, processes=config.world_size))


def load_pipe(config: TrainConfig) -> tuple[Mesh, Pipe]:
    """This rank's mesh (its share of the cores) and stage of the model, with the
    checkpoint's weights (``config.resume``) or the model folder's."""
    c = config
    torch.set_num_threads(c.threads or threads_per_process(c.world_size))
    mesh = Mesh.build(c.stages, c.replicas, timeout=c.timeout)
    balance = c.balance or c.layout.default_balance(num_layers(model_spec(c)))
    pipe = build_pipe(c, mesh, balance, inference_only=True)  # one capture, not two
    if c.resume:
        manifest = ckpt.read_manifest(c.resume)
        pipe.load_state_dict(ckpt.load(manifest, model=list(pipe.state_dict())).model)
    return mesh, pipe


def evaluate(rank: int, config: TrainConfig, prepared: Any = None) -> dict[str, Any]:
    """Rank ``rank``'s part: its stage of the model, every window of the validation data."""
    c = config
    mesh, pipe = load_pipe(c)
    data = c.task.data(batch=c.batch, eval_batches=1, prepared=prepared, chunks=c.chunks)
    autocast = autocast_of(c.dtype)
    mesh.everyone.barrier("the barrier before evaluating", doing="evaluating")
    tick = time.perf_counter()
    indices = torch.arange(len(data.val))
    result = validate(pipe, c, mesh, data.val, indices, replica=0, autocast=autocast)
    seconds = time.perf_counter() - tick
    unit = c.task.unit
    return {
        "loss": result["val_loss"],
        **{k[4:]: v for k, v in result.items() if k in ("val_perplexity", "val_accuracy")},
        "targets": int(result["val_targets"]),
        "samples": len(indices),
        "seconds": seconds,
        f"{unit}_per_s": len(indices) * c.task.samples() / seconds,
        "checkpoint": c.resume,
    }
