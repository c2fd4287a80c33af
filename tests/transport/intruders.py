"""Processes not of the job that connect to its same-host sockets, and the rank code that
lets them in first (run inside the processes ``gpipe.launch`` starts).

Each intruder connects to one listener the moment it listens (before the genuine peer can:
the peers learn its address only afterwards), says a rank and a wrong token, or pickled bytes
whose unpickling would create a marker file, and reports whether the rank closed on it.
Only this job's listener is touched (other jobs on the machine are left alone).
"""

from __future__ import annotations

import os
import pickle
import socket
import warnings

import torch
import torch.distributed as dist
from torch.nn import functional as F

import gpipe
from distributed_cases import _leaving_batch, _leaving_model
from gpipe.transport import choice

NOBODY = 65534


class Marker:
    """Unpickling it creates the file ``path``: the proof that something ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class Intruder:
    """A forked process (of uid 65534 if ``as_nobody``) connected to ``address``, which
    sends ``payload`` and waits to see whether the listener closes on it."""

    def __init__(self, address: str, payload: bytes, *, as_nobody: bool) -> None:
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the intruder: socket calls only, then _exit
            said = b"failed"
            try:
                if as_nobody:
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                link.settimeout(60)
                link.connect(address)
                os.write(write, b"connected ")
                try:
                    link.sendall(payload)
                    said = b"closed" if link.recv(1) == b"" else b"answered"
                except OSError:
                    said = b"closed"
            finally:
                os.write(write, said)
                os._exit(0)
        os.close(write)
        self._read = read
        assert os.read(read, 10) == b"connected "  # in the backlog before any peer

    def outcome(self) -> str:
        said = os.read(self._read, 100).decode()
        os.waitpid(self.pid, 0)
        os.close(self._read)
        return said


def trains_with_intruders(rank: int, marker: str) -> dict:
    """One 2-stage step with ``transport='auto'``; rank 0's listener first takes a stranger
    of this user (a wrong token, then a pickle) and, as root, one of uid 65534. The loss,
    this rank's gradients, the transport, the warnings and what the intruders saw."""
    torch.set_num_threads(1)
    intruders: list[Intruder] = []
    listen = choice.listen

    def listen_and_let_in():
        listener, address, token = listen()
        if rank == 0:
            wrong = (1).to_bytes(8, "little") + bytes(32)
            intruders.append(Intruder(address, wrong, as_nobody=False))
            intruders.append(Intruder(address, pickle.dumps(Marker(marker)), as_nobody=False))
            if os.geteuid() == 0:
                intruders.append(Intruder(address, wrong, as_nobody=True))
        return listener, address, token

    choice.listen = listen_and_let_in
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = gpipe.Pipe(_leaving_model(), balance=[2, 2], chunks=2, group=dist.group.WORLD,
                          timeout=20)  # fmt: skip
    x, y = _leaving_batch()
    loss = pipe.step(x, y, F.mse_loss, seed=3)
    seen = [intruder.outcome() for intruder in intruders]
    return {
        "loss": float(loss) if rank == 1 else None,
        "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
        "transport": pipe.transport,
        "warnings": [str(w.message) for w in caught],
        "intruders": seen,
    }
