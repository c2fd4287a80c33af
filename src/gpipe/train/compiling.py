"""``gpipe train --compile``: every layer of this process's stages compiled by ``torch.compile``.

Per layer, in place: a stage runs its layers one at a time and seeds each layer's random
numbers before it (``gpipe.base.rng``), so that dropout masks are the same for every cut and every
recomputation; a compiled layer draws from the generator gpipe seeded. What is compiled is the
layer's ``forward`` (``torch.compile(layer.forward)`` in its place): the modules, their
parameters and names stay what they were (checkpoints, state dicts and the optimizer do not
know), module hooks (FSDP's, the activation meter's) run as before around it, and a built-in
layer (``nn.Linear``, an ``nn.Sequential``) is compiled too, which ``nn.Module.compile``
leaves alone (dynamo skips the frames of ``torch.nn``'s own ``__call__``). Layers of one class
share one compiled graph (dynamo takes their parameters as inputs), so a GPT compiles each
kind of layer once per mode (training with and without a graph, evaluation).

Exactness. Inductor's own random numbers (a Philox stream of its own) would give other dropout
masks than eager, and a re-materialized stage's no-grad forward and its recomputation are two
different compiled graphs; ``fallback_random`` makes compiled code draw them as eager does.
With it, the compiled pipeline's gradients are the un-split eager model's, to rounding: fused
kernels sum in another order (``tests/train/test_compiling.py``, float64, per parameter).

What it composes with: re-materialization (the no-grad forward and the recomputation are each
compiled), the split backward of the zero-bubble schedules (a compiled layer's backward is
one autograd node; B records its gradient, W runs that node for the weights: exact, at the
cost of running the compiled layer's backward twice, once in B and once in W), autocast.
"""

from __future__ import annotations

import torch

from gpipe.schedule import Schedule

__all__ = ["compile_stages", "split_backward_note"]


def compile_stages(stages: list, *, backend: str = "inductor") -> int:
    """Compile every layer of ``stages`` (a Pipe's local stages) in place with
    ``torch.compile(backend=backend)``; returns how many layers."""
    if backend == "inductor":
        import torch._inductor.config as inductor

        # Random numbers drawn as eager draws them, from the generator gpipe seeds per layer.
        inductor.fallback_random = True
    # Each layer's forward is its own code to compile, once per layer shape and mode: more
    # than dynamo's default of 8 for a model of layers of several widths, past which it runs
    # the layer eagerly (exact, but not compiled).
    dynamo = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, limit, max(getattr(dynamo, limit), 64))  # the second: torch < 2.7
    layers = [layer for stage in stages for layer in stage.layers]
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend)
    return len(layers)


def split_backward_note(schedule: Schedule) -> str | None:
    """What --compile costs under ``schedule`` when it splits backwards (None: nothing)."""
    split = any(
        schedule.splits_backward(stage, microbatch)
        for stage in range(schedule.num_stages)
        for microbatch in range(schedule.num_microbatches)
    )
    if not split:
        return None
    return (
        f"note: --compile with --schedule {schedule.name}: a compiled layer's backward is one "
        "autograd node, which W runs again for the weight gradients (exact, but each split "
        "backward costs about two); 1f1b has the same memory without it"
    )


def reset() -> None:
    """Forget every compiled graph (tests compare compiled against eager in one process)."""
    torch._dynamo.reset()
