"""The input shapes a captured graph assumed, checked on every input before it runs.

``torch.export`` keeps a dimension dynamic only within the range its guards allow: a forward
that branches on a size (``if x.shape[1] > 8``) is captured for one side, the size's range
narrowed to that side (the exported program's ``range_constraints``), and a dimension it had to
fix is a number. Replaying the graph on a size outside is silently wrong (the other branch was
never captured), so the first unit checks its inputs against :class:`InputShapes` on every
call (a few integer comparisons per micro-batch): every fixed size, every range, and equal sizes
where export found them equal (one symbol). As in ``torch.export``'s own check, a size of 0 or 1
passes a range whose lower end is 2 (export assumes sizes >= 2 only to avoid specializing).

Some assumptions are no range: a state-space mixer that pads the length to a multiple of its
chunk and was captured with one chunk assumed ``(length + pad) // chunk == 1``, and a longer
input would fail deep inside the graph (or, worse, not fail). Export keeps every such guard as
Python over the inputs' sizes (``ExportedProgram._guards_code``); they are compiled once into
one function of the flat inputs and checked too, the verdict cached per shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["InputShapes"]

_INFINITE = 2**62  # int_oo and friends, as an int
_SIZE = re.compile(r"T\[(\d+)\]\.size\(\)\[(\d+)\]")


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

    def __init__(self, dims: Sequence[_Dim] = (), guards: Sequence[str] = ()) -> None:
        self.dims = list(dims)
        self.guards = list(guards)  # Python over ``T``, the flat inputs
        self._first_broken: Callable[[list], int | None] | None = None
        self._verdicts: dict[tuple, int | None] = {}  # the inputs' shapes -> a broken guard

    @classmethod
    def of(
        cls,
        inputs: Sequence[fx.Node],
        ranges: dict[Any, Any],
        guards: Sequence[str] = (),
        sources: Sequence[str] = (),
    ) -> InputShapes:
        """From the exported graph's input placeholders, its ``range_constraints`` and its
        ``guards`` (export's code over ``sources``: ``L['input_ids']``, one per input)."""
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
        named = sorted(((i, s) for i, s in enumerate(sources) if s), key=lambda n: -len(n[1]))
        ours = []
        for guard in guards:
            for i, source in named:
                guard = guard.replace(source, f"T[{i}]")
            if "L[" not in guard:  # every input it reads is one of ours
                ours.append(guard)
        return cls(dims, ours)

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
        if self.guards:
            self._check_guards(flat, in_spec)

    def _check_guards(self, flat: Sequence[Any], in_spec: Any) -> None:
        key = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in flat)
        if key not in self._verdicts:
            if self._first_broken is None:
                code = "".join(
                    f"    if not ({g}):\n        return {i}\n" for i, g in enumerate(self.guards)
                )
                namespace: dict[str, Any] = {"math": math, "max": max, "min": min}
                exec(
                    compile(f"def first_broken(T):\n{code}    return None\n", "<guards>", "exec"),
                    namespace,
                )
                self._first_broken = namespace["first_broken"]
            if len(self._verdicts) > 256:  # shapes that change every step: bounded
                self._verdicts.clear()
            self._verdicts[key] = self._first_broken(list(flat))
        broken = self._verdicts[key]
        if broken is not None:
            guard = self.guards[broken]
            sizes = sorted({(int(i), int(d)) for i, d in _SIZE.findall(guard)})
            where = ", ".join(
                f"{_name(i, in_spec)} dimension {d} = {flat[i].shape[d]}" for i, d in sizes
            )
            readable = _SIZE.sub(
                lambda m: f"{_short(int(m.group(1)), in_spec)}.shape[{m.group(2)}]", guard
            )
            readable = readable if len(readable) <= 160 else readable[:157] + "..."
            raise ValueError(
                f"{where or 'the inputs'}: the model was captured assuming {readable} (its "
                "forward branched on these sizes; export kept that branch), which these inputs "
                "break, so the graph would not compute what the model does. Capture again with "
                "an example of these sizes, or pad the inputs to sizes the capture allows"
            )

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


def _short(index: int, in_spec: Any) -> str:
    """``input_ids`` for a keyword input, ``inputs[0]`` for a positional one."""
    name = _name(index, in_spec)
    if name.startswith("input '"):
        return name[len("input '") : -1]
    return f"inputs[{name.split()[1]}]" if name.endswith("(positional)") else name


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
