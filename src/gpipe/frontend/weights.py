"""Big models: capture on ``meta``, then give values to this rank's units only.

A model given on ``meta`` (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``)
or as a function that builds it is captured without real memory; ``Pipe`` then calls
:func:`materialize_units` for the units this process holds. Values come, in order of preference:

1. from ``weights``, a checkpoint directory (``save_pretrained``: ``model.safetensors``, or
   shards listed by ``model.safetensors.index.json``) or one ``.safetensors`` file, under the
   names ``from_pretrained`` gives its tensors (``gpipe.frontend.load``: transformers' own key
   conversions, e.g. Mixtral's per-expert tensors fused): each rank reads only its own tensors.
   Whole or not at all: a tensor the checkpoint lacks, one it holds that the model does not
   have, or one of another shape stops the build on every rank, naming them; ``strict=False``
   initializes those (2. or 3.) and lists them in a warning;
2. for a model given as a function, by replaying its construction (``gpipe.materialize``): bit
   for bit the tensors of ``torch.manual_seed(init_seed); factory()``, whatever the cut, buffers
   computed at construction (rotary ``inv_freq``) included; with ``weights``, only what the
   checkpoint does not hold (non-persistent buffers);
3. otherwise by the model's own initialization of each module that owns a local tensor: Hugging
   Face's ``_init_weights`` (which also recomputes rotary buffers), else ``reset_parameters()``,
   seeded per unit so that any cut gives the same weights.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gpipe.frontend.files import Checkpoint
from gpipe.frontend.keys import KeyMap
from gpipe.frontend.load import install, load_units, local_slots
from gpipe.frontend.report import LoadReport
from gpipe.materialize import record_factory, replay_layers
from gpipe.materialize.record import Recording

__all__ = ["Origin", "materialize_units", "on_meta", "origin_of"]


@dataclass
class Origin:
    """Where the values of a model captured on meta come from."""

    model: nn.Module  # the whole model, on meta
    recording: Recording | None = None  # its construction, when built from a function
    seed: int = 0
    weights: str | Path | None = None
    strict: bool = True  # weights fill every tensor, or the build stops
    keys: KeyMap | None = None  # the checkpoint's keys, mapped to the model's names


def origin_of(
    model: nn.Module | Callable[[], nn.Module],
    weights: str | Path | None,
    seed: int,
    strict: bool = True,
) -> tuple[nn.Module, Origin | None]:
    """The model to capture, and where its values come from (None: it has them). With
    ``weights``, the checkpoint's names are checked against the whole model first (no tensor
    read; the same on every rank): ``strict`` and a tensor missing or unexpected raise
    :class:`~gpipe.frontend.report.WeightsError` before anything is captured."""
    recording = None
    if not isinstance(model, nn.Module) and callable(model):
        factory = model
        with _hf_initializes_on_meta():
            model, recording = record_factory(
                factory, seed=seed, device=torch.device("cpu"), sequential=False
            )
    elif not on_meta(model):
        if weights is not None:
            raise ValueError(
                "weights= fills a model given on meta or as a function; this one has values "
                "already (load the checkpoint into it first, or build it on meta)"
            )
        return model, None
    origin = Origin(model, recording, seed, weights, strict)
    if weights is not None:
        origin.keys = KeyMap(model, Checkpoint(weights))
        found = origin.keys.check(model)
        if strict and not found.complete:
            raise found.error()
    return model, origin


@contextmanager
def _hf_initializes_on_meta():
    """Hugging Face models skip their weight initialization when built on meta, where the
    recording builds them; let them run it, at the moments eager construction does, so that
    the recording holds it."""
    if "transformers" not in sys.modules:  # a factory that builds no Hugging Face model
        yield
        return
    utils = importlib.import_module("transformers.modeling_utils")
    if not hasattr(utils, "get_torch_context_manager_or_global_device"):
        yield
        return
    original = utils.get_torch_context_manager_or_global_device
    utils.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        utils.get_torch_context_manager_or_global_device = original


def on_meta(units: nn.Module) -> bool:
    return any(t.is_meta for t in (*units.parameters(), *units.buffers()))


def materialize_units(
    units: nn.Sequential, layers: list[int], origin: Origin | None
) -> LoadReport | None:
    """Give the meta tensors of ``units[i]`` for ``i`` in ``layers`` their values, in place.

    Returns what loading ``origin.weights`` found (None without weights). With ``strict`` and
    a checkpoint that does not fill these units, nothing else is filled: the caller stops
    (``report.error()``; ``gpipe.pipe.assembly`` on every rank)."""
    if origin is None:
        missing = _meta_names(units, layers)
        if missing:
            raise ValueError(
                f"the captured model's tensors {missing[:4]} are on meta and gpipe does not know "
                "their values: capture through Pipe.from_model with weights= a checkpoint, or "
                "a function that builds the model"
            )
        return None
    report = None
    if origin.weights is not None:
        keys = origin.keys or KeyMap(origin.model, Checkpoint(origin.weights))
        report = load_units(units, layers, origin.model, keys)
        if origin.strict and not report.complete:
            return report
    before = set(_meta_names(units, layers))
    if origin.recording is not None and before:
        replay_layers(units, origin.recording, seed=origin.seed, layers=layers, tied=True)
    if _meta_names(units, layers):
        _initialize(units, layers, origin)
    missing = _meta_names(units, layers)
    if missing:
        raise ValueError(
            f"no value for {missing[:6]}: not in the checkpoint {origin.weights}, and their "
            "modules have neither a Hugging Face _init_weights nor reset_parameters(); pass "
            "weights= a checkpoint that has them, or build the model from a function"
        )
    if report is not None:
        expected = {*report.missing, *(name for name, _, _ in report.mismatched)}
        report.initialized = sorted(before & expected)
    return report


def _meta_names(units: nn.Sequential, layers: list[int]) -> list[str]:
    return [s.name for s in local_slots(units, layers) if s.tensor.is_meta]


def _initialize(units: nn.Sequential, layers: list[int], origin: Origin) -> None:
    """The model's own initialization, module by module, of what is still on meta."""
    model = origin.model
    init_weights = getattr(model, "_init_weights", None)
    # The model's modules own the units' tensors: give them real memory, initialize them as
    # the model would, then hand the new tensors to the unit.
    source: dict[int, tuple[nn.Module, str]] = {}  # a (meta) tensor -> its owner, attribute
    for m in model.modules():
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None:
                source.setdefault(id(t), (m, attr))
    for i in layers:
        meta = [s for s in local_slots(units, [i]) if s.tensor.is_meta]
        if not meta:
            continue
        todo = {
            id(source[id(s.tensor)][0]): source[id(s.tensor)][0]
            for s in meta
            if id(s.tensor) in source
        }
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(origin.seed * 100_003 + i)
        try:
            for m in todo.values():
                m.to_empty(device="cpu", recurse=False)
                if init_weights is not None:
                    init_weights(m)
                elif hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        finally:
            torch.random.set_rng_state(generator_state)
        made: dict[int, torch.Tensor] = {}
        for slot in meta:
            if id(slot.tensor) in source:
                owner, name = source[id(slot.tensor)]
                value = getattr(owner, name)
                if not value.is_meta:
                    install(slot, value, made)
