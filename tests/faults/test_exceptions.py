"""An exception in one rank (forward, backward, a killed process) reaches every rank at once,
names the rank, and leaves the gradients and no process behind."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.parallel.launch import LaunchError, launch
from gpipe.transport.inquest import grace
from injected_faults import BackwardFault, data_parallel_fault, faulty, faulty_backward
from pipe.test_pipe import make_case
from reference import even_balance, twin, worst_gradient_error

pytestmark = pytest.mark.timeout(300)  # multi-process: a hang fails


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_failed_step_leaves_the_gradients_as_they_were(schedule):
    torch.manual_seed(0)
    fault = BackwardFault(at=0)  # armed below
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), fault, nn.Linear(8, 3)).double()
    plain = twin(model)
    pipe = gpipe.Pipe(model, balance=[2, 2], chunks=4, schedule=schedule)
    batches = [
        (torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))) for _ in range(3)
    ]
    pipe.step(*batches[0], F.cross_entropy)  # gradients accumulate over steps 0 and 2
    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    fault.calls, fault.at = 0, 1  # the first forward that builds a graph
    with pytest.raises(KeyError, match="injected fault in backward"):
        pipe.step(*batches[1], F.cross_entropy)
    fault.at = 0
    for name, p in pipe.named_parameters():
        assert torch.equal(p.grad, before[name]), name
    pipe.step(*batches[2], F.cross_entropy)
    for x, y in (batches[0], batches[2]):
        F.cross_entropy(plain(x), y).backward()
    worst, name = worst_gradient_error(pipe, plain)
    assert worst < 1e-10, name


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_loss_that_does_not_require_grad_is_an_error(checkpoint):
    model, x, y, _ = make_case("mlp", torch.float64)
    pipe = gpipe.Pipe(model, balance=even_balance(len(model), 2), chunks=2, checkpoint=checkpoint)
    with pytest.raises(RuntimeError, match="does not require grad"):
        pipe.step(x, y, lambda out, t: F.cross_entropy(out, t).detach())
    assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize(
    ("stages", "fault_stage", "after_steps", "ordered"),
    [(2, 1, 0, False), (2, 0, 0, False), (3, 1, 0, False), (3, 1, 2, False), (3, 2, 2, True)],
    ids=["last", "first", "middle", "middle-after-steady-steps", "last-nccl-order"],
)
@pytest.mark.slow
def test_exception_in_one_stage_reaches_every_rank(stages, fault_stage, after_steps, ordered):
    timeout = 20.0
    args = (stages, fault_stage, 2, "raise", timeout, after_steps, ordered)
    outcomes = launch(faulty, stages, args=args, timeout=30)
    for rank, outcome in enumerate(outcomes):
        assert "injected fault at micro-batch 2" in outcome["message"]
        assert outcome["seconds"] < timeout
        if rank == fault_stage:
            assert outcome["type"] == "KeyError"  # the original exception, unchanged
        else:
            assert outcome["pipeline_error"]
            assert outcome["rank"] == fault_stage
            assert f"rank {fault_stage}" in outcome["message"]
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("stages", "fault_stage", "at", "schedule", "checkpoint", "before"),
    [
        (2, 0, 1, "gpipe", "except_last", 0),  # stalled the others for the whole timeout
        (2, 0, 2, "gpipe", "never", 0),
        (2, 1, 1, "gpipe", "except_last", 0),
        (3, 1, 2, "gpipe", "except_last", 0),
        (3, 0, 1, "1f1b", "always", 0),
        (2, 0, 1, "zb-h1", "except_last", 0),
        (2, 0, 1, "gpipe", "except_last", 2),  # after two other pipelines in the processes
    ],
)
@pytest.mark.slow
def test_exception_in_a_backward_reaches_every_rank_at_once(
    stages, fault_stage, at, schedule, checkpoint, before
):
    timeout = 20.0
    args = (stages, fault_stage, at, schedule, checkpoint, timeout, before)
    outcomes = launch(faulty_backward, stages, args=args, timeout=30)
    for rank, outcome in enumerate(outcomes):
        assert "injected fault in backward" in outcome["message"], outcome
        # Not waiting the timeout out, nor the grace for a statement of a peer that left.
        assert outcome["seconds"] < grace(timeout), outcome
        if rank == fault_stage:
            assert outcome["type"] == "KeyError"
        else:
            assert outcome["type"] == "PipelineError" and outcome["rank"] == fault_stage
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_killed_rank_makes_the_others_fail_within_the_timeout():
    timeout = 10.0
    with pytest.raises(LaunchError) as info:
        launch(faulty, 2, args=(2, 1, 1, "kill", timeout), timeout=30, grace=40)
    error = info.value
    assert error.failures[1] == "killed by signal 9"
    survivor = error.results[0]
    assert survivor["pipeline_error"], survivor
    assert "rank 1" in survivor["message"]
    assert survivor["seconds"] < 2 * timeout
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_launch_reports_the_failing_rank_and_leaves_no_process():
    with pytest.raises(LaunchError, match=r"rank 1: ZeroDivisionError"):
        launch(_divide_on_rank_one, 2, timeout=10)
    assert not multiprocessing.active_children()


def _divide_on_rank_one(rank):
    return 1 / (1 - rank)


@pytest.mark.slow
def test_a_data_parallel_failure_names_the_rank_that_raised_not_its_replica_peer(tmp_path):
    # 2 replicas x 2 stages: rank 3 raises in a forward and stays alive; rank 0 waits on
    # rank 2 (its replica peer, which learnt it from rank 3), rank 1 on rank 3
    outcomes = launch(data_parallel_fault, 4, args=("raise", False, 4.0, str(tmp_path)),
                      timeout=600)  # fmt: skip
    assert outcomes[3]["type"] == "KeyError", outcomes[3]
    raised = "rank 3 (stage 1) raised KeyError: 'injected fault at micro-batch 0'"
    assert outcomes[0]["message"].startswith(f"rank 3 failed (rank 2 waits on it): {raised}")
    assert outcomes[1]["message"].startswith(f"rank 3 failed: {raised}"), outcomes[1]
    assert outcomes[2]["message"] == raised, outcomes[2]
