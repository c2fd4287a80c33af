"""The run's optimizer: ``torch.optim``'s AdamW (the default), Adam or SGD, by ``--optimizer``.

Weight decay applies to matrices (dim >= 2) only, as in nanoGPT: two param groups, named
``decay`` and ``no_decay`` so that a checkpoint's optimizer state loads into any cut of the
model (``gpipe.train.checkpoint``). AdamW decays the weights apart from the gradient; Adam and SGD
add ``weight_decay * w`` to it (L2), as torch's own do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "build", "hyperparameters", "problems"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}
_ADAM_ONLY = ("beta1", "beta2", "eps")
_SGD_ONLY = ("momentum",)


def hyperparameters(config: Any) -> dict[str, Any]:
    """The keyword arguments of ``config.optimizer``'s class (a TrainConfig's fields)."""
    common = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.optimizer == "sgd":
        return {**common, "momentum": config.momentum}
    return {**common, "betas": (config.beta1, config.beta2), "eps": config.eps}


def build(parameters: list[nn.Parameter], config: Any) -> torch.optim.Optimizer | None:
    """The optimizer of ``parameters`` (None if there are none: a stage of pooling only)."""
    groups = [
        {"name": "decay", "params": [p for p in parameters if p.dim() >= 2]},
        {"name": "no_decay", "params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        return None
    return OPTIMIZERS[config.optimizer](groups, **hyperparameters(config))


def problems(config: Any, defaults: Any) -> list[str]:
    """What is wrong with the optimizer's options, each with its value and the remedy;
    ``defaults``: a TrainConfig of the defaults (another optimizer's options must keep them)."""
    c, found = config, []
    if c.optimizer not in OPTIMIZERS:
        return [f"--optimizer {c.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}"]
    other = _SGD_ONLY if c.optimizer != "sgd" else _ADAM_ONLY
    for name in other:
        if getattr(c, name) != getattr(defaults, name):
            owner = "sgd" if name in _SGD_ONLY else "adamw or adam"
            found.append(
                f"--{name} {getattr(c, name)} applies to --optimizer {owner}, not "
                f"--optimizer {c.optimizer}: drop --{name}, or choose --optimizer {owner}"
            )
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(c, name) < 1:
            found.append(f"--{name} must be in [0, 1), got {getattr(c, name)}")
    if not c.eps > 0:
        found.append(f"--eps must be > 0, got {c.eps}")
    if not 0 <= c.momentum < 1:
        found.append(f"--momentum must be in [0, 1), got {c.momentum}")
    return found
