"""ZB-V, DualPipe-V and zb-auto run: every parameter's gradient equals the un-split model's.

In one process, and over 2 and 3 processes (gloo), each remat mode. The V schedules put
two stages on a rank, the first and the last on rank 0, so the turn of the V (stage K-1
to stage K) and the loss stay in one process: hand-offs there go through the mailbox.
"""

from __future__ import annotations

import pytest
import torch

import gpipe
from distributed_cases import train_steps
from gpipe.models import GPTConfig, gpt, lm_loss
from gpipe.parallel.launch import launch
from gpipe.schedule import zb_auto
from gpipe.schedule.simulate import Costs
from parallel.test_distributed import check
from reference import even_balance, reference_step, relative_error, twin, worst_gradient_error

CHECKPOINTS = ["never", "except_last", "always"]
ONE_PROCESS = [
    # (schedule, ranks, virtual stages, chunks)
    ("zb-v", 2, 2, 4),
    ("zb-v", 3, 2, 5),  # fewer micro-batches than the 2K-1 of its warm-up
    ("dualpipe-v", 2, 2, 5),
    ("zb-auto", 3, 1, 5),
    ("zb-auto", 2, 2, 3),  # searched on a V
]


def gpt_case(seed: int = 1):
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=4)
    model = gpt(config).double()  # dropout included: the replayed RNG must match
    x = torch.randint(0, 32, (12, 8))
    y = torch.randint(0, 32, (12, 8))
    return model, x, y


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("schedule", "ranks", "virtual", "chunks"), ONE_PROCESS)
def test_one_process_equals_unsplit_model(schedule, ranks, virtual, chunks, checkpoint):
    model, x, y = gpt_case()
    reference = twin(model)
    pipe = gpipe.Pipe(
        model,
        balance=even_balance(len(model), ranks * virtual),
        devices=["cpu"] * ranks,
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=None if schedule != "zb-auto" else virtual,  # V: 2 by default
    )
    assert pipe.virtual_stages == virtual
    loss = pipe.step(x, y, lm_loss, seed=99)
    expected = reference_step(reference, x, y, lm_loss, chunks=chunks, seed=99)
    assert relative_error(loss, expected) <= 1e-10
    worst, where = worst_gradient_error(pipe, reference)
    assert worst <= 1e-10, f"worst gradient error {worst:.3g} at {where}"
    assert all(not stage.pending for stage in pipe.stages)


def test_zb_auto_for_measured_costs_is_passed_as_a_schedule():
    model, x, y = gpt_case()
    reference = twin(model)
    # e.g. costs measured by gpipe.estimate.profile: the middle stage is slow
    schedule = zb_auto(3, 6, costs=Costs([1.0, 2.0, 1.0], 1.2, 0.8), memory_limit=2)
    pipe = gpipe.Pipe(model, balance=[2, 2, 2], chunks=6, schedule=schedule)
    pipe.step(x, y, lm_loss, seed=5)
    reference_step(reference, x, y, lm_loss, chunks=6, seed=5)
    worst, where = worst_gradient_error(pipe, reference)
    assert worst <= 1e-10, f"worst gradient error {worst:.3g} at {where}"


def test_v_schedule_needs_two_stages_per_device():
    model, _, _ = gpt_case()
    with pytest.raises(gpipe.PartitionError, match=r"but 2 devices × virtual_stages=2 make 4"):
        gpipe.Pipe(model, balance=[2, 2, 2], devices=["cpu"] * 2, chunks=4, schedule="zb-v")


# Over processes: the whole matrix in one launch per process count (start-up dominates).
V_BALANCE = {2: [2, 1, 1, 2], 3: [1] * 6}
TWO_PROCESS_CASES = [
    {
        "model": "gpt",
        "balance": V_BALANCE[2],
        "virtual": 2,
        "chunks": 4,
        "schedule": schedule,
        "checkpoint": checkpoint,
    }
    for schedule in ("zb-v", "dualpipe-v")
    for checkpoint in CHECKPOINTS
] + [
    {"model": "gpt", "balance": [3, 3], "chunks": 5, "schedule": "zb-auto", "checkpoint": c}
    for c in CHECKPOINTS
]
TWO_PROCESS_CASES.append(  # searched on a V
    {
        "model": "gpt",
        "balance": V_BALANCE[2],
        "virtual": 2,
        "chunks": 3,
        "schedule": "zb-auto",
        "checkpoint": "except_last",
    }
)
# Receives posted as on NCCL (at the comm plan's points), though gloo carries them; and
# three steps, so that receives are posted ahead by the third, whose shape then changes.
TWO_PROCESS_CASES += [
    {**case, "ordered": True}
    for case in TWO_PROCESS_CASES
    if case["checkpoint"] == "never" and case["schedule"] != "zb-auto"
]
for _case in TWO_PROCESS_CASES:
    if _case["checkpoint"] == "always":
        _case["lengths"] = [8, 8, 5]
THREE_PROCESS_CASES = [
    {"model": "gpt", "balance": V_BALANCE[3], "virtual": 2, "chunks": 6, "schedule": s, **extra}
    for s, extra in (
        ("zb-v", {"checkpoint": "except_last"}),
        ("zb-v", {"checkpoint": "never", "ordered": True}),
        ("dualpipe-v", {"checkpoint": "always"}),
        ("dualpipe-v", {"checkpoint": "never", "ordered": True}),
    )
] + [
    {"model": "gpt", "balance": [2, 2, 2], "chunks": 5, "schedule": "zb-auto", "checkpoint": c}
    for c in ("never", "always")
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("processes", "cases"), [(2, TWO_PROCESS_CASES), (3, THREE_PROCESS_CASES)], ids=["2", "3"]
)
@pytest.mark.slow
def test_processes_equal_unsplit_model(processes, cases):
    results = launch(train_steps, processes, args=(cases,), timeout=120)
    for index, case in enumerate(cases):
        check(case, [r[index] for r in results])
