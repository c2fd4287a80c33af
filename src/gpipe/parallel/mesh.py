"""The processes of a job: the world, its pipeline × data-parallel mesh, and collectives.

The layers above (the training job, the planner) use these instead of
``torch.distributed``, which only ``gpipe.parallel`` and ``gpipe.transport`` import. Every
collective is over the pipeline group, the data-parallel group or the world, through
``gpipe.parallel.collectives`` (each bounded by the job's timeout, named when it fails);
values are small host-side numbers and objects (losses, counts, traces, manifests).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpipe.parallel.collectives import Collectives

__all__ = [
    "Mesh",
    "ensure_world",
    "group_size",
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


def ensure_world(backend: str = "gloo", timeout: float | None = None) -> int:
    """Join the job's process group (from torchrun's environment) unless joined; this rank.
    ``timeout`` (seconds) bounds its collectives (torch's default: 30 minutes)."""
    if not dist.is_initialized():
        limit = None if timeout is None else timedelta(seconds=timeout)
        dist.init_process_group(backend, timeout=limit)
    return dist.get_rank()


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

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` of this process's replica."""
        return dist.get_global_rank(self.pp, pp_rank)

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
