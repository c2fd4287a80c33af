"""Capacity: the search against brute force, the extrapolated profile against a measured one,
sharded memory by hand, the answer when nothing fits, and a measured two-process run."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from gpipe._utils import MiB
from gpipe.estimate.memory_model import Calibration, Held, MemoryModel, StageMemoryTable
from gpipe.estimate.profile import Profile, profile
from gpipe.layout import Layout
from gpipe.planner import calibrate, capacity, verify_capacity
from gpipe.planner.capacity import _LayoutCosts, capacity_layouts, fit_of
from gpipe.planner.families import FamilyCosts, gpt_family, resnet_family
from gpipe.planner.measured import measure_fit
from gpipe.planner.results import NothingFits, cheaper_first


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


@pytest.mark.parametrize(
    "family, depth",
    [(tiny_gpt(), 5), (resnet_family(channels=4, image=8, batch=4), 3)],
    ids=["gpt", "resnet"],
)
def test_extrapolated_profile_matches_a_measured_deeper_one(family, depth):
    costs = FamilyCosts(family)
    predicted = costs.at(depth, 2)
    torch.manual_seed(0)
    model = family.build(depth)
    x, y = family.batch(2)
    measured = profile(model, x, target=y, loss_fn=family.loss_fn, repeats=1, warmup=0)
    assert len(predicted) == len(measured)
    fields = ("param_bytes", "buffer_bytes", "input_bytes", "output_bytes", "saved_bytes",
              "saved_input_bytes", "saved_output_bytes")  # fmt: skip
    for p, m in zip(predicted.layers, measured.layers, strict=True):
        assert p.name == m.name
        for name in fields:
            assert getattr(p, name) == pytest.approx(getattr(m, name), rel=0.02), (p.name, name)
    assert costs.parameters(depth) == sum(p.numel() for p in model.parameters())


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


def test_nothing_fits_names_the_stage_the_term_and_the_shortfall():
    family = gpt_family(d_model=32, heads=2, seq=8, vocab=4096, batch=4)
    # the embedding and the head hold 4096 x 32 floats each: 2 MiB each with AdamW
    result = capacity(
        family, memory_budget=3.5 * MiB, processes=1, chunks=[1], checkpoints=["never"]
    )
    with pytest.raises(NothingFits) as caught:
        result.best  # noqa: B018
    text = str(caught.value)
    row = result.rows[0]
    over = max(row.missing)
    assert not row.fits and over > 0
    assert "stage 0" in text and "optimizer" in text  # AdamW's state is the largest term
    assert f"{over / MiB:.1f} MiB over" in text
    assert f"a budget of {(3.5 * MiB + over) / MiB:.1f} MiB" in text
    assert "K >= 2" in text  # the two big layers on two processes fit
    assert "nothing fits" in result.table()


def test_cli_prints_the_capacity_table(in_process):
    done = in_process(
        "plan", "--capacity", "--model", "gpt", "--d-model", "16", "--heads", "2", "--seq", "8",
        "--vocab", "64", "--batch", "4", "--memory", "2MiB", "--processes", "2",
        "--search-chunks", "2",
        "--top", "4", "--baseline-memory", "0", "--process-memory", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "capacity of GPT d_model 16" in done.stdout
    assert "budget 2.0 MiB per process, 2 processes" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("K=")]
    assert len(rows) == 4 and rows[0].startswith("K=2")


def test_cli_budget_is_the_whole_process(in_process):
    # Without --baseline-memory the process's own memory counts: 2 MiB holds nothing, and
    # the answer names that fixed cost.
    done = in_process(
        "plan", "--capacity", "--model", "gpt", "--d-model", "16", "--heads", "2", "--seq", "8",
        "--vocab", "64", "--batch", "4", "--memory", "2MiB", "--processes", "2",
        "--search-chunks", "2",
        "--process-memory", "1MiB",
    )  # fmt: skip
    assert done.returncode == 1
    assert "MiB before its model" in done.stdout and "nothing fits 2.0 MiB" in done.stdout
    assert "fixed per process" in done.stdout


def test_cli_calibrates_unless_given_and_prints_the_flags(monkeypatch, in_process):
    # No depth without the fixed cost per process: it is measured, with progress, and
    # printed as the flags that give it next time.
    import gpipe.planner

    def fake(family, *, processes, optimizer, progress):
        progress("calibrating 1/2: K=1 M=4 gpipe always at depth 1 ...")
        return Calibration(3 * MiB, 0.25 * MiB, 0.5 * MiB, 7 * MiB)

    monkeypatch.setattr(gpipe.planner, "calibrate", fake)
    out = in_process(
        "plan", "--capacity", "--model", "gpt", "--d-model", "16", "--heads", "2", "--seq", "8",
        "--vocab", "64", "--batch", "4", "--memory", "64MiB", "--processes", "1",
        "--search-chunks", "2",
    ).stdout  # fmt: skip
    assert "calibrating 1/2" in out
    assert ("--baseline-memory 7.0MiB --process-memory 3.0MiB --model-layer-memory 0.2500MiB "
            "--stage-layer-memory 0.5000MiB") in out  # fmt: skip


@pytest.fixture(scope="module")
def calibration() -> Calibration:
    """The tiny family's memory beyond the model's terms (one process: the 2-process runs
    below miss its peers' buffers, well within their bounds)."""
    return calibrate(tiny_gpt(batch=8))


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_verify_measures_the_found_model_and_the_next_size_up(calibration):
    family = tiny_gpt(batch=8)
    assert calibration.process > 0 and calibration.per_layer >= 0
    assert calibration.baseline > 100 * MiB  # Python, torch and gloo: a budget pays them
    budget = calibration.baseline + calibration.process + 1.0 * MiB
    result = capacity(
        family,
        memory_budget=budget,
        processes=2,
        overhead=calibration,
        stages=[2],
        replicas=[1],
        chunks=[2],
        schedules=["1f1b"],
        checkpoints=["always"],
    )
    found = result.best
    # one run each: the repeats' scatter is the fakes' subject below
    check = verify_capacity(family, found, repeats=1)
    assert check.found.fit == found and len(check.found.measured) == 2
    assert all(
        m > b > 100 * MiB for m, b in zip(check.found.measured, check.found.before, strict=True)
    )
    for ratio in _growth_ratios(check.found, calibration):
        assert 0.5 < ratio < 1.5  # measured within 50 % of predicted, beyond the baseline
    bigger = check.next_size
    assert bigger is not None and bigger.fit.depth == found.depth + 1
    assert not bigger.fit.fits and max(bigger.fit.peaks) > budget
    assert len(bigger.measured) == 2
    assert "next size" in check.describe() and "measured" in check.describe()


def test_layout_labels_and_options():
    layout = Layout(
        stages=2, replicas=2, shard="all", chunks=8, schedule="1f1b", checkpoint="always"
    )
    assert layout.label() == "K=2 R=2 sharded M=8 1f1b always"
    with pytest.raises(ValueError, match="unknown optimizer"):
        capacity(tiny_gpt(), memory_budget=MiB, processes=1, optimizer="lion")
    with pytest.raises(ValueError, match="interleaved"):
        capacity_layouts(tiny_gpt(), 2, schedules=["interleaved-1f1b"])


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_sharded_replicas_are_measured(calibration):
    family = tiny_gpt(batch=8)
    layout = Layout(stages=1, replicas=2, shard="all", chunks=2, checkpoint="always")
    budget = calibration.baseline + calibration.process + 4 * MiB
    fit = fit_of(family, layout, 2, budget=budget, overhead=calibration)
    assert fit.fits and fit.terms()["gathered"] > 0
    measured = measure_fit(family, fit)
    assert measured.ran and len(measured.measured) == 2
    assert 0.5 < _growth_ratios(measured, calibration)[0] < 1.5


def _growth_ratios(measured, calibration: Calibration) -> list[float]:
    """Per stage, the measured growth over the predicted one (both beyond the baseline)."""
    k = measured.fit.layout.stages
    growth = [max(measured.growth[s::k]) for s in range(k)]
    return [g / (p - calibration.baseline) for g, p in zip(growth, measured.fit.peaks, strict=True)]


@pytest.mark.parametrize("predicted", [3, 5, 8, 40, 130])
def test_refine_settles_on_the_measured_answer(monkeypatch, predicted):
    # The machine says depth <= 5 fits; wherever the prediction starts, refine ends with the
    # found depth measured within the budget and the next one over it, in about two runs
    # per doubling of the prediction's error (it gallops, then halves the bracket).
    from gpipe.planner import measured as module

    family = tiny_gpt()
    layout = Layout(stages=1, chunks=1, checkpoint="always")
    ran = []

    def fake(family, fit, **options):
        ran.append(fit.depth)
        peak = fit.budget - 1 if fit.depth <= 5 else fit.budget + 1
        return module.Measured(fit, (peak,), 2, before=(0.0,))

    monkeypatch.setattr(module, "measure_fit", fake)
    fit = fit_of(family, layout, predicted, budget=100 * MiB)
    check = verify_capacity(family, fit, refine=True, moves=16, repeats=1)
    assert check.exact and check.found.fit.depth == 5 and check.next_size.fit.depth == 6
    assert check.predicted_depth == predicted and len(ran) == len(set(ran))  # none twice
    assert len(ran) <= 3 + 2 * math.log2(abs(predicted - 5) + 1), ran
    assert ("off by" in check.describe()) == (predicted != 5)


@pytest.mark.parametrize(("over", "exact"), [(3.0, True), (0.5, False)])
def test_exact_means_the_next_size_up_is_over_by_more_than_the_scatter(monkeypatch, over, exact):
    # Peaks move by 1 MiB between runs of one depth: a next size up 0.5 MiB over the budget
    # may fit in another run, so the row is the range 5-6, not "exact".
    from gpipe.planner import measured as module

    family = tiny_gpt()
    runs: dict[int, int] = {}

    def fake(family, fit, **options):
        runs[fit.depth] = runs.get(fit.depth, 0) + 1
        wobble = MiB * (runs[fit.depth] - 1)  # 0, then 1 MiB more
        peak = fit.budget - 2 * MiB if fit.depth <= 5 else fit.budget + over * MiB
        return module.Measured(fit, (peak + wobble,), 2, before=(0.0,))

    monkeypatch.setattr(module, "measure_fit", fake)
    layout = Layout(stages=1, chunks=1, checkpoint="always")
    fit = fit_of(family, layout, 5, budget=100 * MiB)
    check = verify_capacity(family, fit, refine=True, moves=16)
    assert runs == {5: 2, 6: 2}  # each depth measured again
    assert check.scatter == MiB and check.exact == exact
    assert check.depths == ((5, 5) if exact else (5, 6))
    assert ("exact: depth 5" if exact else "depth 5-6") in check.describe()
