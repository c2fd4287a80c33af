"""A GPT whose token embedding is also its output projection, cut so the two are apart.

    python examples/gpt_tied.py               # one process, two stages
    python examples/gpt_tied.py --processes   # two processes (gloo)

The tied weight lives in stage 0 (embedding) and in the last stage (head). Each holds a
copy; gpipe sums their gradients once per step, so the copies stay identical and the
training equals that of the un-split, tied model. See gpipe.parallel.tied.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import gpipe
from gpipe.data import stdlib_bytes
from gpipe.models import GPTConfig, gpt, gpt_tied_names, lm_loss

CONFIG = GPTConfig(context=64, d_model=64, n_heads=4, n_layers=4, dropout=0.0)


def train(rank: int | None = None) -> float:
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
    data = stdlib_bytes(200_000)
    g = torch.Generator().manual_seed(0)
    first = last = 0.0
    for step in range(40):
        offsets = torch.randint(0, len(data) - CONFIG.context - 1, (16,), generator=g)
        window = torch.stack([data[o : o + CONFIG.context + 1] for o in offsets])
        loss = float(pipe.step(window[:, :-1], window[:, 1:], lm_loss))
        first, last = (loss if step == 0 else first), loss
        optimizer.step()
        optimizer.zero_grad()
    if rank in (None, 0):
        print(f"tied GPT loss {first:.3f} -> {last:.3f}")
    return last


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", action="store_true")
    if parser.parse_args().processes:
        gpipe.launch(train, nprocs=2)
    else:
        train()
