"""``--report-to tensorboard,wandb,mlflow,MODULE:FUNCTION``: where rank 0 sends each step's
metrics (the record ``metrics.jsonl`` gets) and, at the end, the run's summary.

Every destination is a :class:`Sink`: called with each record, ``end`` with the summary,
``close`` always (also when a signal or a failure ends the run). Each library is an optional
extra, imported only when asked for, and configured by its own environment variables:

- ``tensorboard`` (default; ``pip install 'gpipe[tensorboard]'``): event files in the run
  folder, written by ``torch.utils.tensorboard``'s ``SummaryWriter``.
- ``wandb`` (``gpipe[wandb]``): a W&B run named after the folder, its files under
  ``OUT/wandb/``; ``WANDB_PROJECT`` (default ``gpipe``), ``WANDB_MODE=offline`` to sync later.
- ``mlflow`` (``gpipe[mlflow]``, MLflow's client without its server): a run in the experiment
  ``MLFLOW_EXPERIMENT_NAME`` (default ``gpipe``) of the store ``MLFLOW_TRACKING_URI`` names.
- ``MODULE:FUNCTION``: a function of yours, called with each record (a dict)::

      # my_hooks.py, importable (on PYTHONPATH, or installed)
      def to_dashboard(record):
          post(record["step"], record["loss"])

  Named rather than passed so that it reaches every way a run starts (the command line,
  ``gpipe.train.run``, torchrun, a config file) and is stored with the run; keep work such as
  opening a connection in the function's first call, not at import.

Curves name their numbers as TensorBoard's do: ``train/loss``, ``val/loss``. A run resumed in
its own folder continues the same W&B and MLflow runs (their ids are kept in
``OUT/trackers.json``), a run resumed elsewhere starts new ones and sends the history up to its
checkpoint first, so that either way each curve covers the whole run. W&B keeps the first value
of a step it already has (steps logged past the checkpoint before a crash); MLflow keeps both.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gpipe.train.run_folder as run_folder
from gpipe.base._utils import MiB
from gpipe.train.report import write_json

__all__ = ["DESTINATIONS", "Sink", "TensorBoard", "load_function", "open_sinks", "problems"]

DESTINATIONS = ("tensorboard", "wandb", "mlflow")
IDS_FILE = run_folder.TRACKERS  # the W&B and MLflow run ids of this folder
# Not a curve: the step itself, the time since the start, the layout's name.
_NOT_PLOTTED = ("step", "elapsed", "layout")


class Sink:
    """One destination of the metrics; a destination that is new (not resumed in place) is
    first sent the history up to the checkpoint (:meth:`replayed`)."""

    def __call__(self, record: dict[str, Any]) -> None:  # one step's metrics record
        raise NotImplementedError

    def end(self, summary: dict[str, Any], out: Path, *, step: int) -> None:
        """The run's summary and files (nothing, unless the destination takes them)."""

    def close(self) -> None:
        """Let go of the destination (nothing, unless it holds something)."""

    def replayed(self, history: list[dict[str, Any]], *, fresh: bool) -> Sink:
        for record in history if fresh else ():
            self(record)
        return self


