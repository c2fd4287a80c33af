"""What a stage holds while training: parameters, optimizer state, activations.

Memory model of a stage, per process (bytes; :class:`MemoryModel`), P its parameter bytes::

    P × (1 + gradients + optimizer_state)                 AdamW: optimizer_state = 2
    + buffers
    + boundary input × micro-batches held                 (kept for backward)
    + inner activations × micro-batches held without re-materialization
                        (with it, those being recomputed: 1, more under zero bubble)
                        recomputed g layers at a time (``checkpoint_layers=g``, not under
                        a split backward), a recomputed micro-batch holds instead
                        the inputs of the stage's groups but the first + the largest
                        group's inner activations
    − freed after B × micro-batches past B waiting for W (zero bubble: what lies above
                        the stage's last weights, e.g. the loss's log-softmax)
    + layers × layer_overhead (``MemoryModel(layer_overhead=...)``, bytes per layer of
                        the stage that the terms above miss, measured by
                        ``gpipe.planner.calibrate``)
    + workspace (``MemoryModel(workspace=True)``): the largest saved bytes of one layer
                        for one micro-batch (a layer's backward makes the gradients of what
                        it saved while that is alive; measured, ``docs/capacity.md``: the
                        loss of a large vocabulary needs about twice its logits)

"Held" comes from simulating the schedule (``gpipe.schedule.simulate``): a micro-batch is held
on a stage from the start of its forward until its backward is complete. Inner
activations are what autograd saves inside the stage (the layers' saved tensors, each
boundary between two layers counted once); a re-materialized micro-batch holds them
only from the start of its backward. The peaks of the two counts are added, which can
overstate a little when they do not coincide. Not modelled: the loss's saved tensors
unless the profile included the loss, allocator fragmentation, temporary buffers of a
single operation, communication buffers.

Replicas (``MemoryModel(replicas=R)``: R copies of the pipeline, each on its own share of
the mini-batch; the activations come from a profile of that share). Plain replicas average
their gradients with a bucketed all-reduce (``gpipe.parallel.data_parallel``) whose flat
buckets stay alive until the step ends, so a process holds one replica's memory plus one
more copy of the gradients::

    + P × gradients                                       (reduction buffers)

Sharded replicas (``MemoryModel(replicas=R, shard=True)``: FSDP2 ``fully_shard`` on each
layer of a stage with parameters) keep 1/R of the parameters, gradients and optimizer
state; a layer's parameters are gathered whole for its forward or backward and freed after
it, and its gradient is reduce-scattered into the shards after each backward
(``Pipe(shard="all")``), or accumulated whole over the step's micro-batches and
reduce-scattered once per step (``shard="params"``, ``whole_gradients=True``; also
``"all"`` under a split backward)::

    P / R + P × gradients / R + P × optimizer_state / R + buffers
    + the largest layer × gradients   ("all"; "params": P × gradients in place of P / R)
    + gathered: twice the stage's largest layer (FSDP's flat buffer beside the layer's
                parameters: the all-gather's output they are copied out of, the
                reduce-scatter's input the gradients are copied into); P + the largest
                layer under a split backward (W gathers the stage)
    + boundary and inner activations as above

The peaks of the terms are added, as for the activations: an upper bound where they do not
coincide (the reduction buffers, e.g., live after the last backward has freed most
activations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpipe.base import remat
from gpipe.base._utils import MiB
from gpipe.estimate.profile import LayerProfile, Profile
from gpipe.estimate.ranges import RangeMax, StridedMax, prefix_sums, spans
from gpipe.layout import Layout
from gpipe.schedule.ir import Kind, Schedule
from gpipe.schedule.simulate import SimulationResult, simulate

__all__ = [
    "Calibration",
    "Held",
    "MemoryModel",
    "StageMemory",
    "StageMemoryTable",
    "held_in",
    "held_microbatches",
    "stage_memory",
]


@dataclass(frozen=True)
class MemoryModel:
    """How training memory grows with the parameters (multiples of parameter bytes)."""

    gradients: float = 1.0  # one gradient per parameter
    optimizer_state: float = 2.0  # AdamW: two moments per parameter; SGD+momentum: 1
    replicas: int = 1  # R pipelines, data parallel: each process holds one stage of one
    shard: bool = False  # parameters, gradients, optimizer state sharded over the R replicas
    # sharded: the step's gradients accumulated whole, reduced once (Pipe(shard="params"));
    # otherwise each layer's reduced after each backward (shard="all", gpipe train --shard)
    whole_gradients: bool = False
    workspace: bool = False  # count the backward's workspace (see the module docstring)
    layer_overhead: float = 0.0  # bytes per layer of a stage beyond its terms (measured)

    def __post_init__(self) -> None:
        for label in ("gradients", "optimizer_state", "layer_overhead"):
            value = getattr(self, label)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"{label} must be a non-negative number, got {value!r}")
        mode = ("params" if self.whole_gradients else "all") if self.shard else None
        problems = Layout(replicas=self.replicas, shard=mode).problems()
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def kept(self) -> float:
        """Of the parameters and optimizer state, the fraction a process keeps."""
        return 1.0 / self.replicas if self.shard else 1.0

    @property
    def reduction(self) -> float:
        """Multiple of parameter bytes held by the gradient all-reduce's buffers."""
        return self.gradients if self.replicas > 1 and not self.shard else 0.0


