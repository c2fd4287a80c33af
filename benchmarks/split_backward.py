"""Split backward (B + W) against one full backward and against the peer's split.

Zero-bubble schedules run each stage's backward in two parts: B, the input gradient, which
the previous stage waits for, and W, the weight gradients, deferred into the bubbles. This
measures, on the last stage of the throughput benchmark's GPT (4 blocks + head + loss,
one thread), what each part costs per micro-batch:

* **full**: one ``autograd.backward`` from the loss (what GPipe and 1F1B run);
* **gpipe**: ``gpipe.split_backward.backward_input`` then ``backward_weight``;
* **peer**: ``torch.distributed.pipelining``'s ``stage_backward_input`` then
  ``stage_backward_weight`` (what its zero-bubble schedules run).

The three run in rounds, in alternating order, on the same forward, so each round sees the
same machine; the tables give medians over rounds. Every method's gradients are compared
with the full backward's.

Run: ``python benchmarks/split_backward.py [--quick] [--out docs/benchmarks.md]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpipe.engine.split_backward import backward_input, backward_weight
from gpipe.models import GPTConfig, gpt, lm_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measured_timeline import balance, machine, source, write_section  # a sibling script

SECTION = "split-backward"
METHODS = ("full", "gpipe", "peer")


@dataclass(frozen=True)
class Setup:
    config: GPTConfig
    microbatches: tuple[int, ...]  # micro-batch sizes (the benchmark's batch 32 / M)
    rounds: int
    warmup: int


FULL = Setup(
    GPTConfig(vocab_size=256, context=128, d_model=256, n_heads=8, n_layers=8, dropout=0.0),
    microbatches=(2, 4, 8),
    rounds=21,
    warmup=3,
)
QUICK = Setup(
    GPTConfig(vocab_size=64, context=32, d_model=64, n_heads=4, n_layers=4, dropout=0.0),
    microbatches=(2, 4),
    rounds=3,
    warmup=1,
)

Timed = tuple[float, float]  # seconds of B (or the full backward) and of W


def _methods(stage: torch.nn.Sequential) -> dict[str, Callable]:
    params = list(stage.parameters())

    def full(loss: torch.Tensor, inp: torch.Tensor) -> Timed:
        start = time.perf_counter()
        torch.autograd.backward([loss])
        return time.perf_counter() - start, 0.0

    def ours(loss: torch.Tensor, inp: torch.Tensor) -> Timed:
        start = time.perf_counter()
        _, work = backward_input([loss], [None], [inp], params)
        middle = time.perf_counter()
        del loss  # as the runtime holds it: not at all after B
        backward_weight(work)
        return middle - start, time.perf_counter() - middle

    methods = {"full": full, "gpipe": ours}
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:  # a private module: absent from other torch versions
        return methods

    def peer(loss: torch.Tensor, inp: torch.Tensor) -> Timed:
        start = time.perf_counter()
        _, groups = stage_backward_input([loss], None, [inp], iter(params))
        middle = time.perf_counter()
        del loss
        stage_backward_weight(iter(params), groups)
        return middle - start, time.perf_counter() - middle

    methods["peer"] = peer
    return methods


@dataclass
class Row:
    microbatch: int
    times: dict[str, list[Timed]]
    grad_error: dict[str, float]

    def median(self, method: str, part: int | None = None) -> float:
        runs = self.times[method]
        if part is None:
            return statistics.median(b + w for b, w in runs)
        return statistics.median(t[part] for t in runs)


def measure(setup: Setup, microbatch: int) -> Row:
    torch.manual_seed(0)
    model = gpt(setup.config)
    cut = balance(len(model), 2)[0]
    first, stage = model[:cut], model[cut:]
    generator = torch.Generator().manual_seed(0)
    shape = (microbatch, setup.config.context)
    x = torch.randint(0, setup.config.vocab_size, shape, generator=generator)
    y = torch.randint(0, setup.config.vocab_size, shape, generator=generator)
    with torch.no_grad():
        hidden = first(x)
    methods = _methods(stage)
    times: dict[str, list[Timed]] = {name: [] for name in methods}
    grads: dict[str, list[torch.Tensor]] = {}
    names = list(methods)
    for round_ in range(setup.warmup + setup.rounds):
        for name in names if round_ % 2 else names[::-1]:
            stage.zero_grad(set_to_none=True)
            inp = hidden.detach().requires_grad_()
            timed = methods[name](lm_loss(stage(inp), y), inp)
            if round_ >= setup.warmup:
                times[name].append(timed)
            if name not in grads:
                grads[name] = [p.grad.clone() for p in stage.parameters()]
    error = {
        name: max(
            float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
            for a, b in zip(grads[name], grads["full"], strict=True)
        )
        for name in grads
        if name != "full"
    }
    return Row(microbatch, times, error)


def table(rows: Sequence[Row]) -> str:
    header = [
        "micro-batch",
        "full backward (ms)",
        "gpipe B + W (ms)",
        "peer B + W (ms)",
        "gpipe split / full (time)",
        "gpipe split / peer split (time)",
        "rounds gpipe split faster",
        "max grad error vs full",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        full, ours = r.median("full") * 1e3, r.median("gpipe") * 1e3
        cells = [
            str(r.microbatch),
            f"{full:.1f}",
            f"{r.median('gpipe', 0) * 1e3:.1f} + {r.median('gpipe', 1) * 1e3:.1f} = {ours:.1f}",
        ]
        if "peer" in r.times:
            peer = r.median("peer") * 1e3
            faster = sum(
                sum(a) < sum(b) for a, b in zip(r.times["gpipe"], r.times["peer"], strict=True)
            )
            cells += [
                f"{r.median('peer', 0) * 1e3:.1f} + {r.median('peer', 1) * 1e3:.1f} = {peer:.1f}",
                f"{ours / full:.3f}",
                f"{ours / peer:.3f}",
                f"{faster} of {len(r.times['gpipe'])}",
            ]
        else:
            cells += ["n/a", f"{ours / full:.3f}", "", ""]
        cells.append(", ".join(f"{k} {v:.0e}" for k, v in r.grad_error.items()))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 rounds (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to update")
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    load_before, code = os.getloadavg()[0], source()
    rows = []
    for microbatch in setup.microbatches:
        rows.append(measure(setup, microbatch))
        r = rows[-1]
        print(
            f"micro-batch {microbatch}: "
            + ", ".join(f"{m} {r.median(m) * 1e3:.1f} ms" for m in r.times),
            flush=True,
        )
    text = table(rows)
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(text)
    print(f"1-minute load average {load}")
    if args.out is None:
        return
    cfg = setup.config
    command = "python benchmarks/split_backward.py" + (" --quick" if args.quick else "")
    write_section(
        args.out,
        SECTION,
        f"""## Split backward: B + W against one full backward

Regenerate: `{command} --out docs/benchmarks.md`

The last stage of the throughput benchmark's GPT ({cfg.n_layers // 2} blocks of d_model \
{cfg.d_model}, the head and the loss; sequence {cfg.context}), one thread, per micro-batch: \
one full backward, gpipe's split (`gpipe.split_backward`: B then W) and \
`torch.distributed.pipelining`'s split (`stage_backward_input` then `stage_backward_weight`, \
what its zero-bubble schedules run). The three ran in {setup.rounds} rounds in alternating \
order after {setup.warmup} warm-up rounds; times are medians over rounds. {code}. Machine: \
{machine()}; 1-minute load average {load}.

{text}
""",
    )


if __name__ == "__main__":
    main()
