"""Start K local processes that form a pipeline, from a plain ``python`` command.

``torchrun`` is the launcher for real jobs and for several machines::

    torchrun --nproc-per-node 2 train.py                       # one machine
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 train.py  # first of two machines

and a script written for it works unchanged under :func:`launch`, which sets the same
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``),
initializes the default process group (gloo on CPU, NCCL when every process gets a GPU)
and calls ``fn(rank, *args)`` in each process::

    def train(rank):
        pipe = gpipe.Pipe(make_model, balance=[3, 3], chunks=8, group=dist.group.WORLD)
        ...

    gpipe.launch(train, nprocs=2)

Each process computes with its share of this machine's cores (:func:`threads_per_process`),
unless ``OMP_NUM_THREADS`` says otherwise: torch's default, every core in every process,
oversubscribes them (torchrun sets one thread per process for the same reason).

The job's store (torch's ``TCPStore``) is held by the launcher, on loopback, and every rank
is its client (``gpipe.parallel.store``): a rank that stops cannot take it with it. When a
process fails, the others are given ``grace`` seconds to notice and raise their own error
(the pipeline's ``timeout`` bounds that), then any still alive are killed (at once, with
SIGKILL, those stopped: SIGSTOP, a debugger): no process outlives :func:`launch`. The
error raised names each failed rank and its message. SIGTERM to the launcher stops it as
Ctrl-C does (exit code 143), and a launcher killed outright takes its processes with it at
once (each watches its launcher through a Linux pidfd, or asks the kernel for a signal when
its parent dies: :func:`die_with`).

On Linux the processes are forked from a server that imported torch and gpipe once
(multiprocessing's "forkserver"): a rank starts in a fraction of a second, not the seconds
a fresh interpreter takes to import torch. Each gets the launcher's environment as it is at
the call. Where glibc, the loader or Python must read the environment at start
(``MALLOC_*``, ``LD_*``, ``PYTHONMALLOC``), or without pidfds, each rank is a fresh
interpreter ("spawn").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from gpipe.base._utils import seconds
from gpipe.parallel import store as job_store
from gpipe.parallel.store import free_port

__all__ = ["LaunchError", "die_with", "free_port", "launch", "threads_per_process"]


class LaunchError(RuntimeError):
    """One or more launched processes failed; ``failures`` maps rank to its error text."""

    def __init__(self, message: str, failures: dict[int, str], results: dict[int, Any]) -> None:
        super().__init__(message)
        self.failures = failures
        self.results = results  # what the ranks that did finish returned


def _stop_on_sigterm() -> Any:
    """In the main thread: SIGTERM (what Slurm, Kubernetes and systemd send) ends
    :func:`launch` as Ctrl-C does, its processes with it, and the program with exit code
    143. Returns the handler it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): it notices nothing."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _end(processes: list[Any], wait: float) -> None:
    """SIGTERM to the processes still running; SIGKILL to those alive after ``wait`` s
    (at once to a stopped one, which would act on a SIGTERM only once continued)."""
    for process in processes:
        if process.is_alive():
            if _stopped(process.pid):
                process.kill()
            else:
                process.terminate()
    deadline = time.monotonic() + wait
    try:
        for process in processes:
            if process.pid is not None:
                process.join(max(0.0, deadline - time.monotonic()))
    except (KeyboardInterrupt, SystemExit):
        pass
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _context() -> Any:
    """Forked from a server that imported torch once, where that is as good as a fresh
    interpreter (see the module's docstring); else spawned."""
    read_at_start = any(
        name.startswith(("MALLOC_", "LD_")) or name == "PYTHONMALLOC" for name in os.environ
    )
    if hasattr(os, "pidfd_open") and not read_at_start:
        context = mp.get_context("forkserver")
        # torch._dynamo: every model built through gpipe.materialize imports it (2 s a rank).
        preload = ["torch", "torch.distributed", "torch._dynamo", "gpipe.pipe"]
        # What the ranks of a launcher that uses them most likely import too: a Hugging Face
        # model (3 s a rank saved) and torch.export, which captures it (0.4 s a rank),
        # matplotlib's figures (gpipe train's pictures, 3 s a run).
        also = {
            "transformers": ["transformers.modeling_utils", "torch.export._trace"],
            "matplotlib": ["matplotlib.figure"],
        }
        preload += [m for package, modules in also.items() if package in sys.modules
                    for m in modules]  # fmt: skip
        context.set_forkserver_preload(preload)
        return context
    return mp.get_context("spawn")


