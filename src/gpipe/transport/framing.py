"""The one wire protocol of both carriers between processes: every frame starts with a head
of ``HEAD`` bytes (three little-endian int64: kind, position, size; then a row's bytes),
in one sequence per pair of ranks that the schedule fixes:

* ``SEED``: rank 0's row of the step's seed (first, from rank 0 only);
* ``MESSAGE``: an activation or gradient; ``size`` bytes of description follow when it
  differs from last time (``History``; 0: as last time), then its tensors;
* ``AGREEMENT``: a rank's row of the end-of-step agreement (last);
* ``NOTICE``: a failure, in place of the next frame (``gpipe.transport.inquest``); its row
  (``NOTICE_ROW``): the rank that caused it, that rank's global rank (-1: not known) and
  whether the sender gave up on the pipeline (else its agreement row is the next frame).

The position is the frame's index in its sequence (the process group's tag). Descriptions
are plain values (``gpipe.transport.codec``): nothing received is unpickled.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from gpipe.transport.codec import CodecError, TensorMeta, decode, encode

__all__ = [
    "AGREEMENT", "ALIGN", "HEAD", "MESSAGE", "NOTICE", "NOTICE_ROW", "SEED", "History",
    "TensorMeta", "bytes_of", "bytes_tensor", "flatten", "head", "join", "read_head", "row_of",
]  # fmt: skip

ALIGN = 64  # bytes: a cache line, so that vectorized kernels see aligned tensors
HEAD = 128  # bytes of a frame's head: its three words, then room for a row
MESSAGE, SEED, AGREEMENT, NOTICE = 0, 1, 2, 3
_WORDS = struct.Struct("<qqq")
NOTICE_ROW = torch.zeros(3, dtype=torch.int64)  # a notice's row: its dtype and length


def head(kind: int, position: int, size: int = 0, row: Any = None) -> bytes:
    """A frame's head; ``row`` (a CPU tensor of at most ``HEAD - 24`` bytes) travels in it."""
    data = b"" if row is None else row.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return _WORDS.pack(kind, position, size) + data + bytes(HEAD - _WORDS.size - len(data))


def read_head(frame: torch.Tensor) -> tuple[int, int, int]:
    """(kind, position, size) of a frame received (a uint8 tensor that starts with a head)."""
    return _WORDS.unpack_from((frame if frame.is_cpu else frame[: _WORDS.size].cpu()).numpy())


def row_of(frame: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The row a frame received (a CPU uint8 tensor) holds in its head, shaped as ``like``."""
    raw = bytearray(frame[_WORDS.size : _WORDS.size + like.nbytes].numpy())
    return torch.frombuffer(raw, dtype=like.dtype).reshape(like.shape)


class Decoded(NamedTuple):
    """A message's description, decoded: what its receiver needs."""

    build: Callable[[list[Any]], Any]  # the message from its leaves
    described: list[Any]  # its leaves, with a TensorMeta for each tensor
    # Packed, the head first (HEAD bytes), then each tensor on an ALIGN-byte boundary (so
    # that each can be a view of the packed bytes): where each tensor is, and the size.
    spans: list[slice]
    size: int
    # Each tensor leaf as (index, dtype, shape, strides, offset in items): a packed
    # buffer's view of it is one ``as_strided`` of the buffer viewed as its dtype.
    views: list[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int]]
    grads: list[int]  # the leaves a forward message's receiver makes require grad


