"""Schedules as pure data (no tensors, no processes).

* ``actions``: the vocabulary — :class:`Action` (``F3@1``), :class:`Kind`,
  :class:`TimedAction`, :class:`ScheduleError`;
* ``ir``: :class:`Schedule`, per-rank action lists (it re-exports the vocabulary);
* ``builders``: the hand-written schedules (GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipe-V);
* ``auto``: ``zb-auto``, a zero-bubble schedule searched for given costs and memory;
* ``registry``: the one table of named schedules (:data:`SCHEDULES`), :func:`build_schedule`;
* ``check``: what :meth:`Schedule.validate` checks, and the communication model;
* ``routes``: which messages each action receives and sends (skip connections included);
* ``comm_plan``: each wire's message order, and where receives are posted;
* ``simulate``: per-action costs in, makespan, bubble and memory peaks out.
"""

from gpipe.schedule.auto import zb_auto
from gpipe.schedule.builders import (
    dualpipe_v,
    fill_drain,
    interleaved_1f1b,
    one_f_one_b,
    v_stage_to_rank,
    zb_h1,
    zb_v,
)
from gpipe.schedule.check import RECV_AHEAD
from gpipe.schedule.ir import Action, Kind, Schedule, ScheduleError, TimedAction
from gpipe.schedule.registry import SCHEDULES, ScheduleSpec, build_schedule, schedule_spec

__all__ = [
    "RECV_AHEAD",
    "SCHEDULES",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "TimedAction",
    "build_schedule",
    "dualpipe_v",
    "fill_drain",
    "interleaved_1f1b",
    "one_f_one_b",
    "schedule_spec",
    "v_stage_to_rank",
    "zb_auto",
    "zb_h1",
    "zb_v",
]
