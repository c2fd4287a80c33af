"""Who stopped the pipeline: after a wait failed, the rank that caused it, not the one waited on.

A rank that times out waiting for rank 1 knows only that rank 1 did not answer; rank 1 may
itself be waiting for rank 2, which hung. Blaming the rank waited on blames an innocent
neighbour. So each rank whose wait fails leaves a statement in the job's store (torch's
``TCPStore``, which outlives broken process-group connections): the ranks it waited on, or
none when it failed by itself, and what it was doing. It then follows the statements from
the ranks it waited on: a rank that failed by itself is the cause, with its own words; a
rank that left no statement within a short grace (``grace``) stalled or died. The grace is
paid only on a failure, once per rank; a step that succeeds never touches the store.

A failed rank states its words first, then sends each peer that still expects a frame of the
step a ``NOTICE`` in its place (``PeerTransport.announce_failure``): a peer that takes one
raises :func:`heard`, one that finds the sender gone :func:`left`; every failed wait (a
message's receive, a row of the step, a collective) raises :func:`failure`: who waited, for
what, the rank that caused it, and the remedy.

Ranks are global (the store is the whole job's), as a user knows them. Statements are plain
values (``gpipe.transport.codec``): any process that reaches the store can write there, and
what is not a statement is ignored, with a warning.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from gpipe.base.errors import PipelineError
from gpipe.transport.codec import CodecError, decode, encode

__all__ = [
    "DIED", "REMEDY", "Verdict", "blame", "failure", "grace", "heard", "left", "said_by",
    "said_in", "state", "waited_out",
]  # fmt: skip

# What to do, in every error that names a rank: one that stopped answering, one that died.
REMEDY = (
    "(its own error, py-spy dump), or raise the timeout (Pipe(timeout=...), gpipe train "
    "--timeout) if it is only slow (data loading, a checkpoint write)"
)
DIED = "look for its own error, or why it was killed (out of memory?)"

_PREFIX = "gpipe/inquest/"
_last_blame: dict[int, float] = {}  # rank -> when it last waited for statements
_gone: list[bool] = []  # not empty once the store could not be reached


def grace(timeout: float) -> float:
    """How long a rank waits for the others' statements: ranks stuck on one another time
    out within moments of each other; a rank that never answers costs this once. At most
    3.5 s: a wait, its inquest, its notice to the peers (at most a second) and its error
    end within the timeout + 5 s."""
    return min(3.5, max(0.5, timeout / 2))


def waited_out(me: int, *, timeout: float) -> bool:
    """Whether rank ``me`` is in a failure of its own waits (it waited the timeout, or lost
    the rank it waited on, and looked for the cause within a timeout and a grace): it gives
    up on the pipeline then, rather than wait for that rank again in the failure's
    agreement, which doubled the time to the error."""
    return time.monotonic() - _last_blame.get(me, -1e9) < timeout + grace(timeout)


def _group_rank(group: Any, rank: int) -> int | None:
    """Global rank ``rank``'s rank in ``group``; None if it is not in it."""
    try:
        return dist.get_group_rank(group, rank)
    except (RuntimeError, ValueError):
        return None


def _named(group: Any, rank: int) -> str:
    """Global rank ``rank`` as a user knows it, and as ``group`` does where that differs (a
    data-parallel group's rank 1 is no process's name)."""
    local = _group_rank(group, rank)
    return f"rank {rank}" + ("" if local in (None, rank) else f" (rank {local} of this group)")


def said_in(error: BaseException) -> tuple[str, bool]:
    """What a failed transfer's error says (its first line, gloo's advice after the cause
    dropped), and whether it timed out, in gloo's words or NCCL's."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    text = text.split(" This is typically")[0]
    return text, "imed out" in text or "imeout" in text


def _store() -> Any:
    """The default process group's store, or None (no group, or a torch without it)."""
    if _gone:
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_initialized() else None
    except (ImportError, RuntimeError, ValueError):
        return None


def state(rank: int, waits_on: Iterable[int], what: str) -> None:
    """Leave rank ``rank``'s statement: the ranks it waited on when its wait failed, or
    none when it failed by itself (``what``: its error)."""
    store = _store()
    if store is None:
        return
    # The store's host may have died with its process: then there is no one to tell.
    try:
        store.set(_PREFIX + str(rank), encode((time.time(), tuple(waits_on), what)))
    except Exception:
        _gone.append(True)


