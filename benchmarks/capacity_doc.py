"""The capacity benchmark's rows and the doc's tables and plot from them (see
``benchmarks/capacity.py``, which measures them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpipe.base._utils import MiB
from gpipe.planner import CapacityCheck, Fit, Measured

STAGES = (1, 2, 4, 8)
SHARDED_STAGES = (1, 2, 4)  # K·R ≤ 8
CHUNKS = (1, 2, 4, 8, 16)
TARGETS = {"remat": 2.5, "stages": 7.5, "sharded": 1.6}
# GPipe's Table 1 (Huang et al., 2019), parameters: AmoebaNet on 8 GB TPUv2 cores and
# Transformer-L on 16 GB TPUv3 cores. "Naive-1" has no re-materialization.
PAPER = {
    "AmoebaNet": {"naive": 82e6, 1: 318e6, 2: 542e6, 4: 1.05e9, 8: 1.8e9},
    "Transformer-L": {"naive": 282.2e6, 1: 785.8e6, 8: 5.3e9},
}


@dataclass
class Row:
    kind: str  # "no remat" (the best plain layout), "no remat, gpipe", "remat", ...
    fit: Fit  # predicted
    found: Measured | None = None  # measured (refined: the deepest that fits)
    bigger: Measured | None = None  # its next size up, measured
    check: CapacityCheck | None = None  # the verification, repeats and scatter included
    minutes: float = 0.0  # the row's measuring, refinement and repeats included
    load: tuple[float, ...] = ()  # the 1-minute load average as the row began and ended
    commit: str = ""  # the code it was measured with
    cpu: float = 0.0  # CPU-seconds of its runs, every process's: the load does not inflate it

    @property
    def final(self) -> Fit:
        """The deepest measured to fit where it was measured (the next size up, when the
        refinement ran out of moves with it still fitting), else the predicted one."""
        if self.lower_bound:
            return self.bigger.fit
        return self.found.fit if self.found is not None and self.found.ran else self.fit

    @property
    def launches(self) -> int:
        """Its measured runs (each K·R processes), where kept: what its CPU paid for."""
        return self.check.launches if self.check is not None else 0

    @property
    def lower_bound(self) -> bool:
        """The refinement stopped while the next size up still fit: deeper may fit too."""
        return self.bigger is not None and self.bigger.ran and self.bigger.fits

    @property
    def exact(self) -> bool:
        """Measured exact to one block, in every run: the found depth fits, and the next size
        up exceeds the budget by more than the runs' scatter (``CapacityCheck.exact``)."""
        return self.check is not None and self.check.exact


def find(rows: list[Row], kind: str, k: int) -> Row | None:
    return next((r for r in rows if r.kind == kind and r.fit.layout.stages == k), None)


def ratio(rows: list[Row], kind: str, k: int, other_kind: str, other_k: int) -> float | None:
    """Measured parameters of one row over another's (None: either is not in ``rows``)."""
    a, b = find(rows, kind, k), find(rows, other_kind, other_k)
    return None if a is None or b is None else a.final.parameters / b.final.parameters


