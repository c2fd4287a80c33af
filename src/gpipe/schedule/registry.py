"""The schedules gpipe knows by name, in one table: how each is built and where it applies.

Everything a name stands for — its builder, how many stages a rank holds under it (and the
default), the numbers of micro-batches it takes, whether it is built for measured costs —
is its :class:`ScheduleSpec` in :data:`SCHEDULES`; :func:`build_schedule` builds one by
name, and ``gpipe.layout.Layout`` asks the table which configurations are valid::

    >>> print(build_schedule("1f1b", num_ranks=2, num_microbatches=3))
    1f1b (2 stages, 3 micro-batches, 2 ranks)
    rank 0: F0@0 F1@0 B0@0 F2@0 B1@0 B2@0
    rank 1: F0@1 B0@1 F1@1 B1@1 F2@1 B2@1
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpipe.schedule.auto import PLACEMENTS, zb_auto
from gpipe.schedule.builders import (
    dualpipe_v,
    dualpipe_v_problem,
    fill_drain,
    interleaved_1f1b,
    interleaved_problem,
    one_f_one_b,
    zb_h1,
    zb_v,
)
from gpipe.schedule.ir import Schedule, ScheduleError

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "schedule_spec"]

_MANY = 2**31  # no upper bound on stages per rank


@dataclass(frozen=True)
class ScheduleSpec:
    """One named schedule: its builder and the configurations it applies to."""

    name: str
    build: Callable[..., Schedule]  # (num_ranks, num_microbatches[, virtual_stages=v], **options)
    summary: str  # one line, for --help and the docs
    virtual_stages: range  # stages per rank it places; the first is the default
    placement: str  # how it places them, in words
    takes_costs: bool = False  # built for measured costs and a memory limit (zb-auto)
    sizes_problem: Callable[[int, int, int], str] | None = None  # (K, M, v) -> why not, or ""

    @property
    def default_virtual_stages(self) -> int:
        return self.virtual_stages.start

    def problems(self, num_ranks: int, num_microbatches: int, virtual_stages: int) -> list[str]:
        """Why this schedule cannot run K ranks, M micro-batches and v stages per rank, in
        phrases that follow the settings they are about; none: it can."""
        if virtual_stages not in self.virtual_stages:
            if self.virtual_stages == range(1, 2):
                several = [n for n, s in SCHEDULES.items() if s.virtual_stages.stop > 2]
                remedy = f"; for several per rank use {', '.join(map(repr, several))}"
            elif virtual_stages == 1 and self.name == "interleaved-1f1b":
                remedy = "; with 1 it is plain '1f1b'"
            else:
                remedy = ""
            return [f"it places {self.placement}, not {virtual_stages}{remedy}"]
        problem = self.sizes_problem and self.sizes_problem(
            num_ranks, num_microbatches, virtual_stages
        )
        return [problem] if problem else []


_V = "2 stages per rank in a V (rank r holds stages r and 2K-1-r)"

SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "gpipe", fill_drain, "all forwards, then all backwards (GPipe)", range(1, 2),
            "one stage per rank",
        ),
        ScheduleSpec(
            "1f1b", one_f_one_b, "one forward, one backward (PipeDream-flush): less memory",
            range(1, 2), "one stage per rank",
        ),
        ScheduleSpec(
            "interleaved-1f1b", interleaved_1f1b,
            "1F1B over several stages per rank (Megatron-LM): a smaller bubble",
            range(2, _MANY), "2 or more stages per rank, stage s on rank s mod K",
            sizes_problem=interleaved_problem,
        ),
        ScheduleSpec(
            "zb-h1", zb_h1, "zero bubble at 1F1B's memory: input gradients before weight ones",
            range(1, 2), "one stage per rank",
        ),
        ScheduleSpec("zb-v", zb_v, "zero bubble on a V of 2 stages per rank", range(2, 3), _V),
        ScheduleSpec(
            "dualpipe-v", dualpipe_v, "DeepSeek's DualPipe folded into a V: forward-backward pairs",
            range(2, 3), _V, sizes_problem=lambda k, m, v: dualpipe_v_problem(k, m),
        ),
        ScheduleSpec(
            "zb-auto", zb_auto, "zero bubble searched for measured costs under a memory limit",
            range(min(PLACEMENTS), max(PLACEMENTS) + 1),
            "1 stage per rank, or 2 in a V (ZB-V's placement)", takes_costs=True,
        ),
    )
}  # fmt: skip


def schedule_spec(name: str) -> ScheduleSpec:
    """The table's entry for ``name``; :class:`ScheduleError` naming the known ones if none."""
    spec = SCHEDULES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return spec


def build_schedule(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    **options: Any,
) -> Schedule:
    """The schedule ``name`` (a key of :data:`SCHEDULES`) for ``num_ranks`` ranks.

    ``virtual_stages`` (stages per rank) defaults to the schedule's; it may be chosen for
    ``"interleaved-1f1b"`` (2 or more) and ``"zb-auto"`` (1, or 2 placed in a V).
    ``options`` go to ``"zb-auto"`` (``costs``, ``transfer``, ``memory_limit``, see
    ``gpipe.schedule.auto.zb_auto``)::

        build_schedule("interleaved-1f1b", num_ranks=4, num_microbatches=8, virtual_stages=2)
        build_schedule("zb-auto", num_ranks=4, num_microbatches=8,
                       costs=Costs(forward=1.0, backward=1.2, weight=0.8), memory_limit=4)
    """
    spec = schedule_spec(name)
    if options and not spec.takes_costs:
        raise ScheduleError(
            f"schedule {name!r} takes no options, got {', '.join(sorted(options))}; costs and "
            "a memory limit are for 'zb-auto'"
        )
    v = spec.default_virtual_stages if virtual_stages is None else virtual_stages
    if v not in spec.virtual_stages:  # the builder checks the sizes
        problem = spec.problems(num_ranks, num_microbatches, v)[0]
        raise ScheduleError(f"schedule {name!r}, virtual_stages={v!r}: {problem}")
    if len(spec.virtual_stages) > 1:  # the builder takes it
        options["virtual_stages"] = v
    return spec.build(num_ranks, num_microbatches, **options)
