"""The processes of a job: the world, its pipeline × data-parallel mesh, and collectives.

The layers above (the training job, the planner) use these instead of
``torch.distributed``, which only ``gpipe.parallel`` and ``gpipe.transport`` import. Every
collective here is over the pipeline group, the data-parallel group or the world; values
are small host-side numbers and objects (losses, counts, traces, manifests).
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

__all__ = [
    "Mesh",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "broadcast_tensor",
    "ensure_world",
    "leave_world",
    "ping_pong",
    "all_sum",
    "world",
    "world_rank",
]


def world() -> Any:
    """The group of every process of the job."""
    return dist.group.WORLD


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


def world_rank() -> int:
    return dist.get_rank()


def barrier() -> None:
    dist.barrier()


def broadcast_object(value: Any, *, src: int = 0, group: Any = None) -> Any:
    """``value`` as the process of global rank ``src`` has it, on every process of ``group``."""
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(value: Any, group: Any = None) -> list[Any]:
    """Every process's ``value``, by its rank in ``group`` (default: the world)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def all_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` (default: the world); returns it."""
    dist.all_reduce(tensor, group=group)
    return tensor


def broadcast_tensor(tensor: torch.Tensor, *, src: int, group: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with the one of global rank ``src``; returns it."""
    dist.broadcast(tensor, src=src, group=group)
    return tensor


@dataclass(frozen=True)
class Mesh:
    """The world as ``replicas`` × ``stages``: a pipeline group and a data-parallel group.

    Rank ``r`` is stage ``r % stages`` of replica ``r // stages``. ``dp`` is ``None`` with
    one replica.
    """

    stages: int
    replicas: int
    pp: Any
    dp: Any

    @classmethod
    def build(cls, stages: int, replicas: int, device_type: str = "cpu") -> Mesh:
        if replicas == 1:
            return cls(stages, replicas, world(), None)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (replicas, stages), mesh_dim_names=("dp", "pp"))
        return cls(stages, replicas, mesh.get_group("pp"), mesh.get_group("dp"))

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp)

    def global_rank(self, pp_rank: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` of this process's replica."""
        return dist.get_global_rank(self.pp, pp_rank)

    def sum_over_pipeline(self, value: float) -> float:
        return float(all_sum(torch.tensor([float(value)], dtype=torch.float64), self.pp))

    def mean_over_replicas(self, value: float) -> float:
        if self.dp is None:
            return value
        total = all_sum(torch.tensor([float(value)], dtype=torch.float64), self.dp)
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
