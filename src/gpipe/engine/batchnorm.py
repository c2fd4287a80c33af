"""Deferred batch norm: running statistics of the whole mini-batch, not of each micro-batch.

In training, a pipelined model normalizes each micro-batch with that micro-batch's own mean and
variance, exactly as the un-split model does under gradient accumulation. What must not change is
the *running* statistics: a plain ``nn.BatchNorm`` would update them once per micro-batch (M times
per step, each from a small sample). :class:`DeferredBatchNorm` instead accumulates every
micro-batch's count, mean and sum of squared deviations, and :meth:`DeferredBatchNorm.commit`
applies them once per mini-batch: the statistics of everything the layer saw in the step, in one
update. For the first batch norm of a model that is exactly one full-batch forward; a deeper one
sees inputs that earlier layers normalized per micro-batch, so its statistics differ slightly
from a full-batch pass (measured in ``docs/equivalence.md``).

Statistics are merged with Chan et al.'s parallel algorithm in float64, so that inputs with a large
mean (``1e4 + randn``) do not lose the variance to cancellation as ``E[x^2] - E[x]^2`` would.
Forwards replayed by re-materialization (:func:`gpipe.base.remat.rematerializing`) add nothing.

Example::

    model = DeferredBatchNorm.convert(model)
    for mb in split(inputs, chunks):
        loss_fn(model(mb)).backward()
    commit_all(model)      # one update from all micro-batches' statistics
    optimizer.step()
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from gpipe.base.remat import rematerializing

__all__ = ["DeferredBatchNorm", "commit_all", "reset_all"]

# Input ranks each plain batch norm accepts (its _check_input_dim), kept after conversion.
_INPUT_DIMS: dict[type[nn.Module], tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
    nn.BatchNorm3d: (5,),
}


class DeferredBatchNorm(_BatchNorm):
    """Batch norm whose running statistics are updated once per mini-batch by :meth:`commit`.

    Parameters and buffers have the names of ``nn.BatchNorm{1,2,3}d`` (``weight``, ``bias``,
    ``running_mean``, ``running_var``, ``num_batches_tracked``), so state dicts load either way.

    - Training, ``track_running_stats=True``: normalize with the micro-batch's statistics (the
      output and gradients equal ``nn.BatchNorm``'s on that micro-batch) and accumulate them;
      the running buffers change only in :meth:`commit`.
    - Training, ``track_running_stats=False``: plain per-batch normalization; nothing to commit.
    - Eval: exactly ``nn.BatchNorm``'s eval forward.

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as for
            ``nn.BatchNorm2d``; ``momentum=None`` means a cumulative moving average.
        input_dims: input ranks to accept, e.g. ``(4,)`` for a 2d batch norm; ``None`` accepts
            any input of rank >= 2. :meth:`convert` sets it from the layer it replaces.

    Example::

        >>> bn = DeferredBatchNorm(3, input_dims=(4,))
        >>> for mb in torch.randn(10, 3, 4, 4).split([3, 3, 2, 2]):
        ...     _ = bn(mb)
        >>> bn.commit()  # same running stats as nn.BatchNorm2d(3) on all 10 samples
        >>> int(bn.num_batches_tracked)
        1
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        input_dims: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.input_dims = input_dims
        self.reset_accumulators()

    def _check_input_dim(self, input: Tensor) -> None:
        if self.input_dims is None:
            if input.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        elif input.dim() not in self.input_dims:
            expected = " or ".join(f"{d}D" for d in self.input_dims)
            raise ValueError(f"expected {expected} input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)  # eval, or no running stats: nothing to defer
        self._check_input_dim(input)
        # Running buffers are not passed, so F.batch_norm leaves them alone.
        output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if not rematerializing():  # its accumulators are not buffers: never twice
            self._accumulate(input.detach())
        return output

    def _accumulate(self, input: Tensor) -> None:
        """Merge one micro-batch's per-channel statistics into the accumulators (Chan et al.)."""
        reduce_dims = [d for d in range(input.dim()) if d != 1]
        count = input.numel() // input.shape[1]
        if count == 0:
            return
        # Two-pass statistics of this micro-batch in float64: robust to a large mean.
        var, mean = torch.var_mean(input.to(torch.float64), dim=reduce_dims, correction=0)
        m2 = var * count
        if self._count == 0:
            self._count, self._mean, self._m2 = count, mean, m2
            return
        total = self._count + count
        delta = mean - self._mean
        self._mean = self._mean + delta * (count / total)
        self._m2 = self._m2 + m2 + delta.square() * (self._count * count / total)
        self._count = total

    @torch.no_grad()
    def commit(self) -> None:
        """Update the running statistics from everything accumulated since the last commit.

        The update equals one ``nn.BatchNorm`` training forward on the concatenation of the
        accumulated micro-batches: ``num_batches_tracked += 1``, then an exponential
        (``momentum``) or cumulative (``momentum=None``) average of the mean and of the unbiased
        variance ``M2 / (n - 1)``. Then the accumulators are reset. A no-op if nothing was
        accumulated.
        """
        if self._count == 0 or self._mean is None or self._m2 is None:
            return
        if (
            self.running_mean is None
            or self.running_var is None
            or self.num_batches_tracked is None
        ):
            self.reset_accumulators()  # track_running_stats was switched off meanwhile
            return
        count, mean, m2 = self._count, self._mean, self._m2
        self.reset_accumulators()
        # count >= 2: F.batch_norm rejects a micro-batch with one value per channel.
        var = m2 / (count - 1)

        self.num_batches_tracked.add_(1)
        # momentum=None: cumulative moving average over all committed mini-batches.
        momentum = self.momentum
        factor = 1.0 / float(self.num_batches_tracked) if momentum is None else momentum
        for running, new in ((self.running_mean, mean), (self.running_var, var)):
            updated = running.to(torch.float64) * (1.0 - factor) + new.to(running.device) * factor
            running.copy_(updated)

    def reset_accumulators(self) -> None:
        """Drop statistics accumulated since the last commit (e.g. after a failed step)."""
        self._count: int = 0
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` by a :class:`DeferredBatchNorm`.

        The replacement *shares* the original's ``Parameter`` and buffer tensors (no copy), so
        an optimizer built before conversion keeps working and the state dict is unchanged, key
        for key and value for value. It keeps the original's input-rank check and training
        mode. Children are replaced in place; if ``module`` itself is a batch norm, its
        replacement is returned, so always use the return value.

        Only exactly these three classes are converted: ``SyncBatchNorm`` (which syncs
        statistics across processes) and user subclasses (which may override ``forward``) are
        left as they are.

        Example::

            >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
            >>> model = DeferredBatchNorm.convert(model)
            >>> type(model[1]).__name__
            'DeferredBatchNorm'

        Raises:
            ValueError: if ``module`` holds a lazy batch norm that has not been initialized.
        """
        lazy = isinstance(module, _BatchNorm) and isinstance(module, LazyModuleMixin)
        if lazy and module.has_uninitialized_params():  # type: ignore[union-attr]
            raise ValueError(
                f"cannot convert {type(module).__name__} before its parameters exist; run "
                f"one forward pass (e.g. on a sample batch) before DeferredBatchNorm.convert"
            )
        if type(module) in _INPUT_DIMS:
            return cls._from_batchnorm(module)  # type: ignore[arg-type]
        for name, child in module.named_children():
            converted = cls.convert(child)
            if converted is not child:
                setattr(module, name, converted)
        return module

    @classmethod
    def _from_batchnorm(cls, bn: _BatchNorm) -> DeferredBatchNorm:
        # Built on the meta device (allocates nothing), then given bn's own tensors.
        new = cls(
            bn.num_features,
            eps=bn.eps,
            momentum=bn.momentum,
            affine=bn.affine,
            track_running_stats=bn.track_running_stats,
            device="meta",
            input_dims=_INPUT_DIMS[type(bn)],
        )
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(new, name, getattr(bn, name))
        new.train(bn.training)
        return new


def commit_all(module: nn.Module) -> None:
    """:meth:`DeferredBatchNorm.commit` every deferred batch norm in ``module`` (itself included).

    Call once per mini-batch, after the last micro-batch's forward.

    Example::

        >>> commit_all(model)
    """
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit()


def reset_all(module: nn.Module) -> None:
    """Drop the partial statistics of every deferred batch norm in ``module`` (itself included).

    Example::

        >>> try:
        ...     pipe.step(inputs, targets, loss_fn)
        ... except RuntimeError:
        ...     reset_all(model)
        ...     raise
    """
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.reset_accumulators()
