"""``Pipe``: the front end that trains an ``nn.Sequential`` as a pipeline in one process.

It cuts the model into stages (``gpipe.partition``), builds the schedule
(``gpipe.schedule``), splits each mini-batch into micro-batches (``gpipe.microbatch``) and
lets the runtime (``gpipe.runtime``) walk the schedule over the stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from gpipe import microbatch, rng
from gpipe.batchnorm import DeferredBatchNorm
from gpipe.partition import DeviceLike, PartitionError, check_partition, cut, shared_parameters
from gpipe.runtime import Runtime, StepInputs
from gpipe.schedule import SCHEDULES, Schedule, TimedAction, build_schedule
from gpipe.stage import LossSpec, Stage
from gpipe.transport import LocalTransport, to_device

__all__ = ["CHECKPOINT_MODES", "Pipe"]

CHECKPOINT_MODES = ("always", "except_last", "never")
Checkpoint = Literal["always", "except_last", "never"]
Reduction = Literal["mean", "sum"]


class Pipe(nn.Module):
    """An ``nn.Sequential`` cut into stages on devices, trained by micro-batch pipelining.

    Args:
        module: the model, an ``nn.Sequential``. Its layers move to their stage's device
            (in place, like ``Module.to``).
        balance: layers per stage; ``len(balance)`` is the number of stages.
        devices: one device per rank (default: all ``"cpu"``); a rank holds one stage, or
            ``virtual_stages`` stages with ``"interleaved-1f1b"``.
        chunks: micro-batches per mini-batch (M).
        checkpoint: re-materialization: ``"always"``, ``"except_last"`` (every
            micro-batch but the last, whose backward follows its forward at once) or
            ``"never"``.
        schedule: a name from ``gpipe.schedule.SCHEDULES`` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zb-h1"``) or a ``Schedule`` of your own for these
            stages and M micro-batches.
        virtual_stages: stages per device for ``"interleaved-1f1b"`` (stage s lives on
            ``devices[s % len(devices)]``); see ``gpipe.schedule.interleaved_1f1b`` for
            the constraint on ``chunks``.
        deferred_batch_norm: replace BatchNorm layers by ``DeferredBatchNorm`` so that
            running statistics are updated once per mini-batch, as without splitting.

    Example::

        pipe = gpipe.Pipe(model, balance=[3, 3], devices=["cuda:0", "cuda:1"], chunks=8)
        opt = torch.optim.AdamW(pipe.parameters())
        loss = pipe.step(x, y, nn.functional.cross_entropy)
        opt.step(); opt.zero_grad()

    Parameters keep their names in the whole model (``"3.weight"``), so
    ``pipe.state_dict()`` and ``model.state_dict()`` are interchangeable.
    """

    def __init__(
        self,
        module: nn.Sequential,
        *,
        balance: Sequence[int],
        devices: Sequence[DeviceLike] | None = None,
        chunks: int = 1,
        checkpoint: Checkpoint = "except_last",
        schedule: str | Schedule = "gpipe",
        deferred_batch_norm: bool = False,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        balance = list(balance)
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise PartitionError(
                f"virtual_stages must be a positive int (stages per device), got {virtual_stages!r}"
            )
        if devices is None:
            devices = ["cpu"] * max(1, len(balance) // virtual_stages)
        devices = list(devices)
        try:
            check_partition(module, balance, devices, virtual_stages=virtual_stages)
            problems = []
        except PartitionError as error:
            problems = str(error).splitlines()[1:]
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            problems.append(f"- chunks must be a positive int (micro-batches), got {chunks!r}")
        if checkpoint not in CHECKPOINT_MODES:
            problems.append(
                f"- checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {checkpoint!r}"
            )
        if isinstance(schedule, str) and schedule not in SCHEDULES:
            problems.append(f"- unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
        if problems:
            raise PartitionError("invalid Pipe configuration:\n" + "\n".join(problems))

        self.balance = balance
        self.devices = [torch.device(d) for d in devices]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.virtual_stages = virtual_stages
        self.schedule = self._build_schedule(schedule)
        stage_devices = [self.devices[rank] for rank in self.schedule.stage_to_rank]
        stage_layers = cut(module, balance)
        shared = shared_parameters(stage_layers)
        if shared:
            raise PartitionError(
                "a parameter is shared by two stages, which would train two copies:\n"
                + "\n".join(f"- {s}" for s in shared)
                + "\nmove the layers that share it into one stage (change balance)"
            )

        self.stages: list[Stage] = []
        first = 0
        for index, (layers, device) in enumerate(zip(stage_layers, stage_devices, strict=True)):
            placed = []
            for name, layer in layers:
                if deferred_batch_norm:
                    layer = DeferredBatchNorm.convert(layer)
                layer = layer.to(device)
                self.add_module(name, layer)
                placed.append(layer)
            last = index == len(balance) - 1
            self.stages.append(Stage(index, placed, first_layer=first, device=device, is_last=last))
            first += len(layers)

        self._transport = LocalTransport(stage_devices)
        self._runtime = Runtime(self.schedule, dict(enumerate(self.stages)), self._transport)
        self.last_trace: list[TimedAction] = []

    def _build_schedule(self, schedule: str | Schedule) -> Schedule:
        if isinstance(schedule, str):
            schedule = build_schedule(
                schedule,
                num_ranks=len(self.devices),
                num_microbatches=self.chunks,
                virtual_stages=self.virtual_stages,
            )
        shape = (schedule.num_stages, schedule.num_ranks, schedule.num_microbatches)
        if shape != (self.num_stages, len(self.devices), self.chunks):
            raise ValueError(
                f"schedule {schedule.name!r} is for {schedule.num_stages} stages on "
                f"{schedule.num_ranks} ranks and {schedule.num_microbatches} micro-batches, "
                f"but this Pipe has {self.num_stages} stages on {len(self.devices)} devices "
                f"and chunks={self.chunks}"
            )
        return schedule.validate()

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    # -- training and inference -----------------------------------------------------------

    def step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        reduction: Reduction = "mean",
        seed: int | None = None,
        trace: bool = False,
    ) -> torch.Tensor:
        """Run one pipelined training step; gradients are accumulated into the parameters.

        ``loss_fn(output, target)`` returns the scalar loss of one micro-batch.
        ``reduction`` says how it reduces over samples, so that the gradient left in the
        parameters is that of the whole mini-batch's loss:

        * ``"mean"`` (default, e.g. ``F.cross_entropy``): micro-batch losses are weighted
          by their share of the samples (uneven micro-batches included);
        * ``"sum"``: micro-batch losses are added. Use it for a sum-reduced loss, and for
          any custom normalization. E.g. a token mean over a padded batch, with
          ``n_tokens`` counted over the whole mini-batch::

              def loss_fn(out, y):
                  total = F.cross_entropy(out, y, reduction="sum", ignore_index=-1)
                  return total / n_tokens

              pipe.step(x, y, loss_fn, reduction="sum")


        ``seed`` fixes the random numbers (dropout) of this step (default: drawn from
        torch's global generator); see ``gpipe.rng``. With ``trace=True`` the start and
        end of every action is recorded in ``self.last_trace``.

        Returns the mini-batch loss, detached, on the last stage's device.
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        inputs_mb = microbatch.split(inputs, self.chunks, name="inputs")
        targets_mb = microbatch.split(targets, self.chunks, name="targets")
        sizes = [microbatch.batch_size(x, name="inputs") for x in inputs_mb]
        target_sizes = [microbatch.batch_size(y, name="targets") for y in targets_mb]
        if sizes != target_sizes:
            raise ValueError(
                f"inputs and targets have different batch sizes "
                f"({sum(sizes)} and {sum(target_sizes)}); give one target per sample"
            )
        total = sum(sizes)
        weights = [n / total if reduction == "mean" else 1.0 for n in sizes]
        last_device = self.stages[-1].device
        losses = [
            LossSpec(loss_fn, to_device(y, last_device), w)
            for y, w in zip(targets_mb, weights, strict=True)
        ]
        result = self._run(inputs_mb, losses, seed, trace)
        return torch.stack([result.losses[m] for m in range(self.chunks)]).sum()

    def forward(self, inputs: Any) -> Any:
        """Pipelined inference (no gradients): outputs joined on the last stage's device."""
        with torch.no_grad():
            result = self._run(
                microbatch.split(inputs, self.chunks, name="inputs"), None, None, False
            )
        return microbatch.join([result.outputs[m] for m in range(self.chunks)])

    def _run(self, inputs_mb: list, losses: list[LossSpec] | None, seed, trace: bool):
        first_device = self.stages[0].device
        step = StepInputs(
            microbatches=[to_device(x, first_device) for x in inputs_mb],
            seed=rng.draw_step_seed() if seed is None else seed,
            remat=[self._remat(m) for m in range(self.chunks)],
            losses=losses,
        )
        try:
            result = self._runtime.run(step, trace=trace)
        except BaseException:
            # Leave the Pipe ready for the next step: nothing of this one survives.
            self._transport.clear()
            for stage in self.stages:
                stage.clear()
            for module in self.modules():
                if isinstance(module, DeferredBatchNorm):
                    module.reset_accumulators()
            raise
        for module in self.modules():
            if isinstance(module, DeferredBatchNorm):
                module.commit()
        self.last_trace = result.trace
        return result

    def _remat(self, m: int) -> bool:
        if self.checkpoint == "always":
            return True
        if self.checkpoint == "except_last":
            return m < self.chunks - 1
        return False

    # -- devices are fixed at construction --------------------------------------------------

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            raise TypeError(
                f"a Pipe cannot be moved to {device}: each stage already lives on its own "
                f"device ({', '.join(map(str, self.devices))}); build a new Pipe with "
                "devices=[...] instead"
            )
        return super().to(dtype=dtype)

    def cuda(self, device: Any = None) -> Pipe:
        raise TypeError(
            "a Pipe cannot be moved with .cuda(): each stage lives on its own device; "
            "build the Pipe with devices=['cuda:0', 'cuda:1', ...] instead"
        )

    def cpu(self) -> Pipe:
        raise TypeError(
            "a Pipe cannot be moved with .cpu(): each stage lives on its own device; "
            "build the Pipe with devices=['cpu', ...] instead"
        )

    def extra_repr(self) -> str:
        return (
            f"balance={self.balance}, devices={[str(d) for d in self.devices]}, "
            f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
            f"schedule={self.schedule.name!r}, virtual_stages={self.virtual_stages}"
        )
