"""Token means over padded batches, with the count ``Pipe.step`` needs built in.

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
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

__all__ = ["IGNORE_INDEX", "TokenCrossEntropy", "causal_lm", "masked_lm"]

IGNORE_INDEX = -100  # PyTorch's and Hugging Face's label for "does not count"


class TokenCrossEntropy:
    """Cross-entropy averaged over the labels that are not ``ignore_index``.

    Args:
        shift: predict the label of the next position (a causal language model given
            Hugging Face-style ``labels``, equal to its inputs but for padding): the logits
            at position t are scored against ``labels[:, t + 1]``, as ``labels=`` does in a
            Hugging Face ``...ForCausalLM``. ``False``: each position against its own label.
        ignore_index: the label of positions that do not count.
        label_smoothing: as in ``F.cross_entropy``.

    ``loss(output, labels)`` is the mean over one micro-batch's counted tokens;
    ``loss.count(labels)`` is how many there are, which ``Pipe.step`` uses to weigh it.
    """

    def __init__(
        self, *, shift: bool, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0
    ) -> None:
        self.shift, self.ignore_index, self.label_smoothing = shift, ignore_index, label_smoothing

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
        return self._cross_entropy(output, labels, "mean")

    def summed(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        """The sum over the counted tokens (``Pipe.step`` divides it by the mini-batch's
        count: 0, not 0/0, where a micro-batch counts no token)."""
        return self._cross_entropy(output, labels, "sum")

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
        return f"TokenCrossEntropy(shift={self.shift}, ignore_index={self.ignore_index})"


def causal_lm(*, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0):
    """Next-token cross-entropy over Hugging Face-style ``labels`` (shifted inside), a
    mean over the tokens whose next label is not ``ignore_index``::

        pipe.step(input_ids, labels, gpipe.losses.causal_lm())  # labels: input_ids, -100 pads
    """
    return TokenCrossEntropy(shift=True, ignore_index=ignore_index, label_smoothing=label_smoothing)


def masked_lm(*, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0):
    """Cross-entropy of each position against its own label (masked language modelling, or
    targets already shifted), a mean over the labels that are not ``ignore_index``."""
    return TokenCrossEntropy(
        shift=False, ignore_index=ignore_index, label_smoothing=label_smoothing
    )
