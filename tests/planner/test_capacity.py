"""Capacity: the search against brute force, sharded memory by hand, its options, and the
one-process layouts it searches (gpipe's and gradient accumulation's)."""

from __future__ import annotations

import itertools

import pytest

from gpipe.base._utils import MiB
from gpipe.estimate.memory_model import Held, MemoryModel, StageMemoryTable
from gpipe.estimate.profile import Profile
from gpipe.layout import Layout
from gpipe.planner import capacity
from gpipe.planner.capacity import _LayoutCosts, capacity_layouts, fit_of
from gpipe.planner.families import FamilyCosts, gpt_family
from gpipe.planner.results import cheaper_first


def tiny_gpt(batch: int = 4):
    return gpt_family(d_model=16, heads=2, seq=8, vocab=64, batch=batch)


def compositions(n: int, k: int):
    """Every balance of n layers into k non-empty stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [bounds[s + 1] - bounds[s] for s in range(k)]


def fits_by_brute_force(table: StageMemoryTable, n: int, k: int, room: float) -> bool:
    for balance in compositions(n, k):
        start, ok = 0, True
        for s, size in enumerate(balance):
            ok = ok and table(s, start, start + size).total <= room
            start += size
        if ok:
            return True
    return False


def test_search_matches_brute_force_over_depths_and_layouts():
    family = tiny_gpt()
    costs = FamilyCosts(family)
    budget = 0.6 * MiB
    result = capacity(family, memory_budget=budget, processes=3, chunks=[1, 2], max_depth=14)
    assert len(result.rows) == len(capacity_layouts(family, 3, chunks=[1, 2]))
    best_params = 0
    for row in result.rows:
        at = _LayoutCosts(costs, row.layout, 2.0)
        largest = 0
        for depth in range(1, 15):
            table = at.table(depth)
            n = len(table.layers)
            if n >= row.layout.stages and fits_by_brute_force(table, n, row.layout.stages, budget):
                largest = depth
        assert (row.depth if row.fits else 0) == largest, row.layout.label()
        if row.fits:
            best_params = max(best_params, costs.parameters(largest))
            assert max(row.peaks) <= budget
            assert sum(row.balance) == largest + 2
    assert result.best.parameters == best_params
    # ranked: most parameters first, a tie to the cheaper layout
    keys = [(-r.parameters, cheaper_first(r.layout)) for r in result.rows if r.fits]
    assert keys == sorted(keys)
    assert "parameters" in result.table() and result.best.layout.label() in result.table()


def test_sharded_memory_by_hand():
    prof = Profile.from_costs(
        [1.0] * 3, param_bytes=[4 * MiB, 1 * MiB, 2 * MiB], activation_bytes=MiB, saved_bytes=0
    )
    held = [Held(boundary=2, inner=1)]
    plain = StageMemoryTable(prof.layers, held, MemoryModel())(0, 0, 3)
    assert plain.total == pytest.approx(4 * 7 * MiB + 2 * MiB)  # P (1 + 1 + 2), 2 inputs
    replicas = StageMemoryTable(prof.layers, held, MemoryModel(replicas=2))(0, 0, 3)
    assert replicas.reduction == 7 * MiB and replicas.total == plain.total + 7 * MiB
    sharded = StageMemoryTable(prof.layers, held, MemoryModel(replicas=2, shard=True))(0, 1, 3)
    terms = sharded.terms()
    assert terms["parameters"] == 1.5 * MiB and terms["optimizer"] == 3 * MiB
    # shard="all": the shards of the gradients, and the largest layer's whole until reduced
    assert terms["gradients"] == 1.5 * MiB + 2 * MiB
    # its largest layer, and FSDP's flat buffer of it
    assert terms["gathered"] == 2 * 2 * MiB
    assert sharded.total == StageMemoryTable(
        prof.layers, held, MemoryModel(replicas=2, shard=True)
    ).total(0, 1, 3)
    whole = MemoryModel(replicas=2, shard=True, whole_gradients=True)  # shard="params"
    assert StageMemoryTable(prof.layers, held, whole)(0, 1, 3).gradients == 3 * MiB
    split = StageMemoryTable(
        prof.layers, held, MemoryModel(replicas=2, shard=True), splits_backward=True
    )(0, 1, 3)
    assert split.gathered == 3 * MiB + 2 * MiB  # W gathers the whole stage; a flat buffer
    assert split.gradients == 3 * MiB  # W's gradients are whole: reduced as "params"
    with pytest.raises(ValueError, match="replicas >= 2"):
        MemoryModel(shard=True)


def test_layout_labels_and_options():
    layout = Layout(
        stages=2, replicas=2, shard="all", chunks=8, schedule="1f1b", checkpoint="always"
    )
    assert layout.label() == "K=2 R=2 sharded M=8 1f1b always"
    with pytest.raises(ValueError, match="unknown optimizer"):
        capacity(tiny_gpt(), memory_budget=MiB, processes=1, optimizer="lion")
    with pytest.raises(ValueError, match="interleaved"):
        capacity_layouts(tiny_gpt(), 2, schedules=["interleaved-1f1b"])


def test_one_process_searches_gradient_accumulation_beside_gpipe():
    # Without remat, gpipe's schedule on one process holds every micro-batch's activations;
    # 1f1b's holds one (gradient accumulation). Both are candidates, and 1f1b fits deeper.
    family = tiny_gpt(batch=8)
    budget = 0.5 * MiB
    result = capacity(family, memory_budget=budget, processes=1, chunks=[8], checkpoints=["never"])
    rows = {r.layout.schedule_name: r for r in result.rows}
    assert sorted(rows) == ["1f1b", "gpipe"]  # every other schedule runs as one of the two
    accumulating = rows["1f1b"]
    assert accumulating.depth > rows["gpipe"].depth and result.best is accumulating
    same = fit_of(family, rows["gpipe"].layout, accumulating.depth, budget=budget)
    assert same.terms()["activations"] == pytest.approx(8 * accumulating.terms()["activations"])
