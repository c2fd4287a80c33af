"""Transport between stages that all live in this process: device copies in a mailbox."""

from __future__ import annotations

from typing import Any

import torch

from gpipe.base._utils import to_device
from gpipe.schedule.routes import Message

__all__ = ["LocalTransport"]


class LocalTransport:
    """Mailboxes for stages that all live in this process."""

    kind = "local"  # what Pipe.transport says

    def __init__(self, devices: list[torch.device]) -> None:
        self._devices = devices  # device of each stage
        self._mailbox: dict[Message, Any] = {}

    def prepare(self, action: Any) -> None:
        pass  # copies between devices of one process are never posted ahead

    def send(self, message: Message, value: Any) -> None:
        device = self._devices[message.stage]
        self._mailbox[message] = to_device(value, device, as_leaves=message.channel.forward)

    def ready(self, message: Message) -> bool:
        return message in self._mailbox

    def recv(self, message: Message) -> Any:
        return self._mailbox.pop(message)

    def begin(self, training: bool) -> None:
        self._mailbox.clear()

    def finish(self) -> None:
        pass  # copies are done when send() returns

    def clear(self) -> None:
        self._mailbox.clear()
