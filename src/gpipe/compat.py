"""torchgpipe's front end on gpipe: ``from gpipe.compat import GPipe`` where a script had
``from torchgpipe import GPipe``, and the rest of it runs as it did::

    model = GPipe(nn.Sequential(a, b, c, d), balance=[2, 2], devices=["cuda:0", "cuda:1"],
                  chunks=8)
    output = model(input.to(model.devices[0]))
    loss = criterion(output, target.to(model.devices[-1]))
    loss.backward()
    optimizer.step()

Built on ``gpipe.Pipe`` (one stage per partition, one process), with torchgpipe's documented
behaviour: the attributes ``balance``, ``devices``, ``chunks``, ``checkpoint`` and
``partitions`` (an ``nn.ModuleList`` of one ``nn.Sequential`` per partition, so that state
dict keys are ``partitions.0.0.weight``), sequence-like access to the layers, devices fixed at
construction (moving raises ``TypeError``; casting is allowed), :func:`verify_module`, inputs
and outputs that are a tensor or a tuple of tensors (``TypeError`` otherwise), a batch smaller
than ``chunks`` split into fewer micro-batches, recomputation only in training mode with
autograd on. Errors keep torchgpipe's types (``TypeError``, ``ValueError``, ``IndexError``)
with gpipe's messages, which name the values and the remedy.

Where it differs, on purpose (``docs/migrating.md``): ``devices=None`` on a machine without
CUDA puts every partition on the CPU (torchgpipe found no device); layers that write their
input in place get a copy instead of an error; dropout draws gpipe's per-layer seeds
(``gpipe.base.rng``), the same for any balance and chunks; gradients are autograd's, with no
``CheckpointBackward`` nodes to count (``torch.utils.checkpoint``'s recomputation instead).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gpipe.base import microbatch
from gpipe.base._utils import DeviceLike
from gpipe.layout import PIPE, Layout
from gpipe.pipe import Pipe, through_output
from gpipe.pipe.partition import cut

__all__ = ["GPipe", "verify_module"]

# torchgpipe recommends its balancer where balance is wrong; so does this front end.
_BALANCER = (
    "to choose it by measured time: balance = gpipe.balance_by_time(model, sample, stages=K)"
)
_NO_BALANCE = f"balance is required: the layers in each partition, e.g. [2, 2]; {_BALANCER}"


def verify_module(module: nn.Module) -> None:
    """Refuse what torchgpipe refuses: a module that is not an ``nn.Sequential``
    (``TypeError``), one that holds a layer twice, or layers that share a parameter
    (``ValueError``: each partition must own its parameters)."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be nn.Sequential to be partitioned, got {type(module).__name__}; "
            "wrap its layers in order, or use gpipe.Pipe.from_model for any model"
        )
    children = list(module._modules.items())
    seen: dict[int, str] = {}
    for name, child in children:
        if id(child) in seen:
            raise ValueError(
                f"module with duplicate children is not supported: layers {seen[id(child)]!r} "
                f"and {name!r} are one module; give each position its own layer"
            )
        seen[id(child)] = name
    owner: dict[int, str] = {}
    for name, child in children:
        for parameter in child.parameters() if child is not None else ():
            if owner.setdefault(id(parameter), name) != name:
                raise ValueError(
                    "module with duplicate parameters in distinct children is not supported: "
                    f"layers {owner[id(parameter)]!r} and {name!r} share one; gpipe.Pipe "
                    "trains shared (tied) parameters with tied=[(name, name)]"
                )


