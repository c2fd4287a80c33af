"""Partitioning: cut an ``nn.Sequential`` into stages by ``balance`` and check the cut.

Configuration problems are gathered and reported together, each with its values, so a
user fixes them in one round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpipe import remat
from gpipe._utils import DeviceLike
from gpipe.errors import PartitionError
from gpipe.microbatch import chunk_sizes
from gpipe.schedule import ALL_SCHEDULES

__all__ = [
    "configuration_problems",
    "cut",
    "even_balance",
    "partition_problems",
    "check_not_shared",
    "fingerprint",
]


def partition_problems(
    module: nn.Module,
    balance: Sequence[int],
    devices: Sequence[DeviceLike],
    *,
    virtual_stages: int = 1,
) -> list[str]:
    """Every problem of this configuration, one line each (``"- ..."``); none: it cuts.

    ``balance`` has one entry per stage, ``devices`` one per rank; a rank holds
    ``virtual_stages`` stages.
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"gpipe cuts an nn.Sequential into stages, got {type(module).__name__}; "
            "wrap the model's layers in order: nn.Sequential(embedding, *blocks, head)"
        )
    problems: list[str] = []
    entries = list(balance)
    if not entries:
        problems.append("balance is empty: give the number of layers of each stage, e.g. [2, 2]")
    bad = [b for b in entries if not isinstance(b, int) or isinstance(b, bool) or b <= 0]
    if bad:
        problems.append(
            f"every balance entry must be a positive int (layers in that stage), got {entries}"
        )
    elif entries and sum(entries) != len(module):
        problems.append(
            f"module and sum of balance have different length "
            f"(module: {len(module)}, sum of balance: {sum(entries)}); "
            f"e.g. balance={even_balance(len(module), len(entries))} covers all layers"
        )
    if virtual_stages == 1 and len(devices) != len(entries):
        problems.append(
            f"devices and balance have different length "
            f"(devices: {len(devices)}, balance: {len(entries)}); give one device per stage"
        )
    elif len(devices) * virtual_stages != len(entries):
        problems.append(
            f"with virtual_stages={virtual_stages} each device holds {virtual_stages} stages, "
            f"so balance needs {len(devices) * virtual_stages} entries for {len(devices)} "
            f"devices, got {len(entries)}"
        )
    for device in devices:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            problems.append(f"{device!r} is not a device; use e.g. 'cpu' or 'cuda:0'")
    return [f"- {p}" for p in problems]


def configuration_problems(
    module: nn.Sequential,
    balance: Sequence[int],
    devices: Sequence[DeviceLike],
    virtual_stages: int,
    chunks: Any,
    checkpoint: Any,
    schedule: Any,
) -> list[str]:
    """Every problem of a Pipe's configuration, each a line of the one error it raises."""
    problems = partition_problems(module, balance, devices, virtual_stages=virtual_stages)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        problems.append(f"- chunks must be a positive int (micro-batches), got {chunks!r}")
    try:
        remat.check_mode(checkpoint)
    except ValueError as error:
        problems.append(f"- {error}")
    if isinstance(schedule, str) and schedule not in ALL_SCHEDULES:
        problems.append(f"- unknown schedule {schedule!r}; known: {', '.join(ALL_SCHEDULES)}")
    if schedule == "interleaved-1f1b" and virtual_stages == 1:
        problems.append(
            "- schedule='interleaved-1f1b' with virtual_stages=1 is plain 1f1b: pass "
            "virtual_stages=2 (stages per device; the default for this schedule) or "
            "schedule='1f1b'"
        )
    return problems


def even_balance(layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible (earlier stages take the remainder)."""
    return chunk_sizes(layers, max(1, min(stages, layers)))


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