@dataclass(frozen=True)
class Verdict:
    """The ranks that caused a failed wait: ``failed`` raised (rank -> its words),
    ``silent`` left no statement (stalled or died); ``path``: by rank, the ranks waited on
    through which it was reached, from the one the waiting rank waits on."""

    failed: dict[int, str]
    silent: list[int]
    path: dict[int, tuple[int, ...]]

    def via(self, culprit: int) -> str:
        """How the waiting rank came to wait on ``culprit``: " (rank 1 waits on it)", or ""."""
        chain = self.path.get(culprit, ())
        if not chain:
            return ""
        links = [f"rank {chain[0]} waits on"] + [f"rank {r}, which waits on" for r in chain[1:]]
        return f" ({' '.join(links)} it)"


def blame(me: int, waits_on: Iterable[int], what: str, *, timeout: float) -> Verdict:
    """After rank ``me``'s wait on ``waits_on`` failed (``what``: what it was doing): leave
    its statement, then follow the others' (for at most :func:`grace` seconds) to the ranks
    that caused it. A verdict that found nobody (no store) names no one."""
    waits_on = [r for r in waits_on if r != me]
    waited_before = waited_out(me, timeout=timeout)  # a later wait of the same failure
    _last_blame[me] = time.monotonic()
    if _store() is None:
        return Verdict({}, [], {})
    since = time.time() - timeout - grace(timeout)  # older statements: an earlier failure
    # A rank that stated a failure of its own is its cause: a wait of that failure (its
    # agreement, a peer that ended meanwhile) neither restates it nor waits for anyone.
    own = _read(me, since)
    waited_before = waited_before or (own is not None and not own[0])
    if not waited_before:  # else its first statement stands: the nearer to the cause
        state(me, waits_on, what)
    # The grace once per failure: a rank's later waits of the same failure (its agreement
    # on it) ask only what is known by now.
    deadline = time.monotonic() + (0.0 if waited_before else grace(timeout))
    statements: dict[int, tuple[tuple[int, ...], str]] = {}
    while True:
        path: dict[int, tuple[int, ...]] = {r: () for r in waits_on}
        frontier, pending = list(waits_on), []
        for rank in frontier:  # it grows as the statements lead on
            if rank not in statements and (said := _read(rank, since)) is not None:
                statements[rank] = said
            if rank not in statements:
                pending.append(rank)
                continue
            for other in statements[rank][0]:
                if other not in path and other != me:
                    path[other] = (*path[rank], rank)
                    frontier.append(other)
        failed = {r: statements[r][1] for r in path if r in statements and not statements[r][0]}
        if failed or not pending or _gone or time.monotonic() >= deadline:
            # The store gone: what is known so far; the silent ones stay unknown.
            return Verdict(failed, [] if failed or _gone else pending, path)
        time.sleep(0.05)


def failure(
    group: Any, rank: int, peers: list[int], what: str, error: BaseException, *, timeout: float,
    doing: str = "", timed_out: bool | None = None, cause_first: bool = False,
) -> PipelineError:  # fmt: skip
    """The one error of every failed wait (a receive, a collective, a row of the step): rank
    ``rank`` of ``group``, ``doing`` something, waited on its ranks ``peers`` for ``what``
    (``timed_out``: unless ``error`` says). It names the rank that caused it (:func:`blame`),
    which may be none of ``peers`` (``cause_first``: then it is named first), and the remedy."""
    me = dist.get_global_rank(group, rank)
    others = [dist.get_global_rank(group, r) for r in peers]
    text, said_timed_out = said_in(error)
    timed_out = said_timed_out if timed_out is None else timed_out
    where = _named(group, me) + (f", {doing}" if doing else "")
    late = f"did not complete within the pipeline's timeout of {timeout:g} s"
    stuck = f"{where}: {what} {late if timed_out else 'failed'}"
    verdict = blame(me, others, stuck, timeout=timeout)
    culprits = [*verdict.failed][:1] or verdict.silent or (others if len(others) == 1 else [])
    via = verdict.via(culprits[0]) if len(culprits) == 1 else ""
    who = " and ".join(_named(group, r) for r in culprits) or "a peer"
    if verdict.failed:  # each in its own words, the first the culprit
        causes = [f"rank {r} failed{verdict.via(r)}: {said}" for r, said in verdict.failed.items()]
        text = "; ".join([*causes, stuck])
    elif cause_first and via:  # the silent rank first: not the rank waited on
        text = f"rank {culprits[0]} did not answer (stalled, or died){via}: {stuck}; look for why "
        text += f"{who} stopped {REMEDY}"
    elif timed_out:
        text = f"{stuck}: {who}{via} did not arrive (stalled, or slower than that); look for why "
        text += f"it stopped {REMEDY}"
    else:
        text = f"{stuck}: {who} left the group (died or closed it): {text}; {DIED}"
    culprit = culprits[0] if len(culprits) == 1 else None
    rank = None if culprit is None else _group_rank(group, culprit)
    return PipelineError(text, rank=rank, global_rank=culprit)


