"""Sharded replicas (pipeline × FSDP): each stage's parameters, gradients and optimizer
state split over the replicas that hold it, with PyTorch's FSDP2 (``fully_shard``).

Every layer of a local stage that has parameters becomes its own FSDP unit over the
data-parallel group. Between actions a process keeps only its shard (1/R) of each
parameter; FSDP's own hooks gather one layer's parameters for that layer's forward and
for its backward, and free them right after (re-sharding after forward and after
backward), so at most a layer or two is whole at any moment. Gradients are
averaged over the replicas (as :mod:`gpipe.parallel.data_parallel` does) by a
reduce-scatter, and only this replica's shard is kept, as ``.grad`` of the sharded
parameter (a ``DTensor``). When depends on the mode:

* ``"params"``: gradient synchronization is off during the step; each micro-batch's
  backward adds into an unsharded gradient, as without sharding, and after the stage's
  last backward action of the step its layers' gradients are reduce-scattered once. That
  is torchtitan's pipeline + FSDP step (the least communication), and the reduce is done
  the way ``torch.distributed.pipelining`` does it (``perform_reduce_grad``): through
  FSDP's own post-backward, which has no public entry point.
* ``"all"``: the step's gradient accumulator is sharded too. Each layer's gradient is
  reduce-scattered as soon as a micro-batch's backward has passed the layer (FSDP's own
  hooks, as in plain FSDP training) and added into this replica's shard, so at most a
  layer's whole gradient exists at a time, for M reduce-scatters a step instead of one.
  A split backward (zero-bubble schedules) computes the weight gradients in W, whose
  autograd call FSDP's hooks do not see, for the whole stage at once: such a stage is
  reduced as in ``"params"``, which holds no more and communicates less.

Memory per process for a stage of P parameter bytes (AdamW): P/R parameters + 2P/R
optimizer state, and P unsharded gradient during the step (``"params"``) or P/R plus the
largest layer's (``"all"`` without a split backward), instead of 4P; the planner's memory
model (``gpipe.estimate.memory_model``) counts the same terms. A split backward gathers the
whole stage for its W.

Every FSDP collective runs on the data-parallel group, whose own timeout bounds it (a
group built by ``gpipe.parallel.mesh.Mesh`` or ``gpipe.launch`` gets the pipeline's);
what runs outside FSDP (the check for non-finite gradients, the norm for clipping) goes
through :class:`~gpipe.parallel.collectives.Collectives`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from gpipe.base.errors import COMMUNICATION_FAILURES, PartitionError, PipelineError
from gpipe.engine.stage import Stage
from gpipe.parallel.collectives import Collectives

__all__ = [
    "ShardedStages",
    "full_value",
    "shard_like",
    "sharded_optimizer_state",
    "sharing_problems",
]

# How gloo and NCCL say that a peer did not come (timeout) or left (closed connection).
_COMMUNICATION_FAILURES = (*COMMUNICATION_FAILURES, "NCCL")


def full_value(value: Any) -> Any:
    """``value`` (a tensor, or dicts and lists of them) with every ``DTensor`` gathered
    whole: a collective over its replicas, which must all call it, in the same order."""
    return tree_map(lambda v: v.full_tensor() if hasattr(v, "full_tensor") else v, value)


def shard_like(parameter: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This replica's shard of the whole tensor ``full``, laid out as ``parameter`` (a
    sharded one; anything else gets ``full`` back)."""
    if not hasattr(parameter, "device_mesh") or hasattr(full, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        full.to(parameter.device, parameter.dtype),
        parameter.device_mesh,
        parameter.placements,
        src_data_rank=None,  # every replica has the whole value: no communication
    )


