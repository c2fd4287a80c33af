"""What a run needs, checked in the process that starts the ranks before any starts and
before the run's folder is made, so that bad input is one line and leaves nothing behind:

* the output folder: new, empty, or a gpipe run (``gpipe.train.outputs``);
* the data: read (what is not text refused: ``gpipe.train.texts``), tokenized into its cache
  (which the ranks then read), and cut into the samples the ranks will take, at least one
  window each side;
* the memory: the model built on the ``meta`` device (nothing allocated, no weights drawn),
  its parameters per rank by the run's balance and schedule, and the planner's memory model
  (``gpipe.estimate.memory_model``: parameters, gradients, optimizer state, reduction and
  gathered buffers) plus what a rank holds before its model, against the memory this
  machine has available (``MemAvailable``). A lower bound: activations come on top.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpipe.estimate.memory_model import Held, MemoryModel, StageMemoryTable
from gpipe.estimate.profile import LayerProfile
from gpipe.train.config import ConfigError, TrainConfig, flag
from gpipe.train.hf import HFModel
from gpipe.train.memory_checks import PROCESS_BYTES, gib
from gpipe.train.networks import ModelSource
from gpipe.train.outputs import run_folder_problems
from gpipe.train.texts import DataError

__all__ = ["available_memory", "check", "memory_problems", "unit_sizes"]


def check(config: TrainConfig, *, processes: int | None) -> Any:
    """What :meth:`Task.prepare` returns for the ranks; raises :class:`ConfigError` naming
    what cannot run. ``processes``: the ranks this machine will hold (None: not known, as
    under a torchrun whose ranks may be on several machines)."""
    problems = run_folder_problems(config.out)
    task = config.task
    if processes:
        problems += memory_problems(config, task.model, processes=processes)
    if problems:  # nothing read yet: a wrong --out or model is said at once
        raise ConfigError(problems)
    try:
        prepared = task.prepare()
        task.data(batch=config.batch, eval_batches=config.eval_batches, prepared=prepared,
                  chunks=config.chunks)  # fmt: skip
    except DataError as error:  # it names the file
        raise ConfigError([str(error)]) from None
    except (ValueError, OSError, ImportError) as error:
        named = [k for k in ("data", "val_data") if getattr(config, k)]
        given = " ".join(f"{flag(k)} {getattr(config, k)}" for k in named)
        raise ConfigError([f"{given}: {error}" if given else str(error)]) from None
    return prepared


def memory_problems(config: TrainConfig, source: ModelSource, *, processes: int) -> list[str]:
    """Whether ``processes`` ranks of ``config`` fit this machine's available memory."""
    available = available_memory()
    if available is None:
        return []
    units = unit_sizes(source)
    size = torch.tensor([], dtype=torch.float64 if config.dtype == "float64" else torch.float32)
    layers = [LayerProfile(str(i), 0, 0, 0, 0, p * size.element_size(), b * size.element_size(),
                           0, 0, 0) for i, (p, b) in enumerate(units)]  # fmt: skip
    layout = config.layout
    balance = config.balance or layout.default_balance(len(units))
    if len(balance) != layout.num_stages or sum(balance) != len(units):
        return []  # resolve named it
    schedule = layout.build_schedule()
    model = MemoryModel(optimizer_state=_optimizer_state(config), replicas=config.replicas,
                        shard=config.shard is not None,
                        whole_gradients=config.shard == "params")  # fmt: skip
    table = StageMemoryTable(layers, [Held(0, 0)] * len(balance), model,
                             splits_backward=schedule.splits_backward(0, 0))  # fmt: skip
    starts = [sum(balance[:s]) for s in range(len(balance) + 1)]
    peaks = [
        PROCESS_BYTES + sum(table.weights(starts[s], starts[s + 1]) for s in schedule.stages_of(r))
        for r in range(layout.stages)
    ]
    needed = sum(peaks) * processes / layout.stages  # the replicas hold the same
    if needed <= available:
        return []
    count = sum(p for p, _ in units)
    return [
        f"--model {config.model}: {count:,} parameters; a process needs about "
        f"{gib(max(peaks))} at its peak (its stage's parameters, gradients and optimizer "
        f"state in {config.dtype}, before activations), {processes} processes "
        f"{gib(needed)}, more than the {gib(available)} this machine has available; train "
        "a smaller model (--model-config), or use more --stages or --shard with --replicas"
    ]


def _optimizer_state(config: TrainConfig) -> float:
    """Tensors the optimizer keeps per parameter (AdamW's two moments; SGD's momentum)."""
    if config.optimizer == "sgd":
        return 1.0 if config.momentum else 0.0
    return 2.0


def unit_sizes(source: ModelSource) -> list[tuple[int, int]]:
    """(parameters, buffer elements) of each unit of the pipelined model (what --balance
    counts), the model built on ``meta`` (a weight tied to two units counts in both)."""
    with torch.device("meta"), _NoInit():
        model = source.build()
    if isinstance(source, HFModel):  # the work before the first block, the blocks, after
        blocks = source.split(model)
        sizes = [[0, 0] for _ in range(len(blocks) + 2)]
        for kind, named in ((0, model.named_parameters), (1, model.named_buffers)):
            after = False
            for name, tensor in named(remove_duplicate=False):
                at = next((i for i, b in enumerate(blocks) if name.startswith(b + ".")), None)
                after = after or at is not None  # past the first block: the work after
                unit = at + 1 if at is not None else (len(blocks) + 1 if after else 0)
                sizes[unit][kind] += tensor.numel()
        return [(p, b) for p, b in sizes]
    assert isinstance(model, nn.Sequential)
    return [(_count(m.parameters()), _count(m.buffers())) for m in model]


def _count(tensors: Any) -> int:
    return sum(t.numel() for t in tensors)


class _NoInit(TorchFunctionMode):
    """Random initialization skipped on meta tensors: it computes nothing there, but the
    first call loads torch's decompositions (seconds before a refusal)."""

    _RANDOM = frozenset({"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "erfinv_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if getattr(func, "__module__", "") == "torch.nn.init" or name in self._RANDOM:
            target = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
                          None)  # fmt: skip
            if target is not None and target.is_meta:
                return target
        return func(*args, **kwargs)


def available_memory() -> int | None:
    """Bytes this machine can give new processes now (``MemAvailable``; None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)
