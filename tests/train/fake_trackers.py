"""Stand-ins for ``wandb`` and ``mlflow`` with the calls ``gpipe.train.reporters`` makes: each
call is a JSON line in the file ``GPIPE_TEST_TRACKERS`` names, so that a test (in this process
or through a whole ``gpipe train``) sees what would reach W&B and MLflow without the packages.
The real packages, in their offline modes, are tested where installed
(``tests/train/test_reporters.py``)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

__all__ = ["calls", "install", "write_site"]

_LOG = """
import json, os

def _log(*call):
    with open(os.environ["GPIPE_TEST_TRACKERS"], "a") as f:
        f.write(json.dumps(call) + "\\n")
"""

_WANDB = (
    _LOG
    + """
class _Run:
    def __init__(self, **kwargs):
        self.id = kwargs["id"] or "wandb-run-1"
        self.summary = {}

    def log(self, data, step):
        _log("wandb.log", step, data)

    def save(self, path, base_path, policy):
        _log("wandb.save", os.path.relpath(path, base_path))

    def finish(self):
        _log("wandb.finish", self.summary)


def init(**kwargs):
    _log("wandb.init", {k: kwargs[k] for k in ("project", "name", "id", "resume")})
    return _Run(**kwargs)
"""
)

_MLFLOW_ENTITIES = """
from collections import namedtuple

Param = namedtuple("Param", "key value")
Metric = namedtuple("Metric", "key value timestamp step")
"""

_MLFLOW_TRACKING = (
    _LOG
    + """
class _Experiment:
    experiment_id = "0"


class _Run:
    class info:
        run_id = "mlflow-run-1"


class MlflowClient:
    def get_experiment_by_name(self, name):
        _log("mlflow.experiment", name)
        return None

    def create_experiment(self, name):
        return "0"

    def create_run(self, experiment_id, run_name):
        _log("mlflow.create_run", run_name)
        return _Run()

    def update_run(self, run_id, status):
        _log("mlflow.update_run", run_id, status)

    def log_batch(self, run_id, metrics=(), params=()):
        for m in metrics:
            _log("mlflow.metric", m.step, m.key, m.value)
        if params:
            _log("mlflow.params", {p.key: p.value for p in params})

    def log_artifact(self, run_id, path):
        _log("mlflow.artifact", os.path.basename(path))

    def set_terminated(self, run_id):
        _log("mlflow.terminated", run_id)
"""
)


def write_site(site: Path) -> Path:
    """Write the stand-ins under ``site`` (to put first on the path); returns ``site``."""
    files = {
        "wandb/__init__.py": _WANDB,
        "mlflow/__init__.py": "",
        "mlflow/entities.py": _MLFLOW_ENTITIES,
        "mlflow/tracking.py": _MLFLOW_TRACKING,
    }
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    return site


def install(site: Path, log: Path, monkeypatch) -> None:
    """The stand-ins importable in this process, logging to ``log``."""
    write_site(site)
    monkeypatch.setenv("GPIPE_TEST_TRACKERS", str(log))
    monkeypatch.syspath_prepend(str(site))
    names = ("wandb", "mlflow", "mlflow.entities", "mlflow.tracking")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    fakes = {name: importlib.import_module(name) for name in names}
    for name, module in fakes.items():
        # out, then in through monkeypatch: gone after the test, the real ones (if any) back
        del sys.modules[name]
        monkeypatch.setitem(sys.modules, name, module)


def calls(log: Path, prefix: str = "") -> list[list]:
    """The logged calls whose name starts with ``prefix``."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [c for c in map(json.loads, lines) if c[0].startswith(prefix)]
