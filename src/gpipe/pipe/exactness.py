"""``gpipe.check``: is a pipelined step of *your* model the plain model's step?

It trains two float64 copies of the model (the same initial weights) a few steps on the same
batches with the same optimizer: one through a ``Pipe`` in this process, one plain. The plain
step runs each micro-batch's forward as gpipe does (the same dropout seeds per layer, batch
norm over the micro-batch) and then the loss *once*, on the whole mini-batch's outputs, as
the script would without gpipe: so a loss that does not average over samples (a sum, class
weights, ``ignore_index``, a token mean) shows, as do hooks, a private generator, buffers
written in forward, parameters of the loss. Every parameter's gradient (the loss's included),
every buffer and the final weights are compared::

    report = gpipe.check(model, F.cross_entropy, lambda ps: torch.optim.AdamW(ps), (x, y),
                         chunks=4, schedule="zb-h1")
    print(report)   # exact (worst |Δ| = 1.1e-16 over 12 parameters, K=2, M=4, schedule zb-h1)

When it is not, the report names the worst parameters and the likely causes, found by
inspecting the model and the loss. ``gpipe check`` is the same from the command line.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from gpipe.base import microbatch, rng
from gpipe.frontend import split_points
from gpipe.pipe.pipe import Pipe
from gpipe.schedule.registry import schedule_spec

__all__ = ["CheckReport", "Difference", "check"]

Batch = tuple[Any, Any]


@dataclass(frozen=True)
class Difference:
    name: str  # a parameter's (``loss.`` for the loss's own), buffer's name
    relative: float  # |Δ| / |plain| over the tensor (inf: a gradient only one side has)
    largest: float  # the largest |Δ| of one element
    step: int  # the first step it appeared (-1: the final values)


@dataclass
class CheckReport:
    """What :func:`check` found: ``exact``, the worst differences, the likely causes."""

    exact: bool
    worst: float  # the largest |Δ| of any element compared
    relative: float  # the largest relative error of any tensor
    parameters: int
    settings: str
    differences: list[Difference] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        over = f"over {self.parameters} parameters, {self.settings}"
        if self.exact:
            return f"exact (worst |Δ| = {self.worst:.1e} {over})"
        lines = [f"NOT exact: worst relative error {self.relative:.2e} (|Δ| = {self.worst:.2e}) "
                 f"{over}"]  # fmt: skip
        for d in self.differences[:8]:
            when = "final value" if d.step < 0 else f"step {d.step}"
            lines.append(f"  {d.name:<40} relative {d.relative:.2e}  |Δ| {d.largest:.2e}  ({when})")
        lines.append("likely causes:" if self.causes else "no known cause found: please report it")
        lines += [f"  - {cause}" for cause in self.causes]
        return "\n".join(lines)


def check(
    model: nn.Module | Callable[[], nn.Module],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
    batch: Batch | Sequence[Batch],
    *,
    steps: int = 3,
    stages: int = 2,
    split: str | Sequence[str] | None = None,
    reduction: str = "mean",
    count: Callable[[Any], Any] | None = None,
    tolerance: float = 1e-10,
    seed: int = 0,
    **pipe_settings: Any,
) -> CheckReport:
    """Train ``model`` (or ``model()``, seeded by ``seed``) ``steps`` steps plain and as a
    ``Pipe`` of ``stages`` ranks in this process, float64, and compare (see the module doc).

    ``optimizer``: builds the optimizer from parameters (default SGD, lr 0.1); ``batch``:
    ``(inputs, targets)``, or one per step; ``reduction``, ``count``: as ``Pipe.step``'s;
    ``pipe_settings``: ``Pipe``'s (``balance``, ``chunks``, ``checkpoint``, ``schedule``,
    ``virtual_stages``, ``tied``, ...); a model that is not an ``nn.Sequential`` is built
    with ``Pipe.from_model`` (cut at ``split``). Exact: every relative error <= ``tolerance``.
    """
    batches = [batch] if isinstance(batch, tuple) else list(batch)
    batches = [(_float64(x), _float64(y)) for x, y in batches]
    plain, twin = _twins(model, seed)
    settings = _settings(stages, pipe_settings)
    if isinstance(twin, nn.Sequential):
        pipe, units = Pipe(twin, **settings), None
    else:
        pipe = Pipe.from_model(twin, batches[0][0], split=split, **settings)
        units = _units(plain, split)
    plain_loss, pipe_loss = _twin_loss(loss_fn), _twin_loss(loss_fn)
    chunks = pipe.chunks
    make = optimizer or (lambda params: torch.optim.SGD(params, lr=0.1))
    plain_opt = make([*plain.parameters(), *_parameters(plain_loss)])
    pipe_opt = make([*pipe.parameters(), *_parameters(pipe_loss)])
    differences: dict[str, Difference] = {}
    for step in range(steps):
        x, y = batches[step % len(batches)]
        step_seed = seed * 1000 + step
        _plain_step(plain, x, y, plain_loss, chunks, step_seed, units)
        pipe.step(x, y, pipe_loss, seed=step_seed, reduction=reduction, count=count)
        ours = _gradients(pipe, pipe_loss)
        for name, grad in _gradients(plain, plain_loss).items():
            _note(differences, name, ours.get(name), grad, step)
        for opt in (plain_opt, pipe_opt):
            opt.step()
            opt.zero_grad(set_to_none=True)
    final = {**dict(pipe.named_parameters()), **dict(pipe.named_buffers())}
    for name, value in [*plain.named_parameters(), *plain.named_buffers()]:
        _note(differences, name, final.get(name), value, -1)
    return _report(differences, tolerance, plain, plain_loss, loss_fn, model, batches[0],
                   chunks=chunks, reduction=reduction, count=count, pipe=pipe)  # fmt: skip


def _float64(value: Any) -> Any:
    def widen(leaf: Any) -> Any:
        floating = isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
        return leaf.double() if floating else leaf

    return tree_map(widen, value)


def _twins(model, seed: int) -> tuple[nn.Module, nn.Module]:
    """Two float64 copies with the same weights (and the original's tensor hooks)."""
    if isinstance(model, nn.Module):
        made = [copy.deepcopy(model).double() for _ in range(2)]
        for twin in made:  # deepcopy leaves a parameter's own hooks behind
            _copy_tensor_hooks(model, twin)
        return made[0], made[1]
    made = []
    with rng.preserved(torch.device("cpu")):  # the caller's generator as it was
        for _ in range(2):
            torch.manual_seed(seed)
            made.append(model().double())
    return made[0], made[1]


def _copy_tensor_hooks(source: nn.Module, twin: nn.Module) -> None:
    twins = dict(twin.named_parameters(remove_duplicate=False))
    for name, param in source.named_parameters(remove_duplicate=False):
        for hook in (param._backward_hooks or {}).values():
            twins[name].register_hook(hook)


def _settings(stages: int, settings: dict[str, Any]) -> dict[str, Any]:
    settings = dict(settings)
    if "devices" not in settings and "group" not in settings:
        balance = settings.get("balance")
        if isinstance(balance, Sequence):
            spec = schedule_spec(settings.get("schedule", "gpipe"))
            v = settings.get("virtual_stages") or spec.default_virtual_stages
            stages = max(len(balance) // v, 1)
        settings["devices"] = ["cpu"] * stages
    return settings


def _twin_loss(loss_fn):
    """A copy of a loss with parameters of its own (each side trains its own); else itself."""
    return copy.deepcopy(loss_fn).double() if _parameters(loss_fn) else loss_fn


def _parameters(loss_fn) -> list[nn.Parameter]:
    return list(loss_fn.parameters()) if isinstance(loss_fn, nn.Module) else []


def _units(model: nn.Module, split) -> dict[int, nn.Module]:
    """The modules where each unit of ``Pipe.from_model`` begins (unit 0: the model)."""
    modules = dict(model.named_modules())
    return {0: model, **{i + 1: modules[p] for i, p in enumerate(split_points(model, split))}}


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def _plain_step(model, inputs, targets, loss_fn, chunks: int, seed: int, units) -> None:
    """Each micro-batch's forward seeded as gpipe seeds it, then the loss of the whole batch."""
    microbatches = microbatch.split(inputs, chunks, name="inputs")
    outputs = [_seeded(model, x_m, seed, m, units) for m, x_m in enumerate(microbatches)]
    loss_fn(microbatch.join(outputs), targets).backward()


def _seeded(model: nn.Module, x_m: Any, seed: int, m: int, units) -> Any:
    if units is None:  # an nn.Sequential: each layer seeded by its index (gpipe.base.rng)
        for i, layer in enumerate(model):
            with rng.seeded(rng.layer_seed(seed, i, m), "cpu"):
                x_m = layer(x_m)
        return x_m
    generator = rng.device_generator(torch.device("cpu"))

    def seed_unit(index):
        return lambda *_: generator.manual_seed(rng.layer_seed(seed, index, m)) and None

    hooks = [u.register_forward_pre_hook(seed_unit(i), prepend=True) for i, u in units.items()]
    try:
        with rng.preserved(torch.device("cpu")):
            return _call(model, x_m)
    finally:
        for hook in hooks:
            hook.remove()


def _gradients(module: nn.Module, loss_fn) -> dict[str, torch.Tensor | None]:
    grads = {n: p.grad for n, p in module.named_parameters()}
    if isinstance(loss_fn, nn.Module):
        grads.update({f"loss.{n}": p.grad for n, p in loss_fn.named_parameters()})
    return grads


def _note(found: dict[str, Difference], name: str, ours, plain, step: int) -> None:
    if ours is None or plain is None:
        if (ours is None) != (plain is None) and bool((ours if plain is None else plain).abs()
                                                      .max() > 0):  # fmt: skip
            found.setdefault(name, Difference(name, float("inf"), float("inf"), step))
        return
    ours, plain = ours.detach().double().cpu(), plain.detach().double().cpu()
    diff = (ours - plain).abs()
    largest = diff.max().item() if diff.numel() else 0.0
    scale = plain.norm().item()
    relative = diff.norm().item() / scale if scale > 0 else diff.norm().item()
    earlier = found.get(name)
    if earlier is None or relative > earlier.relative:
        first = step if earlier is None or earlier.step < 0 else earlier.step
        found[name] = Difference(name, relative, largest, first if step >= 0 else step)


def _report(differences, tolerance, plain, plain_loss, loss_fn, model, batch, *, chunks,
            reduction, count, pipe) -> CheckReport:  # fmt: skip
    ordered = sorted(differences.values(), key=lambda d: -d.relative)
    relative = ordered[0].relative if ordered else 0.0
    worst = max((d.largest for d in ordered), default=0.0)
    reads = _loss_reads_model(loss_fn, model, plain, batch)
    exact = relative <= tolerance and not reads
    causes = [] if exact else reads + _likely_causes(
        model, plain, loss_fn, batch, chunks=chunks, reduction=reduction, count=count
    )  # fmt: skip
    k = pipe.num_stages // pipe.virtual_stages
    settings = f"K={k}, M={chunks}, schedule {pipe.schedule.name}, checkpoint {pipe.checkpoint}"
    parameters = sum(1 for _ in plain.named_parameters()) + len(_parameters(plain_loss))
    return CheckReport(exact, worst, relative, parameters, settings,
                       [d for d in ordered if d.relative > tolerance], causes)  # fmt: skip


# -- likely causes, from the model and the loss ------------------------------------------------


def _likely_causes(model, plain, loss_fn, batch, *, chunks, reduction, count) -> list[str]:
    original = model if isinstance(model, nn.Module) else plain
    return [
        *_hooks(original),
        *_reduction(plain, loss_fn, batch, chunks, reduction, count),
        *_loss_parameters(loss_fn),
        *_randomness(plain),
        *_written_buffers(plain, batch[0]),
    ]


def _hooks(model: nn.Module) -> list[str]:
    found = []
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    for name, module in model.named_modules():
        held = [k.strip("_").replace("_", " ")[:-1] for k in kinds if getattr(module, k, None)]
        if held:
            found.append(f"{', '.join(held)} on {name or 'the model'}")
    for name, param in model.named_parameters():
        if param._backward_hooks:
            found.append(f"a tensor hook on {name}")
    if not found:
        return []
    return [f"hooks on the model ({'; '.join(found)}): a hook the Pipe does not run alike (a "
            "backward hook in a split backward, a hook on a captured model) changes the step; "
            "move what it does into the forward or the loss"]  # fmt: skip


def _reduction(plain, loss_fn, batch, chunks, reduction, count) -> list[str]:
    """The whole batch's loss against the micro-batch losses weighed as gpipe weighs them."""
    inputs, targets = batch
    with torch.no_grad(), rng.preserved(torch.device("cpu")):
        torch.manual_seed(0)
        was = plain.training
        plain.eval()  # no dropout: the outputs are the same however they are split
        out = _call(plain, inputs)
        plain.train(was)
        whole = float(loss_fn(out, targets))
        outs = microbatch.split(out, chunks, name="outputs")
        ys = microbatch.split(targets, chunks, name="targets")
        if reduction == "sum":
            weights = [1.0] * chunks
        elif count is not None:
            counts = [float(count(y)) for y in ys]
            weights = [c / sum(counts) for c in counts]
        else:
            sizes = [microbatch.batch_size(y) for y in ys]
            weights = [n / sum(sizes) for n in sizes]
        parts = sum(w * float(loss_fn(o, y)) for w, o, y in zip(weights, outs, ys, strict=True))
    if abs(parts - whole) <= 1e-9 * max(abs(whole), 1.0):
        return []
    hints = _loss_hints(loss_fn)
    declared = f"reduction={reduction!r}" + (", count=" if count is not None else "")
    return [f"the loss of the whole batch ({whole:.6g}) is not its micro-batch losses weighed "
            f"as declared ({declared}: {parts:.6g}){hints}: declare step(..., reduction='sum') "
            "for a sum, or count= for a mean over something else than samples (class weights, "
            "ignore_index, tokens), or use gpipe.losses"]  # fmt: skip


def _loss_hints(loss_fn) -> str:
    hints = []
    if getattr(loss_fn, "reduction", None) == "sum":
        hints.append("it has reduction='sum'")
    if getattr(loss_fn, "weight", None) is not None:
        hints.append("it weighs classes")
    ignore = getattr(loss_fn, "ignore_index", -100)
    if ignore != -100:
        hints.append(f"it ignores label {ignore}")
    return f" ({'; '.join(hints)})" if hints else ""


def _loss_parameters(loss_fn) -> list[str]:
    if not isinstance(loss_fn, nn.Module):
        return []
    names = [n for n, _ in loss_fn.named_parameters()]
    if not names:
        return []
    return [
        f"the loss has parameters of its own ({', '.join(names)}): they are trained on the "
        "last stage, which a split backward (zb-h1, zb-v, dualpipe-v, zb-auto) may miss"
    ]


def _randomness(model: nn.Module) -> list[str]:
    """Private generators (dropout and the global generator are seeded alike on both sides)."""
    found = []
    for name, module in model.named_modules():
        generators = [k for k, v in vars(module).items() if isinstance(v, torch.Generator)]
        if generators:
            found.append(f"{name or 'the model'} draws from its own torch.Generator "
                         f"({', '.join(generators)}): a recomputation (checkpoint='always' or "
                         "'except_last') draws again; draw from the global generator, which "
                         "gpipe seeds per layer, or use checkpoint='never'")  # fmt: skip
    return found


def _written_buffers(model: nn.Module, inputs: Any) -> list[str]:
    before = {n: b.clone() for n, b in model.named_buffers()}
    if not before:
        return []
    probe = copy.deepcopy(model)
    with torch.no_grad(), rng.preserved(torch.device("cpu")):
        _call(probe, inputs)
    written = [n for n, b in probe.named_buffers() if not torch.equal(b, before[n])]
    if not written:
        return []
    return [
        f"buffers written in forward ({', '.join(written[:4])}): batch norm over micro-"
        "batches updates running statistics M times (deferred_batch_norm=True: once)"
    ]


def _loss_reads_model(loss_fn, model, plain, batch) -> list[str]:
    """A loss that reads the model's own parameters (a regularizer over the model)."""
    original = model if isinstance(model, nn.Module) else None
    if original is None or not callable(loss_fn):
        return []
    with torch.no_grad():
        out = _call(plain, batch[0])
    params = [p for p in original.parameters() if p.requires_grad]
    try:
        loss = loss_fn(out.detach() if isinstance(out, torch.Tensor) else out, batch[1])
        grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else []
    except (RuntimeError, TypeError):
        return []
    names = {id(p): n for n, p in original.named_parameters()}
    read = [names[id(p)] for p, g in zip(params, grads, strict=False) if g is not None]
    if not read:
        return []
    return [
        f"the loss reads the model's own parameters ({', '.join(read[:4])}): a check on "
        "copies cannot follow it, and a Pipe applies it on the last stage (across "
        "processes to a copy); compute the term in the model's forward instead"
    ]
