"""How a ``Pipe`` is put together, in named steps: configure, place, tie, wire.

* :func:`configure` checks every argument against the model (which is only recorded on
  ``meta`` when it is a function) and reports every problem in one error; it settles the
  :class:`~gpipe.layout.Layout`, the balance (profiled with ``balance="auto"``, an even split
  of the layers without one), the devices and the schedule, and makes every rank agree on them;
* :func:`place` builds this process's layers (only those, for a function or a model on
  ``meta``: from a checkpoint, whole or not at all), gives a captured model's units the graphs
  of their devices, moves them to their stage's device and makes the stages; a rank that cannot
  build its layers stops every rank;
* :func:`tie` keeps the copies of tied weights that live on several stages as one tensor;
* :func:`wire` connects the stages: transport, gradient reduction over replicas (plain or
  sharded), and the runtime that walks the schedule.

Each step is a function of what the previous ones returned, so each can be read (and
tested) alone; ``gpipe.pipe.Pipe.__init__`` calls them in order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from gpipe.base.errors import PartitionError, PipelineError
from gpipe.engine.batchnorm import DeferredBatchNorm
from gpipe.engine.loss import ForeignParameters
from gpipe.engine.runtime import Runtime
from gpipe.engine.skip import SkipLayout
from gpipe.engine.stage import Stage
from gpipe.estimate.auto import auto_balance
from gpipe.frontend import CapturedModel, LoadReport, fit_devices, materialize_units, on_meta
from gpipe.layout import PIPE, Layout
from gpipe.materialize import record_model, replay_layers
from gpipe.materialize.record import Recording
from gpipe.parallel.data_parallel import GradientReducer
from gpipe.parallel.group import PipelineGroup, default_device
from gpipe.parallel.mesh import group_size
from gpipe.parallel.sharded import ShardedStages, sharing_problems
from gpipe.parallel.tied import TiedParameters
from gpipe.pipe.partition import check_not_shared, cut, device_problems, fingerprint
from gpipe.schedule import Schedule
from gpipe.schedule.routes import Routes

__all__ = [
    "Configuration",
    "Placed",
    "Wiring",
    "capture_device",
    "configure",
    "layout_of",
    "place",
    "tie",
    "wire",
]

ModelOrFactory = nn.Sequential | Callable[[], nn.Sequential]


@dataclass
class Configuration:
    """What :func:`configure` settled: valid, and the same on every rank."""

    layout: Layout
    balance: list[int]
    devices: list[torch.device]  # one per rank
    schedule: Schedule
    model: nn.Sequential  # the whole model; a function's is recorded on meta
    factory: Callable[[], nn.Sequential] | None  # the function, when the model was given so
    # how the function built it, until place() replays this rank's layers from it (once:
    # it holds every operation of the whole model)
    recording: Recording | None = None

    @property
    def stage_devices(self) -> list[torch.device]:
        return [self.devices[rank] for rank in self.schedule.stage_to_rank]

    @property
    def first_layers(self) -> list[int]:
        """Whole-model index of each stage's first layer."""
        return [sum(self.balance[:s]) for s in range(len(self.balance))]


def layout_of(
    given: Layout | None,
    ranks: PipelineGroup,
    *,
    devices: Sequence[Any] | None,
    balance: Sequence[int] | str | None,
    data_parallel_group: Any,
    **shorthand: Any,
) -> Layout:
    """The Pipe's layout: ``given``, or the one its ``shorthand`` keywords (``chunks=``,
    ``schedule=``, ... : :class:`Layout`'s fields, None where not given) spell on the ranks
    of ``devices`` (else the group's, else one per stage of ``balance``) and the replicas
    of ``data_parallel_group``. The only place a Pipe's keywords become a Layout."""
    spelled = {key: value for key, value in shorthand.items() if value is not None}
    if given is not None:
        if not isinstance(given, Layout):
            raise TypeError(f"layout must be a gpipe.Layout, got {type(given).__name__}")
        if spelled:
            raise TypeError(
                f"Pipe(layout=...) was also given {', '.join(spelled)}: set them in the "
                f"Layout (dataclasses.replace(layout, ...)), or drop layout="
            )
        return given
    layout = Layout(**spelled, replicas=group_size(data_parallel_group))
    if devices is None:
        v = layout.virtual_stages if isinstance(layout.virtual_stages, int) else 1
        cut = 1 if balance is None or isinstance(balance, str) else len(balance) // max(1, v)
        devices = ranks.default_devices(max(1, cut))  # a group's: one per rank
    return replace(layout, stages=len(list(devices)))


