"""``Pipe``: the front end that trains an ``nn.Sequential`` as a pipeline.

It cuts the model into stages (``gpipe.pipe.partition``), builds the schedule
(``gpipe.schedule``), splits each mini-batch into micro-batches (``gpipe.base.microbatch``) and
lets the runtime (``gpipe.engine.runtime``) walk the schedule over the stages. The same
class serves one process holding every stage and, with ``group=``, one process per rank of
a pipeline spread over processes and machines; what differs between the two is
``gpipe.parallel.group``'s business, so this module never touches ``torch.distributed``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from gpipe.base import allocator, microbatch, remat
from gpipe.base._utils import DeviceLike, local_value, norm_part, seconds
from gpipe.base.errors import PartitionError
from gpipe.frontend import ModelNames, Original, calls, capture, origin_of
from gpipe.layout import Layout
from gpipe.parallel.clipping import GradientWatch
from gpipe.parallel.group import pipeline_group
from gpipe.parallel.sharded import full_value, shard_like
from gpipe.pipe import assembly, stepping, through_output
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
            ``virtual_stages`` stages (two for the V schedules: rank r holds stages r and
            2K-1-r).
        layout: a :class:`gpipe.Layout`: micro-batches, schedule, re-materialization, stages
            per rank and sharding (see its fields); its ``stages`` are the ranks of
            ``devices`` (or of ``group``), its ``replicas`` ``data_parallel_group``'s.
        chunks, checkpoint, checkpoint_layers, schedule, virtual_stages, shard: the shorthand
            for ``layout=``: ``Pipe(model, chunks=8)`` is ``Pipe(model,
            layout=Layout(chunks=8))``, on the ranks the devices and groups make (None: the
            Layout's default). ``schedule`` may also be a ``Schedule`` of your own for these
            stages and M micro-batches (e.g. ``gpipe.schedule.auto.zb_auto`` built for
            measured costs).
        deferred_batch_norm: replace BatchNorm layers by ``DeferredBatchNorm`` so that
            running statistics are updated once per mini-batch, as without splitting.
        group: a ``torch.distributed`` process group whose ranks are the pipeline's
            ranks; each process then holds only its own stages. ``None``: one process.
        data_parallel_group: with ``group``, the replicas of this rank's stages; their
            gradients are averaged over it once per step (bucketed all-reduce), or with
            ``shard`` each stage is sharded over them (``gpipe.parallel.sharded``): build
            the optimizer after the Pipe.
        init_seed: seed of the per-layer initialization when ``module`` is a function.
        timeout: seconds any rank waits for another before raising (multi-process).
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
        layout: Layout | None = None,
        chunks: int | None = None,
        checkpoint: remat.Remat | None = None,
        checkpoint_layers: int | None = None,
        schedule: str | Schedule | None = None,
        virtual_stages: int | None = None,
        shard: Literal["params", "all"] | None = None,
        deferred_batch_norm: bool = False,
        group: Any = None,
        data_parallel_group: Any = None,
        init_seed: int = 0,
        timeout: float = 60.0,
        sample: Any = None,
        sample_loss: tuple[Any, Callable] | None = None,
        tied: Sequence[Sequence[str]] = (),
        transport: Literal["auto", "sockets", "group"] = "auto",
    ) -> None:
        super().__init__()
        self.group, self.timeout = group, seconds(timeout, "timeout")
        # A captured model's: the Pipe shows its names and order, follows its mode and hooks.
        self._original = Original.of(module)
        self._ranks = pipeline_group(group, timeout=self.timeout, transport=transport)
        self.rank = self._ranks.rank
        layout = assembly.layout_of(
            layout, self._ranks, devices=devices, balance=balance,
            data_parallel_group=data_parallel_group, chunks=chunks, checkpoint=checkpoint,
            checkpoint_layers=checkpoint_layers, schedule=schedule,
            virtual_stages=virtual_stages, shard=shard,
        )  # fmt: skip
        config = assembly.configure(
            module, self._ranks, layout, balance=balance, devices=devices,
            data_parallel_group=data_parallel_group, init_seed=init_seed, sample=sample,
            sample_loss=sample_loss,
            # the transport too: never one rank on sockets and its peer on the group
            settings={"tied": tied, "deferred_batch_norm": deferred_batch_norm,
                      "transport": transport},
        )  # fmt: skip
        self.layout: Layout = config.layout
        self.balance, self.devices, self.schedule = config.balance, config.devices, config.schedule
        recorded = config.factory is not None
        self._assemble(config, tied, deferred_batch_norm, init_seed, data_parallel_group)
        if recorded:
            # The record of the whole model and its other layers (on meta) go now, with the
            # last reference to them (this frame's); the pages they held go back, so that no
            # process keeps a cost per layer of the whole model.
            del config
            allocator.trim()
        self.last_trace: list[TimedAction] = []
        # Across processes torch's own clip sees one stage: gpipe notices it (clipping.py).
        self._watch = GradientWatch(self._ranks.check_edit) if self.rank is not None else None
        self._warned_uncounted = False

    def _assemble(
        self, config: assembly.Configuration, tied, deferred_batch_norm, init_seed, dp_group
    ) -> None:
        """This process's layers placed, tied and wired (``assembly``'s steps in order)."""
        placed = assembly.place(
            config, self._ranks, deferred_batch_norm=deferred_batch_norm,
            tied_names={name for names in tied for name in names}, init_seed=init_seed,
        )  # fmt: skip
        for name, layer in placed.layers:
            self.add_module(name, layer)
        self.stages = placed.stages
        self._tied = assembly.tie(config, placed, tied)
        wiring = assembly.wire(
            config, placed, self._ranks, self._tied, data_parallel_group=dp_group,
            timeout=self.timeout,
        )  # fmt: skip
        self._transport, self._runtime = wiring.transport, wiring.runtime
        self._reducer, self._sharded = wiring.reducer, wiring.sharded

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
        inference_only: bool = False,
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

        ``inference_only=True`` captures the ``eval()`` graph alone (one export, not two: a
        Pipe only evaluated starts sooner); such a Pipe refuses ``step`` and a forward that
        trains.
        """
        model, origin = _origin(model, example, weights, init_seed, strict, options)
        device = assembly.capture_device(options.get("devices"), options.get("group"))
        captured = capture(
            model, example, split=split, device=device, inference_only=inference_only
        )
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

        ``loss_fn(output, target)`` returns the scalar loss of one micro-batch; ``reduction``
        says how it reduces over samples, so that the gradient left in the parameters is the
        whole mini-batch loss's (``None``: what the loss shows, ``gpipe.losses.declared``:
        an ``nn`` loss's ``reduction``; else ``"mean"``):

        * ``"mean"`` (e.g. ``F.cross_entropy``): micro-batch losses are weighted by their
          share of the samples (uneven micro-batches included) or, with ``count``, of
          ``count(target)`` over the mini-batch. A loss that averages over something else
          than samples (a token mean over a padded batch) needs ``count``; those of
          ``gpipe.losses``, ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` (any
          ``ignore_index``, class weights) count for themselves::

              pipe.step(input_ids, labels, gpipe.losses.causal_lm())  # shifted inside
              pipe.step(x, y, loss_fn, count=lambda y: (y != -100).sum())  # your own mean

          A micro-batch whose count is 0 adds nothing. Targets with labels below 0 (an
          ignore index) and no ``count`` warn (once per Pipe), with the recipe.
        * ``"sum"``: micro-batch losses are added (a sum-reduced loss).

        ``seed`` fixes this step's random numbers (dropout; default: one draw from torch's
        global generator, alike on every rank; ``gpipe.base.rng``). ``trace=True`` records the
        start and end of every action in ``self.last_trace`` (seconds from the step's start;
        multi-process: this rank's, in ``time.perf_counter`` seconds, shared on a machine).

        ``scaler``: a ``torch.amp.GradScaler`` (float16): backward runs from each
        micro-batch's loss times its scale; a step with gradients not finite on any rank is
        left to the scaler, whose ``step(optimizer)`` then skips it on every rank alike
        (``update()`` lowers the scale alike); the loss returned is unscaled::

            loss = pipe.step(x, y, loss_fn, scaler=scaler)
            scaler.unscale_(optimizer); pipe.clip_grad_norm_(1.0)
            scaler.step(optimizer); scaler.update(); optimizer.zero_grad()

        With ``group``, every rank calls ``step``; ``inputs`` matter only where the first
        stage lives and ``targets`` where the last does (elsewhere they may be ``None``).
        With ``data_parallel_group`` this step's gradients are averaged over the replicas.
        A step that fails leaves the gradients as they were before it. Returns the
        mini-batch loss, detached, as a float64 tensor (which holds a float32 or bfloat16
        loss exactly), the same on every rank when multi-process.
        """
        scale = stepping.scale_of(scaler, self.stages[-1].device)
        inputs_mb = stepping.inputs_of(self, inputs)
        losses, ignored = stepping.losses_of(
            self, inputs_mb, targets, loss_fn, reduction=reduction, count=count, scale=scale
        )
        return stepping.run(self, inputs_mb, losses, seed, trace, scale=scale, ignored=ignored).loss

    def forward(self, inputs: Any) -> Any:
        """Outputs joined on the last stage's device. In training mode with autograd on (one
        process), connected to autograd: ``loss(pipe(x)).backward()`` trains
        (``gpipe.pipe.through_output``); else pipelined inference, without gradients.

        Multi-process: every rank calls it; the rank of the last stage gets the output,
        the others ``None``.
        """
        self._follow_model()  # a captured model's mode, and no hook added since capture
        if self.training and torch.is_grad_enabled():
            return through_output.forward(self, inputs)
        inputs_mb = stepping.inputs_of(self, inputs)
        with calls.without_autograd():  # under torch.inference_mode() too
            result = stepping.run(self, inputs_mb, None, None, False)
        if not self._holds(self.num_stages - 1):
            return None
        return microbatch.join([result.outputs[m] for m in range(self.chunks)])

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


def _origin(model: Any, example: Any, weights: Any, init_seed: int, strict: bool, options: dict):
    """``Pipe.from_model``'s model and where its values come from (``origin_of``); with
    ``balance="auto"`` the units are profiled on the example, which needs the values."""
    if options.get("balance") == "auto":
        options.setdefault("sample", example)  # profile the units on the example
    model, origin = origin_of(model, weights, init_seed, strict)
    if origin is not None and options.get("balance") == "auto":
        raise PartitionError(
            "balance='auto' profiles the model, which needs its values, but this one is on "
            "meta (or a function): pass balance=[units per stage], or plan on a smaller "
            "configuration built in one process (gpipe.plan)"
        )
    return model, origin
