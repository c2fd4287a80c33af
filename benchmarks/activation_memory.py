"""Peak stored activations per stage, measured, next to GPipe's memory formula.

    python benchmarks/activation_memory.py [--out docs/memory.md]

GPipe (Huang et al., 2019) stores, per stage, with re-materialization, only the
boundary inputs of all M micro-batches plus one micro-batch's inner activations during
its backward: O(N + L/K * N/M) for a mini-batch of N samples and L layers. Without
re-materialization a stage holds every micro-batch's inner activations: O(N * L/K).

Measured with saved-tensor hooks (gpipe.measure_activations); the prediction uses the
boundary size of one sample and the inner activations of the stage for one sample,
both measured on their own, so the table checks how the pieces combine, not a guess.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import gpipe
from gpipe.models import GPTConfig, gpt, lm_loss

CONFIG = GPTConfig(vocab_size=256, context=64, d_model=128, n_heads=4, n_layers=4, dropout=0.1)
BATCH, K, M = 32, 2, 8
BALANCE = [3, 3]


def measure(checkpoint: str, schedule: str = "gpipe", chunks: int = M) -> list[int]:
    torch.manual_seed(0)
    pipe = gpipe.Pipe(
        gpt(CONFIG), balance=BALANCE, chunks=chunks, checkpoint=checkpoint, schedule=schedule
    )
    x = torch.randint(0, 256, (BATCH, CONFIG.context))
    with gpipe.measure_activations(pipe) as meter:
        pipe.step(x, x, lm_loss, seed=0)
    return meter.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args()

    T, C = CONFIG.context, CONFIG.d_model
    boundary = [T * 8, T * C * 4]  # one sample's input: int64 ids, then float32 hidden
    # One sample's inner activations per stage: no re-materialization, one micro-batch.
    inner = [b / BATCH for b in measure("never", chunks=1)]
    predicted = {
        "always": [BATCH * b + BATCH / M * a for b, a in zip(boundary, inner, strict=True)],
        "except_last": [
            (BATCH - BATCH / M) * b + BATCH / M * a for b, a in zip(boundary, inner, strict=True)
        ],
        "never": [BATCH * a for a in inner],
    }
    rows = []
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for mode in ("always", "except_last", "never"):
            peaks = measure(mode, schedule)
            formula = predicted[mode] if schedule == "gpipe" else [None] * K
            rows.append((schedule, mode, peaks, formula))

    lines = [
        f"GPT {CONFIG.n_layers} blocks, d_model {C}, seq {T}, batch N={BATCH}, "
        f"K={K} (balance {BALANCE}), M={M}, float32. MiB per stage.",
        "",
        "| schedule | checkpoint | stage 0 measured | stage 0 formula | "
        "stage 1 measured | stage 1 formula |",
        "|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for schedule, mode, peaks, formula in rows:
        cells = []
        for stage in range(K):
            cells.append(f"{peaks[stage] / mib:.2f}")
            cells.append("" if formula[stage] is None else f"{formula[stage] / mib:.2f}")
        lines.append(f"| {schedule} | {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Formula (GPipe): always = N·boundary + (N/M)·inner; except_last = (N − N/M)·boundary "
        "+ (N/M)·inner; never = N·inner, with boundary and inner the per-sample sizes of "
        "each stage.",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            "# Activation memory per stage\n\n"
            "Regenerate: `python benchmarks/activation_memory.py --out docs/memory.md`\n\n"
            + table
            + "\n"
        )


if __name__ == "__main__":
    main()
