"""Sharded replicas (pipeline × FSDP, ``Pipe(shard="params")`` and ``"all"``): 2 replicas × 2
stages on four processes give the un-split, un-sharded model's gradients, for every schedule and
re-materialization mode, and train as it does."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from distributed_cases import (
    GPT_TIED,
    reused_factory,
    sharded_cases_and_reuse,
    trained_reference,
)
from gpipe.materialize import build
from gpipe.parallel.launch import launch
from injected_faults import sharded_faulty
from reference import relative_error

pytestmark = pytest.mark.timeout(300)

SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2}
SHARDS = ("params", "all")


def _cases():
    cases = []
    # Every schedule × remat once, the two modes alternating: each mode meets every
    # schedule and every remat (shard="all" under zb-h1's split backward reduces as "params").
    for i, (schedule, virtual) in enumerate(SCHEDULES.items()):
        for j, checkpoint in enumerate(("never", "except_last", "always")):
            balance = [2, 1, 2, 1] if virtual == 2 else [3, 3]
            cases.append(
                {"model": "gpt", "balance": balance, "chunks": 4, "schedule": schedule,
                 "checkpoint": checkpoint, "virtual": virtual, "shard": SHARDS[(i + j) % 2]}
            )  # fmt: skip
    # The V schedules: two stages per rank, the first and the last on rank 0.
    for schedule, checkpoint in (("zb-v", "always"), ("dualpipe-v", "never")):
        cases.append(
            {"model": "gpt", "balance": [2, 1, 1, 2], "chunks": 4, "schedule": schedule,
             "checkpoint": checkpoint, "virtual": 2, "shard": "params"}
        )  # fmt: skip
    # Tied embedding and head on the two stages: each holds a sharded copy.
    for schedule, checkpoint, shard in (("1f1b", "always", "all"), ("zb-h1", "never", "params")):
        cases.append(
            {"model": "gpt-tied", "balance": [3, 3], "chunks": 4, "schedule": schedule,
             "checkpoint": checkpoint, "shard": shard}
        )  # fmt: skip
    # Deferred batch norm, uneven micro-batches (12 samples in 5), split backward or not.
    for schedule, checkpoint, shard in (
        ("zb-h1", "never", "params"), ("gpipe", "except_last", "all")
    ):  # fmt: skip
        cases.append(
            {"model": "cnn", "balance": [4, 4], "chunks": 5, "schedule": schedule,
             "checkpoint": checkpoint, "shard": shard}
        )  # fmt: skip
    # Training for three steps: AdamW on the shards moves the weights as on the whole model.
    cases.append(
        {"model": "gpt", "balance": [3, 3], "chunks": 3, "schedule": "1f1b",
         "checkpoint": "except_last", "shard": "all", "train": True, "lengths": [8, 8, 8]}
    )  # fmt: skip
    return cases


CASES = _cases()


@pytest.mark.slow
def test_sharded_replicas_give_the_unsplit_models_gradients_for_every_schedule_and_remat():
    """And, in the same launch, a module used twice in a stage (check_reuse)."""
    launched = launch(sharded_cases_and_reuse, 4, args=(CASES,), timeout=240)
    check_reuse([reuse for _, reuse in launched])
    outcomes = [outcome for outcome, _ in launched]
    assert sorted(o["replica"] for o in outcomes) == [0, 0, 1, 1]
    for index, case in enumerate(CASES):
        losses, grads, params = trained_reference(case, replicas=(0, 1))
        merged, weights = {}, {}
        norm = sum(g.pow(2).sum() for g in grads.values()).sqrt()
        for outcome in outcomes:
            result = outcome["results"][index]
            # each process holds half of its stage's parameters (FSDP pads to even shards)
            assert result["local_elements"] <= result["elements"] / 2 + 64, case
            assert relative_error(torch.tensor(result["norm"]), norm) <= 1e-6, case  # float32
            # between backward actions: whole gradients only where the step accumulates them
            accumulated_whole = case["shard"] == "params" or case["schedule"] == "zb-h1"
            assert (result["whole_gradient_elements"] > 0) == accumulated_whole, case
            # FSDP's reduce-scatter inputs: one layer's at a time, not the stage's
            assert 0 < result["reduce_inputs_held"] <= result["largest_layer"] + 64, case
            merged.update(result["grads"])
            weights.update(result["params"])
            loss = torch.tensor(result["losses"][-1], dtype=torch.float64)
            assert relative_error(loss, losses[outcome["replica"]]) <= 1e-10, case
        if case["model"] == "gpt-tied":  # the head's copy of the tied tensor, by its name
            grads[GPT_TIED[1]] = grads[GPT_TIED[0]]
            params[GPT_TIED[1]] = params[GPT_TIED[0]]
        assert sorted(merged) == sorted(grads)
        for name, grad in grads.items():
            assert relative_error(merged[name], grad) <= 1e-10, (case, name)
            assert relative_error(weights[name], params[name]) <= 1e-10, (case, name)


# "all": the faulty rank's replica waits in a reduce-scatter of the step, not at its end.
@pytest.mark.parametrize(
    ("fault_rank", "schedule", "shard"), [(3, "1f1b", "all"), (0, "zb-h1", "params")]
)
@pytest.mark.slow
def test_a_failure_in_one_rank_of_a_sharded_run_ends_every_rank_within_the_timeout(
    fault_rank, schedule, shard, tmp_path
):
    timeout = 6.0
    args = (fault_rank, 2, schedule, shard, timeout, str(tmp_path))
    outcomes = launch(sharded_faulty, 4, args=args, timeout=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome["seconds"] < 3 * timeout, (rank, outcome)  # the faulty rank lives on
        expected = "KeyError" if rank == fault_rank else "PipelineError"
        assert outcome["type"] == expected, (rank, outcome)
    assert not multiprocessing.active_children()


def check_reuse(outcomes):
    """A module used twice in a stage shards; modules sharing a weight are refused."""
    model = build(reused_factory(False), seed=2)
    for replica in (0, 1):
        generator = torch.Generator().manual_seed(replica)
        x = torch.randn(4, 4, generator=generator, dtype=torch.float64)
        y = torch.randn(4, 4, generator=generator, dtype=torch.float64)
        (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
    merged = {}
    for grads, _ in outcomes:
        merged.update(grads)
    for name, p in model.named_parameters():
        assert relative_error(merged[name], p.grad) <= 1e-10, name
    errors = [error for _, error in outcomes]
    # refused on every rank, before anything is sharded, naming the layers
    assert all("stage 0: layers 0, 3 share a parameter" in e for e in errors), errors
