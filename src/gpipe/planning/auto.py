"""``Pipe(balance="auto")``: profile the model on a sample and cut where it is fastest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import nn

from gpipe._utils import DeviceLike
from gpipe.errors import PartitionError
from gpipe.planning.balance import balance_by_time

__all__ = ["auto_balance"]

T = TypeVar("T")


def auto_balance(
    module: Any,
    balance: str,
    sample: Any,
    devices: Sequence[DeviceLike] | None,
    decide: Callable[[Callable[[], T]], T],
    **plan: Any,
) -> list[int]:
    """Cuts that minimise the slowest stage, measured on ``sample`` on the first device.

    ``decide`` runs the profiling where the Pipe's group says (``gpipe.parallel.group``:
    with many processes, rank 0 profiles and every rank takes its answer, since timings
    differ from process to process and all must cut alike). ``plan`` holds the Pipe's
    ``chunks``, ``checkpoint``, ``schedule`` and ``virtual_stages``.
    """
    if balance != "auto":
        raise PartitionError(f"balance must be a list of ints or 'auto', got {balance!r}")
    if sample is None:
        raise PartitionError(
            "balance='auto' profiles the model: pass sample=<one micro-batch of inputs>"
        )
    if not isinstance(module, nn.Module):
        raise PartitionError("balance='auto' needs the built model, not a factory")
    if devices is None:
        raise PartitionError(
            "balance='auto' needs to know the number of stages: pass devices=[...], one per stage"
        )
    stages = len(devices) * plan["virtual_stages"]
    return decide(lambda: balance_by_time(module, sample, stages=stages, device=devices[0], **plan))
