"""PyTorch's Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) as
:mod:`gpipe.train.checkpoint` uses it (and :mod:`gpipe.train.checkpoint_integrity` checks
it): the only place that calls it.

DCP writes one checkpoint from many processes: each rank's tensors go into its own file
(``__R_0.distcp``), a ``DTensor`` (a sharded replica's parameter) as this rank's shard only,
a tensor several ranks hold alike (replicas, the step count) once; rank 0 writes the global
``.metadata`` (every key's shape, dtype and which file holds which chunk). Loading is planned
from that metadata for whatever the reader asks, so any cut, any number of replicas and
sharding or none reads the same checkpoint. A process without a process group saves alone.

Loads here are per process (``no_dist``): a rank reads only the keys it asks for, into whole
tensors it allocates from the metadata, and needs no collective.

A checkpoint is data, never code. DCP pickles its ``.metadata`` and reads it back with plain
``pickle.load``, and it reads the objects it stores (``torch.save`` bytes: an optimizer's
hyperparameters) with ``torch.load(weights_only=False)``: a crafted file would run code. Here
the metadata goes through :class:`_MetadataUnpickler`, which builds only DCP's own types and
refuses any other global naming it, each file it points to must lie in the checkpoint's
folder, and objects load with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import pathlib
import pickle
import re
import warnings
from collections import OrderedDict
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
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["METADATA", "DcpFailure", "Reader", "Refused", "read_metadata", "save"]

METADATA = ".metadata"  # DCP's global metadata file, written last by the coordinator


class DcpFailure(RuntimeError):
    """DCP's ``CheckpointException`` (a ``BaseException``: it would pass ``except
    Exception``), or a checkpoint it cannot read, as one line naming the file or the ranks."""


class Refused(DcpFailure):
    """A checkpoint holds something other than data DCP writes: nothing of it is used."""


@contextlib.contextmanager
def _failures_named() -> Iterator[None]:
    try:
        yield
    except CheckpointException as error:
        ours = [exc for exc, _trace in error.failures.values() if isinstance(exc, DcpFailure)]
        if len(error.failures) == 1 and ours:  # one of ours already says it all
            raise ours[0] from None
        causes = "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}"
            for rank, (exc, _trace) in sorted(error.failures.items())
        )
        raise DcpFailure(causes) from None


def save(state: dict[str, Any], folder: str | Path) -> None:
    """Write ``state`` (nested dicts of tensors and small objects) into ``folder``: a
    collective over every process of the job when there is a process group."""
    alone = not dist.is_initialized()
    with _alone_is_meant(), _failures_named():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=alone)


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
    """DCP's reader, whose metadata is read only once, and through the restricted reader."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_read_once", None) is None:
            self._read_once = read_metadata(self.path)
            # DCP's reader keeps only this load's id there (the saved ids are not used).
            self._read_once.storage_meta = md.StorageMeta(load_id=self.load_id)
        return self._read_once


# -- reading DCP's metadata as data ------------------------------------------------------------

# What DCP's FileSystemWriter pickles into .metadata (torch 2.13), by the names pickle records:
# looked up here, never imported because a file names a module.
_DCP_TYPES = (
    md.Metadata, md.StorageMeta, md.MetadataIndex, md.TensorStorageMetadata,
    md.BytesStorageMetadata, md.ChunkStorageMetadata, md.TensorProperties,
    md._MEM_FORMAT_ENCODING, _StorageInfo, torch.Size, OrderedDict, pathlib.PosixPath,
)  # fmt: skip
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(kind.__module__, kind.__qualname__): kind for kind in _DCP_TYPES},
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # the checkpoint's id (storage_meta)
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # its name in Python 3.13
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a name -> layout
    **{
        ("torch", name): value
        for name, value in vars(torch).items()
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format)
    },
}
# The classes among them whose attributes a pickle could set (BUILD on the class itself).
_MUTABLE = [kind for kind in _DCP_TYPES if kind.__module__ != "torch" and kind is not OrderedDict]


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what :data:`_ALLOWED` names; any other global refuses the file."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[module, name]
        except KeyError:
            raise Refused(
                f"checkpoint {self.path} refers to {_shown(f'{module}.{name}')}, which a DCP "
                "checkpoint never holds: refusing to read it"
            ) from None


def _shown(text: str) -> str:
    """A name from the file as it may be printed: no control characters, not too long."""
    return text[:120] if text.isprintable() else ascii(text[:120])


def read_metadata(folder: str | Path) -> md.Metadata:
    """DCP's ``.metadata`` in ``folder``, read as data only (see the module's docstring)."""
    path = Path(folder) / METADATA
    before = [dict(vars(kind)) for kind in _MUTABLE]
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, path).load()
    except Refused:
        raise
    except Exception as error:  # whatever a damaged or unreadable stream leads pickle to
        raise DcpFailure(
            f"cannot read {path} (damaged?): {type(error).__name__}: {error}"
        ) from None
    finally:
        changed = [kind for kind, was in zip(_MUTABLE, before, strict=True) if _restore(kind, was)]
    if changed:
        raise Refused(
            f"checkpoint {path} sets attributes of {changed[0].__qualname__}, which a DCP "
            "checkpoint never does: refusing to read it"
        )
    return _checked(metadata, path)


def _restore(kind: type, was: dict[str, Any]) -> bool:
    """Put back the attributes of ``kind`` a pickle changed; whether it had."""
    now = vars(kind)
    if now.keys() == was.keys() and all(now[k] is v for k, v in was.items()):
        return False
    for key in now.keys() - was.keys():
        delattr(kind, key)
    for key, value in was.items():
        if now.get(key) is not value:
            setattr(kind, key, value)
    return True


def _checked(metadata: Any, path: Path) -> md.Metadata:
    """``metadata``, if it has DCP's shape and every file it points to is in the folder."""
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not (
        isinstance(metadata, md.Metadata)
        and isinstance(entries, dict)
        and isinstance(storage, dict)
        and all(isinstance(key, str) and _an_entry(entry) for key, entry in entries.items())
    ):
        raise Refused(f"checkpoint {path} is not DCP's metadata: refusing to read it")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _a_file_beside(name):
            raise Refused(
                f"checkpoint {path} points to {name!r}, not a file beside it: refusing to read it"
            )
        if info.transform_descriptors:  # gpipe writes none (they name codecs DCP would run)
            raise Refused(
                f"checkpoint {path} asks for stream transforms {info.transform_descriptors!r}, "
                "which gpipe never writes: refusing to read it"
            )
    return metadata


def _an_entry(entry: Any) -> bool:
    if isinstance(entry, md.BytesStorageMetadata):
        return True
    return (
        isinstance(entry, md.TensorStorageMetadata)
        and isinstance(entry.size, torch.Size)
        and isinstance(entry.properties, md.TensorProperties)
        and isinstance(entry.properties.dtype, torch.dtype)
    )


def _a_file_beside(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name


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
                f"{_shown(what[1]) if what else 'what weights_only refuses'}, which is not data: "
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
