"""Profile each layer of an ``nn.Sequential``: time, parameters and activation memory.

What a partitioner and a planner need to know about layer ``i``, measured on the target
device with one sample micro-batch (each layer runs on the activation the layers before
it produced for that micro-batch):

* ``forward``, ``backward``: median seconds of its forward (with autograd recording) and
  of its whole backward from a random output gradient, over ``repeats`` runs after
  ``warmup`` runs; ``backward_input`` and ``backward_weight``: the two halves of the
  same backward split as zero-bubble schedules run it (``gpipe.engine.split_backward``);
* ``param_bytes``, ``buffer_bytes``: its weights and buffers (running statistics);
* ``input_bytes``, ``output_bytes``: the boundary values it receives and produces;
* ``saved_bytes``: what autograd saves for its backward (saved-tensor hooks through
  :class:`gpipe.engine.memory.ActivationMeter`, one count per storage, parameters excluded),
  and how much of that is its input (``saved_input_bytes``) or its output
  (``saved_output_bytes``) — tensors that neighbouring layers, or the stage's kept
  input, may hold already.

Layers are profiled on a copy of the model on ``device`` (so it must fit there), and the
model itself is left as it was: parameters, gradients, running statistics and random
generators unchanged. Timing runs in rounds over all layers (warm-up rounds, then
``repeats`` timed ones), so a slow spell of a shared machine spreads over every layer::

    prof = gpipe.profile(model, x[:8], "cuda:0")
    print(prof.table())
    prof.layers[3].forward, prof.layers[3].saved_bytes

Given ``target`` and ``loss_fn``, the last layer is profiled together with the loss (its
forward computes the loss, its backward starts from it), as the last stage of a
pipeline runs it; otherwise every backward starts from a random output gradient.

Times are for the micro-batch size of ``sample``; :meth:`Profile.scaled` gives a linear
estimate for another size (activation bytes scale exactly, times roughly: small batches
carry a fixed per-operation overhead that a linear estimate misses — profile at the size
you will run when you can; ``gpipe.plan`` does).
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gpipe.base import microbatch, rng
from gpipe.base._utils import (
    DeviceLike,
    copied,
    run_keeping_input,
    storage_key,
    synchronize,
    tensors_of,
    to_device,
)
from gpipe.engine.memory import ActivationMeter
from gpipe.engine.split_backward import backward_input, backward_weight
from gpipe.engine.stage import detached

__all__ = ["LayerProfile", "Profile", "check_sequential", "profile"]


@dataclass(frozen=True)
class LayerProfile:
    """One layer's measured costs for one micro-batch (seconds and bytes)."""

    name: str  # its key in the Sequential and its type, e.g. "3 (Block)"
    forward: float
    backward: float  # the whole backward: input and weight gradients
    backward_input: float  # B of a split backward (input gradient only)
    backward_weight: float  # W of a split backward (weight gradients)
    param_bytes: int
    buffer_bytes: int
    input_bytes: int
    output_bytes: int
    saved_bytes: int  # saved for backward, all of it
    saved_input_bytes: int = 0  # of which the layer's input
    saved_output_bytes: int = 0  # of which the layer's output
    # Of the saved bytes, what a split backward frees right after B when this layer ends a
    # stage: everything above the layer's weights (e.g. the loss's log-softmax), since W
    # starts at the weights' nodes. All of it for a layer without weights.
    freed_after_input_grad_bytes: int = 0

    @property
    def inner_bytes(self) -> int:
        """Saved bytes that are neither the layer's input nor its output."""
        return self.saved_bytes - self.saved_input_bytes - self.saved_output_bytes


