"""Small helpers every layer uses: tensors of a nested value (copied, or kept from a layer
that writes its input), device moves, byte sizes, gradients set aside during a step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "MiB",
    "DeviceLike",
    "add_earlier_gradients",
    "copied",
    "Verdict",
    "first_nonfinite",
    "read_verdict",
    "gradient_norms",
    "local_value",
    "norm_part",
    "poison",
    "restore_gradients",
    "run_keeping_input",
    "seconds",
    "set_aside_gradients",
    "storage_key",
    "synchronize",
    "tensors_of",
    "to_device",
]

DeviceLike = torch.device | str | int
MiB = 2**20


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of a nested value (a stage boundary), in a fixed (pytree) order."""
    if isinstance(value, torch.Tensor):  # the common boundary, without pytree's walk
        return [value]
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def copied(value: Any) -> Any:
    """``value`` with every tensor cloned (its own storage)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def run_keeping_input(
    fn: Callable[..., Any], x: Any, *args: Any, writes: bool | None, share: bool = False
) -> tuple[Any, bool]:
    """``fn(x, *args)``, on a copy of ``x`` if ``fn`` writes its input (``ReLU(inplace=True)``:
    a recomputation would see the change; autograd refuses it on a leaf), and whether it does:
    ``writes`` as found before, or None: learned here from the copy's version counters. With
    ``share`` an input found unwritten takes the copy's memory (autograd may have saved it)."""
    if writes is False:
        return fn(x, *args), False
    copy = copied(x)
    versions = [t._version for t in tensors_of(copy)]
    out = fn(copy, *args)
    if writes is None:
        writes = [t._version for t in tensors_of(copy)] != versions
        if not writes and share and torch.is_grad_enabled():
            for original, same in zip(tensors_of(x), tensors_of(copy), strict=True):
                original.data = same.detach()
    return out, writes


def to_device(
    value: Any, device: torch.device, *, as_leaves: bool = False, differentiable: bool = False
) -> Any:
    """Copy every tensor of ``value`` to ``device``.

    With ``as_leaves`` the copies are detached leaves that require grad exactly where the
    originals did, ready to be a stage's inputs. With ``differentiable`` a tensor that
    requires grad keeps its graph (the user's inputs: their gradient flows back to them).
    """
    # A device-to-host copy must finish before the host reads it: only copies onto an
    # accelerator may be asynchronous.
    non_blocking = device.type != "cpu"

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if differentiable and leaf.requires_grad:
            return leaf.to(device, non_blocking=non_blocking)
        if leaf.device == device and not as_leaves:
            return leaf.detach()  # already there: no copy (a step moves every micro-batch)
        moved = leaf.detach().to(device, non_blocking=non_blocking)
        if as_leaves and leaf.requires_grad:
            moved.requires_grad_(True)
        return moved

    if isinstance(value, torch.Tensor):
        return move(value)
    if type(value) is list and all(isinstance(leaf, torch.Tensor) for leaf in value):
        return [move(leaf) for leaf in value]  # a stage's gradients, without pytree's walk
    return tree_map(move, value)


def storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """What identifies the memory behind a tensor: views of one storage share it. The
    storage object, not its address: a sharded parameter's gathered copy keeps its storage
    object while FSDP frees and refills it (``gpipe.parallel.sharded``)."""
    return tensor.device, tensor.untyped_storage()._cdata


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU), e.g. before timing."""
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def set_aside_gradients(params: Iterable[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """Take the gradients the parameters hold (of earlier steps) out of them."""
    earlier = {p: p.grad for p in params if p.grad is not None}
    for p in earlier:
        p.grad = None
    return earlier


def add_earlier_gradients(earlier: dict[torch.Tensor, torch.Tensor]) -> None:
    """Add them back to this step's (out of place: a later failure may still restore)."""
    for p, grad in earlier.items():
        p.grad = grad if p.grad is None else grad + p.grad


