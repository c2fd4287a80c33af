"""How a run's options become its :class:`~gpipe.train.config.TrainConfig`: :func:`resolve`
takes the options a user gave, the checkpoint being resumed and the task's presets, and lists
every problem at once (:class:`~gpipe.train.config.ConfigError`) before any process starts."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import gpipe.train.checkpoint as ckpt
import gpipe.train.lora as lora
import gpipe.train.memory_checks as memory_checks
import gpipe.train.reporters as reporters
import gpipe.train.run_folder as run_folder
from gpipe.layout import FLAGS, Layout
from gpipe.train.config import ConfigError, TrainConfig, flag, model_spec, num_layers, option
from gpipe.train.hf import (
    FAMILIES,
    HFModel,
    families_of,
    family_of,
    has_weights,
    parse_overrides,
    read_config,
    transformers_module,
)
from gpipe.train.optimizers import problems as optimizer_problems
from gpipe.train.tasks import HF_FOLDER, RECIPES, recipe_of, sized_rates, tokenizer_of
from gpipe.train.tokenizers import BYTES

__all__ = ["resolve"]

# What a checkpoint's weights and data position depend on: these cannot change on resume.
_FIXED_ON_RESUME = (
    "model", "size", "seq", "seed", "model_config", "family", "split", "tokenizer", "data",
    "text_field", "target_field", "val_data", "val_fraction", "packing", "mask_prob", "lora",
)  # fmt: skip
# The optimizer and the schedule a checkpoint's state follows; --steps alone may change (it
# moves the horizon).
_OPTIMIZER_ON_RESUME = (
    "optimizer", "lr", "lr_schedule", "warmup", "weight_decay", "beta1", "beta2", "eps",
    "momentum", "freeze",
)  # fmt: skip
_PATHS = ("model", "data", "val_data", "tokenizer")  # made absolute: a run resumes anywhere
_NAMES = {f.name for f in fields(TrainConfig)}
_LAYOUT = {f.name for f in fields(Layout)}  # checked by Layout.problems


def resolve(options: dict[str, Any], *, world_size: int | None = None) -> TrainConfig:
    """The run's configuration: the given ``options`` (a field of :class:`TrainConfig` each,
    None meaning not given), else the checkpoint's (on ``resume``), else the task's preset,
    else :class:`TrainConfig`'s. Raises :class:`ConfigError` listing every problem.
    ``world_size`` is torchrun's, when running under it.
    """
    problems: list[str] = []
    given = _given(options, problems)
    manifest = None
    if given.get("resume"):
        manifest = _manifest(given["resume"])
        values = _resumed(manifest, given, problems)
    else:
        chosen, found = _model(given)
        problems += found
        values = {**chosen.pop("preset"), **given, **chosen, "model": given.get("model", "gpt")}
    problems += _data_problems(values, given)
    # Asked for by name, TensorBoard must be there; by default a run without it says so and
    # goes on (gpipe.train.reporters).
    problems += reporters.problems(values.get("report_to", ""), given="report_to" in given)
    default_layout = Layout(schedule=values.get("schedule", "gpipe"))
    values.setdefault("virtual_stages", default_layout.virtual_stages)
    if world_size is not None and "stages" not in given:
        values["stages"] = max(1, world_size // values.get("replicas", 1))
    config = TrainConfig(**{k: v for k, v in values.items() if k in _NAMES})
    if not config.out:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        config.out = str(Path("runs") / f"{config.model_name}-{config.size}-{stamp}")
    if not problems:
        try:
            problems += config.task.problems()
        except (ValueError, OSError) as error:  # e.g. a tokenizer folder that holds none
            problems.append(f"{type(error).__name__}: {error}")
    start = manifest.step if manifest else 0
    problems += _problems(config, start, world_size, fresh=manifest is None)
    if problems:
        raise ConfigError(problems)
    return config


def _given(options: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The options given (None: not given), a balance's text read, paths made absolute."""
    given = {k: v for k, v in options.items() if k in _NAMES and v is not None}
    if isinstance(given.get("balance"), str):
        try:
            given["balance"] = [int(b) for b in given["balance"].split(",")]
        except ValueError:
            problems.append(f"--balance must be comma-separated ints, got {given['balance']!r}")
            del given["balance"]
    for key in _PATHS:  # paths as the ranks and a resumed run see them, wherever they start
        value = given.get(key)
        if value not in (None, *RECIPES, "auto", BYTES) and Path(value).expanduser().exists():
            given[key] = str(Path(value).expanduser().resolve())
    return given


