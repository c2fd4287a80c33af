"""The one table of named schedules (``SCHEDULES``) and ``build_schedule``."""

import doctest

import pytest

import gpipe.schedule.registry
from gpipe.schedule import (
    SCHEDULES,
    ScheduleError,
    build_schedule,
    dualpipe_v,
    one_f_one_b,
    zb_v,
)
from gpipe.schedule.simulate import Costs


def test_module_docstring_examples():
    result = doctest.testmod(gpipe.schedule.registry)
    assert result.attempted > 0 and result.failed == 0


def test_build_schedule_by_name():
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        schedule = build_schedule(name, num_ranks=2, num_microbatches=4)
        assert schedule.name == name
    assert build_schedule("1f1b", num_ranks=3, num_microbatches=5) == one_f_one_b(3, 5)


def test_unknown_schedule_lists_known_names():
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zb-h3'.*gpipe, 1f1b"):
        build_schedule("zb-h3", num_ranks=2, num_microbatches=4)


def test_virtual_stages_need_interleaved():
    with pytest.raises(ScheduleError, match=r"virtual_stages=2: .*one stage per rank.*interleaved"):
        build_schedule("1f1b", num_ranks=2, num_microbatches=4, virtual_stages=2)


def test_by_name_and_default_virtual_stages():
    assert set(SCHEDULES) == {
        "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "zb-auto"
    }  # fmt: skip
    defaults = [SCHEDULES[n].default_virtual_stages for n in ("1f1b", "zb-v", "dualpipe-v")]
    assert defaults == [1, 2, 2] and SCHEDULES["zb-auto"].default_virtual_stages == 1
    assert SCHEDULES["interleaved-1f1b"].default_virtual_stages == 2
    assert build_schedule("zb-v", num_ranks=3, num_microbatches=6) == zb_v(3, 6)
    assert build_schedule("dualpipe-v", num_ranks=2, num_microbatches=4, virtual_stages=2) == (
        dualpipe_v(2, 4)
    )
    assert build_schedule("zb-auto", num_ranks=3, num_microbatches=6).name == "zb-auto"


def test_errors_name_the_value_and_the_remedy():
    with pytest.raises(ScheduleError, match=r"virtual_stages=1: it places 2 stages per rank in"):
        build_schedule("zb-v", num_ranks=3, num_microbatches=6, virtual_stages=1)
    with pytest.raises(ScheduleError, match=r"takes no options, got costs.*'zb-auto'"):
        build_schedule("zb-h1", num_ranks=2, num_microbatches=4, costs=Costs())