def restore_gradients(
    params: Iterable[torch.Tensor], earlier: dict[torch.Tensor, torch.Tensor]
) -> None:
    """Leave the parameters with the earlier gradients only, as before a failed step."""
    for p in params:
        p.grad = earlier.get(p)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: the local shard of a sharded one (a ``DTensor``,
    see ``gpipe.parallel.sharded``), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def norm_part(grads: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """This process's part of the ``p``-norm of ``grads``: the sum of their ``p``-th powers
    (their largest entry for ``inf``), in float64 on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([local_value(g).detach().norm(p).to(device, torch.float64) for g in grads])
    return norms.max() if p == float("inf") else norms.pow(p).sum()


def gradient_norms(grads: list[torch.Tensor], *, precise: bool = True) -> torch.Tensor:
    """Each gradient's 2-norm (of this process's part), in float64 on the first one's
    device; not finite where the gradient holds a NaN or an infinity.

    ``precise=False`` sums in float32 (half gradients) or the gradient's own dtype, an
    order of magnitude faster on the CPU than float64; a norm beyond float32's range then
    reads as infinite too, which :func:`first_nonfinite` tells apart."""
    local = [local_value(g).detach() for g in grads]
    local = [g.coalesce().values() if g.is_sparse else g for g in local]
    device = local[0].device
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(local):
        by_device.setdefault(g.device, []).append(i)
    if len(by_device) == 1:  # one device, the usual case: one fused norm, in order already
        return _norms(local, precise).to(device, torch.float64)
    norms = torch.empty(len(local), dtype=torch.float64, device=device)
    for indices in by_device.values():
        norms[indices] = _norms([local[i] for i in indices], precise).to(device, torch.float64)
    return norms


def _norms(grads: list[torch.Tensor], precise: bool) -> torch.Tensor:
    """The 2-norms of gradients on one device, stacked."""
    dtype = torch.float64 if precise else _at_least_float32(grads[0].dtype)
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=dtype))


def _at_least_float32(dtype: torch.dtype) -> torch.dtype | None:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else None


@dataclass
class Verdict:
    """What the host learns of a step once it ran, in one read (:func:`read_verdict`)."""

    loss: float | None  # this process's part of the loss; None: it holds no last stage
    finite: list[bool] | None  # each gradient norm finite?
    ignored: bool  # integer targets hold the ignore index


def read_verdict(
    loss: torch.Tensor | None, norms: torch.Tensor | None, ignored: torch.Tensor | None
) -> Verdict:
    """The loss, which gradient norms are finite and whether targets hold labels below 0
    (``ignored``'s first flag), read from the device together: on an accelerator each read
    waits for all queued work, so a step reads once (the norms themselves: the host tells
    which are finite, no device operation)."""
    parts = []
    if loss is not None:
        parts.append(loss.detach().reshape(1))
    if norms is not None:
        parts.append(norms)
    if ignored is not None:
        parts.append(ignored[:1])
    device = parts[0].device if parts else None
    parts = [p if p.device == device else p.to(device) for p in parts]
    # One copy to the host: cat promotes to the widest dtype (float64 norms: float64).
    values = torch.cat(parts).tolist() if parts else []
    value = float(values.pop(0)) if loss is not None else None
    finite = [math.isfinite(v) for v in values[: len(norms)]] if norms is not None else None
    return Verdict(value, finite, bool(ignored is not None and values[-1]))


def first_nonfinite(
    names: list[str],
    finite: list[bool] | None,
    grads: list[torch.Tensor],
    norms: torch.Tensor | None = None,
) -> str | None:
    """The first of ``names`` whose gradient is not finite, from ``finite`` (each norm's,
    :func:`read_verdict`). A norm summed in float32 (``gradient_norms(precise=False)``)
    that is not finite is summed again in float64 first, and put into ``norms``: a finite
    gradient whose norm passes float32's range holds no NaN or infinity."""
    if finite is None or all(finite):
        return None
    for i, ok in enumerate(finite):
        if ok:
            continue
        precise = gradient_norms([grads[i]])[0]
        if not torch.isfinite(precise):
            return names[i]
        if norms is not None:
            norms[i] = precise.to(norms.device)
    return None


def poison(grad: torch.Tensor) -> None:
    """Put an infinity into ``grad`` (this process's part), for a GradScaler to find."""
    local = local_value(grad)
    if local.numel():
        local[(0,) * local.dim()] = float("inf")


def seconds(value: object, name: str) -> float:
    """``value`` as a duration in seconds: a finite number > 0 (timedelta holds no inf)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)
