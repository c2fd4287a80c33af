"""What the planner measures of the machine (``gpipe.planner.Machine``) and how a plan
uses it: the per-action and per-step fit, the slowdown, and a real measurement."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gpipe.__main__ import main
from gpipe.estimate.profile import Profile, profile
from gpipe.planner import Link, Machine, plan_from_profiles
from gpipe.planner.machine import _TINY_CHUNKS, _solve_runtime
from gpipe.schedule import build_schedule
from gpipe.schedule.simulate import Costs, simulate

FREE_LINK = Link(latency=0.0, bandwidth=1e30)


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_the_runtime_fit_recovers_known_times(devices):
    action, step, latency = 3e-4, 2e-3, 1e-4
    times = {}
    for chunks in _TINY_CHUNKS:
        schedule = build_schedule("1f1b", num_ranks=devices, num_microbatches=chunks)
        costs = Costs(forward=action, backward=action, weight=0.0)
        transfer = latency if devices > 1 else 0.0
        times[chunks] = simulate(schedule, costs, transfer=transfer).makespan + step
    fitted_action, fitted_step = _solve_runtime(times, devices, latency)
    assert fitted_action == pytest.approx(action, rel=1e-6)
    assert fitted_step == pytest.approx(step, rel=1e-6)


def test_slowdown_is_looked_up_at_the_nearest_measured_micro_batch_count():
    machine = Machine(slowdown={(2, 4): 1.5, (2, 16): 2.0, (1, 4): 0.9})
    assert machine.slowdown_at(2, 4) == 1.5
    assert machine.slowdown_at(2, 32) == 2.0
    assert machine.slowdown_at(2, 8) == 1.5  # as near to 4 as to 16: the smaller
    assert machine.slowdown_at(1, 64) == 0.9
    assert machine.slowdown_at(3, 4) == 1.0  # nothing measured with 3 processes
    with pytest.raises(ValueError, match="positive"):
        Machine(slowdown={(2, 4): 0.0})
    with pytest.raises(ValueError, match="action >= 0"):
        Machine(action=-1.0)


def test_a_plan_predicts_with_the_machine():
    prof = Profile.from_costs([1e-3] * 4, param_bytes=1 << 20, activation_bytes=1 << 20,
                              saved_bytes=1 << 20, batch_size=8)  # fmt: skip
    machine = Machine(link=FREE_LINK, action=1e-4, step=5e-3, slowdown={(2, 4): 1.5})
    result = plan_from_profiles(prof, batch_size=8, devices=2, stages=[2], chunks=[4],
                                schedules=["1f1b"], checkpoints=["never"], virtual_stages=[1],
                                machine=machine)  # fmt: skip
    (only,) = result.candidates
    assert only.balance == (2, 2)
    # 2 of 8 samples a micro-batch: forward 0.25 ms and backward 0.5 ms a layer, two layers
    # a stage, times 1.5; plus the runtime's 0.1 ms per action, and 5 ms per step
    costs = Costs(forward=0.5e-3 * 1.5 + 1e-4, backward=1e-3 * 1.5 + 1e-4, weight=0.0)
    schedule = build_schedule("1f1b", num_ranks=2, num_microbatches=4)
    assert only.step_time == pytest.approx(simulate(schedule, costs).makespan + 5e-3)
    assert str(machine) in result.table()
    # link and overhead given beside a machine replace its own
    other = plan_from_profiles(prof, batch_size=8, devices=2, stages=[2], chunks=[4],
                               schedules=["1f1b"], checkpoints=["never"], virtual_stages=[1],
                               machine=machine, overhead=0.0)  # fmt: skip
    assert other.machine.action == 0.0 and other.machine.step == 5e-3
    assert other.candidates[0].step_time < only.step_time


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_measuring_the_machine_runs_the_model_in_processes():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)))
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    profiles = {
        m: profile(model, x[: 16 // m], target=y[: 16 // m], loss_fn=F.mse_loss, repeats=2,
                   warmup=1)
        for m in (2, 4)
    }  # fmt: skip
    machine = Machine.measure(model, x, profiles, devices=2, target=y, loss_fn=F.mse_loss,
                              rounds=2)  # fmt: skip
    assert machine.measured and "measured" in str(machine)
    assert set(machine.slowdown) == {(1, 2), (1, 4), (2, 2), (2, 4)}
    for factor in machine.slowdown.values():  # a generous bound: a loaded machine is slow
        assert 0.01 < factor < 100 and math.isfinite(factor)
    assert machine.link.latency > 0 and machine.link.bandwidth > 0
    assert machine.action >= 0 and machine.step >= 0
    with pytest.raises(ValueError, match="at least one"):
        Machine.measure(model, x, {}, devices=2)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_cli_calibrates_before_it_ranks(capsys):
    code = main(["plan", "--model", "gpt", "--model-config", "n_layers=1,d_model=16,n_heads=2",
                 "--seq", "8", "--batch", "4", "--processes", "2", "--search-chunks",
                 "2", "--profile-repeats", "1", "--profile-warmup", "0", "--top", "2",
                 "--calibrate"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "compute slowdown K=1 M=2" in out and "K=2 M=2" in out and "(measured)" in out


def uneven_profile() -> Profile:
    """Eight layers of uneven cost: the last stages cost most."""
    return Profile.from_costs([0.5e-3, 0.5e-3, 1e-3, 1e-3, 1e-3, 2e-3, 2e-3, 3e-3],
                              param_bytes=1 << 20, activation_bytes=1 << 20,
                              saved_bytes=1 << 20, batch_size=8)  # fmt: skip


def test_zb_auto_is_built_from_the_best_candidates_costs_and_runs():
    # hand-overs as slow as an action: where the hand-made orders wait, zb-auto does not
    machine = Machine(link=Link(latency=1e-3, bandwidth=1e9), action=1e-4)
    result = plan_from_profiles(uneven_profile(), batch_size=8, devices=4, stages=[4],
                                chunks=[4, 8], checkpoints=["never"], machine=machine)  # fmt: skip
    autos = [c for c in result.candidates if c.schedule == "zb-auto"]
    # the best (K, M, checkpoint) candidates' configurations, one stage a rank and V-placed
    assert {c.virtual_stages for c in autos} == {1, 2}
    assert result.candidates[0].schedule == "zb-auto"
    for c in autos:
        schedule = c.pipe_kwargs()["schedule"]
        assert schedule.num_ranks == 4 and schedule.num_microbatches == c.chunks
        # its predicted step is the simulation of the schedule it carries, with its costs
        costs, transfer = machine.stage_costs(uneven_profile().scaled(1 / c.chunks),
                                              c.balance, schedule, "never")  # fmt: skip
        makespan = simulate(schedule, costs, transfer=transfer).makespan
        assert c.step_time == pytest.approx(machine.step_time(makespan, 4, c.chunks))
        # kept only where faster than every hand-made schedule of its layout
        same = [o for o in result.candidates if o.schedule != "zb-auto" and
                (o.virtual_stages, o.chunks) == (c.virtual_stages, c.chunks)]  # fmt: skip
        assert all(c.throughput > o.throughput for o in same)
    # named, it is tried for every configuration; refine=0 leaves it out
    named = plan_from_profiles(uneven_profile(), batch_size=8, devices=2, stages=[2],
                               chunks=[4], checkpoints=["never"], schedules=["zb-auto"],
                               machine=machine)  # fmt: skip
    assert {c.schedule for c in named.candidates} == {"zb-auto"}
    plain = plan_from_profiles(uneven_profile(), batch_size=8, devices=2, stages=[2],
                               chunks=[4], checkpoints=["never"], machine=machine,
                               refine=0)  # fmt: skip
    assert "zb-auto" not in {c.schedule for c in plain.candidates}


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_zb_auto_candidate_verifies_and_trains_the_unsplit_models_gradients():
    from gpipe.planner import verify

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    prof = {m: profile(model, x[: 8 // m], target=y[: 8 // m], loss_fn=F.mse_loss, repeats=1,
                       warmup=0) for m in (4,)}  # fmt: skip
    result = plan_from_profiles(prof, batch_size=8, devices=2, stages=[2], chunks=[4],
                                checkpoints=["never"], schedules=["zb-auto"],
                                virtual_stages=[1])  # fmt: skip
    (candidate,) = result.candidates
    (checked,) = verify(result, model, x, y, F.mse_loss, top=1, steps=1, warmup=0, rounds=1)
    assert checked.step_time > 0
    # the schedule it carries gives the un-split model's gradients (one process, 2 devices)
    import gpipe

    reference = [p.grad for p in _grads(model, x, y)]
    pipe = gpipe.Pipe(copy.deepcopy(model), devices=["cpu", "cpu"], **candidate.pipe_kwargs())
    pipe.step(x, y, F.mse_loss)
    for got, want in zip((p.grad for p in pipe.parameters()), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[nn.Parameter]:
    copied = copy.deepcopy(model)
    F.mse_loss(copied(x), y).backward()
    return list(copied.parameters())
