"""DCP's ``.metadata`` read as data, without an unpickler.

torch's ``FileSystemWriter`` pickles the checkpoint's :class:`Metadata` (torch 2.13: protocol
4), and its reader unpickles it: a crafted file would run code. Here no ``pickle.load`` runs.
The file's opcodes (``pickletools.genops``) drive a small stack machine that knows only what
DCP's metadata uses: the opcodes in :data:`OPCODES`, the globals in :data:`GLOBALS` (looked
up by name in a fixed table: nothing the file names is imported or called), and its types,
each built by a fixed constructor from fields checked against DCP's schema as it is built::

    STACK_GLOBAL 'torch' 'Size'  (8, 4) TUPLE1 REDUCE        -> torch.Size((8, 4))
    STACK_GLOBAL '...metadata' 'ChunkStorageMetadata' EMPTY_TUPLE NEWOBJ
    EMPTY_DICT MARK 'offsets' ... 'sizes' ... SETITEMS BUILD -> ChunkStorageMetadata(**fields)

Anything else is refused in one line naming the file and the opcode or the global. Sizes are
bounded: the file (:data:`MAX_BYTES`), nesting (marks, tuples in tuples), lists and dicts
used once (never shared through the memo, so no check runs twice).
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickletools
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["GLOBALS", "OPCODES", "SCHEMA", "DcpFailure", "Refused", "parse", "refused", "shown"]

MAX_BYTES = 1 << 30  # DCP writes about 200 bytes per tensor chunk
MAX_MARKS, MAX_TUPLE = 16, 64  # DCP's metadata nests 5 marks, its tuples hold a few items
REMEDY = "use another checkpoint of the run (gpipe checkpoints RUN lists them)"


class DcpFailure(RuntimeError):
    """DCP's ``CheckpointException`` (a ``BaseException``: it would pass ``except
    Exception``), or a checkpoint it cannot read, as one line naming the file or the ranks."""


class Refused(DcpFailure):
    """A checkpoint holds something other than data DCP writes: nothing of it is used."""


def _is(*kinds: Any) -> Any:
    return lambda v: type(v) in kinds


def _list_of(item: Any) -> Any:
    return lambda v: type(v) is list and all(map(item, v))


def _dict_of(key: Any, value: Any) -> Any:
    return lambda v: type(v) is dict and all(key(k) and value(x) for k, x in v.items())


def _obj_path(value: Any) -> bool:  # a key's place in the nested state dict DCP saved
    return type(value) is tuple and all(type(i) in (str, int) for i in value)


_TENSOR = (md.TensorStorageMetadata, md.BytesStorageMetadata)
_FORMATS = {
    md._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    md._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
    md._MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}
# Every type the file may build, each field's check (DCP's own annotations, made exact).
SCHEMA: dict[type, dict[str, Any]] = {
    md.Metadata: {"state_dict_metadata": _dict_of(_is(str), _is(*_TENSOR)),
                  "planner_data": lambda v: v is None or _dict_of(_is(str), _obj_path)(v),
                  "storage_data": _dict_of(_is(md.MetadataIndex), _is(_StorageInfo)),
                  "storage_meta": _is(md.StorageMeta, type(None)),
                  "version": _is(str, type(None))},
    md.TensorStorageMetadata: {"properties": _is(md.TensorProperties), "size": _is(torch.Size),
                               "chunks": _list_of(_is(md.ChunkStorageMetadata))},
    md.TensorProperties: {"dtype": _is(torch.dtype), "layout": lambda v: v is torch.strided,
                          "requires_grad": _is(bool), "pin_memory": _is(bool),
                          "memory_format": lambda v: v in _FORMATS.values()},
    md.ChunkStorageMetadata: {"offsets": _is(torch.Size), "sizes": _is(torch.Size)},
    md.MetadataIndex: {"fqn": _is(str), "offset": _is(torch.Size, type(None)),
                       "index": _is(int, type(None))},
    _StorageInfo: {"relative_path": _is(str), "offset": _is(int), "length": _is(int),
                   "transform_descriptors": lambda v: v is None or _list_of(_is(str))(v)},
    md.StorageMeta: {"checkpoint_id": _is(str, pathlib.PosixPath, type(None)),
                     "save_id": _is(str, type(None)), "load_id": _is(str, type(None)),
                     "modules": _list_of(_is(str))},
    md.BytesStorageMetadata: {},
}  # fmt: skip


def _size(dims: tuple) -> torch.Size:
    if type(dims) is not tuple or not all(type(d) is int and 0 <= d < 1 << 63 for d in dims):
        raise ValueError(f"a size of {dims!r}")
    return torch.Size(dims)


def _format(value: int) -> md._MEM_FORMAT_ENCODING:
    return md._MEM_FORMAT_ENCODING(value)  # (by value only: with more, Enum makes a class)


def _layout(name: str) -> torch.layout:
    return {"torch.strided": torch.strided}[name]


def _path(*parts: str) -> pathlib.PosixPath:
    if not all(type(p) is str for p in parts):
        raise ValueError("a path of other than strings")
    return pathlib.PosixPath(*parts)


# What REDUCE may call, by the names pickle records: DCP's own few, never what a file names.
_CALLS = {
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
    (md.__name__, "_MEM_FORMAT_ENCODING"): _format,
    ("pathlib", "PosixPath"): _path,  # the checkpoint's id (storage_meta)
    ("pathlib._local", "PosixPath"): _path,  # its name from Python 3.13
}
GLOBALS: dict[tuple[str, str], Any] = {
    **{(kind.__module__, kind.__qualname__): kind for kind in SCHEMA},  # NEWOBJ, then BUILD
    **_CALLS,
    **{("torch", str(v).removeprefix("torch.")): v for v in vars(torch).values()
       if isinstance(v, torch.dtype)},
}  # fmt: skip
_PUSH = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
_ARGUMENT = {"BININT", "BININT1", "BININT2", "LONG1", "SHORT_BINUNICODE", "BINUNICODE"}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}
_REST = {"PROTO", "FRAME", "MARK", "TUPLE", "EMPTY_LIST", "APPEND", "APPENDS", "EMPTY_DICT",
         "SETITEM", "SETITEMS", "MEMOIZE", "BINGET", "LONG_BINGET", "STACK_GLOBAL", "REDUCE",
         "NEWOBJ", "BUILD", "STOP"}  # fmt: skip
OPCODES = frozenset(_PUSH.keys() | _ARGUMENT | _TUPLES.keys() | _REST)


@dataclasses.dataclass(eq=False)
class _New:
    """An instance NEWOBJ announced, which the BUILD that follows makes from its fields."""

    kind: type
    slot: int | None = None  # its memo slot, to hold the built instance instead


def parse(data: bytes, path: Any) -> md.Metadata:
    """The :class:`Metadata` that DCP pickled into ``data`` (the file ``path``, for errors)."""
    if len(data) > MAX_BYTES:
        raise refused(path, f"holds over {MAX_BYTES} bytes of metadata")
    stack: list[Any] = []
    memo: list[Any] = []
    marks: list[int] = []
    ops = pickletools.genops(data)
    while True:
        try:
            op, arg, pos = next(ops)
        except (ValueError, StopIteration) as error:  # truncated, or not a pickle
            raise DcpFailure(f"cannot read {path} (damaged?): {error or 'no STOP'}") from None
        try:
            if op.name == "STOP":
                if len(stack) != 1 or marks or type(stack[0]) is not md.Metadata:
                    raise ValueError("it does not end in one Metadata")
                if pos + 1 != len(data):
                    raise ValueError(f"{len(data) - pos - 1} bytes follow its end")
                return stack[0]
            _step(op.name, arg, stack, memo, marks)
        except _Refusal as error:
            raise refused(path, f"{error} (at byte {pos})") from None
        except (TypeError, ValueError, KeyError, IndexError) as error:
            what = f"{op.name} at byte {pos} fails: {error}"
            raise refused(path, f"is not DCP's metadata: {shown(what)}") from None


class _Refusal(Exception):
    """What the file holds that DCP's metadata never does (:func:`parse` names the file)."""


