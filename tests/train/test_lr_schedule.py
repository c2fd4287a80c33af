"""The learning rate of each step (``gpipe.train.lr_schedule``): the documented formula, a
resume that continues bitwise, and a resume with more steps that moves the horizon without
a jump. The scheduler's state goes through JSON, as in a checkpoint's manifest."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest
import torch

from gpipe.train import lr_schedule

LR = 3e-3


def documented(step: int, *, kind: str, warmup: int, steps: int) -> float:
    """The module docstring's formula (the hand-written one the trainer had before)."""
    warmup = max(warmup, 1)
    if step <= warmup:
        return LR * step / warmup
    if kind == "constant":
        return LR
    progress = (step - warmup) / max(1, steps - warmup)
    if kind == "linear":
        return LR * (1 - progress)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer() -> torch.optim.Optimizer:
    decay, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [decay]}, {"params": [bias], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR)


def train(opt, scheduler, steps: range) -> dict[int, float]:
    """The trainer's order: the step's rate, then the optimizer's step."""
    rates = {}
    for step in steps:
        lr_schedule.advance(scheduler, step)
        rates[step] = opt.param_groups[0]["lr"]
        assert all(g["lr"] == rates[step] for g in opt.param_groups)
        opt.step()
    return rates


def checkpoint(opt, scheduler) -> tuple[dict, dict]:
    return opt.state_dict(), json.loads(json.dumps(lr_schedule.state(scheduler)))


def resumed(saved: tuple[dict, dict], *, kind: str, warmup: int, steps: int, was: int):
    """A new optimizer and scheduler loaded as ``Trainer._load`` loads them."""
    opt = optimizer()
    scheduler = lr_schedule.build(opt, kind=kind, lr=LR, warmup=warmup, steps=steps)
    opt.load_state_dict(saved[0])
    lr_schedule.load_state(scheduler, saved[1])
    if steps != was:
        lr_schedule.stretch(scheduler, warmup=warmup, steps=steps)
    return opt, scheduler


@pytest.mark.parametrize("kind", lr_schedule.LR_SCHEDULES)
@pytest.mark.parametrize("warmup", [0, 1, 2, 5])
def test_each_steps_rate_is_the_documented_formula(kind, warmup):
    opt = optimizer()
    scheduler = lr_schedule.build(opt, kind=kind, lr=LR, warmup=warmup, steps=40)
    rates = train(opt, scheduler, range(1, 41))
    for step, rate in rates.items():
        expected = documented(step, kind=kind, warmup=warmup, steps=40)
        assert rate == pytest.approx(expected, rel=1e-12, abs=1e-18), step
    assert rates[max(warmup, 1)] == LR
    assert rates[40] == pytest.approx({"cosine": LR / 10, "linear": 0, "constant": LR}[kind])


@pytest.mark.parametrize("kind", lr_schedule.LR_SCHEDULES)
@pytest.mark.parametrize("stop", [3, 5, 20])  # in the warm-up, at its end, in the decay
def test_a_resume_with_the_same_steps_is_bitwise_the_uninterrupted_run(kind, stop):
    opt = optimizer()
    whole = train(opt, lr_schedule.build(opt, kind=kind, lr=LR, warmup=5, steps=40), range(1, 41))
    opt = optimizer()
    scheduler = lr_schedule.build(opt, kind=kind, lr=LR, warmup=5, steps=40)
    first = train(opt, scheduler, range(1, stop + 1))
    opt, scheduler = resumed(checkpoint(opt, scheduler), kind=kind, warmup=5, steps=40, was=40)
    with warnings.catch_warnings():  # and in silence: torch's order warning is a false alarm
        warnings.simplefilter("error")
        rest = train(opt, scheduler, range(stop + 1, 41))
    assert {**first, **rest} == whole  # exact


@pytest.mark.parametrize("kind", ["cosine", "linear"])
@pytest.mark.parametrize("stop", [20, 40])  # in the decay, at its end
def test_a_resume_with_more_steps_goes_on_from_its_rate_to_the_new_end(kind, stop):
    opt = optimizer()
    scheduler = lr_schedule.build(opt, kind=kind, lr=LR, warmup=5, steps=40)
    whole = train(opt, scheduler, range(1, stop + 1))
    opt, scheduler = resumed(checkpoint(opt, scheduler), kind=kind, warmup=5, steps=60, was=40)
    rates = {**whole, **train(opt, scheduler, range(stop + 1, 61))}

    end = {"cosine": LR / 10, "linear": 0.0}[kind]
    assert rates[60] == pytest.approx(end, abs=1e-15)
    if stop == 40:  # the decay had ended: the rate stays where it stood
        assert all(rates[s] == pytest.approx(end, abs=1e-15) for s in range(40, 61))
        return
    # No jump: each step's rate falls at most as fast as the uninterrupted run's ever does.
    drops = [rates[s + 1] / rates[s] for s in range(5, 60) if rates[s + 1] > 0]
    uninterrupted = [documented(s, kind=kind, warmup=5, steps=40) for s in range(5, 41)]
    steepest = min(b / a for a, b in itertools.pairwise(uninterrupted) if b > 0)
    assert all(steepest <= d <= 1 for d in drops), (steepest, min(drops), max(drops))
    before = documented(stop + 1, kind=kind, warmup=5, steps=40) / whole[stop]
    assert rates[stop + 1] / rates[stop] >= before  # gentler than where the 40 steps went


def test_a_resume_with_more_steps_in_the_warm_up_is_the_longer_run():
    opt = optimizer()
    scheduler = lr_schedule.build(opt, kind="cosine", lr=LR, warmup=5, steps=40)
    first = train(opt, scheduler, range(1, 4))
    opt, scheduler = resumed(checkpoint(opt, scheduler), kind="cosine", warmup=5, steps=60, was=40)
    rates = {**first, **train(opt, scheduler, range(4, 61))}
    for step, rate in rates.items():
        assert rate == pytest.approx(documented(step, kind="cosine", warmup=5, steps=60), rel=1e-12)


def test_an_unknown_schedule_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"'step'.*cosine, linear, constant"):
        lr_schedule.build(optimizer(), kind="step", lr=LR, warmup=0, steps=10)
