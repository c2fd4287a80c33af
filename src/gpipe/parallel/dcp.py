"""PyTorch's Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) as
:mod:`gpipe.train.checkpoint` uses it (and :mod:`gpipe.train.checkpoint_integrity` checks
it): the only place that calls it.

DCP writes one checkpoint from many processes: each rank's tensors go into its own file
(``__R_0.distcp``), a ``DTensor`` (a sharded replica's parameter) as this rank's shard only;
the global ``.metadata`` (every key's shape, dtype and which file holds which chunk) is the
ranks' parts merged by one (:func:`save`, :func:`merge`). Loading is planned
from that metadata for whatever the reader asks, so any cut, any number of replicas and
sharding or none reads the same checkpoint. A process without a process group saves alone.

Loads here are per process (``no_dist``): a rank reads only the keys it asks for, into whole
tensors it allocates from the metadata, and needs no collective.

A checkpoint is data, never code. DCP pickles its ``.metadata`` and reads it back with plain
``pickle.load``, and it reads the objects it stores (``torch.save`` bytes: an optimizer's
hyperparameters) with ``torch.load(weights_only=False)``: a crafted file would run code. Here
no unpickler reads the metadata (:mod:`gpipe.parallel.dcp_metadata` walks its opcodes and
builds only DCP's own types), and objects load with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from gpipe.base.files import write_file
from gpipe.parallel import dcp_metadata as dm
from gpipe.parallel.dcp_metadata import DcpFailure, Refused

__all__ = ["METADATA", "DcpFailure", "Reader", "Refused", "merge", "read_metadata", "save"]

METADATA = ".metadata"  # DCP's global metadata file, written last by the coordinator


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _failures_named() -> Iterator[None]:
    """DCP's failure as a :class:`DcpFailure` naming this process's rank (DCP runs here in
    one process alone, as its rank 0: one failure)."""
    try:
        yield
    except CheckpointException as error:
        ((exc, _trace),) = error.failures.values()
        if isinstance(exc, DcpFailure):  # one of ours already says it all
            raise exc from None
        raise DcpFailure(f"rank {_rank()}: {type(exc).__name__}: {exc}") from None


def save(state: dict[str, Any], folder: str | Path, *, replica: int = 0) -> None:
    """Write this process's part of a checkpoint, ``state`` (nested dicts of tensors and
    small objects), into ``folder``: its files and its part of the metadata, ``__R.metadata``
    for its rank R. Once every process has written, one calls :func:`merge`.

    Without DCP's collectives, which pickle the plans and results they exchange, so that a
    rank would unpickle what its peers send. Replicas hold equal tensors: only the first
    (``replica`` 0) writes them, the others their own ``DTensor`` shards alone.
    """
    if replica > 0:
        state = _shards_of(state) or {}
    with _alone_is_meant(), _failures_named():
        dcp.save(state, storage_writer=_PartWriter(str(folder), _rank()), no_dist=True)


def _shards_of(tree: Any) -> Any:
    """The ``DTensor`` shards of nested dicts, the rest dropped."""
    if isinstance(tree, DTensor):
        return tree
    if isinstance(tree, dict):
        kept = {key: _shards_of(value) for key, value in tree.items()}
        return {key: value for key, value in kept.items() if value is not None} or None
    return None


class _PartWriter(dcp.FileSystemWriter):
    """DCP's writer of one process's part: its files and metadata named by its rank."""

    def __init__(self, path: str, rank: int) -> None:
        super().__init__(path)
        self._rank = rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, rank=self._rank, use_collectives=False)

    def _metadata_exists(self) -> bool:
        # DCP looks for rank 0's part, which a faster rank 0 has just written ("Detected an
        # existing checkpoint ... overwriting"): what this writer would replace is its own.
        return (Path(self.path) / f"__{self._rank}{METADATA}").exists()


def merge(folder: str | Path) -> None:
    """The one ``.metadata`` in ``folder`` from every process's part, each read as data: the
    keys of all, a sharded tensor's chunks from each holder. The parts are removed."""
    folder = Path(folder)
    parts = {int(p.name[2 : -len(METADATA)]): p for p in folder.glob(f"__*{METADATA}")}
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    if missing := sorted(set(range(ranks)) - parts.keys()):
        ranks_named = ", ".join(map(str, missing))
        raise DcpFailure(f"its files were not written (no __R{METADATA} of rank {ranks_named})")
    parts = [parts[rank] for rank in sorted(parts)]
    merged = _parsed(parts[0])
    for part in parts[1:]:
        got = _parsed(part)
        for key, entry in got.state_dict_metadata.items():
            held = merged.state_dict_metadata.setdefault(key, entry)
            if type(held) is not type(entry) or getattr(held, "size", None) != getattr(
                entry, "size", None
            ):
                raise DcpFailure(f"{part} holds {key} unlike {parts[0]}: not one checkpoint")
            if held is not entry and isinstance(held, md.TensorStorageMetadata):
                held.chunks += [chunk for chunk in entry.chunks if chunk not in held.chunks]
            # an object several ranks hold (an optimizer group's settings): the first's, as
            # DCP's own planner keeps one
        for index, info in got.storage_data.items():
            merged.storage_data.setdefault(index, info)
        for key, place in (got.planner_data or {}).items():
            merged.planner_data.setdefault(key, place)
    # written here, read back only as data (dcp_metadata)
    write_file(folder / METADATA, lambda file: pickle.dump(merged, file))
    for part in parts:
        part.unlink()


