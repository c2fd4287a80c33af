"""Token means over padded batches, and what a loss's reduction tells ``Pipe.step``.

A language model's loss is a mean over the tokens that count: the labels that are not
``ignore_index`` (-100, padding or a prompt). Each micro-batch holds a different number of
them, so its mean must weigh by its share of the mini-batch's tokens, not of its samples:
``Pipe.step(..., count=...)`` says how many tokens a micro-batch's targets hold. The losses
here carry that count themselves::

    pipe.step(input_ids, labels, gpipe.losses.causal_lm())   # Hugging Face-style labels
    pipe.step(input_ids, labels, gpipe.losses.masked_lm())   # BERT-style, or pre-shifted

Each takes the model's output as it is: logits ``(B, T, V)``, or an output with ``.logits``
(a Hugging Face ``ModelOutput``). Half-precision logits are averaged in float32, as Hugging
Face's own losses do. The same losses on the un-split model give its gradients exactly.
An output that carries ``aux_loss`` (a mixture of experts' load-balancing loss, with
``output_router_logits=True``) adds it times ``aux_loss_coef``, as the model's own ``loss``
does (:func:`auxiliary_loss`).

A loss gpipe cannot see into must say how it reduces (``reduction=``, ``count=``);
:func:`declared` reads both off the losses that show them (these, ``nn.CrossEntropyLoss``,
``nn.NLLLoss``, any ``nn`` loss's ``reduction``, ``functools.partial(F.cross_entropy, ...)``),
and :func:`uncounted` finds labels below 0 (an ignore index) in targets of a loss that says
nothing, which ``Pipe.step`` then warns about (:data:`UNCOUNTED`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gpipe.base._utils import tensors_of

__all__ = [
    "IGNORE_INDEX",
    "TokenCrossEntropy",
    "auxiliary_loss",
    "causal_lm",
    "declared",
    "masked_lm",
    "uncounted",
    "warn_per_microbatch",
]

IGNORE_INDEX = -100  # PyTorch's and Hugging Face's label for "does not count"

UNCOUNTED = (
    "the targets hold labels below 0 (an ignore_index such as -100: labels that do not count) "
    "but step() was given no count=: each micro-batch's mean is then weighed by its samples, "
    "not by its tokens, and the gradients are not the un-split model's. Pass "
    "count=lambda y: (y != -100).sum() (your ignore_index for -100; for a loss that shifts "
    "its labels inside, as Hugging Face's: (y[:, 1:] != -100).sum()), or the loss as "
    "nn.CrossEntropyLoss(ignore_index=...), whose count gpipe reads, or use gpipe.losses' "
    "causal_lm() or masked_lm(), which count for themselves"
)
NOTHING_COUNTS = (
    "micro-batch {microbatch}'s targets are all below 0 (labels that do not count), so its "
    "mean loss is 0/0: a token mean needs step(..., count=...) to weigh each micro-batch by "
    "its tokens, e.g. count=lambda y: (y != -100).sum() (for Hugging Face-style labels, "
    "shifted inside the loss: (y[:, 1:] != -100).sum()); or use a loss of gpipe.losses "
    "(causal_lm(), masked_lm()) or nn.CrossEntropyLoss, which gpipe counts for"
)
NO_TOKEN = (
    "no target of the mini-batch counts (every label is the loss's ignore_index), so its "
    "token mean is 0/0; give batches with at least one label that counts"
)
_NO_COEFFICIENT = (
    "the model's output carries aux_loss (a mixture of experts' load-balancing loss), which "
    "its own loss adds times config.router_aux_loss_coef, but this loss was given no "
    "coefficient: pass gpipe.losses.causal_lm(aux_loss_coef=model.config.router_aux_loss_coef)"
    " (or masked_lm(...); 0 trains without it)"
)


def auxiliary_loss(output: Any, coefficient: float | None) -> torch.Tensor | float:
    """``coefficient * output.aux_loss``, as a Hugging Face model's ``loss`` adds it (0 for
    an output without one); an output with one and no coefficient is refused, so that the
    load-balancing loss is never dropped in silence.

    The load-balancing loss is E times the sum over experts of (the fraction of tokens routed
    to each) times (its mean router probability), both means over every token of the batch:
    a product of means, which micro-batches cannot add up to. Each micro-batch's own is
    weighed by its share of the counted tokens, as gradient accumulation computes it: the
    model's own loss with ``chunks=1``, not the mini-batch's value otherwise.
    """
    aux = getattr(output, "aux_loss", None) if not isinstance(output, torch.Tensor) else None
    if aux is None:
        return 0.0
    if coefficient is None:
        raise ValueError(_NO_COEFFICIENT)
    return coefficient * aux


def warn_per_microbatch(coefficient: float | None, chunks: int) -> bool:
    """Warn (and say so) where an auxiliary loss weighs in and ``chunks`` > 1: its value is
    then each micro-batch's, not the mini-batch's (:func:`auxiliary_loss`)."""
    if not coefficient or chunks <= 1:
        return False
    warnings.warn(
        f"with chunks={chunks} the auxiliary loss (aux_loss_coef={coefficient}) is each "
        "micro-batch's own, weighed by its tokens, as gradient accumulation computes it, not "
        "the mini-batch's: a load-balancing loss is a product of means over all tokens, which "
        "micro-batches cannot add up to (exact with chunks=1; see gpipe.losses.auxiliary_loss)",
        stacklevel=4,
    )
    return True


class TokenCrossEntropy:
    """Cross-entropy averaged over the labels that are not ``ignore_index``.

    Args:
        shift: predict the label of the next position (a causal language model given
            Hugging Face-style ``labels``, equal to its inputs but for padding): the logits
            at position t are scored against ``labels[:, t + 1]``, as ``labels=`` does in a
            Hugging Face ``...ForCausalLM``. ``False``: each position against its own label.
        ignore_index: the label of positions that do not count.
        label_smoothing: as in ``F.cross_entropy``.
        aux_loss_coef: the weight of the ``aux_loss`` a model's output carries (a mixture of
            experts': ``model.config.router_aux_loss_coef``); see :func:`auxiliary_loss`.

    ``loss(output, labels)`` is the mean over one micro-batch's counted tokens (plus the
    auxiliary loss); ``loss.count(labels)`` is how many there are, which ``Pipe.step`` uses
    to weigh it.
    """

    def __init__(
        self,
        *,
        shift: bool,
        ignore_index: int = IGNORE_INDEX,
        label_smoothing: float = 0.0,
        aux_loss_coef: float | None = None,
    ) -> None:
        self.shift, self.ignore_index, self.label_smoothing = shift, ignore_index, label_smoothing
        self.aux_loss_coef = aux_loss_coef
        self._warned_chunks = False

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """The label each position is scored against (shifted: the next one's; the last
        position has none)."""
        if not self.shift:
            return labels
        return F.pad(labels[..., 1:], (0, 1), value=self.ignore_index)

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """How many tokens of ``labels`` count."""
        return (self.targets(labels) != self.ignore_index).sum()

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        mean = self._cross_entropy(output, labels, "mean")
        aux = auxiliary_loss(output, self.aux_loss_coef)
        return mean if isinstance(aux, float) else mean + aux

    def summed(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """The sum over the counted tokens (``Pipe.step`` divides it by the mini-batch's
        count: 0, not 0/0, where a micro-batch counts no token), and the auxiliary loss
        times this micro-batch's count (its share of it, once divided)."""
        total = self._cross_entropy(output, labels, "sum")
        aux = auxiliary_loss(output, self.aux_loss_coef)
        return total if isinstance(aux, float) else total + aux.to(total.dtype) * self.count(labels)

    def _cross_entropy(self, output: Any, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        logits = getattr(output, "logits", output)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            self.targets(labels).reshape(-1),
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=reduction,
        )

    def __repr__(self) -> str:
        aux = "" if self.aux_loss_coef is None else f", aux_loss_coef={self.aux_loss_coef}"
        return f"TokenCrossEntropy(shift={self.shift}, ignore_index={self.ignore_index}{aux})"


