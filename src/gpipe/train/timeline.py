"""Timelines of a pipeline step: PNG pictures and Chrome traces, simulated or measured.

A timeline has one row per rank (rank 0 on top) and one box per action, blue for ``F``,
orange for ``B`` and green for ``W`` (the Okabe-Ito palette, safe for colour-blind readers);
on a rank holding several virtual stages each later stage is a lighter shade of its kind.
White space is idle time: the bubble, whose share ``1 - busy / (ranks * makespan)`` is
printed in the title. The events come from either side of the same schedule::

    import gpipe.train.timeline as timeline
    from gpipe.schedule import build_schedule
    from gpipe.schedule.simulate import simulate

    simulated = simulate(build_schedule("1f1b", num_ranks=2, num_microbatches=4)).events
    pipe.step(x, y, loss_fn, trace=True)            # a Pipe built with schedule="1f1b"
    timeline.compare_png(simulated, pipe.last_trace, "1f1b.png")
    timeline.save_chrome_trace(pipe.last_trace, "1f1b.json")   # open in ui.perfetto.dev

Times are in cost units when simulated and in seconds when measured. ``time_unit=None``
tells them apart by where the trace begins: :func:`gpipe.simulate` starts the first
action at exactly 0, a measured trace a little after the step's clock starts. Pass
``time_unit`` when that guess does not hold (e.g. ``"s"`` for a measured trace shifted to 0).

Pictures need matplotlib (``pip install 'gpipe[plot]'``), imported only when drawing; figures
are built as ``matplotlib.figure.Figure`` objects, never through pyplot's global state, so
drawing works headless and in threads. Chrome traces need nothing but ``json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpipe.base.files import write_file
from gpipe.schedule.ir import Kind, TimedAction

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from gpipe.schedule.simulate import SimulationResult

    Trace = Sequence[TimedAction] | SimulationResult  # a result stands for its events

__all__ = [
    "compare_png",
    "draw",
    "save_chrome_trace",
    "save_png",
    "stack_png",
    "to_chrome_trace",
]

# Okabe & Ito (2008), "Color Universal Design": distinct under the common colour blindnesses.
_COLOURS = {Kind.FORWARD: "#0072B2", Kind.BACKWARD: "#E69F00", Kind.WEIGHT: "#009E73"}
_NAMES = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.WEIGHT: "weight grad"}
_LIGHTEST = 0.55  # how far the last virtual stage's shade is mixed towards white
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6}  # physical units, in seconds
_COST_UNITS = "cost units"
_DPI = 150


# -- Chrome trace ----------------------------------------------------------------------------


def to_chrome_trace(trace: Trace, *, time_unit_us: float | None = None) -> dict[str, Any]:
    """The trace as a Chrome trace-event dict, for Perfetto (ui.perfetto.dev) or chrome://tracing.

    One complete event (``"ph": "X"``) per action on thread ``tid = rank`` of process 0, named
    like ``"F3@1"``, with category the kind and ``args`` its stage, micro-batch and rank; metadata
    events (``"ph": "M"``) name the rows ``"rank r"`` and keep them in rank order. ``ts`` and
    ``dur`` are microseconds: ``time_unit_us`` is how many one unit of the trace's times lasts.
    By default a measured trace (seconds) is converted exactly and a simulated one shows one
    cost unit as 1 ms::

        json.dump(to_chrome_trace(pipe.last_trace), open("step.json", "w"))
    """
    events = _events_of(trace)
    if time_unit_us is None:
        unit = _guess_unit(events)
        time_unit_us = _SECONDS[unit] * 1e6 if unit in _SECONDS else 1000.0
    if not (isinstance(time_unit_us, int | float) and time_unit_us > 0):
        raise ValueError(f"time_unit_us must be a positive number, got {time_unit_us!r}")
    ranks = sorted({e.rank for e in events})
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "gpipe"}}
    ]
    for r in ranks:
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        )
        meta.append(
            {"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}}
        )
    spans = [
        {
            "name": str(e.action),
            "cat": str(e.action.kind),
            "ph": "X",
            "pid": 0,
            "tid": e.rank,
            # Rounded to nanoseconds: exact enough, and keeps the JSON short.
            "ts": round(e.start * time_unit_us, 3),
            "dur": round(max(e.end - e.start, 0.0) * time_unit_us, 3),
            "args": {"stage": e.action.stage, "microbatch": e.action.microbatch, "rank": e.rank},
        }
        for e in sorted(events, key=lambda e: (e.start, e.rank))
    ]
    return {"traceEvents": meta + spans, "displayTimeUnit": "ms"}


def save_chrome_trace(trace: Trace, path: str | Path, **kwargs: Any) -> Path:
    """Write :func:`to_chrome_trace` (same keywords) as JSON to ``path``; return the path."""
    path = Path(path)
    write_file(path, lambda f: f.write(json.dumps(to_chrome_trace(trace, **kwargs)).encode()))
    return path


# -- Pictures ----------------------------------------------------------------------------------


def draw(
    trace: Trace,
    *,
    title: str | None = None,
    ax: Axes | None = None,
    time_unit: str | None = None,
    legend: bool = True,
) -> Axes:
    """Draw the timeline of ``trace`` on ``ax`` (default: a new Figure); return the Axes.

    ``time_unit`` is the unit of the trace's times: ``"s"``, ``"ms"`` or ``"us"`` for a
    measured trace (drawn in ms, or s / µs when the step is very long / short), any other
    string (e.g. ``"cost units"``) to label simulated times as they are; ``None`` guesses (see
    the module docstring). The makespan and bubble fraction are appended to ``title``. Save
    the figure with ``draw(trace).figure.savefig("step.png")``, or use :func:`save_png`.
    """
    events = _events_of(trace)
    if not events:
        raise ValueError(
            "the trace has no events, so there is nothing to draw; for a measured trace, "
            "pass trace=True to Pipe.step before reading pipe.last_trace"
        )
    colors, patches, figure_module = _matplotlib()
    if ax is None:
        fig = figure_module.Figure(figsize=_figsize([_num_ranks(events)]), layout="constrained")
        ax = fig.add_subplot()
    label, scale = _display_unit(events, time_unit)
    origin, end, bubble = _window(events)
    ranks = sorted({e.rank for e in events})
    chunk, virtual = _chunks(events)
    _boxes(ax, events, {r: i for i, r in enumerate(ranks)}, chunk, virtual, origin, end,
           scale, colors, patches)  # fmt: skip
    ax.set_xlim(0, (end - origin) * scale)
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(f"time ({label})")
    ax.set_axisbelow(True)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    stats = f"makespan {_amount((end - origin) * scale)} {label}"
    if bubble is not None:
        stats += f", bubble {bubble:.1%}"
    title = _default_title(trace) if title is None else title
    ax.set_title(f"{title} — {stats}" if title else stats, loc="left", fontsize=10)
    if legend:
        _legend(ax, events, virtual, colors, patches)
    return ax


def _boxes(ax, events, row, chunk, virtual, origin, end, scale, colors, patches) -> None:
    """One box per action on its rank's ``row``, numbered by micro-batch where that fits."""
    shades = {
        (k, c): _shade(k, c, virtual, colors) for k in Kind for c in range(virtual)
    }  # computed once: thousands of boxes share a handful of colours
    inks = {key: _ink(face, colors) for key, face in shades.items()}
    # Numbers are written in boxes wide enough for the longest one (so equal boxes are all
    # numbered or none is), in inches from the axes' share of the figure (estimated before
    # the constrained layout runs: close enough). A digit is ~0.64 em wide.
    axes_inches = ax.get_position().width * ax.figure.get_figwidth()
    inches_per_unit = axes_inches / max(end - origin, 1e-300)
    digits = len(str(max(e.action.microbatch for e in events)))
    median = sorted(e.end - e.start for e in events)[len(events) // 2]
    for fontsize in (7.0, 6.0, 5.0):  # the largest that numbers at least half the boxes
        fits = (digits * 0.64 * fontsize / 72 + 0.03) / inches_per_unit  # narrowest numbered
        if median >= fits:
            break
    height = 0.8
    for e in events:
        x, width = (e.start - origin) * scale, (e.end - e.start) * scale
        key = e.action.kind, chunk[e.rank, e.action.stage]
        box = (x, row[e.rank] - height / 2), width, height
        ax.add_patch(
            patches.Rectangle(*box, facecolor=shades[key], edgecolor="white", linewidth=0.6)
        )
        if e.end - e.start >= fits:
            ax.text(x + width / 2, row[e.rank], str(e.action.microbatch), ha="center",
                    va="center", fontsize=fontsize, color=inks[key], clip_on=True)  # fmt: skip


def save_png(trace: Trace, path: str | Path, **kwargs: Any) -> Path:
    """Draw ``trace`` (keywords as :func:`draw`) into the PNG file ``path``; return the path."""
    ax = draw(trace, **kwargs)
    return _save(ax.figure, path)


def stack_png(
    traces: Sequence[Trace],
    path: str | Path,
    *,
    titles: Sequence[str | None] | None = None,
    time_units: Sequence[str | None] | None = None,
    share_x: bool = True,
) -> Path:
    """Draw several timelines stacked top to bottom into one PNG; return the path.

    With ``share_x`` (for traces in the same unit, e.g. schedules simulated with the same
    costs) the boxes of all panels are to one scale, so makespans compare at a glance::

        stack_png([simulate(build_schedule(n, num_ranks=4, num_microbatches=8))
                   for n in ("gpipe", "1f1b", "zb-h1")], "schedules.png")
    """
    traces = list(traces)
    if not traces:
        raise ValueError("traces is empty; give at least one trace to draw")
    titles = [None] * len(traces) if titles is None else list(titles)
    units = [None] * len(traces) if time_units is None else list(time_units)
    for label, values in (("titles", titles), ("time_units", units)):
        if len(values) != len(traces):
            raise ValueError(
                f"{label} has {len(values)} entries for {len(traces)} traces; give one per trace"
            )
    _, _, figure_module = _matplotlib()
    sizes = [_num_ranks(_events_of(t)) for t in traces]
    fig = figure_module.Figure(figsize=_figsize(sizes), layout="constrained")
    axes = fig.subplots(len(traces), 1, sharex=share_x, squeeze=False, height_ratios=sizes)[:, 0]
    for ax, trace, title, unit in zip(axes, traces, titles, units, strict=True):
        draw(trace, title=title, ax=ax, time_unit=unit)
    if share_x:
        # Each draw set the shared limit to its own step; widen it to the longest.
        right = max(max(p.get_x() + p.get_width() for p in ax.patches) for ax in axes)
        axes[0].set_xlim(0, right)
        for ax in axes[:-1]:
            ax.set_xlabel("")
            ax.tick_params(axis="x", labelbottom=False)
    return _save(fig, path)


def compare_png(
    simulated: Trace,
    measured: Trace,
    path: str | Path,
    *,
    titles: tuple[str, str] = ("simulated", "measured"),
    simulated_unit: str = _COST_UNITS,
) -> Path:
    """Simulated timeline above the measured one, each on its own time axis; return the path.

    The measured trace is drawn in ms from the step's start and the simulated one in
    ``simulated_unit`` (``"ms"`` when it was simulated with measured costs in ms), each
    axis spanning its own step, so the two shapes line up for comparison.
    """
    return stack_png(
        [simulated, measured],
        path,
        titles=titles,
        time_units=[simulated_unit, "s"],
        share_x=False,
    )


# -- helpers -----------------------------------------------------------------------------------


def _amount(value: float) -> str:
    """3 significant digits without exponents: 0.0123, 4.56, 1520."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _matplotlib():
    try:
        from matplotlib import colors, figure, patches
    except ImportError as error:
        raise ImportError(
            "gpipe.train.timeline needs matplotlib to draw; install it with "
            "pip install 'gpipe[plot]' (or pip install matplotlib). "
            "to_chrome_trace works without it."
        ) from error
    return colors, patches, figure


def _events_of(trace: Trace) -> list[TimedAction]:
    events = getattr(trace, "events", trace)  # a SimulationResult, or the events themselves
    if isinstance(events, str | bytes) or not isinstance(events, Sequence):
        raise TypeError(
            f"expected a list of TimedAction (pipe.last_trace, simulate(...).events) or a "
            f"SimulationResult, got {type(trace).__name__}"
        )
    for e in events:
        if not isinstance(e, TimedAction):
            raise TypeError(f"expected TimedAction events, got {e!r}")
    return list(events)


def _default_title(trace: Trace) -> str | None:
    schedule = getattr(trace, "schedule", None)
    return getattr(schedule, "name", None)


def _guess_unit(events: Sequence[TimedAction]) -> str:
    """Cost units for a simulated trace (it starts at exactly 0), else seconds (measured)."""
    if not events or min(e.start for e in events) == 0.0:
        return _COST_UNITS
    return "s"


def _display_unit(events: Sequence[TimedAction], time_unit: str | None) -> tuple[str, float]:
    """(label, factor from the trace's times to the drawn times)."""
    unit = _guess_unit(events) if time_unit is None else time_unit
    if unit not in _SECONDS:
        return unit, 1.0
    origin, end, _ = _window(events)
    span = (end - origin) * _SECONDS[unit]  # seconds
    shown = "s" if span >= 10 else "ms" if span >= 1e-4 else "µs"
    return shown, _SECONDS[unit] / _SECONDS[shown]


def _window(events: Sequence[TimedAction]) -> tuple[float, float, float | None]:
    """(origin, end, bubble fraction or None): the step's span and its idle share.

    The origin is 0 (the step's start) unless the trace begins well after it, e.g. when its
    times are absolute; the bubble is that of the span, as in :func:`gpipe.simulate`.
    """
    first = min(e.start for e in events)
    end = max(e.end for e in events)
    origin = 0.0 if 0.0 <= first <= 0.1 * (end - first) else first
    span = end - origin
    if span <= 0:
        return origin, end, None
    busy = sum(e.end - e.start for e in events)
    return origin, end, max(0.0, 1.0 - busy / (_num_ranks(events) * span))


def _num_ranks(events: Sequence[TimedAction]) -> int:
    return len({e.rank for e in events})


def _figsize(ranks_per_panel: Sequence[int]) -> tuple[float, float]:
    """11 inches wide; per panel a title line, an axis line and ~0.4 inch per rank."""
    return 11.0, sum(0.95 + 0.4 * n for n in ranks_per_panel)


def _chunks(events: Sequence[TimedAction]) -> tuple[dict[tuple[int, int], int], int]:
    """({(rank, stage): its position among the rank's stages}, most stages on one rank)."""
    held: dict[int, set[int]] = {}
    for e in events:
        held.setdefault(e.rank, set()).add(e.action.stage)
    chunk = {(r, s): i for r, stages in held.items() for i, s in enumerate(sorted(stages))}
    return chunk, max(len(stages) for stages in held.values())


def _shade(kind: Kind, chunk: int, virtual: int, colors) -> str:
    """The kind's colour, mixed towards white for later virtual stages of a rank."""
    t = _LIGHTEST * chunk / (virtual - 1) if virtual > 1 else 0.0
    return colors.to_hex([c + (1 - c) * t for c in colors.to_rgb(_COLOURS[kind])])


def _ink(face: str, colors) -> str:
    """Black or white text, whichever reads better on ``face`` (WCAG relative luminance)."""

    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in colors.to_rgb(face))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    # Contrast ratios against white and black are equal at luminance ~0.18.
    return "black" if luminance > 0.18 else "white"


def _legend(ax, events: Sequence[TimedAction], virtual: int, colors, patches) -> None:
    kinds = [k for k in Kind if any(e.action.kind is k for e in events)]
    split = Kind.WEIGHT in kinds  # then B computes only the input gradient
    # One entry per kind, and one for the lighter shades of later virtual stages: an entry
    # per (kind, virtual stage) overflows the title's line.
    handles = []
    for kind in kinds:
        name = "input grad" if kind is Kind.BACKWARD and split else _NAMES[kind]
        face = _shade(kind, 0, virtual, colors)
        handles.append(patches.Patch(facecolor=face, edgecolor="none", label=f"{kind} {name}"))
    if virtual > 1:
        face = _shade(kinds[0], virtual - 1, virtual, colors)
        later = "1" if virtual == 2 else f"1-{virtual - 1}"
        label = f"lighter: virtual stage{'s' if virtual > 2 else ''} {later}"
        handles.append(patches.Patch(facecolor=face, edgecolor="none", label=label))
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=len(handles),
        frameon=False,
        fontsize=8,
        handlelength=1.2,
        columnspacing=1.2,
        borderaxespad=0.2,
    )


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    write_file(path, lambda f: fig.savefig(f, dpi=_DPI, format="png", facecolor="white"))
    return path