class Reader:
    """The checkpoint in ``folder``, for this process alone: its keys (:attr:`entries`) and
    :meth:`load`, reading DCP's metadata once for both. Raises :class:`DcpFailure`
    (:class:`Refused` for what is not DCP's data) naming the file."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = str(folder)
        self._storage = _OnceReader(self.folder)
        metadata = self._storage.read_metadata()
        # Every (flattened, dotted) key: a tensor's whole size and dtype, or None (an object).
        self.entries: dict[str, tuple[torch.Size, torch.dtype] | None] = {
            key: (entry.size, entry.properties.dtype)
            if isinstance(entry, md.TensorStorageMetadata)
            else None
            for key, entry in metadata.state_dict_metadata.items()
        }

    def load(self, state: dict[str, Any]) -> None:
        """Fill ``state`` (tensors allocated with the saved sizes, None for objects) in
        place, in this process alone."""
        with _alone_is_meant(), _failures_named():
            planner = _DataOnlyPlanner(self.folder)
            dcp.load(state, storage_reader=self._storage, planner=planner, no_dist=True)

    def check_objects(self) -> None:
        """Read every object the checkpoint holds (its tensors are checked by their bytes'
        SHA-256): raises :class:`DcpFailure` if one is not plain data."""
        self.load({key: None for key, entry in self.entries.items() if entry is None})


class _OnceReader(dcp.FileSystemReader):
    """DCP's reader, whose metadata is read only once, and as data (never unpickled)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_read_once", None) is None:
            self._read_once = read_metadata(self.path)
            # DCP's reader keeps only this load's id there (the saved ids are not used).
            self._read_once.storage_meta = md.StorageMeta(load_id=self.load_id)
        return self._read_once


def read_metadata(folder: str | Path) -> md.Metadata:
    """DCP's ``.metadata`` in ``folder``, read as data only (:mod:`gpipe.parallel.dcp_metadata`),
    if every file it points to lies in ``folder`` and holds at least the tensors it describes."""
    path = Path(folder) / METADATA
    metadata = _parsed(path)
    files = {info.relative_path for info in metadata.storage_data.values()}
    for name in sorted(files):
        if name in ("", ".", "..") or Path(name).name != name:
            raise dm.refused(path, f"points to {name!r}, not a file beside it")
    if any(info.transform_descriptors for info in metadata.storage_data.values()):
        raise dm.refused(path, "asks for stream transforms, which gpipe never writes")
    stored = sum(_size_of(Path(folder) / name) for name in files)
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, md.TensorStorageMetadata):
            claimed = math.prod(entry.size) * entry.properties.dtype.itemsize
            if claimed > stored:
                raise dm.refused(path, f"claims {dm.shown(key)} of {claimed} bytes, more than "
                               f"its files' {stored}")  # fmt: skip
    return metadata


def _parsed(path: Path) -> md.Metadata:
    try:
        with open(path, "rb") as file:
            data = file.read(dm.MAX_BYTES + 1)
    except OSError as error:
        raise DcpFailure(f"cannot read {path}: {error}") from None
    return dm.parse(data, path)


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # DCP names the missing file when it reads it


class _DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading stored objects with ``weights_only=True``: plain data
    (numbers, strings, containers, tensors), never a global outside torch's allowed few."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: Any, value: Any) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            what = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
            raise Refused(
                f"checkpoint {self.folder}: its {key} refers to "
                f"{dm.shown(what[1]) if what else 'what weights_only refuses'}, which is not data: "
                "refusing to read it"
            ) from None
        set_element(self.original_state_dict, self.mappings[key], loaded)  # as DCP's does


@contextlib.contextmanager
def _alone_is_meant() -> Iterator[None]:
    """DCP warns that it assumes one process whenever it runs without a group: here that is
    the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
