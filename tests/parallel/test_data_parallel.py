"""gpipe.parallel.data_parallel: R replicas x K stages average each stage's gradients (early
buckets start while the last backward runs); the merged gradients and each replica's loss
are the un-split model's on the replicas' batches."""

from __future__ import annotations

import pytest
import torch

from distributed_cases import data_and_pipeline, reference
from gpipe.parallel.launch import launch
from reference import relative_error

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_data_parallel_times_pipeline_parallel():
    cases = [
        {
            "model": "gpt",
            "balance": [3, 3],
            "chunks": 4,
            "schedule": "1f1b",
            "checkpoint": "always",
        },
        {
            "model": "cnn",
            "balance": [4, 4],
            "chunks": 3,
            "schedule": "zb-h1",
            "checkpoint": "never",
        },
        # Small buckets: most start reducing while the last backward still runs (B/W
        # split or not).
        *(
            {
                "model": "gpt",
                "balance": [3, 3],
                "chunks": 4,
                "schedule": schedule,
                "checkpoint": "never",
                "bucket_bytes": 4096,
            }
            for schedule in ("gpipe", "zb-h1")
        ),
    ]
    outcomes = launch(data_and_pipeline, 4, args=(cases,), timeout=60)
    for index, case in enumerate(cases):
        if "bucket_bytes" in case:
            for outcome in outcomes:
                (early,) = outcome["results"][index]["buckets_started_during_backward"]
                assert early >= 2, (case, early)
    assert sorted(o["replica"] for o in outcomes) == [0, 0, 1, 1]
    for index, case in enumerate(cases):
        if case["model"] == "cnn":
            continue  # replicas keep their own running statistics, as DDP does
        losses, grads, _ = reference(case, replicas=(0, 1))
        merged = {}
        for outcome in outcomes:
            merged.update(outcome["results"][index]["grads"])  # replicas agree
            replica_loss = outcome["results"][index]["losses"][-1]
            assert (
                relative_error(
                    torch.tensor(replica_loss, dtype=torch.float64), losses[outcome["replica"]]
                )
                <= 1e-10
            )
        for name, grad in grads.items():
            assert relative_error(merged[name], grad) <= 1e-10, name
    # Replicas hold identical averaged gradients.
    by_replica = {}
    for outcome in outcomes:
        for index in range(len(cases)):
            for name, grad in outcome["results"][index]["grads"].items():
                by_replica.setdefault((index, name), []).append(grad)
    for grads in by_replica.values():
        assert len(grads) == 2 and torch.equal(grads[0], grads[1])
