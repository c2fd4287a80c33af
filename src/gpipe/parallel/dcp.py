"""PyTorch's Distributed Checkpoint (``torch.distributed.checkpoint``, DCP) as
:mod:`gpipe.checkpoint` uses it: the only place that calls it.

DCP writes one checkpoint from many processes: each rank's tensors go into its own file
(``__R_0.distcp``), a ``DTensor`` (a sharded replica's parameter) as this rank's shard only,
a tensor several ranks hold alike (replicas, the step count) once; rank 0 writes the global
``.metadata`` (every key's shape, dtype and which file holds which chunk). Loading is planned
from that metadata for whatever the reader asks, so any cut, any number of replicas and
sharding or none reads the same checkpoint. A process without a process group saves alone.

Loads here are per process (``no_dist``): a rank reads only the keys it asks for, into whole
tensors it allocates from the metadata, and needs no collective.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["METADATA", "DcpFailure", "Reader", "save"]

METADATA = ".metadata"  # DCP's global metadata file, written last by the coordinator


class DcpFailure(RuntimeError):
    """DCP's ``CheckpointException`` (a ``BaseException``: it would pass ``except
    Exception``) as one line: each failing rank with its exception."""


@contextlib.contextmanager
def _failures_named() -> Iterator[None]:
    try:
        yield
    except CheckpointException as error:
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
    :meth:`load`, reading DCP's metadata once for both."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = str(folder)
        self._storage = _OnceReader(self.folder)
        metadata = self._storage.read_metadata()
        # Every (flattened, dotted) key: a tensor's whole size and dtype, or None (an object).
        self.entries: dict[str, tuple[torch.Size, torch.dtype] | None] = {
            key: (entry.size, entry.properties.dtype)
            if isinstance(entry, TensorStorageMetadata)
            else None
            for key, entry in metadata.state_dict_metadata.items()
        }

    def load(self, state: dict[str, Any]) -> None:
        """Fill ``state`` (tensors allocated with the saved sizes, None for objects) in
        place, in this process alone."""
        with _alone_is_meant(), _failures_named():
            dcp.load(state, storage_reader=self._storage, no_dist=True)


class _OnceReader(dcp.FileSystemReader):
    """DCP's reader, whose metadata (a pickle of every key's chunks) is read only once."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "_read_once", None) is None:
            self._read_once = super().read_metadata(*args, **kwargs)
        return self._read_once


@contextlib.contextmanager
def _alone_is_meant() -> Iterator[None]:
    """DCP warns that it assumes one process whenever it runs without a group: here that is
    the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
