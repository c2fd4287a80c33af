"""``gpipe plan``'s options, one field each (the command line is generated from them by
``gpipe.cli.train.add_config_options``, as ``gpipe train``'s are from ``TrainConfig``).

A field ``gpipe train`` also has keeps its name, meaning and choices there (``--model``,
``--size``, ``--model-config``, ``--seq``, ``--batch``, ``--optimizer``, ``--momentum``,
``--threads``, ``--seed``). What the plan searches over is a range, named ``--search-*``
(``--search-stages 1,2,4``), where ``gpipe train`` takes one value (``--stages 2``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace
from typing import Any

from gpipe.base.remat import REMAT_MODES
from gpipe.schedule import SCHEDULES
from gpipe.train import ConfigError, TrainConfig
from gpipe.train.config import _option, option

__all__ = ["PlanConfig", "optimizer_state", "parse_bytes", "resolve_plan"]

_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_MODEL, _RESOURCES, _SEARCH = "model (as gpipe train's)", "resources", "search"
_TIMING, _MEASURING = "timing model", "profiling and verifying"
_CAPACITY = "--capacity: the largest model of a family that fits --memory per process"
_FAMILY = "--capacity's families (gpt, resnet), by depth"


def _train_option(name: str, group: str = _MODEL, **how: Any) -> Any:
    """``gpipe train``'s option ``name``: its default, help and choices."""
    f = TrainConfig.__dataclass_fields__[name]
    of = option(f)
    return _option(f.default, of.help, group, choices=of.choices, metavar=of.metavar, **how)


_PRESET = "gpipe train's preset; --capacity: {}"


@dataclass
class PlanConfig:
    """What ``gpipe plan`` plans: the model, its resources, the ranges searched, and how
    profiles are taken. Sizes are text as given (``2GiB``) and lists comma-separated text
    until :func:`resolve_plan` reads them (bytes, lists)."""

    model: str = _train_option("model")
    size: str = _train_option("size")
    model_config: str | None = _train_option("model_config", default_text="the preset's")
    seq: int | None = _option(
        None, "tokens per sample, language models only", _MODEL, default_text=_PRESET.format(64)
    )
    batch: int | None = _option(
        None, "global mini-batch size, all replicas together", _MODEL,
        default_text=_PRESET.format(16),
    )  # fmt: skip
    optimizer: str = _train_option("optimizer")
    momentum: float = _train_option("momentum")
    processes: int = _option(2, "processes (devices) available: K x R of them at most", _RESOURCES)
    memory: str | float | None = _option(
        None, "bytes per process, e.g. 2GiB; --capacity: each process's whole peak (Python, "
        "torch and the process group included, see --baseline-memory); otherwise: the "
        "model's terms alone (parameters, optimizer state, activations)", _RESOURCES,
        metavar="SIZE", default_text="no limit; --capacity needs it",
    )  # fmt: skip
    threads: int = _train_option("threads", _RESOURCES)
    search_stages: list[int] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, "K: stage counts to try, e.g. 1,2,4", _SEARCH, metavar="K,...",
        default_text="every K up to --processes",
    )  # fmt: skip
    search_replicas: list[int] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, "--capacity: R, replica counts to try", _SEARCH, metavar="R,...",
        default_text="every R dividing the batch",
    )  # fmt: skip
    search_shard: str = _option(
        "both", "--capacity: replicas with and without --shard, or only on or off", _SEARCH,
        choices=("both", "on", "off"),
    )  # fmt: skip
    search_chunks: list[int] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, "M: micro-batch counts to try", _SEARCH, metavar="M,...",
        default_text="powers of two up to the batch",
    )  # fmt: skip
    search_schedules: list[str] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, f"schedules to try, of {', '.join(SCHEDULES)}", _SEARCH, metavar="NAME,...",
        default_text="all but zb-auto",
    )  # fmt: skip
    search_checkpoints: list[str] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, f"re-materialization modes to try, of {', '.join(REMAT_MODES)}", _SEARCH,
        metavar="MODE,...", default_text="all",
    )  # fmt: skip
    search_checkpoint_layers: list[str] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, "--capacity: layers a re-materialized micro-batch recomputes at a time (as "
        "--checkpoint-layers), or stage (all of it)", _SEARCH, metavar="N|stage,...",
        default_text="stage,1,2,4",
    )  # fmt: skip
    search_virtual_stages: list[int] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, "stages per process to try (as --virtual-stages)", _SEARCH, metavar="V,...",
        default_text="1,2",
    )  # fmt: skip
    latency: float = _option(100e-6, "seconds per transfer between processes", _TIMING)
    bandwidth: str | float = _option(
        "2GB", "bytes per second between processes", _TIMING, metavar="SIZE"
    )
    measure_link: bool = _option(
        False, "measure --latency and --bandwidth between two local processes instead", _TIMING
    )
    action_seconds: float = _option(100e-6, "the runtime's seconds per action", _TIMING)
    calibrate: bool = _option(
        False, "measure this machine first: the time per action and per step, the link and "
        "the compute slowdown of K processes at once (--capacity always calibrates its "
        "memory unless --process-memory is given)", _TIMING,
    )  # fmt: skip
    device: str = _option("cpu", "where to profile", _MEASURING)
    profile_repeats: int = _option(5, "timed runs per layer (their median)", _MEASURING)
    profile_warmup: int = _option(2, "untimed runs per layer before them", _MEASURING)
    top: int = _option(10, "rows to print", _MEASURING)
    verify: int = _option(0, "train the top N for real and print what they measure", _MEASURING,
                          metavar="N")  # fmt: skip
    verify_steps: int = _option(10, "timed steps per verified run", _MEASURING)
    seed: int = _train_option("seed", _MEASURING)
    write_config: str | None = _option(
        None, "write the first choice as gpipe train's options (TOML): gpipe train --config "
        "FILE trains the planned model, data shape and layout", _MEASURING, metavar="FILE",
        default_text="none",
    )  # fmt: skip
    capacity: bool = _option(False, "search depth x layout of --model's family instead", _CAPACITY)
    baseline_memory: str | float | None = _option(
        None, "what a training process holds before its model, part of --memory", _CAPACITY,
        metavar="SIZE", default_text="calibrated; with --process-memory: this process's",
    )  # fmt: skip
    process_memory: str | float | None = _option(
        None, "the fixed cost of a training process beyond its baseline and the model's terms "
        "(calibrated's 'MiB per process'); given, nothing is calibrated", _CAPACITY,
        metavar="SIZE", default_text="calibrated",
    )  # fmt: skip
    model_layer_memory: str | float = _option(
        "0", "per layer of the whole model, in every process (calibrated's 'per layer of the "
        "model'; with --process-memory)", _CAPACITY, metavar="SIZE",
    )  # fmt: skip
    stage_layer_memory: str | float = _option(
        "0", "per layer of a process's own stage (calibrated's 'per layer of its stage'; with "
        "--process-memory)", _CAPACITY, metavar="SIZE",
    )  # fmt: skip
    d_model: int = _option(128, "gpt: width", _FAMILY)
    heads: int = _option(4, "gpt: attention heads", _FAMILY)
    vocab: int = _option(4096, "gpt: vocabulary (a large one: a heavy head)", _FAMILY)
    channels: int = _option(32, "resnet: width at full resolution", _FAMILY)
    image: int = _option(32, "resnet: image side in pixels", _FAMILY)


