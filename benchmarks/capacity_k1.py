"""One process: gpipe's re-materialization per layer against plain PyTorch's best.

    python benchmarks/capacity.py --k1 --out docs/capacity.md

gpipe's rows at K = 1 against plain PyTorch's best on the same family, budget and
mini-batch (16-way gradient accumulation, no remat, or per-block
``torch.utils.checkpoint``), each row's peak resident growth over what the process held
before its model; it writes its own section of the doc (``benchmarks/capacity.py``).
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpipe.base._utils import MiB
from gpipe.base.allocator import started_with
from gpipe.parallel.launch import launch
from gpipe.planner import calibrate, capacity, verify_capacity
from gpipe.planner.families import Family, gpt_family
from gpipe.planner.measured import _peak_resident_bytes, _reset_peak, _resident_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capacity import CHUNKS  # siblings
from capacity_doc import Row, _mib, write_doc

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
    lines = _table(family, overhead, rows, plain)
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


def _table(family: Family, overhead, rows: list[Row], plain: list[PlainRow]) -> list[str]:
    """Plain PyTorch's rows, then gpipe's, each with its next size up."""
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
    return lines