class _Outputs:
    """The launcher's standard output and error as they are at the call (a fork server's
    are those of its start): unpickled in a process as a tuple of its received fds."""

    def __reduce__(self) -> tuple:  # runs while a process starts: its fds go along
        from multiprocessing.reduction import DupFd

        return tuple, (tuple(DupFd(fd) if _is_open(fd) else None for fd in (1, 2)),)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _write_to(outputs: tuple[Any, Any]) -> None:
    for received, fd in zip(outputs, (1, 2), strict=True):
        if received is not None:
            os.dup2(received.detach(), fd)


def die_with(launcher: int) -> None:
    """This process ends at once (SIGKILL) when process ``launcher`` does, however it ends.

    Not a SIGTERM, which asks a rank of ``gpipe train`` to finish its step and save: a
    launcher killed outright means the whole job is (out of memory, a scheduler's kill),
    and its ranks must not train on for another step. A forked rank's parent is the fork
    server, so it watches the launcher itself; ``gpipe train`` under torchrun watches
    torchrun.
    """
    if hasattr(os, "pidfd_open"):
        try:
            launched_by = os.pidfd_open(launcher)
        except ProcessLookupError:  # the launcher died before this process started
            os._exit(1)

        def watch() -> None:  # blocked in select: holds no GIL
            select.select([launched_by], [], [])
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="gpipe-launcher-watch", daemon=True).start()
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        os._exit(1)


def threads_per_process(processes: int) -> int:
    """The threads each of ``processes`` processes computes with: ``OMP_NUM_THREADS`` when
    set, else this machine's cores (those this process may run on) shared by them. Four
    processes of two threads each on two cores made a small pipeline's steps 20-50x slower."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        return int(threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // processes)


def _worker(
    rank: int,
    fn: Callable[..., Any],
    args: tuple,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    results: Any,
    launcher: int,
    environment: dict[str, str],
    outputs: tuple[Any, Any],
) -> None:
    import torch.distributed as dist

    _write_to(outputs)
    die_with(launcher)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's: it sends SIGTERM
    os.environ.clear()  # the launcher's, as it is now (a fork server's is from its start)
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)
    torch.set_num_threads(threads_per_process(world_size))  # read here: a fork's torch runs
    failure = "start"  # the group did not form: the launcher may start the job again
    try:
        # The launcher holds the store (gpipe.parallel.store): every rank is its client.
        store = job_store.client("127.0.0.1", port, world_size, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )  # fmt: skip
        # init returns when this rank's side of gloo's mesh is made, not every peer's (launch)
        dist.barrier(device_ids=[rank] if backend == "nccl" else None)
        failure = "error"
        value = fn(rank, *args)
        # Pickled by value here: tensors sent through shared memory would vanish with
        # this process before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as error:  # reported to the parent, which decides what to raise
        text = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        results.put((rank, failure, text))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: tuple = (),
    backend: str | None = None,
    timeout: float = 60.0,
    grace: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes forming one process group.

    Returns the values ``fn`` returned, by rank (they must be picklable). ``backend``
    defaults to NCCL when CUDA offers ``nprocs`` devices, else gloo. ``timeout`` is the
    process group's; ``grace`` (default ``timeout + 10``) is how long the others may run
    on after a process has failed.

    Every process passes a barrier once the group forms, before ``fn``: gloo's full mesh
    fails ("Gloo connectFullMesh failed ... Connection closed by peer", pytorch/pytorch#53270)
    when a peer leaves while a process still connects, as one whose ``fn`` returned at once
    did. Should the mesh fail all the same, and that be all any process reported (the group
    never formed, so ``fn`` can have done no more than begin), the job is started once more
    on a fresh port, with a warning.
    """
    try:
        return _launch(fn, nprocs, args, backend, timeout, grace)
    except _MeshFailed as failed:
        warnings.warn(
            f"gloo's connections did not form ({failed}); starting the {nprocs} processes "
            "once more on a fresh port",
            stacklevel=2,
        )
        return _launch(fn, nprocs, args, backend, timeout, grace, again=False)


class _MeshFailed(Exception):
    """The process group did not form: gloo's full mesh failed, and nothing else."""