def configure(
    module: ModelOrFactory,
    ranks: PipelineGroup,
    layout: Layout,
    *,
    balance: Sequence[int] | str | None,
    devices: Sequence[Any] | None,
    data_parallel_group: Any,
    init_seed: int,
    sample: Any,
    sample_loss: Any,
    settings: dict[str, Any],
) -> Configuration:
    """Every argument checked (one :class:`PartitionError` listing every problem), the
    balance chosen when ``"auto"`` (profiled) or None (:meth:`Layout.default_balance` over
    the layout's stages), and the ranks' agreement that they were built alike
    (``settings``: what else must agree, e.g. ``tied``)."""
    factory = _factory_of(module)
    if isinstance(balance, str):
        balance = _auto_balance(module, balance, ranks, devices, layout, sample, sample_loss)
    if devices is None:
        stages = layout.stages if isinstance(layout.stages, int) and layout.stages > 0 else 0
        devices = ranks.default_devices(stages)
    devices = list(devices)
    # A function is recorded on meta (no memory) to check the configuration against; place()
    # replays this rank's layers from the same record.
    model, recording = module, None
    if factory is not None:
        model, recording = record_model(factory, seed=init_seed)
    if (
        balance is None
        and isinstance(model, nn.Sequential)
        and not layout.problems(layers=len(model))
    ):
        balance = layout.default_balance(len(model))
    balance = None if balance is None else list(balance)
    _check(layout, model, balance, devices, ranks, group_size(data_parallel_group))
    built = layout.build_schedule()
    agreed = {**layout.to_dict(), "schedule": built.actions, "balance": balance}
    ranks.check_same(fingerprint(model, **agreed, init_seed=init_seed, **settings))
    devices = [torch.device(d) for d in devices]
    return Configuration(layout, balance, devices, built, model, factory, recording)


def _factory_of(module: ModelOrFactory) -> Callable[[], nn.Sequential] | None:
    if isinstance(module, nn.Module):
        return None
    if not callable(module):
        raise TypeError(
            f"module must be an nn.Sequential or a function that builds one, got "
            f"{type(module).__name__}"
        )
    return module


def _auto_balance(module, balance, ranks, devices, layout, sample, sample_loss) -> list[int]:
    """``balance="auto"``: profiled on ``sample``, on rank 0 when there are many."""
    return auto_balance(
        module,
        balance,
        sample,
        ranks.default_devices(0) if devices is None and ranks.rank is not None else devices,
        ranks.decide,
        chunks=layout.chunks,
        checkpoint=layout.checkpoint,
        schedule=layout.schedule,
        virtual_stages=layout.virtual_stages if isinstance(layout.virtual_stages, int) else 1,
        sample_loss=sample_loss,
    )


