"""Which unit holds which of the model's tensors, under the model's own names and in its
order, so that a captured model's state dict is the model's: a tensor with several names gets
them all, a tensor the forward never reads stays with the unit of the module that owns it, and
a parameter read by several units is tied."""

from __future__ import annotations

import torch
from torch import nn

from gpipe.frontend.cut import Piece
from gpipe.frontend.units import CapturedModel, Unit, tensor_names

__all__ = ["units_of"]


def units_of(
    model: nn.Module,
    paths: list[str],
    train: list[Piece],
    evaluate: list[Piece],
    device: torch.device,
) -> CapturedModel:
    """The pieces of the train() and eval() captures, cut at ``paths``, as one model of units
    running on ``device``."""
    _add_other_names(model, train, evaluate)
    _add_unused(model, paths, train, evaluate)
    positions = _positions(model)
    order: dict[str, int] = {}  # a tensor's or a module's place in the model's order
    for key, index in positions.items():
        parts = key.split(".")
        for end in range(1, len(parts) + 1):
            order.setdefault(".".join(parts[:end]), index)
    units = [
        Unit(t.name, _holder([t, e], order), {True: t.graph, False: e.graph}, device)
        for t, e in zip(train, evaluate, strict=True)
    ]
    captured = CapturedModel(*units, tied=_ties(train, evaluate), split=paths)
    captured.order = positions
    return captured


def _positions(model: nn.Module) -> dict[str, int]:
    """Each tensor's place in the model's own order (a module's parameters, then its buffers,
    module by module): that of ``named_parameters()``, ``named_buffers()``, ``state_dict()``."""
    positions: dict[str, int] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name in (*module._parameters, *module._buffers):
            positions.setdefault(f"{path}.{name}" if path else name, len(positions))
    return positions


def _holder(pieces: list[Piece], order: dict[str, int]) -> nn.Module:
    """The unit's tensors and kept modules at their paths in the model, in the model's
    order (so that state dicts list them as the model's does)."""
    root = nn.Module()
    items = [(path, None, module) for piece in pieces for path, module in piece.modules.items()]
    items += [(name, *kt) for piece in pieces for name, kt in piece.tensors.items()]
    items.sort(key=lambda item: order.get(item[0], len(order)))
    for name, kind, tensor in items:
        if kind is None:
            _place(root, name, tensor)
            continue
        owner, attr = _owner(root, name)
        if attr in owner._parameters or attr in owner._buffers:
            continue
        if kind == "parameter":
            owner.register_parameter(attr, tensor)
        else:
            owner.register_buffer(attr, tensor, persistent=kind == "buffer")
    return root


def _add_other_names(model: nn.Module, *modes: list[Piece]) -> None:
    """A tensor with several names in the model (BERT's decoder bias) gets them all, in the
    first unit that holds it, so that state dicts have the model's keys."""
    names = tensor_names(model)
    held = {name for pieces in modes for piece in pieces for name in piece.tensors}
    for pieces in modes:
        for piece in pieces:
            for kind, tensor in list(piece.tensors.values()):
                for other in names.get(id(tensor), []):
                    if other not in held:
                        piece.tensors[other] = (kind, tensor)
                        held.add(other)


def _add_unused(model: nn.Module, paths: list[str], *modes: list[Piece]) -> None:
    """Parameters and buffers the forward never reads stay the model's (in its state dict, or
    its ``buffers()``): in the unit of the split module that owns them, else the first unit."""
    held = {id(t) for pieces in modes for piece in pieces for _, _, t in _read(piece)}
    persistent = dict(model.state_dict(keep_vars=True))
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in held:
            continue
        kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
        kind = kind if name in persistent or kind == "parameter" else "constant"
        owner = [p for p in paths if name.startswith(p + ".")]
        index = [piece.name for piece in modes[0]].index(owner[0]) if owner else 0
        for pieces in modes:
            pieces[index].tensors[name] = (kind, t)
        held.add(id(t))


def _read(piece: Piece) -> list[tuple[str, str, torch.Tensor]]:
    """(name, kind, tensor) of what a unit reads: its tensors, and those of the modules it
    keeps as calls (a batch norm's weight is the module's, not the graph's)."""
    read = [(name, kind, t) for name, (kind, t) in piece.tensors.items()]
    for path, module in piece.modules.items():
        read += [(f"{path}.{n}", "parameter", t) for n, t in module.named_parameters()]
        read += [(f"{path}.{n}", "buffer", t) for n, t in module.named_buffers()]
    return read


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    *prefix, attr = name.split(".")
    module = root
    for part in prefix:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    return module, attr


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, attr = _owner(root, path)
    parent.add_module(attr, module)


def _ties(*modes: list[Piece]) -> list[tuple[str, ...]]:
    """Parameters read by more than one unit, as ``Pipe``'s ``tied=`` groups."""
    holders: dict[int, dict[int, str]] = {}
    for pieces in modes:
        for u, piece in enumerate(pieces):
            for name, kind, tensor in _read(piece):
                if kind == "parameter":
                    holders.setdefault(id(tensor), {}).setdefault(u, name)
    return [
        tuple(f"{u}.{name}" for u, name in sorted(units.items()))
        for units in holders.values()
        if len(units) > 1
    ]