def causal_lm(
    *,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    aux_loss_coef: float | None = None,
) -> TokenCrossEntropy:
    """Next-token cross-entropy over Hugging Face-style ``labels`` (shifted inside), a
    mean over the tokens whose next label is not ``ignore_index``; plus ``aux_loss_coef``
    times the output's ``aux_loss`` where it has one (a mixture of experts)::

        pipe.step(input_ids, labels, gpipe.losses.causal_lm())  # labels: input_ids, -100 pads
        moe = gpipe.losses.causal_lm(aux_loss_coef=model.config.router_aux_loss_coef)
    """
    return TokenCrossEntropy(
        shift=True, ignore_index=ignore_index, label_smoothing=label_smoothing,
        aux_loss_coef=aux_loss_coef,
    )  # fmt: skip


def masked_lm(
    *,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    aux_loss_coef: float | None = None,
) -> TokenCrossEntropy:
    """Cross-entropy of each position against its own label (masked language modelling, or
    targets already shifted), a mean over the labels that are not ``ignore_index``; the
    auxiliary loss as in :func:`causal_lm`."""
    return TokenCrossEntropy(
        shift=False, ignore_index=ignore_index, label_smoothing=label_smoothing,
        aux_loss_coef=aux_loss_coef,
    )  # fmt: skip


