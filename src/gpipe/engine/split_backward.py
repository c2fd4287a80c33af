"""Split one backward pass into B (input gradient) and W (weight gradients).

Zero-bubble schedules (Qi et al., ICLR 2024) run B as soon as the next stage's gradient
arrives, since the previous stage waits for it, and defer W into the bubbles. Running
autograd twice — once for inputs, once for weights — would compute every activation
gradient twice. Instead:

* **B** walks the stage's autograd graph once to find, for each parameter, the
  *intermediates*: the nodes on the path from the outputs to the inputs from which
  the parameter hangs (e.g. the ``AddmmBackward`` of a ``Linear``). It runs
  ``torch.autograd.grad`` for the inputs only — autograd then computes only the
  input-side outputs of every node — while pre-hooks record the gradient arriving at
  each intermediate.
* **W** starts autograd at those intermediates (``GradientEdge``) with the recorded
  gradients, restricted to their parameters: each node computes only its weight-side
  outputs. Parameters are grouped by the intermediates they share so that every group
  is one autograd call.

A stage whose inputs need no gradient (the first stage) has nothing to send back: its
B does nothing and its W is the whole backward.

Known cost: a parameter used at two depths of one stage (a weight applied twice) has two
intermediates, one above the other; W then re-derives the activation gradient between
them. Weights used once — every ordinary layer — cost nothing extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.overrides import has_torch_function

try:  # what torch.autograd.backward calls once it has checked its arguments
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # a private name: other torch versions take the public path
    _engine_run_backward = None

__all__ = ["WeightWork", "backward_input", "backward_weight"]


def _node(tensor: torch.Tensor) -> Node:
    """A tensor's grad_fn, or for a leaf its gradient accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return tensor.view_as(tensor).grad_fn.next_functions[0][0]


@dataclass
class _Group:
    params: list[torch.Tensor]
    intermediates: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)  # recorded in B


@dataclass
class WeightWork:
    """What W needs from B: the graph (kept alive) and the recorded gradients."""

    groups: list[_Group]
    roots: list[torch.Tensor]  # W's start for parameters B never reached (else empty)
    root_grads: list[torch.Tensor | None]
    full: bool = False  # no input needed a gradient: W is the whole backward
    held: list = field(default_factory=list)  # memory-meter tokens of the stage


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: gradients of ``inputs`` from ``roots`` (with ``grads``); W's work for later."""
    params = [p for p in params if p.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted or not roots:
        return [None] * len(inputs), WeightWork([], list(roots), list(grads), full=True)

    # One walk down from the roots: every node's parents, and the leaves' accumulators
    # (found here rather than through a view of each tensor: it runs once per B).
    parents: dict[Node, list[Node]] = {}
    accumulators: dict[int, Node] = {}
    stack = [_node(r) for r in roots]
    visited = set(stack)
    while stack:
        node = stack.pop()
        below = node.next_functions
        if not below:
            variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
            if variable is not None:
                accumulators[id(variable)] = node
            continue
        for child, _ in below:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in visited:
                visited.add(child)
                stack.append(child)

    def node_of(tensor: torch.Tensor) -> Node | None:
        if tensor.grad_fn is not None:
            return tensor.grad_fn
        return accumulators.get(id(tensor))  # None: the graph does not use this leaf

    # Nodes B executes: those from which an input's accumulator can be reached, i.e.
    # the inputs' ancestors.
    on_input_path: set[Node] = set()
    frontier = [n for n in map(node_of, wanted) if n is not None]
    while frontier:
        node = frontier.pop()
        if node not in on_input_path:
            on_input_path.add(node)
            frontier.extend(parents.get(node, ()))

    # Climb from each parameter towards the roots; stop at the first input-path nodes.
    groups: dict[Node, _Group] = {}
    unreached = []
    for param in params:
        accumulator = node_of(param)
        if accumulator not in parents:
            continue  # not used by this micro-batch's graph
        found, seen, frontier = set(), {accumulator}, [accumulator]
        while frontier:
            node = frontier.pop()
            for parent in parents.get(node, ()):
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in on_input_path:
                    found.add(parent)
                else:
                    frontier.append(parent)
        if not found:
            unreached.append(param)  # hangs only from outputs that do not reach inputs
            continue
        shared = [groups[n] for n in found if n in groups]
        group = _merge(shared, param, found)
        for node in group.intermediates:
            groups[node] = group
    unique = list({id(g): g for g in groups.values()}.values())

    handles = []
    for group in unique:
        for node in group.intermediates:

            def record(grad_outputs, group=group, node=node):
                group.grads[node] = grad_outputs

            handles.append(node.register_prehook(record))
    try:
        pairs = [(r, g) for r, g in zip(roots, grads, strict=True)]
        computed = torch.autograd.grad(
            [r for r, _ in pairs],
            wanted,
            [g for _, g in pairs],
            retain_graph=True,
            allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), computed, strict=True))
    grad_inputs = [by_input.get(id(t)) for t in inputs]
    # The intermediates keep the graph below them alive; what lies above them (e.g. the
    # loss and its softmax) is freed now unless W must start from the roots, as the
    # peer's detach of the stage outputs does.
    work = WeightWork(unique, [], [])
    if unreached:
        # Parameters feeding only outputs that do not depend on the inputs: W runs
        # autograd from the roots for them (B never touched those nodes).
        work.groups.append(_Group(unreached, []))
        work.roots, work.root_grads = list(roots), list(grads)
    return grad_inputs, work


