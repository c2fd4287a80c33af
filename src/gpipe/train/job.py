"""Starting the main job's processes: K × R local ones (:func:`run`), or this one as a rank of
a job torchrun started (:func:`run_under_torchrun`). Each process runs :func:`train`."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import gpipe.train.config_file as config_file
import gpipe.train.inputs as inputs
from gpipe.base.allocator import started_with
from gpipe.base.errors import COMMUNICATION_FAILURES
from gpipe.parallel.launch import LaunchError, die_with, launch
from gpipe.parallel.mesh import ensure_world, leave_world, world_collectives
from gpipe.train.config import ConfigError, TrainConfig
from gpipe.train.report import write_json
from gpipe.train.run_folder import CONFIG
from gpipe.train.trainer import Trainer

__all__ = ["TrainingError", "launched", "root_cause", "run", "run_under_torchrun", "train"]


class TrainingError(RuntimeError):
    """A rank failed; ``rank`` is the one whose error started it (see :func:`root_cause`),
    ``failures`` every failed rank's error text with its traceback."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures, self.rank = failures, root_cause(failures)
        first_line = (failures[self.rank].strip().splitlines() or ["?"])[0]
        if first_line.startswith("PipelineError: "):
            # It names the rank that caused it (gpipe.transport.inquest): not this one.
            super().__init__(first_line.removeprefix("PipelineError: "))
        else:
            super().__init__(f"failed in rank {self.rank}: {first_line}")

    @property
    def signal_exit(self) -> int | None:
        """The exit code (130, 143) when every rank stopped on a signal, after saving."""
        codes = {text.split("\n")[0] for text in self.failures.values()}
        if len(codes) == 1 and codes.pop() in ("SystemExit: 130", "SystemExit: 143"):
            return int(next(iter(self.failures.values())).split("\n")[0][-3:])
        return None


def train(rank: int, config: TrainConfig, prepared: Any = None) -> dict[str, Any] | None:
    """The training run of one rank (inside a process of the job's group); ``prepared``:
    what :func:`gpipe.train.inputs.check` returned, or None to let each rank load its data."""
    return Trainer(rank, config, prepared).run()


def _write_run(config: TrainConfig) -> None:
    """The run's folder and its options (once the inputs are known to be good)."""
    Path(config.out).mkdir(parents=True, exist_ok=True)
    write_json(Path(config.out) / CONFIG, asdict(config))
    config_file.write(Path(config.out) / config_file.FILE, config)


@contextlib.contextmanager
def _claimed(out: str) -> Iterator[None]:
    """Hold the output folder for one run at a time: an advisory lock on the folder itself,
    so that nothing is left in it (the lock goes with the process, however it ends)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                [f"--out {out} is in use by another run right now: choose another --out"]
            ) from None
        yield
    finally:
        os.close(folder)


def run(config: TrainConfig) -> dict[str, Any]:
    """Train ``config`` in K × R new local processes; rank 0's summary.

    Raises :class:`ConfigError`, before any process starts and before the output folder is
    made, for what cannot run (``gpipe.train.inputs.check``: the folder, the data, the
    memory), or when another run is writing to the same output folder; and
    :class:`TrainingError` when a rank fails (the others stop with it).
    """
    prepared = inputs.check(config, processes=config.world_size)  # before the folder
    with _claimed(config.out):
        return _run(config, prepared)


def _run(config: TrainConfig, prepared: Any) -> dict[str, Any]:
    _write_run(config)
    # The allocator policy is also read at each rank's start (Python's, glibc's defaults).
    with started_with(config.cpu_allocator):
        return launched(train, config, prepared)


def launched(fn: Any, config: TrainConfig, *args: Any) -> Any:
    """``fn(rank, config, *args)`` in K × R new local processes; rank 0's result. A failed
    rank raises :class:`TrainingError` (the others stop with it)."""
    try:
        # gloo: the main job runs on CPU, and its own collectives carry CPU tensors.
        results = launch(fn, nprocs=config.world_size, args=(config, *args), backend="gloo",
                         timeout=config.timeout)  # fmt: skip
    except LaunchError as error:
        raise TrainingError(error.failures) from None
    return results[0]


def run_under_torchrun(config: TrainConfig) -> dict[str, Any] | None:
    """Train as one rank of the job torchrun started (or of one whose RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT were set by hand); rank 0's summary on rank 0.

    Raises :class:`~gpipe.parallel.mesh.WorldError` when that environment is wrong or the
    other processes do not all come within ``config.timeout``."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun killed outright: stop with it
        die_with(os.getppid())
    # Each rank checks before any waits for another: bad input stops every one at once.
    local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's ranks on this machine
    prepared = inputs.check(config, processes=int(local) if local and local.isdigit() else None)
    # CPU training, as when run() spawns the ranks; every wait bounded by --timeout
    rank = ensure_world("gloo", timeout=config.timeout)
    try:
        # Every rank resolved the same options; only rank 0's clock named the output folder.
        everyone = world_collectives(config.timeout)
        options = everyone.broadcast_object(asdict(config), "the broadcast of rank 0's options")
        config = TrainConfig(**options)
        if rank == 0:
            _write_run(config)
        everyone.barrier("the barrier after preparing the data", doing="starting")
        return train(rank, config, prepared)
    finally:
        leave_world()


# How a rank fails when another one failed first: not the cause worth reporting.
_SECONDARY = ("PipelineError", *COMMUNICATION_FAILURES, "killed by signal", "without a result")


def root_cause(failures: dict[int, str]) -> int:
    """The rank whose error started it: the lowest one whose error is not a consequence."""

    def secondary(rank: int) -> bool:
        first_line = (failures[rank].strip().splitlines() or [""])[0]
        return any(s in first_line for s in _SECONDARY)

    return min(failures, key=lambda r: (secondary(r), r))
