"""The data sets of ``gpipe train``: real data that every machine already has, no download.

* **stdlib corpus** (the language model's): the Python standard library's own top-level
  ``.py`` files — several MB of real text nobody here wrote, present on every Python
  install. Split by *file* into train and validation (a file's name decides, so the split
  is the same on every machine with the same Python); ``gpipe.train.sources`` tokenizes and
  caches it (``$GPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpipe``, else ``~/.cache/gpipe``).
* **digits** (the CNN's): scikit-learn's bundled 8x8 handwritten digits, 1,797 images in
  10 classes (``pip install 'gpipe[digits]'``), split once with a fixed permutation.
* **your files**: read as documents of bytes by :mod:`gpipe.train.texts`, tokenized by the caller
  into :class:`Documents`.

A language model reads token documents as windows: :class:`PackedWindows` (the documents
joined, cut into windows of equal length, no padding) or :class:`PaddedWindows` (each document
cut on its own, its last window padded and marked invalid), each window with its mask of real
tokens, so that a token-mean loss counts only those.

Batches come from :class:`EpochSampler`: each epoch visits every item once in an order
fixed by (seed, epoch), and its whole state is two integers, so a checkpoint can store the
data position and a resumed run sees exactly the batches an uninterrupted one would::

    windows = TokenWindows(stdlib_bytes(1_000_000), seq=64)
    sampler = EpochSampler(len(windows), seed=0)
    x, y = windows[sampler.take(16)]          # (16, 64) inputs and next-byte targets
    state = sampler.state_dict()   # {"seed": 0, "epoch": 0, "index": 16, "items": 43690}
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "Digits",
    "Documents",
    "EpochSampler",
    "PackedWindows",
    "PaddedWindows",
    "TokenWindows",
    "cache_dir",
    "digits",
    "readable",
    "stdlib_bytes",
    "stdlib_files",
]

VALIDATION_PERCENT = 10  # share of the stdlib's files held out for validation


def cache_dir() -> Path:
    """Where built data sets are cached (``$GPIPE_CACHE_DIR`` or the XDG cache)."""
    explicit = os.environ.get("GPIPE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpipe"


# -- the stdlib corpus -------------------------------------------------------------------------


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(
            f"no .py files in {root}: this Python install has no standard-library source "
            f"(some slim images ship only .pyc files); install the full Python or pass root="
        )
    return files


def stdlib_bytes(max_bytes: int, root: Path | None = None) -> torch.Tensor:
    """The first ``max_bytes`` of the standard library's source, as int64 byte values: a
    small real text for demos, read straight from the files (no split, no cache)."""
    chunks, total = [], 0
    for path in stdlib_files(root):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def is_validation(path: Path) -> bool:
    """A file's split, from its name alone: ~``VALIDATION_PERCENT``% are validation files."""
    return zlib.crc32(path.name.encode()) % 100 < VALIDATION_PERCENT


# Control characters but newline and tab would garble a terminal: shown as escapes too.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(32), 127] if chr(c) not in "\n\t"}


def readable(text: bytes) -> str:
    """Bytes a byte-level model wrote, as text: UTF-8 where they are, and an escape such as
    ``\\xe2`` for each byte that is not (and for control characters)."""
    return text.decode("utf-8", "backslashreplace").translate(_CONTROLS)


# -- token documents, cut into windows ------------------------------------------------------


