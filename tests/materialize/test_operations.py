"""An operation as the recorder reads it: pytree's results by a cheaper walk, schema facts."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from gpipe.materialize.operations import info_of, leaves, map_leaves, written_by

Pair = namedtuple("Pair", "a b")
T = torch.zeros(2)
TREES = [
    T,
    None,
    (T, 3, [T, None], {"out": T, "dtype": torch.float16}),
    [torch.Size([2, 3]), Pair(T, (1.5, T)), OrderedDict(x=[T])],
    ((), [], {}, "text", torch.device("meta"), torch.float32),
]


def test_leaves_and_map_are_pytree_s():
    def tag(x):
        return ("leaf", x) if isinstance(x, torch.Tensor) else x

    for tree in TREES:
        assert _same(leaves(tree), tree_flatten(tree)[0])
        mapped, expected = map_leaves(tag, tree), tree_map(tag, tree)
        assert type(mapped) is type(expected) and _same(leaves(mapped), leaves(expected))
        assert repr(tree_flatten(mapped)[1]) == repr(tree_flatten(expected)[1])


def test_schema_facts():
    aten = torch.ops.aten
    uniform = info_of(aten.uniform_.default)
    assert (uniform.name, uniform.random) == ("uniform_", True)
    assert uniform.writes == ((0, "self", False),)
    empty = info_of(aten.empty.memory_format)
    assert (empty.random, empty.dtype_kwarg, empty.writes) == (False, True, ())
    assert info_of(aten.uniform_.default) is uniform  # asked once
    add_out = info_of(aten.add.out)
    a, b, out = torch.zeros(1), torch.ones(1), torch.empty(1)
    assert written_by(add_out, (a, b), {"out": out})[0] is out


def _same(xs: list, ys: list) -> bool:
    return len(xs) == len(ys) and all(x is y or x == y for x, y in zip(xs, ys, strict=True))
