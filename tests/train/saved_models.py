"""Tiny Hugging Face models and tokenizers saved the way a user's are (``save_pretrained``),
made here from nothing: no download. For the tests of ``gpipe train --model DIR``."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from torch.nn import functional as F

transformers = __import__("pytest").importorskip("transformers")

# Real text nobody here wrote, on every Python install: the json package's own source.
TEXT = Path(json.__file__).read_text()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]  # ids 0..4
PAD, BOS, EOS = 0, 1, 2


def tokenizer(folder: Path, *, vocab: int = 320) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer learnt from :data:`TEXT`, saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    learn = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator([TEXT], learn)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", mask_token="<mask>",
    )  # fmt: skip
    fast.save_pretrained(folder)
    return fast


def save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def llama(**overrides) -> transformers.LlamaConfig:
    shape = dict(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaConfig(**{**shape, **overrides})


def mixtral() -> transformers.MixtralConfig:
    return transformers.MixtralConfig(
        vocab_size=320, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=PAD,
        bos_token_id=BOS, eos_token_id=EOS,
    )  # fmt: skip


def bart() -> transformers.BartConfig:
    return transformers.BartConfig(
        vocab_size=320, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        decoder_start_token_id=EOS, forced_eos_token_id=None,
    )  # fmt: skip


def bert() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=PAD,
    )  # fmt: skip


def model_folder(folder: Path, config, *, seed: int = 0, family: str = "AutoModelForCausalLM"):
    """``config``'s model, seeded, saved with :func:`tokenizer`'s into ``folder``."""
    tokenizer(folder)
    torch.manual_seed(seed)
    model = getattr(transformers, family).from_config(config)
    return save(model, folder)


def pairs_file(path: Path, count: int = 24) -> Path:
    """A JSONL of (source, target) records: a line of :data:`TEXT` and the line after it."""
    lines = [line for line in TEXT.splitlines() if line.strip()][: count + 1]
    records = [{"source": a, "target": b} for a, b in itertools.pairwise(lines)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def plain_loss(model: torch.nn.Module, config) -> tuple[float, int]:
    """The reference: the summed token cross-entropy of every window over their targets."""
    task = config.task
    data = task.data(batch=config.batch, eval_batches=1, prepared=None, chunks=config.chunks)
    x, y = task.batch(data.val, torch.arange(len(data.val)), seed=0)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits
    summed = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100,
                             reduction="sum")  # fmt: skip
    return float(summed / (y != -100).sum()), int((y != -100).sum())
