"""Timelines: Chrome traces and PNG pictures of simulated and measured steps."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
import gpipe.train.timeline as timeline
from gpipe.schedule import TimedAction, build_schedule
from gpipe.schedule.simulate import simulate

PNG_HEADER = b"\x89PNG\r\n\x1a\n"
SCHEDULES = [  # (name, virtual stages)
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb-h1", 1),
    ("interleaved-1f1b", 2),
]


def simulated(name: str, virtual: int = 1, ranks: int = 3, microbatches: int = 6):
    schedule = build_schedule(
        name, num_ranks=ranks, num_microbatches=microbatches, virtual_stages=virtual
    )
    return simulate(schedule)


@pytest.fixture(scope="module")
def measured():
    """A real step's trace: 2 ranks, 4 micro-batches, gpipe schedule."""
    torch.manual_seed(0)
    pipe = gpipe.Pipe(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), balance=[2, 2], chunks=4)
    pipe.step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss, trace=True)
    return pipe


@pytest.fixture
def mpl():
    return pytest.importorskip("matplotlib")


# -- Chrome trace ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "virtual"), SCHEDULES)
def test_chrome_trace_has_every_action_once_with_its_rank_and_time(name, virtual):
    result = simulated(name, virtual)
    trace = timeline.to_chrome_trace(result.events)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert Counter(e["name"] for e in spans) == Counter(str(e.action) for e in result.events)
    assert len(spans) == len(result.events)
    by_name = {str(e.action): e for e in result.events}
    for span in spans:
        event = by_name[span["name"]]
        assert span["tid"] == event.rank and span["pid"] == 0
        assert span["cat"] == str(event.action.kind)
        assert span["args"] == {
            "stage": event.action.stage,
            "microbatch": event.action.microbatch,
            "rank": event.rank,
        }
        # Simulated: one cost unit shows as 1 ms = 1000 µs.
        assert span["ts"] == pytest.approx(event.start * 1000)
        assert span["dur"] == pytest.approx(event.duration * 1000)
        assert isinstance(span["ts"], int | float) and span["ts"] >= 0
        assert isinstance(span["dur"], int | float) and span["dur"] >= 0
    assert trace["displayTimeUnit"] == "ms"
    assert json.loads(json.dumps(trace)) == trace


def test_chrome_trace_names_one_row_per_rank_in_rank_order():
    trace = timeline.to_chrome_trace(simulated("1f1b", ranks=3))
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert order == {0: 0, 1: 1, 2: 2}
    assert all(e["pid"] == 0 for e in meta)


def test_measured_chrome_trace_is_converted_from_seconds_to_microseconds(measured):
    events = measured.last_trace
    trace = timeline.to_chrome_trace(events)
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert len(spans) == len(events) == 2 * 2 * 4  # F and B of 4 micro-batches on 2 stages
    for event in events:
        span = spans[str(event.action)]
        assert span["ts"] == pytest.approx(event.start * 1e6, abs=1e-3)
        assert span["dur"] == pytest.approx(event.duration * 1e6, abs=1e-3)


