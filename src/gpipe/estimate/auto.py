"""``Pipe(balance="auto")``: profile the model on a sample and cut where it is fastest."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import nn

from gpipe.base._utils import DeviceLike
from gpipe.base.errors import PartitionError
from gpipe.estimate.balance import balance_by_time

__all__ = ["auto_balance"]

T = TypeVar("T")


def auto_balance(
    module: Any,
    balance: str,
    sample: Any,
    devices: Sequence[DeviceLike] | None,
    decide: Callable[[Callable[[], T]], T],
    sample_loss: tuple[Any, Callable] | None = None,
    **plan: Any,
) -> list[int]:
    """Cuts that minimise the slowest stage, measured on ``sample`` on the first device.

    ``decide`` runs the profiling where the Pipe's group says (``gpipe.parallel.group``:
    with many processes, rank 0 profiles and every rank takes its answer, since timings
    differ from process to process and all must cut alike). ``plan`` holds the Pipe's
    ``chunks``, ``checkpoint``, ``schedule`` and ``virtual_stages``; ``sample_loss`` is
    ``(target, loss_fn)``, timed with the last layer.
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
    target = loss_fn = None
    if sample_loss is not None:
        if not (
            isinstance(sample_loss, tuple) and len(sample_loss) == 2 and callable(sample_loss[1])
        ):
            raise PartitionError(
                f"sample_loss must be a pair (target, loss_fn) with a callable loss_fn, got "
                f"{type(sample_loss).__name__}: e.g. sample_loss=(y[:8], F.cross_entropy)"
            )
        target, loss_fn = sample_loss
    stages = len(devices) * plan["virtual_stages"]
    return decide(
        lambda: balance_by_time(
            module,
            sample,
            stages=stages,
            device=devices[0],
            target=target,
            loss_fn=loss_fn,
            **plan,
        )
    )