def sharded_optimizer_state(
    state: dict[str, Any], parameters: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """A by-name optimizer state of whole tensors (``gpipe.train.checkpoint``) with each
    per-element tensor (AdamW's moments: the parameter's shape) cut to this replica's
    shard of its sharded parameter; scalars (the step count) stay whole."""

    def cut(name: str, entry: dict[str, Any]) -> dict[str, Any]:
        param = parameters.get(name)
        if param is None:
            return entry
        return {
            k: shard_like(param, v)
            if isinstance(v, torch.Tensor) and v.shape == param.shape and v.dim() > 0
            else v
            for k, v in entry.items()
        }

    return {**state, "state": {n: cut(n, e) for n, e in state["state"].items()}}


def _has_parameters(layer: nn.Module) -> bool:
    return next(layer.parameters(), None) is not None


def sharing_problems(stages: Sequence[Sequence[tuple[str, nn.Module]]]) -> list[str]:
    """Why these stages ((name, layer) pairs) cannot be sharded layer by layer: layers of
    one stage that share a parameter (FSDP shards each parameter in one unit only). A module
    used twice is one layer."""
    problems = []
    for index, named in enumerate(stages):
        name_of: dict[int, str] = {}
        for name, layer in named:
            name_of.setdefault(id(layer), name)
        for unit in _units([layer for _, layer in named]):
            if len(unit) > 1:
                names = ", ".join(name_of[id(m)] for m in unit)
                problems.append(
                    f"stage {index}: layers {names} share a parameter, and shard='params' "
                    "shards each layer on its own; make them one layer (one nn.Module holding "
                    "them) or use plain replicas (shard=None)"
                )
    return problems


def _units(layers: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """The stage's layers that have parameters, grouped where they share one (a module
    used twice counts once): FSDP must shard each parameter in exactly one unit."""
    unique = list({id(layer): layer for layer in layers if _has_parameters(layer)}.values())
    parent = list(range(len(unique)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for index, layer in enumerate(unique):
        for param in layer.parameters():
            if id(param) in owner:
                parent[root(index)] = root(owner[id(param)])
            else:
                owner[id(param)] = index
    units: dict[int, list[nn.Module]] = {}
    for index, layer in enumerate(unique):
        units.setdefault(root(index), []).append(layer)
    return list(units.values())


def _param_groups(layer: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(layer)
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.10; before: one group
    return list(groups) if groups is not None else [state._fsdp_param_group]


class ShardedStages:
    """Shards the local stages' layers over ``group`` (the replicas of these stages).

    Has the interface of :class:`~gpipe.parallel.data_parallel.GradientReducer` that the
    Pipe and the runtime use: :meth:`arm` and :meth:`stage_done` around a stage's last
    backward action, :meth:`finish` at the end of the step, :meth:`reset` after a failure.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        group: Any,
        *,
        timeout: float,
        mode: str = "params",
        split_stages: Collection[int] = (),
    ) -> None:
        # FSDP2 is public from torch 2.6; imported here so that older ones run the rest.
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.group = group
        self._stages = list(stages)
        # "all": FSDP's hooks reduce each layer after each backward, except where W computes
        # the stage's weight gradients apart (``split_stages``), as in "params".
        self._by_hooks = {s.index for s in self._stages if mode == "all"} - set(split_stages)
        device_type = self._stages[0].device.type if self._stages else "cpu"
        # FSDP's collectives wait as long as the group's timeout: make it the pipeline's.
        group.set_timeout(timedelta(seconds=timeout))
        mesh = DeviceMesh.from_group(group, device_type)
        self._ops = Collectives(group, timeout=timeout, device=_collective_device(group))
        self._layers: dict[int, list[nn.Module]] = {}
        for stage in self._stages:
            sharded = []
            for unit in _units(stage.layers):  # one layer each: see sharing_problems
                fully_shard(unit[0], mesh=mesh, reshard_after_forward=True)
                # Without the hooks' reduction, stage_done reduces once per step.
                unit[0].set_requires_gradient_sync(stage.index in self._by_hooks)
                if stage.index in self._by_hooks:
                    _reduce_unused_parameters(unit[0])
                sharded.append(unit[0])
            self._layers[stage.index] = sharded
            for layer in sharded:  # FSDP makes the gathered copies at the first gather
                layer.unshard()
                layer.reshard()
            stage.autograd_parameters = self._unsharded_parameters_of(stage.index)
            stage.gathered = self._gathered_of(stage.index)
        self._retaining: Any = None  # the communication context of the last reduce-scatter
        for layers in self._layers.values():
            for layer in layers:
                for group in _param_groups(layer):
                    group.post_backward = self._releasing(group, group.post_backward)
        self._done: set[int] = set()

    def _releasing(self, group: Any, post_backward: Callable[..., None]) -> Callable[..., None]:
        """``post_backward`` of an FSDP parameter group, then the input of the previous
        reduce-scatter of another layer let go.

        FSDP keeps a reduce-scatter's input (a whole layer's gradient) until the next
        reduce-scatter of its communication context, or the end of the backward: one in
        flight, to overlap it with compute. Each layer is its own FSDP root here (gpipe
        calls the layers, not a module holding them), with a context of its own, so every
        layer's input stayed until the end of each backward: a whole stage's gradient
        again. Released as one context would release them, one is held at a time."""

        def run(*args: Any) -> None:
            post_backward(*args)
            context = group.comm_ctx
            if not context.reduce_scatter_states:
                return
            previous, self._retaining = self._retaining, context
            if previous is not None and previous is not context:
                for state in previous.reduce_scatter_states:
                    if state.event is not None:  # the compute stream waits for it (GPU)
                        previous.device_handle.current_stream().wait_event(state.event)
                previous.reduce_scatter_states.clear()

        return run

    # -- what the engine asks ------------------------------------------------------------------

    def _unsharded_parameters_of(self, index: int):
        """The tensors autograd differentiates for the stage: the gathered parameters
        (FSDP keeps one tensor object per parameter for them, refilled at each gather)."""

        def parameters() -> list[torch.Tensor]:
            out = []
            for layer in self._layers[index]:
                for group in _param_groups(layer):
                    out += [p.unsharded_param for p in group.fsdp_params]
            stage = next(s for s in self._stages if s.index == index)
            sharded = {id(p) for layer in self._layers[index] for p in layer.parameters()}
            out += [p for p in stage.parameters() if id(p) not in sharded]
            return out

        return parameters

    def _gathered_of(self, index: int):
        @contextmanager
        def gathered() -> Iterator[None]:
            for layer in self._layers[index]:
                layer.unshard()
            try:
                yield
            finally:
                for layer in self._layers[index]:
                    layer.reshard()

        return gathered

    # -- the reducer's interface ---------------------------------------------------------------

    def arm(self, stage: Stage) -> None:
        """Nothing to start early: the stage's gradients are reduce-scattered at its end."""

    def stage_done(self, stage: Stage) -> None:
        """``stage``'s gradients are final: reduce-scatter what of them is still whole,
        keep this replica's shard (with the hooks' reduction, nothing is)."""
        if stage.index in self._done or stage.index in self._by_hooks:
            return
        self._done.add(stage.index)
        for layer in self._layers[stage.index]:
            layer.set_requires_gradient_sync(True)
            try:
                for group in _param_groups(layer):
                    # A parameter unused this step gets zeros: every replica must
                    # reduce-scatter the same set.
                    for param in group.fsdp_params:
                        unsharded = param.unsharded_param
                        if unsharded.requires_grad and unsharded.grad is None:
                            unsharded.grad = torch.zeros_like(unsharded)
                    group.post_backward()
                _final_callback(layer)
            finally:
                layer.set_requires_gradient_sync(False)

    def finish(self) -> None:
        """Reduce the stages that had no backward action this step, then end the step."""
        for stage in self._stages:
            self.stage_done(stage)
        self._done.clear()

    def reset(self) -> None:
        """After a failed step: drop the step's unsharded gradients, keep only shards."""
        self._done.clear()
        for layers in self._layers.values():
            for layer in layers:
                for group in _param_groups(layer):
                    group._reset_iter_state()
                    for param in group.fsdp_params:
                        param.unsharded_accumulated_grad = None
                        if hasattr(param, "_unsharded_param"):
                            param.unsharded_param.grad = None

    def explain(self, error: BaseException) -> BaseException:
        """A failed FSDP collective (gloo's or NCCL's own words) as a ``PipelineError`` that
        says which collective, which replica caused it (``Collectives.error``), and what to
        do; other errors as they are."""
        text = str(error)
        if not isinstance(error, RuntimeError) or isinstance(error, PipelineError):
            return error
        if not any(marker in text for marker in _COMMUNICATION_FAILURES):
            return error
        return self._ops.error(
            "a collective of the sharded replicas (FSDP's parameter all-gather or gradient "
            "reduce-scatter)",
            error,
        )

    # -- whole-model questions over the replicas -----------------------------------------------

    def nonfinite_anywhere(self, trouble: str | None, *, doing: str) -> str | None:
        """Each replica holds other shards: a non-finite gradient on any refuses the step
        on all of them."""
        flag = torch.tensor([1.0 if trouble else 0.0], dtype=torch.float64)
        found = self._ops.all_reduce(
            flag, "the non-finite gradient check over the replicas", maximum=True, doing=doing
        )
        if trouble is None and float(found.reshape(())) > 0:
            return "a gradient shard held by another replica"
        return trouble

    def norm_over_replicas(self, local: torch.Tensor, *, maximum: bool, doing: str) -> torch.Tensor:
        """A norm term of this process's shards, reduced over the replicas."""
        total = self._ops.all_reduce(
            local.reshape(1).to(self._ops.device),
            "the clip_grad_norm_ all-reduce over the replicas",
            maximum=maximum,
            doing=doing,
        )
        return total.reshape(()).to(local.device)


def _reduce_unused_parameters(layer: nn.Module) -> None:
    """FSDP's hooks reduce-scatter zeros for a parameter unused in a backward, so that every
    replica reduces the same set (a mixture's experts that one replica's tokens missed)."""
    setting = getattr(layer, "set_reduce_scatter_unused_params", None)
    if setting is None:
        raise PartitionError(
            f"shard='all' needs FSDP's set_reduce_scatter_unused_params, which torch "
            f"{torch.__version__} lacks: upgrade torch, or use shard='params'"
        )
    setting(True)


def _final_callback(layer: nn.Module) -> None:
    """What FSDP runs when autograd's backward ends (waits for the reductions, resets its
    state); gpipe's reduce happens outside any backward, so it is called here."""
    from torch.distributed.fsdp import fully_shard

    fully_shard.state(layer)._root_post_backward_final_callback()


def _collective_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
