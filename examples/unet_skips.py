"""A U-Net whose skip connections span stages, trained as a 4-stage pipeline.

    python examples/unet_skips.py             # one process, four stages
    python examples/unet_skips.py --processes # four processes (gloo), same gradients

The skip from layer 1 (stage 0) to layer 5 (stage 3) travels straight between those two
stages; stages 1 and 2 never see it. See gpipe.engine.skip and gpipe.models.unet.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn import functional as F

import gpipe
from gpipe.models import unet

BALANCE = [2, 2, 1, 2]  # the skips: stage 0 -> stage 3 and stage 1 -> stage 2


def data(step: int):
    """Pixels above their image's mean are class 1, others class 0 (a toy segmentation)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 1, 16, 16, generator=g)
    return x, (x > x.mean(dim=(2, 3), keepdim=True)).long().squeeze(1)


def train(rank: int | None = None) -> list[float]:
    torch.set_num_threads(1)  # layers this small: more threads only wait on each other
    group = dist.group.WORLD if rank is not None else None
    devices = None if group is not None else ["cpu"] * len(BALANCE)
    pipe = gpipe.Pipe(
        lambda: unet(channels=8, classes=2),
        balance=BALANCE,
        devices=devices,
        chunks=4,
        schedule="1f1b",
        group=group,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        x, y = data(step)
        losses.append(float(pipe.step(x, y, F.cross_entropy)))  # at first ln(2) = 0.69
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 and rank in (None, 0):
            print(f"step {step:3d}  loss {losses[-1]:.3f}", flush=True)
    if rank in (None, 0):
        print(f"final loss {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", action="store_true")
    if parser.parse_args().processes:
        gpipe.launch(train, nprocs=len(BALANCE))
    else:
        train()