def _launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple,
    backend: str | None,
    timeout: float,
    grace: float | None,
    *,
    again: bool = True,
) -> list[Any]:
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    timeout = seconds(timeout, "timeout")
    if backend is None:
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= nprocs
        backend = "nccl" if cuda else "gloo"
    grace = timeout + 10.0 if grace is None else grace
    context = _context()
    results = context.SimpleQueue()
    # Held here, on loopback: a rank that stops cannot take it (gpipe.parallel.store).
    store = job_store.serve("127.0.0.1", None, nprocs, timeout)
    worker = (fn, args, nprocs, store.port, backend, timeout, results)
    processes = [_process(context, rank, worker) for rank in range(nprocs)]
    outcomes: dict[int, tuple[str, Any]] = {}
    frozen: set[int] = set()  # ranks stopped (SIGSTOP, a debugger) when the others failed
    previous = _stop_on_sigterm()
    try:
        for process in processes:
            process.start()
        frozen = _watch(processes, results, outcomes, grace)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        # Stopped (Ctrl-C, SIGTERM): one SIGTERM each, and the time to finish their step
        # and save (see gpipe.train); a second Ctrl-C kills them at once.
        stopped = sys.exc_info()[0] in (KeyboardInterrupt, SystemExit)
        _end(processes, wait=grace if stopped else 5.0)
        _drain(results, outcomes)
        del store  # its server stops: nobody is left to reach it

    mesh = [
        text
        for status, text in outcomes.values()
        if status == "start" and "connectFullMesh" in text
    ]
    if again and mesh and len(mesh) == len(outcomes):  # that, and nothing else, went wrong
        raise _MeshFailed(mesh[0].splitlines()[0])
    failures = _failures(processes, outcomes, frozen)
    if failures:
        summary = "\n".join(
            f"- rank {rank}: {text.splitlines()[0]}" for rank, text in sorted(failures.items())
        )
        first = min(failures)
        raise LaunchError(
            f"{len(failures)} of {nprocs} processes failed:\n{summary}\n\n"
            f"rank {first}'s error:\n{failures[first]}",
            failures,
            {r: pickle.loads(v) for r, (status, v) in outcomes.items() if status == "ok"},
        )
    return [pickle.loads(outcomes[rank][1]) for rank in range(nprocs)]


def _process(context: Any, rank: int, worker: tuple) -> Any:
    """Rank ``rank``'s process, not yet started: ``_worker`` with ``worker`` (fn, args, world
    size, port, backend, timeout, results queue), the launcher, its environment and outputs."""
    fn, args, *job = worker
    return context.Process(
        target=_worker,
        args=(rank, fn, args, *job, os.getpid(), dict(os.environ), _Outputs()),
        name=f"gpipe-rank-{rank}",
        daemon=False,
    )


def _drain(results: Any, outcomes: dict[int, tuple[str, Any]]) -> None:
    while not results.empty():
        rank, status, value = results.get()
        outcomes[rank] = (status, value)


def _watch(processes: list, results: Any, outcomes: dict, grace: float) -> set[int]:
    """Collect the ranks' outcomes until every process has ended, or the group cannot form,
    or ``grace`` has passed since the first failure, or the ones left are all stopped
    (returned: none of them can notice)."""
    first_failure: float | None = None
    while True:
        _drain(results, outcomes)
        alive = [p for p in processes if p.is_alive()]
        failed = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)] + [
            r for r, (status, _) in outcomes.items() if status in ("error", "start")
        ]
        if any(status == "start" for status, _ in outcomes.values()):
            return set()  # the group cannot form: the others wait in vain
        if failed and first_failure is None:
            first_failure = time.monotonic()
        if not alive:
            return set()
        if first_failure is not None and time.monotonic() - first_failure > grace:
            return set()
        if failed and all(_stopped(p.pid) for p in alive):
            return {processes.index(p) for p in alive}
        time.sleep(0.05)


def _failures(processes: list, outcomes: dict, frozen: set[int]) -> dict[int, str]:
    """Each failed rank's error, or what became of a rank that left none."""
    failures: dict[int, str] = {}
    for rank, process in enumerate(processes):
        status, value = outcomes.get(rank, (None, None))
        if status in ("error", "start"):
            failures[rank] = value
        elif status != "ok":
            code = process.exitcode
            if rank in frozen:
                failures[rank] = (
                    "stopped (SIGSTOP, or a debugger) while the others waited for it; killed "
                    "once they had failed"
                )
            elif code is not None and code < 0:
                failures[rank] = f"killed by signal {-code}"
            else:
                failures[rank] = f"exited with code {code} without a result"
    return failures
