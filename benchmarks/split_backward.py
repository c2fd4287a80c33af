"""Split backward (B + W) against one full backward, per layer type, and against the peer's split.

Zero-bubble schedules run each stage's backward in two parts: B, the input gradient, which
the previous stage waits for, and W, the weight gradients, deferred into the bubbles. The
*split tax* is (B + W) / one full backward. This measures it, one thread, per micro-batch, for

* the two stages of the throughput benchmark's GPT (8 blocks, d_model 256, sequence 128):
  the last (4 blocks, head and loss) at micro-batches of 2, 4 and 8 sequences, and the first
  (embedding and 4 blocks), whose input (token ids) needs no gradient, so that B is empty
  and W is the whole backward;
* one layer type at a time, at the micro-batch of the benchmark's M=8 (4 sequences): MLPs
  (Linear 256 -> 1024 -> 256), transformer blocks (attention + MLP), the head (LayerNorm,
  Linear to the vocabulary, the loss), and residual blocks of convolution + batch norm
  (64 channels, 32 x 32 pixels, 8 images).

Three methods, on the same forward, in alternating order, each round seeing the same machine:

* **full**: one ``autograd.backward`` (what GPipe and 1F1B run);
* **gpipe**: ``gpipe.engine.split_backward.backward_input`` then ``backward_weight``;
* **peer**: ``torch.distributed.pipelining``'s ``stage_backward_input`` then
  ``stage_backward_weight`` (what its zero-bubble schedules run).

A stage that is not the last starts its backward from a fixed gradient of its output, as in
a pipeline. Every method's gradients are compared with the full backward's.

Each run is repeated under two policies of the C allocator (``gpipe.cpu_allocator``), each
in a process of its own, since a process cannot go back to glibc's default: ``default``
and ``cache`` (freed CPU tensors kept for reuse, as PyTorch's CUDA allocator does). With the
default, a split backward pays for the memory it holds longer: its W keeps landing on fresh,
page-faulting memory.

Run: ``python benchmarks/split_backward.py [--quick] [--out docs/benchmarks.md]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gpipe import cpu_allocator
from gpipe.engine import split_backward
from gpipe.models import GPTConfig, Head, Residual, gpt, lm_loss, mlp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measured_timeline import balance, machine, source, write_section  # a sibling script

SECTION = "split-backward"
POLICIES = ("default", "cache")
METHODS = ("full", "gpipe", "peer")


@dataclass(frozen=True)
class Setup:
    config: GPTConfig
    gpt_microbatches: tuple[int, ...]  # sequences per micro-batch for the GPT's stages
    layer_microbatch: int  # for the one-layer-type rows
    images: int  # images per micro-batch for the convolution row
    image_size: int
    channels: int
    rounds: int
    warmup: int


FULL = Setup(
    GPTConfig(vocab_size=256, context=128, d_model=256, n_heads=8, n_layers=8, dropout=0.0),
    gpt_microbatches=(2, 4, 8),
    layer_microbatch=4,
    images=8,
    image_size=32,
    channels=64,
    rounds=15,
    warmup=3,
)
QUICK = Setup(
    GPTConfig(vocab_size=64, context=32, d_model=64, n_heads=4, n_layers=4, dropout=0.0),
    gpt_microbatches=(2,),
    layer_microbatch=2,
    images=2,
    image_size=8,
    channels=8,
    rounds=3,
    warmup=1,
)

Timed = tuple[float, float]  # seconds of B (or of the full backward) and of W


@dataclass
class Case:
    """One stage: its module, one micro-batch's input, and where its backward starts."""

    name: str
    microbatch: str
    stage: nn.Module
    inputs: torch.Tensor  # needs a gradient unless the stage is a first stage
    loss: Callable[[torch.Tensor], torch.Tensor] | None  # None: start from a fixed gradient


def cases(setup: Setup) -> list[Case]:
    cfg, generator = setup.config, torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = gpt(cfg)
    cut = balance(len(model), 2)[0]
    first, last = model[:cut], model[cut:]
    blocks = nn.Sequential(*model[1:cut])

    def tokens(batch: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (batch, cfg.context), generator=generator)

    def hidden(batch: int) -> torch.Tensor:
        return torch.randn(batch, cfg.context, cfg.d_model, generator=generator)

    found = []
    for batch in setup.gpt_microbatches:
        targets = tokens(batch)
        with torch.no_grad():
            entering = first(tokens(batch))
        found.append(
            Case(
                f"GPT last stage ({len(last) - 1} blocks + head + loss)",
                f"{batch} seq",
                last,
                entering,
                lambda out, t=targets: lm_loss(out, t),
            )
        )
    batch = setup.layer_microbatch
    d, blocks_in_stage = cfg.d_model, cut - 1
    found.append(
        Case(
            f"GPT first stage (embedding + {blocks_in_stage} blocks)",
            f"{batch} seq",
            first,
            tokens(batch),
            None,
        )
    )
    layer_mlps = nn.Sequential(*(mlp([d, 4 * d, d]) for _ in range(blocks_in_stage)))
    found.append(
        Case(
            f"MLP ({blocks_in_stage} x Linear {d}->{4 * d}->{d})",
            f"{batch} seq",
            layer_mlps,
            hidden(batch),
            None,
        )
    )
    found.append(
        Case(
            f"transformer blocks ({blocks_in_stage}, attention + MLP)",
            f"{batch} seq",
            blocks,
            hidden(batch),
            None,
        )
    )
    head_targets = tokens(batch)
    found.append(
        Case(
            f"head (LayerNorm + Linear to {cfg.vocab_size} + loss)",
            f"{batch} seq",
            Head(cfg),
            hidden(batch),
            lambda out, t=head_targets: lm_loss(out, t),
        )
    )
    c = setup.channels
    images = torch.randn(setup.images, c, setup.image_size, setup.image_size, generator=generator)
    convs = nn.Sequential(*(Residual(c) for _ in range(blocks_in_stage)))
    found.append(
        Case(
            f"conv + batch norm ({blocks_in_stage} residual blocks, {c} ch)",
            f"{setup.images} img {setup.image_size} px",
            convs,
            images,
            None,
        )
    )
    return found