def _manifest(resume: str) -> ckpt.Manifest:
    """The manifest of the checkpoint ``--resume`` names, written by gpipe train."""
    try:
        manifest = ckpt.read_manifest(resume)
    except ckpt.CheckpointError as error:
        raise ConfigError([f"--resume {resume}: {error}"]) from None
    if manifest.config is None:  # not written by gpipe train
        raise ConfigError([
            f"--resume {resume}: {manifest.path} holds no run configuration (it was written "
            "by gpipe.train.checkpoint directly, not by gpipe train): load its weights with "
            "gpipe.train.checkpoint.load_tensors instead"
        ])  # fmt: skip
    return manifest


def _resumed(manifest: ckpt.Manifest, given: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """A resumed run's options: the checkpoint's, but what ``given`` may change."""
    saved = dict(manifest.config)
    if isinstance(saved.get("shard"), bool):  # saved before --shard named its mode
        saved["shard"] = "all" if saved["shard"] else None
    for key in _FIXED_ON_RESUME:
        if key in given and given[key] != saved.get(key):  # .get: a key newer than it
            problems.append(
                f"--{key} {given[key]} differs from the checkpoint's {saved.get(key)!r}: a "
                f"resumed run keeps the model, data and seed; drop --{key}"
            )
            # The rest is checked with the checkpoint's: another model with this
            # checkpoint's model arguments would fail on them instead of saying this.
            del given[key]
    for key in _OPTIMIZER_ON_RESUME:
        was = saved.get(key, getattr(TrainConfig, key))  # a checkpoint older than the key
        if key in given and given[key] != was:
            problems.append(
                f"{flag(key)} {given[key]} differs from the checkpoint's {was!r}: a resumed "
                f"run continues its optimizer and learning-rate schedule (--steps may "
                f"change); drop {flag(key)}"
            )
    if "out" not in given and (run := run_folder.run_of(manifest.path)):
        given["out"] = str(run)
    return {**saved, **given, "resume": str(manifest.path)}


def _model(given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The model of a new run: its preset, arguments, initial weights and tokenizer."""
    model = given.get("model", TrainConfig.model)
    problems: list[str] = []
    try:
        overrides = parse_overrides(given.get("model_config"))
    except ValueError as error:
        problems.append(str(error))
        overrides = {}
    if recipe_of(model) is not HF_FOLDER:
        return _builtin_model(given, model, overrides, problems)
    return _folder_model(given, model, overrides, problems)


def _builtin_model(
    given: dict[str, Any], model: str, overrides: dict[str, Any], problems: list[str]
) -> tuple[dict[str, Any], list[str]]:
    recipe = recipe_of(model)
    preset = recipe.preset(given.get("size", TrainConfig.size))
    model_args = {k: preset.pop(k) for k in recipe.model_keys}
    unknown = sorted(set(overrides) - set(model_args))
    if unknown:
        problems.append(
            f"--model-config {', '.join(unknown)}: not a field of --model {model}; its "
            f"fields: {', '.join(model_args)}"
        )
    model_args.update((k, v) for k, v in overrides.items() if k in model_args)
    family = recipe.model(model_args, 1, 256).family if recipe.name != "hf-llama" else None
    if given.get("init", "auto") == "pretrained":
        problems.append(
            f"--init pretrained: --model {model} starts from random weights; name a Hugging "
            "Face folder that holds weights to fine-tune it"
        )
    for name in ("family", "split", "lora"):
        if name in given and (name, given[name]) != ("family", family):
            problems.append(f"{flag(name)} applies to a Hugging Face folder (--model DIR)")
    problems += _needs(recipe.name)
    tokenizer = given.get("tokenizer", "auto")
    chosen = {"model_args": model_args, "init": "random",
              "tokenizer": BYTES if tokenizer == "auto" else tokenizer}  # fmt: skip
    return {"preset": preset, **chosen}, problems


def _folder_model(
    given: dict[str, Any], model: str, overrides: dict[str, Any], problems: list[str]
) -> tuple[dict[str, Any], list[str]]:
    if not Path(model).exists():
        raise ConfigError([
            f"--model {model}: not a built-in model ({', '.join(RECIPES)}), nor a folder or a "
            "config.json of a Hugging Face model"
        ])  # fmt: skip
    try:
        transformers_module()
    except ImportError as error:
        raise ConfigError([f"--model {model}: {error}"]) from None
    weights, init = has_weights(model), given.get("init", "auto")
    if init == "auto":
        init = "pretrained" if weights else "random"
    if init == "pretrained" and not weights:
        problems.append(
            f"--init pretrained: {model} holds no model.safetensors (nor its index): save it "
            "with save_pretrained (safetensors), or train from scratch with --init random"
        )
    try:
        config = read_config(model, overrides)
    except ValueError as error:
        raise ConfigError([*problems, str(error)]) from None
    family = _family(given.get("family", "auto"), model, config, problems)
    split = given.get("split")
    model_args = {"config": config, "family": family,
                  "split": [p.strip() for p in split.split(",")] if split else None}  # fmt: skip
    if given.get("lora"):  # part of the model: its checkpoints hold the adapters' names
        try:
            model_args["lora"] = lora.parse(given["lora"])
        except ValueError as error:
            problems.append(str(error))
        if importlib.util.find_spec("peft") is None:
            problems.append("--lora needs peft: pip install 'gpipe[lora]'")
    tokenizer = given.get("tokenizer", "auto")
    size = given.get("size", TrainConfig.size)
    chosen = {
        "preset": _sized(HF_FOLDER.preset(size), model_args, pretrained=init == "pretrained"),
        "model_args": model_args, "init": init,
        "tokenizer": tokenizer_of(model) if tokenizer == "auto" else tokenizer,
    }  # fmt: skip
    return chosen, problems


def _family(family: str, model: str, config: dict[str, Any], problems: list[str]) -> str | None:
    """What a Hugging Face model learns: ``--family``, else by its configuration."""
    known = families_of(config["model_type"])
    if family != "auto" and family not in known:
        problems.append(
            f"--family {family}: transformers builds model type {config['model_type']} as "
            f"{', '.join(known) or 'none of ' + ', '.join(FAMILIES)}"
        )
    if family != "auto":
        return family
    found = family_of(config)
    if found is None:
        problems.append(
            f"--model {model}: {config.get('architectures') or config['model_type']} is not "
            f"a causal LM, masked LM or sequence-to-sequence model that transformers "
            f"knows; name its family with --family {{{','.join(FAMILIES)}}}"
        )
    return found


def _sized(preset: dict[str, Any], model_args: dict[str, Any], **how: Any) -> dict[str, Any]:
    try:
        return {**preset, **sized_rates(HFModel(model_args).parameter_count(), preset, **how)}
    except (ValueError, OSError, ImportError):  # a model transformers cannot build: said later
        return preset


def _needs(recipe: str) -> list[str]:
    """The optional libraries a built-in model needs, where missing."""
    library, extra = {"resnet": ("sklearn", "digits"), "hf-llama": ("transformers", "hf")}.get(
        recipe, (None, None)
    )
    if library is None:
        return []
    try:
        __import__(library)
    except ImportError:
        return [f"--model {recipe} needs {library}: pip install 'gpipe[{extra}]'"]
    return []


def _data_problems(values: dict[str, Any], given: dict[str, Any]) -> list[str]:
    problems = []
    if recipe_of(values["model"]).data == "digits":
        for name in ("seq", "data", "val_data", "tokenizer", "packing"):
            if name in given:
                problems.append(f"{flag(name)} applies to language models, not --model resnet")
    for name in ("data", "val_data"):
        if values.get(name) and not Path(values[name]).exists():
            problems.append(f"{flag(name)} {values[name]}: no such file or folder")
    if not 0 < values.get("val_fraction", TrainConfig.val_fraction) < 1:
        problems.append(f"--val-fraction must be in (0, 1), got {values['val_fraction']}")
    if not 0 < values.get("mask_prob", TrainConfig.mask_prob) < 1:
        problems.append(f"--mask-prob must be in (0, 1), got {values['mask_prob']}")
    tokenizer = values.get("tokenizer")
    if tokenizer not in (None, "auto", BYTES) and not Path(tokenizer).is_dir():
        problems.append(f"--tokenizer {tokenizer}: give bytes, or a folder holding a tokenizer")
    return problems


def _problems(c: TrainConfig, start: int, world_size: int | None, *, fresh: bool) -> list[str]:
    problems = _option_problems(c)
    layers = None
    if not problems:
        try:
            layers = num_layers(model_spec(c))
        except (ValueError, OSError) as error:  # a model its configuration cannot build
            problems.append(f"--model {c.model}: {error}")
    batch = c.batch if c.batch >= 1 else None
    problems += c.layout.problems(layers=layers, balance=c.balance, batch=batch, spelling=FLAGS)
    if problems:
        return problems  # the checks below assume sane numbers

    if start >= c.steps:
        problems.append(
            f"the checkpoint is at step {start} and --steps is {c.steps}: nothing to train; "
            f"pass --steps > {start}"
        )
    if world_size is not None and world_size != c.world_size:
        problems.append(
            f"torchrun started {world_size} processes but --stages {c.stages} x --replicas "
            f"{c.replicas} needs {c.world_size}"
        )
    problems += memory_checks.problems(c, spawns=world_size is None)
    checkpoints = Path(c.out) / run_folder.CHECKPOINTS
    if fresh and checkpoints.is_dir() and ckpt.holds(checkpoints):
        problems.append(
            f"--out {c.out} already holds a run's checkpoints: continue it with "
            f"--resume {c.out}, or choose another --out"
        )
    return problems


def _option_problems(c: TrainConfig) -> list[str]:
    """The options' own ranges and choices (the layout's are :meth:`Layout.problems`')."""
    problems = []
    for name in ("batch", "steps", "seq"):
        if getattr(c, name) < 1:
            problems.append(f"--{name} must be >= 1, got {getattr(c, name)}")
    for name in ("warmup", "save_every", "eval_every", "keep", "sample_tokens", "threads",
                 "skip_nonfinite"):  # fmt: skip
        if getattr(c, name) < 0:
            problems.append(f"{flag(name)} must be >= 0, got {getattr(c, name)}")
    for f in fields(TrainConfig):  # argparse checks a flag's choices, not a file's values
        how, value = option(f), getattr(c, f.name)
        if how and how.choices and f.name not in _LAYOUT and value not in how.choices:
            problems.append(f"{flag(f.name)} {value!r}: choose one of {', '.join(how.choices)}")
    if c.lr <= 0 or c.grad_clip < 0 or c.weight_decay < 0 or c.temperature <= 0:
        problems.append("--lr and --temperature must be > 0, --grad-clip and --weight-decay >= 0")
    problems += optimizer_problems(c, TrainConfig())
    if c.eval_batches < 1 or c.log_every < 1 or not 0 < c.timeout < 1e9:
        problems.append("--eval-batches, --log-every and --timeout must be positive (finite)")
    out = Path(c.out)
    if out.exists() and not out.is_dir():
        problems.append(f"--out {c.out} is a file: give a folder for the run's outputs")
    else:
        existing = next(p for p in (out, *out.parents) if p.exists())
        if not _writable(existing):
            problems.append(f"--out {c.out}: {existing} is not writable; choose another --out")
    return problems


def _writable(folder: Path) -> bool:
    """Whether a folder can be made in ``folder``: tried, since ``os.access`` says yes to
    root everywhere, even on a read-only file system (/proc, a read-only mount)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        probe = tempfile.mkdtemp(prefix=".gpipe-probe-", dir=folder)
    except OSError:
        return False
    os.rmdir(probe)
    return True
