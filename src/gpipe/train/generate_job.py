"""``gpipe generate``'s job: a run's checkpoint or a model folder continues a prompt through a
pipeline of K processes, with the model's tokenizer (:mod:`gpipe.train.generation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpipe.train.config import ConfigError, TrainConfig, _option
from gpipe.train.eval_job import launched, load_pipe, resolve_model
from gpipe.train.generation import Sampling, generate
from gpipe.train.precision import autocast_of

__all__ = ["GenerateConfig", "resolve_generate", "run_generate"]

_TEXT, _PIPELINE = "text", "pipeline"


@dataclass
class GenerateConfig:
    """What ``gpipe generate`` writes, and how; each field but ``model`` is an option."""

    model: str = ""  # a run folder, a checkpoint, or a Hugging Face model folder
    prompt: str | None = _option(None, "the text to continue", _TEXT, metavar="TEXT")
    max_tokens: int = _option(32, "new tokens at most (fewer at the end of text)", _TEXT)
    temperature: float = _option(0.0, "sampling temperature; 0: greedy", _TEXT)
    top_k: int = _option(0, "sample among the k likeliest tokens; 0: all", _TEXT)
    top_p: float = _option(1.0, "sample among the likeliest tokens reaching this mass", _TEXT)
    seed: int = _option(0, "the sampling's random seed", _TEXT)
    samples: int = _option(1, "continuations, one micro-batch each", _TEXT)
    seq: int | None = _option(
        None, "the window of tokens the model sees; a run's own is fixed", _TEXT,
        default_text="the run's, or the preset's for a folder",
    )  # fmt: skip
    stages: int = _option(2, "K: pipeline stages, one process each", _PIPELINE, flags=("-K",))
    dtype: str = _option(
        "float32", "weights' dtype, or float32 under bfloat16 or float16 autocast", _PIPELINE,
        choices=("float32", "bfloat16", "float16", "float64"),
    )  # fmt: skip
    timeout: float = _option(120.0, "seconds a rank waits for another", _PIPELINE)

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)


def resolve_generate(g: GenerateConfig) -> TrainConfig:
    """The model's configuration for generating; raises :class:`ConfigError`."""
    problems = g.sampling.problems()
    if g.prompt is None:
        problems.append("--prompt is required: the text to continue")
    if g.max_tokens < 1 or g.samples < 1:
        problems.append("--max-tokens and --samples must be >= 1")
    if problems:
        raise ConfigError(problems)
    pipeline = {"stages": g.stages, "chunks": g.samples, "batch": g.samples, "dtype": g.dtype,
                "timeout": g.timeout}  # fmt: skip
    config = resolve_model(g.model, pipeline, seq=g.seq)
    if not config.task.writes_text:
        raise ConfigError([f"{g.model}: a {config.task.model.family} model does not write text"])
    return config


def run_generate(config: TrainConfig, g: GenerateConfig) -> dict[str, Any]:
    """Generate in K new local processes: the token ids and texts, rank 0's."""
    return launched(_generate, config, g)


def _generate(rank: int, config: TrainConfig, g: GenerateConfig) -> dict[str, Any]:
    c = config
    mesh, pipe = load_pipe(c)
    task = c.task
    prompt = task.encode(g.prompt)
    tokens = generate(pipe, mesh, task, prompt, rows=g.samples, new_tokens=g.max_tokens,
                      window=c.seq, sampling=g.sampling, seed=g.seed,
                      autocast=autocast_of(c.dtype))  # fmt: skip
    rows = [row.tolist() for row in tokens]
    return {"prompt": prompt, "tokens": rows, "texts": [task.decode(r) for r in rows]}
