"""Generated cases against plain PyTorch, float64, per parameter and buffer (tests/fuzz_cases.py).

A fixed set of seeds: every schedule x every remat mode in one process, the front end and
the features drawn; three cases over 2 processes. A case that fails prints its one-line
reproduction (``python benchmarks/fuzz.py --seed ...``), which runs it alone; the benchmark
runs many more. Cases in a known gap of issue 41 (``fuzz_cases.KNOWN_GAPS``) are expected
failures until their fix lands.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fuzz_cases
from fuzz_cases import FEATURES, FRONTENDS, REMATS, SCHEDULES, draw_case, known_gap, run_case

ONE_PROCESS = [
    draw_case(100 + i, schedule=schedule, remat=remat, processes=1)
    for i, (schedule, remat) in enumerate(itertools.product(SCHEDULES, REMATS))
]
TWO_PROCESSES = [
    draw_case(200, schedule="1f1b", processes=2, frontend="sequential"),
    draw_case(201, schedule="zb-v", processes=2, frontend="sequential"),
    draw_case(202, schedule="interleaved-1f1b", processes=2, frontend="from_model"),
]


def _id(case) -> str:
    return f"{case.seed}-{case.schedule}-{case.remat}-{case.frontend}"


def _check(case, request) -> None:
    gap = known_gap(case)
    if gap is not None:
        request.applymarker(pytest.mark.xfail(reason=gap, strict=False))
    outcome = run_case(case)
    assert outcome.accepted, outcome.report()


@pytest.mark.parametrize("case", ONE_PROCESS, ids=_id)
def test_one_process_case_equals_plain_pytorch(case, request):
    _check(case, request)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", TWO_PROCESSES, ids=_id)
def test_two_process_case_equals_plain_pytorch(case, request):
    _check(case, request)


def test_the_fixed_set_covers_every_feature_and_front_end():
    cases = ONE_PROCESS + TWO_PROCESSES
    assert {f for c in cases for f in c.features} == set(FEATURES)
    assert {c.frontend for c in cases} == set(FRONTENDS)
    assert {(c.schedule, c.remat) for c in ONE_PROCESS} == set(itertools.product(SCHEDULES, REMATS))


def test_a_case_is_its_seed_and_its_line_says_all_that_was_pinned():
    case = draw_case(7, schedule="zb-h1", remat="always", processes=1, features=["bias"])
    assert case == draw_case(7, schedule="zb-h1", remat="always", processes=1, features=["bias"])
    line = case.line()
    for text in ("seed=7", "--schedule zb-h1", "--remat always", "--processes 1", "bias"):
        assert text in line
    # pinning one value leaves the others as the seed drew them
    drawn = draw_case(7)
    assert draw_case(7, schedule=drawn.schedule) == drawn


def test_the_comparison_sees_a_wrong_gradient_and_a_missing_one():
    case = draw_case(3, schedule="gpipe", remat="never", processes=1, features=[])
    plain = fuzz_cases.run_plain(case)
    record = fuzz_cases.run_pipe(case)
    assert fuzz_cases.compare(case, plain, [record]).status == "exact"
    name, grad = next(iter(record["steps"][0]["grads"].items()))
    record["steps"][0]["grads"][name] = grad * (1 + 1e-8)
    outcome = fuzz_cases.compare(case, plain, [record])
    assert outcome.status == "inexact" and name in outcome.where
    record["steps"][0]["grads"][name] = None
    assert fuzz_cases.compare(case, plain, [record]).worst == float("inf")
    del record["steps"][1]["grads"][name]
    assert "no gradient reported" in fuzz_cases.compare(case, plain, [record]).problems[0]


def test_every_known_gap_names_a_feature_and_a_place():
    places = {"split", "from_model", "2 processes", "remat", "any"}
    for feature, place in fuzz_cases.KNOWN_GAPS:
        assert feature in FEATURES and place in places, (feature, place)
    assert torch.get_default_dtype() == torch.float32  # the cases build float64 themselves