def _step(name: str, arg: Any, stack: list, memo: list, marks: list[int]) -> None:
    """One opcode on ``stack``: raises :class:`_Refusal` or, for a malformed stream, any
    of the errors :func:`parse` catches."""
    if name not in OPCODES:
        raise _Refusal(f"holds the pickle opcode {name}, which DCP's metadata never uses")
    if name == "MEMOIZE":  # the commonest first
        if type(stack[-1]) is _New:
            stack[-1].slot = len(memo)
        memo.append(stack[-1])
    elif name in ("BINGET", "LONG_BINGET"):
        if type(memo[arg]) in (list, dict):  # DCP shares none: each is checked once
            raise _Refusal(f"shares a {type(memo[arg]).__name__} through the memo")
        stack.append(memo[arg])
    elif name in _PUSH:
        stack.append(_PUSH[name])
    elif name in _ARGUMENT:
        stack.append(arg)
    elif name in ("EMPTY_LIST", "EMPTY_DICT"):
        stack.append([] if name == "EMPTY_LIST" else {})
    elif name == "MARK":
        if len(marks) == MAX_MARKS:
            raise _Refusal(f"nests more than {MAX_MARKS} marks")
        marks.append(len(stack))
    elif name in _TUPLES or name == "TUPLE":
        items = _pop(stack, _TUPLES[name] if name in _TUPLES else len(stack) - marks.pop())
        if len(items) > MAX_TUPLE or any(type(i) is tuple and _holds_tuple(i) for i in items):
            raise _Refusal(f"holds a tuple of {len(items)} items, or tuples 3 deep")
        stack.append(tuple(items))
    elif name in ("APPEND", "SETITEM", "APPENDS", "SETITEMS"):
        count = {"APPEND": 1, "SETITEM": 2}.get(name) or len(stack) - marks.pop()
        items = _pop(stack, count)
        _fill(name, stack[-1], items)
    elif name == "STACK_GLOBAL":
        module, qualname = _pop(stack, 2)
        if (module, qualname) not in GLOBALS:
            text = shown(f"{module}.{qualname}")
            raise _Refusal(f"refers to {text}, which a DCP checkpoint never holds")
        stack.append(GLOBALS[module, qualname])
    elif name in ("REDUCE", "NEWOBJ", "BUILD"):
        stack.append(_make(name, *_pop(stack, 2), memo))
    # PROTO and FRAME (which only groups the opcodes) change nothing


