"""The largest model that trains within a fixed memory budget per process, for K = 1, 2, 4, 8.

    python benchmarks/capacity.py --out docs/capacity.md --plot docs/img/capacity.png
    python benchmarks/capacity.py --k1 --out docs/capacity.md   # K=1 against plain PyTorch
    python benchmarks/capacity.py --sharded --out docs/capacity.md  # 2 sharded replicas alone
    # a family per run, each kept, then the doc and plot from both:
    python benchmarks/capacity.py --family GPT --save gpt.pickle
    python benchmarks/capacity.py --load gpt.pickle resnet.pickle --out docs/capacity.md ...

GPipe's Table 1: with re-materialization the largest trainable model grows about linearly
with the number of stages K. For the GPT and the ResNet of ``gpipe.models`` (by depth), one
budget of resident memory per process and AdamW, each row is the largest depth that
``gpipe.planner.capacity`` predicts to fit, over micro-batch counts and schedules, for K
stages without re-materialization, with it, and with 2 sharded replicas
(``Pipe(shard="params")``). The budget is each process's whole peak resident memory
(Python, torch and gloo included). Rows are then trained for real (2 steps, one process per
stage and replica, ``gpipe.planner.verify_capacity``; sharded ones at ``--measure-sharded``
K) with the next size up (depth + 1) at ``--next-size`` K, and refined a block at a time
until the found depth measures within the budget and the next one over it: the measured
answer, next to the predicted one. The per-process memory beyond the model is calibrated
once per family (``gpipe.planner.calibrate``, on 8 processes). The ratios are shown next to
those of GPipe's Table 1.

``--sharded`` measures only what the sharded target needs, in its own section of the doc:
the GPT family's rows with remat and with 2 sharded replicas at ``--measure-sharded`` K,
each refined until exact, and their ratios (minutes instead of the whole table's hour).

``--k1`` measures one process instead, gpipe's rows against plain PyTorch's best on the same
family, budget and mini-batch (16-way gradient accumulation, no remat, or per-block
``torch.utils.checkpoint``), each row's peak resident growth over what the process held
before its model; it writes its own section of the doc.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpipe._utils import MiB
from gpipe.allocator import started_with
from gpipe.parallel.launch import launch
from gpipe.planner import Fit, Measured, calibrate, capacity, verify_capacity
from gpipe.planner.families import Family, gpt_family, resnet_family
from gpipe.planner.measured import _peak_resident_bytes, _reset_peak, _resident_bytes

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


def families() -> dict[str, Family]:
    return {
        # activations per block ~ 8x its parameter bytes (tokens / d_model = 8), so that
        # both matter; sizes keep the measured runs within minutes on 2 cores
        "GPT": gpt_family(d_model=128, heads=4, seq=64, vocab=2048, batch=16),
        "ResNet": resnet_family(channels=32, image=32, batch=8),
    }


@dataclass
class Row:
    kind: str  # "no remat", "remat", "2 sharded replicas"
    fit: Fit  # predicted
    found: Measured | None = None  # measured (refined: the deepest that fits)
    bigger: Measured | None = None  # its next size up, measured

    @property
    def final(self) -> Fit:
        """The deepest measured to fit where it was measured (the next size up, when the
        refinement ran out of moves with it still fitting), else the predicted one."""
        if self.lower_bound:
            return self.bigger.fit
        return self.found.fit if self.found is not None and self.found.ran else self.fit

    @property
    def lower_bound(self) -> bool:
        """The refinement stopped while the next size up still fit: deeper may fit too."""
        return self.bigger is not None and self.bigger.ran and self.bigger.fits

    @property
    def exact(self) -> bool:
        """Measured exact to one block: the found depth fits, the next size up does not."""
        ran = self.found is not None and self.bigger is not None and self.bigger.ran
        return (
            ran and self.found.fits and not self.bigger.fits
            and self.bigger.fit.depth == self.found.fit.depth + 1
        )  # fmt: skip


def search(family: Family, budget: float, overhead: float) -> list[Row]:
    rows = []
    common = {"memory_budget": budget, "processes": 8, "overhead": overhead, "chunks": CHUNKS}
    for k in STAGES:
        for kind, modes in (("no remat", ["never"]), ("remat", ["always", "except_last"])):
            result = capacity(family, stages=[k], replicas=[1], checkpoints=modes, **common)
            rows.append(Row(kind, result.best))
    for k in SHARDED_STAGES:
        result = capacity(family, stages=[k], replicas=[2], shard=[True], **common)
        rows.append(Row("2 sharded replicas", result.best))
    return rows


def measure(
    family: Family,
    rows: list[Row],
    next_size: tuple[int, ...],
    sharded: tuple[int, ...],
    moves: int = 12,
) -> None:
    """Measure each row (and its next size up where K is in ``next_size``, refined at most
    ``moves`` blocks each way: K = 8's prediction can be 10 blocks off)."""
    for row in rows:
        if row.fit.layout.shard and row.fit.layout.stages not in sharded:
            continue
        start = time.perf_counter()
        bigger = row.fit.layout.stages in next_size
        check = verify_capacity(
            family, row.fit, next_size=bigger, refine=bigger, steps=2, moves=moves
        )
        row.found, row.bigger = check.found, check.next_size
        print(f"  {check.describe()}  ({time.perf_counter() - start:.0f} s)", flush=True)


def ratio(rows: list[Row], kind: str, k: int, other_kind: str, other_k: int) -> float:
    a = next(r for r in rows if r.kind == kind and r.fit.layout.stages == k)
    b = next(r for r in rows if r.kind == other_kind and r.fit.layout.stages == other_k)
    return a.final.parameters / b.final.parameters


def _mib(x: float) -> str:
    return f"{x / MiB:.1f}"


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| K | mode | layout | depth predicted | depth measured | parameters | balance "
        "| peak MiB predicted / measured | next size up: predicted / measured MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        fit, final = row.fit, row.final
        measured, depth = "not run", "–"
        if row.found is not None and row.found.ran:
            at = row.bigger if row.lower_bound else row.found  # where final was measured
            measured = f"{_mib(at.peak)} ({'fits' if at.fits else '**over**'})"
            depth = ("≥ " if row.lower_bound else "") + str(final.depth)
            if row.bigger is not None and row.bigger.ran:
                depth += " (exact)" if row.exact else " (**not exact**)"
        bigger = "–"
        if row.bigger is not None and row.bigger.ran:
            verdict = "exceeds" if not row.bigger.fits else "**fits**"
            bigger = f"{_mib(row.bigger.fit.peak)} / {_mib(row.bigger.peak)} ({verdict})"
        lines.append(
            f"| {fit.layout.stages} | {row.kind} | {fit.layout.label()} | {fit.depth} | "
            f"{depth} | {final.parameters / 1e6:.2f} M | {list(final.balance)} | "
            f"{_mib(final.peak)} / {measured} | {bigger} |"
        )
    return lines


def paper(rows: list[Row]) -> list[str]:
    """Our ratios next to GPipe's Table 1 (parameters, relative to K = 1 with remat)."""
    ours = {k: ratio(rows, "remat", k, "remat", 1) for k in STAGES}
    naive = ratio(rows, "no remat", 1, "remat", 1)
    lines = [
        "| largest model relative to K=1 with remat | no remat, K=1 | K=1 | K=2 | K=4 | K=8 |",
        "|---|---|---|---|---|---|",
        "| gpipe (this table) | " + " | ".join(f"{x:.2f}x" for x in (naive, *ours.values())) + " |",
    ]
    for name, sizes in PAPER.items():
        cells = [sizes["naive"] / sizes[1]] + [sizes.get(k, 0) / sizes[1] for k in STAGES]
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
    remat = ratio(rows, "remat", 1, "no remat", 1)
    lines.append(
        f"- remat at K=1 fits **{remat:.2f}x** the parameters of no remat "
        f"(target >= {TARGETS['remat']}): {'met' if remat >= TARGETS['remat'] else 'missed'}."
    )
    stages = ratio(rows, "remat", 8, "remat", 1)
    deepest = next(r for r in rows if r.kind == "remat" and r.fit.layout.stages == 8)
    bound = "at least " if deepest.lower_bound else ""
    lines.append(
        f"- remat at K=8 fits **{bound}{stages:.2f}x** K=1 (target >= {TARGETS['stages']}): "
        f"{'met' if stages >= TARGETS['stages'] else 'missed'}."
    )
    for k in SHARDED_STAGES:
        sharded = ratio(rows, "2 sharded replicas", k, "remat", k)
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


def sharded_check(budget: float, stages: tuple[int, ...]) -> str:
    """The GPT family's remat and sharded rows at ``stages``, measured and refined; the
    sharded replicas' ratios to one replica, as measured."""
    start = time.perf_counter()
    family = families()["GPT"]
    overhead = calibrate(family, processes=8)
    rows = [
        r
        for r in search(family, budget, overhead)
        if r.kind in ("remat", "2 sharded replicas") and r.fit.layout.stages in stages
    ]
    measure(family, rows, stages, stages)
    lines = [
        f"{family.describe()}, {budget / MiB:.0f} MiB per process (calibrated: {overhead}).",
        "",
        *table(rows),
        "",
    ]
    for k in stages:
        sharded = ratio(rows, "2 sharded replicas", k, "remat", k)
        met = "met" if sharded >= TARGETS["sharded"] else "missed"
        exact = all(r.exact for r in rows if r.fit.layout.stages == k)
        lines.append(
            f"- 2 sharded replicas at K={k} fit **{sharded:.2f}x** one replica with remat, "
            f"measured (target >= {TARGETS['sharded']}): {met}"
            + ("." if exact else "; not refined to an exact depth, so not final.")
        )
    elapsed = time.perf_counter() - start
    lines += ["", f"Benchmark wall time: {elapsed / 60:.1f} min on this machine."]
    return "\n".join(lines)


def rows_alone(name: str, stages: int, mode: str, budget: float) -> str:
    """A family's row of ``stages`` and ``mode`` measured and refined on its own (a run of
    the whole family takes over an hour here)."""
    start = time.perf_counter()
    family = families()[name]
    kind = {"no-remat": "no remat", "remat": "remat", "sharded": "2 sharded replicas"}[mode]
    overhead = calibrate(family, processes=8)
    rows = [
        r for r in search(family, budget, overhead)
        if r.kind == kind and r.fit.layout.stages == stages
    ]  # fmt: skip
    measure(family, rows, (stages,), (stages,), moves=16)
    elapsed = time.perf_counter() - start
    return "\n".join([
        f"{name}: {family.describe()}, {budget / MiB:.0f} MiB per process (calibrated: "
        f"{overhead}).",
        "",
        *table(rows),
        "",
        f"Measured by `python benchmarks/capacity.py --rows {name} {stages} {mode}` in "
        f"{elapsed / 60:.1f} min on this machine.",
    ])  # fmt: skip


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=512, help="MiB per process, the whole process's peak"
    )
    parser.add_argument("--family", nargs="*", default=None, help="families to run (all)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--plot", type=Path, default=None, help="save the plot here")
    parser.add_argument(
        "--next-size",
        type=int,
        nargs="*",
        default=list(STAGES),
        help="K whose depth + 1 is run, and the depth refined until exact",
    )
    parser.add_argument(
        "--measure-sharded",
        type=int,
        nargs="*",
        default=list(SHARDED_STAGES),
        help="K of sharded rows run",
    )
    parser.add_argument(
        "--predict-only", nargs="*", default=None, metavar="FAMILY",
        help="no measured runs (of these families; none named: all)",
    )  # fmt: skip
    parser.add_argument("--k1", action="store_true", help="one process against plain PyTorch")
    parser.add_argument("--sharded", action="store_true", help="the sharded rows alone")
    parser.add_argument(
        "--rows", nargs=3, default=None, metavar=("FAMILY", "K", "MODE"),
        help="one family's rows of K stages and MODE (no-remat, remat, sharded) alone, "
        "measured and refined, e.g. --rows ResNet 8 remat",
    )  # fmt: skip
    parser.add_argument(
        "--save", type=Path, default=None,
        help="keep the measured rows here (pickled), rewritten as each family ends",
    )  # fmt: skip
    parser.add_argument(
        "--load", type=Path, nargs="+", default=None,
        help="write the doc and plot from rows kept by --save, measuring nothing",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.k1:
        return one_process(args.out)
    budget = args.budget * MiB
    if args.rows:
        name, k, mode = args.rows
        text = rows_alone(name, int(k), mode, budget)
        print(text)
        if args.out:
            write_doc(args.out, text, part=f"{name} rows measured alone")
        return None
    if args.sharded:
        text = sharded_check(budget, tuple(args.measure_sharded))
        print(text)
        if args.out:
            write_doc(args.out, text, part="sharded replicas, measured")
        return None
    results: dict[str, tuple[str, list[Row], float]] = {}  # calibration, rows, minutes
    for saved in args.load or []:
        results.update(pickle.loads(saved.read_bytes()))
    for name, family in families().items():
        if args.load or (args.family and name not in args.family):
            continue
        print(f"{family.describe()}:", flush=True)
        begun = time.perf_counter()
        overhead = calibrate(family, processes=8)
        print(f"  calibrated: {overhead}", flush=True)
        rows = search(family, budget, overhead)
        predict_only = args.predict_only is not None and (
            not args.predict_only or name in args.predict_only
        )
        if not predict_only:
            measure(family, rows, tuple(args.next_size), tuple(args.measure_sharded))
        results[name] = (str(overhead), rows, (time.perf_counter() - begun) / 60)
        if args.save:  # each family as it ends: a later family's failure loses nothing
            args.save.write_bytes(pickle.dumps(results))
    doc = []
    for name, (overhead, rows, _) in results.items():
        doc += [
            f"### {name}: {families()[name].describe()}",
            "",
            f"Beyond the model's terms (calibrated): {overhead}.",
            "",
            *table(rows),
            "",
            "Predicted peak of the fullest process by term (MiB):",
            "",
            *terms_table(rows),
            "",
            "Targets:",
            "",
            *targets(rows),
            "",
            "Side by side with GPipe's Table 1:",
            "",
            *paper(rows),
            "",
        ]
    minutes = ", ".join(f"{name} {m:.1f} min" for name, (_, _, m) in results.items())
    doc.append(f"Benchmark wall time: {minutes} on this machine.")
    text = "\n".join(doc)
    print(text)
    if args.out:
        write_doc(args.out, text)
    if args.plot:
        plot({name: rows for name, (_, rows, _) in results.items()}, args.plot, budget)


def write_doc(path: Path, results: str, part: str = "capacity results") -> None:
    """Replace the generated part of the doc (between the markers), keep the prose."""
    begin, end = f"<!-- {part}: begin -->", f"<!-- {part}: end -->"
    text = path.read_text() if path.exists() else f"{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{results}\n{end}{tail}")


