"""Data parallelism across pipeline replicas: average each stage's gradients.

With R replicas of a K-stage pipeline (R x K processes, a 2-D mesh), the processes that
hold the same stage form a data-parallel group. Once per step their gradients are
averaged with all-reduce, bucketed (few large messages instead of one per parameter).
A bucket's reduction starts during the stage's last backward action of the step, as
soon as its parameters' gradients are final, so it overlaps the rest of that backward
and whatever the rank still has to do (other virtual stages, outstanding sends, the
end-of-step agreement).

Gradients are averaged, not summed: each replica's loss is already the mean over its own
mini-batch, so the average over replicas is the gradient of the mean over all of them.
Zero gradients before each step: what was in ``.grad`` before is averaged again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe.engine.stage import Stage
from gpipe.parallel.collectives import Collectives

__all__ = ["GradientReducer"]

BUCKET_BYTES = 25 * 2**20  # as torch.nn.parallel.DistributedDataParallel


class GradientReducer:
    """Averages the gradients of local stages over ``group``, bucket by bucket.

    Buckets follow a stage's parameters from last to first, the order in which backward
    finishes them, and are reduced in that fixed order on every replica, as collectives
    must be. During a stage's last backward action of the step (:meth:`arm`), a bucket's
    all-reduce starts as soon as autograd has accumulated the final gradient of each of
    its parameters, overlapping the rest of that backward; :meth:`stage_done` starts
    whatever is left (parameters that got no gradient are reduced as zeros).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        group: Any,
        *,
        timeout: float = 60.0,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self._ops = Collectives(group, timeout=timeout)
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._stages = list(stages)
        self._buckets = {stage.index: self._bucket(stage) for stage in self._stages}
        self._launched: dict[int, int] = {}  # stage -> buckets started this step
        self._ready: set[int] = set()  # ids of parameters whose gradient is final
        self._hooks: dict[int, list[Any]] = {}

    def _bucket(self, stage: Stage) -> list[list[torch.Tensor]]:
        buckets: list[list[torch.Tensor]] = []
        size = self.bucket_bytes
        for param in reversed([p for p in stage.parameters() if p.requires_grad]):
            nbytes = param.numel() * param.element_size()
            if size + nbytes > self.bucket_bytes or param.dtype != buckets[-1][0].dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(param)
            size += nbytes
        return buckets

    def arm(self, stage: Stage) -> None:
        """``stage`` is about to run its last backward action: reduce buckets as they fill."""

        def accumulated(param: torch.Tensor) -> None:
            self._ready.add(id(param))
            self._launch(stage.index, only_ready=True)

        self._hooks[stage.index] = [
            p.register_post_accumulate_grad_hook(accumulated)
            for bucket in self._buckets[stage.index]
            for p in bucket
        ]

    def stage_done(self, stage: Stage) -> None:
        """``stage``'s last backward action has run: reduce every bucket not yet started."""
        self._disarm(stage.index)
        self._launch(stage.index, only_ready=False)

    def _disarm(self, index: int) -> None:
        for handle in self._hooks.pop(index, []):
            handle.remove()

    def _launch(self, index: int, *, only_ready: bool) -> None:
        buckets = self._buckets[index]
        start = self._launched.get(index, 0)
        for bucket in buckets[start:]:
            if only_ready and not all(id(p) in self._ready for p in bucket):
                return  # later buckets wait: every replica starts them in the same order
            for p in bucket:
                if p.grad is None:  # unused this step: zeros, so every layout matches
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in bucket]
            flat = _flatten_dense_tensors(grads)
            flat.div_(self.size)
            work = self._ops.start_all_reduce(flat)
            self._pending.append((work, flat, grads))
            self._launched[index] = self._launched.get(index, 0) + 1

    def finish(self) -> None:
        """Wait for every reduction and write the averages back into ``.grad``."""
        for stage in self._stages:  # stages with no backward action this step
            self.stage_done(stage)
        pending = self._pending
        self.reset()
        for work, flat, bucket in pending:
            self._ops.wait("the data-parallel gradient all-reduce", lambda work=work: work)
            for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                grad.copy_(averaged)

    def reset(self) -> None:
        for index in list(self._hooks):
            self._disarm(index)
        self._pending = []
        self._launched.clear()
        self._ready.clear()