@dataclass(frozen=True)
class Held:
    """Micro-batches a stage holds at its peak: boundary inputs, and inner activations."""

    boundary: int
    inner: int
    # of ``inner``, those past B and waiting for W (zero-bubble), which hold less
    after_input_grad: int = 0
    # the peaks of the two kinds apart: micro-batches holding their whole graph from the
    # forward on, and re-materialized ones being recomputed (from the start of B)
    stored: int = 0
    recomputing: int = 0


@dataclass(frozen=True)
class StageMemory:
    """A stage's memory by kind, in bytes."""

    parameters: float
    gradients: float
    optimizer: float
    buffers: float
    boundary: float  # boundary inputs × held micro-batches
    inner: float  # inner activations × micro-batches holding them
    held: Held
    gathered: float = 0.0  # sharded: parameters gathered whole at once
    reduction: float = 0.0  # plain replicas: the gradient all-reduce's buffers
    workspace: float = 0.0  # the gradients one layer's backward makes at once
    layers: float = 0.0  # the measured cost of holding its layers, beyond the terms above

    @property
    def total(self) -> float:
        return sum(self.terms().values())

    def terms(self) -> dict[str, float]:
        """Each term of the total by name, in the order of the module docstring."""
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "buffers": self.buffers,
            "inputs": self.boundary,
            "activations": self.inner,
            "workspace": self.workspace,
            "gathered": self.gathered,
            "reduction": self.reduction,
            "layers": self.layers,
        }

    def describe(self) -> str:
        extra = ""
        if self.workspace:
            extra += f" + backward workspace {self.workspace / MiB:.1f}"
        if self.gathered:
            extra += f" + gathered parameters {self.gathered / MiB:.1f}"
        if self.reduction:
            extra += f" + reduction buffers {self.reduction / MiB:.1f}"
        return (
            f"{self.total / MiB:.1f} MiB (parameters {self.parameters / MiB:.1f} + gradients "
            f"{self.gradients / MiB:.1f} + optimizer {self.optimizer / MiB:.1f} + buffers "
            f"{self.buffers / MiB:.1f} + inputs {self.boundary / MiB:.1f} for "
            f"{self.held.boundary} micro-batches + inner activations {self.inner / MiB:.1f} "
            f"for {self.held.inner}{extra})"
        )


def held_microbatches(schedule: Schedule, checkpoint: str) -> list[Held]:
    """Per stage, the most micro-batches holding boundary inputs and inner activations.

    From the simulated timeline (``gpipe.schedule.simulate``, unit costs): boundary
    inputs are held from a micro-batch's forward until its backward is complete (the
    simulator's ``peak_live_per_stage``); inner activations from the forward too without
    re-materialization, from the start of the backward with it::

        >>> s = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
        >>> [(h.boundary, h.inner) for h in held_microbatches(s, "always")]
        [(4, 1), (3, 1), (2, 1), (1, 1)]
    """
    return held_in(simulate(schedule), checkpoint)


