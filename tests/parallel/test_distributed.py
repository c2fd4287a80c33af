"""The pipeline over processes (gloo on 127.0.0.1): the same gradients as one process.

Each launch runs many configurations in the same processes to keep start-up costs down;
every configuration is compared, parameter by parameter, with the un-split model.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed_cases import (
    FACTORIES,
    GPT_TIED,
    INIT_SEED,
    reference,
    train_steps,
    trained_reference,
)
from gpipe.materialize import build
from gpipe.parallel.launch import free_port, launch
from reference import relative_error

pytestmark = pytest.mark.timeout(600)


def check(case, per_rank_results, replicas=(0,)):
    losses, grads, stats = reference(case, replicas)
    merged = {}
    for result in per_rank_results:
        assert result["receive_ahead"] is not case.get("ordered", False)
        # One machine, CPU stages on gloo: Unix sockets, unless told the process group.
        by_group = case.get("ordered") or case.get("transport") == "group"
        assert result["transport"] == ("group" if by_group else "sockets")
        merged.update(result["grads"])
        assert (
            relative_error(torch.tensor(result["losses"][-1], dtype=torch.float64), losses[0])
            <= 1e-10
        )
    if case["model"] == "gpt-tied":  # the head's copy of the embedding, same gradient
        embedding, head = GPT_TIED
        assert torch.equal(merged.pop(head), merged[embedding])
    assert set(merged) == set(grads)
    for name, grad in grads.items():
        assert relative_error(merged[name], grad) <= 1e-10, (case, name)
    buffers = {}
    for result in per_rank_results:
        buffers.update(result["buffers"])
    for key, value in stats.items():
        if "running" in key or "num_batches" in key:
            assert relative_error(buffers[key], value) <= 1e-10, (case, key)
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values()))
    for result in per_rank_results:
        assert abs(result["norm"] - total.item()) <= 1e-6 * total.item()


TWO_STAGE_CASES = [
    {"model": model, "schedule": schedule, "checkpoint": checkpoint, **shape}
    for model, balance, virtual_balance in (
        ("gpt", [3, 3], [2, 1, 2, 1]),
        ("cnn", [4, 4], [2, 2, 2, 2]),
    )
    for checkpoint in ("always", "never")
    for schedule, shape in (
        ("gpipe", {"balance": balance, "chunks": 4}),
        ("1f1b", {"balance": balance, "chunks": 4}),
        ("zb-h1", {"balance": balance, "chunks": 5}),
        ("interleaved-1f1b", {"balance": virtual_balance, "chunks": 4, "virtual": 2}),
    )
]
TWO_STAGE_CASES += [
    {"model": "gpt-tied", "balance": [3, 3], "chunks": 4, "schedule": s, "checkpoint": "never"}
    for s in ("gpipe", "zb-h1")
]
for _case in TWO_STAGE_CASES:
    if _case["model"] == "gpt":
        _case["lengths"] = [8, 5, 7]  # another sequence length every step
# A shape that held for steps (so its receives are posted ahead), then changes: the
# posted buffers get placeholders. And receives posted as on NCCL (see test_transport.py).
TWO_STAGE_CASES += [
    {
        "model": "gpt",
        "balance": [3, 3],
        "chunks": 4,
        "schedule": s,
        "checkpoint": "never",
        "lengths": [8, 8, 8, 5],
    }
    for s in ("gpipe", "zb-h1")
]
TWO_STAGE_CASES += [
    {**case, "ordered": True}
    for case in TWO_STAGE_CASES
    if case["model"] == "gpt" and case["checkpoint"] == "never"
]
# The process group's own transport (gloo, receives ahead), as off one machine or on GPUs.
TWO_STAGE_CASES += [
    {**case, "transport": "group"}
    for case in TWO_STAGE_CASES
    if case["model"] == "gpt" and case["checkpoint"] == "never" and not case.get("ordered")
]


@pytest.mark.slow
def test_two_processes_every_schedule_and_remat_mode_clipping_and_tied_training():
    """One launch: every two-stage case, the global clip, and training with tied copies."""
    cases = [*TWO_STAGE_CASES, CLIP_CASE, TIED_TRAINING_CASE]
    results = launch(train_steps, 2, args=(cases,), timeout=90)
    for index, case in enumerate(TWO_STAGE_CASES):
        check(case, [results[0][index], results[1][index]])
    clip, tied = ([r[index] for r in results] for index in (-2, -1))
    check_clipping(clip)
    check_tied_training(tied)


FOUR_STAGE_CASES = (
    [
        {
            "model": "gpt",
            "balance": [2, 2, 1, 1],
            "chunks": 4,
            "schedule": s,
            "checkpoint": "except_last",
        }
        for s in ("gpipe", "1f1b", "zb-h1")
    ]
    + [
        {
            "model": "cnn",
            "balance": [2, 2, 2, 2],
            "chunks": 6,
            "schedule": "1f1b",
            "checkpoint": "always",
        },
        {
            "model": "cnn",
            "balance": [1] * 8,
            "chunks": 4,
            "schedule": "interleaved-1f1b",
            "virtual": 2,
            "checkpoint": "never",
        },
    ]
    + [
        # Skips from stage 0 to stage 3 and from stage 1 to stage 2, point to point.
        {"model": "unet", "balance": [2, 2, 1, 2], "chunks": 4, "schedule": s, "checkpoint": c}
        for s, c in (("gpipe", "always"), ("1f1b", "never"), ("zb-h1", "except_last"))
    ]
)
# Three steps each (the last is checked), so receives are posted ahead by then (not for
# the CNN, whose reference holds one step of batch-norm statistics); and some cases again
# with receives posted as on NCCL.
for _case in FOUR_STAGE_CASES:
    if _case["model"] != "cnn":
        _case["lengths"] = [8, 8, 8]
FOUR_STAGE_CASES += [
    {**case, "ordered": True}
    for case in FOUR_STAGE_CASES
    if case["model"] in ("unet", "cnn") and case["checkpoint"] != "except_last"
]


@pytest.mark.slow
def test_four_processes():
    results = launch(train_steps, 4, args=(FOUR_STAGE_CASES,), timeout=60)
    for index, case in enumerate(FOUR_STAGE_CASES):
        check(case, [r[index] for r in results])


CLIP_CASE = {"model": "gpt", "balance": [3, 3], "chunks": 2, "schedule": "gpipe",
             "checkpoint": "never", "clip": 0.05}  # fmt: skip


def check_clipping(results):
    """clip_grad_norm_ scales by the global norm, over both processes."""
    _, grads, _ = reference(CLIP_CASE)
    total = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    scale = min(1.0, 0.05 / (total.item() + 1e-6))  # as torch.nn.utils.clip_grad_norm_
    assert scale < 0.5, "the case must actually clip"
    merged = {**results[0]["grads"], **results[1]["grads"]}
    for name in grads:
        assert relative_error(merged[name], grads[name] * scale) <= 1e-9, name
    for result in results:
        assert abs(result["norm"] - total.item()) <= 1e-6 * total.item()


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_two_machines_with_torchrun(tmp_path):
    """Two torchrun launches ("nodes") on 127.0.0.1 rendezvous into one 2-stage pipeline,
    with the flags of docs/your-model.md's several-machines command (``--node-rank``,
    ``--master-addr``; ``gpipe train`` under torchrun: tests/faults/test_restarts.py).
    Each node is told it is a machine of its own (``GPIPE_TEST_HOST``): the carrier across
    machines, the process group's point-to-point, is what runs."""
    port = free_port()
    script = Path(__file__).parent / "torchrun_job.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(port)]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [*command, "--node-rank", str(node), str(script), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "GPIPE_TEST_HOST": f"node{node}"},
            start_new_session=True,  # a hang kills the agent and its worker together
        )
        for node in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=60)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    assert all(node.returncode == 0 for node in nodes), "\n".join(outputs)
    assert not any("terminate called" in out for out in outputs), "\n".join(outputs)
    from parallel.torchrun_job import CASE

    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [result["transport"] for result in results] == ["group", "group"]
    check({**CASE, "transport": "group"}, results)  # each parameter against the un-split model