class GPipe(nn.Module):
    """torchgpipe's ``GPipe(module, balance, *, devices, chunks, checkpoint,
    deferred_batch_norm)`` on ``gpipe.Pipe``; see the module's docstring.

    Args:
        module: an ``nn.Sequential`` (see :func:`verify_module`).
        balance: layers per partition, summing to ``len(module)``.
        devices: a device per partition (extra ones are ignored); default: the CUDA
            devices in order, or the CPU for every partition where there is none.
        chunks: micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"`` (``gpipe.base.remat``).
        deferred_batch_norm: batch norm's running statistics once per mini-batch.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        devices: Sequence[DeviceLike] | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        verify_module(module)
        if balance is None:
            raise ValueError(_NO_BALANCE)
        balance, chunks, checkpoint = list(balance), int(chunks), str(checkpoint)
        if not len(module) and balance:
            raise ValueError(f"balance={balance} cuts layers, but the module is empty: use []")
        if len(module):
            layout = Layout(stages=max(len(balance), 1), chunks=chunks, checkpoint=checkpoint)
            problems = layout.problems(layers=len(module), balance=balance, spelling=PIPE)
            if problems:
                if any("balance" in problem for problem in problems):
                    problems.append(_BALANCER)
                raise ValueError("invalid GPipe configuration:\n- " + "\n- ".join(problems))
        self.balance, self.chunks, self.checkpoint = balance, chunks, checkpoint
        self.devices = _devices(devices, len(balance))
        # Each partition keeps the layers' names (verify_module refused a repeated layer).
        self.partitions = nn.ModuleList(nn.Sequential(OrderedDict(p)) for p in cut(module, balance))
        pipe = None
        if balance:
            pipe = Pipe(
                nn.Sequential(*self.partitions), balance=[1] * len(balance),
                devices=self.devices, chunks=chunks, checkpoint=checkpoint,
                deferred_batch_norm=deferred_batch_norm,
            )  # fmt: skip
        self.__dict__["_pipe"] = pipe  # not a submodule: the state dict is the partitions'

    # -- torchgpipe's sequence of layers ----------------------------------------------------

    def __len__(self) -> int:
        return sum(len(partition) for partition in self.partitions)

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        try:
            return layers[index]
        except IndexError:
            raise IndexError(f"layer {index} of a GPipe of {len(layers)} layers") from None

    # -- forward ----------------------------------------------------------------------------

    def forward(self, input: Any) -> Any:
        """The module's output on ``input`` (a tensor or a tuple of tensors, on
        ``devices[0]`` or anywhere), on ``devices[-1]``, connected to autograd wherever it is
        on; recomputing as ``checkpoint`` says in training mode only."""
        _check_tensors(input, "input")
        if self._pipe is None:  # an empty module: the identity
            return input
        batch = microbatch.batch_size(input, name="input")
        # torchgpipe splits a batch smaller than chunks into fewer micro-batches
        output = through_output.forward(self._pipe, input, chunks=max(1, min(self.chunks, batch)))
        _check_tensors(output, "output")
        return output

    def train(self, mode: bool = True) -> GPipe:
        super().train(mode)
        if self._pipe is not None:
            self._pipe.train(mode)  # the Pipe's own flag decides recomputation
        return self

    # -- devices are fixed at construction ---------------------------------------------------

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        try:
            device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        except RuntimeError as error:  # .to(0) where there is no accelerator: still a move
            raise TypeError(_moving(".to(...)")) from error
        if device is not None:
            raise TypeError(_moving(f".to({device})"))
        return super().to(dtype=dtype) if dtype is not None else self

    def cuda(self, device: Any = None) -> GPipe:
        raise TypeError(_moving(".cuda()"))

    def cpu(self) -> GPipe:
        raise TypeError(_moving(".cpu()"))

    def extra_repr(self) -> str:
        return (
            f"balance={self.balance}, devices={[str(d) for d in self.devices]}, "
            f"chunks={self.chunks}, checkpoint={self.checkpoint!r}"
        )


def _moving(how: str) -> str:
    return (
        f"a GPipe cannot be moved with {how}: each partition already lives on its device; "
        "build it with devices=[...] instead (casting, e.g. .double(), is allowed)"
    )


def _devices(devices: Sequence[DeviceLike] | None, partitions: int) -> list[torch.device]:
    if devices is None:
        count = torch.cuda.device_count()
        devices = range(count) if count else ["cpu"] * partitions
    devices = [torch.device(d) for d in devices]
    if len(devices) < partitions:
        raise IndexError(
            f"too few devices to hold the partitions (devices: {len(devices)}, partitions: "
            f"{partitions}): give one device per partition, or fewer partitions in balance"
        )
    return devices[:partitions]


def _check_tensors(value: Any, what: str) -> None:
    """torchgpipe's rule at the boundaries: a tensor or a tuple of tensors."""
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return
    got = type(value).__name__
    if isinstance(value, tuple):
        got = f"a tuple of {', '.join(type(v).__name__ for v in value)}"
    raise TypeError(
        f"GPipe's {what} must be a tensor or a tuple of tensors, got {got}; for dicts, "
        "lists and constants use gpipe.Pipe, which splits any nested batch"
    )