@dataclass(frozen=True)
class Profile:
    """Per-layer costs of a model for one micro-batch of ``batch_size`` samples."""

    layers: tuple[LayerProfile, ...]
    batch_size: int | None = None  # samples in the profiled micro-batch (None: unknown)
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))

    def __len__(self) -> int:
        return len(self.layers)

    def scaled(self, factor: float) -> Profile:
        """Times and activation bytes times ``factor`` (a linear guess for another batch).

        Parameters and buffers do not scale. ``profile.scaled(2)`` estimates a micro-batch
        twice as large.
        """
        if not factor > 0:
            raise ValueError(f"factor must be positive, got {factor!r}")

        def scale(layer: LayerProfile) -> LayerProfile:
            return replace(
                layer,
                forward=layer.forward * factor,
                backward=layer.backward * factor,
                backward_input=layer.backward_input * factor,
                backward_weight=layer.backward_weight * factor,
                input_bytes=round(layer.input_bytes * factor),
                output_bytes=round(layer.output_bytes * factor),
                saved_bytes=round(layer.saved_bytes * factor),
                saved_input_bytes=round(layer.saved_input_bytes * factor),
                saved_output_bytes=round(layer.saved_output_bytes * factor),
            )

        size = None if self.batch_size is None else self.batch_size * factor
        if size is not None and float(size).is_integer():
            size = int(size)
        return Profile(tuple(scale(layer) for layer in self.layers), size, self.device)  # type: ignore[arg-type]

    @classmethod
    def from_costs(
        cls,
        forward: Sequence[float],
        backward: Sequence[float] | None = None,
        *,
        weight_fraction: float = 0.5,
        param_bytes: Sequence[int] | int = 0,
        activation_bytes: Sequence[int] | int = 0,
        saved_bytes: Sequence[int] | int = 0,
        batch_size: int | None = None,
    ) -> Profile:
        """A synthetic profile from given numbers (tests, what-if planning).

        ``backward`` defaults to twice ``forward``; a split backward gives
        ``weight_fraction`` of it to W. ``activation_bytes`` is each layer's output (and
        the next layer's input); ``saved_bytes`` what each layer saves beyond its input
        and output.
        """
        n = len(forward)
        backward = [2 * f for f in forward] if backward is None else list(backward)

        def per_layer(value: Sequence[int] | int, label: str) -> list[int]:
            values = [value] * n if isinstance(value, int) else list(value)
            if len(values) != n:
                raise ValueError(f"{label} has {len(values)} values for {n} layers")
            return values

        if len(backward) != n:
            raise ValueError(f"backward has {len(backward)} values for {n} layers")
        params = per_layer(param_bytes, "param_bytes")
        outputs = per_layer(activation_bytes, "activation_bytes")
        saved = per_layer(saved_bytes, "saved_bytes")
        layers = []
        for i in range(n):
            layers.append(
                LayerProfile(
                    name=str(i),
                    forward=float(forward[i]),
                    backward=float(backward[i]),
                    backward_input=float(backward[i]) * (1 - weight_fraction),
                    backward_weight=float(backward[i]) * weight_fraction,
                    param_bytes=params[i],
                    buffer_bytes=0,
                    input_bytes=outputs[i - 1] if i > 0 else outputs[0],
                    output_bytes=outputs[i],
                    saved_bytes=saved[i],
                )
            )
        return cls(tuple(layers), batch_size, "synthetic")

    @classmethod
    def sizes_of(cls, model: nn.Sequential) -> Profile:
        """Each layer's parameter and buffer bytes, nothing run (times and activations 0):
        :func:`~gpipe.estimate.balance.balance_by_size` without a sample."""
        unrun = dict.fromkeys(["forward", "backward", "backward_input", "backward_weight"], 0.0)
        unrun |= dict.fromkeys(["input_bytes", "output_bytes", "saved_bytes"], 0)
        layers = [LayerProfile(**_sizes(*named), **unrun) for named in model._modules.items()]
        return cls(tuple(layers), None, "none")

    def table(self) -> str:
        """A text table, one row per layer (ms and MiB)."""
        mib = 2**20
        rows = [
            f"{'layer':<22} {'fwd ms':>8} {'bwd ms':>8} {'B ms':>7} {'W ms':>7} "
            f"{'param MiB':>9} {'out MiB':>8} {'saved MiB':>9}"
        ]
        for layer in self.layers:
            rows.append(
                f"{layer.name[:22]:<22} {layer.forward * 1e3:8.3f} {layer.backward * 1e3:8.3f} "
                f"{layer.backward_input * 1e3:7.3f} {layer.backward_weight * 1e3:7.3f} "
                f"{layer.param_bytes / mib:9.3f} {layer.output_bytes / mib:8.3f} "
                f"{layer.saved_bytes / mib:9.3f}"
            )
        return "\n".join(rows)


