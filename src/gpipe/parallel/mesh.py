"""The processes of a job: the world, its pipeline × data-parallel mesh, and collectives.

The layers above (the training job, the planner) use these instead of
``torch.distributed``, which only ``gpipe.parallel`` and ``gpipe.transport`` import. Every
collective is over the pipeline group, the data-parallel group or the world, through
``gpipe.parallel.collectives`` (each bounded by the job's timeout, named when it fails);
values are small host-side numbers and objects (losses, counts, traces, manifests).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpipe.parallel.collectives import Collectives
from gpipe.parallel.store import client, loopback, serve, this_attempt

__all__ = [
    "Mesh",
    "WorldError",
    "ensure_world",
    "group_size",
    "job_environment",
    "leave_world",
    "ping_pong",
    "world",
    "world_collectives",
]


def world() -> Any:
    """The group of every process of the job."""
    return dist.group.WORLD


def world_size() -> int:
    return dist.get_world_size()


def group_size(group: Any) -> int:
    """Processes in ``group``; ``None`` (no group) is one."""
    return 1 if group is None else dist.get_world_size(group)


def first_ranks(count: int) -> Any:
    """The group of ranks 0..count-1; every rank of the job must call this, in one order."""
    return dist.new_group(list(range(count)))


def barrier() -> None:
    dist.barrier()


class WorldError(RuntimeError):
    """This process cannot join its job: the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) is wrong, or the other processes did not come."""


_REMEDY = (
    "start every process with the same MASTER_ADDR and MASTER_PORT (rank 0's host and a "
    "free port) and its own RANK, or use torchrun, which sets them"
)


def job_environment() -> tuple[int, int, str, int]:
    """RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT of this process, checked: every problem
    in one :class:`WorldError`, before anything waits."""
    env, problems = os.environ, []
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        text = env.get(name)
        if text is None:
            problems.append(f"{name} is not set")
        elif not text.strip().isdigit():
            problems.append(f"{name}={text!r} is not a whole number")
        else:
            numbers[name] = int(text)
    rank, size, port = (numbers.get(n) for n in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    if size is not None and size < 1:
        problems.append(f"WORLD_SIZE={size}: a job has at least one process")
    elif rank is not None and size is not None and rank >= size:
        problems.append(f"RANK={rank} is not a rank of WORLD_SIZE={size} (ranks 0 to {size - 1})")
    if port is not None and not 0 < port < 65536:
        problems.append(f"MASTER_PORT={port} is not a TCP port (1 to 65535)")
    if not env.get("MASTER_ADDR"):
        problems.append("MASTER_ADDR is not set")
    if problems:
        raise WorldError(f"{'; '.join(problems)}: {_REMEDY}")
    return rank, size, env["MASTER_ADDR"], port


def ensure_world(backend: str = "gloo", timeout: float | None = None) -> int:
    """Join the job's process group (from torchrun's environment, or the same variables set
    by hand) unless joined; this rank. ``timeout`` (seconds) bounds the wait for the other
    processes and then every collective (torch's default: 30 minutes).

    A wrong environment, or processes that do not all come within ``timeout``, raise
    :class:`WorldError` naming what is wrong (which ranks are missing) and the remedy,
    instead of torch's own store or socket errors once its timeout has passed.
    """
    if dist.is_initialized():
        return dist.get_rank()
    rank, size, address, port = job_environment()
    limit = timedelta(seconds=1800 if timeout is None else timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent holds the store, and every process of this attempt has started.
        store = _attempt(rank, size, address, port, limit.total_seconds())
    else:
        store = _join(rank, size, address, port, limit.total_seconds())
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=limit)
    return dist.get_rank()


def _attempt(rank: int, size: int, address: str, port: int, timeout: float) -> Any:
    """torchrun's agent's store, in the namespace of this attempt (``store.this_attempt``)."""
    where = f"MASTER_ADDR={address}, MASTER_PORT={port}"
    try:
        return this_attempt(client(address, port, size, timeout), rank, size, timeout)
    except (RuntimeError, OSError) as error:  # TimeoutError is an OSError
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise WorldError(
            f"rank {rank} of WORLD_SIZE={size} could not join this attempt of the job at "
            f"{where} (torchrun's store): {text}; check that torchrun started every process"
        ) from None


def _join(rank: int, size: int, address: str, port: int, timeout: float) -> Any:
    """Rank 0's store, reached by every process, once all ``size`` of them are there."""
    where = f"MASTER_ADDR={address}, MASTER_PORT={port}"
    began = time.monotonic()
    # Said once, early, while a process waits: waiting in silence looks like a hang.
    note = threading.Timer(3.0, lambda: print(
        f"gpipe: rank {rank} of WORLD_SIZE={size} waits for the other processes at {where} "
        f"(at most {timeout:g} s)", file=sys.stderr, flush=True))  # fmt: skip
    note.daemon = True
    note.start()
    try:
        try:
            store = _store(rank, size, address, port, timeout)
        except (RuntimeError, OSError) as error:
            text = str(error).splitlines()[0] if str(error) else type(error).__name__
            if rank == 0:
                raise WorldError(
                    f"rank 0 could not open the job's store at {where}: {text}; choose a free "
                    "MASTER_PORT on rank 0's host (another job, or a second process with "
                    "RANK=0, may hold this one)"
                ) from None
            raise WorldError(
                f"rank {rank} could not reach rank 0 at {where} within {timeout:g} s: {text}; "
                "start the process with RANK=0 there, with the same MASTER_PORT"
            ) from None
        if store.add(f"gpipe/rank/{rank}", 1) > 1:
            raise WorldError(f"two processes of this job have RANK={rank}: {_REMEDY}")
        store.add("gpipe/joined", 1)
        while store.add("gpipe/joined", 0) < size:
            if time.monotonic() - began > timeout:
                missing = [r for r in range(size) if not store.check([f"gpipe/rank/{r}"])]
                shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
                raise WorldError(
                    f"rank {rank}: {size - len(missing)} of WORLD_SIZE={size} processes joined "
                    f"at {where} within {timeout:g} s; rank{'s' if len(missing) > 1 else ''} "
                    f"{shown} did not come: start "
                    f"{'it' if len(missing) == 1 else 'them'} with the same MASTER_ADDR and "
                    "MASTER_PORT, or lower WORLD_SIZE"
                )
            time.sleep(0.05)
    finally:
        note.cancel()
    return store


def _store(rank: int, size: int, address: str, port: int, timeout: float) -> Any:
    """Rank 0's store, or a client of it. Every process on this host (MASTER_ADDR a loopback
    address): it listens on loopback only (``gpipe.parallel.store``)."""
    local = loopback(address) if rank == 0 else None
    if local is not None:
        return serve(local, port, size, timeout)
    return dist.TCPStore(address, port, size, is_master=rank == 0,
                         timeout=timedelta(seconds=timeout), wait_for_workers=False)  # fmt: skip


def leave_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_collectives(timeout: float) -> Collectives:
    """The job's collectives over every process, each bounded by ``timeout`` seconds."""
    return Collectives(world(), timeout=timeout)


@dataclass(frozen=True)
class Mesh:
    """The world as ``replicas`` × ``stages``: a pipeline group and a data-parallel group,
    with their collectives (``everyone``, ``pipeline``, ``data``), each bounded by
    ``timeout`` seconds.

    Rank ``r`` is stage ``r % stages`` of replica ``r // stages``. ``dp`` and ``data`` are
    ``None`` with one replica.
    """

    stages: int
    replicas: int
    pp: Any
    dp: Any
    timeout: float

    @classmethod
    def build(cls, stages: int, replicas: int, *, timeout: float, device_type: str = "cpu") -> Mesh:
        if replicas == 1:
            return cls(stages, replicas, world(), None, timeout)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (replicas, stages), mesh_dim_names=("dp", "pp"))
        return cls(stages, replicas, mesh.get_group("pp"), mesh.get_group("dp"), timeout)

    @property
    def everyone(self) -> Collectives:
        return world_collectives(self.timeout)

    @property
    def pipeline(self) -> Collectives:
        return Collectives(self.pp, timeout=self.timeout)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp)

    def sum_over_pipeline(self, value: float, operation: str) -> float:
        total = torch.tensor([float(value)], dtype=torch.float64)
        return float(self.pipeline.all_reduce(total, operation))

    def mean_over_replicas(self, value: float, operation: str, *, doing: str = "") -> float:
        if self.dp is None:
            return value
        replicas = Collectives(self.dp, timeout=self.timeout)
        total = replicas.all_reduce(torch.tensor([float(value)], dtype=torch.float64), operation,
                                    doing=doing)  # fmt: skip
        return float(total) / self.replicas


def ping_pong(rank: int, sizes: Sequence[int], rounds: int) -> dict[int, float]:
    """One-way time of a message of each size between ranks 0 and 1 (half the median
    round trip); run in both processes, e.g. by ``gpipe.parallel.launch``."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.set_num_threads(1)
    out = {}
    for size in sizes:
        message = torch.zeros(max(1, size // 4), device=device)
        trips = []
        for _ in range(rounds + 3):
            start = time.perf_counter()
            if rank == 0:
                dist.send(message, 1)
                dist.recv(message, 1)
            else:
                dist.recv(message, 0)
                dist.send(message, 0)
            if device.type != "cpu":
                torch.cuda.synchronize(device)
            trips.append(time.perf_counter() - start)
        out[size] = statistics.median(trips[3:]) / 2
    return out
