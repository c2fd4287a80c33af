"""What a captured model runs as: an ``nn.Sequential`` of units that ``Pipe`` already takes.

A unit is one piece of the model's own computation (a block, or what comes before or after
the blocks), held as a ``torch.fx`` graph with the parameters and buffers it uses registered
under the original model's names. Units pass one tuple from each to the next: every value
that crosses the cut (hidden states, masks, position ids, rotary cos/sin, residuals), so a
stage boundary can fall between any two units. The first unit takes the model's inputs; the
last returns the model's own output structure (e.g. a Hugging Face ``ModelOutput``).

A unit holds one graph per mode, ``train()`` and ``eval()``, captured from the model in that
mode (dropout and batch norm are fixed into the graph by capture).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from gpipe.frontend.shapes import InputShapes

__all__ = ["CapturedModel", "Unit", "UnitGraph", "tensor_names"]


@dataclass
class UnitGraph:
    """One mode's graph of a unit, and how its tuple in and out is laid out."""

    graph: fx.Graph
    int_inputs: frozenset[int] = frozenset()  # slots carried as 0-d tensors, ints inside
    int_outputs: frozenset[int] = frozenset()
    in_spec: Any = None  # first unit: the model's (args, kwargs) structure
    out_spec: Any = None  # last unit: the model's output structure
    shapes: InputShapes = field(default_factory=InputShapes)  # first unit: what export assumed

    def __deepcopy__(self, memo: dict) -> UnitGraph:  # specs and shapes do not change: shared
        return UnitGraph(
            copy.deepcopy(self.graph, memo), self.int_inputs, self.int_outputs,
            self.in_spec, self.out_spec, self.shapes,
        )  # fmt: skip


class Unit(nn.Module):
    """One piece of a captured model. ``forward(carried) -> carried`` (see the module doc)."""

    def __init__(
        self,
        name: str,
        holder: nn.Module,
        graphs: dict[bool, UnitGraph],
        capture_device: torch.device,
    ) -> None:
        super().__init__()
        # The holder's children become this unit's, so parameter names are the model's.
        for child_name, child in holder.named_children():
            self.add_module(child_name, child)
        for pname, p in holder.named_parameters(recurse=False):
            self.register_parameter(pname, p)
        for bname, b in holder.named_buffers(recurse=False):
            persistent = bname not in holder._non_persistent_buffers_set
            self.register_buffer(bname, b, persistent=persistent)
        self.unit_name = name
        self._graphs = graphs
        self._compiled: dict[tuple[bool, torch.device], Any] = {}
        self._capture_device = capture_device
        # A graph that names a dtype (casts, checks) runs only with the dtype it was captured in.
        self._capture_dtype = _floating_dtype(self) if _names_a_dtype(graphs) else None

    def __repr__(self) -> str:  # one line: the holder modules are plain containers
        params = sum(p.numel() for p in self.parameters())
        return f"Unit({self.unit_name!r}, {params:,} parameters)"

    def forward(self, carried: Any) -> Any:
        graph = self._graphs[self.training]
        if graph.in_spec is not None:
            flat = _flatten_inputs(carried, graph.in_spec, self.unit_name)
            graph.shapes.check(flat, graph.in_spec)
        else:
            flat = list(carried) if isinstance(carried, tuple) else [carried]
            flat = [int(v) if i in graph.int_inputs else v for i, v in enumerate(flat)]
        out = self._code(graph, _device_of(self, flat))(self, *flat)
        if graph.out_spec is not None:
            return pytree.tree_unflatten(list(out), graph.out_spec)
        return tuple(
            torch.tensor(v, dtype=torch.int64) if i in graph.int_outputs else v
            for i, v in enumerate(out)
        )

    def _code(self, graph: UnitGraph, device: torch.device) -> Any:
        # The graph's code runs as a method of this unit: ``self.<name>`` reads the unit's
        # tensors and modules as they are now (moved, tied copies, deferred batch norm).
        dtype = _floating_dtype(self) if self._capture_dtype is not None else None
        if dtype != self._capture_dtype:
            raise TypeError(
                f"unit {self.unit_name!r} was captured with {self._capture_dtype} tensors and "
                f"now holds {dtype}: the captured graph fixes its dtypes (casts, checks); cast "
                f"the model first (model.to({dtype})) and capture it again, or use "
                "torch.autocast for mixed precision"
            )
        key = (self.training, device)
        if key not in self._compiled:
            g = graph.graph
            if device != self._capture_device:
                g = _retarget(g, self._capture_device, device)
            code = g.python_code(root_module="self")
            namespace = dict(code.globals)
            exec(compile(code.src, f"<gpipe unit {self.unit_name}>", "exec"), namespace)
            self._compiled[key] = namespace["forward"]
        return self._compiled[key]

    @property
    def capture_device(self) -> torch.device:
        """The device the graphs were captured for (their branches are that device's)."""
        return self._capture_device

    def boundary(self, side: str) -> list[tuple[str, ...]]:
        """What this unit takes (``side="in"``) or gives (``"out"``) in each mode: the names
        of the carried values and which are integers; two captures agree on a cut iff the
        units on either side agree on it."""
        found = []
        for training in (True, False):
            graph = self._graphs[training]
            if side == "in":
                names = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
                found.append((*names, *map(str, sorted(graph.int_inputs))))
            else:
                (out,) = [n for n in graph.graph.nodes if n.op == "output"]
                names = [getattr(v, "name", repr(v)) for v in out.args[0]]
                found.append((*names, *map(str, sorted(graph.int_outputs))))
        return found

    def use_graphs(self, other: Unit) -> None:
        """Run ``other``'s graphs (the same unit, captured for another device)."""
        self._graphs = other._graphs
        self._capture_device = other._capture_device
        self._compiled = {}

    def __getstate__(self):  # the compiled code is rebuilt on demand, never pickled
        return {**self.__dict__, "_compiled": {}}