def curves(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record by curve name: ``train/loss``, ``val/loss``."""
    numbers = {}
    for key, value in record.items():
        if key in _NOT_PLOTTED or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        numbers[f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"] = float(value)
    return numbers


def _summary_numbers(summary: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v) for k, v in summary.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }  # fmt: skip


def names(spec: str) -> list[str]:
    """The destinations of ``--report-to`` in order; ``none`` (or nothing) is none."""
    parts = [p.strip() for p in (spec or "").split(",") if p.strip()]
    return [] if parts == ["none"] else parts


def problems(spec: str, *, given: bool) -> list[str]:
    """What cannot work in ``--report-to spec``; ``given``: the user named it (else the
    default, whose TensorBoard may be missing: the run then says so once and goes on)."""
    found = []
    for name in names(spec):
        if ":" in name:
            try:
                load_function(name)
            except ValueError as error:
                found.append(str(error))
        elif name not in DESTINATIONS:
            found.append(
                f"--report-to {name}: not one of {', '.join(DESTINATIONS)}, MODULE:FUNCTION "
                "(a function of yours) or none"
            )
        elif (given or name != "tensorboard") and importlib.util.find_spec(name) is None:
            found.append(
                f"--report-to {name}: the {name} package is not installed: pip install "
                f"'gpipe[{name}]', or leave {name} out of --report-to"
            )
    return found


def load_function(spec: str) -> Callable[[dict[str, Any]], Any]:
    """The function ``spec`` names (``"package.module:function"``); raises ValueError with
    the remedy when it cannot be found."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"--report-to {spec!r}: give MODULE:FUNCTION, e.g. my_hooks:to_dashboard")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"--report-to {spec}: cannot import {module_name} ({error}); put it on "
            "PYTHONPATH or install it"
        ) from None
    function = module
    for part in name.split("."):
        function = getattr(function, part, None)
    if not callable(function):
        raise ValueError(
            f"--report-to {spec}: {module_name} has no function {name}; give "
            "MODULE:FUNCTION of a function taking one dict"
        )
    return function


def open_sinks(
    spec: str,
    out: Path,
    *,
    start: int,
    history: list[dict[str, Any]],
    options: dict[str, Any],
    note: Callable[[str], Any],
) -> list[Sink]:
    """Rank 0's destinations of ``spec`` for the run folder ``out`` that starts after step
    ``start`` (``history``: the records up to it; ``options``: the run's, for W&B's config
    and MLflow's parameters). A missing TensorBoard is ``note``d once and left out."""
    sinks: list[Sink] = []
    for name in names(spec):
        if name == "tensorboard":
            board = TensorBoard.open(out, start=start, history=history)
            if board is None:
                note(
                    "TensorBoard logging is off: the tensorboard package is not installed "
                    "(pip install 'gpipe[tensorboard]'; --report-to none silences this)"
                )
            else:
                sinks.append(board)
        elif name == "wandb":
            sinks.append(WandB.open(out, history=history, options=options))
        elif name == "mlflow":
            sinks.append(MLflow.open(out, history=history, options=options))
        else:
            sinks.append(Function(load_function(name)))
    return sinks


class Function(Sink):
    """A function of the user's, called with each record."""

    def __init__(self, function: Callable[[dict[str, Any]], Any]) -> None:
        self.function = function

    def __call__(self, record: dict[str, Any]) -> None:
        self.function(record)


