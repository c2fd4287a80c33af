"""gpipe.train.objectives: each family's inputs and targets from its samples, and a loss that
is the mean over the real targets (whole runs against the plain model: train/test_hf.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.nn import functional as F

from gpipe.train.objectives import IGNORE, CausalLM, Classify, MaskedLM, Seq2Seq

GENERATOR = torch.Generator()


def test_a_causal_lm_predicts_the_next_real_token_and_averages_over_them():
    tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    real = tokens != 0
    inputs, targets = CausalLM().batch((tokens, real), generator=GENERATOR, tokenizer=None)
    assert inputs.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert targets.tolist() == [[6, 7, IGNORE], [9, IGNORE, IGNORE]]
    logits = torch.randn(2, 3, 10, dtype=torch.float64)
    kept = targets != IGNORE
    expected = F.cross_entropy(logits[kept], targets[kept])  # the mean over the 3 real ones
    assert torch.allclose(CausalLM().loss(logits, targets), expected, rtol=1e-12, atol=0)
    assert CausalLM().count(targets) == 3
    nothing = torch.full((1, 3), IGNORE)  # a micro-batch of padding adds 0, not nan
    assert CausalLM().loss(logits[:1], nothing) == 0


def test_a_masked_lm_masks_only_real_ordinary_tokens_as_bert_does_and_alike_per_seed():
    tokenizer = SimpleNamespace(special={0, 1}, vocab_size=50, mask=1)
    tokens = torch.randint(2, 50, (64, 64), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 0  # a special token
    real = torch.ones_like(tokens, dtype=torch.bool)
    real[:, -8:] = False  # padding
    objective = MaskedLM(mask_prob=0.5)

    def batch(seed):
        generator = torch.Generator().manual_seed(seed)
        return objective.batch((tokens, real), generator=generator, tokenizer=tokenizer)

    (inputs, targets), (again, _) = batch(3), batch(3)
    assert torch.equal(inputs["input_ids"], again["input_ids"])  # the same masks every rank
    assert torch.equal(inputs["attention_mask"], real.long())
    chosen = targets != IGNORE
    assert not chosen[:, 0].any() and not chosen[:, -8:].any()
    assert torch.equal(targets[chosen], tokens[chosen])
    assert 0.45 < chosen.float().mean() * 64 / 55 < 0.55  # of the real, ordinary tokens
    masked = (inputs["input_ids"] == tokenizer.mask) & chosen
    kept = (inputs["input_ids"] == tokens) & chosen
    assert 0.75 < masked.sum() / chosen.sum() < 0.85  # 80 % the mask token
    assert 0.05 < (chosen & ~masked & ~kept).sum() / chosen.sum() < 0.15  # 10 % another one
    assert torch.equal(inputs["input_ids"][~chosen], tokens[~chosen])


def test_a_seq2seq_decoder_reads_the_target_shifted_right_after_its_start_token():
    source, target = torch.tensor([[3, 4, 0]]), torch.tensor([[7, 8, 0]])
    raw = (source, source != 0, target, target != 0)
    inputs, targets = Seq2Seq(decoder_start=2).batch(raw, generator=GENERATOR, tokenizer=None)
    assert inputs["decoder_input_ids"].tolist() == [[2, 7, 8]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 0]]
    assert targets.tolist() == [[7, 8, IGNORE]]


def test_a_classifier_averages_over_samples_and_counts_the_correct_ones():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    labels = torch.tensor([0, 1, 1])
    assert Classify().loss(logits, labels) == F.cross_entropy(logits, labels)
    assert Classify().count(labels) == 3 and Classify().correct(logits, labels) == 2
