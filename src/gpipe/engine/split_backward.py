"""Split one backward pass into B (input gradient) and W (weight gradients), exact by
construction.

Zero-bubble schedules (Qi et al., ICLR 2024) run B as soon as the next stage's gradient
arrives, since the previous stage waits for it, and defer W into the bubbles. Running
autograd twice — once for inputs, once for weights — would compute every activation
gradient twice. Instead, with *S* the nodes of the stage's autograd graph from which an
input can be reached (exactly the nodes autograd runs for the input gradient):

* **B** walks the graph once — every node's parents, every leaf's gradient accumulator —
  and runs ``torch.autograd.grad`` for the inputs only, while pre-hooks record the
  gradient arriving at the *starts*: the nodes of S directly above a node outside S (e.g.
  the ``AddmmBackward`` of a ``Linear``, above its weight's ``TBackward``).
* **W** delivers every leaf that requires grad and that the graph reaches: the leaves are
  those the walk met (the ``AccumulateGrad`` nodes' variables), not a list of parameters,
  so a loss's own parameters, or the user's input on the first stage, are not missed.
  For each leaf, every path up from it leaves the nodes outside S at a start, or ends at
  a root outside S — an output computed from parameters alone (a position bias the stage
  uses and also passes on). W starts autograd there (``GradientEdge``), with the
  recorded gradient resp. the root's own, restricted to the leaves: each node computes
  only its weight-side outputs. Leaves that share a start are one autograd call.

Why that is the full gradient: S is closed upwards (a node above one in S reaches the
input through it), so when B runs a node of S all that will ever flow into it has
arrived — what a start records is complete. Below S, nothing is in S: W runs every node
between a leaf and its starts with all of their gradient. A start may still receive more
in W (a start below another, a tensor hook applied again): a pre-hook puts the recorded
gradient back.

A stage whose inputs need no gradient (the first stage) has nothing to send back: its B
does nothing and its W is the whole backward. A graph that autograd cannot split
(``torch.utils.checkpoint(..., use_reentrant=True)`` runs a backward of its own and
refuses ``.grad``) is not split: B runs the whole backward, W nothing, and a warning says
why (as does :attr:`WeightWork.whole`).

Known cost: a weight used at two depths of one stage has two starts, one above the
other; W then re-derives the activation gradient between them. Weights used once — every
ordinary layer — cost nothing extra.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, _engine_run_backward, get_gradient_edge
from torch.overrides import has_torch_function

__all__ = [
    "WeightWork",
    "backward_input",
    "backward_weight",
    "grads_of",
    "leaves_below",
    "run_backward",
]

# Nodes whose backward runs autograd itself and refuses to run under ``.grad``.
_UNSPLITTABLE = {
    "CheckpointFunctionBackward": "torch.utils.checkpoint(use_reentrant=True) runs a "
    "backward of its own inside B; use_reentrant=False splits",
}


def _node(tensor: torch.Tensor) -> Node:
    """A tensor's grad_fn, or for a leaf its gradient accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return get_gradient_edge(tensor).node


@dataclass
class _Group:
    params: list[torch.Tensor]
    intermediates: list[Node]  # starts in S: recorded in B
    roots: list[int]  # starts outside S: roots, by index
    grads: dict[Node, tuple] = field(default_factory=dict)  # recorded in B
    root_starts: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    handles: list = field(default_factory=list)  # the starts' pre-hooks, from B to W


@dataclass
class WeightWork:
    """What W needs from B: the graph (kept alive) and the recorded gradients."""

    groups: list[_Group]
    roots: list[torch.Tensor]  # the whole backward's roots (``full``), else empty
    root_grads: list[torch.Tensor | None]
    full: bool = False  # no input needed a gradient: W is the whole backward
    held: list = field(default_factory=list)  # memory-meter tokens of the stage
    whole: str | None = None  # why B ran the whole backward (W has nothing left)


@dataclass
class _Graph:
    """One walk down from the roots."""

    parents: dict[Node, list[Node]]
    accumulators: dict[int, Node]  # id(leaf) -> its AccumulateGrad
    leaves: list[torch.Tensor]  # in the order met
    root_nodes: dict[Node, list[int]]  # node -> the roots it computes
    unsplittable: str | None = None


def _walk(roots: Sequence[torch.Tensor]) -> _Graph:
    """Parents and leaves of the graph below ``roots``."""
    graph = _Graph({}, {}, [], {})
    stack = []
    for index, root in enumerate(roots):
        node = _node(root)
        graph.root_nodes.setdefault(node, []).append(index)
        stack.append(node)
    visited = set(stack)
    while stack:
        node = stack.pop()
        below = node.next_functions
        if not below:
            variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
            if variable is not None:
                graph.accumulators[id(variable)] = node
                graph.leaves.append(variable)
            continue
        if graph.unsplittable is None:
            graph.unsplittable = _UNSPLITTABLE.get(type(node).__name__)
        for child, _ in below:
            if child is None:
                continue
            graph.parents.setdefault(child, []).append(node)
            if child not in visited:
                visited.add(child)
                stack.append(child)
    return graph


