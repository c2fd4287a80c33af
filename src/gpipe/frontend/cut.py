"""Cut one exported graph into units at named modules, carrying what crosses each cut.

Every node of the graph belongs to one unit, by position: a unit starts where a split module's
first node is (nodes before the first split module form a unit of their own, as do nodes after
the last one). A value defined in one unit and used in a later one is carried through every
cut in between, in graph order, so that each unit's tuple in holds everything it and the
units after it need. Parameters and buffers are not carried: each unit registers those it
reads, under the model's own names (a parameter two units read is reported as tied).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from gpipe.frontend.shapes import InputShapes
from gpipe.frontend.units import UnitGraph, tensor_names

__all__ = ["CaptureError", "Piece", "cut_graph", "module_path"]


class CaptureError(RuntimeError):
    """A model that cannot be captured or cut where asked; the message says what to do."""


@dataclass
class Piece:
    """One unit of one mode: its graph and the tensors and modules it reads."""

    name: str
    graph: UnitGraph
    tensors: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)  # kind, tensor
    modules: dict[str, nn.Module] = field(default_factory=dict)
    reads: dict[int, str] = field(default_factory=dict)  # id(tensor) -> name, for ties


def module_path(node: fx.Node) -> str:
    """The path of the innermost module a node ran in ("" at the top)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return ".".join(part.split("@")[0] for part in path.split("."))


def _within(node: fx.Node, path: str) -> bool:
    inner = module_path(node)
    return inner == path or inner.startswith(path + ".")


def keep_as_calls(
    gm: fx.GraphModule, model: nn.Module, paths: Sequence[str], hooked: dict[str, str]
) -> None:
    """Replace each module's inlined operations by one call of the module itself (batch
    norm: so that ``eval()`` and deferred batch norm act on it as on the original; a module
    with forward hooks: so that they run, ``hooked`` naming them for an error)."""
    graph = gm.graph
    outer: list[str] = []  # a module inside one kept already is in its call
    for path in sorted(paths, key=lambda p: p.count(".") if p else -1):
        if any(path.startswith(o + ".") for o in outer):
            continue
        outer.append(path)
        inside = [n for n in graph.nodes if n.op == "call_function" and _within(n, path)]
        if not inside:
            if path in hooked:
                raise CaptureError(
                    f"{hooked[path]}: the module does no work of its own in the captured "
                    f"{'train' if model.training else 'eval'} graph, so the hook would not run; "
                    "register it on a module that computes"
                )
            continue
        members = set(inside)
        sources = {
            a
            for n in inside
            for a in n.all_input_nodes
            if a not in members and not (a.op == "placeholder" and a.meta.get("gpipe_attr"))
        }
        results = [n for n in inside if any(u not in members for u in n.users)]
        if len(sources) != 1 or len(results) != 1 or len(_calls(inside, path)) > 1:
            said = hooked.get(path, f"module {path} ({type(model.get_submodule(path)).__name__})")
            raise CaptureError(
                f"{said}: the module takes {len(sources)} values and gives {len(results)} in "
                "the captured graph (or runs twice); gpipe keeps it as one call (to run its "
                "hooks) only with one input and one output"
                + ("; remove the hook, or register it on such a module" if path in hooked else "")
            )
        (source,), (result,) = sources, results
        with graph.inserting_before(inside[0]):
            call = graph.create_node("call_module", path, (source,))
        call.meta = dict(result.meta)
        result.replace_all_uses_with(call)
        for n in reversed(inside):
            graph.erase_node(n)


def _calls(nodes: list[fx.Node], path: str) -> set[str]:
    """The distinct calls of module ``path`` that ``nodes`` ran in (export marks a second
    call of a module ``path@1``)."""
    return {
        raw
        for n in nodes
        for raw, _ in (n.meta.get("nn_module_stack") or {}).values()
        if ".".join(part.split("@")[0] for part in raw.split(".")) == path
    }


