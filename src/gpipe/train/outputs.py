"""Where gpipe writes, and never over what it did not write: a run's folder (``gpipe train
--out``) and an exported model (``gpipe export -o``).

A folder is a gpipe run when it holds the options gpipe wrote for it (``config.toml``, read
back as options of ``gpipe train``) or a checkpoint; ``--out`` takes such a folder or an empty
one (or makes it), nothing else: a model's folder holds a ``config.json`` too. An export goes
anywhere but into a checkpoint or over a run's own files, and replaces only an export (its
record: the ``.json`` beside the weights, ``gpipe-export.json`` in a ``save_pretrained``
folder), unless forced; every file whole or not at all (``gpipe.base.files.write_file``)::

    problems = run_folder_problems("runs/x")        # [] or one line
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gpipe.train.config_file as config_file
from gpipe.base.files import write_file, write_folder
from gpipe.train.checkpoint import LATEST, MANIFEST
from gpipe.train.run_folder import BEST, BEST_RECORD, CHECKPOINTS, FILES, STEPS, TENSORBOARD

__all__ = [
    "EXPORT_RECORD",
    "OutputError",
    "export_problem",
    "exported_by_gpipe",
    "best_loss",
    "is_run",
    "keep_best",
    "run_folder_problems",
]

EXPORT_RECORD = "gpipe-export.json"  # in an exported save_pretrained folder
_RUN_NAMES = (*FILES, CHECKPOINTS, BEST, BEST_RECORD)


class OutputError(ValueError):
    """A place gpipe will not write to: what is there, and where to write instead."""


def is_run(folder: str | Path) -> bool:
    """Whether ``folder`` is a run of ``gpipe train``: its ``config.toml`` or a checkpoint."""
    folder = Path(folder)
    if any(folder.glob(f"{CHECKPOINTS}/{STEPS}/{MANIFEST}")):
        return True
    options = folder / config_file.FILE
    try:
        return options.is_file() and bool(config_file.read(options))
    except (ValueError, OSError):  # not TOML, or not gpipe's options
        return False


def keep_best(checkpoint: Path, out: Path, *, step: int, val_loss: float) -> Path:
    """``out/best/step-NNNNNN/``: the committed ``checkpoint``, hard-linked (no copy of its
    bytes, and retention deleting the original in checkpoints/ unlinks only its name there),
    replacing the previous best; ``out/best.json`` records its step and validation loss.
    ``out/best`` is a folder of checkpoints: gpipe eval, export and --resume take it."""

    def link(into: Path) -> None:
        shutil.copytree(checkpoint, into / checkpoint.name, copy_function=os.link)

    final = out / BEST
    write_folder(final, link)
    record = {"step": step, "val_loss": val_loss, "checkpoint": checkpoint.name}
    write_file(out / BEST_RECORD, lambda f: f.write(json.dumps(record).encode() + b"\n"))
    return final / checkpoint.name


def best_loss(out: Path) -> float:
    """The validation loss of ``out/best/`` (infinity: none yet)."""
    try:
        return float(json.loads((out / BEST_RECORD).read_text())["val_loss"])
    except (OSError, ValueError, KeyError):
        return float("inf")


def run_folder_problems(out: str | Path) -> list[str]:
    """Why ``gpipe train --out out`` must not write there ([] when it may)."""
    folder = Path(out)
    if not folder.is_dir() or is_run(folder):
        return []
    held = sorted(p.name for p in folder.iterdir())
    if not held:
        return []
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    return [
        f"--out {out} holds {shown}, and is not a gpipe run: gpipe writes a run only into "
        "a new or empty folder or its own run's; choose another --out"
    ]


def export_problem(out: Path, record: Path, *, force: bool) -> str | None:
    """Why an export must not write ``out`` (and its ``record``), or None."""
    parent = out.parent.resolve()
    for folder in (out, parent, *parent.parents):
        if _is_checkpoint(folder):
            return (
                f"{folder} is a checkpoint or a folder of them: gpipe export never writes into "
                "one; choose a path outside it"
            )
    if out.is_dir() and is_run(out):
        return f"{out} is a run's folder: choose a new name (the default: model-step-NNNNNN/ in it)"
    if is_run(out.parent):
        for path in (out, record):
            if path.parent == out.parent and (
                path.name in _RUN_NAMES or path.name.startswith(TENSORBOARD)
            ):
                return (
                    f"{path} is a file of the run {out.parent}: choose another name (the "
                    "default: model-step-NNNNNN.pt in it)"
                )
    if force:
        return None
    for path in (out, record):
        if os.path.lexists(path) and not exported_by_gpipe(record):
            return (
                f"{path} exists and gpipe export did not write it: choose another -o, or pass "
                "--force to replace it"
            )
    return None


def _is_checkpoint(folder: Path) -> bool:
    """A checkpoint (its manifest) or a folder of them (``latest``, step-NNNNNN/)."""
    return (
        (folder / MANIFEST).is_file()
        or (folder / LATEST).is_file()
        or any(folder.glob(f"{STEPS}/{MANIFEST}"))
    )


def exported_by_gpipe(record: Path) -> bool:
    """Whether ``record`` is what gpipe export writes beside (or in) what it exported."""
    try:
        written = json.loads(record.read_text()) if not record.is_symlink() else None
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and {"model", "step", "source"} <= set(written)