def heard(group: Any, rank: int, peer: int, row: list[int]) -> PipelineError:
    """The error that ``peer``'s notice (its ``row``: the failed rank in ``group``, the
    global rank that caused it or -1, whether it gave up) makes rank ``rank`` raise: the
    peer's statement, in this rank's words where it gave up waiting on this rank."""
    origin, culprit, _ = row
    me, other = dist.get_global_rank(group, rank), dist.get_global_rank(group, peer)
    words = said_by(other) or f"rank {other} failed; its statement is not in the job's store"
    if culprit == me:
        return _gave_up(me, peer, other, words)
    return PipelineError(words, rank=origin, global_rank=None if culprit < 0 else culprit)


def left(group: Any, rank: int, peer: int, error: BaseException, doing: str, *,
         timeout: float) -> PipelineError:  # fmt: skip
    """Posting a transfer failed (``doing``: "send to", "receive from"): ``peer`` left. If
    it gave up on this pipeline, its words (which may name this rank); else it died."""
    me, other = dist.get_global_rank(group, rank), dist.get_global_rank(group, peer)
    said = said_by(other, timeout=timeout)
    if said is not None:
        return _gave_up(me, peer, other, said)
    return PipelineError(f"rank {me} could not {doing} rank {other}, which left (died, or gave "
                         f"up on this pipeline): {said_in(error)[0]}; {DIED}",
                         rank=peer, global_rank=other)  # fmt: skip


def _gave_up(me: int, peer: int, other: int, words: str) -> PipelineError:
    return PipelineError(f"rank {me}: rank {other} gave up on this pipeline: {words}",
                         rank=peer, global_rank=other)  # fmt: skip


def said_by(rank: int, *, timeout: float | None = None) -> str | None:
    """Rank ``rank``'s statement of its latest failure (at most a timeout and a grace old;
    None: any, where the rank announced a failure, which it states first), without waiting
    for one; None if it left none or the store is gone."""
    said = _read(rank, 0.0 if timeout is None else time.time() - timeout - grace(timeout))
    return None if said is None else said[1]


def _read(rank: int, since: float) -> tuple[tuple[int, ...], str] | None:
    """Rank ``rank``'s statement, if it wrote one since ``since`` and the store is there."""
    store, key = _store(), _PREFIX + str(rank)
    try:
        data = store.get(key) if store is not None and store.check([key]) else None
    except Exception:
        _gone.append(True)  # torch logs each failed call: try no more in this process
        return None
    if data is None:
        return None
    try:
        said = decode(data)
    except CodecError as error:
        said = error
    if not (type(said) is tuple and len(said) == 3 and type(said[0]) is float
            and type(said[1]) is tuple and all(type(r) is int for r in said[1])
            and type(said[2]) is str):  # fmt: skip
        warnings.warn(f"gpipe: the job's store holds something else than rank {rank}'s "
                      f"statement under {key!r}, ignored ({str(said)[:200]}): another process "
                      "wrote there (the store takes any connection: docs/reliability.md)",
                      RuntimeWarning, stacklevel=2)  # fmt: skip
        return None
    written, waits_on, what = said
    return (waits_on, what) if written >= since else None
