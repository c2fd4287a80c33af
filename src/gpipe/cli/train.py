"""Train a model through a pipeline of K processes: the main job, with no download.

    gpipe train                                   # GPT 'small' on the stdlib's source, K=2
    gpipe train --size tiny --steps 40            # a few seconds
    gpipe train --model resnet                    # ResNet-style CNN (batch norm) on digits
    gpipe train --model hf-llama                  # a Hugging Face Llama, as it is (gpipe[hf])
    gpipe train --stages 3 --chunks 8 --schedule 1f1b --dtype bfloat16
    gpipe train --stages 2 --replicas 2           # 2 replicas x 2 stages = 4 processes
    gpipe train --stages 2 --replicas 2 --shard all  # the same, each stage sharded over its 2
    gpipe train --resume runs/gpt-small-...       # continue from the newest checkpoint
    torchrun --nproc-per-node 2 --max-restarts 3 -m gpipe train --out runs/a --resume auto
                                                  # a restarted job continues by itself
    gpipe train --config run.toml --steps 100     # options from a TOML file, flags win
    gpipe train --compile                         # each stage's layers through torch.compile
    torchrun --nproc-per-node 2 -m gpipe train    # the same, launched by torchrun

Your model and your data (docs/your-model.md):

    gpipe train --model ./my-qwen --data train.jsonl       # fine-tune its weights
    gpipe train --model ./config.json --data book.txt      # from scratch, the config's size
    gpipe train --model ./my-qwen --init random --model-config num_hidden_layers=4
    gpipe train --model ./my-bart --data pairs.jsonl --text-field source --packing pad
    gpipe train --model gpt --data notes/                  # the built-in GPT on your files
    gpipe export runs/my-qwen-small-...                    # -> a save_pretrained folder

The language model (``--model gpt``) is a byte-level GPT trained on the Python standard
library's own ``.py`` files (``gpipe.train.data``); ``--model resnet`` trains a small ResNet with
deferred batch norm on scikit-learn's digits (``pip install 'gpipe[digits]'``);
``--model hf-llama`` trains a random byte-level Hugging Face ``LlamaForCausalLM`` on the same
text, captured and cut between its decoder layers by ``Pipe.from_model`` (``gpipe[hf]``).
``--model DIR`` takes any causal LM, masked LM or sequence-to-sequence model that
transformers builds from the folder's ``config.json``, its tokenizer, and its weights
(``gpipe[hf]``; a ``--data`` folder saved by ``datasets`` needs ``gpipe[datasets]``).

The command spawns K x R local processes (``gpipe.launch``), or, when ``RANK`` and
``WORLD_SIZE`` are set (``torchrun``), runs as one of them; the job itself is the library
``gpipe.train``. Every rank builds only its own stage; rank 0 alone prints. The output
folder receives ``metrics.jsonl`` (one record per step), TensorBoard's event files
(``tensorboard --logdir runs``), ``loss.png``, ``timeline.png``/``timeline.json`` (the
measured last step), ``sample.txt`` (text the language model wrote through the pipeline),
``summary.json`` and ``checkpoints/step-NNNNNN/`` (a DCP checkpoint, see
``gpipe.train.checkpoint``).
Resuming reproduces the uninterrupted run exactly (see ``gpipe.train.trainer``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, fields
from typing import Any

from gpipe.parallel.mesh import WorldError, job_environment
from gpipe.train import (
    ConfigError,
    TrainConfig,
    TrainingError,
    config_file,
    resolve,
    run_under_torchrun,
)
from gpipe.train import run as run_job
from gpipe.train.checkpoint import CheckpointError, holds, read_manifest
from gpipe.train.checkpoint_integrity import choose
from gpipe.train.config import flag, option, option_kinds, preset_fields

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--config", metavar="FILE",
        help="a TOML file of options, keyed by the names below with _ for - (virtual_stages = "
        "2); flags here override it. Each run writes its own as config.toml (see "
        "gpipe.train.config_file); gpipe plan --write-config writes one",
    )  # fmt: skip
    groups = add_config_options(parser)
    groups["checkpoints and resuming"].add_argument(
        "--strict-resume", action="store_true",
        help="stop if the newest checkpoint is damaged (default: resume from the newest intact)",
    )  # fmt: skip


def add_config_options(parser: argparse.ArgumentParser, of: type = TrainConfig) -> dict[str, Any]:
    """One option per field of :class:`TrainConfig` (or of the config dataclass ``of``: gpipe
    eval's, generate's), as its :class:`~gpipe.train.config.Option` describes it, under its
    group's heading; returns the groups by heading.

    Every option defaults to None, "not given", so that presets and, on --resume, the
    checkpoint's configuration fill it in; --help shows the default of the field.
    """
    groups: dict[str, Any] = {}
    kinds = option_kinds(of)
    presets = preset_fields() if of is TrainConfig else set()
    for f in fields(of):
        how = option(f)
        if how is None:
            continue
        group = groups.get(how.group) or groups.setdefault(
            how.group, parser.add_argument_group(how.group)
        )
        default = how.default_text or ("preset" if f.name in presets else _shown(f.default))
        details: dict[str, Any] = dict(
            dest=f.name, help=f"{how.help} (default: {default})" if default else how.help
        )
        kind = kinds[f.name]
        if kind is bool:
            details["action"] = argparse.BooleanOptionalAction
        else:  # a list, like --balance 3,3, is read as text by gpipe.train.resolve
            kind = kind if kind in (int, float) else str
            details.update(type=kind, choices=how.choices, metavar=how.metavar)
        group.add_argument(*how.flags, flag(f.name), default=None, **details)
    return groups


def config_of(args: argparse.Namespace, of: type) -> Any:
    """The config dataclass ``of`` from ``args``: the options given; the rest its defaults."""
    names = of.__dataclass_fields__
    return of(**{k: v for k, v in vars(args).items() if k in names and v is not None})


def _shown(default: Any) -> str:
    """A field's default as --help says it ("" for none)."""
    if default is MISSING or default is None:
        return ""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    if isinstance(default, str) and default != default.strip():
        return repr(default)
    return str(default)


