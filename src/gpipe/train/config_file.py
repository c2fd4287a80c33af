"""``gpipe train --config FILE``: a run's options as a TOML file, read with the standard
library's ``tomllib`` and written here by hand (the options are flat: strings, numbers,
booleans and one list of ints, so no TOML writer is needed)::

    model = "gpt"
    size = "tiny"
    stages = 2
    balance = [1, 1]
    lr = 0.003

A key is the name of a :class:`~gpipe.train.config.TrainConfig` field, which is the option's
flag without its dashes (``virtual_stages`` for ``--virtual-stages``); flags on the command
line override the file. Every run writes its options as ``config.toml`` in its folder
(:func:`write`): given back with ``--config`` (and a new ``--out``), it trains the same run
again.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpipe.base.files import write_file
from gpipe.train.config import ConfigError, TrainConfig, option_kinds
from gpipe.train.run_folder import OPTIONS
from gpipe.train.tasks import RECIPES, recipe_of
from gpipe.train.tokenizers import BYTES

__all__ = ["FILE", "merge", "read", "write", "write_options"]

FILE = OPTIONS
# Not written: a run again goes to a new folder, from its start (pass them as flags).
_PER_RUN = ("out", "resume")
_INTS = "a list of integers"


def read(path: str | Path) -> dict[str, Any]:
    """The options in TOML file ``path``, by field name; raises :class:`ConfigError`
    naming every unknown key and every value of the wrong type."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text())
    except OSError as error:
        raise ConfigError([f"--config {path}: {error.strerror}; give a TOML file"]) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ConfigError([f"--config {path}: not TOML ({error}); fix the file"]) from None
    kinds = option_kinds()
    problems = []
    for key, value in values.items():
        if key not in kinds:
            problems.append(_unknown(path, key, kinds))
            continue
        wanted = _wanted(kinds[key], value)
        if wanted:
            problems.append(
                f"--config {path}: {key} = {_toml(value)} is {_kind_of(value)}; give "
                f"{wanted}, e.g. {key} = {_example(kinds[key], key)}"
            )
    if problems:
        raise ConfigError(problems)
    return {k: float(v) if kinds[k] is float else v for k, v in values.items()}


def merge(path: str | Path | None, given: dict[str, Any]) -> dict[str, Any]:
    """The options of file ``path`` (if any) overridden by ``given`` (None: not given)."""
    chosen = {k: v for k, v in given.items() if v is not None}
    return {**read(path), **chosen} if path else chosen


def write(path: str | Path, config: TrainConfig) -> None:
    """Write ``config``'s options as TOML: its preset's and those off their default, but
    --out and --resume (a value a model cannot take, like --seq for a CNN, stays out)."""
    values, defaults = asdict(config), asdict(TrainConfig())
    preset = set(recipe_of(config.model).preset(config.size))
    chosen = {
        name: values[name]
        for name in option_kinds()
        if name not in _PER_RUN and (values[name] != defaults[name] or name in preset)
    }
    if config.model in RECIPES and chosen.get("tokenizer") == BYTES:
        del chosen["tokenizer"]  # what "auto" gives a built-in model, and no option of a CNN's
    header = (
        "gpipe train --config THIS: this run's options, again from its start (give --out;\n"
        "--resume a checkpoint to continue it). Flags on the command line override these."
    )
    write_options(path, chosen, header=header)


def write_options(path: str | Path, options: dict[str, Any], *, header: str = "") -> None:
    """Write ``options`` (by field name; None: left out) as a TOML file for ``--config``,
    after the comment ``header``."""
    unknown = sorted(set(options) - set(option_kinds()))
    if unknown:
        raise ValueError(f"{unknown} are not options of gpipe train; give field names")
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{k} = {_toml(v)}" for k, v in options.items() if v is not None]
    text = ("\n".join(lines) + "\n").encode()
    write_file(Path(path), lambda file: file.write(text))  # whole, never through a link


def _wanted(kind: Any, value: Any) -> str | None:
    """What ``value`` should have been, or None if it is of ``kind``."""
    if kind is bool:
        return None if isinstance(value, bool) else "true or false"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if kind is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number else "a number"
    if kind is list:
        ints = isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        )
        return None if ints else _INTS
    return None if isinstance(value, str) else "a string (in quotes)"


def _example(kind: Any, key: str) -> str:
    default = getattr(TrainConfig, key, None)
    if kind is list:
        return "[3, 3]"
    if default is None or isinstance(default, list):
        return {int: "2", float: "0.5", bool: "true"}.get(kind, '"..."')
    return _toml(default)


def _unknown(path: Path, key: str, kinds: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), kinds, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (
        f"--config {path}: unknown key {key!r}: {hint}the keys are gpipe train's options "
        "with _ for - (see gpipe train --help); remove it or correct its name"
    )


def _kind_of(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "a list", dict: "a table"})
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def _toml(value: Any) -> str:
    """``value`` (str, int, float, bool or a list of them) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # Python's repr of a float (1e-05, inf, nan) is TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{...}"  # only in error messages: the options hold no tables
    # A JSON string is a TOML basic string, but for DEL, which TOML wants escaped.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