_SIZES = ("memory", "bandwidth", "baseline_memory", "process_memory", "model_layer_memory",
          "stage_layer_memory")  # fmt: skip
_AT_LEAST = {"processes": 1, "seq": 1, "batch": 1, "threads": 0, "top": 1, "verify": 0,
             "verify_steps": 1, "profile_repeats": 1, "profile_warmup": 0, "d_model": 1,
             "heads": 1, "vocab": 1, "channels": 1, "image": 1}  # fmt: skip
_CHOICES = {"search_schedules": tuple(SCHEDULES), "search_checkpoints": REMAT_MODES}


def parse_bytes(text: str | float) -> float:
    """``"2GiB"`` -> 2147483648.0; also ``"500MB"``, ``"1.5gib"``, ``"1e9"`` (bytes)."""
    if isinstance(text, int | float):
        return float(text)
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS or match.group(1).count(".") > 1:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 2GiB, 512MiB, 1.5GB or 1e9")
    return float(match.group(1)) * _UNITS[match.group(2)]


def optimizer_state(config: PlanConfig) -> float:
    """Optimizer state per parameter, in parameter sizes: gpipe train's --optimizer's."""
    if config.optimizer == "sgd":
        return 1.0 if config.momentum else 0.0
    return 2.0  # AdamW and Adam: two moments


def resolve_plan(config: PlanConfig) -> PlanConfig:
    """``config`` with its sizes in bytes and its ranges as lists; raises
    :class:`ConfigError`, one line per bad value, naming the flag and the remedy."""
    problems: list[str] = []
    values: dict[str, Any] = {}
    for f in fields(PlanConfig):
        value, flag = getattr(config, f.name), "--" + f.name.replace("_", "-")
        try:
            values[f.name] = _read(f.name, flag, value)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError(problems)
    return replace(config, **values)


def _read(name: str, flag: str, value: Any) -> Any:
    if value is None:
        return None
    if name in _SIZES:
        try:
            return parse_bytes(value)
        except ValueError as error:
            raise ValueError(f"{flag} {value}: {error}") from None
    if name in _AT_LEAST and value < _AT_LEAST[name]:
        raise ValueError(f"{flag} {value}: give a whole number >= {_AT_LEAST[name]}")
    if not (name.startswith("search_") and name != "search_shard" and isinstance(value, str)):
        return value
    items = [item.strip() for item in value.split(",")]
    if name in _CHOICES:
        wrong = [i for i in items if i not in _CHOICES[name]]
        if wrong:
            raise ValueError(f"{flag} {value}: {wrong[0]!r} is not one of "
                             f"{', '.join(_CHOICES[name])}")  # fmt: skip
        return items
    if name == "search_checkpoint_layers" and "stage" in items:
        return [None, *_counts(flag, value, [i for i in items if i != "stage"])]
    return _counts(flag, value, items)


def _counts(flag: str, value: str, items: list[str]) -> list[int]:
    if not all(i.isdigit() and int(i) >= 1 for i in items):
        raise ValueError(f"{flag} {value}: give whole numbers >= 1, comma-separated, e.g. 1,2,4")
    return [int(i) for i in items]