class TensorBoard(Sink):
    """Rank 0's TensorBoard event files, in the run folder itself (so ``tensorboard --logdir
    runs`` lists every run by its folder): each number of a metrics record under ``train/`` or
    ``val/`` by step, and at the end the measured bubble, the memory of each rank, the
    timeline image, the summary and the configuration.

    Resumed in the same folder, the old files' steps after the checkpoint are purged (the
    writer's ``purge_step``); in a new folder, the steps up to the checkpoint are written
    again from ``history``, so that either way the curves cover the whole run once.
    """

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, folder: Path, *, start: int, history: list[dict[str, Any]]) -> TensorBoard | None:
        """The writer for ``folder``; None when the ``tensorboard`` package is missing."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's module needs the tensorboard package
            return None
        earlier = any(folder.glob(f"{run_folder.TENSORBOARD}*"))
        writer = SummaryWriter(str(folder), purge_step=start + 1 if earlier else None)
        return cls(writer).replayed(history, fresh=not earlier)

    def __call__(self, record: dict[str, Any]) -> None:
        for tag, value in curves(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def end(self, summary: dict[str, Any], out: Path, *, step: int) -> None:
        """The run's measurements (at ``step``, the measured one) and its files' contents."""
        add = self.writer.add_scalar
        if summary.get("bubble") is not None:
            add("pipeline/bubble", summary["bubble"], step)
        for m in summary.get("memory_per_rank", []):
            who = f"rank{m['rank']}_stage{'-'.join(map(str, m['stages']))}"
            add(f"memory_MiB/activations/{who}", m["activation_bytes"] / MiB, step)
            add(f"memory_MiB/weights_and_optimizer/{who}", m["state_bytes"] / MiB, step)
            add(f"memory_MiB/process_peak/{who}", m["peak_rss_bytes"] / MiB, step)
        picture = out / run_folder.TIMELINE_PNG
        if picture.exists():
            import numpy as np
            from PIL import Image  # there whenever matplotlib drew the PNG

            with Image.open(picture) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.writer.add_image("timeline/measured", pixels, step, dataformats="HWC")
        numbers = _summary_numbers(summary)
        table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v:.6g} |\n" for k, v in numbers.items())
        self.writer.add_text("summary", table, step)
        config = out / run_folder.OPTIONS
        if config.exists():  # indented: a code block in TensorBoard's markdown
            text = "".join(f"    {line}\n" for line in config.read_text().splitlines())
            self.writer.add_text("config", text, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _ids(out: Path) -> dict[str, str]:
    path = out / IDS_FILE
    try:
        ids = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


_ARTIFACTS = (run_folder.LOSS_PLOT, run_folder.TIMELINE_PNG, run_folder.OPTIONS, run_folder.SUMMARY)


class WandB(Sink):
    """A Weights & Biases run (``wandb.init``), one per run folder."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def open(cls, out: Path, *, history: list[dict[str, Any]], options: dict[str, Any]) -> WandB:
        import wandb

        earlier = _ids(out).get("wandb")
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "gpipe", name=out.name, dir=str(out),
            id=earlier, resume="allow" if earlier else None, config=options,
        )  # fmt: skip
        write_json(out / IDS_FILE, {**_ids(out), "wandb": run.id})
        return cls(run).replayed(history, fresh=not earlier)

    def __call__(self, record: dict[str, Any]) -> None:
        self.run.log(curves(record), step=record["step"])

    def end(self, summary: dict[str, Any], out: Path, *, step: int) -> None:
        self.run.summary.update(_summary_numbers(summary))
        for name in _ARTIFACTS:
            if (out / name).exists():
                self.run.save(str(out / name), base_path=str(out), policy="now")

    def close(self) -> None:
        self.run.finish()


class MLflow(Sink):
    """An MLflow run through ``MlflowClient`` (no global active run), one per run folder."""

    _BATCH = 100  # MLflow's limit of parameters in one request

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def open(cls, out: Path, *, history: list[dict[str, Any]], options: dict[str, Any]) -> MLflow:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        earlier = _ids(out).get("mlflow")
        if earlier is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "gpipe"
            experiment = client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id if experiment else client.create_experiment(name)
            )
            run_id = client.create_run(experiment_id, run_name=out.name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in options.items() if v is not None]
            for i in range(0, len(params), cls._BATCH):
                client.log_batch(run_id, params=params[i : i + cls._BATCH])
            write_json(out / IDS_FILE, {**_ids(out), "mlflow": run_id})
        else:
            run_id = earlier
            client.update_run(run_id, status="RUNNING")
        return cls(client, run_id).replayed(history, fresh=earlier is None)

    def __call__(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        at = int(time.time() * 1000)
        numbers = curves(record)
        metrics = [Metric(k, v, at, record["step"]) for k, v in numbers.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def end(self, summary: dict[str, Any], out: Path, *, step: int) -> None:
        from mlflow.entities import Metric

        at = int(time.time() * 1000)
        numbers = _summary_numbers(summary)
        metrics = [Metric(f"summary/{k}", v, at, step) for k, v in numbers.items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        for name in _ARTIFACTS:
            if (out / name).exists():
                self.client.log_artifact(self.run_id, str(out / name))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