def held_in(result: SimulationResult, checkpoint: str) -> list[Held]:
    """:func:`held_microbatches` of a simulation already run."""
    schedule = result.schedule
    M = schedule.num_microbatches
    remat.check_mode(checkpoint)
    start: dict[tuple[Kind, int, int], float] = {}
    end: dict[tuple[Kind, int, int], float] = {}
    for event in result.events:
        key = (event.action.kind, event.action.stage, event.action.microbatch)
        start[key], end[key] = event.start, event.end
    held = []
    for s in range(schedule.num_stages):
        points = []  # (time, change of held micro-batches, change of those past B)
        for m in range(M):
            again = int(remat.recomputes(checkpoint, m, M))
            begin = start[(Kind.BACKWARD, s, m)] if again else start[(Kind.FORWARD, s, m)]
            points.append((begin, 1, 0, again))
            if schedule.splits_backward(s, m):
                points += [
                    (end[(Kind.BACKWARD, s, m)], 0, 1, again),
                    (end[(Kind.WEIGHT, s, m)], -1, -1, again),
                ]
            else:
                points.append((end[(Kind.BACKWARD, s, m)], -1, 0, again))
        points.sort()  # at a tie releases come first
        live = pending = peak = 0
        fewest_pending = 0  # at the peak: the heaviest moment holds the fewest past B
        by_kind, peak_of_kind = [0, 0], [0, 0]  # stored, recomputing
        for _, delta, past_b, again in points:
            live, pending = live + delta, pending + past_b
            by_kind[again] += delta
            peak_of_kind[again] = max(peak_of_kind[again], by_kind[again])
            if live > peak:
                peak, fewest_pending = live, pending
            elif live == peak:
                fewest_pending = min(fewest_pending, pending)
        held.append(Held(result.peak_live_per_stage[s], peak, fewest_pending, *peak_of_kind))
    return held


