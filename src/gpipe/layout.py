"""One configuration value, :class:`Layout`: how a pipeline is laid out, and whether it runs.

A layout is K pipeline ranks (``stages``: devices, or processes of one replica), each holding
``virtual_stages`` stages, M micro-batches per mini-batch (``chunks``), a schedule, a
re-materialization mode (``checkpoint``, recomputing ``checkpoint_layers`` layers at a
time or the whole stage) and R replicas of the pipeline (``replicas``), sharded or not
(``shard``: a mode of :data:`SHARD_MODES`). Which combinations are valid is decided here and
nowhere else:
:meth:`Layout.problems` lists every problem at once, each with its values and a remedy, and
:func:`layouts` enumerates the valid ones. ``Pipe``, ``gpipe train``'s configuration, the
planner and the capacity search all ask this module; what a named schedule allows comes
from its entry in ``gpipe.schedule.SCHEDULES``::

    >>> for problem in Layout(stages=4, chunks=6, schedule="interleaved-1f1b").problems():
    ...     print(problem[:77])
    schedule='interleaved-1f1b', virtual_stages=2, chunks=6 on 4 ranks: 6 micro-b
    >>> Layout(stages=4, chunks=8, schedule="zb-v").num_stages
    8
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from gpipe.base import remat
from gpipe.base.errors import PartitionError
from gpipe.base.microbatch import chunk_sizes
from gpipe.schedule import SCHEDULES, Schedule, build_schedule

__all__ = [
    "FLAGS", "KEYWORDS", "PIPE", "SHARD_MODES", "Layout", "Spelling", "check_choices",
    "even_balance", "layouts",
]  # fmt: skip

# How replicas shard a stage (FSDP2, ``gpipe.parallel.sharded``): "params" accumulates the
# step's gradients whole and reduce-scatters them once per step; "all" reduce-scatters each
# micro-batch's into the shards.
SHARD_MODES = ("params", "all")


@dataclass(frozen=True)
class Spelling:
    """How a problem names a setting, as its caller wrote it: Python keywords
    (``chunks=0``), ``gpipe``'s flags (``--chunks 0``), or ``Pipe``'s arguments, which count
    ranks by ``devices`` and replicas by ``data_parallel_group``."""

    style: str = "keywords"  # "keywords", "flags" or "pipe"

    @property
    def flags(self) -> bool:
        return self.style == "flags"

    def name(self, field: str) -> str:
        if self.flags:
            return "--" + field.replace("_", "-")
        if self.style == "pipe":
            return _PIPE_NAMES.get(field, field)
        return field

    def __call__(self, field: str, value: Any) -> str:
        """The setting ``field = value`` as the caller wrote it."""
        if self.flags:
            if isinstance(value, bool):
                return self.name(field) if value else "--no-" + field.replace("_", "-")
            if isinstance(value, list | tuple):
                value = ",".join(map(str, value))
            return f"{self.name(field)} {value}"
        if self.style == "pipe" and field == "stages":
            return f"{value} devices"
        if self.style == "pipe" and field == "replicas":
            return f"a data_parallel_group of {value}"
        return f"{field}={value!r}"


_PIPE_NAMES = {"stages": "the number of devices", "replicas": "data_parallel_group's size"}
KEYWORDS, FLAGS, PIPE = Spelling("keywords"), Spelling("flags"), Spelling("pipe")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def even_balance(layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible (earlier stages take the remainder)."""
    return chunk_sizes(layers, max(1, min(stages, layers)))


