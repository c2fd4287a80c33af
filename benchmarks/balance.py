"""Balance quality, measured.

    python benchmarks/balance.py [--out docs/balance.md] [--quick]

For a GPT with a heavy head and embedding (a large vocabulary) and for a ResNet-style
CNN whose layers cost very different amounts, cut K = 2 and 4 ways by three methods — uniform
(equal layer counts), parameter count (``gpipe.balance_by_size`` without a sample,
DeepSpeed's ``"parameters"``) and time (``gpipe.balance_by_time``) — then train a few
steps of each pipeline in one process and report the *measured* max/mean stage time
(each stage's busy time per step, from ``pipe.step(..., trace=True)``).

(The planner's predicted throughput against measured: ``benchmarks/planner_accuracy.py``.)

Everything runs on one CPU thread per process (stages in one process run one after the
other, so their times do not disturb each other).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gpipe
from gpipe.models import GPTConfig, gpt, lm_loss, resnet
from reference import even_balance

STAGES, CHUNKS, CHECKPOINT = (2, 4), 4, "except_last"


def gpt_case(quick: bool):
    # The throughput benchmark's transformer (8 blocks, d_model 256, sequence 128) with a
    # large vocabulary: an embedding and a head of 2M parameters each, the head (with the
    # loss) costing about three blocks.
    if quick:
        config = GPTConfig(vocab_size=2048, context=32, d_model=64, n_heads=4, n_layers=4)
    else:
        config = GPTConfig(vocab_size=8192, context=128, d_model=256, n_heads=8, n_layers=8)
    torch.manual_seed(0)
    model = gpt(config)
    batch = 8
    x = torch.randint(0, config.vocab_size, (batch, config.context))
    y = torch.randint(0, config.vocab_size, (batch, config.context))
    what = (
        f"GPT: {config.n_layers} blocks, d_model {config.d_model}, vocab {config.vocab_size}, "
        f"seq {config.context}, batch {batch}"
    )
    return "gpt", what, model, x, y, lm_loss


def cnn_case(quick: bool):
    # Resolution halves and width doubles at each stage: blocks cost about the same time,
    # their parameters grow four times per stage.
    torch.manual_seed(0)
    widths, blocks, batch = ((16, 32, 64), 1, 8) if quick else ((32, 64, 128), 2, 16)
    model = resnet(widths=widths, blocks=blocks)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    what = (
        f"ResNet-style CNN: widths {widths} at 32, 16, 8 px, {blocks} residual blocks each, "
        f"batch {batch}"
    )
    return "cnn", what, model, x, y, F.cross_entropy


def imbalance(times) -> float:
    return max(times) / (sum(times) / len(times))


def stage_times(model, balance, x, y, loss_fn, steps: int) -> list[float]:
    """Median busy seconds per step of each stage, from traced steps in one process."""
    pipe = gpipe.Pipe(model, balance=balance, chunks=CHUNKS, checkpoint=CHECKPOINT)
    per_step = []
    for step in range(steps + 1):
        pipe.step(x, y, loss_fn, seed=step, trace=True)
        pipe.zero_grad(set_to_none=True)
        if step == 0:
            continue  # warm-up
        busy = [0.0] * len(balance)
        for event in pipe.last_trace:
            busy[event.action.stage] += event.duration
        per_step.append(busy)
    return [statistics.median(s[i] for s in per_step) for i in range(len(balance))]


def balance_rows(case, steps: int) -> tuple[list[str], str]:
    name, _, model, x, y, loss_fn = case
    micro, target = x[: len(x) // CHUNKS], y[: len(y) // CHUNKS]
    prof = gpipe.profile(model, micro, target=target, loss_fn=loss_fn)
    layer_times = [lay.forward * (1 + (CHUNKS - 1) / CHUNKS) + lay.backward for lay in prof.layers]
    rows = []
    for k in STAGES:
        methods = {
            "uniform": even_balance(len(model), k),
            "parameters": gpipe.balance_by_size(model, stages=k),
            "time": gpipe.balance_by_time(
                model,
                micro,
                stages=k,
                chunks=CHUNKS,
                checkpoint=CHECKPOINT,
                target=target,
                loss_fn=loss_fn,
            ),
        }
        for method, balance in methods.items():
            times = stage_times(model, balance, x, y, loss_fn, steps)
            predicted = [sum(layer_times[i:j]) for i, j in _bounds(balance)]
            cells = " / ".join(f"{t * 1e3:.0f}" for t in times)
            rows.append(
                f"| {name} | {k} | {method} | {balance} | {cells} | **{imbalance(times):.2f}** "
                f"| {imbalance(predicted):.2f} | {max(times) * 1e3:.0f} |"
            )
            print(rows[-1], flush=True)
    return rows, prof.table()


def _bounds(balance):
    start = 0
    for size in balance:
        yield start, start + size
        start += size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = [gpt_case(args.quick), cnn_case(args.quick)]
    steps = 2 if args.quick else 4

    lines = [
        "## Balance: measured max/mean stage time",
        "",
        f"One process, one thread; M={CHUNKS}, checkpoint={CHECKPOINT!r}. Stage time = the "
        f"stage's busy time in a training step (median of {steps} steps after one warm-up), "
        "in ms; max/mean of those (**measured**) and of the profile's per-layer times "
        "(predicted); the slowest stage bounds the pipeline's step.",
        "",
        *[f"* {what}" for _, what, *_ in cases],
        "",
        "| model | K | method | balance | stage ms | max/mean | predicted | slowest ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    profiles = []
    for case in cases:
        rows, table = balance_rows(case, steps)
        lines += rows
        profiles.append((case[0], table))
    lines += ["", "Per-layer profile of one micro-batch (the input of the time balance):", ""]
    for name, table in profiles:
        lines += [f"{name}:", "", "```", table, "```", ""]

    table = "\n".join(lines)
    print(table)
    if args.out:
        text = args.out.read_text() if args.out.exists() else ""
        marker = "<!-- benchmark results -->"
        head = text.split(marker)[0] if marker in text else text
        command = "python benchmarks/balance.py --out docs/balance.md"
        args.out.write_text(
            head.rstrip() + f"\n\n{marker}\n\nRegenerate: `{command}`\n\n" + table + "\n"
        )


if __name__ == "__main__":
    main()