def spread(row: Row) -> tuple[float, float]:
    """The parameters at either end of the depths a row's runs decide (one where exact; a
    family's parameters grow by the same count each block)."""
    final = row.final.parameters
    if row.check is None or row.check.next_size is None or row.lower_bound:
        return final, final
    low, high = row.check.depths
    block = row.check.next_size.fit.parameters - row.check.found.fit.parameters
    depth = row.final.depth
    return final + (low - depth) * block, final + (high - depth) * block


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def ratios(rows: list[Row]) -> list[str]:
    """Each measured row's parameters over each K=1 layout's: gpipe's plain schedule
    (naive-1), the best plain layout (1f1b: gradient accumulation), remat."""
    bases = [("no remat, gpipe", "gpipe's plain K=1"), ("no remat", "best plain K=1"),
             ("remat", "remat K=1")]  # fmt: skip
    lines = [
        "| K | mode | parameters | " + " | ".join(f"vs {w}" for _, w in bases) + " |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        k = row.fit.layout.stages
        cells = [_x(ratio(rows, row.kind, k, kind, 1)) for kind, _ in bases]
        lines.append(f"| {k} | {row.kind} | {row.final.parameters / 1e6:.2f} M | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return lines


def _mib(x: float) -> str:
    return f"{x / MiB:.1f}"


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| K | mode | layout | depth predicted | depth measured | parameters | balance "
        "| peak MiB predicted / measured | next size up: predicted / measured MiB "
        "| measured at (commit, load) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        fit, final = row.fit, row.final
        measured, depth = "not run", "–"
        if row.found is not None and row.found.ran:
            at = row.bigger if row.lower_bound else row.found  # where final was measured
            measured = f"{_mib(at.peak)} ({'fits' if at.fits else '**over**'})"
            depth = ("≥ " if row.lower_bound else "") + str(final.depth)
            if row.bigger is not None and row.bigger.ran:
                low, high = row.check.depths
                depth += " (exact)" if row.exact else f" (**{low}–{high}**: within the scatter)"
        bigger = "–"
        if row.bigger is not None and row.bigger.ran:
            verdict = "exceeds" if not row.bigger.fits else "**fits**"
            bigger = f"{_mib(row.bigger.fit.peak)} / {_mib(row.bigger.peak)} ({verdict})"
        lines.append(
            f"| {fit.layout.stages} | {row.kind} | {fit.layout.label()} | {fit.depth} | "
            f"{depth} | {final.parameters / 1e6:.2f} M | {list(final.balance)} | "
            f"{_mib(final.peak)} / {measured} | {bigger} | {when(row) or '–'} |"
        )
    return lines


def when(row: Row) -> str:
    """The code a row was measured with and the load average (1 minute) at its start and
    end, where kept."""
    load = "–".join(f"{x:.0f}" for x in row.load)
    return ", ".join(([row.commit] if row.commit else []) + ([f"load {load}"] if load else []))


def order(rows: list[Row]) -> list[Row]:
    """The tables' order: by K, then plain, remat; sharded replicas last."""
    kinds = ["no remat, gpipe", "no remat", "remat"]
    return sorted(rows, key=lambda r: (r.fit.layout.replicas > 1, r.fit.layout.stages,
                                       kinds.index(r.kind) if r.kind in kinds else 3))  # fmt: skip


def paper(rows: list[Row]) -> list[str]:
    """Our ratios next to GPipe's Table 1 (parameters, relative to K = 1 with remat)."""
    ours = {k: ratio(rows, "remat", k, "remat", 1) for k in STAGES}
    naive = [ratio(rows, kind, 1, "remat", 1) for kind in ("no remat, gpipe", "no remat")]
    lines = [
        "| largest model relative to K=1 with remat | no remat, K=1, gpipe's schedule (naive-1) "
        "| no remat, K=1, best plain layout | K=1 | K=2 | K=4 | K=8 |",
        "|---|---|---|---|---|---|---|",
        "| gpipe (this table) | " + " | ".join(_x(x) for x in (*naive, *ours.values())) + " |",
    ]
    for name, sizes in PAPER.items():
        cells = [sizes["naive"] / sizes[1], 0] + [sizes.get(k, 0) / sizes[1] for k in STAGES]
        lines.append(
            f"| GPipe Table 1, {name} | "
            + " | ".join(f"{x:.2f}x" if x else "–" for x in cells)
            + " |"
        )
    return lines


def terms_table(rows: list[Row]) -> list[str]:
    names = list(rows[0].fit.terms())
    lines = [
        "| K | mode | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in rows:
        terms = row.fit.terms()
        lines.append(
            f"| {row.fit.layout.stages} | {row.kind} | "
            + " | ".join(_mib(terms[n]) for n in names)
            + " |"
        )
    return lines


def limiting_term(row: Row) -> str:
    """The largest term of the fullest process, but the fixed process overhead."""
    fixed = ("process", "before the model")
    terms = {k: v for k, v in row.fit.terms().items() if k not in fixed}
    name = max(terms, key=terms.__getitem__)
    return f"{name} ({_mib(terms[name])} MiB of {_mib(row.fit.peak)})"


def targets(rows: list[Row]) -> list[str]:
    lines = []
    plain = {"no remat, gpipe": "gpipe's schedule without remat (naive-1)",
             "no remat": "the best plain layout (1f1b: gradient accumulation)"}  # fmt: skip
    for kind, words in plain.items():
        remat = ratio(rows, "remat", 1, kind, 1)
        if remat is None:
            continue
        lines.append(
            f"- remat at K=1 fits **{remat:.2f}x** the parameters of {words} (target >= "
            f"{TARGETS['remat']}): {'met' if remat >= TARGETS['remat'] else 'missed'}; remat "
            f"at K=8 fits **{_x(ratio(rows, 'remat', 8, kind, 1))}** it."
        )
    stages, deepest = ratio(rows, "remat", 8, "remat", 1), find(rows, "remat", 8)
    if stages is not None:
        bound = "at least " if deepest.lower_bound else ""
        (low8, high8), (low1, high1) = (spread(r) for r in (deepest, find(rows, "remat", 1)))
        within = (
            f"; over the rows' ranges {low8 / high1:.2f}–{high8 / low1:.2f}x, the target "
            f"{'met even' if low8 / high1 >= TARGETS['stages'] else 'not met'} at the low end"
            if (low8, low1) != (high8, high1) else ""
        )  # fmt: skip
        lines.append(
            f"- remat at K=8 fits **{bound}{stages:.2f}x** K=1 (target >= {TARGETS['stages']}):"
            f" {'met' if stages >= TARGETS['stages'] else 'missed'}{within}."
        )
    for k in SHARDED_STAGES:
        sharded = ratio(rows, "2 sharded replicas", k, "remat", k)
        if sharded is None:
            continue
        met = sharded >= TARGETS["sharded"]
        row = next(r for r in rows if r.kind == "2 sharded replicas" and r.fit.layout.stages == k)
        lines.append(
            f"- 2 sharded replicas at K={k} fit **{sharded:.2f}x** one replica with remat "
            f"(target >= {TARGETS['sharded']}): {'met' if met else 'missed'}"
            + ("." if met else f"; the fullest process is limited by {limiting_term(row)}.")
        )
    checked = [r for r in rows if r.bigger is not None and r.bigger.ran]
    if checked:
        exact = [r for r in checked if r.exact]
        on = [r for r in checked if r.final.depth == r.fit.depth]
        off = ", ".join(
            f"{r.fit.layout.label()} {r.final.depth - r.fit.depth:+d}"
            for r in checked
            if r.final.depth != r.fit.depth
        )
        lines.append(
            f"- exact to one block, measured (the found depth within the budget, the next over "
            f"it): **{len(exact)} of {len(checked)}** rows; predicted depth right in "
            f"{len(on)} of {len(checked)}" + (f" (off: {off} blocks)." if off else ".")
        )
    return lines


def plot(results: dict[str, list[Row]], path: Path, budget: float) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    for axis, (name, rows) in zip(figure.subplots(1, 2), results.items(), strict=True):
        for kind, marker in (("no remat", "o"), ("remat", "s"), ("2 sharded replicas", "^")):
            chosen = [r for r in rows if r.kind == kind]
            ks = [r.fit.layout.stages for r in chosen]
            params = [r.final.parameters / 1e6 for r in chosen]
            axis.plot(ks, params, marker=marker, label=kind)
        axis.set_xscale("log", base=2)
        axis.set_xticks(list(STAGES), [str(k) for k in STAGES])
        axis.set_xlabel("stages K")
        axis.set_ylabel("largest trainable model (M parameters)")
        axis.set_title(f"{name}, {budget / MiB:.0f} MiB per process, AdamW")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def write_doc(path: Path, results: str, part: str = "capacity results") -> None:
    """Replace the generated part of the doc (between the markers), keep the prose."""
    begin, end = f"<!-- {part}: begin -->", f"<!-- {part}: end -->"
    text = path.read_text() if path.exists() else f"{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{results}\n{end}{tail}")