# -- what a loss says of its reduction -------------------------------------------------------


def declared(
    loss_fn: Callable, reduction: str | None, count: Callable | None, *, chunks: int
) -> tuple[str, Callable | None]:
    """``Pipe.step``'s ``reduction`` and ``count`` for ``loss_fn``: those given, completed by
    what the loss shows of itself; a contradiction is refused.

    A loss of this module counts its tokens. ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` (or
    ``functools.partial(F.cross_entropy, ...)``) with ``reduction="mean"`` average over the
    targets that are not ``ignore_index``, each weighed by its class's ``weight``: their
    count is that (exact, any ignore_index, class weights included). Any ``nn`` loss tells
    its ``reduction``. Anything else is taken as the caller says (default ``"mean"``: a mean
    over samples).
    """
    if isinstance(loss_fn, TokenCrossEntropy):
        if (count is not None and count != loss_fn.count) or reduction not in (None, "mean"):
            raise ValueError(
                f"{loss_fn!r} is a token mean that counts its own tokens (shifted or not): "
                "drop step()'s count= and reduction="
            )
        if not loss_fn._warned_chunks:
            loss_fn._warned_chunks = warn_per_microbatch(loss_fn.aux_loss_coef, chunks)
        return "mean", loss_fn.count
    own = _settings(loss_fn)
    if own is None:
        return reduction or "mean", count
    theirs, weight, ignore_index = own
    theirs = "mean" if theirs == "batchmean" else theirs
    if theirs not in ("mean", "sum") or reduction not in (None, theirs):
        raise ValueError(
            f"loss_fn reduces by {theirs!r} ({_name(loss_fn)}) but step() needs a scalar "
            f"'mean' or 'sum'{f' and was given reduction={reduction!r}' if reduction else ''}: "
            "give the loss reduction='mean' or 'sum' and drop step()'s reduction= (gpipe "
            "reads it off the loss)"
        )
    if theirs == "mean" and count is None and ignore_index is not None:
        count = functools.partial(_class_count, weight=weight, ignore_index=ignore_index)
    return theirs, count


def _settings(loss_fn: Callable) -> tuple[str, torch.Tensor | None, int | None] | None:
    """(reduction, class weights, ignore_index) of a loss that shows them; ignore_index
    None: an ``nn`` loss that averages over its elements (a sample mean)."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return loss_fn.reduction, loss_fn.weight, loss_fn.ignore_index
    if isinstance(loss_fn, nn.modules.loss._Loss):
        return loss_fn.reduction, None, None
    if (
        isinstance(loss_fn, functools.partial)
        and loss_fn.func in (F.cross_entropy, F.nll_loss)
        and not loss_fn.args
    ):
        keywords = loss_fn.keywords
        return (keywords.get("reduction", "mean"), keywords.get("weight"),
                keywords.get("ignore_index", IGNORE_INDEX))  # fmt: skip
    return None


def _class_count(target: torch.Tensor, *, weight: torch.Tensor | None, ignore_index: int) -> Any:
    """What a class-index cross-entropy's mean divides by: the targets that are not
    ``ignore_index``, each counted by its class's weight; class probabilities: a mean over
    the samples (and positions)."""
    if target.is_floating_point():
        return target.numel() // target.shape[1] if target.dim() > 1 else 1
    kept = target[target != ignore_index]
    return kept.numel() if weight is None else weight.to(target.device)[kept].sum()


def _name(loss_fn: Callable) -> str:
    return type(loss_fn).__name__ if isinstance(loss_fn, nn.Module) else repr(loss_fn)


def uncounted(targets_mb: list[Any]) -> torch.Tensor | None:
    """For integer targets: whether any holds a label below 0 (no class has one: an ignore
    index, -100 by default), then for each micro-batch whether all of its targets do (a mean
    over them is 0/0), as a bool tensor on the first target's device (not read here); None
    for targets with no integer label."""
    flags = []
    for y in targets_mb:
        labels = [t for t in tensors_of(y) if not t.is_floating_point() and t.numel()]
        if not labels:
            return None
        ignored = [t < 0 for t in labels]
        device = labels[0].device
        flags.append(torch.stack([m.any().to(device) for m in ignored]).any())
        flags.append(torch.stack([m.all().to(device) for m in ignored]).all())
    flags = torch.stack([f.to(flags[0].device) for f in flags]).view(-1, 2)
    return torch.cat([flags[:, 0].any().reshape(1), flags[:, 1]])