def _check(
    layout: Layout,
    model: nn.Module,
    balance: list[int] | None,
    devices: list,
    ranks: PipelineGroup,
    replicas: int,
) -> None:
    """Every problem of the configuration against the model, in one error; a warning for a
    pipeline that cannot overlap its stages."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"gpipe cuts an nn.Sequential into stages, got {type(model).__name__}; wrap the "
            "model's layers in order: nn.Sequential(embedding, *blocks, head), or capture any "
            "model with Pipe.from_model"
        )
    problems = layout.problems(layers=len(model), balance=balance, spelling=PIPE)
    problems += device_problems(devices) + ranks.device_problems(devices)
    if len(devices) != layout.stages:
        problems.append(
            f"the layout has stages={layout.stages!r} but devices has {len(devices)} entries: "
            "give one device per rank"
        )
    if replicas != layout.replicas:
        problems.append(
            f"the layout has replicas={layout.replicas!r} but data_parallel_group holds "
            f"{replicas} process(es): give a group of {layout.replicas!r} (e.g. "
            "gpipe.parallel.mesh.Mesh.build(stages, replicas, ...).dp)"
        )
    if layout.shard and not problems:
        problems += sharing_problems(cut(model, balance))
    if problems:
        raise PartitionError(
            "invalid Pipe configuration:\n" + "\n".join(f"- {p}" for p in problems)
        )
    if layout.chunks == 1 and layout.stages > 1:
        k = layout.stages
        warnings.warn(
            f"Pipe(chunks=1) on {k} devices: one micro-batch, so the stages run one after "
            f"another, never at once; pass chunks >= {k} (e.g. {4 * k}) to pipeline",
            stacklevel=4,
        )


@dataclass
class Placed:
    """This process's part of the model: its stages, their layers by whole-model name."""

    model: nn.Sequential  # the whole model: local layers built and placed, the rest on meta
    layers: list[tuple[str, nn.Module]]  # the local layers, as placed
    stages: list[Stage]  # the local stages, in increasing order
    stage_of_name: dict[str, int]  # every layer's stage
    routes: Routes


def place(
    config: Configuration,
    ranks: PipelineGroup,
    *,
    deferred_batch_norm: bool,
    tied_names: set[str],
    init_seed: int,
) -> Placed:
    """Build this process's layers (a function's, or a captured model's on meta: only
    these) and make its stages, each on its device."""
    local = ranks.local_stages(config.schedule)
    starts, balance = config.first_layers, config.balance
    local_layers = [i for s in local for i in range(starts[s], starts[s] + balance[s])]
    model = _build_local(config, ranks, local_layers, tied=bool(tied_names), init_seed=init_seed)
    stage_layers = cut(model, balance)
    check_not_shared(stage_layers, tied_names)

    # Skip connections: declared by the layers, read from the whole (maybe meta) model.
    skip_layout = SkipLayout.of([layer for layers in stage_layers for _, layer in layers])
    stage_of_layer = [s for s, size in enumerate(balance) for _ in range(size)]
    skips = (
        {s: skip_layout.stage_view(stage_of_layer, s) for s in range(len(balance))}
        if skip_layout
        else {}
    )
    devices = config.stage_devices
    placed_layers, stages = [], []
    for index in local:
        layers = []
        for name, layer in stage_layers[index]:
            if deferred_batch_norm:
                layer = DeferredBatchNorm.convert(layer)
            layer = layer.to(devices[index])
            placed_layers.append((name, layer))
            layers.append(layer)
        stages.append(
            Stage(
                index,
                layers,
                first_layer=starts[index],
                device=devices[index],
                is_last=index == len(balance) - 1,
                skips=skips.get(index),
                checkpoint_layers=config.layout.checkpoint_layers,
            )
        )
    if stages[-1].is_last:  # what its loss must not read (gpipe.engine.loss)
        as_placed = dict(placed_layers)
        named = CapturedModel.original_name if isinstance(model, CapturedModel) else str
        stages[-1].foreign = ForeignParameters(
            (named(f"{name}.{key}"), p)
            for layers in stage_layers[:-1]
            for name, layer in layers
            for key, p in as_placed.get(name, layer).named_parameters()
        )
    stage_of_name = {name: s for s, layers in enumerate(stage_layers) for name, _ in layers}
    return Placed(model, placed_layers, stages, stage_of_name, Routes(len(balance), skips))