class Documents:
    """Token documents stored flat: ``tokens`` and ``offsets``, document i being
    ``tokens[offsets[i]:offsets[i + 1]]``."""

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor) -> None:
        self.tokens, self.offsets = tokens, offsets

    @classmethod
    def of(
        cls, documents: Iterable[Sequence[int] | torch.Tensor], *, dtype: torch.dtype = torch.int32
    ) -> Documents:
        """From each document's token ids, stored as ``dtype`` (one that holds every id)."""
        parts = [torch.as_tensor(d, dtype=dtype) for d in documents]
        lengths = torch.tensor([0] + [len(p) for p in parts], dtype=torch.int64)
        tokens = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
        return cls(tokens, lengths.cumsum(0))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def joined(self, separator: Sequence[int]) -> torch.Tensor:
        """One stream: the documents with ``separator`` between them (packing)."""
        sep = torch.tensor(list(separator), dtype=self.tokens.dtype)
        parts = []
        for i in range(len(self)):
            parts += [sep, self[i]] if i and len(sep) else [self[i]]
        return torch.cat(parts) if parts else self.tokens[:0]


class PackedWindows:
    """Windows of ``length`` tokens, ``stride`` apart, over one stream; every token real.

    A language model's windows overlap by ``length - stride`` tokens: one for next-token
    prediction (``length = seq + 1``, ``stride = seq``), so that every token but the first is
    a target exactly once per epoch, as in :class:`TokenWindows`.
    """

    def __init__(self, stream: torch.Tensor, *, length: int, stride: int) -> None:
        if len(stream) < length:
            raise ValueError(
                f"{len(stream):,} tokens hold no window of {length} tokens: more data, or a "
                "shorter --seq"
            )
        self.stream, self.length = stream, length
        self._starts = torch.arange((len(stream) - length) // stride + 1) * stride

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, real): (len(indices), length) int64 and bool."""
        tokens = self.stream[self._starts[indices].unsqueeze(1) + torch.arange(self.length)]
        return tokens.long(), torch.ones(tokens.shape, dtype=torch.bool)

    def evenly_spaced(self, count: int) -> torch.Tensor:
        """Indices of ``count`` windows spread over the whole data (a fixed evaluation set)."""
        return _evenly_spaced(len(self), count)


class TokenWindows(PackedWindows):
    """Windows of ``seq + 1`` bytes, ``seq`` apart: item i is (input, next-byte target).

    Window i covers bytes ``[i*seq, i*seq + seq]``; consecutive windows share one byte, so
    every byte but the first is a target exactly once per epoch.
    """

    def __init__(self, data: torch.Tensor, *, seq: int) -> None:
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        if len(data) < seq + 1:
            raise ValueError(f"{len(data)} bytes hold no window of seq + 1 = {seq + 1} bytes")
        super().__init__(data, length=seq + 1, stride=seq)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (len(indices), seq) int64."""
        window, _ = super().__getitem__(indices)  # (B, seq + 1)
        return window[:, :-1], window[:, 1:]


class PaddedWindows:
    """Each document cut on its own into windows of ``length`` tokens, ``stride`` apart (the
    last one shorter: padded with ``pad`` and marked not real); a window holds at least
    one token beyond the overlap of ``length - stride``."""

    def __init__(self, documents: Documents, *, length: int, stride: int, pad: int) -> None:
        overlap = length - stride
        starts, lengths = [], []
        for begin, size in zip(documents.offsets[:-1].tolist(), documents.lengths.tolist(),
                               strict=True):  # fmt: skip
            for start in range(0, max(0, size - overlap), stride):
                starts.append(begin + start)
                lengths.append(min(length, size - start))
        if not starts:
            raise ValueError(
                f"no document holds more than {overlap} token(s): nothing to learn from"
            )
        self.tokens, self.length, self.pad = documents.tokens, length, pad
        self._starts, self._lengths = torch.tensor(starts), torch.tensor(lengths)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, real): (len(indices), length) int64 and bool; padding where not real."""
        span = torch.arange(self.length)
        real = span < self._lengths[indices].unsqueeze(1)
        where = (self._starts[indices].unsqueeze(1) + span).clamp(max=len(self.tokens) - 1)
        tokens = torch.where(real, self.tokens[where].long(), self.pad)
        return tokens, real

    def evenly_spaced(self, count: int) -> torch.Tensor:
        return _evenly_spaced(len(self), count)


class PairedSamples:
    """Sequence-to-sequence samples, one per (source, target) pair, each side cut to its
    length and padded with ``pad`` (marked not real)."""

    def __init__(
        self, sources: Documents, targets: Documents, *, length: int, target_length: int, pad: int
    ) -> None:
        if len(sources) != len(targets) or not len(sources):
            raise ValueError(f"{len(sources)} sources for {len(targets)} targets")
        self.sides = [(sources, length), (targets, target_length)]
        self.pad = pad

    def __len__(self) -> int:
        return len(self.sides[0][0])

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(source, source real, target, target real), each (len(indices), its length)."""
        out: list[torch.Tensor] = []
        for documents, length in self.sides:
            tokens = torch.full((len(indices), length), self.pad, dtype=torch.int64)
            for row, i in enumerate(indices.tolist()):
                document = documents[i][:length]
                tokens[row, : len(document)] = document.long()
            size = documents.lengths[indices].clamp(max=length)
            out += [tokens, torch.arange(length) < size.unsqueeze(1)]
        return tuple(out)

    def evenly_spaced(self, count: int) -> torch.Tensor:
        return _evenly_spaced(len(self), count)


