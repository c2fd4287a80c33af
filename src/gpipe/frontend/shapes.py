"""The input shapes a captured graph assumed, checked on every input before it runs.

``torch.export`` keeps a dimension dynamic only within the range its guards allow: a forward
that branches on a size (``if x.shape[1] > 8``) is captured for one side, the size's range
narrowed to that side (the exported program's ``range_constraints``), and a dimension it had to
fix is a number. Replaying the graph on a size outside is silently wrong (the other branch was
never captured), so the first unit checks its inputs against :class:`InputShapes` on every
call (a few integer comparisons per micro-batch): every fixed size, every range, and equal sizes
where export found them equal (one symbol). As in ``torch.export``'s own check, a size of 0 or 1
passes a range whose lower end is 2 (export assumes sizes >= 2 only to avoid specializing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["InputShapes"]

_INFINITE = 2**62  # int_oo and friends, as an int


@dataclass(frozen=True)
class _Dim:
    input: int  # position among the flat inputs
    dim: int
    size: int | None  # a fixed size
    symbol: str | None  # export's symbol (s27): dims with one symbol are one size
    low: int = 0
    high: int = _INFINITE


class InputShapes:
    """What a graph assumed of each dimension of its inputs (see the module doc)."""

    def __init__(self, dims: Sequence[_Dim] = ()) -> None:
        self.dims = list(dims)

    @classmethod
    def of(cls, inputs: Sequence[fx.Node], ranges: dict[Any, Any]) -> InputShapes:
        """From the exported graph's input placeholders and its ``range_constraints``."""
        bounds = {
            str(symbol): (_int(r.lower, 0), _int(r.upper, _INFINITE))
            for symbol, r in ranges.items()
        }
        dims = []
        for i, node in enumerate(inputs):
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                continue
            for d, size in enumerate(val.shape):
                fixed = size if isinstance(size, int) else size.node.maybe_as_int()
                if fixed is not None:
                    dims.append(_Dim(i, d, fixed, None))
                    continue
                expr = size.node.expr
                if expr.is_Symbol:  # a derived size (2 * s0) is checked through s0's dims
                    low, high = bounds.get(str(expr), (0, _INFINITE))
                    dims.append(_Dim(i, d, None, str(expr), low, high))
        return cls(dims)

    def check(self, flat: Sequence[Any], in_spec: Any) -> None:
        """Raise ``ValueError`` (the input, the dimension, what was assumed, the remedy) for
        the first input dimension outside what the graph assumed."""
        seen: dict[str, tuple[int, _Dim]] = {}
        for d in self.dims:
            got = flat[d.input].shape[d.dim]
            if d.size is not None:
                if got != d.size:
                    self._refuse(
                        d, got, f"fixed at {d.size} (export could not keep it dynamic)", in_spec
                    )
                continue
            if not (d.low <= got <= d.high) and not (got in (0, 1) and d.low <= 2):
                span = f"at least {d.low}" if d.high >= _INFINITE else f"in [{d.low}, {d.high}]"
                said = f"{span} (the forward branches on this size: export kept that branch)"
                self._refuse(d, got, said, in_spec)
            first = seen.setdefault(d.symbol, (got, d))
            if first[0] != got:
                other = first[1]
                name = _name(other.input, in_spec)
                said = f"equal to dimension {other.dim} of {name} ({first[0]} here)"
                self._refuse(d, got, said, in_spec)

    @staticmethod
    def _refuse(d: _Dim, got: int, assumed: str, in_spec: Any) -> None:
        raise ValueError(
            f"{_name(d.input, in_spec)} has size {got} in dimension {d.dim}, but the model was "
            f"captured with that dimension {assumed}; the graph would not compute what the "
            "model does at this size. Capture again with an example of this size, or keep the "
            "dimension as captured (pad the inputs to a size in the range; a size the model "
            "branches on is best made static)"
        )


def _int(bound: Any, unbounded: int) -> int:
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError):  # int_oo, -int_oo, oo
        return unbounded


def _name(index: int, in_spec: Any) -> str:
    """The name of flat input ``index`` as the caller passed it: ``input_ids``, ``inputs[0]``."""
    if in_spec is None:
        return f"input {index}"
    paths, _ = pytree.tree_flatten_with_path(
        pytree.tree_unflatten([0] * in_spec.num_leaves, in_spec)
    )
    path = paths[index][0]
    if len(path) >= 2 and getattr(path[0], "idx", None) == 1 and hasattr(path[1], "key"):
        return f"input {path[1].key!r}"
    if len(path) >= 2 and getattr(path[0], "idx", None) == 0 and hasattr(path[1], "idx"):
        return f"input {path[1].idx} (positional)"
    return f"input {pytree.keystr(path)}"
