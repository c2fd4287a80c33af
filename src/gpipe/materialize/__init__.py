"""Build one stage of a model exactly as the factory builds it, without building the rest.

In the multi-process engine every rank holds one stage, and the whole model may not fit in one
process. :func:`build` runs ``factory()`` once on the ``meta`` device (shapes only, no memory)
while recording every tensor operation it makes (``gpipe.materialize.record``), then replays on
the target device only what the local layers need; the other layers stay on ``meta``, so the
returned Sequential keeps every index and name and a stage's parameters keep their whole-model
names (``"7.qkv.weight"``).

The contract. ``build(factory, seed=s, layers=L, device=d)`` holds, in every layer of ``L``, the
very tensors that eager construction gives::

    torch.manual_seed(s)
    with torch.device(d):
        reference = factory()

bit for bit, with the same dtypes and the same ties, for any ``L``: whatever ``__init__`` does,
``reset_parameters()``, ``nn.init`` calls applied afterwards (``model.apply(_init_weights)``),
parameters made from ``torch.ones``/``torch.randn(...) * 0.1``, buffers computed in ``__init__``
(``torch.tril`` masks), plain tensor attributes, ``torch.manual_seed`` or ``fork_rng`` inside the
factory. So any cut equals the one-process model, and ``Pipe(factory, init_seed=s)`` holds the
weights of ``torch.manual_seed(s); Pipe(factory(), ...)`` (on the CPU; equality across device
types is *not* promised, CPU and CUDA generators draw different numbers). A tensor the factory
leaves uninitialized (``torch.empty``) is uninitialized here too. With ``dtype``, local layers
equal ``reference[i].to(dtype)``. The CPU's and the device's generator states are left as found.

Memory: a rank allocates its local layers, the temporaries the factory computes them from (e.g.
the ``randn`` of ``randn(n, n) * 0.1``), and, for each random draw into a non-local tensor, a
scratch tensor of that tensor's size, freed at once: the draw must still happen so that later
draws match eager ones. Time: draws are replayed up to the last one a local tensor depends on,
so a rank holding the last layers draws every random number of the model, as eager
construction does (cheap on a GPU; on a CPU about as long as initializing the whole model).

Example (rank ``r`` of ``K`` holds layers ``cuts[r]:cuts[r + 1]``)::

    model = build(lambda: gpt(GPTConfig(n_layers=48)), seed=0,
                  layers=range(cuts[r], cuts[r + 1]), device=f"cuda:{local_rank}")
    stage = model[cuts[r]:cuts[r + 1]]      # the other layers are on meta

What cannot be reproduced raises a ``ValueError`` naming each local tensor concerned: a tensor
made on meta outside ``factory()`` (or by a path that bypasses torch's dispatcher), a random
value the factory reads back into Python (``.item()``), parameters or buffers the factory puts on
a real device. A factory whose Python code depends on tensor values fails on meta. Not detected:
``orthogonal_``, ``sparse_`` and ``dirac_`` return at once on meta, and are recorded only when
called through ``torch.nn.init`` (as ``nn.init.orthogonal_(w)``), not through a reference taken
before :func:`build` runs (``from torch.nn.init import orthogonal_``); generators of devices
other than the CPU and ``device`` are neither seeded nor replayed. Weights tied between layers
stay tied within the local slice; a tie (or shared storage) that crosses the cut is rejected
unless ``tied=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gpipe.base.rng import preserved
from gpipe.materialize.record import Recording, Unreplayable, record

__all__ = [
    "build",
    "materialized_bytes",
    "record_factory",
    "record_model",
    "replay_layers",
]

_REMEDY = (
    "create every tensor of the model inside factory() with torch operations, "
    "or build the model in one process and pass it to Pipe"
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
    """Record ``factory()`` on ``meta`` and materialize only ``layers`` on ``device``, exactly.

    Args:
        factory: builds the whole model; called once, under ``torch.device("meta")``. It must
            not place tensors on a device explicitly.
        seed: the build equals ``torch.manual_seed(seed); factory()`` (see the module doc).
        layers: whole-model indices of the layers to materialize (default: all). Need not be
            contiguous (virtual stages).
        device: where the local layers are built (and their random draws made).
        dtype: cast the local layers' floating-point tensors to it after building.
        tied: accept weights tied across the cut (the caller keeps the copies equal, as
            ``Pipe(tied=...)`` does); the local copy holds the tensor as built.

    Returns:
        The Sequential returned by ``factory``: local layers on ``device``, as eagerly built;
        the others on ``meta`` (holding no memory).

    Raises:
        TypeError: ``factory`` did not return an ``nn.Sequential``.
        ValueError: bad ``layers``; tensors the factory put off ``meta``; weights tied across the
            cut; local tensors that cannot be reproduced (each named, whole-model names).

    Example::

        >>> model = build(lambda: mlp([8, 16, 16, 4]), seed=0, layers=range(2, 4))
        >>> model[0].weight.device, model[2].weight.device
        (device(type='meta'), device(type='cpu'))
    """
    model, recording = record_model(factory, seed=seed, device=device)
    return replay_layers(model, recording, seed=seed, layers=layers, dtype=dtype, tied=tied)


def record_model(
    factory: Callable[[], nn.Sequential], *, seed: int, device: torch.device | str = "cpu"
) -> tuple[nn.Sequential, Recording]:
    """The first half of :func:`build`: ``factory()`` recorded on meta (every layer on meta),
    the generators left as found. Record once and replay once: the record holds every
    operation of the whole model, so drop it after :func:`replay_layers`."""
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("device='meta' materializes nothing; pass the device the stage runs on")
    with preserved(torch.device("cpu")), preserved(device):  # the generators as found
        return record_factory(factory, seed=seed, device=device)


def replay_layers(
    model: nn.Sequential,
    recording: Recording,
    *,
    seed: int,
    layers: range | Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    tied: bool = False,
) -> nn.Sequential:
    """The second half of :func:`build`: materialize ``layers`` of a ``model`` recorded on
    meta (``record(factory)``), in place, on the recording's device. ``model`` may be any
    Sequential whose layers hold the recorded tensors (e.g. a captured model's units)."""
    device = recording.device
    with preserved(torch.device("cpu")), preserved(device):
        local = _local_layers(layers, len(model))
        slots = _slots(model, local, recording)
        _reject_crossing(slots, allowed=tied)
        keep, problems = _kept_storages(slots, recording)
        storages: dict[int, torch.UntypedStorage] = {}
        if not problems and keep:
            try:
                storages = recording.replay(keep, seed)
            except Unreplayable as error:
                problems.append(str(error))
    if problems:
        listing = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"build() cannot reproduce {len(problems)} tensor(s) of the local layers exactly:\n"
            f"{listing}\nRemedy: {_REMEDY}."
        )
    _install(slots, storages)
    if dtype is not None:
        for i in local:
            model[i].to(dtype)
    return model


