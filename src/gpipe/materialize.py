"""Build one stage of a model without building the whole model.

In the multi-process engine every rank holds one stage, and the whole model may not fit in one
process. :func:`build` therefore constructs the whole ``nn.Sequential`` on the ``meta`` device
(shapes only, no memory), then allocates and initializes only the local layers; the others stay on
``meta``, so the returned Sequential keeps every index and name and a stage's parameters keep
their whole-model names (``"7.qkv.weight"``).

Why not just ``torch.manual_seed(s); factory()``: eager construction draws every layer's weights
from one stream in order, so layer 7's weights depend on the sizes of layers 0-6 and on having
built them. Here each layer ``i`` is initialized from its own generator seed,
``gpipe.rng.layer_seed(seed, i, INIT)``, by calling the ``reset_parameters()`` of its modules. The
result is the same for any cut: layer 7 of a 4-stage build equals layer 7 of
:func:`build_full` (the one-process reference) bit for bit, given the same seed, device type and
dtype. Equality across device types is *not* promised: CPU and CUDA generators draw different
numbers, and the layers are initialized on the target device so that no host memory is needed.

Example (rank ``r`` of ``K`` holds layers ``cuts[r]:cuts[r + 1]``)::

    model = build(lambda: gpt(GPTConfig(n_layers=48)), seed=0,
                  layers=range(cuts[r], cuts[r + 1]), device=f"cuda:{local_rank}")
    stage = model[cuts[r]:cuts[r + 1]]      # the other layers are on meta

What ``reset_parameters()`` must do. Within a layer, modules are reset children first, parents
last, as eager construction would run their ``__init__`` code (so a block whose own
``reset_parameters`` re-initializes its projections wins over the projections' defaults).
``torch.nn`` modules that only have a private ``_reset_parameters`` (``MultiheadAttention``,
``Transformer``) are reset with it. Before resetting, every floating-point parameter and buffer is
filled with NaN and every other buffer with zeros; a floating tensor still all-NaN afterwards, or
an integer/bool buffer that no reset wrote, was not initialized (e.g. a parameter made in
``__init__`` by ``torch.ones``, a mask computed in ``__init__``) and :func:`build` raises a
``ValueError`` naming each. Weights tied between layers stay tied within the local slice; a tie
that crosses the cut is rejected (the two stages would hold independent copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gpipe.rng import layer_seed, preserved

__all__ = ["build", "build_full", "materialized_bytes"]

# The "micro-batch" of initialization: no real micro-batch has it, so initial weights are
# never correlated with the dropout masks of a step whose seed equals the build seed.
INIT = -1

_REMEDY = (
    "give that module a reset_parameters() that initializes it, "
    "or build the model without meta (one process)"
)


def build(
    factory: Callable[[], nn.Sequential],
    *,
    seed: int,
    layers: range | Sequence[int] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    tied: bool = False,
) -> nn.Sequential:
    """Construct ``factory()`` on ``meta`` and materialize only ``layers`` on ``device``.

    Args:
        factory: builds the whole model; called once, under ``torch.device("meta")``. It must
            not place tensors on a device explicitly.
        seed: layer ``i`` is initialized from ``gpipe.rng.layer_seed(seed, i, INIT)``.
        layers: whole-model indices of the layers to materialize (default: all). Need not be
            contiguous (virtual stages).
        device: where the local layers live and are initialized.
        dtype: floating-point dtype for the local layers (default: as built). Initialization runs
            in this dtype, so results differ between dtypes.
        tied: accept weights tied across the cut (the caller keeps the copies equal, as
            ``Pipe(tied=...)`` does); the local side is initialized by its own layers.

    Returns:
        The Sequential returned by ``factory``: local layers on ``device``, initialized; the
        others on ``meta`` (holding no memory).

    Raises:
        TypeError: ``factory`` did not return an ``nn.Sequential``.
        ValueError: bad ``layers``; tensors the factory put off ``meta``; weights tied across the
            cut; tensors no ``reset_parameters()`` initialized (each named, whole-model names).

    Example::

        >>> model = build(lambda: mlp([8, 16, 16, 4]), seed=0, layers=range(2, 4))
        >>> model[0].weight.device, model[2].weight.device
        (device(type='meta'), device(type='cpu'))
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("device='meta' materializes nothing; pass the device the stage runs on")
    model = _build_on_meta(factory)
    local = _local_layers(layers, len(model))
    slots = _tensor_slots(model, local, allow_crossing=tied)
    for i in local:
        if dtype is not None:
            model[i].to(dtype)  # on meta: free
        model[i].to_empty(device=device)
    _retie(slots)

    problems: list[str] = []
    cpu = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        generators = [stack.enter_context(preserved(cpu))]
        if device.type != "cpu":
            generators.append(stack.enter_context(preserved(device)))
        for i in local:
            problems += _initialize(model[i], str(i), layer_seed(seed, i, INIT), generators, device)
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"build() could not initialize {len(problems)} tensor(s) of the local layers:\n"
            f"{listing}\nRemedy: {_REMEDY}."
        )
    return model


