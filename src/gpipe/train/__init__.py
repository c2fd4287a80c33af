"""The main job as a library: train a model through a pipeline of K processes (× R replicas),
with validation, checkpoints, resume, metrics, a measured timeline and a summary.

    from gpipe.train import resolve, run
    summary = run(resolve({"size": "tiny", "steps": 40, "out": "runs/tiny"}))

``gpipe train`` (``gpipe.cli.train``) is this package behind a command line. Its parts, each
usable alone:

* ``config``: :class:`TrainConfig`; ``options``: :func:`resolve` (options, checkpoint, presets);
* ``tasks``: :class:`Task`, a run's model source, objective and data (``networks``, ``hf``,
  ``objectives``, ``sources``, ``tokenizers``), the built-in models' :data:`RECIPES`;
* ``trainer``: :class:`Trainer`, one rank's loop;
* ``report``: progress, metrics file, loss plot, summary;
* ``run_folder``, ``checkpoint``: a run's folder (every name in it) and its DCP checkpoints;
* ``job``: starting the processes (locally or under torchrun) and finding a failure's cause.
"""

from gpipe.train.config import ConfigError, TrainConfig, model_spec
from gpipe.train.job import TrainingError, run, run_under_torchrun, train
from gpipe.train.options import resolve
from gpipe.train.tasks import RECIPES, Task, build_model, constructor, task_of
from gpipe.train.trainer import Trainer

__all__ = [
    "RECIPES",
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
    "task_of",
    "train",
]