def _methods() -> dict[str, Callable]:
    def full(roots, grads, inp, params) -> Timed:
        start = time.perf_counter()
        torch.autograd.backward(roots, grads)
        return time.perf_counter() - start, 0.0

    def ours(roots, grads, inp, params) -> Timed:
        start = time.perf_counter()
        _, work = split_backward.backward_input(roots, grads, [inp], params)
        middle = time.perf_counter()
        roots.clear()  # as the runtime holds them: not at all after B
        split_backward.backward_weight(work)
        return middle - start, time.perf_counter() - middle

    methods = {"full": full, "gpipe": ours}
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:  # a private module: absent from other torch versions
        return methods

    def peer(roots, grads, inp, params) -> Timed:
        if not inp.requires_grad:
            return float("nan"), float("nan")  # its schedules run a first stage's backward whole
        start = time.perf_counter()
        _, groups = stage_backward_input(
            roots, None if grads[0] is None else grads, [inp], iter(params)
        )
        middle = time.perf_counter()
        roots.clear()
        stage_backward_weight(iter(params), groups)
        return middle - start, time.perf_counter() - middle

    methods["peer"] = peer
    return methods


def _analysis_seconds(
    case: Case, params: list[torch.Tensor], gradient: torch.Tensor | None
) -> float:
    """B's graph analysis alone: backward_input stopped where it calls autograd."""

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    roots, grads, inp = _forward(case, gradient)
    real, torch.autograd.grad = torch.autograd.grad, stop
    try:
        start = time.perf_counter()
        with contextlib.suppress(Stop):
            split_backward.backward_input(roots, grads, [inp], params)
        return time.perf_counter() - start
    finally:
        torch.autograd.grad = real


def _forward(case: Case, gradient: torch.Tensor | None) -> tuple[list, list, torch.Tensor]:
    inp = case.inputs.detach()
    if inp.is_floating_point():
        inp.requires_grad_()
    out = case.stage(inp)
    if case.loss is not None:
        return [case.loss(out)], [None], inp
    # The peer detaches the outputs in place after its B, which a view (a Linear's 3-D
    # output) refuses; a copy costs the three methods alike.
    return [out.clone() if out._is_view() else out], [gradient], inp


def measure(case: Case, setup: Setup) -> dict:
    params = [p for p in case.stage.parameters() if p.requires_grad]
    methods = _methods()
    gradient = None
    if case.loss is None:
        with torch.no_grad():
            shape = case.stage(case.inputs).shape
        gradient = (
            torch.randn(shape, generator=torch.Generator().manual_seed(1)) / shape.numel() ** 0.5
        )
    times: dict[str, list[Timed]] = {name: [] for name in methods}
    kernel: dict[str, list[tuple[float, int]]] = {name: [] for name in methods}
    grads: dict[str, list[torch.Tensor]] = {}
    names = list(methods)
    for round_ in range(setup.warmup + setup.rounds):
        for name in names if round_ % 2 else names[::-1]:
            case.stage.zero_grad(set_to_none=True)
            before = resource.getrusage(resource.RUSAGE_SELF)
            roots, grad_outputs, inp = _forward(case, gradient)
            timed = methods[name](roots, grad_outputs, inp, params)
            after = resource.getrusage(resource.RUSAGE_SELF)
            if round_ >= setup.warmup:
                times[name].append(timed)
                # The system's share of the round (forward included: memory given back
                # after one W is faulted in again by the next forward) and its page faults.
                kernel[name].append(
                    ((after.ru_stime - before.ru_stime) * 1e3, after.ru_minflt - before.ru_minflt)
                )
            if name not in grads and timed[0] == timed[0]:  # not NaN: it ran
                grads[name] = [p.grad.clone() for p in params]
    analysis = statistics.median(_analysis_seconds(case, params, gradient) for _ in range(5))
    error = {
        name: max(
            float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
            for a, b in zip(grads[name], grads["full"], strict=True)
        )
        for name in grads
        if name != "full"
    }
    return {
        "case": case.name,
        "microbatch": case.microbatch,
        "times": times,
        "kernel": kernel,
        "error": error,
        "analysis": analysis,
    }


