"""NCCL's code paths without a GPU: the transport chooses them by the backend's name
(``gpipe.transport.distributed._backend``), so ranks on gloo told 'nccl'
(``distributed_cases.nccl_order``) run them all —
receives posted in NCCL's one global order, headers, descriptions and the step's rows on
a gloo side group, several transfers coalesced into one ``batch_isend_irecv`` — and
every gradient is compared with the un-split model. benchmarks/cuda_check.py runs the
same on GPUs."""

from __future__ import annotations

import pytest

from distributed_cases import train_steps
from gpipe.parallel.launch import launch
from parallel.test_distributed import check

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

CASES = [
    {"model": "gpt", "balance": [3, 3], "chunks": 4, "schedule": s, "checkpoint": "never",
     "lengths": [8, 8, 5], "ordered": True, "transport": "group"}
    for s in ("gpipe", "1f1b", "zb-h1")
] + [
    {"model": "gpt", "balance": [2, 1, 2, 1], "chunks": 4, "schedule": "interleaved-1f1b",
     "virtual": 2, "checkpoint": "always", "ordered": True, "transport": "group"},
    {"model": "gpt-tied", "balance": [3, 3], "chunks": 4, "schedule": "1f1b",
     "checkpoint": "never", "ordered": True, "transport": "group"},
]  # fmt: skip


def _told_nccl(rank: int, cases: list[dict]) -> list[dict]:
    pipes: list = []  # "ordered" cases: their carriers were told 'nccl' (nccl_order)
    results = train_steps(rank, cases, keep=pipes)
    for result, pipe in zip(results, pipes, strict=True):
        carrier = pipe._transport.carrier
        result["nccl_order"] = not carrier.receive_ahead  # coalesced, heads on the twin
    return results


def test_nccl_paths_on_gloo_give_the_unsplit_gradients():
    results = launch(_told_nccl, 2, args=(CASES,), timeout=60)
    for index, case in enumerate(CASES):
        per_rank = [r[index] for r in results]
        assert all(r["nccl_order"] for r in per_rank)
        check(case, per_rank)