def _evenly_spaced(total: int, count: int) -> torch.Tensor:
    """Indices of ``count`` items spread over ``total`` (a fixed evaluation set)."""
    count = min(count, total)
    return torch.linspace(0, total - 1, count).round().long()


# -- digits --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Digits:
    """8x8 digit images, normalized: ``images`` (N, 1, 8, 8) float32, ``labels`` (N,) int64."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor
    val_labels: torch.Tensor

    def describe(self) -> str:
        return (
            f"{len(self.train_labels):,} train and {len(self.val_labels):,} validation 8x8 "
            f"images of scikit-learn's digits"
        )


def digits(*, val_size: int = 297) -> Digits:
    """scikit-learn's digits, split by a fixed permutation; needs the ``digits`` extra."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "the digits data set comes with scikit-learn: pip install 'gpipe[digits]' "
            "(or pip install scikit-learn)"
        ) from error
    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    val, train = order[:val_size], order[val_size:]
    mean, std = images[train].mean(), images[train].std()
    images = (images - mean) / std
    return Digits(images[train], labels[train], images[val], labels[val])


# -- sampling ------------------------------------------------------------------------------


class EpochSampler:
    """Shuffled indices without replacement, epoch after epoch; resumable from two integers.

    Epoch e's order is ``randperm(num_items)`` from a generator seeded by (seed, e); a batch
    that runs past an epoch's end continues into the next one.
    """

    def __init__(self, num_items: int, *, seed: int) -> None:
        if num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {num_items}")
        self.num_items, self.seed = num_items, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash_seed(self.seed, epoch))
        return torch.randperm(self.num_items, generator=generator)

    def take(self, count: int) -> torch.Tensor:
        """The next ``count`` indices."""
        parts, needed = [], count
        while needed > 0:
            if self.index == self.num_items:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            part = self._order[self.index : self.index + needed]
            self.index += len(part)
            needed -= len(part)
            parts.append(part)
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def state_dict(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "index": self.index,
            "items": self.num_items,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for seed {state['seed']}, this sampler has seed {self.seed}"
            )
        if state.get("items", self.num_items) != self.num_items:
            raise ValueError(
                f"the sampler's position is in an epoch of {state['items']} items, this data "
                f"has {self.num_items}: the checkpoint was made with other data (the data "
                "files, --seq or --packing changed?)"
            )
        if not 0 <= state["index"] <= self.num_items:
            raise ValueError(
                f"sampler position {state['index']} is outside an epoch of {self.num_items} "
                f"items: the checkpoint was made with other data (seq or data set changed?)"
            )
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)


def hash_seed(*values: int) -> int:
    """A well-mixed non-negative 63-bit seed from integers (e.g. run seed, step, replica)."""
    digest = hashlib.blake2b(",".join(map(str, values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