def profile(
    model: nn.Sequential,
    sample: Any,
    device: DeviceLike | None = None,
    *,
    target: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    repeats: int = 5,
    warmup: int = 2,
) -> Profile:
    """Measure every layer of ``model`` on ``sample`` (one micro-batch of inputs).

    Args:
        model: the ``nn.Sequential`` to profile; it is not modified.
        sample: one micro-batch of inputs (a tensor or nested tuple/list/dict of tensors).
        device: where to measure (default: where the model's parameters are, else CPU).
        target, loss_fn: profile the last layer together with ``loss_fn(output, target)``.
        repeats: timed runs per layer; the median is kept.
        warmup: untimed runs before them.

    Example::

        prof = gpipe.profile(model, torch.randint(0, 256, (8, 64)))
        print(prof.table())
    """
    _check_arguments(model, target, loss_fn, repeats=repeats, warmup=warmup)
    device = _resolve_device(model, device)
    try:
        batch = microbatch.batch_size(sample, name="sample")
    except ValueError:
        batch = None
    sync = functools.partial(synchronize, device)
    # Own storages: a sample sliced from a larger batch would otherwise count as all of it.
    x = copied(to_device(sample, device))
    if target is not None:
        target = to_device(target, device)
    names = list(model._modules)
    with rng.preserved(device) as generator:
        generator.manual_seed(0)
        # One forward through the model to get each layer's input and its memory ...
        runs = []
        for i, (name, layer) in enumerate(zip(names, model, strict=True)):
            loss = (target, loss_fn) if i == len(model) - 1 and loss_fn is not None else None
            run = _LayerRun(name, layer, x, device, loss, sync)
            x = run.measure_memory()
            runs.append(run)
        # ... then timing in rounds over all layers, so that a slow spell of a shared
        # machine spreads over every layer instead of falling on one.
        for round_ in range(warmup + repeats):
            for run in runs:
                run.time_once(keep=round_ >= warmup)
    return Profile(tuple(run.result() for run in runs), batch, str(device))


def check_sequential(model: Any, caller: str) -> None:
    """What profiling and balancing take: a non-empty ``nn.Sequential`` (``caller`` names
    the function in the error)."""
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise TypeError(
            f"{caller} takes a non-empty nn.Sequential, got {type(model).__name__}"
            + (" of length 0" if isinstance(model, nn.Sequential) else "")
        )


def _check_arguments(model: Any, target: Any, loss_fn: Any, **counts: int) -> None:
    check_sequential(model, "profile")
    for label, low in (("repeats", 1), ("warmup", 0)):
        value = counts[label]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{label} must be an int >= {low}, got {value!r}")
    if (target is None) != (loss_fn is None):
        raise ValueError("give both target and loss_fn (the last layer's loss), or neither")


def _resolve_device(model: nn.Module, device: DeviceLike | None) -> torch.device:
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(
            "cannot profile on the meta device: build the model (or pass device='cuda:0')"
        )
    return device


