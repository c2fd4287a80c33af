"""A first look, in one process: a small GPT trained through a pipeline, its loss and speed.

    gpipe demo            # a 2-stage pipeline on stdlib source; loss and throughput
    python -m gpipe demo --stages 3 --chunks 8 --steps 60

The whole library use is the ``demo`` function below; ``gpipe train`` is the real job.
"""

from __future__ import annotations

import argparse
import time

import torch

from gpipe.base.remat import REMAT_MODES

__all__ = ["configure", "run"]


def demo(args: argparse.Namespace) -> None:
    from gpipe.layout import FLAGS, Layout, even_balance
    from gpipe.models import GPTConfig, gpt, lm_loss
    from gpipe.pipe import Pipe
    from gpipe.train.data import stdlib_bytes

    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = GPTConfig(context=args.seq, d_model=128, n_heads=4, n_layers=4, dropout=0.1)
    model = gpt(config)
    layers = len(model)
    layout = Layout(stages=args.stages, chunks=args.chunks, checkpoint=args.checkpoint)
    problems = layout.problems(layers=layers, spelling=FLAGS)
    if problems:
        raise SystemExit("gpipe demo: " + "; ".join(problems))
    balance = even_balance(layers, args.stages)
    pipe = Pipe(model, balance=balance, chunks=args.chunks, checkpoint=args.checkpoint)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)

    data = stdlib_bytes(400_000)
    generator = torch.Generator().manual_seed(args.seed)
    print(
        f"gpipe demo: GPT {layers} layers, {sum(p.numel() for p in pipe.parameters()):,} "
        f"parameters, balance={balance}, chunks={args.chunks}, checkpoint={args.checkpoint}, "
        f"{len(data):,} bytes of stdlib source"
    )
    tokens = 0
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        offsets = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=generator)
        window = torch.stack([data[o : o + args.seq + 1] for o in offsets])
        loss = pipe.step(window[:, :-1], window[:, 1:], lm_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += args.batch * args.seq
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}  loss {loss.item():.3f}  {tokens / elapsed:,.0f} tokens/s")


def configure(d: argparse.ArgumentParser) -> None:
    d.add_argument("--stages", type=int, default=2)
    d.add_argument("--chunks", type=int, default=4)
    d.add_argument("--checkpoint", default="except_last", choices=REMAT_MODES)
    d.add_argument("--batch", type=int, default=16)
    d.add_argument("--seq", type=int, default=64)
    d.add_argument("--steps", type=int, default=150)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--log-every", type=int, default=25)


def run(args: argparse.Namespace) -> int:
    demo(args)
    return 0
