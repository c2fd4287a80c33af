"""A run's folder (``gpipe train --out``): every name in it, spelled here only, and where a
checkpoint sits in it (each file in it written whole or not at all: :mod:`gpipe.base.files`).
Everything that reads or writes a run asks this module::

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

from pathlib import Path

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
    "run_of",
    "step_folder",
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
