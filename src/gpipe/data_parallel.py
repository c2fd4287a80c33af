"""Data parallelism across pipeline replicas: average each stage's gradients.

With R replicas of a K-stage pipeline (R x K processes, a 2-D mesh), the processes that
hold the same stage form a data-parallel group. Once per step their gradients are
averaged with all-reduce, bucketed (few large messages instead of one per parameter),
and started as soon as the stage has run its last backward action of the step, so that
the reduction of one stage overlaps whatever the rank still has to do (other virtual
stages, outstanding sends, the end-of-step agreement).

Gradients are averaged, not summed: each replica's loss is already the mean over its own
mini-batch, so the average over replicas is the gradient of the mean over all of them.
Zero gradients before each step: what was in ``.grad`` before is averaged again.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gpipe.stage import Stage

__all__ = ["GradientReducer"]

BUCKET_BYTES = 25 * 2**20  # as torch.nn.parallel.DistributedDataParallel


class GradientReducer:
    """Averages the gradients of local stages over ``group``, bucket by bucket."""

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
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
        self._done: set[int] = set()
        self._stages = list(stages)

    def stage_done(self, stage: Stage) -> None:
        """Start averaging ``stage``'s gradients (its last backward of the step has run)."""
        if stage.index in self._done:
            return
        self._done.add(stage.index)
        # Parameters without a gradient (unused this step) get zeros, so that every
        # replica sends buckets of the same layout.
        params = [p for p in stage.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in self._buckets([p.grad for p in params]):
            flat = _flatten_dense_tensors(bucket)
            flat.div_(self.size)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((work, flat, bucket))

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        buckets: list[list[torch.Tensor]] = []
        size = self.bucket_bytes
        for grad in grads:
            nbytes = grad.numel() * grad.element_size()
            if size + nbytes > self.bucket_bytes or grad.dtype != buckets[-1][0].dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(grad)
            size += nbytes
        return buckets

    def finish(self) -> None:
        """Wait for every reduction and write the averages back into ``.grad``."""
        for stage in self._stages:  # stages with no backward action this step
            self.stage_done(stage)
        pending, self._pending = self._pending, []
        self._done.clear()
        for work, flat, bucket in pending:
            work.wait(timeout=timedelta(seconds=self.timeout))
            for grad, averaged in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                grad.copy_(averaged)

    def reset(self) -> None:
        self._pending.clear()
        self._done.clear()
