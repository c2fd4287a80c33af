"""Transport: moves activations forward and gradients backward between stages.

The runtime addresses every message by what it is — the activation entering stage ``s``
for micro-batch ``m``, or the gradient leaving it — and never by who sends it, so the
same runtime works whether the neighbouring stage lives on another device of this
process or in another process.

:class:`LocalTransport` serves stages held by one process: a message is a device copy
(``Tensor.to``) put in a mailbox; nothing is serialized.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = ["Channel", "LocalTransport", "Message", "to_device"]


class Channel(StrEnum):
    ACTIVATION = "activation"  # output of stage s-1, input of stage s
    GRADIENT = "gradient"  # gradient of stage s+1's input, for stage s's output


@dataclass(frozen=True, slots=True)
class Message:
    channel: Channel
    stage: int  # the stage that receives it
    microbatch: int


def to_device(value: Any, device: torch.device, *, as_leaves: bool = False) -> Any:
    """Copy every tensor of ``value`` to ``device``.

    With ``as_leaves`` the copies are detached leaves that require grad exactly where the
    originals did, ready to be a stage's inputs.
    """
    # A device-to-host copy must finish before the host reads it: only copies onto an
    # accelerator may be asynchronous.
    non_blocking = device.type != "cpu"

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        moved = leaf.detach().to(device, non_blocking=non_blocking)
        if as_leaves and leaf.requires_grad:
            moved.requires_grad_(True)
        return moved

    return tree_map(move, value)


class LocalTransport:
    """Mailboxes for stages that all live in this process."""

    def __init__(self, devices: list[torch.device]) -> None:
        self._devices = devices  # device of each stage
        self._mailbox: dict[Message, Any] = {}

    def send(self, message: Message, value: Any) -> None:
        device = self._devices[message.stage]
        as_leaves = message.channel is Channel.ACTIVATION
        self._mailbox[message] = to_device(value, device, as_leaves=as_leaves)

    def ready(self, message: Message) -> bool:
        return message in self._mailbox

    def recv(self, message: Message) -> Any:
        return self._mailbox.pop(message)

    def clear(self) -> None:
        self._mailbox.clear()