class StageMemoryTable:
    """O(1) memory of any stage (layers i..j-1 at position s), from prefix sums.

    ``splits_backward``: the schedule runs W apart (zero bubble), which under sharding
    gathers the whole stage's parameters at once. ``checkpoint_layers``: a re-materialized
    micro-batch is recomputed that many layers at a time (None: the whole stage).
    """

    def __init__(
        self,
        layers: Sequence[LayerProfile],
        held: Sequence[Held],
        model: MemoryModel,
        *,
        splits_backward: bool = False,
        checkpoint_layers: int | None = None,
    ):
        n = len(layers)
        self.layers, self.held, self.model = layers, held, model
        self.splits_backward = splits_backward
        # shard="all" accumulates shards, and a layer's gradient is whole only until it is
        # reduced; a split backward's W makes the whole stage's at once (reduced as "params")
        self.sharded_gradients = model.shard and not model.whole_gradients and not splits_backward
        self.gradient_factor = model.gradients * (model.kept if self.sharded_gradients else 1.0)
        self.factor = (1.0 + model.optimizer_state) * model.kept + self.gradient_factor
        self.factor += model.reduction
        self.params = prefix_sums([lay.param_bytes for lay in layers])
        self.largest = RangeMax([lay.param_bytes for lay in layers])
        self.largest_saved = RangeMax([lay.saved_bytes for lay in layers])
        self.buffers = prefix_sums([lay.buffer_bytes for lay in layers])
        self.inner = prefix_sums([lay.inner_bytes for lay in layers])
        self.has_params = [lay.param_bytes > 0 for lay in layers]
        # the boundary between layers l and l+1 is saved once, by either of them
        self.joint = prefix_sums(
            [
                max(layers[l].saved_output_bytes, layers[l + 1].saved_input_bytes)
                for l in range(n - 1)
            ]
        )
        # A split backward's W needs every layer's saved tensors: its stages recompute whole.
        self.group = None if splits_backward else checkpoint_layers
        if self.group is not None:
            g = self.group
            # kept group inputs: sums of input bytes at a stride of g
            self.strided_inputs = [0.0] * (n + 1)
            for x in range(n):
                below = self.strided_inputs[x - g + 1] if x >= g else 0.0
                self.strided_inputs[x + 1] = below + layers[x].input_bytes
            self.group_inner = StridedMax([self._inner(x, x + g) for x in range(n - g + 1)], g)

    def _inner(self, i: int, j: int) -> float:
        return (
            self.inner[j]
            - self.inner[i]
            + self.joint[j - 1]
            - self.joint[i]
            + self.layers[j - 1].saved_output_bytes
        )

    def _recomputed(self, i: int, j: int) -> float:
        """What a micro-batch recomputed ``self.group`` layers at a time holds at once: the
        inputs of its groups but the first (the stage input, counted apart), and the
        largest group's inner activations."""
        g = self.group
        if g is None or j - i <= g:
            return self._inner(i, j)
        groups = -(-(j - i) // g)
        last = i + (groups - 1) * g  # the start of the last group, maybe a partial one
        kept = self.strided_inputs[last + 1] - self.strided_inputs[i + 1]
        full = (j - i) // g
        largest = self.group_inner(i, full)
        if last + g > j:
            largest = max(largest, self._inner(last, j))
        return kept + largest

    def _freed_after_input_grad(self, i: int, j: int) -> float:
        """What a split B frees at once: the stage's top layers down to its last weights
        (W starts at their nodes and keeps everything below alive). The first stage has
        no input gradient to compute: its B does nothing and W the whole backward."""
        if i == 0:
            return 0.0
        freed = 0.0
        for layer in range(j - 1, i - 1, -1):
            freed += self.layers[layer].freed_after_input_grad_bytes
            if self.has_params[layer]:
                break
        return freed

    def _held_inner(self, s: int, i: int, j: int) -> float:
        held = self.held[s]
        if self.group is not None and held.recomputing:
            return self._inner(i, j) * held.stored + self._recomputed(i, j) * held.recomputing
        inner = self._inner(i, j) * held.inner
        if held.after_input_grad:
            inner -= self._freed_after_input_grad(i, j) * held.after_input_grad
        return inner

    def _gathered(self, i: int, j: int) -> float:
        if not self.model.shard:
            return 0.0
        # the gathered layer(s) and one flat buffer of the largest layer (module docstring)
        whole = self.params[j] - self.params[i] if self.splits_backward else self.largest(i, j)
        return whole + self.largest(i, j)

    def _workspace(self, i: int, j: int) -> float:
        return self.largest_saved(i, j) if self.model.workspace else 0.0

    def weights(self, i: int, j: int) -> float:
        """The terms that grow with the parameters alone (never less for more layers)."""
        return (
            (self.params[j] - self.params[i]) * self.factor
            + self.buffers[j]
            - self.buffers[i]
            + self._gathered(i, j)
            + self._whole_gradient(i, j)
            + (j - i) * self.model.layer_overhead
        )

    def _whole_gradient(self, i: int, j: int) -> float:
        """shard="all": the largest layer's gradient, whole until its reduce-scatter."""
        return self.largest(i, j) * self.model.gradients if self.sharded_gradients else 0.0

    def __call__(self, s: int, i: int, j: int) -> StageMemory:
        params = self.params[j] - self.params[i]
        held = self.held[s]
        model = self.model
        return StageMemory(
            parameters=params * model.kept,
            gradients=params * self.gradient_factor + self._whole_gradient(i, j),
            optimizer=params * model.optimizer_state * model.kept,
            buffers=self.buffers[j] - self.buffers[i],
            boundary=self.layers[i].input_bytes * held.boundary,
            inner=self._held_inner(s, i, j),
            held=held,
            gathered=self._gathered(i, j),
            reduction=params * model.reduction,
            workspace=self._workspace(i, j),
            layers=(j - i) * model.layer_overhead,
        )

    def total(self, s: int, i: int, j: int) -> float:
        """``self(s, i, j).total``, without building the breakdown (the hot path)."""
        held = self.held[s]
        return (
            self.weights(i, j)
            + self.layers[i].input_bytes * held.boundary
            + self._held_inner(s, i, j)
            + self._workspace(i, j)
        )


def stage_memory(
    prof: Profile,
    balance: Sequence[int],
    held: Sequence[Held],
    model: MemoryModel | None = None,
    *,
    splits_backward: bool = False,
    checkpoint_layers: int | None = None,
) -> list[StageMemory]:
    """The memory of each stage of ``balance`` (see the module docstring)."""
    table = StageMemoryTable(
        prof.layers, held, model or MemoryModel(), splits_backward=splits_backward,
        checkpoint_layers=checkpoint_layers,
    )  # fmt: skip
    return [table(s, i, j) for s, (i, j) in enumerate(spans(balance))]


@dataclass(frozen=True)
class Calibration:
    """What a training process needs beyond the memory model's terms, measured
    (``gpipe.planner.calibrate``): what it holds before its model is built (``baseline``:
    Python, torch, the process group; a budget is the whole process's peak, so it counts),
    a constant per process, bytes per layer of the *whole* model (each process records the
    whole model on ``meta`` to build its own layers; what that leaves behind), and bytes
    per layer of its own stage (``MemoryModel(layer_overhead=...)``)."""

    process: float = 0.0
    per_layer: float = 0.0  # per layer of the whole model
    per_stage_layer: float = 0.0  # per layer of the process's stage
    baseline: float = 0.0  # resident before the model is built

    def at(self, layers: int) -> float:
        """Bytes per process for a model of ``layers`` layers, beyond its stage's terms."""
        return self.baseline + self.process + self.per_layer * layers

    def __post_init__(self) -> None:
        values = (self.process, self.per_layer, self.per_stage_layer, self.baseline)
        if not all(v >= 0 for v in values):
            raise ValueError(f"calibration must be non-negative bytes, got {self}")

    def __str__(self) -> str:
        return (
            f"{self.baseline / MiB:.1f} MiB held before the model + {self.process / MiB:.1f} "
            f"MiB per process + {self.per_layer / MiB:.3f} MiB per layer of the model + "
            f"{self.per_stage_layer / MiB:.3f} MiB per layer of its stage"
        )