def cut_graph(
    ep: ExportedProgram,
    gm: fx.GraphModule,
    model: nn.Module,
    split: Sequence[str],
    sources: Sequence[str] = (),
) -> list[Piece]:
    """The units of ``gm`` (``ep``'s graph, maybe with modules kept as calls); ``sources``:
    export's name of each input (``L['input_ids']``), for its guards."""
    inputs, attrs, mutations, results = _signature(ep, gm)
    body = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "get_attr")]
    unit_of, names = _assign(body, split)
    count = len(names)
    live = _carried(gm, inputs, body, unit_of, results, names)
    reads = _Reads(ep, gm, model, attrs, mutations, _aliases(model))
    pieces = []
    for u in range(count):
        carried_in = inputs if u == 0 else live[u]
        piece, g, env = reads.copy(names[u], [n for n in body if unit_of[n] == u], carried_in)
        if u == count - 1:
            g.output(tuple(env[a] if isinstance(a, fx.Node) else a for a in results))
            piece.graph.out_spec = ep.call_spec.out_spec
        else:
            g.output(tuple(env[v] for v in live[u + 1]))
            piece.graph.int_outputs = _int_slots(live[u + 1])
        if u == 0:
            piece.graph.in_spec = ep.call_spec.in_spec
            guards = getattr(ep, "_guards_code", None) or ()
            piece.graph.shapes = InputShapes.of(inputs, ep.range_constraints, guards, sources)
        else:
            piece.graph.int_inputs = _int_slots(carried_in)
        g.lint()
        pieces.append(piece)
    return pieces


def _signature(ep: ExportedProgram, gm: fx.GraphModule):
    """The user's inputs, the tensor inputs (parameters, buffers, constants) by node, the
    buffers written (node name -> buffer), and the user's outputs."""
    signature = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = dict(zip(placeholders, signature.input_specs, strict=True))
    inputs = [n for n in placeholders if specs[n].kind == InputKind.USER_INPUT]
    attrs = {n: specs[n] for n in placeholders if specs[n].kind != InputKind.USER_INPUT}
    mutations = {
        s.arg.name: s.target for s in signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION
    }
    unsupported = [
        s.kind.name
        for s in signature.output_specs
        if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION)
    ]
    if unsupported:
        raise CaptureError(f"the captured graph has outputs gpipe cannot carry: {unsupported}")
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = [
        a
        for a, s in zip(output.args[0], signature.output_specs, strict=True)
        if s.kind == OutputKind.USER_OUTPUT
    ]
    return inputs, attrs, mutations, results


def _carried(
    gm: fx.GraphModule,
    inputs: list[fx.Node],
    body: list[fx.Node],
    unit_of: dict[fx.Node, int],
    results: list,
    names: list[str],
) -> list[list[fx.Node]]:
    """Per cut c (before unit c), the values it carries, in graph order: defined before it,
    used at or after it (the output counts as the last unit); each must be carriable."""
    count = len(names)
    defined = {n: 0 for n in inputs} | {n: unit_of[n] for n in body}
    last_use: dict[fx.Node, int] = {}
    for n in body:
        for a in n.all_input_nodes:
            if a in defined:
                last_use[a] = max(last_use.get(a, -1), unit_of[n])
    for a in results:
        if isinstance(a, fx.Node):
            last_use[a] = count - 1
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    live = [
        sorted((v for v in defined if defined[v] < c <= last_use.get(v, -1)), key=order.get)
        for c in range(count + 1)
    ]
    for c in range(1, count):
        for v in live[c]:
            if not _carriable(v):
                raise CaptureError(
                    f"the value {v.name} ({type(v.meta.get('val')).__name__}, made in "
                    f"{module_path(v) or 'the model forward'}) crosses the cut before "
                    f"{names[c]}; gpipe carries tensors and integers only: cut elsewhere"
                )
    return live


@dataclass
class _Reads:
    """What a unit's copied nodes read of the model: its tensors under the model's names,
    its kept modules, its subgraphs, and the buffers it writes."""

    ep: ExportedProgram
    gm: fx.GraphModule
    model: nn.Module
    attrs: dict
    mutations: dict[str, str]
    aliases: dict[str, list[str]]

    def copy(self, name: str, nodes: list[fx.Node], carried_in: list[fx.Node]):
        """A new graph of ``nodes`` taking ``carried_in``: (piece, graph, node map)."""
        gm, attrs = self.gm, self.attrs
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for v in carried_in:
            env[v] = g.placeholder(v.name)
            env[v].meta = dict(v.meta)
        piece = Piece(name, UnitGraph(g))
        for n in nodes:
            for a in n.all_input_nodes:
                if a in attrs and a not in env:
                    env[a] = self._tensor_read(piece, g, attrs[a], n)
            if n.op == "call_module":
                piece.modules[n.target] = self.model.get_submodule(n.target)
            env[n] = g.node_copy(n, env.__getitem__)
            if n.op == "get_attr":  # a subgraph of a higher-order op (a no_grad region)
                env[n].target = _subgraph(piece, gm.get_submodule(n.target))
            if n.name in self.mutations:
                target = _name_for_buffer(self.mutations[n.name], piece, self.model, g, env)
                g.call_function(torch.Tensor.copy_, (target, env[n]))
        return piece, g, env

    def _tensor_read(self, piece: Piece, g: fx.Graph, spec, user: fx.Node) -> fx.Node:
        name = _name_for(spec, user, self.aliases)
        tensor = _tensor(self.ep, self.model, spec)
        persistent = spec.kind == InputKind.PARAMETER or bool(spec.persistent)
        label = "parameter" if spec.kind == InputKind.PARAMETER else "buffer"
        piece.tensors[name] = (label if persistent else "constant", tensor)
        piece.reads[id(tensor)] = name
        return g.get_attr(name)


