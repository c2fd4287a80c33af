"""Plain values as bytes, for everything that crosses a process boundary: no pickle.

Unpickling runs whatever the bytes say, and what a process reads comes from peers, the
job's store (which any local user can write to) or a socket. So values travel in one
fixed, versioned layout: a version byte, then JSON, which builds nothing but dicts, lists,
strings and numbers. The types JSON lacks travel as one-key objects (``{"t": [...]}``: a
tuple); :func:`decode` builds only these, and :func:`encode` refuses anything else on the
sending side, naming its type and :data:`REMEDY`:

None, bool, int, float (inf and nan included), str, bytes, list, tuple, dict,
``torch.dtype``, ``torch.Size`` and :class:`TensorMeta`. Subclasses of int, float and str
(an ``IntEnum``, a ``numpy.float64``) travel as their base type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["REMEDY", "VERSION", "CodecError", "TensorMeta", "decode", "encode"]

VERSION = 2  # 1: a hand-written binary layout
REMEDY = (
    "send tensors or plain values (None, bool, int, float, str, bytes, torch.dtype, and "
    "lists, tuples and dicts of them)"
)
_DEPTH = 64  # nesting: deeper is refused (a value cannot exhaust the reader's stack)
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
    text = json.dumps(_plain(value, what, 0), ensure_ascii=False, separators=(",", ":"))
    return bytes((VERSION,)) + text.encode("utf-8", "surrogatepass")


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The value ``data`` holds; :class:`CodecError` if it is not one :func:`encode` wrote."""
    data = bytes(data)
    if not data or data[0] != VERSION:
        found = data[0] if data else "no data"
        raise CodecError(f"not gpipe's wire format (version {found}, expected {VERSION})")
    try:
        return json.loads(data[1:].decode("utf-8", "surrogatepass"), object_hook=_built)
    except (ValueError, TypeError, KeyError, RecursionError) as error:
        raise CodecError(f"not gpipe's wire format: {type(error).__name__}: {error}") from None


def _plain(value: Any, what: str, depth: int) -> Any:
    """``value`` as JSON holds it: the types JSON lacks as one-key objects."""
    if depth > _DEPTH:
        raise CodecError(f"{what} is nested more than {_DEPTH} deep (or holds itself): {REMEDY}")
    if value is None or isinstance(value, (int, float, str)):  # bool is an int
        return value  # JSON writes a subclass (an IntEnum) as its base type
    kind = type(value)
    if kind is list or kind is tuple or kind is torch.Size:
        items = [_plain(item, what, depth + 1) for item in value]
        return items if kind is list else {"t" if kind is tuple else "S": items}
    if kind is dict:
        return {"d": [[_plain(k, what, depth + 1), _plain(v, what, depth + 1)]
                      for k, v in value.items()]}  # fmt: skip
    if kind is bytes or kind is bytearray:
        return {"b": bytes(value).hex()}
    if kind is torch.dtype:
        return {"y": str(value).removeprefix("torch.")}
    if kind is TensorMeta:
        parts = (value.dtype, torch.Size(value.shape), bool(value.requires_grad))
        return {"M": [_plain(part, what, depth + 1) for part in parts]}
    name = f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
    raise CodecError(f"{what} holds a value of type {name}, which cannot cross processes: {REMEDY}")


def _built(tagged: dict[str, Any]) -> Any:
    """The value a one-key object stands for (JSON builds the innermost first)."""
    ((tag, body),) = tagged.items()  # ValueError for any other object
    kind, build = _TAGS[tag]
    if type(body) is not kind:
        raise ValueError(f"{tag!r} holds a {type(body).__name__}")
    if tag == "S" and not all(type(n) is int for n in body):
        raise ValueError("a size holds something else than ints")
    return build(*body) if tag == "M" else build(body)


def _meta(dtype: Any, shape: Any, grad: Any) -> TensorMeta:
    if type(dtype) is not torch.dtype or type(shape) is not torch.Size or type(grad) is not bool:
        raise ValueError("a tensor's description is malformed")
    return TensorMeta(dtype, tuple(shape), grad)


_TAGS = {  # tag: (the type JSON holds it as, what builds the value from that)
    "t": (list, tuple),
    "S": (list, torch.Size),
    "d": (list, dict),  # [key, value] pairs: keys of any type
    "b": (str, bytes.fromhex),
    "y": (str, _DTYPES.__getitem__),
    "M": (list, _meta),
}
