"""One step of a ``Pipe``, from its micro-batches to the verdict every rank agrees on.

``Pipe.step`` (training) and ``Pipe.forward`` (pipelined inference) come here with the
micro-batches this rank holds: the runtime walks the schedule (``gpipe.engine.runtime``), the
replicas reduce their gradients and the tied copies add theirs; then every rank agrees on the
loss and on whether every gradient is finite (``gpipe.parallel.group``). A step that fails or
is refused, here or on another rank, leaves nothing behind: messages, stored micro-batches,
running statistics and gradient reductions are dropped and the gradients of earlier steps
restored, so that the Pipe is ready for the next step.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

from gpipe.base import microbatch, remat
from gpipe.base._utils import (
    Verdict,
    add_earlier_gradients,
    first_nonfinite,
    gradient_norms,
    poison,
    read_verdict,
    restore_gradients,
    set_aside_gradients,
    to_device,
)
from gpipe.base.errors import PipelineError
from gpipe.engine import batchnorm
from gpipe.engine.loss import LossSpec, check_batch, loss_specs
from gpipe.engine.runtime import StepInputs, StepResult
from gpipe.losses import NO_TOKEN, NOTHING_COUNTS, UNCOUNTED, declared, uncounted

__all__ = ["inputs_of", "losses_of", "run", "scale_of"]


def inputs_of(pipe: Any, inputs: Any) -> list | None:
    """The first stage's micro-batches on its device (None where this rank does not hold
    it): the batch moved once (a tensor that requires grad keeps its graph: the user's
    inputs get their gradient), then split into views."""
    if not pipe._holds(0):
        return None
    moved = to_device(inputs, pipe.stages[0].device, differentiable=True)
    return microbatch.split(moved, pipe.chunks, name="inputs")


def losses_of(
    pipe: Any,
    inputs_mb: list | None,
    targets: Any,
    loss_fn: Any,
    *,
    reduction: str | None,
    count: Any,
    scale: torch.Tensor | None,
) -> tuple[list[LossSpec | None], torch.Tensor | None]:
    """Each micro-batch's loss as ``Pipe.step`` was asked for it (None where this rank does
    not hold the last stage), and which targets count nothing (labels < 0 with no
    ``count``: read with the step's verdict)."""
    reduction, count = declared(loss_fn, reduction, count, chunks=pipe.chunks)
    if not pipe._holds(pipe.num_stages - 1):
        return [None] * pipe.chunks, None
    targets_mb = microbatch.split(targets, pipe.chunks, name="targets")
    ignored = uncounted(targets_mb) if count is None and reduction == "mean" else None
    losses = loss_specs(
        loss_fn, targets_mb, inputs_mb, reduction=reduction, count=count,
        device=pipe.stages[-1].device, scale=scale,
    )  # fmt: skip
    return losses, ignored


def run(
    pipe: Any,
    inputs_mb: list | None,
    losses: list[LossSpec | None] | None,
    seed: int | None,
    trace: bool,
    scale: torch.Tensor | None = None,
    ignored: torch.Tensor | None = None,
) -> StepResult:
    """The step of ``pipe`` on these micro-batches (``losses`` None: inference), agreed."""
    pipe._follow_model()  # a captured model's mode, and no hook added since capture
    if losses is not None and pipe._original is not None:
        pipe._original.refuse_training("pipe.step")
    if pipe._ranks.broken is not None:
        raise PipelineError(
            f"this pipeline failed in an earlier step ({pipe._ranks.broken}); "
            "its ranks may disagree on what was sent: build a new Pipe",
        )
    if pipe._tied is not None:
        pipe._tied.refresh()
    # The step's parameters, listed once. Gradients of earlier steps wait aside: a failed
    # step must leave them as they were.
    params = list(pipe.parameters()) if losses is not None else []
    earlier = set_aside_gradients(params)
    try:
        result = _compute(pipe, inputs_mb, losses, seed, trace)
        add_earlier_gradients(earlier)
    except BaseException as error:
        _abandon(pipe, earlier)
        explained = pipe._sharded.explain(error) if pipe._sharded is not None else error
        pipe._ranks.fail(explained, pipe.stages)
        if explained is not error:
            raise explained from error
        raise
    _conclude(pipe, result, losses, params, earlier, scale, ignored)
    batchnorm.commit_all(pipe)
    pipe.last_trace = result.trace
    return result


def _compute(pipe: Any, inputs_mb, losses, seed: int | None, trace: bool) -> StepResult:
    """The runtime over this rank's stages, then the gradients reduced and tied."""
    chunks = pipe.chunks
    pipe._transport.begin(training=losses is not None)
    batch = sum(microbatch.batch_size(x) for x in inputs_mb) if inputs_mb else None
    seed, first_batch = pipe._ranks.begin_step(seed, batch)
    if losses is not None and losses[0] is not None and first_batch is not None:
        check_batch(losses, first_batch)
    step = StepInputs(
        microbatches=inputs_mb or [None] * chunks,
        seed=seed,
        remat=_remat_plan(pipe.checkpoint, chunks),
        losses=losses,
    )
    result = pipe._runtime.run(step, trace=trace, clock_origin=pipe._ranks.clock_origin)
    if pipe._reducer is not None and losses is not None:
        pipe._reducer.finish()
    if pipe._tied is not None and losses is not None:
        # this step's gradients only: every holder already carries the earlier sum
        pipe._tied.sync_gradients(pipe._ranks.exchange)
    return result


@functools.cache
def _remat_plan(mode: str, chunks: int) -> tuple[bool, ...]:
    """Which micro-batches recompute their forward: the same every step of a Pipe."""
    return tuple(remat.recomputes(mode, m, chunks) for m in range(chunks))


def _conclude(pipe: Any, result: StepResult, losses, params, earlier, scale, ignored) -> None:
    """Every rank's verdict on the loss and the gradients (of ``params``, the step's
    parameters), agreed; a refused step undone."""
    local_loss = None
    if losses is not None and pipe._holds(pipe.num_stages - 1):
        # Stacked as they are, then widened: exact, in two operations instead of M.
        losses_mb = torch.stack([result.losses[m] for m in range(pipe.chunks)])
        local_loss = losses_mb.to(torch.float64).sum()
    training = losses is not None
    with_grads = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grads]
    # The watch compares norms before and after the script's edits: those need float64.
    norms = gradient_norms(grads, precise=pipe._watch is not None) if grads else None
    try:
        verdict = read_verdict(local_loss, norms, ignored if not pipe._warned_uncounted else None)
        local_trouble = None
        if verdict.finite is not None and not all(verdict.finite):  # names for the error only
            names = [name for name, p in pipe.named_parameters() if p.grad is not None]
            local_trouble = first_nonfinite(names, verdict.finite, grads, norms)
        if verdict.ignored and not pipe._warned_uncounted:
            pipe._warned_uncounted = True
            warnings.warn(UNCOUNTED, stacklevel=4)
        trouble = local_trouble
        if pipe._sharded is not None and training:
            trouble = pipe._sharded.nonfinite_anywhere(trouble, doing="ending a step")
        if pipe._watch is not None and training:
            pipe._watch.forget()
        agreed = pipe._ranks.agree(
            local_loss, verdict.loss, trouble, refuse_nonfinite=scale is None,
            why=_why_not_finite(verdict, ignored, losses),
        )  # fmt: skip
        # Every rank has received all of its messages: no send can be waiting.
        pipe._transport.finish()
    except BaseException:  # refused here or elsewhere: this step counts nowhere
        _abandon(pipe, earlier)
        raise
    result.loss = agreed.loss
    if scale is not None and agreed.nonfinite_grads and local_trouble is None:
        # Every rank's scaler must find what one rank's found, and skip the step alike.
        for p in with_grads:
            poison(p.grad)
    if pipe._watch is not None and training:
        pipe._watch.note(with_grads, norms, scale)


