"""``pipe(x)`` in training: outputs connected to autograd, so that ``loss(pipe(x)).backward()``
trains, as every PyTorch model does (and torchgpipe's ``GPipe`` did).

``Pipe.forward`` comes here in training mode with autograd on, in one process; the stages'
side is ``gpipe.engine.autograd_path``. This module is the Pipe's side: micro-batches
(``gpipe.base.microbatch``), the step's seed, the re-materialization rule (``gpipe.base.remat``),
tied copies, deferred batch norm committed once per call (one mini-batch), and the refusal
across processes, where a graph cannot span the ranks and ``Pipe.step`` is the way.

The order is GPipe's whatever the Pipe's ``schedule`` (all forwards now, all backwards in the
caller's ``backward()``), and a re-materialized micro-batch recomputes a whole stage at a time
(``checkpoint_layers`` is ``Pipe.step``'s): for 1F1B's or zero bubble's memory, use
``Pipe.step``.

Example::

    pipe = gpipe.Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=4)
    out = pipe(x)                       # every micro-batch's forward
    loss = criterion(out, y.to(out.device))
    loss.backward()                     # every backward, recomputing as configured
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch

from gpipe.base import microbatch, remat
from gpipe.engine import autograd_path, batchnorm

__all__ = ["forward"]

_ACROSS_PROCESSES = (
    "pipe(x) with autograd runs in one process, but this Pipe is rank {rank} of a pipeline "
    "over processes (group=...), where a graph cannot span the ranks: train with "
    "loss = pipe.step(x, y, loss_fn), or call pipe(x) under torch.no_grad() or after "
    "pipe.eval() for inference"
)


def forward(pipe: Any, inputs: Any, *, chunks: int | None = None) -> Any:
    """``pipe``'s outputs on ``inputs`` (joined on the last stage's device), connected to
    autograd wherever it is on; ``chunks`` micro-batches (default: the Pipe's).

    Recomputes as ``pipe.checkpoint`` says when ``pipe.training`` and autograd is on, never
    otherwise. Deferred batch norms commit once, after the last micro-batch's forward.
    """
    if pipe.rank is not None:
        raise RuntimeError(_ACROSS_PROCESSES.format(rank=pipe.rank))
    chunks = pipe.chunks if chunks is None else chunks
    microbatches = microbatch.split(inputs, chunks, name="inputs")
    training = pipe.training and torch.is_grad_enabled()
    if training and pipe._original is not None:
        pipe._original.refuse_training("a forward in train() mode with autograd on")
    seed, _ = pipe._ranks.begin_step(None, None)  # the seed a step would draw (gpipe.base.rng)
    flags = [training and remat.recomputes(pipe.checkpoint, m, chunks) for m in range(chunks)]
    try:
        outputs = autograd_path.forward(
            pipe.stages, microbatches, seed=seed, remat=flags, stand_ins=_stand_ins(pipe)
        )
    except BaseException:
        batchnorm.reset_all(pipe)
        raise
    batchnorm.commit_all(pipe)
    return microbatch.join(outputs)


def _stand_ins(pipe: Any) -> dict[int, list[autograd_path.StandIn]]:
    """A tied tensor's copy on another device is read as the reference moved there, so that
    autograd sums its uses into the reference's gradient (``gpipe.parallel.tied``)."""
    tied = pipe._tied
    if tied is None:
        return {}
    tied.refresh()  # the copies' values and gradients as a step starts them
    extras = tied.extra_copies()
    reference_of = {id(c): tie.reference for tie in tied.ties if tie.copies for c in tie.extras()}
    found: dict[int, list[autograd_path.StandIn]] = {}
    for stage in pipe.stages:
        for layer in stage.layers:
            for module in layer.modules():
                for name, p in module._parameters.items():
                    if p is not None and id(p) in extras:
                        found.setdefault(stage.index, []).append(
                            (module, name, reference_of[id(p)])
                        )
    return found
