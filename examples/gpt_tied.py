"""A GPT whose token embedding is also its output projection, cut so the two are apart.

    python examples/gpt_tied.py               # one process, two stages
    python examples/gpt_tied.py --processes   # two processes (gloo)

The tied weight lives in stage 0 (embedding) and in the last stage (head). In one process on
one device both stages hold the one tensor; across processes each holds a copy, gpipe sums
their gradients once per step, and the copies stay identical: the training equals that of
the un-split, tied model. See gpipe.parallel.tied.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import gpipe
from gpipe.models import GPTConfig, gpt, gpt_tied_names, lm_loss
from gpipe.train.data import TokenWindows, stdlib_bytes

CONFIG = GPTConfig(context=64, d_model=64, n_heads=4, n_layers=4, dropout=0.0)


def train(rank: int | None = None) -> float:
    torch.set_num_threads(1)  # layers this small: more threads only wait on each other
    group = dist.group.WORLD if rank is not None else None
    pipe = gpipe.Pipe(
        lambda: gpt(CONFIG, tie_embeddings=True),
        balance=[3, 3],
        devices=None if group is not None else ["cpu", "cpu"],
        chunks=4,
        group=group,
        tied=[gpt_tied_names(CONFIG)],
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    windows = TokenWindows(stdlib_bytes(200_000), seq=CONFIG.context)
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        x, y = windows[torch.randint(len(windows), (16,), generator=g)]  # 16 windows of 64 bytes
        loss = float(pipe.step(x, y, lm_loss))  # at first ln(256) = 5.5: every byte as likely
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 and rank in (None, 0):
            print(f"step {step:3d}  loss {loss:.3f}", flush=True)
    if rank in (None, 0):
        print(f"final loss {loss:.3f}")
    return loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", action="store_true")
    if parser.parse_args().processes:
        gpipe.launch(train, nprocs=2)
    else:
        train()