def materialized_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that are not on ``meta``, shared ones once."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.device.type != "meta")


def record_factory(
    factory: Callable[[], nn.Module],
    *,
    seed: int,
    device: torch.device,
    sequential: bool = True,
) -> tuple[nn.Module, Recording]:
    """``factory()`` built on meta while recording (``gpipe.materialize.record``): the model
    (an ``nn.Sequential`` unless ``sequential=False``) and what :func:`replay_layers` needs."""
    try:
        model, recording = record(factory, seed=seed, device=device)
    except (RuntimeError, NotImplementedError) as error:
        if "meta" not in str(error):
            raise
        raise ValueError(
            f"factory() failed on the meta device, where tensors have shapes but no values: "
            f"{error}. A factory must not read tensor values (.item(), data-dependent branches); "
            f"build the model in one process and pass it to Pipe instead"
        ) from error
    if sequential and not isinstance(model, nn.Sequential):
        raise TypeError(
            f"factory() returned {type(model).__name__}, not an nn.Sequential: Pipe cuts a model "
            f"between the layers of an nn.Sequential; for any other model use "
            f"Pipe.from_model(factory, example, split=...)"
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
    return model, recording


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
    """Where a tensor is registered: ``getattr(module, attr)``."""

    name: str  # whole-model name, e.g. "3.attn.qkv.weight"
    kind: str  # "Parameter", "buffer" or "plain tensor attribute"
    module: nn.Module
    attr: str
    local: bool
    tensor: torch.Tensor
    key: object  # its storage in the recording (or the tensor's id if never recorded)

    @property
    def label(self) -> str:
        return f"{self.name} (a {self.kind} of {type(self.module).__name__})"


def _slots(model: nn.Sequential, local: list[int], recording: Recording) -> list[_Slot]:
    """Every registration of a parameter or buffer, and the local plain tensor attributes."""
    slots, local_set = [], set(local)
    for i, layer in enumerate(model):
        for prefix, module in layer.named_modules(prefix=str(i), remove_duplicate=False):
            registered = [
                *(("Parameter", a, t) for a, t in module._parameters.items()),
                *(("buffer", a, t) for a, t in module._buffers.items()),
            ]
            if i in local_set:
                registered += [
                    ("plain tensor attribute", a, t)
                    for a, t in vars(module).items()
                    if isinstance(t, torch.Tensor) and t.is_meta
                ]
            for kind, attr, tensor in registered:
                if tensor is not None:
                    key = recording.key_of(tensor)
                    key = ("unrecorded", id(tensor)) if key is None else key
                    slots.append(_Slot(f"{prefix}.{attr}", kind, module, attr, i in local_set,
                                       tensor, key))  # fmt: skip
    return slots


def _reject_crossing(slots: list[_Slot], *, allowed: bool) -> None:
    """Tensors (storages) registered both in a local layer and in another one."""
    groups: dict[object, list[_Slot]] = {}
    for slot in slots:
        if slot.kind != "plain tensor attribute":
            groups.setdefault(slot.key, []).append(slot)
    crossing = [
        " = ".join(dict.fromkeys(s.name for s in group))
        for group in groups.values()
        if any(s.local for s in group) and not all(s.local for s in group)
    ]
    if crossing and not allowed:
        raise ValueError(
            f"tensors tied across the local layers' boundary: {'; '.join(crossing)}. Each stage "
            f"would hold its own copy, trained apart; put tied layers in one stage, or untie them"
        )


def _kept_storages(slots: list[_Slot], recording: Recording) -> tuple[dict[int, str], list[str]]:
    """The storages to replay (key -> label of a tensor in it), and the tensors that can't be.
    A tensor that has values already (loaded from a checkpoint) is left as it is."""
    keep: dict[int, str] = {}
    problems: list[str] = []
    for slot in slots:
        if not slot.local or slot.key in keep or not slot.tensor.is_meta:
            continue
        if not isinstance(slot.key, int) or recording.is_outside_meta(slot.key):
            problems.append(
                f"{slot.label} was made on meta outside factory(), or by a path that bypasses "
                f"torch's dispatcher, so its values are unknown"
            )
        else:
            keep[slot.key] = slot.label
    return keep, list(dict.fromkeys(problems))


def _install(slots: list[_Slot], storages: dict[int, torch.UntypedStorage]) -> None:
    """Put the replayed tensors in place of the local meta ones; one new tensor per old one."""
    made: dict[int, torch.Tensor] = {}
    for slot in slots:
        if not slot.local or not slot.tensor.is_meta:
            continue
        old = slot.tensor
        new = made.get(id(old))
        if new is None:
            storage = storages[slot.key]
            data = torch.empty(0, dtype=old.dtype, device=storage.device).set_(
                storage, old.storage_offset(), old.shape, old.stride()
            )
            if isinstance(old, nn.Parameter):
                new = nn.Parameter(data, requires_grad=old.requires_grad)
                new.__dict__.update(old.__dict__)
            else:
                new = data.requires_grad_(old.requires_grad)
            made[id(old)] = new
        setattr(slot.module, slot.attr, new)  # through __setattr__, which RNNs hook
