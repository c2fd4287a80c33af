"""``gpipe plan``'s options: generated from ``PlanConfig``, the ones ``gpipe train`` has too
with its meaning and choices, and every bad value one line."""

from __future__ import annotations

from dataclasses import fields

import pytest

from gpipe.__main__ import main
from gpipe.cli.plan_config import PlanConfig, resolve_plan
from gpipe.train import TrainConfig
from gpipe.train.config import option


def test_an_option_train_has_too_means_the_same_there():
    shared = [f for f in fields(PlanConfig) if f.name in TrainConfig.__dataclass_fields__]
    assert {f.name for f in shared} >= {"model", "size", "seq", "batch", "optimizer", "threads"}
    for f in shared:
        ours, theirs = option(f), option(TrainConfig.__dataclass_fields__[f.name])
        assert ours.help == theirs.help and ours.choices == theirs.choices, f.name


def test_the_ranges_searched_are_lists_under_their_own_names():
    config = resolve_plan(PlanConfig(search_stages="1,2,4", search_checkpoint_layers="stage,2",
                                     search_schedules="gpipe,1f1b", memory="2GiB"))  # fmt: skip
    assert config.search_stages == [1, 2, 4] and config.search_checkpoint_layers == [None, 2]
    assert config.search_schedules == ["gpipe", "1f1b"] and config.memory == 2**31


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--search-stages", "1,x"], "--search-stages 1,x: give whole numbers >= 1"),
        (["--search-replicas", "0"], "--search-replicas 0: give whole numbers >= 1"),
        (["--search-checkpoint-layers", "stage,0"], "--search-checkpoint-layers stage,0:"),
        (["--baseline-memory", "1.2.3MiB"], "--baseline-memory 1.2.3MiB: cannot read"),
        (["--threads", "-1"], "--threads -1: give a whole number >= 0"),
        (["--top", "0"], "--top 0: give a whole number >= 1"),
        (["--processes", "two"], "argument --processes: invalid int value: 'two'"),
        (["--search-shard", "yes"], "argument --search-shard: invalid choice: 'yes'"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_flag(capsys, argv, message):
    try:
        code = main(["plan", *argv])
    except SystemExit as stop:  # argparse's refusals
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
