"""The order of messages on each wire, and where a rank posts each receive.

Messages between two ranks are received in the order the sender sends them, which the
schedule fixes (:func:`wire_order`). Backends that run a process's operations in issue
order (NCCL) also need each receive posted where it cannot hold back a send the peer is
waiting on (:func:`receive_points`); why, and how the transport uses both, is told in
:mod:`gpipe.transport.distributed`.
"""

from __future__ import annotations

from typing import Any

from gpipe.schedule.ir import Action, Kind
from gpipe.schedule.routes import Message, Routes

__all__ = ["Wires", "receive_points", "wire_order"]

Wires = dict[int, list[Message]]  # peer rank -> messages in wire order


def _actions(schedule: Any, training: bool) -> list[list[Action]]:
    """Each rank's actions of a training step, or of inference (forwards only)."""
    return [
        [a for a in actions if training or a.kind is Kind.FORWARD] for actions in schedule.actions
    ]


def wire_order(schedule: Any, routes: Routes, rank: int, training: bool) -> tuple[Wires, Wires]:
    """Per peer: the messages ``rank`` receives from it, and sends to it, in order."""
    s2r = schedule.stage_to_rank
    incoming: Wires = {}
    outgoing: Wires = {}
    for sender, actions in enumerate(_actions(schedule, training)):
        for action in actions:
            for message in routes.outgoing(action):
                dst = s2r[message.stage]
                if sender == dst:
                    continue
                if dst == rank:
                    incoming.setdefault(sender, []).append(message)
                if sender == rank:
                    outgoing.setdefault(dst, []).append(message)
    return incoming, outgoing


def receive_points(
    schedule: Any, routes: Routes, rank: int, training: bool
) -> dict[Action, list[tuple[int, Message]]]:
    """Where ``rank`` posts each receive so that no transfer waits on a later one.

    The ranks' action lists are run in clock order (round robin, an action as soon as
    its inputs exist). A message from another rank is received at the point of
    ``rank``'s list where that rank stood when the message was sent: before the action
    returned here as key. Every process then issues its sends and receives in the order
    of one global sequence in which each send is followed by its receive, which is what
    backends that run operations in issue order (NCCL) need to never deadlock.
    """
    s2r = schedule.stage_to_rank
    lists = _actions(schedule, training)
    cursors = [0] * len(lists)
    produced: set[Message] = set()
    points: dict[Action, list[tuple[int, Message]]] = {}
    remaining = sum(map(len, lists))
    while remaining:
        progressed = False
        for r, actions in enumerate(lists):
            if cursors[r] == len(actions):
                continue
            action = actions[cursors[r]]
            if not all(message in produced for message in routes.incoming(action)):
                continue
            cursors[r] += 1
            remaining -= 1
            progressed = True
            for message in routes.outgoing(action):
                produced.add(message)
                if s2r[message.stage] == rank != r:
                    # rank has not consumed it yet, so its cursor is on a later action
                    points.setdefault(lists[rank][cursors[rank]], []).append((r, message))
        if not progressed:
            raise RuntimeError(f"schedule {schedule.name!r} cannot run: check Schedule.validate()")
    return points
