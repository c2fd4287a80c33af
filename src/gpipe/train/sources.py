"""What the main job reads: text (the user's files, or the standard library's own source)
tokenized once and cached, or images (scikit-learn's digits).

Text is tokenized once, before the ranks start (:meth:`TextData.prepare`), into a cache file
keyed by everything the tokens depend on (the files' names, sizes and times, the fields, the
validation split, the tokenizer's files); the ranks then only read it. The validation set is
a separate source (``--val-data``), the source's own split (the stdlib's by file name, a saved
DatasetDict's ``validation``), or a fixed share of the documents (``--val-fraction``).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpipe.base.files import write_file
from gpipe.train.data import Documents, cache_dir, digits, is_validation, stdlib_files
from gpipe.train.texts import Texts, hold_out, read_texts
from gpipe.train.tokenizers import Tokenizer, describe, load

__all__ = ["DigitsData", "Files", "Stdlib", "TextData", "TextSource", "TokenSplit"]

_FORMAT = 1  # bump when the cached tokens change meaning


class TextSource:
    """Documents to learn from."""

    def texts(self) -> Texts:
        raise NotImplementedError

    def key(self) -> str:
        """What the documents depend on, without reading them."""
        raise NotImplementedError


class Stdlib(TextSource):
    """The Python standard library's top-level ``.py`` files, split by file name."""

    def texts(self) -> Texts:
        files = stdlib_files()
        train = [f.read_bytes() for f in files if not is_validation(f)]
        val = [f.read_bytes() for f in files if is_validation(f)]
        size = sum(map(len, train)) + sum(map(len, val))
        description = (
            f"{len(train)} train and {len(val)} validation files, {size:,} bytes of "
            f"{files[0].parent}"
        )
        return Texts(train, val, description, tuple(files))

    def key(self) -> str:
        files = stdlib_files()
        return f"stdlib|{sys.version}|" + "|".join(f"{f}:{f.stat().st_size}" for f in files)


@dataclass(frozen=True)
class Files(TextSource):
    """What the user named (``gpipe.train.texts.read_texts``)."""

    path: str
    field: str = "text"
    target: str | None = None

    def texts(self) -> Texts:
        return read_texts(self.path, field=self.field, target=self.target)

    def key(self) -> str:
        root = Path(self.path)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        stamps = "|".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
        return f"files|{self.field}|{self.target}|{stamps}"


@dataclass
class TokenSplit:
    """Tokenized documents: each side a :class:`Documents`, or (sources, targets) of pairs."""

    train: Any
    val: Any
    description: str


@dataclass
class TextData:
    """Text for a language model: ``train``, validation from ``val`` or a ``fraction`` of the
    documents (where the source has no split of its own), tokenized by ``tokenizer`` (a
    folder, or ``"bytes"``)."""

    train: TextSource
    val: TextSource | None
    fraction: float
    tokenizer_spec: str
    pairs: bool = False

    def __post_init__(self) -> None:
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load(self.tokenizer_spec)
        return self._tokenizer

    def cache_file(self) -> Path:
        held = self.val.key() if self.val is not None else f"fraction {self.fraction}"
        key = hashlib.sha256(
            f"{_FORMAT}|{self.train.key()}|{held}|{self.pairs}|".encode()
            + self.tokenizer.fingerprint().encode()
        )
        return cache_dir() / f"tokens-{key.hexdigest()[:20]}.pt"

    def prepare(self) -> None:
        """Tokenize and cache (once, before the ranks start)."""
        self.load()

    def load(self) -> TokenSplit:
        cached = self.cache_file()
        if cached.exists():
            try:
                saved = torch.load(cached, weights_only=True)
                return TokenSplit(_documents(saved["train"]), _documents(saved["val"]),
                                  saved["description"])  # fmt: skip
            except Exception:  # a damaged cache file is rebuilt, not fatal
                pass
        split = self._tokenize()
        cached.parent.mkdir(parents=True, exist_ok=True)
        tokens = {"train": _tensors(split.train), "val": _tensors(split.val),
                  "description": split.description}  # fmt: skip
        write_file(cached, lambda file: torch.save(tokens, file))
        return split

    def _tokenize(self) -> TokenSplit:
        texts = self.train.texts()
        if self.val is not None:
            held_texts = self.val.texts()
            train, val = texts.train, held_texts.train
            held = f"; validation: {held_texts.description}"
        elif texts.val is not None:
            train, val, held = texts.train, texts.val, ""
        else:
            train, val = hold_out(texts.train, self.fraction)
            held = (
                f"; {len(val)} of them held out for validation" if len(texts.train) > 1
                else f"; its last {self.fraction:.0%} held out for validation"
            )  # fmt: skip
        if not val:
            raise ValueError("the validation set is empty: name one with --val-data")
        encode, dtype = self.tokenizer.tokens, self.tokenizer.dtype
        if self.pairs:
            sides = [
                tuple(Documents.of([encode(r[i]) for r in part], dtype=dtype) for i in (0, 1))
                for part in (train, val)
            ]
            train_docs, val_docs = sides
            count = (len(train_docs[0].tokens) + len(train_docs[1].tokens),
                     len(val_docs[0].tokens) + len(val_docs[1].tokens))  # fmt: skip
        else:
            train_docs = Documents.of([encode(r) for r in train], dtype=dtype)
            val_docs = Documents.of([encode(r) for r in val], dtype=dtype)
            count = (len(train_docs.tokens), len(val_docs.tokens))
        description = (
            f"{texts.description}{held}; {count[0]:,} train and {count[1]:,} validation "
            f"tokens ({describe(self.tokenizer)})"
        )
        return TokenSplit(train_docs, val_docs, description)


def _tensors(side: Any) -> Any:
    if isinstance(side, tuple):
        return [_tensors(s) for s in side]
    return {"tokens": side.tokens, "offsets": side.offsets}


def _documents(saved: Any) -> Any:
    if isinstance(saved, list):
        return tuple(_documents(s) for s in saved)
    return Documents(saved["tokens"], saved["offsets"])


class DigitsData:
    """scikit-learn's digits (small: loaded once and handed to the ranks)."""

    def prepare(self) -> Any:
        return digits()

    def load(self, prepared: Any = None) -> Any:
        return prepared if prepared is not None else digits()