class CapturedModel(nn.Sequential):
    """The units of a captured model, in order; what ``Pipe`` trains.

    ``tied`` lists the parameters that two units use (GPT-2's ``wte``/``lm_head``), in
    ``Pipe``'s ``tied=`` form; ``original_name`` turns a unit-qualified name
    (``"3.model.layers.2.mlp.up_proj.weight"``) back into the model's own.
    """

    def __init__(self, *units: Unit, tied: list[tuple[str, ...]] = (), split: list[str] = ()):
        super().__init__(*units)
        self.tied = list(tied)
        self.split = list(split)
        self.origin = None  # a gpipe.frontend.weights.Origin when captured on meta
        self.source = None  # (model, example, split, dynamic): to capture again elsewhere
        self.inference_only = False  # captured in eval() only: a Pipe of it refuses to train
        self.order: dict[str, int] = {}  # a tensor's name -> its place in the model's order

    @staticmethod
    def original_name(name: str) -> str:
        return name.split(".", 1)[1]

    def extra_repr(self) -> str:
        return f"units={len(self)}, tied={self.tied}"


def tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each of ``model``'s parameters and buffers, by ``id`` (tied: several)."""
    names: dict[int, list[str]] = {}
    for name, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(t), []).append(name)
    return names


def _flatten_inputs(inputs: Any, in_spec: Any, unit: str) -> list[Any]:
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    if not isinstance(args, tuple):
        args = (args,)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    if spec != in_spec:
        raise TypeError(
            f"the inputs of the captured model do not have the structure of its example: "
            f"got {spec}, captured with {in_spec}; pass the same tuple (or dict) of tensors as "
            f"the example given to capture"
        )
    return leaves


def _names_a_dtype(graphs: dict[bool, UnitGraph]) -> bool:
    return any(
        isinstance(value, torch.dtype) and value.is_floating_point
        for g in graphs.values()
        for node in g.graph.nodes
        for value in pytree.tree_leaves((node.args, node.kwargs))
    )


def _floating_dtype(unit: nn.Module) -> torch.dtype | None:
    for t in (*unit.parameters(), *unit.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def _device_of(unit: nn.Module, flat: list[Any]) -> torch.device:
    for t in unit.parameters():
        return t.device
    for t in unit.buffers():
        return t.device
    for t in flat:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _retarget(graph: fx.Graph, old: torch.device, new: torch.device) -> fx.Graph:
    """A copy of ``graph`` whose tensor factories and device checks name ``new``."""
    copy = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = copy.graph_copy(graph, env)
    copy.output(out)

    def swap(value: Any) -> Any:
        return new if isinstance(value, torch.device) and value == old else value

    for node in copy.nodes:
        node.args = pytree.tree_map(swap, node.args)
        node.kwargs = pytree.tree_map(swap, node.kwargs)
    return copy
