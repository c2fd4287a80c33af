"""Sizes this machine cannot hold, found before any process starts (see
:func:`gpipe.train.options.resolve`)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["PROCESS_BYTES", "gib", "physical_memory", "problems"]

PROCESS_BYTES = 400 * 2**20  # a rank before its model: Python, torch, gloo (measured ~350 MiB)


def problems(c: Any, *, spawns: bool) -> list[str]:
    """Sizes this machine cannot hold, refused before any process allocates them.

    Generous on purpose: the floor is one micro-batch in the largest layer of one rank
    (:meth:`Task.activation_floor`), against all of the machine's memory; a run refused
    here could not have finished its first step. ``spawns``: this command starts every
    rank here (not torchrun, whose ranks may be on several machines).
    """
    memory = physical_memory()
    if memory is None:
        return []
    problems = []
    micro = -(-c.batch // (c.replicas * c.chunks))  # samples of the largest micro-batch
    floor, terms = c.task.activation_floor(micro)
    if floor > memory:
        given = ", ".join(f"--{name} {getattr(c, name)}" for name in c.task.size_options)
        lower = " or ".join(f"--{name}" for name in c.task.size_options)
        problems.append(
            f"{given} (--chunks {c.chunks}): one micro-batch of {micro} samples needs at "
            f"least {gib(floor)} in a single layer ({terms}), more than this machine's "
            f"{gib(memory)} of memory; lower {lower}, or raise --chunks"
        )
    if spawns and c.world_size * PROCESS_BYTES > memory:
        problems.append(
            f"--stages {c.stages} x --replicas {c.replicas} = {c.world_size} processes need "
            f"about {gib(c.world_size * PROCESS_BYTES)} before any model, more than this "
            f"machine's {gib(memory)} of memory; use fewer --replicas, or torchrun over "
            "several machines"
        )
    return problems


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gib(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB"