def _pop(stack: list, count: int) -> list:
    if not 0 <= count <= len(stack):
        raise IndexError(f"{count} items asked of a stack of {len(stack)}")
    items = stack[len(stack) - count :]
    del stack[len(stack) - count :]
    return items


def _holds_tuple(items: tuple) -> bool:
    return any(type(i) is tuple for i in items)


def _fill(name: str, target: Any, items: list) -> None:
    """APPEND(S) ``items`` to a list, or SETITEM(S) them (key, value, ...) into a dict."""
    if name.startswith("APPEND") and type(target) is list:
        target.extend(items)
    elif name.startswith("SETITEM") and type(target) is dict and len(items) % 2 == 0:
        keys = items[::2]
        for key in keys:
            if type(key) not in (str, md.MetadataIndex):
                raise _Refusal(f"keys a dict by {_named(key)}")
        target.update(zip(keys, items[1::2], strict=True))
    else:
        raise _Refusal(f"applies {name} to {_named(target)}")


def _make(name: str, callee: Any, args: Any, memo: list) -> Any:
    """REDUCE (one of :data:`_CALLS`), NEWOBJ (a type of :data:`SCHEMA`) or BUILD (its fields)."""
    if name == "REDUCE" and any(callee is call for call in _CALLS.values()):
        if type(args) is tuple:
            return callee(*args)
    elif name == "NEWOBJ" and type(callee) is type and callee in SCHEMA and args == ():
        return callee() if callee is md.BytesStorageMetadata else _New(callee)
    elif name == "BUILD" and type(callee) is _New:
        built = callee.kind(**_fields(callee.kind, args))
        if callee.slot is not None:  # what the memo hands out from now on
            memo[callee.slot] = built
        return built
    raise _Refusal(f"applies {name} to {_named(callee)}, which DCP's metadata never does")


def _fields(kind: type, state: Any) -> dict[str, Any]:
    """The fields of ``kind`` that BUILD's ``state`` gives, each checked by :data:`SCHEMA`."""
    if kind is md.TensorProperties and type(state) is tuple and len(state) == 5:
        dtype, layout, grad, encoding, pinned = state  # its __getstate__'s tuple
        state = {"dtype": dtype, "layout": layout, "requires_grad": grad,
                 "memory_format": _FORMATS[encoding], "pin_memory": pinned}  # fmt: skip
    if type(state) is not dict:
        raise _Refusal(f"builds a {kind.__qualname__} from {_named(state)}")
    for key, value in state.items():
        if key not in SCHEMA[kind] or not SCHEMA[kind][key](value):
            raise _Refusal(f"builds a {kind.__qualname__} whose {shown(str(key))} is not DCP's")
    return state


def _named(value: Any) -> str:
    """``value`` as a refusal names it: the global it is, or its type."""
    names = [".".join(key) for key, known in GLOBALS.items() if known is value]
    return names[0] if names else f"a {type(value).__name__}"


def shown(text: str) -> str:
    """A name from the file as it may be printed: no control characters, not too long."""
    return text[:120] if text.isprintable() else ascii(text[:120])


def refused(path: Any, what: str) -> Refused:
    """The refusal of the checkpoint whose metadata is ``path``, for holding ``what``."""
    return Refused(f"checkpoint {path} {what}: refusing to read it; {REMEDY}")