def _median(row: dict, method: str, part: int | None = None) -> float:
    runs = row["times"][method]
    values = [b + w if part is None else (b, w)[part] for b, w in runs]
    return statistics.median(values) * 1e3


def _ratio_interval(row: dict, method: str, base: str = "full") -> str:
    """Median of each round's own ratio, with the 25th-75th percentile of those ratios."""
    ratios = sorted(
        sum(a) / sum(b) for a, b in zip(row["times"][method], row["times"][base], strict=True)
    )
    if not ratios or ratios[0] != ratios[0]:
        return "n/a"
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{statistics.median(ratios):.3f} ({q[0]:.2f}–{q[2]:.2f})"


def _kernel(row: dict, method: str = "gpipe") -> str:
    rounds = row["kernel"][method]
    system = statistics.median(ms for ms, _ in rounds)
    faults = statistics.median(count for _, count in rounds)
    return f"{system:.1f} ({faults:.0f})"


def table(runs: dict[str, list[dict]]) -> str:
    header = [
        "stage",
        "micro-batch",
        "full backward (ms)",
        "gpipe B + W (ms)",
        "B's graph analysis (ms)",
        "peer B + W (ms)",
        "tax gpipe, default allocator",
        "tax peer, default",
        "tax gpipe, `cache` allocator",
        "tax peer, `cache`",
        "gpipe split round: system ms (page faults), default → `cache`",
        "max grad error vs full",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for plain, cached in zip(runs["default"], runs["cache"], strict=True):
        has_peer = (
            "peer" in plain["times"]
            and plain["times"]["peer"][0][0] == plain["times"]["peer"][0][0]
        )
        peer = (
            f"{_median(plain, 'peer', 0):.1f} + {_median(plain, 'peer', 1):.1f}"
            if has_peer
            else "n/a"
        )
        errors = {
            k: max(plain["error"].get(k, 0.0), cached["error"].get(k, 0.0)) for k in plain["error"]
        }
        cells = [
            plain["case"],
            plain["microbatch"],
            f"{_median(plain, 'full'):.1f}",
            f"{_median(plain, 'gpipe', 0):.1f} + {_median(plain, 'gpipe', 1):.1f}",
            f"{plain['analysis'] * 1e3:.2f}",
            peer,
            _ratio_interval(plain, "gpipe"),
            _ratio_interval(plain, "peer") if has_peer else "n/a",
            _ratio_interval(cached, "gpipe"),
            _ratio_interval(cached, "peer") if has_peer else "n/a",
            f"{_kernel(plain)} → {_kernel(cached)}",
            ", ".join(f"{k} {v:.0e}" for k, v in errors.items()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def child(setup: Setup, policy: str) -> list[dict]:
    """Every case under one allocator policy (this process's whole life)."""
    cpu_allocator(policy)
    torch.set_num_threads(1)
    rows = []
    for case in cases(setup):
        row = measure(case, setup)
        print(
            f"[{policy}] {case.name}, {case.microbatch}: "
            + ", ".join(f"{m} {_median(row, m):.1f} ms" for m in row["times"]),
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 rounds (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to update")
    parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    if args.child:
        print(json.dumps(child(setup, args.child)))
        return
    load_before, code = os.getloadavg()[0], source()
    started = time.monotonic()
    runs = {}
    for policy in POLICIES:
        command = [sys.executable, __file__, "--child", policy] + (
            ["--quick"] if args.quick else []
        )
        done = subprocess.run(command, stdout=subprocess.PIPE, check=True, text=True)
        runs[policy] = json.loads(done.stdout)
    text = table(runs)
    minutes = (time.monotonic() - started) / 60
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(text)
    print(f"1-minute load average {load}; {minutes:.1f} min")
    if args.out is None:
        return
    command = "python benchmarks/split_backward.py" + (" --quick" if args.quick else "")
    write_section(
        args.out,
        SECTION,
        f"""## Split backward: B + W against one full backward

Regenerate: `{command} --out docs/benchmarks.md` ({minutes:.0f} minutes)

One thread, per micro-batch: one full backward, gpipe's split \
(`gpipe.engine.split_backward`: B then W) and `torch.distributed.pipelining`'s split \
(`stage_backward_input` then `stage_backward_weight`, what its zero-bubble schedules run). \
Rows: the two stages of the throughput benchmark's GPT, then one layer type at a time. \
A stage other than the last starts its backward from a fixed output gradient. The three \
methods ran in {setup.rounds} rounds in alternating order after {setup.warmup} warm-up \
rounds, first in a process with glibc's default allocator, then in one with \
`gpipe.cpu_allocator("cache")`. Times are medians over rounds under the default allocator; \
**tax** = (B + W) / full backward, the median of each round's own ratio with its \
25th–75th percentiles. The system column is the kernel's share of a round (forward and \
split backward; `getrusage`) and its page faults, medians over rounds. *B's graph \
analysis* is the part of B spent in Python finding where W must start (`backward_input` \
stopped at its autograd call). {code}. Machine: {machine()}; 1-minute load average {load}.

{text}
""",
    )


if __name__ == "__main__":
    main()
