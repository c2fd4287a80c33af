"""Every gradient path, in every schedule and re-materialization mode: each parameter's
gradient (the loss's own tensors and the input's included) equals plain PyTorch's in
float64, in one process and across two (cases: tests/engine/gradient_paths.py)."""

from __future__ import annotations

import pytest

import gpipe
from engine.gradient_paths import (
    BALANCE,
    CASES,
    SCHEDULES,
    batch,
    model_of,
    pipelined,
    plain,
    rank_steps,
    regularized,
    worst_error,
)
from gpipe.base.errors import PartitionError

MODES = ["always", "except_last", "never"]


def _options(schedule: str, devices: int, virtual: int | None, mode: str) -> dict:
    return {
        "devices": ["cpu"] * devices,
        "schedule": schedule,
        "virtual_stages": virtual,
        "checkpoint": mode,
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("schedule", "devices", "virtual"), SCHEDULES, ids=lambda s: str(s))
@pytest.mark.parametrize("case", CASES)
def test_every_gradient_equals_the_plain_models(case, schedule, devices, virtual, mode):
    ours = pipelined(case, 2, 4, **_options(schedule, devices, virtual, mode))
    theirs = plain(case, 2, 4)
    assert set(ours) == set(theirs), "a tensor the plain model trains got no gradient"
    worst, where = worst_error(ours, theirs)
    assert worst <= 1e-10, f"worst gradient error {worst:.3g} at {where}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", CASES)
def test_recomputing_one_layer_at_a_time_too(case, schedule):
    """checkpoint_layers=1: each layer recomputed from its input, the generator's state and
    the user's input included (split schedules recompute whole stages)."""
    options = _options(schedule, 4, None, "always")
    ours = pipelined(case, 2, 4, checkpoint_layers=1, **options)
    theirs = plain(case, 2, 4)
    assert set(ours) == set(theirs)
    worst, where = worst_error(ours, theirs)
    assert worst <= 1e-10, f"worst gradient error {worst:.3g} at {where}"


def test_a_stage_autograd_cannot_split_warns_and_stays_exact():
    """A reentrant checkpoint refuses .grad: that stage's B runs its whole backward."""
    with pytest.warns(UserWarning, match=r"runs whole in B.*use_reentrant=False"):
        ours = pipelined("reentrant", 1, 4, **_options("zb-h1", 4, None, "never"))
    worst, where = worst_error(ours, plain("reentrant", 1, 4))
    assert worst <= 1e-10, f"worst gradient error {worst:.3g} at {where}"


@pytest.mark.parametrize(("schedule", "devices", "virtual"), SCHEDULES, ids=lambda s: str(s))
def test_a_loss_reading_another_stages_parameter_is_refused(schedule, devices, virtual):
    model = model_of("plain")
    pipe = gpipe.Pipe(
        model, balance=BALANCE, chunks=4, **_options(schedule, devices, virtual, "never")
    )
    with pytest.raises(
        PartitionError, match=r"loss_fn reads 2\.weight, which the last stage \(3\)"
    ):
        pipe.step(*batch(0), regularized(model))
    assert all(p.grad is None for p in pipe.parameters()), "a refused step changed gradients"


TWO_PROCESSES = [
    ("temperature", {"schedule": "zb-v", "checkpoint": "never", "chunks": 4}),
    ("passed-on", {"schedule": "zb-v", "checkpoint": "except_last", "chunks": 4}),
    ("temperature", {"schedule": "dualpipe-v", "checkpoint": "always", "chunks": 4}),
    ("adaptive", {"schedule": "zb-auto", "virtual_stages": 2, "checkpoint": "never", "chunks": 3}),
    ("input-grad", {"schedule": "zb-v", "checkpoint": "always", "chunks": 4}),
    ("regularizer", {"schedule": "zb-v", "checkpoint": "never", "chunks": 4}),
]


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_two_processes_equal_the_plain_model():
    ranks = gpipe.launch(rank_steps, nprocs=2, args=(TWO_PROCESSES,), timeout=120)
    for index, (case, options) in enumerate(TWO_PROCESSES):
        results = [rank[index] for rank in ranks]
        if case == "regularizer":  # the last stage's rank (0 in a V) refuses, naming it
            assert "loss_fn reads 2.weight" in results[0]["error"], results
            continue
        ours = {name: g for result in results for name, g in result["grads"].items()}
        theirs = plain(case, 2, options["chunks"])
        assert set(ours) == set(theirs), case
        worst, where = worst_error(ours, theirs)
        assert worst <= 1e-10, f"{case}: worst gradient error {worst:.3g} at {where}"


def test_a_captured_models_parameter_in_the_loss_is_refused_by_the_models_name():
    model = model_of("plain")
    pipe = gpipe.Pipe.from_model(
        model, batch(0)[0], split=["2", "4"], balance=[2, 2], chunks=2, schedule="zb-h1"
    )
    with pytest.raises(
        PartitionError, match=r"loss_fn reads 2\.weight, which the last stage \(1\)"
    ):
        pipe.step(*batch(0), regularized(model))
