"""Schedules as pure data (no tensors, no processes).

* ``ir``: the vocabulary — :class:`Action` (``F3@1``), :class:`Kind`, :class:`TimedAction`;
* ``builders``: :class:`Schedule` (per-rank action lists) and the built-in schedules;
* ``auto``: ``zb-auto``, a zero-bubble schedule searched for given costs and memory;
* ``check``: what :meth:`Schedule.validate` checks, and the communication model;
* ``routes``: which messages each action receives and sends (skip connections included);
* ``comm_plan``: each wire's message order, and where receives are posted;
* ``simulate``: per-action costs in, makespan, bubble and memory peaks out.
"""

from gpipe.schedule.auto import zb_auto  # also registers "zb-auto" in ALL_SCHEDULES
from gpipe.schedule.builders import (
    ALL_SCHEDULES,
    SCHEDULES,
    Schedule,
    build_schedule,
    default_virtual_stages,
    dualpipe_v,
    fill_drain,
    interleaved_1f1b,
    one_f_one_b,
    v_stage_to_rank,
    zb_h1,
    zb_v,
)
from gpipe.schedule.check import RECV_AHEAD
from gpipe.schedule.ir import Action, Kind, ScheduleError, TimedAction

__all__ = [
    "ALL_SCHEDULES",
    "RECV_AHEAD",
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "build_schedule",
    "default_virtual_stages",
    "dualpipe_v",
    "fill_drain",
    "interleaved_1f1b",
    "one_f_one_b",
    "v_stage_to_rank",
    "zb_auto",
    "zb_h1",
    "zb_v",
]
