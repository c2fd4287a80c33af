"""``Pipe``: the front end that trains an ``nn.Sequential`` as a pipeline.

It cuts the model into stages (``gpipe.partition``), builds the schedule
(``gpipe.schedule``), splits each mini-batch into micro-batches (``gpipe.microbatch``) and
lets the runtime (``gpipe.engine.runtime``) walk the schedule over the stages. The same
class serves one process holding every stage and, with ``group=``, one process per rank of
a pipeline spread over processes and machines; what differs between the two is
``gpipe.parallel.group``'s business, so this module never touches ``torch.distributed``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from gpipe import allocator, assembly, microbatch, remat, through_output
from gpipe._utils import (
    DeviceLike,
    Verdict,
    add_earlier_gradients,
    first_nonfinite,
    gradient_norms,
    local_value,
    norm_part,
    poison,
    read_verdict,
    restore_gradients,
    seconds,
    set_aside_gradients,
    to_device,
)
from gpipe.engine import batchnorm
from gpipe.engine.loss import LossSpec, check_batch, loss_specs
from gpipe.engine.runtime import StepInputs, StepResult
from gpipe.errors import PartitionError, PipelineError
from gpipe.frontend import ModelNames, Original, calls, capture, origin_of
from gpipe.layout import Layout
from gpipe.losses import NO_TOKEN, NOTHING_COUNTS, UNCOUNTED, declared, uncounted
from gpipe.parallel.clipping import GradientWatch
from gpipe.parallel.group import pipeline_group
from gpipe.parallel.sharded import full_value, shard_like
from gpipe.schedule import Schedule, TimedAction

__all__ = ["Pipe"]

Reduction = Literal["mean", "sum"]
_FIXED = "a Pipe cannot be moved with {}: each stage lives on its own device; build the Pipe \
with devices=[{}] instead"


class Pipe(ModelNames, nn.Module):
    """An ``nn.Sequential`` cut into stages on devices, trained by micro-batch pipelining.

    Args:
        module: the model, an ``nn.Sequential`` (its layers move to their stage's device,
            in place), or a function that builds it: then each process builds only its own
            layers, bit for bit as ``torch.manual_seed(init_seed); factory()`` would (see
            ``gpipe.materialize``), so every cut and every process count gives the same
            weights.
        balance: layers per stage; ``len(balance)`` is the number of stages. ``"auto"``:
            profile the model on ``sample`` (one micro-batch of inputs) and choose the cuts
            that minimise the slowest stage (``gpipe.estimate.balance.balance_by_time``).
            ``None`` (default): the layers split evenly by count (not by size or time;
            ``Layout.default_balance``) over one stage per device in ``devices``, or per rank
            of ``group`` when ``devices`` is not given (``virtual_stages`` each); with
            neither, one process holds one stage on the CPU: ``Pipe(model)`` is the plain
            model trained by micro-batches.
        devices: one device per rank (default: all ``"cpu"``; with ``group``, this
            process's ``cuda:LOCAL_RANK`` under NCCL). A rank holds one stage, or
            ``virtual_stages`` stages with ``"interleaved-1f1b"``, two with ``"zb-v"`` and
            ``"dualpipe-v"`` (rank r holds stages r and 2K-1-r).
        chunks: micro-batches per mini-batch (M).
        checkpoint: re-materialization: ``"always"``, ``"except_last"`` (every
            micro-batch but the last, whose backward follows its forward at once) or
            ``"never"``.
        checkpoint_layers: with ``checkpoint`` on, recompute this many layers at a time in
            backward instead of a whole stage (nested checkpoints: a pass without autograd
            keeps each group's input, then each group is recomputed and differentiated from
            the last down), so that the peak holds one group's activations, not the stage's,
            for one more forward without autograd. ``None`` (default): the whole stage.
            Zero-bubble schedules (a split backward) and stages with skip connections
            recompute whole.
        schedule: a name from ``gpipe.schedule.SCHEDULES`` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved-1f1b"``, ``"zb-h1"``, ``"zb-v"``, ``"dualpipe-v"``, ``"zb-auto"``)
            or a ``Schedule`` of your own for these stages and M micro-batches (e.g.
            ``gpipe.schedule.auto.zb_auto`` built for measured costs).
        deferred_batch_norm: replace BatchNorm layers by ``DeferredBatchNorm`` so that
            running statistics are updated once per mini-batch, as without splitting.
        virtual_stages: stages per device for ``"interleaved-1f1b"`` (stage s lives on
            ``devices[s % len(devices)]``; default 2 for that schedule, 1 otherwise); see
            ``gpipe.schedule.interleaved_1f1b`` for the constraint on ``chunks``. 2 for
            the V schedules (their default), and 1 or 2 (a V) for ``"zb-auto"``.
        group: a ``torch.distributed`` process group whose ranks are the pipeline's
            ranks; each process then holds only its own stages. ``None``: one process.
        data_parallel_group: with ``group``, the replicas of this rank's stages; their
            gradients are averaged over it once per step (bucketed all-reduce).
        shard: with ``data_parallel_group``, shards each stage's parameters, gradients
            and optimizer state over the replicas (FSDP2, one unit per layer, gathered per
            layer for each forward and backward; see ``gpipe.parallel.sharded``).
            ``"params"``: the step's gradients are accumulated whole and reduce-scattered
            once per step, P + 3P / R bytes per process with AdamW instead of 4P;
            ``"all"``: each micro-batch's are reduce-scattered into the shards (M times
            the communication), 4P / R and one layer's gradient. Parameters become
            ``DTensor`` shards: build the optimizer after the Pipe. ``None`` (default):
            every replica holds all.
        init_seed: seed of the per-layer initialization when ``module`` is a function.
        timeout: seconds any rank waits for another before raising (multi-process).
        receive_ahead: multi-process, how receives are posted (``gpipe.transport.distributed``):
            ``None`` (default) by backend — ahead on gloo, in NCCL's global order on NCCL;
            ``False`` runs NCCL's order on gloo (to test it on the CPU).
        transport: multi-process, what carries the messages between stages: ``"auto"``
            (default) a Unix socket per pair of ranks where every rank runs on this machine
            with CPU stages on gloo (``gpipe.transport.sockets``: about 10× cheaper per
            message than gloo there), else the process group (gloo or NCCL);
            ``"sockets"`` requires the sockets; ``"group"`` always the process group.
        sample: a micro-batch of inputs, for ``balance="auto"``.
        sample_loss: ``(target, loss_fn)`` for that micro-batch: ``balance="auto"`` then
            times the loss with the last layer, since the last stage runs it too.
        tied: groups of whole-model parameter names that are one tensor used by several
            stages, e.g. ``[("0.token.weight", "9.out.weight")]``: each stage keeps a copy,
            their gradients are summed once per step, and the copies stay equal.

    Example::

        pipe = gpipe.Pipe(model, balance=[3, 3], devices=["cuda:0", "cuda:1"], chunks=8)
        opt = torch.optim.AdamW(pipe.parameters())
        loss = pipe.step(x, y, nn.functional.cross_entropy)
        opt.step(); opt.zero_grad()

    Parameters keep their names in the whole model (``"3.weight"``), so
    ``pipe.state_dict()`` and ``model.state_dict()`` are interchangeable (with ``group``,
    a rank's state dict is its shard of the whole model's).
    """

    def __init__(
        self,
        module: assembly.ModelOrFactory,
        *,
        balance: Sequence[int] | Literal["auto"] | None = None,
        devices: Sequence[DeviceLike] | None = None,
        chunks: int = 1,
        checkpoint: remat.Remat = "except_last",
        checkpoint_layers: int | None = None,
        schedule: str | Schedule = "gpipe",
        deferred_batch_norm: bool = False,
        virtual_stages: int | None = None,
        group: Any = None,
        data_parallel_group: Any = None,
        shard: Literal["params", "all"] | None = None,
        init_seed: int = 0,
        timeout: float = 60.0,
        sample: Any = None,
        sample_loss: tuple[Any, Callable] | None = None,
        tied: Sequence[Sequence[str]] = (),
        receive_ahead: bool | None = None,
        transport: Literal["auto", "sockets", "group"] = "auto",
    ) -> None:
        super().__init__()
        self.group, self.timeout = group, seconds(timeout, "timeout")
        # A captured model's: the Pipe shows its names and order, follows its mode and hooks.
        self._original = Original.of(module)
        self._ranks = pipeline_group(
            group, timeout=self.timeout, receive_ahead=receive_ahead, transport=transport
        )
        self.rank = self._ranks.rank
        config = assembly.configure(
            module, self._ranks, balance=balance, devices=devices, chunks=chunks,
            checkpoint=checkpoint, checkpoint_layers=checkpoint_layers, schedule=schedule,
            virtual_stages=virtual_stages,
            data_parallel_group=data_parallel_group, shard=shard, init_seed=init_seed,
            sample=sample, sample_loss=sample_loss,
            settings={"tied": tied, "deferred_batch_norm": deferred_batch_norm},
        )  # fmt: skip
        self.layout: Layout = config.layout
        self.balance, self.devices, self.schedule = config.balance, config.devices, config.schedule
        placed = assembly.place(
            config, self._ranks, deferred_batch_norm=deferred_batch_norm,
            tied_names={name for names in tied for name in names}, init_seed=init_seed,
        )  # fmt: skip
        for name, layer in placed.layers:
            self.add_module(name, layer)
        self.stages = placed.stages
        self._tied = assembly.tie(config, placed, tied)
        wiring = assembly.wire(
            config, placed, self._ranks, self._tied,
            data_parallel_group=data_parallel_group, timeout=self.timeout,
        )  # fmt: skip
        self._transport, self._runtime = wiring.transport, wiring.runtime
        self._reducer, self._sharded = wiring.reducer, wiring.sharded
        self.last_trace: list[TimedAction] = []
        # Across processes torch's own clip sees one stage: gpipe notices it (clipping.py).
        self._watch = GradientWatch(self._ranks.check_edit) if self.rank is not None else None
        self._warned_uncounted = False
        if config.factory is not None:
            # The record of the whole model and its other layers (on meta) go now; the pages
            # they held go back, so that no process keeps a cost per layer of the whole model.
            del config, placed, wiring
            allocator.trim()

    @classmethod
    def from_model(
        cls,
        model: nn.Module | Callable[[], nn.Module],
        example: Any,
        *,
        split: str | Sequence[str] | None = None,
        weights: str | os.PathLike | None = None,
        strict: bool = True,
        init_seed: int = 0,
        tied: Sequence[Sequence[str]] = (),
        **options: Any,
    ) -> Pipe:
        """A Pipe of any model, as it is (a Hugging Face or torchvision model, ...).

        The model's forward is captured on ``example`` (its inputs: a tensor, a tuple of
        positional tensors or a dict of keyword tensors; only shapes matter) and cut
        before each module named by ``split`` (``"model.layers"``: every block of that
        list; a list of module paths; ``None``: the model's largest ``nn.ModuleList``), see
        ``gpipe.frontend``. ``balance`` then counts units: the work before the first split
        module, each split module, the work after the last one (``len(pipe.units)``
        before building: ``gpipe.frontend.capture(...)``); without it the units are split
        evenly over the stages, as ``Pipe`` splits layers. Parameters used by two units
        (tied embeddings) are found and tied. Every other option is ``Pipe``'s
        (``balance="auto"`` profiles the units on ``example``).

        Inputs of ``step`` and ``forward`` have the example's structure; the last stage's
        output is the model's own (e.g. a ``ModelOutput`` with ``.logits``). Names in
        ``named_parameters()`` and ``state_dict()`` are the model's own.

        Big models: pass the model on ``meta``, or a function that builds it; each process
        then materializes only its own units, from ``weights`` (a ``save_pretrained``
        directory or a ``.safetensors`` file, read under the names ``from_pretrained`` maps
        its keys to) or by the model's own initialization (a function: exactly
        ``torch.manual_seed(init_seed); model()``), see ``gpipe.frontend.weights``. Weights
        load whole or not at all: a tensor the checkpoint lacks, one the model does not have
        or one of another shape stops the build on every rank, naming them
        (``gpipe.frontend.WeightsError``); ``strict=False`` initializes the tensors the
        checkpoint does not fill, as without ``weights``, and lists them in a warning. A
        rank's tensors then equal ``from_pretrained(weights)``'s. The model is captured for
        the device type of the stages (a model on meta: on fake tensors of that device), so
        that its device-dependent branches are those of the device it runs on.

        Shapes: the dimensions of the inputs may change from step to step within what the
        capture assumed (``torch.export``'s range constraints: a forward that branches on a
        length is captured for one side); an input outside raises before the graph runs,
        naming the dimension, the range and the remedy.
        """
        if options.get("balance") == "auto":
            options.setdefault("sample", example)  # profile the units on the example
        model, origin = origin_of(model, weights, init_seed, strict)
        if origin is not None and options.get("balance") == "auto":
            raise PartitionError(
                "balance='auto' profiles the model, which needs its values, but this one is on "
                "meta (or a function): pass balance=[units per stage], or plan on a smaller "
                "configuration built in one process (gpipe.plan)"
            )
        device = assembly.capture_device(options.get("devices"), options.get("group"))
        captured = capture(model, example, split=split, device=device)
        captured.origin = origin
        return cls(captured, tied=[*captured.tied, *tied], init_seed=init_seed, **options)

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    @property
    def transport(self) -> str:
        """How this rank's stages reach the others: ``"local"`` (one process),
        ``"sockets"`` or ``"group"`` (what ``transport="auto"`` chose, or what was asked)."""
        return self._transport.kind

    @property
    def chunks(self) -> int:
        return self.layout.chunks

    @property
    def checkpoint(self) -> str:
        return self.layout.checkpoint

    @property
    def virtual_stages(self) -> int:
        return self.layout.virtual_stages

    def _holds(self, stage: int) -> bool:
        return any(s.index == stage for s in self.stages)

    # -- training and inference -----------------------------------------------------------

    def step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        reduction: Reduction | None = None,
        count: Callable[[Any], float | torch.Tensor] | None = None,
        seed: int | None = None,
        trace: bool = False,
        scaler: Any = None,
    ) -> torch.Tensor:
        """Run one pipelined training step; gradients are accumulated into the parameters.

        ``loss_fn(output, target)`` returns the scalar loss of one micro-batch.
        ``reduction`` says how it reduces over samples, so that the gradient left in the
        parameters is that of the whole mini-batch's loss (``None``: what the loss shows,
        ``gpipe.losses.declared``: an ``nn`` loss's ``reduction``; else ``"mean"``):

        * ``"mean"`` (e.g. ``F.cross_entropy``): micro-batch losses are weighted
          by their share of the samples (uneven micro-batches included) or, with
          ``count``, by their share of ``count(target)`` over the mini-batch. A loss that
          averages over something else than samples needs ``count``: e.g. a token mean
          over a padded batch, which averages over the tokens that are not padding. The
          losses of ``gpipe.losses``, ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` (any
          ``ignore_index``, class weights) count for themselves::

              pipe.step(input_ids, labels, gpipe.losses.causal_lm())  # shifted inside
              pipe.step(x, y, loss_fn, count=lambda y: (y != -100).sum())  # your own mean

          A micro-batch whose count is 0 adds nothing. Targets with labels below 0 (an
          ignore index) and no ``count`` warn (once per Pipe), with the recipe.
        * ``"sum"``: micro-batch losses are added (a sum-reduced loss).

        ``seed`` fixes the random numbers (dropout) of this step (default: one draw from
        torch's global generator, on every rank alike); see ``gpipe.rng``. With
        ``trace=True`` the start and end of every action is recorded in ``self.last_trace``
        (seconds from the step's start; multi-process: this rank's actions, in
        ``time.perf_counter`` seconds, which all ranks of a machine share).

        ``scaler``: a ``torch.amp.GradScaler`` for float16 mixed precision. Backward runs
        from each micro-batch's loss times its scale; a step whose gradients are not finite
        (anywhere, on any rank) is not refused but left to the scaler, which every rank's
        ``scaler.step(optimizer)`` then skips alike (and ``scaler.update()`` lowers the
        scale alike); the loss returned is unscaled. Unscale before clipping, as usual::

            loss = pipe.step(x, y, loss_fn, scaler=scaler)
            scaler.unscale_(optimizer); pipe.clip_grad_norm_(1.0)
            scaler.step(optimizer); scaler.update(); optimizer.zero_grad()

        With ``group``, every rank calls ``step``; ``inputs`` matter only where the first
        stage lives and ``targets`` where the last does (elsewhere they may be ``None``).
        With ``data_parallel_group`` this step's gradients are averaged over the replicas.
        A step that fails leaves the gradients as they were before it.

        Returns the mini-batch loss, detached, as a float64 tensor (which holds a float32 or
        bfloat16 loss exactly), the same on every rank when multi-process.
        """
        first, last = self._holds(0), self._holds(self.num_stages - 1)
        reduction, count = declared(loss_fn, reduction, count, chunks=self.chunks)
        scale = _scale_of(scaler, self.stages[-1].device)
        inputs_mb = microbatch.split(inputs, self.chunks, name="inputs") if first else None
        losses: list[LossSpec | None] = [None] * self.chunks
        ignored = None  # labels < 0 in targets with no count=: read with the step's verdict
        if last:
            targets_mb = microbatch.split(targets, self.chunks, name="targets")
            if count is None and reduction == "mean":
                ignored = uncounted(targets_mb)
            losses = loss_specs(
                loss_fn, targets_mb, inputs_mb, reduction=reduction, count=count,
                device=self.stages[-1].device, scale=scale,
            )  # fmt: skip
        result = self._run(inputs_mb, losses, seed, trace, scale=scale, ignored=ignored)
        return result.loss

    def forward(self, inputs: Any) -> Any:
        """Outputs joined on the last stage's device. In training mode with autograd on (one
        process), connected to autograd: ``loss(pipe(x)).backward()`` trains
        (``gpipe.through_output``); else pipelined inference, without gradients.

        Multi-process: every rank calls it; the rank of the last stage gets the output,
        the others ``None``.
        """
        self._follow_model()  # a captured model's mode, and no hook added since capture
        if self.training and torch.is_grad_enabled():
            return through_output.forward(self, inputs)
        first = self._holds(0)
        inputs_mb = microbatch.split(inputs, self.chunks, name="inputs") if first else None
        with calls.without_autograd():  # under torch.inference_mode() too
            result = self._run(inputs_mb, None, None, False)
        if not self._holds(self.num_stages - 1):
            return None
        return microbatch.join([result.outputs[m] for m in range(self.chunks)])

    def _run(
        self,
        inputs_mb,
        losses,
        seed: int | None,
        trace: bool,
        scale: torch.Tensor | None = None,
        ignored: torch.Tensor | None = None,
    ) -> StepResult:
        self._follow_model()  # a captured model's mode, and no hook added since capture
        if self._ranks.broken is not None:
            raise PipelineError(
                f"this pipeline failed in an earlier step ({self._ranks.broken}); "
                "its ranks may disagree on what was sent: build a new Pipe",
            )
        if self._tied is not None:
            self._tied.refresh()
        if inputs_mb is not None:
            inputs_mb = [
                to_device(x, self.stages[0].device, differentiable=True) for x in inputs_mb
            ]
        # Gradients of earlier steps wait aside: a failed step must leave them as they were.
        earlier = set_aside_gradients(self.parameters()) if losses is not None else {}
        try:
            self._transport.begin(training=losses is not None)
            batch = sum(microbatch.batch_size(x) for x in inputs_mb) if inputs_mb else None
            seed, first_batch = self._ranks.begin_step(seed, batch)
            mbs = range(self.chunks)
            if losses is not None and losses[0] is not None and first_batch is not None:
                check_batch(losses, first_batch)
            step = StepInputs(
                microbatches=inputs_mb or [None] * self.chunks,
                seed=seed,
                remat=[remat.recomputes(self.checkpoint, m, self.chunks) for m in mbs],
                losses=losses,
            )
            result = self._runtime.run(step, trace=trace, clock_origin=self._ranks.clock_origin)
            if self._reducer is not None and losses is not None:
                self._reducer.finish()
            if self._tied is not None and losses is not None:
                # this step's gradients only: every holder already carries the earlier sum
                self._tied.sync_gradients(self._ranks.exchange)
            add_earlier_gradients(earlier)
        except BaseException as error:
            self._abandon_step(earlier)
            explained = self._sharded.explain(error) if self._sharded is not None else error
            self._ranks.fail(explained, self.stages)
            if explained is not error:
                raise explained from error
            raise
        local_loss = None
        if losses is not None and self._holds(self.num_stages - 1):
            # Stacked as they are, then widened: exact, in two operations instead of M.
            losses_mb = torch.stack([result.losses[m] for m in range(self.chunks)])
            local_loss = losses_mb.to(torch.float64).sum()
        training = losses is not None
        with_grads = [(n, p) for n, p in self.named_parameters() if p.grad is not None]
        grads = [p.grad for _, p in with_grads] if training else []
        # The watch compares norms before and after the script's edits: those need float64.
        norms = gradient_norms(grads, precise=self._watch is not None) if grads else None
        try:
            verdict = read_verdict(
                local_loss, norms, ignored if not self._warned_uncounted else None
            )
            local_trouble = first_nonfinite(
                [n for n, _ in with_grads], verdict.finite, grads, norms
            )
            if verdict.ignored and not self._warned_uncounted:
                self._warned_uncounted = True
                warnings.warn(UNCOUNTED, stacklevel=3)
            trouble = local_trouble
            if self._sharded is not None and training:
                trouble = self._sharded.nonfinite_anywhere(trouble, doing="ending a step")
            if self._watch is not None and training:
                self._watch.forget()
            agreed = self._ranks.agree(
                local_loss, verdict.loss, trouble, refuse_nonfinite=scale is None,
                why=_why_not_finite(verdict, ignored, losses),
            )  # fmt: skip
            # Every rank has received all of its messages: no send can be waiting.
            self._transport.finish()
        except BaseException:  # refused here or elsewhere: this step counts nowhere
            self._abandon_step(earlier)
            raise
        result.loss = agreed.loss
        if scale is not None and agreed.nonfinite_grads and local_trouble is None:
            # Every rank's scaler must find what one rank's found, and skip the step alike.
            for _, p in with_grads:
                poison(p.grad)
        if self._watch is not None and training:
            self._watch.note([p for _, p in with_grads], norms, scale)
        batchnorm.commit_all(self)
        self.last_trace = result.trace
        return result

    def _abandon_step(self, earlier: dict) -> None:
        """Nothing of a failed or refused step survives: messages, stored micro-batches,
        running statistics and gradient reductions are dropped, the gradients of earlier
        steps restored; one process is ready for the next step."""
        self._transport.clear()
        for stage in self.stages:
            stage.clear()
        batchnorm.reset_all(self)
        if self._reducer is not None:
            self._reducer.reset()
        restore_gradients(self.parameters(), earlier)

    # -- parameters and gradients ------------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters, each once: a tied tensor is one parameter, as in the
        un-split model, though a stage on another device holds a copy of it (gpipe's, kept
        equal; listed with ``remove_duplicate=False``)."""
        tied = getattr(self, "_tied", None)
        hidden = tied.extra_copies() if tied is not None and remove_duplicate else set()
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(p) not in hidden:
                yield name, p

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the whole model (every stage, every replica) by their norm.

        The norm is over all stages' gradients together, as for the un-split model, and is
        returned on every rank, in the gradients' dtype (as ``torch.nn.utils.clip_grad_norm_``).
        """
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        # A tied tensor counts once, as in the un-split model, though each holder has a copy.
        elsewhere = self._tied.counted_elsewhere() if self._tied is not None else set()
        counted = [
            p.grad for p in self.parameters() if p.grad is not None and id(p) not in elsewhere
        ]
        p = float(norm_type)
        local = norm_part(counted, p, self.stages[0].device)
        if self._sharded is not None:  # each replica holds a shard of every gradient
            local = self._sharded.norm_over_replicas(
                local, maximum=p == float("inf"), doing="clip_grad_norm_"
            )
        local = self._ranks.norm_total(local, maximum=p == float("inf"))
        total = local if p == float("inf") else local.pow(1.0 / p)
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            local_value(g).mul_(scale.to(g.device, g.dtype))
        if self._watch is not None:
            self._watch.rebase()  # gpipe's own clip: not the script's
        return total.to(grads[0].dtype if grads else torch.float32)

    # -- state of a sharded Pipe -------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` with whole tensors, detached, on the CPU. With ``shard=``, each
        parameter is gathered from the replicas: every replica must call it."""
        return {k: full_value(v).detach().cpu() for k, v in self.state_dict().items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As ``nn.Module.load_state_dict``; with ``shard=`` it takes whole tensors (as
        :meth:`full_state_dict` gives, or the plain model's), each replica keeping its shard."""
        if self._sharded is not None:
            own = self.state_dict(keep_vars=True)
            state_dict = {
                k: shard_like(own[k], v) if k in own else v for k, v in state_dict.items()
            }
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

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
        raise TypeError(_FIXED.format(".cuda()", "'cuda:0', 'cuda:1', ..."))

    def cpu(self) -> Pipe:
        raise TypeError(_FIXED.format(".cpu()", "'cpu', ..."))

    def extra_repr(self) -> str:
        return (
            f"balance={self.balance}, devices={[str(d) for d in self.devices]}, "
            f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
            f"schedule={self.schedule.name!r}, virtual_stages={self.virtual_stages}, {self._ranks}"
        )


def _scale_of(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """A GradScaler's scale as a tensor on ``device`` (None without an enabled scaler); the
    call also gives the scaler its scale on a rank that computes no loss, so that its
    ``unscale_``, ``step`` and ``update`` work there."""
    if scaler is None:
        return None
    if not callable(getattr(scaler, "scale", None)) or not hasattr(scaler, "is_enabled"):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not scaler.is_enabled():
        return None
    return scaler.scale(torch.ones((), device=device))


def _why_not_finite(
    verdict: Verdict, ignored: torch.Tensor | None, losses: list[LossSpec | None] | None
) -> str:
    """Why the loss is not finite, when the targets say (read only then: a refused step)."""
    if verdict.loss is None or math.isfinite(verdict.loss):
        return ""
    if ignored is not None:
        empty = [m for m, flag in enumerate(ignored[1:].tolist()) if flag]
        if empty:
            return NOTHING_COUNTS.format(microbatch=empty[0])
    divisor = losses[0].divisor if losses and losses[0] is not None else None
    if divisor is not None and int(divisor) == 0:
        return NO_TOKEN
    return ""