# -- one process: gpipe's re-materialization per layer against plain PyTorch's best -----------

K1_FAMILY = {"d_model": 192, "heads": 4, "seq": 96, "vocab": 1536, "batch": 16}
K1_BUDGET = 384 * MiB
K1_MICROBATCHES = 16  # plain PyTorch's gradient accumulation, one sample each


@dataclass
class PlainRow:
    kind: str
    depth: int  # the largest measured to fit
    parameters: int
    peak: float  # measured peak growth at depth
    next_peak: float  # ... and at depth + 1


def _plain_rank(rank: int, family: Family, depth: int, per_block: bool, steps: int) -> float:
    """Plain PyTorch in one process, measured as ``verify_capacity`` measures a Pipe: the
    growth of the peak resident memory over the resident memory before the build."""
    from torch.utils.checkpoint import checkpoint

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = family.batch(family.batch_size)
    gc.collect()
    _reset_peak()
    before = _resident_bytes()
    model = family.build(depth)  # embedding, blocks, head
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        for x_m, y_m in zip(
            x.tensor_split(K1_MICROBATCHES), y.tensor_split(K1_MICROBATCHES), strict=True
        ):
            h = model[0](x_m)
            for block in model[1:-1]:
                h = checkpoint(block, h, use_reentrant=False) if per_block else block(h)
            (family.loss_fn(model[-1](h), y_m) / K1_MICROBATCHES).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(_peak_resident_bytes() - before)


