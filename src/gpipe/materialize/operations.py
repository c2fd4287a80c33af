"""An aten operation as the recorder (``gpipe.materialize.record``) reads it, for each of the
tens of thousands of operations that build a large model: the facts of its schema, asked once
per operation, and pytree's flatten and map for its arguments and results. Those are plain
lists, tuples and dicts, which a direct walk handles at a fraction of pytree's generic cost (its
per-node type lookups were half of a record); any other container (``torch.Size``, a
namedtuple) goes to pytree itself, so that the results are pytree's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map

__all__ = ["Info", "info_of", "leaves", "map_leaves", "written_by"]


@dataclass(frozen=True, slots=True)
class Info:
    """What the recorder asks of an operation's schema, asked once per operation."""

    name: str  # without "aten::"
    random: bool
    dtype_kwarg: bool  # takes a keyword-only dtype
    writes: tuple[tuple[int, str, bool], ...]  # (position, name, keyword-only) of Tensor(a!)


_INFOS: dict[Any, Info] = {}


def info_of(func: Any) -> Info:
    info = _INFOS.get(func)
    if info is None:
        schema = func._schema
        writes = tuple(
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        info = _INFOS[func] = Info(
            schema.name.removeprefix("aten::"),
            torch.Tag.nondeterministic_seeded in func.tags,
            any(a.name == "dtype" and a.kwarg_only for a in schema.arguments),
            writes,
        )
    return info


def written_by(info: Info, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments the schema says the operation writes (``Tensor(a!)``)."""
    found = []
    for i, name, kwarg_only in info.writes:
        value = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        found += [t for t in leaves(value) if isinstance(t, torch.Tensor)]
    return found


def leaves(tree: Any) -> list:
    """pytree's ``tree_flatten(tree)[0]``."""
    kind = type(tree)
    if kind is tuple or kind is list:
        return [leaf for x in tree for leaf in leaves(x)]
    if kind is dict:
        return [leaf for x in tree.values() for leaf in leaves(x)]
    if kind in SUPPORTED_NODES or isinstance(tree, (tuple, dict)):
        return tree_flatten(tree)[0]
    return [tree]


def map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
    """pytree's ``tree_map(fn, tree)``."""
    kind = type(tree)
    if kind is tuple:
        return tuple(map_leaves(fn, x) for x in tree)
    if kind is list:
        return [map_leaves(fn, x) for x in tree]
    if kind is dict:
        return {k: map_leaves(fn, x) for k, x in tree.items()}
    if kind in SUPPORTED_NODES or isinstance(tree, (tuple, dict)):
        return tree_map(fn, tree)
    return fn(tree)
