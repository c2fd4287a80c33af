"""A run's folder (``gpipe train --out``): every name in it, spelled here only, and where a
checkpoint sits in it, and how a file is written (:func:`write_file`, :func:`write_folder`:
whole or not at all). Everything that reads or writes a run asks this module::

    runs/gpt-small-20250101-120000/
      config.json  config.toml        the run's options (--resume reads the checkpoint's copy)
      metrics.jsonl                   one record per step; TensorBoard's events.out.tfevents.*
      loss.png  timeline.png  timeline.json  sample.txt  summary.json
      checkpoints/step-000200/        gpipe.train.checkpoint's folders of one step each
      best/step-000150/  best.json    --keep-best's checkpoint and its validation loss
      model-step-000200.pt (.json)    gpipe export's default (a folder for a Hugging Face model)

What is a run (``is_run``) and what gpipe never overwrites: ``gpipe.train.outputs``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "BEST",
    "BEST_RECORD",
    "CHECKPOINTS",
    "CONFIG",
    "FILES",
    "METRICS",
    "OPTIONS",
    "TENSORBOARD",
    "checkpoints",
    "export_target",
    "fsync_folder",
    "run_of",
    "step_folder",
    "write_file",
    "write_folder",
]

CONFIG, OPTIONS = "config.json", "config.toml"  # the run's options: as JSON, as gpipe train's
METRICS, SUMMARY, SAMPLE = "metrics.jsonl", "summary.json", "sample.txt"
LOSS_PLOT, TIMELINE_PNG, TIMELINE_TRACE = "loss.png", "timeline.png", "timeline.json"
TRACKERS = "trackers.json"  # the W&B and MLflow runs --report-to continues on resume
FILES = (METRICS, LOSS_PLOT, TIMELINE_PNG, TIMELINE_TRACE, SAMPLE, SUMMARY, TRACKERS, CONFIG,
         OPTIONS)  # fmt: skip
TENSORBOARD = "events.out.tfevents."  # the prefix of TensorBoard's files
CHECKPOINTS = "checkpoints"  # a run's checkpoints, each a step-NNNNNN/ folder
STEPS = "step-*"  # what step_folder names
BEST, BEST_RECORD = "best", "best.json"  # gpipe train --keep-best's checkpoint, its loss


def step_folder(step: int) -> str:
    """The name of the checkpoint of ``step``: ``step-000200``."""
    return f"step-{step:06d}"


def checkpoints(path: str | Path) -> Path:
    """The folder of checkpoints ``path`` designates: a run's ``checkpoints/``, or ``path``."""
    path = Path(path)
    return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path


def run_of(checkpoint: str | Path) -> Path | None:
    """The run folder that holds ``checkpoint`` (``RUN/checkpoints/step-NNNNNN``), or None."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None


def export_target(checkpoint: Path, step: int, *, folder: bool) -> Path:
    """Where ``gpipe export`` writes the checkpoint of ``step`` by default: beside its run's
    ``checkpoints/`` (else here), ``model-step-NNNNNN.pt``, or that ``folder``."""
    name = f"model-{step_folder(step)}"
    return (run_of(checkpoint) or Path(".")) / (name if folder else f"{name}.pt")


# -- writing: whole or not at all, never through a link -------------------------------------


def write_file(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """``write`` a file into a new temporary file beside ``path``, then rename it over
    ``path`` (a link at ``path`` is replaced, never followed): whole or not at all, and on
    disk (the file before the rename, the folder's entry after it)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600: as open() would have made it
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_folder(path.parent)


def write_folder(path: Path, write: Callable[[Path], Any]) -> None:
    """``write`` a folder into a new temporary one beside ``path``, then put it in place
    of ``path`` (what was there is removed once the new one is in place)."""
    temporary = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    aside = None
    try:
        os.chmod(temporary, 0o777 & ~_umask())
        write(temporary)
        if path.is_dir() and not path.is_symlink():
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, aside / path.name)
        elif os.path.lexists(path):
            os.unlink(path)
        os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def fsync_folder(folder: Path) -> None:
    """Put ``folder``'s entries (a rename) on disk."""
    with contextlib.suppress(OSError):  # a file system that cannot: nothing more to do
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)  # read by setting it: put back at once
    os.umask(mask)
    return mask