def _assign(body: list[fx.Node], split: Sequence[str]) -> tuple[dict[fx.Node, int], list[str]]:
    """Each node's unit, and the units' names."""
    first, last = {}, {}
    for i, n in enumerate(body):
        for k, path in enumerate(split):
            if _within(n, path):
                first.setdefault(k, i)
                last[k] = i
    missing = [p for k, p in enumerate(split) if k not in first]
    if missing:
        raise CaptureError(
            f"split modules {missing} do no work in the captured forward (never called, or "
            "called with no operation of their own); name modules that the forward runs"
        )
    for k in range(1, len(split)):
        if first[k] <= last[k - 1]:
            raise CaptureError(
                f"the model runs {split[k]} before {split[k - 1]} has finished (their "
                "operations interleave in the forward), so no cut can separate them; split at "
                "modules that run one after the other, e.g. their common parent's children"
            )
    has_pre = first[0] > 0 and any(_does_work(n) for n in body[: first[0]])
    has_post = any(_does_work(n) for n in body[last[len(split) - 1] + 1 :])
    starts = [first[k] for k in range(len(split))]
    unit_of = {}
    for i, n in enumerate(body):
        k = sum(1 for s in starts if s <= i) - 1  # the split module whose run we are in
        if k < 0:
            u = 0
        elif has_post and i > last[len(split) - 1]:
            u = len(split) + int(has_pre)
        else:
            u = k + int(has_pre)
        unit_of[n] = u
    names = [*([f"before {split[0]}"] if has_pre else []), *split]
    return unit_of, names + ([f"after {split[-1]}"] if has_post else [])


def _does_work(n: fx.Node) -> bool:
    if n.op != "call_function":
        return True
    name = getattr(n.target, "__name__", str(n.target))
    return not ("sym_size" in name or "assert" in name or name == "getitem")


def _carriable(v: fx.Node) -> bool:
    val = v.meta.get("val")
    return isinstance(val, torch.Tensor | torch.SymInt | int) and not isinstance(val, bool)


def _int_slots(values: Sequence[fx.Node]) -> frozenset[int]:
    return frozenset(
        i for i, v in enumerate(values) if not isinstance(v.meta.get("val"), torch.Tensor)
    )


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of a tensor -> all its names (tied weights have several)."""
    return {name: group for group in tensor_names(model).values() for name in group}


def _tensor(ep: ExportedProgram, model: nn.Module, spec) -> torch.Tensor:
    if spec.kind == InputKind.PARAMETER:
        return model.get_parameter(spec.target)
    if spec.kind == InputKind.BUFFER:
        try:
            return model.get_buffer(spec.target)
        except AttributeError:
            return ep.constants[spec.target]
    if spec.target in ep.constants:
        return ep.constants[spec.target]
    raise CaptureError(f"the captured graph reads {spec.target} ({spec.kind.name}), unknown")


def _name_for(spec, user: fx.Node, aliases: dict[str, list[str]]) -> str:
    """The model's name for the tensor as this unit uses it: of two tied names (``wte`` and
    ``lm_head``), the one owned by the module that reads it here."""
    if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
        return "_constants." + spec.target.replace(".", "_")
    path = module_path(user)
    for name in aliases.get(spec.target, ()):
        owner = name.rpartition(".")[0]
        if owner and (path == owner or path.startswith(owner + ".")):
            return name
    return spec.target


def _subgraph(piece: Piece, module: fx.GraphModule) -> str:
    """The unit's name for a subgraph: named by its code, so that the train and eval graphs'
    subgraphs (each export numbers its own from 1) never take each other's place."""
    name = "_subgraph_" + hashlib.sha256(module.code.encode()).hexdigest()[:16]
    piece.modules[name] = module
    return name


def _name_for_buffer(target: str, piece: Piece, model: nn.Module, g: fx.Graph, env) -> fx.Node:
    buffer = model.get_buffer(target)
    name = piece.reads.get(id(buffer), target)
    piece.tensors.setdefault(name, ("buffer", buffer))
    piece.reads[id(buffer)] = name
    return g.get_attr(name)