def largest_plain(family: Family, per_block: bool, start: int) -> PlainRow:
    """The largest depth whose measured peak fits the budget, walking one block at a time
    from ``start``; the next depth up is measured too."""
    peaks: dict[int, float] = {}

    def peak(depth: int) -> float:
        if depth not in peaks:
            with started_with("return"):  # the allocator of gpipe's measured rows
                args = (family, depth, per_block, 2)
                peaks[depth] = launch(_plain_rank, 1, args=args, timeout=900)[0]
            print(f"  plain, per-block checkpoint {per_block}, depth {depth}: "
                  f"{peaks[depth] / MiB:.1f} MiB", flush=True)  # fmt: skip
        return peaks[depth]

    depth = start
    if peak(depth) <= K1_BUDGET:
        while peak(depth + 1) <= K1_BUDGET:
            depth += 1
    else:
        while peak(depth) > K1_BUDGET:
            depth -= 1
    kind = "per-block torch.utils.checkpoint" if per_block else "no remat"
    with torch.device("meta"):
        parameters = sum(p.numel() for p in family.build(depth).parameters())
    return PlainRow(f"plain PyTorch, {kind}", depth, parameters, peaks[depth], peaks[depth + 1])


def one_process(out: Path | None) -> None:
    family = gpt_family(**K1_FAMILY)
    start = time.perf_counter()
    print(f"{family.describe()}, {K1_BUDGET / MiB:.0f} MiB, one process:", flush=True)
    overhead = calibrate(family, processes=1)
    print(f"  calibrated: {overhead}", flush=True)
    common = {"memory_budget": K1_BUDGET, "processes": 1, "overhead": overhead, "stages": [1],
              "replicas": [1], "chunks": CHUNKS}  # fmt: skip
    remat = ["always", "except_last"]
    rows = []
    for kind, modes, per in (
        ("gpipe, no remat", ["never"], [None]),
        ("gpipe, remat of the whole stage", remat, [None]),
        ("gpipe, remat a few layers at a time", remat, [1, 2, 4]),
    ):
        row = Row(kind, capacity(family, checkpoints=modes, checkpoint_layers=per, **common).best)
        check = verify_capacity(family, row.fit, next_size=True, steps=2)
        row.found, row.bigger = check.found, check.next_size
        print(f"  {check.describe()}", flush=True)
        rows.append(row)
    # walk from gpipe's rows of the same memory: a whole graph held, one block at a time
    plain = [
        largest_plain(family, per_block=False, start=rows[1].fit.depth),
        largest_plain(family, per_block=True, start=rows[2].fit.depth),
    ]
    lines = [
        f"{family.describe()}, AdamW, {K1_BUDGET / MiB:.0f} MiB of peak resident growth in "
        f"one process (`MALLOC_MMAP_THRESHOLD_=65536`); beyond the model's terms "
        f"(calibrated on one process): {overhead}.",
        "",
        "| K=1 | layout | depth | parameters | predicted peak MiB | measured peak MiB "
        "| next size up: predicted / measured MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in plain:
        lines.append(
            f"| {p.kind} | {K1_MICROBATCHES} micro-batches accumulated | {p.depth} | "
            f"{p.parameters / 1e6:.2f} M | – | {_mib(p.peak)} | – / {_mib(p.next_peak)} "
            f"({'exceeds' if p.next_peak > K1_BUDGET else '**fits**'}) |"
        )
    for row in rows:
        fit, bigger = row.fit, row.bigger
        assert row.found is not None and bigger is not None
        verdict = "exceeds" if not bigger.fits else "**fits**"
        lines.append(
            f"| {row.kind} | {fit.layout.label()} | {fit.depth} | {fit.parameters / 1e6:.2f} M "
            f"| {_mib(fit.peak)} | {_mib(row.found.peak)} | {_mib(bigger.fit.peak)} / "
            f"{_mib(bigger.peak)} ({verdict}) |"
        )
    best, checkpointed = rows[2], plain[1]
    lines += [
        "",
        f"- gpipe K=1 recomputing a few layers at a time fits depth **{best.fit.depth}** "
        f"against plain per-block checkpointing's **{checkpointed.depth}** (target: at least "
        f"as many): {'met' if best.fit.depth >= checkpointed.depth else 'missed'}; "
        f"**{best.fit.parameters / rows[1].fit.parameters:.2f}x** the parameters of gpipe's "
        "remat of the whole stage.",
        "",
        f"Benchmark wall time: {(time.perf_counter() - start) / 60:.1f} min on this machine.",
    ]
    text = "\n".join(lines)
    print(text)
    if out:
        write_doc(out, text, part="capacity at K=1")


if __name__ == "__main__":
    main()
