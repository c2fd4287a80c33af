"""Non-pipelined references: the plain model trained the ordinary way, comparisons, and
brute force over the cuts of a model."""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from gpipe.base import rng
from gpipe.layout import even_balance  # noqa: F401 - re-exported for the tests


def reference_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn,
    *,
    chunks: int,
    seed: int,
    reduction: str = "mean",
    units: dict[int, nn.Module] | None = None,
) -> torch.Tensor:
    """One plain step by gradient accumulation over the same micro-batches.

    Each layer is seeded as documented in ``gpipe.base.rng``, so dropout masks match; the
    gradient of the mini-batch loss is accumulated into ``.grad`` as nanoGPT does.
    ``units``: for a model that is not an ``nn.Sequential`` (``Pipe.from_model``), the
    modules that begin each unit, by unit index: the generator is seeded as each starts.
    """
    total = torch.zeros((), dtype=torch.float64)
    xs, ys = torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)
    for m, (x_m, y_m) in enumerate(zip(xs, ys, strict=True)):
        h = _seeded_forward(model, x_m, seed, m, units)
        weight = len(x_m) / len(x) if reduction == "mean" else 1.0
        loss = loss_fn(h, y_m) * weight
        loss.backward()
        total += loss.detach().double()
    return total


def _seeded_forward(model, x_m, seed: int, m: int, units) -> torch.Tensor:
    if units is None:
        h = x_m
        for i, layer in enumerate(model):
            with rng.seeded(rng.layer_seed(seed, i, m), x_m.device):
                h = layer(h)
        return h
    generator = rng.device_generator(x_m.device)

    def seed_unit(index):
        return lambda *_: generator.manual_seed(rng.layer_seed(seed, index, m)) and None

    handles = [u.register_forward_pre_hook(seed_unit(i), prepend=True) for i, u in units.items()]
    try:
        with rng.preserved(x_m.device):
            return model(x_m)
    finally:
        for handle in handles:
            handle.remove()


def full_batch_step(model: nn.Module, x, y, loss_fn) -> torch.Tensor:
    """One plain step on the whole mini-batch at once."""
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().norm().item()
    diff = (actual.double() - expected.double()).norm().item()
    return diff / scale if scale > 0 else diff


def worst_gradient_error(pipe: nn.Module, reference: nn.Module) -> tuple[float, str]:
    """Largest relative error over each parameter's gradient (name of the worst one)."""
    ours = dict(pipe.named_parameters())
    worst, worst_name = 0.0, ""
    for name, param in reference.named_parameters():
        if param.grad is None:
            assert ours[name].grad is None or ours[name].grad.abs().max() == 0, name
            continue
        assert ours[name].grad is not None, f"{name} has no gradient in the pipe"
        error = relative_error(ours[name].grad.cpu(), param.grad.cpu())
        if error > worst:
            worst, worst_name = error, name
    assert set(ours) == {n for n, _ in reference.named_parameters()}
    return worst, worst_name


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def running_stats_of_unsplit_batch(model: nn.Sequential, x: torch.Tensor, chunks: int) -> dict:
    """Running statistics each BatchNorm would have after one step on the whole batch.

    Micro-batches are normalized by their own statistics, so what a later BatchNorm sees
    depends on the split: record each BatchNorm's inputs over the micro-batches, then
    update a plain copy of it once from all of them, as the un-split model would.
    """
    model = copy.deepcopy(model).train()
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            initial = copy.deepcopy(module)

            def record(mod, args, name=name):
                seen.setdefault(name, []).append(args[0].detach())

            handles.append(module.register_forward_pre_hook(record))
            seen[name + "/initial"] = [initial]  # type: ignore[list-item]
    with torch.no_grad():
        for x_m in torch.tensor_split(x, chunks):
            model(x_m)
    expected = {}
    for name in [n for n in seen if not n.endswith("/initial")]:
        bn = seen[name + "/initial"][0]
        with torch.no_grad():
            bn(torch.cat(seen[name]))
        for key, value in bn.state_dict().items():
            expected[f"{name}.{key}"] = value
    for handle in handles:
        handle.remove()
    return expected


def assert_step_matches(pipe, reference, x, y, loss_fn, *, chunks: int, seed: int) -> None:
    """One ``pipe.step`` against :func:`reference_step`: the loss and every parameter's
    gradient within 1e-10 (float64)."""
    loss = pipe.step(x, y, loss_fn, seed=seed)
    expected = reference_step(reference, x, y, loss_fn, chunks=chunks, seed=seed)
    assert relative_error(loss, expected) <= 1e-10
    worst, where = worst_gradient_error(pipe, reference)
    assert worst <= 1e-10, f"worst gradient error {worst:.3g} at {where}"


# -- brute force over the cuts of a model, for the balancers' tests ---------------------------


def compositions(n: int, k: int):
    """Every balance of n layers into k non-empty stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [b - a for a, b in itertools.pairwise(bounds)]


def stage_sums(values, balance):
    out, start = [], 0
    for size in balance:
        out.append(sum(values[start : start + size]))
        start += size
    return out
