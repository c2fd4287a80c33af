"""A rank that stalls (alive, silent) or dies: every other rank raises once the pipeline's
timeout has passed — not the process group's far longer one — naming the operation and the
rank, within the timeout + 5 s (``late``: a wait, its inquest, its notice and its error; the
failure's agreement once waited for the stalled rank a second time), plus an allowance for
the load measured by the rank's own good step. Bounds are relative to the timeout; a stalled
rank sleeps for longer than twice them, so that a second wait shows."""

from __future__ import annotations

import pytest

from gpipe.parallel.launch import launch
from injected_faults import data_parallel_fault, late, stalled, stalled_two_hops

TIMEOUT = 4.0  # the pipeline's; the process group's is far longer, as torchrun's 30 minutes
AT_ONCE = TIMEOUT / 2  # a woken rank learns what happened without waiting a timeout in turn


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_rank_stalled_before_the_checkpoint_barrier_of_gpipe_train(tmp_path, monkeypatch):
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(tmp_path / "cache"))
    out, folder = str(tmp_path / "run"), tmp_path / "outcomes"
    folder.mkdir()
    args = ("save", "stall", TIMEOUT, str(folder), out)
    waiting, woken = launch(stalled, 2, args=args, timeout=600)
    assert waiting["type"] == "PipelineError", waiting
    assert waiting["seconds"] <= late(waiting, TIMEOUT), waiting
    assert "the checkpoint barrier before writing" in waiting["message"]
    assert "saving the checkpoint of step 1" in waiting["message"]
    assert woken["type"] is not None  # the stalled rank does not wait forever either


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_rank_two_hops_from_a_hung_one_names_the_hung_one_not_its_neighbour(tmp_path):
    # K=3: rank 2 hangs in a forward; rank 1 waits on it, rank 0 on rank 1
    outcomes = launch(stalled_two_hops, 3, args=(TIMEOUT, str(tmp_path)), timeout=600)
    first, second = outcomes[0], outcomes[1]
    assert first["type"] == "PipelineError" and first["rank"] == 2, first
    assert first["message"].startswith(
        "rank 2 did not answer (stalled, or died) (rank 1 waits on it): rank 0: the receive "
        "from rank 1 of the gradient of micro-batch 1 did not complete within the pipeline's "
        "timeout of 4 s; look for why rank 2 stopped"
    ), first
    assert second["rank"] == 2 and "rank 2 did not arrive" in second["message"], second
    for outcome in (first, second):  # the timeout, and the grace to hear from the others
        assert TIMEOUT - 0.5 <= outcome["seconds"] <= late(outcome, TIMEOUT), outcome
    # Awake, the hung rank learns why the others gave up (from rank 1's statement).
    assert "rank 1 gave up on this pipeline: rank 1: the receive" in outcomes[2]["message"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicas"])
@pytest.mark.slow
def test_a_stalled_replica_is_named_by_every_rank(tmp_path, shard):
    # 2 (sharded) replicas x 2 stages; rank 3 (replica 1, stage 1) sleeps before its second
    # step; each rank names it by its global rank
    outcomes = launch(data_parallel_fault, 4, args=("stall", shard, TIMEOUT, str(tmp_path)),
                      timeout=600)  # fmt: skip
    for rank in (0, 1, 2):
        outcome = outcomes[rank]
        assert outcome["type"] == "PipelineError", outcome
        assert outcome["seconds"] <= late(outcome, TIMEOUT), outcome
        message = outcome["message"]
        # did not arrive / did not answer / waited ... from rank 3 without an answer
        silent = ("did not a", "from rank 3 without an answer")
        assert "rank 3" in message and any(s in message for s in silent), message
        assert not [f"rank {r} did not" for r in (0, 1, 2) if f"rank {r} did not" in message]
    # Awake, the stalled rank learns at once what happened instead of waiting in turn.
    assert outcomes[3]["type"] == "PipelineError" and outcomes[3]["seconds"] < AT_ONCE, outcomes[3]
    if not shard:  # rank 1 (replica 0, stage 1) waits for it in the gradient all-reduce
        message = outcomes[1]["message"]
        assert message.startswith("rank 1 (rank 0 of this group)"), message
        assert "the data-parallel gradient all-reduce" in message, message
        assert "rank 3 (rank 1 of this group) did not arrive" in message, message
