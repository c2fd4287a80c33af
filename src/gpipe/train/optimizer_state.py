"""An optimizer's state by parameter name, so that any cut of the model can load it.

Torch optimizers key state by position, which changes with the cut; a checkpoint keys it by
each parameter's whole-model name (``gpipe.train.checkpoint`` writes and reads it). DCP's own
helper (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``) finds a
parameter's name by walking module attributes, which a captured model's names (the model's
own, without gpipe's unit index: ``model.layers.3...``) are not: it raises AttributeError.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpipe.train.checkpoint import CheckpointError

__all__ = ["load_optimizer_state_by_name", "optimizer_state_by_name"]


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[nn.Parameter, str]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of positions.

    ``names`` maps each parameter to its whole-model name (``{p: n for n, p in
    pipe.named_parameters()}``). Param groups keep their hyperparameters; a group's
    ``"name"`` entry, if it has one, is how :func:`load_optimizer_state_by_name` matches it.
    """
    saved = optimizer.state_dict()
    position_to_name: dict[int, str] = {}
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        for position, parameter in zip(saved_group["params"], group["params"], strict=True):
            position_to_name[position] = names[parameter]
    return {
        "state": {position_to_name[i]: s for i, s in saved["state"].items()},
        "param_groups": [
            {**g, "params": [position_to_name[i] for i in g["params"]]}
            for g in saved["param_groups"]
        ],
    }


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[nn.Parameter, str], state: Mapping[str, Any]
) -> None:
    """Load a by-name optimizer state (from any cut of the model) into ``optimizer``.

    Groups are matched by their ``"name"`` entry (else by position); the saved
    hyperparameters win. Every parameter of ``optimizer`` that has state in ``state`` gets it;
    a parameter the saved optimizer had not stepped yet has none, as it would.
    """
    by_key = {g.get("name", f"#{i}"): g for i, g in enumerate(state["param_groups"])}
    current = optimizer.state_dict()
    groups, per_position = [], {}
    for i, (group, saved_group) in enumerate(
        zip(optimizer.param_groups, current["param_groups"], strict=True)
    ):
        key = group.get("name", f"#{i}")
        if key not in by_key:
            raise CheckpointError(
                f"the checkpoint's optimizer has no param group {key!r} (it has {sorted(by_key)})"
            )
        group_names = [names[p] for p in group["params"]]
        stray = set(group_names) - set(by_key[key]["params"])
        if stray:
            raise CheckpointError(
                f"parameters {sorted(stray)[:4]} are in group {key!r} here but not in the "
                f"checkpoint's optimizer"
            )
        hyper = {k: v for k, v in by_key[key].items() if k != "params"}
        groups.append({**hyper, "params": saved_group["params"]})
        for position, name in zip(saved_group["params"], group_names, strict=True):
            if name in state["state"]:
                per_position[position] = state["state"][name]
    optimizer.load_state_dict({"state": per_position, "param_groups": groups})
