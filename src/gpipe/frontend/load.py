"""A rank's units filled from a checkpoint, each tensor as ``from_pretrained`` would load it.

A Hugging Face model's tensors go through transformers' own loading,
``convert_and_load_state_dict_in_model`` with the model's conversion mapping, on a copy of the
model on ``meta`` (renamed keys, Mixtral's experts fused, cast to the model's dtypes); any
other model's are its ``state_dict`` entries. Only the checkpoint keys that fill this rank's
tensors are read (``gpipe.frontend.keys``, ``gpipe.frontend.files``). :func:`load_units`
returns what it found (``gpipe.frontend.report``); filling the rest is the caller's.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from gpipe.frontend.keys import KeyMap
from gpipe.frontend.report import LoadReport
from gpipe.frontend.units import tensor_names

__all__ = ["Slot", "install", "load_units", "local_slots"]


@dataclass
class Slot:
    """Where a unit registers a tensor: ``module.<attr>``, the model's ``name`` for it."""

    module: nn.Module
    attr: str
    name: str
    tensor: torch.Tensor


def local_slots(units: nn.Sequential, layers: Iterable[int]) -> Iterator[Slot]:
    """Every registration of a parameter or buffer in ``units[i]``, ``i`` in ``layers``."""
    for i in layers:
        for prefix, module in units[i].named_modules(remove_duplicate=False):
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None:
                    yield Slot(module, attr, f"{prefix}.{attr}" if prefix else attr, t)


def install(slot: Slot, value: torch.Tensor, made: dict[int, torch.Tensor]) -> None:
    """Put ``value`` (cast to the slot's dtype) in the slot; one new tensor per old one, so
    that a tensor registered twice stays one."""
    old = slot.tensor
    new = made.get(id(old))
    if new is None:
        value = value.detach().to(old.dtype)
        new = nn.Parameter(value, old.requires_grad) if isinstance(old, nn.Parameter) else value
        made[id(old)] = new
    if slot.attr in slot.module._parameters:
        slot.module._parameters[slot.attr] = new
    else:
        slot.module._buffers[slot.attr] = new


def load_units(
    units: nn.Sequential, layers: list[int], model: nn.Module, keys: KeyMap
) -> LoadReport:
    """Fill the meta tensors of ``units[i]`` (``i`` in ``layers``) from ``keys.checkpoint``,
    in place; ``model`` is the whole model on meta, whose tensors the units hold."""
    names_of = tensor_names(model)
    wanted = [s for s in local_slots(units, layers) if s.tensor.is_meta]
    aliases = {id(s.tensor): [s.name, *names_of.get(id(s.tensor), [])] for s in wanted}
    local = {name for names in aliases.values() for name in names}
    report = LoadReport(str(keys.checkpoint.path), unexpected=list(keys.unexpected))
    read = _read_hugging_face if keys.hugging_face else _read_state_dict
    values = read(model, keys, keys.keys_for(local), report)
    persistent = set(model.state_dict(keep_vars=True))
    made: dict[int, torch.Tensor] = {}
    missing = set()
    for slot in wanted:
        names = aliases[id(slot.tensor)]
        found = next((values[n] for n in names if n in values), None)
        if found is not None:
            install(slot, found, made)
        elif any(n in persistent for n in names) and not any(map(keys.ignore_missing, names)):
            missing.add(next(n for n in names if n in persistent))
    report.missing = sorted(missing - {name for name, _, _ in report.mismatched})
    return report


def _read_state_dict(
    model: nn.Module, keys: KeyMap, wanted: list[str], report: LoadReport
) -> dict[str, torch.Tensor]:
    """A plain model's tensors: the checkpoint's keys are the model's names."""
    shapes = {
        name: tuple(t.shape)
        for name, t in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]
    }
    values = {}
    with keys.checkpoint.slices(wanted) as slices:
        for name, piece in slices.items():
            shape = tuple(piece.get_shape())
            if shape != shapes[name]:
                report.mismatched.append((name, shape, shapes[name]))
            else:
                values[name] = piece[...]
    return values


def _read_hugging_face(
    model: nn.Module, keys: KeyMap, wanted: list[str], report: LoadReport
) -> dict[str, torch.Tensor]:
    """Through ``convert_and_load_state_dict_in_model``, as ``from_pretrained`` loads, into a
    copy of the model on meta; its loaded tensors, by the model's names."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    scratch = copy.deepcopy(model)  # on meta: no memory; loading sets real tensors on it
    config = LoadStateDictConfig(weight_mapping=get_model_conversion_mapping(scratch))
    with keys.checkpoint.slices(wanted) as slices, _no_progress_bar():
        info, _ = convert_and_load_state_dict_in_model(scratch, slices, config)
    report.mismatched = sorted(
        (n, tuple(got), tuple(want)) for n, got, want in info.mismatched_keys
    )
    report.failed = sorted(
        f"{target}: {' '.join(message.strip().splitlines()[-2:])}"
        for target, message in info.conversion_errors.items()
    )
    values = {}
    for name in {n for key in wanted for n in keys.targets[key]}:
        owner, _, attr = name.rpartition(".")
        value = getattr(scratch.get_submodule(owner), attr, None)
        if isinstance(value, torch.Tensor) and not value.is_meta:
            values[name] = value
    return values


@contextmanager
def _no_progress_bar():
    """Each rank loads its part: no progress bar per rank."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()