def test_chrome_trace_time_unit_is_explicit_when_given(tmp_path):
    result = simulated("gpipe")
    trace = timeline.to_chrome_trace(result, time_unit_us=2.5)
    last = max((e for e in trace["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])
    assert last["ts"] + last["dur"] == pytest.approx(result.makespan * 2.5)
    with pytest.raises(ValueError, match="positive"):
        timeline.to_chrome_trace(result, time_unit_us=0)

    # written whole through gpipe.base.files: a link planted at the name is replaced, not followed
    (tmp_path / "target").write_text("theirs")
    (tmp_path / "step.json").symlink_to(tmp_path / "target")
    path = timeline.save_chrome_trace(result.events, tmp_path / "step.json", time_unit_us=2.5)
    assert json.loads(path.read_text()) == trace
    assert not path.is_symlink() and (tmp_path / "target").read_text() == "theirs"


# -- pictures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "virtual"), SCHEDULES)
def test_one_box_per_event_at_its_time_and_rank(mpl, name, virtual):
    result = simulated(name, virtual)
    ax = timeline.draw(result)
    boxes = [p for p in ax.patches if isinstance(p, mpl.patches.Rectangle)]
    assert len(boxes) == len(ax.patches) == len(result.events)

    def rounded(*xs):
        return tuple(round(x, 6) for x in xs)

    drawn = sorted(rounded(b.get_x(), b.get_width(), b.get_y() + 0.4) for b in boxes)
    expected = sorted(rounded(e.start, e.duration, e.rank) for e in result.events)
    assert drawn == expected
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # rank 0 on top
    assert ax.get_xlabel() == "time (cost units)"
    # The schedule's name and simulate's own bubble fraction head the picture.
    assert ax.get_title(loc="left").startswith(name)
    assert f"bubble {result.bubble_fraction:.1%}" in ax.get_title(loc="left")


def test_kinds_and_virtual_stages_have_distinct_colours(mpl):
    ax = timeline.draw(simulated("interleaved-1f1b", virtual=2))
    colour = {}
    for box, event in zip(
        sorted(ax.patches, key=lambda b: (b.get_y(), b.get_x())),
        sorted(simulated("interleaved-1f1b", virtual=2).events, key=lambda e: (e.rank, e.start)),
        strict=True,
    ):
        key = event.action.kind, event.action.stage >= 3  # second virtual stage of its rank
        colour.setdefault(key, set()).add(mpl.colors.to_hex(box.get_facecolor()))
    assert all(len(c) == 1 for c in colour.values())  # one colour per (kind, virtual stage)
    assert len({c.pop() for c in colour.values()}) == 4  # F, B x 2 virtual stages
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["F forward", "B backward", "lighter: virtual stage 1"], labels

    split = timeline.draw(simulated("zb-h1"))
    faces = {
        mpl.colors.to_hex(b.get_facecolor()) for b in split.patches
    }  # F, B and W only: no shades with one stage per rank
    assert len(faces) == 3
    labels = [t.get_text() for t in split.get_legend().get_texts()]
    assert labels == ["F forward", "B input grad", "W weight grad"]


def test_microbatch_numbers_are_written_in_boxes_that_fit(mpl):
    roomy = timeline.draw(simulated("gpipe", ranks=2, microbatches=4))
    assert sorted(t.get_text() for t in roomy.texts) == sorted("01230123" * 2)
    # 400 micro-batches on 11 inches: the forwards are too narrow for three digits.
    crowded = timeline.draw(simulated("gpipe", ranks=2, microbatches=400))
    assert len(crowded.texts) < len(crowded.patches) == 1600


@pytest.mark.parametrize(("name", "virtual"), SCHEDULES)
def test_png_of_simulated_schedules(mpl, tmp_path, name, virtual):
    path = timeline.save_png(simulated(name, virtual), tmp_path / f"{name}.png", title=name)
    data = path.read_bytes()
    assert data.startswith(PNG_HEADER) and len(data) > 10_000


def test_png_of_measured_trace_is_in_milliseconds(mpl, tmp_path, measured):
    ax = timeline.draw(measured.last_trace)
    assert ax.get_xlabel() in ("time (ms)", "time (µs)")  # µs only on a very fast machine
    assert len(ax.patches) == len(measured.last_trace)
    (tmp_path / "target").write_text("theirs")
    (tmp_path / "measured.png").symlink_to(tmp_path / "target")  # replaced, not followed
    path = timeline.save_png(measured.last_trace, tmp_path / "measured.png")
    assert path.read_bytes().startswith(PNG_HEADER)
    assert not path.is_symlink() and (tmp_path / "target").read_text() == "theirs"


def test_compare_png_stacks_simulated_above_measured(mpl, tmp_path, measured):
    path = tmp_path / "compare.png"
    assert timeline.compare_png(simulate(measured.schedule), measured.last_trace, path) == path
    assert path.read_bytes().startswith(PNG_HEADER)


def test_stack_png_shares_the_time_axis(mpl, tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(timeline, "_save", lambda fig, path: figures.append(fig) or path)
    traces = [simulated("gpipe"), simulated("zb-h1")]  # makespans 24 and 20
    timeline.stack_png(traces, tmp_path / "stack.png", titles=["a", "b"])
    top, bottom = figures[0].axes
    assert top.get_xlim() == bottom.get_xlim() == (0, traces[0].makespan)
    assert top.get_title(loc="left").startswith("a — ")
    with pytest.raises(ValueError, match="titles has 1 entries for 2 traces"):
        timeline.stack_png(traces, tmp_path / "bad.png", titles=["a"])


def test_time_unit_can_be_given(mpl):
    events = [TimedAction(0, simulated("gpipe").events[0].action, 1.0, 3.0)]
    ax = timeline.draw(events, time_unit="s")  # a 2 s step that begins 1 s in
    assert ax.get_xlabel() == "time (ms)"
    assert ax.patches[0].get_width() == pytest.approx(2000)
    assert timeline.draw(events, time_unit="steps").get_xlabel() == "time (steps)"


def test_empty_trace_says_to_turn_tracing_on(mpl):
    with pytest.raises(ValueError, match=r"trace=True"):
        timeline.draw([])


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"gpipe\[plot\]"):
        timeline.draw(simulated("gpipe"))
    # The Chrome trace does not need it.
    assert timeline.to_chrome_trace(simulated("gpipe"))["traceEvents"]


def test_makespan_in_the_title_is_written_without_exponent(mpl):
    long = simulate(build_schedule("gpipe", num_ranks=4, num_microbatches=500))
    title = timeline.draw(long).get_title(loc="left")
    assert f"makespan {long.makespan:.0f} cost units" in title and "e+" not in title