def _abandon(pipe: Any, earlier: dict) -> None:
    """Nothing of a failed or refused step survives: messages, stored micro-batches,
    running statistics and gradient reductions are dropped, the gradients of earlier
    steps restored; one process is ready for the next step."""
    pipe._transport.clear()
    for stage in pipe.stages:
        stage.clear()
    batchnorm.reset_all(pipe)
    if pipe._reducer is not None:
        pipe._reducer.reset()
    restore_gradients(pipe.parameters(), earlier)


def scale_of(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """A GradScaler's scale as a tensor on ``device`` (None without an enabled scaler); the
    call also gives the scaler its scale on a rank that computes no loss, so that its
    ``unscale_``, ``step`` and ``update`` work there."""
    if scaler is None:
        return None
    if not callable(getattr(scaler, "scale", None)) or not hasattr(scaler, "is_enabled"):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not scaler.is_enabled():
        return None
    return scaler.scale(torch.ones((), device=device))


def _why_not_finite(
    verdict: Verdict, ignored: torch.Tensor | None, losses: list[LossSpec | None] | None
) -> str:
    """Why the loss is not finite, when the targets say (read only then: a refused step)."""
    if verdict.loss is None or math.isfinite(verdict.loss):
        return ""
    if ignored is not None:
        empty = [m for m, flag in enumerate(ignored[1:].tolist()) if flag]
        if empty:
            return NOTHING_COUNTS.format(microbatch=empty[0])
    divisor = losses[0].divisor if losses and losses[0] is not None else None
    if divisor is not None and int(divisor) == 0:
        return NO_TOKEN
    return ""