def _bytes_of(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    unique = {storage_key(t): t.untyped_storage().nbytes() for t in tensors}
    return sum(unique.values())


def _saved_part(meter: ActivationMeter, tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` that ``meter`` counts already.

    Holding a storage the meter counts adds no bytes; the token is dropped at once.
    """
    total = 0
    for t in {storage_key(t): t for t in tensors}.values():
        before = meter.live_bytes[0]
        token = meter.hold(0, [t])
        if meter.live_bytes[0] == before:
            total += t.untyped_storage().nbytes()
        del token
    return total


def _sizes(name: str, layer: nn.Module) -> dict[str, Any]:
    """A layer's name in a profile (``3 (Block)``) and its parameters' and buffers' bytes (a
    tensor it holds twice counted once)."""
    params, buffers = (
        sum({id(t): t.numel() * t.element_size() for t in tensors}.values())
        for tensors in (layer.parameters(), layer.buffers())
    )
    return {
        "name": f"{name} ({type(layer).__name__})",
        "param_bytes": params,
        "buffer_bytes": buffers,
    }


class _LayerRun:
    """One layer's copy on the device, its input, and what has been measured of it."""

    def __init__(
        self,
        name: str,
        original: nn.Module,
        x: Any,
        device: torch.device,
        loss: tuple[Any, Callable] | None,
        sync: Callable[[], None],
    ) -> None:
        self.name, self.original, self.x, self.loss, self.sync = name, original, x, loss, sync
        self.layer = copy.deepcopy(original).to(device).train()
        for p in self.layer.parameters():
            p.grad = None
        self.params = [p for p in self.layer.parameters() if p.requires_grad]
        self.inputs = [t for t in tensors_of(x) if t.requires_grad]
        self.times: list[tuple[float, float, float, float]] = []
        self.memory: dict[str, int] = {}
        self.writes: bool | None = None  # does the layer write its input (not known yet)

    def run(self) -> tuple[Any, list[torch.Tensor], list[torch.Tensor | None]]:
        """Forward with autograd; the tensors backward starts from, and their gradients.
        A layer that writes its input runs on a copy, as a stage runs it."""
        out, self.writes = run_keeping_input(self.layer, self.x, writes=self.writes, share=True)
        if self.loss is not None:
            value = self.loss[1](out, self.loss[0])
            return out, ([value] if value.requires_grad else []), [None]
        roots = [t for t in tensors_of(out) if t.requires_grad]
        return out, roots, [_random_like(t) for t in roots]

    def measure_memory(self) -> Any:
        """What autograd saves (the loss's too), and how much of it is the input or the
        output, which the stage's kept input or a neighbouring layer may hold already.
        Returns the next layer's input."""
        meter = ActivationMeter(1, self.layer.parameters())
        with torch.enable_grad(), meter.saved_tensors(0):
            out, roots, _ = self.run()  # roots keep the loss's graph, if any, alive
        in_tensors, out_tensors = tensors_of(self.x), tensors_of(out)
        in_keys = {storage_key(t) for t in in_tensors}
        self.memory = {
            "saved_bytes": meter.live_bytes[0],
            "saved_input_bytes": _saved_part(meter, in_tensors),
            # an output sharing the input's storage (identity, view) is counted as input
            "saved_output_bytes": _saved_part(
                meter, [t for t in out_tensors if storage_key(t) not in in_keys]
            ),
            "input_bytes": _bytes_of(in_tensors),
            "output_bytes": _bytes_of(out_tensors),
        }
        del roots
        if self.inputs:  # without an input gradient B does nothing and frees nothing
            self.memory["freed_after_input_grad_bytes"] = self._freed_by_split_input_grad()
        return detached(out, lambda t: t.is_floating_point())

    def _freed_by_split_input_grad(self) -> int:
        """Saved bytes a split B frees: what W does not need goes once the roots go."""
        meter = ActivationMeter(1, self.layer.parameters())
        with torch.enable_grad(), meter.saved_tensors(0):
            out, roots, grads = self.run()
        if not roots:
            return 0
        saved = meter.live_bytes[0]
        _, work = backward_input(roots, grads, self.inputs, self.params)
        del out, roots, grads
        freed = saved - meter.live_bytes[0]
        del work
        return freed

    def time_once(self, *, keep: bool) -> None:
        """Time forward, whole backward, and the split backward (B, then W) once."""

        def now() -> float:
            self.sync()
            return time.perf_counter()

        start = now()
        with torch.enable_grad():
            out, roots, grads = self.run()
        middle = now()
        if roots:
            torch.autograd.backward(roots, grads)
        end = now()
        with torch.enable_grad():
            out, roots, grads = self.run()
        split_start = now()
        _, work = backward_input(roots, grads, self.inputs, self.params)
        split_middle = now()
        backward_weight(work)
        split_end = now()
        del out, roots, grads, work
        for t in [*self.inputs, *self.params]:
            t.grad = None
        if keep:
            self.times.append(
                (middle - start, end - middle, split_middle - split_start, split_end - split_middle)
            )

    def result(self) -> LayerProfile:
        forward, backward, b_input, b_weight = (
            statistics.median(t) for t in zip(*self.times, strict=True)
        )
        return LayerProfile(
            **_sizes(self.name, self.original),
            forward=forward,
            backward=backward,
            backward_input=b_input,
            backward_weight=b_weight,
            **self.memory,
        )


def _random_like(t: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(t) if t.is_floating_point() else torch.zeros_like(t)
