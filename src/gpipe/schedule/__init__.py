"""Schedules as pure data (no tensors, no processes); its modules, one line each, are in
docs/architecture.md."""

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
