"""What a model learns from its samples: one :class:`Objective` per family of models.

An objective turns the samples a data set gives (token windows with their mask of real
tokens, image and label pairs) into a batch of model inputs and targets, and measures the
loss. Every language-model loss is a token mean, exact over a padded mini-batch: each
micro-batch's loss is its sum over the real target tokens divided by their count, and
``Pipe.step(count=...)`` weights it by that count (a micro-batch without a target adds 0).

* causal LM: the next token of every real token (windows of ``seq + 1``);
* masked LM: ``mask_prob`` of the real, non-special tokens chosen by a generator seeded per
  step (the same on every rank, whatever the layout; 80 % become the mask token, 10 % a
  random token, 10 % stay), as BERT's pre-training does; predicted at their positions;
* sequence to sequence: the target from the source, the decoder fed the target shifted right
  after its start token (as the model's ``labels=`` argument does);
* classification: a class per sample (a mean over samples).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.nn import functional as F

from gpipe.train.data import Documents, PackedWindows, PaddedWindows, PairedSamples

__all__ = ["OBJECTIVES", "CausalLM", "Classify", "MaskedLM", "Objective", "Seq2Seq"]

IGNORE = -100  # a target position without a target (padding, an unmasked token)
PACKINGS = ("pack", "pad")


class Objective:
    family: ClassVar[str]
    unit: ClassVar[str] = "tokens"  # what throughput counts
    writes_text: ClassVar[bool] = False  # generates text at the end of a run
    classifies: ClassVar[bool] = False  # validation reports accuracy
    pairs: ClassVar[bool] = False  # its documents are (source, target) pairs
    packs: ClassVar[bool] = True  # --packing pack applies

    def samples(self, documents: Any, *, seq: int, packing: str, tokenizer: Any) -> Any:
        """The indexable set of samples of ``documents`` (a :class:`Documents`, or a pair)."""
        raise NotImplementedError

    def example(self, seq: int) -> Any:
        """Model inputs of two samples, for capturing the model (only shapes matter)."""
        raise NotImplementedError

    def batch(self, raw: Any, *, generator: torch.Generator, tokenizer: Any) -> tuple[Any, Any]:
        """(inputs, targets) of the samples ``raw``; ``generator``: this batch's randomness."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A micro-batch's mean loss over its targets (:meth:`count` of them)."""
        # Summed, then divided by the count: a micro-batch without targets gives 0, not nan.
        total = F.cross_entropy(
            _wide(logits).flatten(0, -2), target.flatten(), ignore_index=IGNORE, reduction="sum"
        )
        return total / self.count(target).clamp(min=1)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != IGNORE).sum()

    def correct(self, logits: torch.Tensor, target: torch.Tensor) -> int:
        return 0


class CausalLM(Objective):
    family, writes_text = "causal-lm", True

    def samples(self, documents: Documents, *, seq: int, packing: str, tokenizer: Any) -> Any:
        if packing == "pack":
            stream = documents.joined(tokenizer.separator)
            return PackedWindows(stream, length=seq + 1, stride=seq)
        return PaddedWindows(documents, length=seq + 1, stride=seq, pad=tokenizer.pad)

    def example(self, seq: int) -> Any:
        return (torch.zeros(2, seq, dtype=torch.int64),)

    def batch(self, raw: Any, *, generator: torch.Generator, tokenizer: Any) -> tuple[Any, Any]:
        tokens, real = raw  # (B, seq + 1)
        return tokens[:, :-1], torch.where(real[:, 1:], tokens[:, 1:], IGNORE)


class MaskedLM(Objective):
    family = "masked-lm"

    def __init__(self, mask_prob: float = 0.15) -> None:
        self.mask_prob = mask_prob

    def samples(self, documents: Documents, *, seq: int, packing: str, tokenizer: Any) -> Any:
        if packing == "pack":
            return PackedWindows(documents.joined(tokenizer.separator), length=seq, stride=seq)
        return PaddedWindows(documents, length=seq, stride=seq, pad=tokenizer.pad)

    def example(self, seq: int) -> Any:
        ids = torch.zeros(2, seq, dtype=torch.int64)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def batch(self, raw: Any, *, generator: torch.Generator, tokenizer: Any) -> tuple[Any, Any]:
        tokens, real = raw  # (B, seq)
        special = torch.isin(tokens, torch.tensor(sorted(tokenizer.special), dtype=tokens.dtype))
        chosen = (torch.rand(tokens.shape, generator=generator) < self.mask_prob) & real & ~special
        draw = torch.rand(tokens.shape, generator=generator)
        random = torch.randint(tokenizer.vocab_size, tokens.shape, generator=generator)
        inputs = torch.where(chosen & (draw < 0.8), tokenizer.mask, tokens)
        inputs = torch.where(chosen & (draw >= 0.8) & (draw < 0.9), random, inputs)
        targets = torch.where(chosen, tokens, IGNORE)
        return {"input_ids": inputs, "attention_mask": real.long()}, targets


class Seq2Seq(Objective):
    family, pairs, packs = "seq2seq", True, False

    def __init__(self, decoder_start: int = 0) -> None:
        self.decoder_start = decoder_start

    def samples(self, documents: Any, *, seq: int, packing: str, tokenizer: Any) -> Any:
        sources, targets = documents
        return PairedSamples(sources, targets, length=seq, target_length=seq, pad=tokenizer.pad)

    def example(self, seq: int) -> Any:
        ids = torch.zeros(2, seq, dtype=torch.int64)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "decoder_input_ids": torch.zeros_like(ids)}  # fmt: skip

    def batch(self, raw: Any, *, generator: torch.Generator, tokenizer: Any) -> tuple[Any, Any]:
        source, source_real, target, target_real = raw
        start = torch.full_like(target[:, :1], self.decoder_start)
        decoder = torch.cat([start, target[:, :-1]], dim=1)  # the target shifted right
        inputs = {"input_ids": source, "attention_mask": source_real.long(),
                  "decoder_input_ids": decoder}  # fmt: skip
        return inputs, torch.where(target_real, target, IGNORE)


class Classify(Objective):
    family, unit, classifies, packs = "classify", "images", True, False

    def batch(self, raw: Any, *, generator: torch.Generator, tokenizer: Any) -> tuple[Any, Any]:
        return raw

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(_wide(logits), target)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(len(target))

    def correct(self, logits: torch.Tensor, target: torch.Tensor) -> int:
        return int((logits.argmax(-1) == target).sum())


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least (bfloat16 under autocast; float64 stays)."""
    return logits if logits.dtype == torch.float64 else logits.float()


OBJECTIVES: dict[str, type[Objective]] = {
    o.family: o for o in (CausalLM, MaskedLM, Seq2Seq, Classify)
}
