"""The one configuration value: every rule of which layouts run, stated once and asked by
Pipe, ``gpipe train``, the planner and the capacity search."""

from __future__ import annotations

import doctest
import itertools

import pytest

import gpipe.layout
from gpipe.base.errors import PartitionError
from gpipe.base.remat import REMAT_MODES
from gpipe.layout import FLAGS, PIPE, SHARD_MODES, Layout, even_balance, layouts
from gpipe.schedule import SCHEDULES, ScheduleError, build_schedule, fill_drain


def test_defaults_come_from_the_schedule_table():
    assert Layout(schedule="interleaved-1f1b").virtual_stages == 2
    assert Layout(schedule="zb-v").virtual_stages == 2
    assert Layout(schedule="zb-auto").virtual_stages == 1
    assert Layout(schedule="1f1b").virtual_stages == 1
    built = build_schedule("dualpipe-v", num_ranks=2, num_microbatches=4)
    assert Layout(stages=2, chunks=4, schedule=built).virtual_stages == 2
    layout = Layout(stages=3, chunks=6, schedule="zb-v", replicas=2)
    assert (layout.num_stages, layout.processes) == (6, 6)


def test_a_layout_builds_its_schedule_and_refuses_as_the_builder_does():
    """The sizes rules are stated once (gpipe.schedule's table); a layout asks them."""
    for name in SCHEDULES:
        layout = Layout(stages=2, chunks=4, schedule=name)
        assert not layout.problems(), name
        built = build_schedule(name, num_ranks=2, num_microbatches=4)
        assert layout.build_schedule() == built and built.num_stages == layout.num_stages
    refused = Layout(stages=4, chunks=6, schedule="interleaved-1f1b")
    with pytest.raises(ScheduleError) as error:
        build_schedule("interleaved-1f1b", num_ranks=4, num_microbatches=6, virtual_stages=2)
    assert refused.problems()[0].split(": ", 1)[1] in str(error.value)


def test_every_problem_is_listed_with_its_values_and_a_remedy():
    problems = Layout(stages=0, chunks=0, checkpoint="sometimes", schedule="zigzag").problems(
        balance=[1, 1], layers=3, spelling=PIPE
    )
    text = "\n".join(problems)
    assert "the number of devices must be a positive int (pipeline ranks), got 0" in text
    assert "chunks must be a positive int (micro-batches), got 0" in text
    assert "checkpoint must be one of always, except_last, never, got 'sometimes'" in text
    assert "unknown schedule 'zigzag'; known: gpipe, 1f1b" in text
    assert "balance=[1, 1] sums to 2 layers, but the model has 3; e.g. balance=[2, 1]" in text


@pytest.mark.parametrize(
    ("layout", "context", "expected"),
    [
        (Layout(stages=4, chunks=6, schedule="interleaved-1f1b"), {},
         "6 micro-batches are not a multiple of its 4 ranks"),
        (Layout(stages=2, chunks=3, schedule="dualpipe-v"), {},
         "3 micro-batches are fewer than its 4 stages"),
        (Layout(stages=2, chunks=4, schedule="1f1b", virtual_stages=2), {},
         "it places one stage per rank, not 2; for several per rank use 'interleaved-1f1b'"),
        (Layout(stages=2, chunks=4, schedule="interleaved-1f1b", virtual_stages=1), {},
         "with 1 it is plain '1f1b'"),
        (Layout(stages=2, chunks=4, schedule="zb-v", virtual_stages=1), {},
         "it places 2 stages per rank in a V"),
        (Layout(stages=2, chunks=4, shard="all"), {},
         "shard='all' shards each stage over its replicas: it needs replicas >= 2, got 1"),
        (Layout(stages=2, chunks=4, shard="params"), {"spelling": PIPE},
         "shard='params' shards each stage over its replicas: it needs "
         "data_parallel_group's size >= 2, got 1: pass data_parallel_group="),
        (Layout(stages=2, chunks=4, replicas=2, shard=True), {},
         "shard must be one of params, all (or None: every replica holds all), got True"),
        (Layout(stages=2, chunks=4), {"balance": [1, 1, 1]},
         "balance=[1, 1, 1] has 3 entries, but stages=2 make 2 stages"),
        (Layout(stages=2, chunks=4), {"balance": [1, 1, 1], "spelling": PIPE},
         "balance=[1, 1, 1] has 3 entries, but 2 devices make 2 stages"),
        (Layout(stages=2, chunks=4), {"balance": [2, 0]}, "must be a positive int"),
        (Layout(stages=2, chunks=4), {"balance": []}, "balance is empty"),
        (Layout(stages=5, chunks=4), {"layers": 4}, "needs at least 5 layers"),
        (Layout(stages=2, chunks=4, replicas=4), {"batch": 6},
         "batch=6 must be divisible by replicas=4"),
        (Layout(stages=2, chunks=8), {"batch": 4}, "must have at least chunks=8 samples"),
        (Layout(stages=2, chunks=4, schedule=fill_drain(3, 2)), {},
         "schedule 'gpipe' is for 3 stages on 3 ranks and 2 micro-batches"),
        (Layout(chunks=4, checkpoint="always", checkpoint_layers=0), {},
         "checkpoint_layers must be a positive int (layers recomputed at a time) or None"),
        (Layout(chunks=4, checkpoint="never", checkpoint_layers=1), {},
         "checkpoint_layers=1 says how a re-materialized micro-batch is recomputed, but "
         "checkpoint='never' re-materializes none: use checkpoint always"),
    ],
)  # fmt: skip
def test_each_rule(layout, context, expected):
    problems = layout.problems(**context)
    assert len(problems) == 1 and expected in problems[0], problems
    with pytest.raises(PartitionError, match="invalid pipeline configuration"):
        layout.check(**context)


