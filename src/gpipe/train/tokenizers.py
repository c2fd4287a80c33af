"""From text to tokens and back: a model folder's own tokenizer (``transformers``'
``AutoTokenizer``), or bytes (256 tokens, one per byte value) where there is none.

Documents arrive as bytes (``gpipe.train.data``); a tokenizer gives each its token ids with the
tokenizer's own special tokens (as ``tokenizer(text)`` does), and says what separates
documents when they are packed into one stream (its end-of-text token; a newline for bytes).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from gpipe.train.data import readable

__all__ = [
    "BYTES", "ByteTokenizer", "HFTokenizer", "Tokenizer", "describe", "has_tokenizer", "load",
]  # fmt: skip

BYTES = "bytes"
# Files that save_pretrained writes for a tokenizer: one of them marks a folder as having one.
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model",
)  # fmt: skip


class Tokenizer:
    """What the main job asks of a tokenizer."""

    name: str  # "bytes", or the folder it was loaded from
    vocab_size: int  # ids are < vocab_size
    pad: int  # the id that fills padded positions (never a target)
    separator: list[int]  # between documents packed into one stream
    mask: int | None = None  # the masked-LM mask token
    eos: int | None = None  # end of text: generation stops there
    special: frozenset[int] = frozenset()  # never masked

    def encode(self, text: bytes) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def tokens(self, text: bytes) -> torch.Tensor:
        """:meth:`encode` as a 1-D tensor of the smallest dtype that holds every id."""
        return torch.tensor(self.encode(text), dtype=self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.vocab_size <= 256 else torch.int32

    def fingerprint(self) -> str:
        """What the tokens depend on (a cache of them is keyed by it)."""
        return self.name


class ByteTokenizer(Tokenizer):
    """One token per byte: any text, no vocabulary file, 256 ids."""

    name, vocab_size, pad, separator = BYTES, 256, 0, [10]  # documents joined by a newline

    def encode(self, text: bytes) -> list[int]:
        return list(text)

    def tokens(self, text: bytes) -> torch.Tensor:
        return (
            torch.frombuffer(bytearray(text), dtype=torch.uint8)
            if text
            else torch.empty(0, dtype=torch.uint8)
        )

    def decode(self, ids: list[int]) -> str:
        return readable(bytes(ids))


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer saved in ``folder`` (``AutoTokenizer.from_pretrained``)."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        self.name = str(folder)
        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.pad = next(i for i in (tokenizer.pad_token_id, eos, 0) if i is not None)
        self.mask, self.eos = tokenizer.mask_token_id, eos
        self.special = frozenset(tokenizer.all_special_ids)
        # Packed documents are separated by end-of-text, unless the tokenizer ends each
        # document with it already (T5's does).
        ends_with_eos = eos is not None and self.encode(b"a")[-1:] == [eos]
        self.separator = [] if eos is None or ends_with_eos else [eos]

    def encode(self, text: bytes) -> list[int]:
        return list(self.tokenizer(text.decode("utf-8", "replace"))["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for name in [*sorted(_TOKENIZER_FILES), "special_tokens_map.json", "merges.txt"]:
            path = self.folder / name
            if path.exists():
                digest.update(name.encode() + path.read_bytes())
        return f"{self.name}:{digest.hexdigest()[:16]}"


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a tokenizer that ``save_pretrained`` wrote."""
    return Path(folder).is_dir() and any((Path(folder) / f).exists() for f in _TOKENIZER_FILES)


def load(spec: str) -> Tokenizer:
    """``"bytes"``, or a folder holding a Hugging Face tokenizer."""
    if spec == BYTES:
        return ByteTokenizer()
    return HFTokenizer(spec)


def describe(tokenizer: Any) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return "bytes, 256 tokens"
    return f"the tokenizer of {tokenizer.name}, {tokenizer.vocab_size:,} tokens"