def _resume_auto(out: str | None) -> str | None:
    """``--resume auto``: ``out``, when it holds a complete checkpoint (the newest intact
    one is resumed, as with ``--resume OUT``), else None: a fresh start."""
    if not out:
        raise ConfigError(["--resume auto continues the run in --out: give --out"])
    return out if holds(out) else None


# RANK and WORLD_SIZE make gpipe train one process of a job started elsewhere.
_OR_ALONE = " (or unset RANK and WORLD_SIZE: gpipe train then starts its processes itself)"


def run(args: argparse.Namespace) -> int:
    """Bad input raises :class:`ConfigError` (one line by ``gpipe.__main__``) before anything
    starts; under torchrun rank 0 says it, or every process where each may differ."""
    try:
        return _run(args)
    except WorldError as error:  # each process says it: its own environment, or peers missing
        raise ConfigError([f"{error}{_OR_ALONE}"]) from None


def _run(args: argparse.Namespace) -> int:
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size, speaks = None, True
    if torchrun:  # checked before anything waits for the other processes
        rank, world_size, _, _ = job_environment()
        speaks = rank == 0
    try:
        config = _config(args, world_size=world_size, speaks=speaks)
        if config is None:  # --resume auto of a run already complete
            return 0
        if torchrun:
            run_under_torchrun(config)
            return 0
        return _launched(config)
    except ConfigError:
        if speaks:
            raise
        return 2


def _config(
    args: argparse.Namespace, *, world_size: int | None, speaks: bool
) -> TrainConfig | None:
    """The run's configuration; None where ``--resume auto`` finds the run complete."""
    options = config_file.merge(args.config, vars(args))
    resume = auto = options.get("resume")
    if resume == "auto":  # a job started again (torchrun --max-restarts) continues
        resume = _resume_auto(options.get("out"))
        options = {**options, "resume": resume}
    if resume:
        try:
            folder, notes = choose(resume, strict=args.strict_resume)
        except CheckpointError as error:
            raise ConfigError([f"--resume {resume}: {error}"]) from None
        options = {**options, "resume": str(folder)}
        for note in notes if speaks else []:
            print(f"gpipe train: warning: {note}", file=sys.stderr)
        if auto == "auto" and (done := _complete(folder, options.get("steps"))):
            # A process that died after the last checkpoint of a finished run makes torchrun
            # start the job again: that is success, not "nothing to train" (exit 2).
            if speaks:
                print(f"gpipe train: {options['out']} is complete ({done}): nothing left to train")
            return None
    return resolve(options, world_size=world_size)


def _complete(folder: Any, steps: int | None) -> str | None:
    """How the checkpoint in ``folder`` ends its run, where it has reached ``steps`` (given,
    else the run's own); None while steps are left, or where the run's steps are unknown."""
    manifest = read_manifest(folder)
    steps = steps or (manifest.config or {}).get("steps")
    if steps is None or manifest.step < steps:
        return None
    return f"its checkpoint is at step {manifest.step} of --steps {steps}"


def _launched(config: TrainConfig) -> int:
    """Train in processes started here; a failed rank's cause in a few lines (exit 1)."""
    try:
        run_job(config)
    except TrainingError as error:
        if error.signal_exit is not None:
            print("gpipe train: stopped by a signal", file=sys.stderr)
            return error.signal_exit
        print(f"gpipe train: {error}", file=sys.stderr)
        if len(error.failures) > 1:
            print(f"  ({len(error.failures) - 1} other rank(s) stopped with it)", file=sys.stderr)
        if os.environ.get("GPIPE_DEBUG"):
            print(error.failures[error.rank], file=sys.stderr)
        else:
            print("  set GPIPE_DEBUG=1 for the traceback", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpipe train: interrupted", file=sys.stderr)
        return 130
    return 0