class History:
    """What one message (one peer, one kind, one micro-batch) looked like last time.

    Sender and receiver update theirs identically, so both know whether the receiver
    posted the message's buffers ahead (it does when the message is *stable*: the same
    description the last two times).
    """

    __slots__ = ("_decoded", "_described", "last", "stable")

    def __init__(self) -> None:
        self.last: bytes | None = None
        self.stable = False
        self._decoded: Decoded | None = None
        self._described: tuple[list[Any], bytes] | None = None  # sender: (key, encoded)

    def describe(self, spec: str, leaves: list[Any]) -> bytes:
        """A message's description (its tree spec's text, its leaves with a ``TensorMeta``
        for each tensor), encoded; not encoded again while its key (each tensor's dtype,
        shape and requires_grad, each other leaf's type and value) stays the same. A leaf
        that cannot cross processes raises :class:`~gpipe.transport.codec.CodecError`."""
        key = [spec]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                key += [leaf.dtype, leaf.shape, leaf.requires_grad]
            else:
                key += [type(leaf), leaf]
        if self._described is None or self._described[0] != key:
            described = [
                TensorMeta(leaf.dtype, tuple(leaf.shape), leaf.requires_grad)
                if isinstance(leaf, torch.Tensor)
                else leaf
                for leaf in leaves
            ]
            self._described = (key, encode((_checked(spec), described)))
        return self._described[1]

    def update(self, meta: bytes) -> None:
        self.stable = meta == self.last
        if not self.stable:
            self.last, self._decoded = meta, None

    @property
    def decoded(self) -> Decoded:
        """The last message's description, decoded (once)."""
        if self._decoded is None:
            spec, described = _description(self.last)
            spans, views, offset = [], [], HEAD
            for i, d in enumerate(described):
                if isinstance(d, TensorMeta):
                    size = math.prod(d.shape) * d.dtype.itemsize
                    spans.append(slice(offset, offset + size))
                    strides = torch.empty(d.shape, device="meta").stride()
                    views.append((i, d.dtype, d.shape, strides, offset // d.dtype.itemsize))
                    offset += -(-size // ALIGN) * ALIGN
            grads = [i for i, d in enumerate(described) if isinstance(d, TensorMeta)
                     and d.requires_grad]  # fmt: skip
            build = _builder(treespec_loads(_checked(spec)))
            self._decoded = Decoded(build, described, spans, offset, views, grads)
        return self._decoded

    def allocate(self, device: torch.device) -> list[Any]:
        """The last message's leaves, each tensor empty on ``device``, to receive into."""
        return [
            torch.empty(d.shape, dtype=d.dtype, device=device) if isinstance(d, TensorMeta) else d
            for d in self.decoded.described
        ]

    def rebuild(self, leaves: list[Any], forward: bool = False) -> Any:
        """The last message's value from its received leaves. A ``forward`` message's
        tensors require grad where the sender's did."""
        if forward:
            for i in self.decoded.grads:
                leaves[i].requires_grad_(True)
        return self.decoded.build(leaves)

    def parts(self, head: bytes, tensors: list[torch.Tensor] | None) -> list[Any]:
        """A frame's head and tensors (contiguous, as described last time) as the parts of
        one transfer of the size the receiver posted: the head, each tensor at its offset,
        zeros between. A socket writes them as they are; the process group joins them
        (:func:`join`)."""
        spans, total = self.decoded.spans, self.decoded.size
        parts, at = [head], HEAD
        for tensor, span in zip(tensors or [], spans if tensors else [], strict=True):
            parts += [bytes(span.start - at), tensor] if span.start > at else [tensor]
            at = span.stop
        return [*parts, bytes(total - at)] if total > at else parts

    def unpack(self, packed: torch.Tensor) -> list[Any]:
        """The message's leaves, its tensors as views of ``packed`` (no copy)."""
        leaves = list(self.decoded.described)
        for i, dtype, shape, strides, offset in self.decoded.views:
            leaves[i] = packed.view(dtype).as_strided(shape, strides, offset)
        return leaves


@functools.lru_cache(maxsize=256)
def _spec_text(spec: Any) -> str:
    # Serializing a tree spec costs ~0.1 ms; a pipeline sends the same few over and over.
    return treespec_dumps(spec)


def flatten(value: Any) -> tuple[list[Any], str]:
    """A message's leaves and its tree spec's text, as ``tree_flatten`` gives them. What
    stages send is mostly a tensor, or a list or tuple of tensors: those skip pytree's walk,
    which costs more than the rest of a small message's send."""
    if type(value) is torch.Tensor:
        return [value], _LEAF
    kind = type(value)
    if (kind is list or kind is tuple) and all(type(v) is torch.Tensor for v in value):
        return list(value), _sequence_text(kind, len(value))
    leaves, spec = tree_flatten(value)
    return leaves, _spec_text(spec)


@functools.lru_cache(maxsize=64)
def _sequence_text(kind: type, n: int) -> str:
    return _spec_text(tree_flatten(kind([0] * n))[1])


_LEAF = _spec_text(tree_flatten(0)[1])


def _builder(spec: Any) -> Callable[[list[Any]], Any]:
    """What builds a value of ``spec`` from its leaves: ``tree_unflatten``, but for a leaf,
    or a list or tuple of leaves, without pytree's walk."""
    if spec.is_leaf():
        return operator.itemgetter(0)
    if spec.type in (list, tuple) and all(c.is_leaf() for c in spec.children()):
        return spec.type
    return functools.partial(tree_unflatten, treespec=spec)


def _checked(spec: str) -> str:
    # Loading a spec with an enum in it imports the module it names: none crosses processes.
    if "__enum__" in spec:
        raise CodecError(f"a tree spec with an enum in it cannot cross processes: {spec[:200]}")
    return spec


def _description(data: bytes) -> tuple[str, list[Any]]:
    value = decode(data)
    if not (type(value) is tuple and len(value) == 2 and type(value[0]) is str
            and type(value[1]) is list):  # fmt: skip
        raise CodecError(f"not a message's description: {type(value).__name__}")
    return value


def join(parts: list[Any]) -> torch.Tensor:
    """One transfer's parts (bytes, contiguous tensors) in one byte buffer, on the
    tensors' device (on the host: joined as bytes, twice as fast as a ``torch.cat``)."""
    if all(type(p) is bytes or p.is_cpu for p in parts):
        joined = bytearray().join([p if type(p) is bytes else bytes_of(p) for p in parts])
        return torch.frombuffer(joined, dtype=torch.uint8)
    device = next(p.device for p in parts if isinstance(p, torch.Tensor))
    return torch.cat([bytes_tensor(p).to(device) if isinstance(p, bytes)
                      else p.reshape(-1).view(torch.uint8) for p in parts])  # fmt: skip


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (any dtype: viewed as bytes; a view
    of the last dimension costs a third of a reshape's)."""
    if not tensor.numel():
        return memoryview(b"")
    try:  # one call where numpy has the dtype
        return memoryview(tensor.numpy()).cast("B")
    except (TypeError, RuntimeError):  # bfloat16 and the like: viewed as bytes first
        flat = tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)
        return memoryview(flat.numpy()).cast("B")


def bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