def build_full(
    factory: Callable[[], nn.Sequential],
    *,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> nn.Sequential:
    """The one-process reference: :func:`build` of every layer.

    Any cut of ``build(factory, seed=seed, layers=...)`` equals the corresponding layers of this
    model exactly (same device type and dtype).
    """
    return build(factory, seed=seed, layers=None, device=device, dtype=dtype)


def materialized_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that are not on ``meta``, shared ones once."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type != "meta")


def _build_on_meta(factory: Callable[[], nn.Sequential]) -> nn.Sequential:
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"factory() returned {type(model).__name__}, not an nn.Sequential: gpipe cuts a model "
            f"between the layers of an nn.Sequential, so return nn.Sequential(layer0, layer1, ...) "
            f"(see gpipe.models)"
        )
    placed = [
        f"{name} on {t.device}"
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if t.device.type != "meta"
    ]
    if placed:
        raise ValueError(
            f"factory() created {len(placed)} tensor(s) off the meta device, so every rank would "
            f"hold them: {', '.join(placed[:5])}{', ...' if len(placed) > 5 else ''}. "
            f"Construct the model inside factory() and do not pass device= to its modules"
        )
    return model


def _local_layers(layers: range | Sequence[int] | None, n: int) -> list[int]:
    if layers is None:
        return list(range(n))
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
    if bad:
        raise ValueError(
            f"layers must be whole-model indices in 0..{n - 1} (the model has {n} layers); "
            f"got {bad}"
        )
    return sorted(set(layers))


@dataclass
class _Slot:
    """Where a parameter or buffer is registered: ``getattr(module, attr)``."""

    name: str  # whole-model name, e.g. "3.attn.qkv.weight"
    module: nn.Module
    attr: str
    local: bool


def _tensor_slots(
    model: nn.Sequential, local: list[int], *, allow_crossing: bool = False
) -> dict[int, list[_Slot]]:
    """The local registrations of every meta tensor, grouped by tensor.

    Rejects ties across the cut unless ``allow_crossing``.
    """
    slots: dict[int, list[_Slot]] = {}
    local_set = set(local)
    for i, layer in enumerate(model):
        for prefix, module in layer.named_modules(prefix=str(i), remove_duplicate=False):
            registered = (*module._parameters.items(), *module._buffers.items())
            for attr, tensor in registered:
                if tensor is not None:
                    slot = _Slot(f"{prefix}.{attr}", module, attr, i in local_set)
                    slots.setdefault(id(tensor), []).append(slot)
    crossing = [
        " = ".join(s.name for s in group)
        for group in slots.values()
        if any(s.local for s in group) and not all(s.local for s in group)
    ]
    if crossing and not allow_crossing:
        raise ValueError(
            f"tensors tied across the local layers' boundary: {'; '.join(crossing)}. Each stage "
            f"would hold its own copy, initialized and trained apart; put tied layers in one "
            f"stage, or untie them"
        )
    local_slots = {key: [s for s in group if s.local] for key, group in slots.items()}
    return {key: group for key, group in local_slots.items() if group}


def _retie(slots: dict[int, list[_Slot]]) -> None:
    """``to_empty`` gives each registration its own tensor; share them again as built."""
    for first, *others in slots.values():
        shared = getattr(first.module, first.attr)
        for slot in others:
            setattr(slot.module, slot.attr, shared)


def _initialize(
    layer: nn.Module,
    prefix: str,
    seed: int,
    generators: list[torch.Generator],
    device: torch.device,
) -> list[str]:
    """Reset ``layer`` from ``seed``; return a line for each tensor the resets left alone."""
    tensors = _named_tensors(layer, prefix)
    with torch.no_grad():
        for _, _, _, tensor in tensors:
            tensor.fill_(float("nan") if _is_float(tensor) else 0)
    before = {name: (tensor, tensor._version) for name, _, _, tensor in tensors}

    for generator in generators:
        generator.manual_seed(seed)
    for module in _children_first(layer):
        reset = _reset_method(module)
        if reset is not None:
            reset()

    problems = []
    for name, kind, owner, tensor in _named_tensors(layer, prefix):
        old, version = before.get(name, (None, None))
        what = f"{name} (a {kind} of {type(owner).__name__})"
        if tensor.device.type != device.type or (
            device.index is not None and tensor.device != device
        ):
            problems.append(f"{what} is on {tensor.device} after reset, not on {device}")
        elif _is_float(tensor):
            if tensor.numel() > 0 and bool(tensor.isnan().all()):
                problems.append(f"{what} was not initialized")
        elif tensor is old and tensor._version == version and not bool(tensor.any()):
            # No sentinel exists for bool, so "untouched" is: same tensor, no in-place write.
            problems.append(f"{what} was not initialized (a {tensor.dtype} left zero-filled)")
    for prefix_, module in layer.named_modules(prefix=prefix):
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                problems.append(
                    f"{prefix_}.{attr} (a plain tensor attribute of {type(module).__name__}) is "
                    f"still on meta: register it with register_buffer() and fill it in "
                    f"reset_parameters()"
                )
    return problems


def _named_tensors(layer: nn.Module, prefix: str) -> list[tuple[str, str, nn.Module, torch.Tensor]]:
    """(whole-model name, "Parameter" or "buffer", owning module, tensor), each tensor once."""
    found, seen = [], set()
    for module_name, module in layer.named_modules(prefix=prefix):
        for kind, registered in (("Parameter", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in registered.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    found.append((f"{module_name}.{attr}", kind, module, tensor))
    return found


def _is_float(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _children_first(module: nn.Module, seen: set[int] | None = None) -> Iterator[nn.Module]:
    """Post-order, each module once: the order in which eager construction finishes them."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _children_first(child, seen)
    yield module


def _reset_method(module: nn.Module) -> Callable[[], None] | None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    # MultiheadAttention and Transformer name theirs privately; only trust torch's own.
    private = getattr(module, "_reset_parameters", None)
    if callable(private) and type(module).__module__.startswith("torch.nn."):
        return private
    return None
