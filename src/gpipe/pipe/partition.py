"""Partitioning: cut an ``nn.Sequential`` into stages by ``balance``, and what a cut must not
do (share a parameter between stages unless it is tied).

Whether a balance fits the layout is ``gpipe.layout.Layout.problems``' question; here are
the layers themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe.base._utils import DeviceLike
from gpipe.base.errors import PartitionError

__all__ = ["check_not_shared", "cut", "device_problems", "fingerprint"]


def device_problems(devices: Sequence[DeviceLike]) -> list[str]:
    """The entries of ``devices`` that name no device, one line each."""
    problems = []
    for device in devices:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            problems.append(f"{device!r} is not a device; use e.g. 'cpu' or 'cuda:0'")
    return problems


def cut(module: nn.Sequential, balance: Sequence[int]) -> list[list[tuple[str, nn.Module]]]:
    """The (name, layer) pairs of each stage, in order."""
    # _modules, not named_children(): the latter skips a layer repeated in the Sequential.
    named = list(module._modules.items())
    stages, start = [], 0
    for size in balance:
        stages.append(named[start : start + size])
        start += size
    return stages


def check_not_shared(
    stages: Sequence[Sequence[tuple[str, nn.Module]]], tied: set[str] = frozenset()
) -> None:
    """Raise on parameters used by more than one stage and not declared ``tied``: each
    stage would train its own copy."""
    owners: dict[int, tuple[int, str]] = {}
    problems = []
    for index, layers in enumerate(stages):
        for name, layer in layers:
            for pname, param in layer.named_parameters(remove_duplicate=False):
                if f"{name}.{pname}" in tied:
                    continue
                first = owners.setdefault(id(param), (index, f"{name}.{pname}"))
                if first[0] != index:
                    problems.append(
                        f"- parameter {first[1]} (stage {first[0]}) is also {name}.{pname} "
                        f"(stage {index})"
                    )
    if problems:
        raise PartitionError(
            "a parameter is shared by two stages, which would train two copies:\n"
            + "\n".join(problems)
            + "\nmove the layers that share it into one stage (change balance), or declare "
            "it tied: tied=[(name, other_name)]"
        )


def fingerprint(module: nn.Sequential, **settings: Any) -> dict[str, str]:
    """What every rank of one pipeline must agree on: the settings, and the name, shape and
    dtype of every parameter and buffer of the whole model (on meta or not)."""
    tensors = [
        f"{name}:{tuple(t.shape)}:{t.dtype}"
        for name, t in (*module.named_parameters(), *module.named_buffers())
    ]
    digest = hashlib.sha256("\n".join(tensors).encode()).hexdigest()[:16]
    return {**{key: repr(value) for key, value in settings.items()}, "model": digest}
