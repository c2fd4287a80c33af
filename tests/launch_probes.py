"""Code that runs inside the processes of the launcher's and the mesh's tests
(tests/parallel/test_launch.py, test_mesh.py): what each process was given and where its
job's store listens.

It lives in a module (not in the test file) so that spawned processes can import it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist


def thread_count(rank):
    """The threads ``launch`` left this process to compute with."""
    return torch.get_num_threads()


def environment_and_output(rank, name):
    """The variable ``name`` as this process sees it, after printing a line to fd 1."""
    print(f"rank {rank} says hello", flush=True)
    return os.environ.get(name)


def listening(port: int) -> list[tuple[str, str]]:
    """(local address in /proc/net's hex, socket inode) of each TCP socket listening at
    ``port`` on this machine."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, hexport = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hexport, 16) == port:
                found.append((address, fields[9]))
    return found


def _sockets_of(pid: int) -> set[str]:
    held = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held.add(os.readlink(fd))
    return held


def job_store(rank, launcher):
    """Where the job's store listens (``listening``), and which process holds it: the
    launcher (pid ``launcher``), this rank, or neither."""
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while not isinstance(store, dist.TCPStore):  # under the group's prefixes
        store = store.underlying_store
    found = listening(store.port)
    inodes = {f"socket:[{inode}]" for _, inode in found}
    return {
        "addresses": [address for address, _ in found],
        "launcher": bool(inodes) and inodes <= _sockets_of(launcher),
        "rank": bool(inodes & _sockets_of(os.getpid())),
    }


FLAKY_MESH = "gpipe-flaky-mesh"  # a backend whose first mesh of a launch does not form


def _flaky_mesh(store, rank, size, timeout):
    """Gloo, but the first time in a folder (``GPIPE_FLAKY_MESH``) the ranks that come fail
    as gloo's full mesh does on a busy machine (one marker for all: a rank the launcher
    stopped before it came must not fail the next attempt)."""
    marker = Path(os.environ["GPIPE_FLAKY_MESH"]) / "tried"
    if not marker.exists():
        marker.touch()
        raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed "
                           "by peer [127.0.0.1]:4794 (simulated)")  # fmt: skip
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend(FLAKY_MESH, _flaky_mesh, devices=["cpu"])


def rank_of(rank):
    return rank