TIED_TRAINING_CASE = {"model": "gpt-tied", "balance": [3, 3], "chunks": 2, "schedule": "1f1b",
                      "checkpoint": "except_last", "lengths": [8] * 10, "train": True}  # fmt: skip


def check_tied_training(results):
    """Tied copies in two processes stay identical through training, and equal the
    un-split model's one tensor."""
    first, second = results
    embedding, head = GPT_TIED
    assert torch.equal(first["params"][embedding], second["params"][head])
    # After 9 AdamW steps, the weights and the last step's gradients and loss are the
    # un-split model's (its one tensor: the head's copy carries the embedding's values).
    losses, grads, weights = trained_reference(TIED_TRAINING_CASE)
    weights[head], grads[head] = weights[embedding], grads[embedding]
    ours = {**second["params"], **first["params"]}
    ours_grads = {**second["grads"], **first["grads"]}
    assert sorted(ours) == sorted(weights)
    for name, value in weights.items():
        assert relative_error(ours[name], value) <= 1e-10, name
        assert relative_error(ours_grads[name], grads[name]) <= 1e-10, name
    loss = torch.tensor(second["losses"][-1], dtype=torch.float64)
    assert relative_error(loss, losses[0]) <= 1e-10
    # Trained: the optimizer moved the tied weight.
    initial = dict(build(FACTORIES["gpt-tied"], seed=INIT_SEED).named_parameters())
    assert relative_error(weights[embedding], initial[embedding].detach()) > 1e-3