def _merge(shared: list[_Group], param: torch.Tensor, found: set[Node]) -> _Group:
    group = _Group([param], list(found))
    for other in {id(g): g for g in shared}.values():
        group.params = other.params + group.params
        group.intermediates = list(dict.fromkeys(other.intermediates + group.intermediates))
    return group


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameters' gradients into ``.grad``."""
    if work.full:
        pairs = [(r, g) for r, g in zip(work.roots, work.root_grads, strict=True)]
        if pairs:
            torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        return
    # Each group's recorded gradients are released as soon as its call is done: the
    # allocator then hands that memory straight to the next group's products. Holding
    # them all to the end made W 10–20% slower on CPU (benchmarks/split_backward.py).
    groups, work.groups = work.groups, []
    groups.reverse()
    roots, root_grads = work.roots, work.root_grads
    while groups:
        group = groups.pop()
        if group.intermediates:
            edges, grad_outputs = [], []
            for node in group.intermediates:
                for index, grad in enumerate(group.grads.get(node, ())):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grad_outputs.append(grad)
        else:
            edges, grad_outputs = list(roots), list(root_grads)
        handles = []
        if len(group.intermediates) > 1:
            # One intermediate may lie below another: the gradient flowing into it is
            # the one recorded in B, not that plus what arrives from above.
            for node in group.intermediates:
                recorded = group.grads.get(node)
                if recorded is not None:
                    handles.append(node.register_prehook(lambda _, saved=recorded: saved))
        params, group.grads = group.params, {}
        del group
        try:
            if edges:
                _accumulate(edges, grad_outputs, params)
        finally:
            for handle in handles:
                handle.remove()
        del edges, grad_outputs, handles
    work.roots.clear()
    work.root_grads.clear()


def _accumulate(edges: list[GradientEdge], grads: list[torch.Tensor], params: list) -> None:
    """One group's autograd call. Accumulated by autograd itself, so .grad hooks (e.g. data
    parallelism's bucket reduction) see it as after any backward."""
    if _engine_run_backward is None or has_torch_function(params):
        torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
        return
    # The engine directly: B recorded these gradients from these very nodes, so the
    # public call's checks of each gradient against its edge's metadata (about 40 us per
    # group, 5 % of W for a small micro-batch) have nothing to find.
    _engine_run_backward(
        tuple(edges),
        tuple(grads),
        True,  # retain_graph: later groups start below this one
        False,  # create_graph
        tuple(params),
        allow_unreachable=True,
        accumulate_grad=True,
    )
