"""Plain values as bytes, for everything that crosses a process boundary: no pickle.

Unpickling runs whatever the bytes say, and what a process reads comes from peers, the
job's store (which any local user can write to) or a socket. So values travel in one
fixed, versioned layout: a version byte, then each value as a one-byte tag and its
contents (little-endian). :func:`decode` builds only these types, and :func:`encode`
refuses anything else on the sending side, naming its type and :data:`REMEDY`:

None, bool, int, float (inf and nan included), str, bytes, list, tuple, dict,
``torch.dtype``, ``torch.Size`` and :class:`TensorMeta`. Subclasses of int, float and str
(an ``IntEnum``, a ``numpy.float64``) travel as their base type.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REMEDY", "VERSION", "CodecError", "TensorMeta", "decode", "encode"]

VERSION = 1
REMEDY = (
    "send tensors or plain values (None, bool, int, float, str, bytes, torch.dtype, and "
    "lists, tuples and dicts of them)"
)
_DEPTH = 64  # nesting: deeper is refused (a value cannot exhaust the reader's stack)
_LENGTH = struct.Struct("<I")
_INT = struct.Struct("<q")
_FLOAT = struct.Struct("<d")
_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate a tensor that is on its way."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


class CodecError(ValueError):
    """A value that cannot cross processes, or bytes that are not such a value."""


def encode(value: Any, what: str = "the value sent") -> bytes:
    """``value`` in the wire layout; :class:`CodecError` naming ``what`` for any other type."""
    out = bytearray((VERSION,))
    _put(out, value, what, 0)
    return bytes(out)


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value ``data`` holds; :class:`CodecError` if it is not one :func:`encode` wrote."""
    view = memoryview(data).cast("B")
    if not view.nbytes or view[0] != VERSION:
        found = view[0] if view.nbytes else "no data"
        raise CodecError(f"not gpipe's wire format (version {found}, expected {VERSION})")
    try:
        value, end = _get(view, 1, 0)
    except (struct.error, IndexError, UnicodeDecodeError, TypeError, KeyError) as error:
        raise CodecError(f"not gpipe's wire format: {type(error).__name__}: {error}") from None
    if end != view.nbytes:
        raise CodecError(f"not gpipe's wire format: {view.nbytes - end} bytes after the value")
    return value


def _put(out: bytearray, value: Any, what: str, depth: int) -> None:
    if depth > _DEPTH:
        raise CodecError(f"{what} is nested more than {_DEPTH} deep (or holds itself): {REMEDY}")
    kind = type(value)
    if value is None:
        out += b"N"
    elif kind is bool:
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        if -(1 << 63) <= value < 1 << 63:
            out += b"i" + _INT.pack(value)
        else:
            _sized(
                out, b"I", int(value).to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
            )
    elif isinstance(value, float):
        out += b"f" + _FLOAT.pack(value)
    elif isinstance(value, str):
        _sized(out, b"s", value.encode("utf-8", "surrogatepass"))
    elif kind is bytes or kind is bytearray:
        _sized(out, b"b", value)
    elif kind is torch.dtype:
        _sized(out, b"y", str(value).removeprefix("torch.").encode())
    elif kind is torch.Size:
        out += b"S" + _LENGTH.pack(len(value)) + b"".join(_INT.pack(n) for n in value)
    elif kind is TensorMeta:
        out += b"M"
        for part in (value.dtype, torch.Size(value.shape), bool(value.requires_grad)):
            _put(out, part, what, depth + 1)
    elif kind is list or kind is tuple:
        out += (b"l" if kind is list else b"t") + _LENGTH.pack(len(value))
        for item in value:
            _put(out, item, what, depth + 1)
    elif kind is dict:
        out += b"d" + _LENGTH.pack(len(value))
        for key, item in value.items():
            _put(out, key, what, depth + 1)
            _put(out, item, what, depth + 1)
    else:
        name = f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
        raise CodecError(f"{what} holds a value of type {name}, which cannot cross processes: "
                         f"{REMEDY}")  # fmt: skip


def _sized(out: bytearray, tag: bytes, raw: bytes) -> None:
    out += tag + _LENGTH.pack(len(raw)) + raw


def _get(view: memoryview, at: int, depth: int) -> tuple[Any, int]:
    if depth > _DEPTH:
        raise CodecError(f"not gpipe's wire format: nested more than {_DEPTH} deep")
    tag = view[at]
    at += 1
    if tag in _CONSTANTS:
        return _CONSTANTS[tag], at
    if tag == _I:
        return _INT.unpack_from(view, at)[0], at + 8
    if tag == _F:
        return _FLOAT.unpack_from(view, at)[0], at + 8
    if tag in _SIZED:
        (size,) = _LENGTH.unpack_from(view, at)
        at += 4
        raw = bytes(view[at : at + size])
        if len(raw) != size:
            raise CodecError(f"not gpipe's wire format: {size} bytes announced, {len(raw)} there")
        return _SIZED[tag](raw), at + size
    if tag == _SIZE:
        (n,) = _LENGTH.unpack_from(view, at)
        dims = struct.unpack_from(f"<{n}q", view, at + 4)
        return torch.Size(dims), at + 4 + 8 * n
    if tag == _META:
        dtype, at = _get(view, at, depth + 1)
        shape, at = _get(view, at, depth + 1)
        grad, at = _get(view, at, depth + 1)
        if (
            type(dtype) is not torch.dtype
            or type(shape) is not torch.Size
            or type(grad) is not bool
        ):
            raise CodecError("not gpipe's wire format: a tensor's description is malformed")
        return TensorMeta(dtype, tuple(shape), grad), at
    if tag in _SEQUENCES:
        (n,) = _LENGTH.unpack_from(view, at)
        at += 4
        items = []
        for _ in range(n * (2 if tag == _D else 1)):
            item, at = _get(view, at, depth + 1)
            items.append(item)
        if tag == _D:
            return dict(zip(items[::2], items[1::2], strict=True)), at
        return _SEQUENCES[tag](items), at
    raise CodecError(f"not gpipe's wire format: unknown tag {tag} at byte {at - 1}")


_CONSTANTS = {ord("N"): None, ord("T"): True, ord("F"): False}
_I, _F, _SIZE, _META, _D = (ord(t) for t in "ifSMd")
_SIZED = {
    ord("I"): lambda raw: int.from_bytes(raw, "little", signed=True),
    ord("s"): lambda raw: raw.decode("utf-8", "surrogatepass"),
    ord("b"): bytes,
    ord("y"): lambda raw: _DTYPES[raw.decode("ascii")],
}
_SEQUENCES = {ord("l"): list, ord("t"): tuple, _D: dict}