def leaves_below(roots: Sequence[torch.Tensor], stop: Sequence[torch.Tensor]) -> list:
    """The leaves that require grad and that ``roots`` depend on other than through the
    tensors of ``stop`` (e.g. what a loss reads besides the stage's outputs). Its own walk,
    not :func:`_walk`'s: the last stage runs it on every micro-batch's loss, and it needs
    no parents, accumulators or roots."""
    stop_nodes = {t.grad_fn for t in stop if t.grad_fn is not None}
    stack = [_node(r) for r in roots if r.requires_grad]
    seen, leaves = set(stack), []
    while stack:
        node = stack.pop()
        if node in stop_nodes:
            continue
        below = node.next_functions
        if not below:
            variable = getattr(node, "variable", None)  # an AccumulateGrad's leaf
            if variable is not None:
                leaves.append(variable)
            continue
        for child, _ in below:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return leaves


def _starts(node: Node, graph: _Graph, on_input_path: set[Node]) -> tuple[set[Node], set[int]]:
    """Where W starts for the leaf of ``node``: the nodes of S and the roots outside S at
    which the paths up from it leave the nodes outside S."""
    found: set[Node] = set()
    roots: set[int] = set(graph.root_nodes.get(node, ()))
    seen, frontier = {node}, [node]
    while frontier:
        below = frontier.pop()
        for parent in graph.parents.get(below, ()):
            if parent in seen:
                continue
            seen.add(parent)
            if parent in on_input_path:
                found.add(parent)
            else:
                frontier.append(parent)
                roots.update(graph.root_nodes.get(parent, ()))
    return found, roots


def _whole(roots, grads, inputs, reason: str) -> tuple[list, WeightWork]:
    """B as the whole backward, for a graph that cannot be split."""
    warnings.warn(f"a split backward runs whole in B (no W to defer): {reason}", stacklevel=4)
    run_backward(roots, grads)
    return grads_of(inputs), WeightWork([], [], [], whole=reason)