def _build_local(
    config: Configuration, ranks: PipelineGroup, layers: list[int], *, tied: bool, init_seed: int
) -> nn.Sequential:
    """The model with this rank's ``layers`` built: a function's, bit for bit; a captured
    model's units materialized (from its checkpoint, whole or not at all) and given the
    graphs of their devices. Any rank that cannot build its own stops every rank, none waits
    for it in a collective; an incomplete checkpoint is one error naming what is missing
    everywhere (or, with ``strict=False``, a warning of what was initialized)."""
    model = config.model
    if config.factory is None and not isinstance(model, CapturedModel):
        return model  # built by the caller: nothing of it can fail here
    report: LoadReport | None = None
    failure: Exception | None = None
    try:
        if config.factory is not None:
            # Built on the CPU, as ``factory()`` would be, then moved: the same weights as
            # Pipe(factory()) on any devices (generators of other device types differ).
            recording, config.recording = config.recording, None  # freed once replayed
            if recording is None:
                raise RuntimeError("internal error: the model was placed twice")
            model = replay_layers(model, recording, seed=init_seed, layers=layers, tied=tied)
        elif isinstance(model, CapturedModel):
            report = materialize_units(model, layers, model.origin) if on_meta(model) else None
            if report is None or report.complete or not model.origin.strict:
                fit_devices(model, _layer_devices(config), layers)
    except Exception as error:
        failure = error
    said = None if failure is None else f"{type(failure).__name__}: {failure}"
    mine = None if report is None else asdict(report)  # plain values across processes
    everyone = ranks.gather((mine, said), "what each rank built")
    if failure is not None:
        raise failure
    for rank, (_, message) in enumerate(everyone):
        if message is not None:
            raise PipelineError(
                f"rank {rank} could not build its stages, so no rank starts: {message}", rank=rank
            )
    reports = [LoadReport(**r) for r, _ in everyone if r is not None]
    if reports and not LoadReport.merged(reports).complete:
        if model.origin.strict:
            raise LoadReport.merged(reports).error()
        if report is not None and not report.complete:
            warnings.warn(report.warning(), stacklevel=4)
    return model


def _layer_devices(config: Configuration) -> list[torch.device]:
    stages = zip(config.stage_devices, config.balance, strict=True)
    return [device for device, size in stages for _ in range(size)]


def capture_device(devices: Sequence[Any] | None, group: Any) -> torch.device:
    """The device a model is captured for when Pipe's ``devices`` and ``group`` are these:
    the first stage's (:func:`gpipe.frontend.capture.fit_devices` captures again for the
    others' types, if they differ)."""
    return torch.device(devices[0]) if devices else default_device(group)


def tie(
    config: Configuration, placed: Placed, tied: Sequence[Sequence[str]]
) -> TiedParameters | None:
    """The tied weights' copies, one per holding stage (None when nothing is tied)."""
    if not tied:
        return None
    return TiedParameters(
        placed.model,
        tied,
        stage_of_layer=placed.stage_of_name,
        local_stages={stage.index for stage in placed.stages},
        devices=config.stage_devices,
    )


@dataclass
class Wiring:
    """How the stages talk: to other ranks, to their replicas, and the runtime over them."""

    transport: Any
    reducer: GradientReducer | ShardedStages | None  # over the replicas, once per step
    sharded: ShardedStages | None
    runtime: Runtime


def wire(
    config: Configuration,
    placed: Placed,
    ranks: PipelineGroup,
    tied: TiedParameters | None,
    *,
    data_parallel_group: Any,
    timeout: float,
) -> Wiring:
    """The transport between ranks, the reduction over replicas (plain or sharded), the
    runtime; then the tied copies made equal."""
    transport = ranks.connect(config.schedule, config.stage_devices, placed.routes)
    sharded = reducer = None
    if config.layout.shard:
        schedule, microbatches = config.schedule, range(config.schedule.num_microbatches)
        split = {  # stages whose W computes the weight gradients apart
            stage.index
            for stage in placed.stages
            if any(schedule.splits_backward(stage.index, m) for m in microbatches)
        }
        reducer = sharded = ShardedStages(
            placed.stages, data_parallel_group, timeout=timeout, mode=config.layout.shard,
            split_stages=split,
        )  # fmt: skip
        if tied is not None:
            tied.rebind()  # the copies are DTensor shards now
    elif data_parallel_group is not None:
        reducer = GradientReducer(placed.stages, data_parallel_group, timeout=timeout)
    runtime = Runtime(
        config.schedule,
        {stage.index: stage for stage in placed.stages},
        transport,
        routes=placed.routes,
        before_final_backward=reducer.arm if reducer else None,
        after_backward=reducer.stage_done if reducer else None,
    )
    if tied is not None:
        ranks.tie(tied)
    return Wiring(transport, reducer, sharded, runtime)