@dataclass(frozen=True, kw_only=True)
class Layout:
    """K ranks × v stages each, M micro-batches, a schedule, remat, R replicas (sharded?).

    * ``schedule``: a name from ``gpipe.schedule.SCHEDULES`` (``"gpipe"``, ``"1f1b"``,
      ``"interleaved-1f1b"``, ``"zb-h1"``, ``"zb-v"``, ``"dualpipe-v"``, ``"zb-auto"``) or a
      built ``Schedule``; ``virtual_stages`` defaults to the schedule's (2 for interleaved,
      where stage s lives on rank s mod K, and for the V schedules; 1 or 2 for zb-auto).
    * ``checkpoint``: ``"always"``, ``"except_last"`` (every micro-batch but the last, whose
      backward follows its forward at once) or ``"never"``; ``checkpoint_layers``: recompute
      that many layers at a time (nested checkpoints: the peak holds one group's
      activations, not the stage's, for one more forward without autograd). Zero-bubble
      schedules and stages with skip connections recompute whole.
    * ``shard`` (FSDP2 over the replicas, one unit per layer, gathered per layer for each
      forward and backward): ``"params"`` accumulates the step's gradients whole and
      reduce-scatters them once, P + 3P / R bytes per process with AdamW instead of 4P;
      ``"all"`` reduce-scatters each micro-batch's (M times the communication): 4P / R.
      None: every replica holds all.
    """

    stages: int = 1  # K: pipeline ranks
    chunks: int = 1  # M: micro-batches per mini-batch
    schedule: str | Schedule = "gpipe"
    virtual_stages: int | None = None  # stages per rank; None: the schedule's default
    checkpoint: str = "except_last"
    checkpoint_layers: int | None = None  # layers recomputed at a time; None: a whole stage
    replicas: int = 1  # R: data-parallel replicas of the pipeline
    shard: str | None = None  # a mode of SHARD_MODES: each stage sharded over the replicas

    def __post_init__(self) -> None:
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", self._default_virtual_stages())

    def _default_virtual_stages(self) -> int:
        if isinstance(self.schedule, Schedule):
            return max(1, self.schedule.num_stages // max(1, self.schedule.num_ranks))
        spec = SCHEDULES.get(self.schedule) if isinstance(self.schedule, str) else None
        return spec.default_virtual_stages if spec is not None else 1

    def to_dict(self) -> dict[str, Any]:
        """Its fields as plain values (a built schedule by its name): the one format a layout
        is written in (fingerprints, checkpoints' manifests, configuration files)."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "schedule": self.schedule_name
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Layout:
        """The layout of :meth:`to_dict`'s ``values`` (other keys are ignored: a manifest's
        ``balance``, a run configuration's other options)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    @classmethod
    def of_stages(cls, num_stages: int, **fields: Any) -> Layout:
        """The layout of ``num_stages`` pipeline stages (``fields``: the others but
        ``stages``), or :class:`PartitionError` when its ranks cannot hold them alike."""
        layout = cls(**fields)
        v = layout.virtual_stages
        if not (_positive_int(num_stages) and _positive_int(v) and num_stages % v == 0):
            raise PartitionError(
                f"{num_stages!r} stages cannot be placed {v!r} per rank (virtual_stages): "
                f"give a multiple of {v!r}"
            )
        return replace(layout, stages=num_stages // v)

    @property
    def num_stages(self) -> int:
        """Pipeline stages S = K × v: the entries of a balance."""
        return self.stages * self.virtual_stages

    @property
    def processes(self) -> int:
        return self.stages * self.replicas

    @property
    def schedule_name(self) -> str:
        return self.schedule.name if isinstance(self.schedule, Schedule) else str(self.schedule)

    def default_balance(self, layers: int) -> list[int]:
        """The cut used when none is given: the layers (a captured model's units) split as
        evenly as possible over the :attr:`num_stages` stages, by count, not by size or time
        (earlier stages take the remainder); ``balance="auto"`` profiles instead."""
        return even_balance(layers, self.num_stages)

    def label(self) -> str:
        """One line: ``K=2 v=2 R=2 sharded M=8 interleaved-1f1b except_last``."""
        virtual = f" v={self.virtual_stages}" if self.virtual_stages != 1 else ""
        sharded = {None: "", "all": " sharded"}.get(self.shard, f" sharded {self.shard}")
        replicas = f" R={self.replicas}{sharded}" if self.replicas > 1 else ""
        per = self.checkpoint_layers
        granularity = "" if per is None else f" per {per} layer{'s' if per != 1 else ''}"
        return (
            f"K={self.stages}{virtual}{replicas} M={self.chunks} {self.schedule_name} "
            f"{self.checkpoint}{granularity}"
        )

    # -- validity ----------------------------------------------------------------------------

    def problems(
        self,
        *,
        layers: int | None = None,
        balance: Sequence[int] | None = None,
        batch: int | None = None,
        spelling: Spelling = KEYWORDS,
    ) -> list[str]:
        """Every problem of this layout, one line each with its values and a remedy; none:
        it runs. ``layers``: the model's layers (units), to cut into ``num_stages`` stages;
        ``balance``: the cut, layers per stage; ``batch``: the global mini-batch."""
        say = spelling
        problems = []
        for field, what in (
            ("stages", "pipeline ranks"),
            ("chunks", "micro-batches"),
            ("virtual_stages", "stages per rank"),
            ("replicas", "replicas of the pipeline"),
        ):
            value = getattr(self, field)
            if not _positive_int(value):
                problems.append(f"{say.name(field)} must be a positive int ({what}), got {value!r}")
        problems += _unknown("checkpoint", self.checkpoint, say)
        sizes_ok = not problems
        problems += self._granularity_problems(say)
        if _unknown("shard", self.shard, say):
            problems += _unknown("shard", self.shard, say)
        elif self.shard and _positive_int(self.replicas) and self.replicas < 2:
            remedy = {
                "flags": " (or leave --shard out)",
                "pipe": ": pass data_parallel_group= (and group=), e.g. from "
                "gpipe.parallel.mesh.Mesh.build(stages, replicas, ...)",
            }.get(say.style, "")
            problems.append(
                f"{say('shard', self.shard)} shards each stage over its replicas: it needs "
                f"{say.name('replicas')} >= 2, got {self.replicas}{remedy}"
            )
        # The cut needs only the number of stages.
        shape_ok = _positive_int(self.stages) and _positive_int(self.virtual_stages)
        problems += self._schedule_problems(say, check_sizes=sizes_ok)
        if balance is not None:
            problems += self._balance_problems(balance, layers, say, shape_ok)
        elif layers is not None and shape_ok and self.num_stages > layers:
            most = max(1, layers // self.virtual_stages)
            problems.append(
                f"{self._stage_count(say)} needs at least {self.num_stages} layers (one per "
                f"stage), but the model has {layers}: use "
                + (f"{say.name('stages')} <= {most}" if say.flags else f"at most {most} ranks")
            )
        if batch is not None and sizes_ok:
            problems += self._batch_problems(batch, say)
        return problems

    def _granularity_problems(self, say: Spelling) -> list[str]:
        per = self.checkpoint_layers
        if per is None:
            return []
        if not _positive_int(per):
            return [
                f"{say.name('checkpoint_layers')} must be a positive int (layers recomputed at "
                f"a time) or None (a whole stage), got {per!r}"
            ]
        if self.checkpoint == "never":
            return [
                f"{say('checkpoint_layers', per)} says how a re-materialized micro-batch is "
                f"recomputed, but {say('checkpoint', 'never')} re-materializes none: use "
                f"{say.name('checkpoint')} always (or except_last), or leave "
                f"{say.name('checkpoint_layers')} out"
            ]
        return []

    def _schedule_problems(self, say: Spelling, *, check_sizes: bool) -> list[str]:
        if isinstance(self.schedule, Schedule):
            s = self.schedule
            if check_sizes and (s.num_stages, s.num_ranks, s.num_microbatches) != (
                self.num_stages,
                self.stages,
                self.chunks,
            ):
                return [
                    f"schedule {s.name!r} is for {s.num_stages} stages on {s.num_ranks} ranks and "
                    f"{s.num_microbatches} micro-batches, but this layout has {self.num_stages} "
                    f"stages on {self.stages} ranks and {say('chunks', self.chunks)}"
                ]
            return []
        unknown = _unknown("schedule", self.schedule, say)
        if unknown or not check_sizes:
            return unknown
        spec = SCHEDULES[self.schedule]
        settings = ", ".join(
            say(field, getattr(self, field)) for field in ("schedule", "virtual_stages", "chunks")
        )
        return [
            f"{settings} on {self.stages} ranks: {problem}"
            for problem in spec.problems(self.stages, self.chunks, self.virtual_stages)
        ]

    def _stage_count(self, say: Spelling) -> str:
        """How the caller set the number of stages: ``2 devices × virtual_stages=2``."""
        if self.virtual_stages == 1:
            return say("stages", self.stages)
        return f"{say('stages', self.stages)} × {say('virtual_stages', self.virtual_stages)}"

    def _balance_problems(
        self, balance: Sequence[int], layers: int | None, say: Spelling, shape_ok: bool
    ) -> list[str]:
        entries = list(balance)
        if not entries:
            return ["balance is empty: give the number of layers of each stage, e.g. [2, 2]"]
        if not all(_positive_int(b) for b in entries):
            return [
                f"every balance entry must be a positive int (layers in that stage), got "
                f"{say('balance', entries)}"
            ]
        problems = []
        if shape_ok and len(entries) != self.num_stages:
            problems.append(
                f"{say('balance', entries)} has {len(entries)} entries, but "
                f"{self._stage_count(say)} make {self.num_stages} stages: give one entry per "
                "stage"
            )
        if layers is not None and sum(entries) != layers:
            problems.append(
                f"{say('balance', entries)} sums to {sum(entries)} layers, but the model has "
                f"{layers}; e.g. {say('balance', even_balance(layers, len(entries)))} covers "
                "them all"
            )
        return problems

    def _batch_problems(self, batch: int, say: Spelling) -> list[str]:
        if batch % self.replicas:
            return [f"{say('batch', batch)} must be divisible by {say('replicas', self.replicas)}"]
        if batch // self.replicas < self.chunks:
            return [
                f"each replica's batch ({batch // self.replicas}) must have at least "
                f"{say('chunks', self.chunks)} samples: one per micro-batch; raise "
                f"{say.name('batch')} or lower {say.name('chunks')}"
            ]
        return []

    def check(self, **context: Any) -> Layout:
        """This layout, or :class:`PartitionError` listing every problem (``context``: the
        keyword arguments of :meth:`problems`)."""
        problems = self.problems(**context)
        if problems:
            raise PartitionError(
                "invalid pipeline configuration:\n" + "\n".join(f"- {p}" for p in problems)
            )
        return self

    # -- what it implies ---------------------------------------------------------------------

    def build_schedule(self, **options: Any) -> Schedule:
        """The schedule this layout runs, validated (``options``: zb-auto's costs and limit)."""
        if isinstance(self.schedule, Schedule):
            return self.check().schedule.validate()  # type: ignore[union-attr]
        self.check()
        return build_schedule(
            self.schedule,
            num_ranks=self.stages,
            num_microbatches=self.chunks,
            virtual_stages=self.virtual_stages,
            **options,
        )

    def canonical(self) -> Layout:
        """The simplest layout that trains exactly as this one in no more time or memory: one
        rank runs every schedule in the same time, but ``gpipe`` holds all M micro-batches'
        activations and ``1f1b`` one (gradient accumulation), the least of any other schedule,
        which becomes ``1f1b``; with one micro-batch both are ``gpipe``, and ``except_last``
        is ``never``."""
        simpler = self
        if self.stages == 1:
            one_at_a_time = self.schedule != "gpipe" and self.chunks > 1
            name = "1f1b" if one_at_a_time else "gpipe"
            if (self.schedule, self.virtual_stages) != (name, 1):
                simpler = replace(simpler, schedule=name, virtual_stages=1)
        if self.chunks == 1 and self.checkpoint == "except_last":
            simpler = replace(simpler, checkpoint="never", checkpoint_layers=None)
        return simpler


def _unknown(field: str, value: Any, say: Spelling = KEYWORDS) -> list[str]:
    """The problem of a name that ``field`` (schedule, checkpoint, shard) does not take."""
    if field == "schedule":
        if isinstance(value, Schedule) or (isinstance(value, str) and value in SCHEDULES):
            return []
        return [f"unknown schedule {value!r}; known: {', '.join(SCHEDULES)}"]
    if field == "checkpoint":
        if value in remat.REMAT_MODES:
            return []
        return [f"{say.name(field)} must be one of {', '.join(remat.REMAT_MODES)}, got {value!r}"]
    if value is None or value in SHARD_MODES:
        return []
    return [
        f"{say.name(field)} must be one of {', '.join(SHARD_MODES)} (or "
        f"{'left out' if say.flags else 'None'}: every replica holds all), got {value!r}"
    ]


def check_choices(
    *,
    schedules: Iterable[Any] = (),
    checkpoints: Iterable[Any] = (),
    shard: Iterable[Any] = (),
) -> None:
    """:class:`PartitionError` listing every name among these choices (of a search) that no
    layout takes, e.g. an unknown schedule."""
    chosen = {"schedule": schedules, "checkpoint": checkpoints, "shard": shard}
    problems = [p for field, values in chosen.items() for v in values for p in _unknown(field, v)]
    if problems:
        raise PartitionError("invalid choices:\n" + "\n".join(f"- {p}" for p in problems))


def layouts(
    *,
    stages: Iterable[int],
    chunks: Iterable[int],
    schedules: Iterable[str],
    checkpoints: Iterable[str] = remat.REMAT_MODES,
    checkpoint_layers: Iterable[int | None] = (None,),
    virtual_stages: Iterable[int] | None = None,
    replicas: Iterable[int] = (1,),
    shard: Iterable[str | None] = (None,),
    processes: int | None = None,
    layers: int | None = None,
    batch: int | None = None,
) -> list[Layout]:
    """Every valid layout of these choices, once: combinations with a problem
    (:meth:`Layout.problems` with ``layers`` and ``batch``), with more than ``processes``
    processes, or that train as a simpler one does (:meth:`Layout.canonical`) are left out.
    ``virtual_stages`` None: each schedule's default only; ``shard``: modes of
    :data:`SHARD_MODES`, None for replicas that hold all. A name no layout takes (an
    unknown schedule) raises (:func:`check_choices`)."""
    v_choices = None if virtual_stages is None else list(virtual_stages)
    schedules, checkpoints, shard = list(schedules), list(checkpoints), list(shard)
    check_choices(schedules=schedules, checkpoints=checkpoints, shard=shard)
    found = []
    for k, r, sharded, m, name, mode, per in itertools.product(
        stages, replicas, shard, chunks, schedules, checkpoints, checkpoint_layers
    ):
        spec = SCHEDULES.get(name)
        v_list = v_choices or [spec.default_virtual_stages if spec else 1]
        for v in v_list:
            layout = Layout(
                stages=k, chunks=m, schedule=name, virtual_stages=v, checkpoint=mode,
                checkpoint_layers=per, replicas=r, shard=sharded,
            )  # fmt: skip
            if processes is not None and layout.processes > processes:
                continue
            if layout.problems(layers=layers, batch=batch) or layout.canonical() != layout:
                continue
            found.append(layout)
    return found
