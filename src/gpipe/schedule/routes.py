"""Routes: which messages each action receives and sends, skip connections included.

A message is addressed by what it is (the activation entering stage ``s`` for micro-batch
``m``, or the gradient leaving it), never by who sends it, so the same runtime works
whether the neighbouring stage lives on another device of this process or in another
process. Pure data like the rest of :mod:`gpipe.schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpipe.schedule.ir import Kind

__all__ = ["Channel", "Message", "Routes"]


class Channel(StrEnum):
    ACTIVATION = "activation"  # output of stage s-1, input of stage s
    GRADIENT = "gradient"  # gradient of stage s+1's input, for stage s's output
    SKIP = "skip"  # a stashed tensor, from the stage that stashes it to the one that pops it
    SKIP_GRADIENT = "skip gradient"  # its gradient, back to the stage that stashed it

    @property
    def forward(self) -> bool:
        """Carries a stage's inputs (which need ``requires_grad`` leaves on arrival)."""
        return self in (Channel.ACTIVATION, Channel.SKIP)


@dataclass(frozen=True, slots=True)
class Message:
    channel: Channel
    stage: int  # the stage that receives it
    microbatch: int
    name: str = ""  # the skip connection's name, for SKIP and SKIP_GRADIENT


class Routes:
    """Which messages each action receives and sends: the one place that knows the wiring.

    ``F(m)@s`` receives the activation into ``s`` (unless s is the first stage) and the
    skip tensors ``s`` pops, and sends its output to ``s+1`` and its stashes to the stages
    that pop them. ``B(m)@s`` receives the gradient of its output and of its stashes and
    sends its input's gradient back, and the gradients of what it popped to their
    stashing stages. ``W`` moves nothing.
    """

    def __init__(self, num_stages: int, skips: dict[int, Any] | None = None) -> None:
        self.last = num_stages - 1
        self.skips = skips or {}  # stage -> gpipe.engine.skip.StageSkips
        # The runtime asks for every action of every step: each answer is worked out once.
        self._incoming: dict[Any, tuple[Message, ...]] = {}
        self._outgoing: dict[Any, tuple[Message, ...]] = {}

    def _skips(self, stage: int) -> tuple[dict[str, int], dict[str, int]]:
        view = self.skips.get(stage)
        return (view.inputs, view.outputs) if view is not None else ({}, {})

    def incoming(self, action: Any) -> tuple[Message, ...]:
        found = self._incoming.get(action)
        if found is None:
            found = self._incoming[action] = tuple(self._find_incoming(action))
        return found

    def outgoing(self, action: Any) -> tuple[Message, ...]:
        found = self._outgoing.get(action)
        if found is None:
            found = self._outgoing[action] = tuple(self._find_outgoing(action))
        return found

    def _find_incoming(self, action: Any) -> list[Message]:
        s, m = action.stage, action.microbatch
        popped, stashed = self._skips(s)
        if action.kind is Kind.FORWARD:
            head = [Message(Channel.ACTIVATION, s, m)] if s > 0 else []
            return head + [Message(Channel.SKIP, s, m, name) for name in popped]
        if action.kind is Kind.BACKWARD:
            head = [Message(Channel.GRADIENT, s, m)] if s < self.last else []
            return head + [Message(Channel.SKIP_GRADIENT, s, m, name) for name in stashed]
        return []

    def _find_outgoing(self, action: Any) -> list[Message]:
        s, m = action.stage, action.microbatch
        popped, stashed = self._skips(s)
        if action.kind is Kind.FORWARD:
            head = [Message(Channel.ACTIVATION, s + 1, m)] if s < self.last else []
            return head + [Message(Channel.SKIP, stage, m, n) for n, stage in stashed.items()]
        if action.kind is Kind.BACKWARD:
            head = [Message(Channel.GRADIENT, s - 1, m)] if s > 0 else []
            return head + [
                Message(Channel.SKIP_GRADIENT, stage, m, n) for n, stage in popped.items()
            ]
        return []

    def sender(self, message: Message) -> int:
        """The stage that sends ``message``."""
        popped, stashed = self._skips(message.stage)
        return {
            Channel.ACTIVATION: lambda: message.stage - 1,
            Channel.GRADIENT: lambda: message.stage + 1,
            Channel.SKIP: lambda: popped[message.name],
            Channel.SKIP_GRADIENT: lambda: stashed[message.name],
        }[message.channel]()
