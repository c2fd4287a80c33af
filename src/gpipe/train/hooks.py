"""``--metrics-hook MODULE:FUNCTION``: a function of the user's that rank 0 calls with each
step's metrics (the record ``metrics.jsonl`` gets, a dict), to send them to Weights & Biases,
MLflow or anything else::

    # my_hooks.py, importable (on PYTHONPATH, or installed)
    import mlflow

    def to_mlflow(record):  # mlflow starts its run on the first call
        numbers = {k: v for k, v in record.items() if isinstance(v, float)}
        mlflow.log_metrics(numbers, step=record["step"])

    gpipe train --metrics-hook my_hooks:to_mlflow

It is named rather than passed as an object so that it reaches every way a run starts (the
command line, ``gpipe.train.run``, torchrun, a config file) and is stored with the run. The
command imports the module once to check the name, rank 0 again to call it: keep work such
as starting a W&B run inside the function (on its first call), not at import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["load"]

MetricsHook = Callable[[dict[str, Any]], Any]


def load(spec: str) -> MetricsHook:
    """The function ``spec`` names (``"package.module:function"``); raises ValueError with
    the remedy when it cannot be found."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ValueError(f"--metrics-hook {spec!r}: give MODULE:FUNCTION, e.g. my_hooks:to_mlflow")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"--metrics-hook {spec}: cannot import {module_name} ({error}); put it on "
            "PYTHONPATH or install it"
        ) from None
    function = module
    for part in name.split("."):
        function = getattr(function, part, None)
    if not callable(function):
        raise ValueError(
            f"--metrics-hook {spec}: {module_name} has no function {name}; give "
            "MODULE:FUNCTION of a function taking one dict"
        )
    return function
