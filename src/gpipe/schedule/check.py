"""The schedule checker: every dependency, completeness, and freedom from deadlock.

:func:`check` is what :meth:`gpipe.schedule.Schedule.validate` runs. It checks, in this
order: sizes; each action's type, ranges, rank and uniqueness; that every stage runs ``F``
and ``B`` of every micro-batch; the order of dependent actions on the same rank; and, by
running the ranks' program counters under the communication model below, that no two
ranks wait on each other. Linear in the number of actions; the first offending action is
named, with a remedy.

Communication model. Hand-offs between stages on the same rank never block. Between ranks
a send is a rendezvous: it completes only once the receiving rank has posted the matching
receive, and the sender computes nothing until it has. A rank keeps the receives of its
next ``recv_ahead`` (default :data:`RECV_AHEAD` = 2) actions posted: after computing action
j it posts j's sends together with the receive of action j+2 (the one of j+1 is already
up), as one ``batch_isend_irecv``. One action ahead is what 1F1B needs (it is Megatron's
``send_forward_recv_backward``: with strictly one transfer at a time, rank 0 sending ``F1``
and rank 1 sending ``B0`` would wait on each other forever); Megatron's interleaved 1F1B
exchanges a forward's and a backward's tensors in one batch and needs two. On a backend
whose operations proceed independently (gloo), a runtime that posts receives earlier, or
whose sends do not block (``isend``), can only make more progress, so a schedule that
passes is safe for it too. A backend that runs a process's operations in issue order
(NCCL) is different; where the transport posts receives for it is decided by
:mod:`gpipe.schedule.comm_plan`.

A schedule with ``buffered_sends`` is checked under the model of gpipe's own transports
instead: a send never blocks its rank (``gpipe.transport.distributed`` waits for it
at the step's end), so only a cycle of ranks each waiting to *receive* deadlocks. The V schedules
need it: in their warm-up rank 0 sends forwards that rank 1 takes only after its own
turn of the V, about 3K actions later, beyond any fixed ``recv_ahead``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from gpipe.schedule.actions import Action, Kind, ScheduleError

__all__ = ["RECV_AHEAD", "check"]

RECV_AHEAD = 2  # receives each rank keeps posted, counted in actions (see above)

# Integer codes index flat per-kind arrays in the checker (faster than hashing actions).
_F, _B, _W = 0, 1, 2
_CODE = {Kind.FORWARD: _F, Kind.BACKWARD: _B, Kind.WEIGHT: _W}
_KIND = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)
_WHY = {  # (kind, kind of the input it needs) -> the dependency in words
    (_F, _F): "it needs the previous stage's output",
    (_B, _F): "a stage's backward follows its forward",
    (_B, _B): "it needs the next stage's input gradient",
    (_W, _B): "the weight gradient follows the input gradient",
}
_MAX_LINES = 8  # stuck ranks listed in a deadlock message

Slot = tuple[int, int]  # (rank, position in that rank's list)


class _Checker:
    """One validation pass; see :func:`check`."""

    def __init__(self, schedule: Any, recv_ahead: int) -> None:
        self.s = schedule
        self.recv_ahead = recv_ahead
        self.S, self.M = schedule.num_stages, schedule.num_microbatches
        self.where: list[list[Slot | None]] = []  # [code][stage * M + mb] -> slot
        self.inbound: list[list[Slot | None]] = []  # [rank][pos] -> cross-rank producer
        self.outbound: list[list[Slot | None]] = []  # [rank][pos] -> cross-rank consumer

    def run(self) -> None:
        self._check_shape()
        self._check_actions()
        self._check_complete()
        self._check_order()
        self._check_deadlock()

    def fail(self, message: str, action: Action | None = None) -> NoReturn:
        raise ScheduleError(f"schedule {self.s.name!r}: {message}", action=action)

    def _check_shape(self) -> None:
        s = self.s
        for label, value in (
            ("num_stages", s.num_stages),
            ("num_microbatches", s.num_microbatches),
        ):
            if not isinstance(value, int) or value < 1:
                self.fail(f"{label} must be a positive integer, got {value!r}")
        if s.num_ranks < 1:
            self.fail("actions has no rank lists; give one list of actions per rank")
        if len(s.stage_to_rank) != s.num_stages:
            self.fail(
                f"stage_to_rank has {len(s.stage_to_rank)} entries but num_stages is "
                f"{s.num_stages}; give the rank of every stage"
            )
        for stage, rank in enumerate(s.stage_to_rank):
            if not isinstance(rank, int) or not 0 <= rank < s.num_ranks:
                self.fail(
                    f"stage_to_rank[{stage}] = {rank!r} is not a rank of this schedule "
                    f"(0..{s.num_ranks - 1}, one per action list)"
                )
        idle = sorted(set(range(s.num_ranks)) - set(s.stage_to_rank))
        if idle:
            self.fail(f"rank {idle[0]} holds no stage; drop its action list or give it a stage")

    def _check_actions(self) -> None:
        s, S, M = self.s, self.S, self.M
        where: list[list[Slot | None]] = [[None] * (S * M) for _ in _KIND]
        for rank, acts in enumerate(s.actions):
            for pos, a in enumerate(acts):
                at = f"rank {rank}, position {pos}"
                if not isinstance(a, Action) or a.kind not in _CODE:
                    self.fail(f"{at}: {a!r} is not an Action (use Action.parse('F0@1'))")
                if not isinstance(a.stage, int) or not 0 <= a.stage < S:
                    self.fail(f"{at}: {a} names stage {a.stage!r}, outside 0..{S - 1}", a)
                if not isinstance(a.microbatch, int) or not 0 <= a.microbatch < M:
                    self.fail(
                        f"{at}: {a} names micro-batch {a.microbatch!r}, outside 0..{M - 1} "
                        f"(num_microbatches={M})",
                        a,
                    )
                owner = s.stage_to_rank[a.stage]
                if owner != rank:
                    self.fail(
                        f"{at}: {a} is listed on rank {rank} but stage {a.stage} is held by "
                        f"rank {owner}; move it to rank {owner}'s list",
                        a,
                    )
                slots = where[_CODE[a.kind]]
                key = a.stage * M + a.microbatch
                if (first := slots[key]) is not None:
                    self.fail(
                        f"{at}: {a} appears twice (first at rank {first[0]}, position "
                        f"{first[1]}); each action runs exactly once",
                        a,
                    )
                slots[key] = (rank, pos)
        self.where = where

    def _check_complete(self) -> None:
        M = self.M
        for code in (_F, _B):
            missing = [k for k, slot in enumerate(self.where[code]) if slot is None]
            if missing:
                a = Action(_KIND[code], *divmod(missing[0], M))
                more = f" ({len(missing) - 1} more {a.kind} missing)" if len(missing) > 1 else ""
                self.fail(
                    f"{a} is missing{more}: every stage runs F and B once for each micro-batch "
                    f"0..{M - 1}; add it to rank {self.s.stage_to_rank[a.stage]}'s list",
                    a,
                )

    def _check_order(self) -> None:
        """Inputs produced on the same rank must come earlier in its list; link the others."""
        S, M, where = self.S, self.M, self.where
        for rank, acts in enumerate(self.s.actions):
            ins: list[Slot | None] = [None] * len(acts)
            outs: list[Slot | None] = [None] * len(acts)
            for pos, a in enumerate(acts):
                code, s, m = _CODE[a.kind], a.stage, a.microbatch
                # Inputs (kind, stage); the first one may come from another rank.
                if code == _F:
                    inputs = [(_F, s - 1)] if s > 0 else []
                    consumer = (_F, s + 1) if s < S - 1 else None
                elif code == _B:
                    inputs = [(_B, s + 1)] if s < S - 1 else []
                    inputs.append((_F, s))
                    consumer = (_B, s - 1) if s > 0 else None
                else:
                    inputs, consumer = [(_B, s)], None
                for dep_code, dep_stage in inputs:
                    dep_rank, dep_pos = where[dep_code][dep_stage * M + m]  # type: ignore[misc]
                    if dep_rank != rank:
                        ins[pos] = (dep_rank, dep_pos)
                    elif dep_pos > pos:
                        dep = Action(_KIND[dep_code], dep_stage, m)
                        self.fail(
                            f"rank {rank}, position {pos}: {a} runs before {dep} (position "
                            f"{dep_pos}), but {_WHY[code, dep_code]}; move {a} after {dep}",
                            a,
                        )
                if consumer is not None:
                    slot = where[consumer[0]][consumer[1] * M + m]
                    if slot is not None and slot[0] != rank:
                        outs[pos] = slot
            self.inbound.append(ins)
            self.outbound.append(outs)

    def _check_deadlock(self) -> None:
        """Run the ranks' program counters with rendezvous sends (see the module docstring)."""
        acts, inbound, outbound = self.s.actions, self.inbound, self.outbound
        R = self.s.num_ranks
        lengths = [len(a) for a in acts]
        pc = [0] * R
        computed = [False] * R  # has rank r computed acts[r][pc[r]] (and now waits to send)?

        def produced(rank: int, pos: int) -> bool:
            return pc[rank] > pos or (pc[rank] == pos and computed[rank])

        buffered = getattr(self.s, "buffered_sends", False)

        def receiving(rank: int, pos: int) -> bool:
            # Posted: positions up to pc + self.recv_ahead - 1, one more once pc is computed.
            return buffered or pc[rank] + computed[rank] + self.recv_ahead - 1 >= pos

        pending, queued = list(range(R)), [True] * R
        while pending:
            r = pending.pop()
            queued[r] = False
            woken = []
            while pc[r] < lengths[r]:
                pos = pc[r]
                if not computed[r]:
                    src = inbound[r][pos]
                    if src is not None and not produced(*src):
                        break
                    computed[r] = True
                    if (dst := outbound[r][pos]) is not None:
                        woken.append(dst[0])  # its receive may now complete
                    ahead = pos + self.recv_ahead  # the receive posted just now
                    if ahead < lengths[r] and (src := inbound[r][ahead]) is not None:
                        woken.append(src[0])  # its send may now complete
                dst = outbound[r][pos]
                if dst is not None and not receiving(*dst):
                    break
                pc[r] += 1
                computed[r] = False
            for other in woken:
                if not queued[other]:
                    queued[other] = True
                    pending.append(other)

        if any(pc[r] < lengths[r] for r in range(R)):
            self._report_deadlock(pc, computed)

    def _report_deadlock(self, pc: list[int], computed: list[bool]) -> None:
        """Fail at the first rank stuck with its program counter at pc, naming who waits on
        whom."""
        acts, inbound, outbound = self.s.actions, self.inbound, self.outbound
        lengths = [len(a) for a in acts]
        stuck = [r for r in range(len(acts)) if pc[r] < lengths[r]]

        def state(rank: int) -> str:
            if pc[rank] == lengths[rank]:
                return "done"
            doing = "sending" if computed[rank] else "receiving"
            return f"at {acts[rank][pc[rank]]} ({doing})"

        lines = []
        for r in stuck[:_MAX_LINES]:
            pos = pc[r]
            if computed[r]:
                b, q = outbound[r][pos]  # type: ignore[misc]
                wait = f"waits to send to {acts[b][q]} on rank {b}"
            else:
                b, q = inbound[r][pos]  # type: ignore[misc]
                wait = f"waits to receive from {acts[b][q]} on rank {b}"
            lines.append(f"rank {r} at {acts[r][pos]} (position {pos}) {wait}, {state(b)}")
        if len(stuck) > _MAX_LINES:
            lines.append(f"... and {len(stuck) - _MAX_LINES} more ranks")
        first = acts[stuck[0]][pc[stuck[0]]]
        self.fail(
            f"deadlock at {first}: with blocking sends the ranks wait on each other:\n  - "
            + "\n  - ".join(lines)
            + "\nReorder so that each send meets a receive posted within "
            f"{self.recv_ahead} actions of where the receiving rank waits.",
            first,
        )


def check(schedule: Any, *, recv_ahead: int = RECV_AHEAD) -> None:
    """Raise :class:`ScheduleError`, naming the first offending action, if ``schedule``
    cannot run with ``recv_ahead`` receives posted per rank (see the module docstring).

    ``schedule`` is a :class:`gpipe.schedule.ir.Schedule` (which imports this module).
    """
    _Checker(schedule, recv_ahead).run()
