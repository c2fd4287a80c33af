"""The main job as a library: train a model through a pipeline of K processes (× R replicas),
with validation, checkpoints, resume, metrics, a measured timeline and a summary.

    from gpipe.train import resolve, run
    summary = run(resolve({"size": "tiny", "steps": 40, "out": "runs/tiny"}))

``gpipe train`` (``gpipe.cli.train``) is this package behind a command line. Its parts, each
usable alone:

* ``config``: :class:`TrainConfig` and :func:`resolve` (options, checkpoint, presets);
* ``tasks``: one :class:`Task` per model (presets, model, data, loss), in :data:`TASKS`;
* ``trainer``: :class:`Trainer`, one rank's loop;
* ``report``: progress, metrics file, loss plot, summary;
* ``job``: starting the processes (locally or under torchrun) and finding a failure's cause.
"""

from gpipe.train.config import ConfigError, TrainConfig, model_spec, resolve
from gpipe.train.job import TrainingError, run, run_under_torchrun, train
from gpipe.train.tasks import TASKS, Task, build_model, constructor
from gpipe.train.trainer import Trainer

__all__ = [
    "TASKS",
    "ConfigError",
    "Task",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "build_model",
    "constructor",
    "model_spec",
    "resolve",
    "run",
    "run_under_torchrun",
    "train",
]