def run_backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """``torch.autograd.backward(roots, grads)``: accumulate into every leaf below ``roots``.

    The engine directly (as :func:`_accumulate`), after the public call's checks that can
    find something in a stage's backward: a gradient has its root's shape (the engine alone
    would sum a broadcastable one silently) and is not complex for a real root; None only
    for a real one-element root (a loss), which gets ones. The public call's general argument
    handling costs 15-25 us per call on the CPU, a fifth of a small stage's B. Tensor
    subclasses (``__torch_function__``) and functorch transforms take the public call."""
    if has_torch_function(roots) or torch._C._are_functorch_transforms_active():
        torch.autograd.backward(list(roots), list(grads))
        return
    filled = []
    for index, (root, grad) in enumerate(zip(roots, grads, strict=True)):
        if grad is None:
            if root.numel() != 1 or not root.is_floating_point():
                raise RuntimeError(
                    f"backward got no gradient for root {index} of shape {tuple(root.shape)} "
                    f"({root.dtype}): only a real one-element root (a loss) starts from ones"
                )
            grad = torch.ones_like(root, memory_format=torch.preserve_format)
        elif grad.shape != root.shape or (grad.is_complex() and not root.is_complex()):
            raise RuntimeError(
                f"backward got a gradient of shape {tuple(grad.shape)} ({grad.dtype}) for root "
                f"{index} of shape {tuple(root.shape)} ({root.dtype}): each gradient must have "
                "its output's shape"
            )
        filled.append(grad)
    _engine_run_backward(
        tuple(roots), tuple(filled), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def grads_of(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each input's ``.grad`` (None where it is not a leaf that requires grad)."""
    return [t.grad if t.requires_grad and t.is_leaf else None for t in inputs]


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: gradients of ``inputs`` from ``roots`` (with ``grads``); W's work for later.

    W delivers ``params`` (tensors autograd differentiates that the walk may not meet as
    leaves, e.g. gathered shards) and every leaf the graph reaches but ``inputs``. An
    input that is not a leaf (the user's tensor that requires grad, on the first stage)
    is differentiated through, as part of W."""
    wanted = [t for t in inputs if t.requires_grad and t.is_leaf]
    if not wanted or not roots:
        return [None] * len(inputs), WeightWork([], list(roots), list(grads), full=True)
    graph = _walk(roots)
    if graph.unsplittable is not None:
        return _whole(roots, grads, inputs, graph.unsplittable)

    def node_of(tensor: torch.Tensor) -> Node | None:
        if tensor.grad_fn is not None:
            return tensor.grad_fn
        return graph.accumulators.get(id(tensor))  # None: the graph does not use this leaf

    # S: the inputs' ancestors, the nodes B executes.
    on_input_path: set[Node] = set()
    frontier = [n for n in map(node_of, wanted) if n is not None]
    while frontier:
        node = frontier.pop()
        if node not in on_input_path:
            on_input_path.add(node)
            frontier.extend(graph.parents.get(node, ()))

    inputs_seen = {id(t) for t in wanted}
    targets = {id(p): p for p in params if p.requires_grad and id(p) not in inputs_seen}
    for leaf in graph.leaves:
        if id(leaf) not in inputs_seen:
            targets.setdefault(id(leaf), leaf)
    groups = _grouped(targets.values(), node_of, graph, on_input_path)
    grad_inputs = _run_input_part(roots, grads, wanted, inputs, groups)
    # The starts keep the graph below them alive; what lies above them (e.g. the loss and
    # its softmax) is freed when the caller lets the roots go, unless a start is a root.
    for group in groups:
        for index in group.roots:
            grad = grads[index] if grads[index] is not None else torch.ones_like(roots[index])
            group.root_starts.append((get_gradient_edge(roots[index]), grad))
    return grad_inputs, WeightWork(groups, [], [])


def _grouped(targets, node_of, graph: _Graph, on_input_path: set[Node]) -> list[_Group]:
    """One group per set of leaves that share a start."""
    by_start: dict[Node | int, _Group] = {}  # a start: a node of S, or a root's index
    for target in targets:
        node = node_of(target)
        if node is None or (node not in graph.parents and node not in graph.root_nodes):
            continue  # not used by this micro-batch's graph
        found, roots = _starts(node, graph, on_input_path)
        met = list(
            {id(g): g for k in (*found, *roots) if (g := by_start.get(k)) is not None}.values()
        )
        group = met[0] if met else _Group([], [], [])
        for other in met[1:]:  # this leaf joins their starts: one call for all
            group.params += other.params
            group.intermediates += other.intermediates
            group.roots += other.roots
            for start in (*other.intermediates, *other.roots):
                by_start[start] = group
        group.params.append(target)
        for start in found:
            if start not in by_start:
                by_start[start] = group
                group.intermediates.append(start)
        for index in roots:
            if index not in by_start:
                by_start[index] = group
                group.roots.append(index)
    return list({id(g): g for g in by_start.values()}.values())


def _run_input_part(roots, grads, wanted, inputs, groups: list[_Group]) -> list:
    """autograd for the inputs only, while each start's pre-hook records what arrives there.
    The hook stays until W: there it puts the recorded gradient back (see the module's
    docstring), at no cost of a second hook."""
    try:
        for group in groups:
            for node in group.intermediates:
                group.handles.append(node.register_prehook(_start_hook(group.grads, node)))
        computed = torch.autograd.grad(
            list(roots), wanted, list(grads), retain_graph=True, allow_unused=True
        )
    except BaseException:
        for group in groups:
            _remove(group)
        raise
    by_input = dict(zip(map(id, wanted), computed, strict=True))
    return [by_input.get(id(t)) for t in inputs]


def _start_hook(recorded: dict[Node, tuple], node: Node):
    def hook(grad_outputs):
        if node not in recorded:  # B
            recorded[node] = grad_outputs
            return None
        return recorded[node]  # W: from a start above, or a tensor hook run again

    return hook


def _remove(group: _Group) -> None:
    for handle in group.handles:
        handle.remove()
    group.handles.clear()


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the gradients of every leaf B left into ``.grad``."""
    if work.full:
        if work.roots:
            run_backward(work.roots, work.root_grads)
        return
    # Each group's recorded gradients are released as soon as its call is done: the
    # allocator then hands that memory straight to the next group's products. Holding
    # them all to the end made W 10–20% slower on CPU (benchmarks/split_backward.py).
    groups, work.groups = work.groups, []
    groups.reverse()
    while groups:
        group = groups.pop()
        edges, grad_outputs = [], []
        for node in group.intermediates:
            for index, grad in enumerate(group.grads.get(node, ())):  # none: nothing arrived
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grad_outputs.append(grad)
        for edge, grad in group.root_starts:
            edges.append(edge)
            grad_outputs.append(grad)
        try:
            if edges:
                _accumulate(edges, grad_outputs, group.params)
        finally:
            _remove(group)
            group.grads.clear()
            group.root_starts.clear()
        del group, edges, grad_outputs


def _accumulate(edges: list[GradientEdge], grads: list[torch.Tensor], params: list) -> None:
    """One group's autograd call. Accumulated by autograd itself, so .grad hooks (e.g. data
    parallelism's bucket reduction) see it as after any backward."""
    if has_torch_function(params):
        torch.autograd.backward(edges, grads, retain_graph=True, inputs=params)
        return
    # The engine directly (what torch.autograd.backward calls once it has checked its
    # arguments; torch >= 2.3): B recorded these gradients from these very nodes, so the
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
