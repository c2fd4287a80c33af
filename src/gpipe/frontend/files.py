"""A checkpoint's safetensors files: which file holds each tensor, each damage named with its path.

:class:`Checkpoint` takes what ``save_pretrained`` writes (a directory with ``model.safetensors``,
or shards listed by ``model.safetensors.index.json``) or one ``.safetensors`` file. Listing the
tensors reads the index, or the one file's header; :meth:`Checkpoint.slices` opens only the files
that hold the tensors asked for and gives them lazily (``safe_open``'s slices: a tensor is read
when it is indexed), so a rank reads its own tensors only. A file that is empty, truncated, not
a safetensors file (garbage, a Git LFS pointer) or missing, and an index that is not JSON, raise
:class:`CheckpointError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

__all__ = ["Checkpoint", "CheckpointError"]

_INDEX, _SINGLE = "model.safetensors.index.json", "model.safetensors"
_REMEDY = "download it again, or save it again (save_pretrained)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message names the file and the remedy."""


class Checkpoint:
    """The tensors of a checkpoint and the file holding each (see the module doc)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files = self._index()  # tensor name -> the file holding it

    def names(self) -> list[str]:
        return list(self.files)

    @contextmanager
    def slices(self, names: Iterable[str]) -> Iterator[dict[str, Any]]:
        """``{name: slice}`` for ``names`` (``slice.get_shape()``, ``slice[...]`` reads it),
        valid inside the ``with``; only the files holding them are opened."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        with ExitStack() as stack:
            found = {}
            for path, wanted in by_file.items():
                handle = stack.enter_context(_open(path))
                held = set(handle.keys())
                absent = [n for n in wanted if n not in held]
                if absent:
                    raise CheckpointError(
                        f"{path} does not hold {absent[:3]}"
                        f"{f' (and {len(absent) - 3} more)' if len(absent) > 3 else ''}, which "
                        f"{self.path / _INDEX} says it does: the index and its shards are of "
                        f"different saves; {_REMEDY}"
                    )
                found.update((n, handle.get_slice(n)) for n in wanted)
            yield found

    def _index(self) -> dict[str, Path]:
        if self.path.is_file():
            return _names_in(self.path)
        index = self.path / _INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(
                    f"{index} is not a safetensors index (JSON with a weight_map): "
                    f"{type(error).__name__}: {error}; {_REMEDY}"
                ) from error
            files = {name: self.path / file for name, file in weight_map.items()}
            gone = sorted({str(f) for f in files.values() if not f.is_file()})
            if gone:
                raise CheckpointError(
                    f"{index} lists shards that do not exist: {gone[:3]}"
                    f"{f' (and {len(gone) - 3} more)' if len(gone) > 3 else ''}; {_REMEDY}"
                )
            return files
        if (self.path / _SINGLE).exists():
            return _names_in(self.path / _SINGLE)
        raise FileNotFoundError(
            f"weights={str(self.path)!r} holds neither {_SINGLE} nor {_INDEX}; pass the directory "
            "save_pretrained wrote (safe_serialization), or a .safetensors file"
        )


def _names_in(path: Path) -> dict[str, Path]:
    with _open(path) as handle:
        return dict.fromkeys(handle.keys(), path)


@contextmanager
def _open(path: Path):
    from safetensors import SafetensorError, safe_open  # a dependency of the hf extra

    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as error:
        raise CheckpointError(f"{path} {_damage(path)} ({error}); {_REMEDY}") from error
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {error}") from error
    with handle:
        yield handle


def _damage(path: Path) -> str:
    """What is wrong with a file safetensors refused, in words."""
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with path.open("rb") as f:
        head = f.read(64)
    if head.startswith(b"version https://git-lfs"):
        return "is a Git LFS pointer, not the file (run git lfs pull in its repository)"
    if size < 8:
        return f"is truncated: {size} bytes, less than the 8 of a safetensors header's length"
    (length,) = struct.unpack("<Q", head[:8])
    if length > size - 8:
        if head[8:9] != b"{":
            return "is not a safetensors file (no JSON header at its start)"
        return f"is truncated: {size} bytes, but its header alone needs {length + 8}"
    with path.open("rb") as f:
        f.seek(8)
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "is not a safetensors file (its header is not JSON)"
    ends = [
        entry["data_offsets"][1]
        for entry in header.values()
        if isinstance(entry, dict) and "data_offsets" in entry
    ]
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        return f"is truncated: {size} bytes, but its header describes {needed}"
    return "is damaged"
