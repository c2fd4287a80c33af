"""The fault matrix's security rows (``benchmarks/faults.py``): what a process not of the job,
or a value that is not plain data, can do to a run. Each case's rank code is here too."""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fault_jobs as jobs

import gpipe
from gpipe.parallel.launch import launch
from gpipe.transport.inquest import grace
from injected_faults import Stall, _outcome
from transport.intruders import Marker, trains_with_intruders

TIMEOUT = 5.0

SECTION = """
## What is refused, and what stays yours to protect

Nothing a process receives is run: message descriptions, the failure inquest's
statements in the job's store (a failure's words) and the values ranks exchange while building
(configuration checks, the run's options, memory reports, timelines) travel as plain values
in one fixed, versioned layout (`gpipe.transport.codec`), never pickled. What is not such a
value is refused: on the sending side with the type named and the remedy, on the receiving
side as not gpipe's format (a statement planted in the store is ignored, with a warning).
The same-host sockets take a connection only from a process of the job's user
(`SO_PEERCRED`) presenting the listener's token, 32 random bytes shared through the process
group's own all-gather; anything else is closed and reported with its uid or pid, and never
makes the job change transport: `transport='auto'` falls back to the process group only
where the sockets cannot exist (ranks on several machines, stages off the CPU, no Unix
sockets), and says so in a log line (logger `gpipe.transport.choice`, level INFO).
A checkpoint is data too: DCP's `.metadata`, which torch pickles, is never unpickled
(`gpipe.parallel.dcp_metadata` walks its opcodes and builds only DCP's own types from a fixed
schema; any other opcode, global or field refuses the checkpoint, naming the file and what
it holds), and the objects DCP stores load with `weights_only=True`.

Yours to protect, as with any `torch.distributed` job: the job's store (torch's `TCPStore`)
and gloo's or NCCL's connections take any process that reaches their port, without
authentication. Whoever reaches them can stop or disturb the job (delete keys, break the
rendezvous); gpipe runs nothing it reads there, but torchrun's own elastic rendezvous keeps
its state pickled in its store, and DCP's collective save exchanges its plans between ranks
through torch's object collectives, which pickle. On one machine, keep other users off it or
run the job in its own network namespace; across machines, keep MASTER_ADDR's port and the
ranks' ports on a private network (a firewall, a VPN, the cluster's own fabric).
"""


def planted_statement(rank: int, timeout: float, marker: str) -> dict:
    """Rank 1 hangs in its first forward; a pickle (unpickled, it would create ``marker``)
    sits in the job's store under rank 1's inquest key, where any process that reaches the
    store's port can write. What each rank raised, and the warnings."""
    torch.set_num_threads(1)
    from torch.distributed.distributed_c10d import _get_default_store

    stall = Stall(at=1, seconds=timeout + grace(timeout) + 3)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), stall)
    pipe = gpipe.Pipe(model, balance=[2, 2], chunks=2, group=dist.group.WORLD, timeout=timeout)
    if rank == 0:
        _get_default_store().set("gpipe/inquest/1", pickle.dumps(Marker(marker)))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = _outcome(lambda: pipe.step(x, y, F.mse_loss))
    return {**outcome, "warnings": [str(w.message) for w in caught]}


class _Unsendable(nn.Module):
    def forward(self, x):
        return x, object()


class _First(nn.Module):
    def forward(self, pair):
        return pair[0]


def unsendable(rank: int, timeout: float) -> dict:
    """Stage 0's output holds an ``object()``: what each rank raised, and when."""
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 8), _Unsendable(), _First(), nn.Linear(8, 8))
    pipe = gpipe.Pipe(model, balance=[2, 2], chunks=2, group=dist.group.WORLD, timeout=timeout)
    return _outcome(lambda: pipe.step(torch.randn(4, 8), torch.randn(4, 8), F.mse_loss))


def _case(fn, args):
    started = time.monotonic()
    outcomes = launch(jobs.on_carrier, 2, args=(jobs.CARRIER, fn, *args), timeout=TIMEOUT + 30)
    wall = time.monotonic() - started
    types = ",".join(str(o.get("type")) for o in outcomes)
    worst = max(o.get("seconds", 0.0) for o in outcomes)
    return outcomes, worst, wall, types, len(multiprocessing.active_children())


def rows_security(work: Path) -> list[tuple]:
    rows = []
    marker = work / "ran"
    outcomes, worst, wall, types, left = _case(planted_statement, (TIMEOUT, str(marker)))
    said = outcomes[0]["message"]
    # inquest.failure's words for a rank that never answered, as a neighbour or further on
    named = any(f"rank 1 {words}" in said for words in ("did not arrive", "did not answer"))
    warned = any("something else than rank 1's statement" in w for w in outcomes[0]["warnings"])
    rows.append((f"a pickle planted in the job's store under rank 1's inquest key, rank 1 hung "
                 f"(timeout {TIMEOUT:g} s) (before: unpickled in rank 0: the planted code ran)",
                 "nothing runs (no marker file); the statement is ignored with a warning and "
                 "rank 0 names rank 1 within timeout + grace + 5 s", outcomes[0]["seconds"], wall,
                 f"{types}; marker {'written' if marker.exists() else 'absent'}; "
                 f"{'warned' if warned else 'no warning'}", left,
                 not marker.exists() and named and warned
                 and outcomes[0]["seconds"] <= TIMEOUT + grace(TIMEOUT) + 5
                 and left == 0))  # fmt: skip
    if jobs.CARRIER == "sockets":  # the sockets' own listener: no such row on the group
        started = time.monotonic()
        outcomes = launch(trains_with_intruders, 2, args=(str(marker),), timeout=60)
        wall = time.monotonic() - started
        seen = outcomes[0]["intruders"]
        refused = [w for w in outcomes[0]["warnings"] if "refused a connection" in w]
        transports = ",".join(o["transport"] for o in outcomes)
        rows.append(("strangers connect to rank 0's same-host socket before rank 1 (a wrong "
                     "token, a pickle, as root a process of uid 65534) (before: read as a peer; "
                     "transport='auto' fell back to gloo in silence)",
                     "each is closed and reported (uid or pid); nothing runs; the job trains on "
                     "the sockets", 0.0, wall, f"transports {transports}; {len(refused)} of "
                     f"{len(seen)} reported, intruders saw {','.join(seen)}", left,
                     transports == "sockets,sockets" and len(refused) == len(seen) >= 2
                     and set(seen) == {"closed"} and not marker.exists()))  # fmt: skip
    outcomes, worst, wall, types, left = _case(unsendable, (TIMEOUT,))
    said = outcomes[0].get("message", "")
    rows.append(("a stage's output holds an object() (before: pickled to the next rank)",
                 "the sending rank raises at once naming the type and the remedy; every rank "
                 "within 1 s", worst, wall, f"{types}: {said[:160]}", left,
                 "object" in said and "send tensors or plain values" in said and worst <= 1.0
                 and left == 0))  # fmt: skip
    return rows


if __name__ == "__main__":
    import tempfile

    for name, promise, worst, wall, outcome, left, held in rows_security(
        Path(tempfile.mkdtemp(prefix="gpipe-security-"))
    ):  # these rows of docs/reliability.md alone
        print(f"| {name} | {promise} | {worst:.2f} | {wall:.2f} | {outcome} | {left} | "
              f"{'yes' if held else '**no**'} |")  # fmt: skip