def test_the_command_line_spells_settings_as_flags():
    problems = Layout(stages=2, chunks=4, schedule="zb-v", virtual_stages=1, replicas=1,
                      shard="all").problems(balance=[1, 1, 1], spelling=FLAGS)  # fmt: skip
    text = "\n".join(problems)
    assert (
        "--shard all shards each stage over its replicas: it needs --replicas >= 2, got 1 (or "
        "leave --shard out)" in text
    )
    assert "--schedule zb-v, --virtual-stages 1, --chunks 4 on 2 ranks: it places 2" in text
    assert "--balance 1,1,1 has 3 entries, but --stages 2 make 2 stages" in text
    assert Layout(stages=5).problems(layers=4, spelling=FLAGS)[0].endswith("use --stages <= 4")
    never = Layout(checkpoint="never", checkpoint_layers=2).problems(spelling=FLAGS)
    assert never == [
        "--checkpoint-layers 2 says how a re-materialized micro-batch is recomputed, but "
        "--checkpoint never re-materializes none: use --checkpoint always (or except_last), "
        "or leave --checkpoint-layers out"
    ]


def test_canonical_layouts_train_alike():
    # one rank: gpipe holds every micro-batch, any other schedule one at a time (as 1f1b)
    one_at_a_time = Layout(stages=1, chunks=4, schedule="1f1b")
    assert Layout(stages=1, chunks=4, schedule="zb-h1").canonical() == one_at_a_time
    assert one_at_a_time.canonical() is one_at_a_time
    assert Layout(stages=1, schedule="1f1b").canonical() == Layout(stages=1, checkpoint="never")
    assert Layout(stages=1, schedule="interleaved-1f1b").canonical().virtual_stages == 1
    assert Layout(stages=2, chunks=1).canonical().checkpoint == "never"
    layout = Layout(stages=2, chunks=4, schedule="1f1b", checkpoint="always")
    assert layout.canonical() is layout
    one = Layout(stages=2, chunks=1, checkpoint_layers=1).canonical()
    assert (one.checkpoint, one.checkpoint_layers) == ("never", None)
    assert Layout(chunks=2, checkpoint="always", checkpoint_layers=3).label() == (
        "K=1 M=2 gpipe always per 3 layers"
    )


def test_layouts_enumerates_the_valid_canonical_ones_once():
    found = layouts(
        stages=[1, 2, 3], chunks=[1, 2, 3, 4], schedules=list(SCHEDULES),
        virtual_stages=[1, 2], replicas=[1, 2], shard=[None, *SHARD_MODES], processes=4, layers=6,
        batch=8,
    )  # fmt: skip
    assert len(found) == len(set(found))
    for layout in found:
        assert not layout.problems(layers=6, batch=8) and layout.canonical() == layout
        assert layout.processes <= 4
    brute = {
        Layout(stages=k, chunks=m, schedule=s, virtual_stages=v, checkpoint=c, replicas=r, shard=sh)
        for k, m, s, v, c, r, sh in itertools.product(
            [1, 2, 3], [1, 2, 3, 4], SCHEDULES, [1, 2], REMAT_MODES, [1, 2], [None, *SHARD_MODES]
        )
    }
    valid = {
        x for x in brute
        if not x.problems(layers=6, batch=8) and x.canonical() == x and x.processes <= 4
    }  # fmt: skip
    assert set(found) == valid
    assert Layout(stages=2, chunks=4, schedule="zb-v") in found
    assert Layout(stages=1, chunks=4, schedule="1f1b") in found
    assert not any(x.stages == 1 and x.schedule not in ("gpipe", "1f1b") for x in found)


def test_a_layout_is_written_and_read_as_a_dict():
    layout = Layout(stages=2, chunks=4, schedule="zb-v", replicas=2, shard="params")
    written = layout.to_dict()
    assert written == {
        "stages": 2, "chunks": 4, "schedule": "zb-v", "virtual_stages": 2,
        "checkpoint": "except_last", "checkpoint_layers": None, "replicas": 2, "shard": "params",
    }  # fmt: skip
    assert Layout.from_dict({**written, "balance": [1, 1, 1, 1]}) == layout  # others ignored
    built = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    assert Layout(stages=2, chunks=4, schedule=built).to_dict()["schedule"] == "1f1b"
    assert "R=2 sharded params M=4" in layout.label()


def test_even_balance():
    assert even_balance(10, 4) == [3, 3, 2, 2]
    assert even_balance(2, 3) == [1, 1]


def test_the_module_example_runs():
    assert doctest.testmod(gpipe.layout).failed == 0


def test_the_default_balance_splits_the_layers_evenly_over_every_stage():
    assert Layout(stages=2).default_balance(5) == [3, 2]
    assert Layout(stages=2, chunks=4, schedule="interleaved-1f1b").default_balance(9) == [
        3,
        2,
        2,
        2,
    ]
    assert Layout(stages=4, chunks=8, schedule="zb-v").default_balance(8) == [1] * 8
