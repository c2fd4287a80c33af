"""What the fault matrix's rows share (``benchmarks/faults.py`` and its row modules,
``benchmarks/fault_*.py``): the carrier they run on, starting ``gpipe train`` and a library
case's ranks on it, and finding a job's processes and those it left behind.

The carrier is what moves messages between stages (``Pipe(transport=...)``): the same-host
sockets, or ``"group"``, torch.distributed's point-to-point (what crosses machines). A
library case's ranks build their Pipes with it as the default (:func:`on_carrier`); ``gpipe
train`` is given ``--transport`` (:func:`train`).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout's gpipe, in the rows' own process and the ranks it launches, as in the
# commands they start (env): imported before gpipe by every row module.
sys.path.insert(0, str(ROOT / "src"))
CARRIERS = ("sockets", "group")
CARRIER = "sockets"  # the rows' carrier: faults.py and fault_stops.py set it (--carrier)
TIMEOUT = 20.0  # the pipeline's timeout in the library cases


def train() -> list[str]:
    """``gpipe train`` on the rows' carrier, for ``python -m gpipe`` (or torchrun's ``-m
    gpipe``) to run: ``[*python, "-m", "gpipe", *train(), *argv]``."""
    return ["train", "--transport", CARRIER]


def on_carrier(rank: int, carrier: str, fn, *args):
    """``fn(rank, *args)`` in a rank of ``gpipe.launch``, whose Pipes default to ``carrier``:
    launch ``on_carrier`` with ``args=(CARRIER, fn, *args)``."""
    import gpipe

    gpipe.Pipe.__init__.__kwdefaults__["transport"] = carrier
    return fn(rank, *args)


def env(cache: Path) -> dict[str, str]:
    """A command's environment: this checkout's gpipe, ``cache``, and none of torchrun's
    variables (the command starts its processes itself)."""
    found = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "src")}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        found.pop(variable, None)
    return found


def gpipe_train(*argv: str, cache: Path) -> subprocess.Popen:
    """``gpipe train ARGV`` on the rows' carrier, in a session of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpipe", *train(), *argv],
        env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return sorted(int(p) for p in found.stdout.split())


def ranks(launcher: int) -> list[int]:
    """The ranks of a `gpipe train` launcher, in rank order: its fork server's children (or
    its own spawned ones)."""
    for child in children(launcher):
        if "forkserver" in Path(f"/proc/{child}/cmdline").read_text(errors="replace"):
            return children(child)
    found = subprocess.run(["pgrep", "-P", str(launcher), "-f", "spawn_main"],
                           capture_output=True, text=True)  # fmt: skip
    return sorted(int(pid) for pid in found.stdout.split())


def running(pid: int) -> bool:
    """Alive, and not a zombie waiting for its new parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def left_in(session: int) -> int:
    """The processes of ``session`` still alive after up to 10 s."""
    for _ in range(50):
        found = subprocess.run(["pgrep", "-s", str(session)], capture_output=True, text=True)
        if not found.stdout.strip():
            return 0
        time.sleep(0.2)
    return len(found.stdout.split())


def library_case(fn, nprocs, args, *, expect_kill=False, messages=None):
    """``fn`` in ``nprocs`` ranks of ``gpipe.launch`` on the rows' carrier: (seconds until
    every rank raised, the whole run's, each rank's error type, processes left); each
    rank's message goes into the list ``messages``, if given."""
    from gpipe.parallel.launch import LaunchError, launch

    started = time.monotonic()
    try:
        outcomes = launch(on_carrier, nprocs, args=(CARRIER, fn, *args), timeout=TIMEOUT + 10,
                          grace=TIMEOUT + 5)  # fmt: skip
    except LaunchError as error:
        if not expect_kill:
            raise
        outcomes = [error.results.get(r, {"type": "killed", "seconds": 0.0}) for r in range(nprocs)]
    wall = time.monotonic() - started
    if messages is not None:
        messages.extend(o.get("message", "") for o in outcomes)
    worst = max(o.get("seconds", 0.0) for o in outcomes)
    types = ",".join(str(o["type"]) for o in outcomes)
    return worst, wall, types, len(multiprocessing.active_children())


def long_run(out: Path, work: Path, *extra: str) -> subprocess.Popen:
    """A `gpipe train` of 5,000 steps into ``out`` that prints a line per step."""
    return gpipe_train("--size", "tiny", "--steps", "5000", "--eval-every", "0",
                       "--sample-tokens", "0", "--progress", "lines", "--out", str(out),
                       *(extra or ("--save-every", "0")), cache=work / "cache")  # fmt: skip


class Lines:
    """Drains a job's stdout in a thread (so that it never blocks on a full pipe), keeping
    the last step printed."""

    def __init__(self, job: subprocess.Popen) -> None:
        self.last, self.text = 0, []
        self.thread = threading.Thread(target=self._read, args=(job,), daemon=True)
        self.thread.start()

    def _read(self, job: subprocess.Popen) -> None:
        for line in job.stdout:
            self.text.append(line)
            if line.startswith("step ") and "/5000" in line:
                self.last = int(line.split()[1].split("/")[0])

    def wait_for(self, step: int, limit: float = 120.0) -> None:
        deadline = time.monotonic() + limit
        while self.last < step and time.monotonic() < deadline:
            time.sleep(0.05)
