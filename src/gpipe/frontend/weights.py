"""Big models: capture on ``meta``, then give values to this rank's units only.

A model given on ``meta`` (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``)
or as a function that builds it is captured without real memory; ``Pipe`` then calls
:func:`materialize_units` for the units this process holds. Values come, in order of preference:

1. from ``weights``, a checkpoint directory (``save_pretrained``: ``model.safetensors``, or
   shards listed by ``model.safetensors.index.json``) or one ``.safetensors`` file: each rank
   reads only its own tensors (a tensor saved under another of its names, as Hugging Face saves
   one of two tied weights, is found by that name);
2. for a model given as a function, by replaying its construction (``gpipe.materialize``): bit
   for bit the tensors of ``torch.manual_seed(init_seed); factory()``, whatever the cut, buffers
   computed at construction (rotary ``inv_freq``) included;
3. otherwise by the model's own initialization of each module that owns a local tensor: Hugging
   Face's ``_init_weights`` (which also recomputes rotary buffers), else ``reset_parameters()``,
   seeded per unit so that any cut gives the same weights.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

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


def origin_of(
    model: nn.Module | Callable[[], nn.Module], weights: str | Path | None, seed: int
) -> tuple[nn.Module, Origin | None]:
    """The model to capture, and where its values come from (None: it has them)."""
    if not isinstance(model, nn.Module) and callable(model):
        factory = model
        with _hf_initializes_on_meta():
            built, recording = record_factory(
                factory, seed=seed, device=torch.device("cpu"), sequential=False
            )
        return built, Origin(built, recording, seed, weights)
    if on_meta(model):
        return model, Origin(model, None, seed, weights)
    if weights is not None:
        raise ValueError(
            "weights= fills a model given on meta or as a function; this one has values "
            "already (load the checkpoint into it first, or build it on meta)"
        )
    return model, None


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


def materialize_units(units: nn.Sequential, layers: list[int], origin: Origin | None) -> None:
    """Give the meta tensors of ``units[i]`` for ``i`` in ``layers`` their values, in place."""
    if origin is None:
        missing = _meta_names(units, layers)
        if missing:
            raise ValueError(
                f"the captured model's tensors {missing[:4]} are on meta and gpipe does not know "
                "their values: capture through Pipe.from_model with weights= a checkpoint, or "
                "a function that builds the model"
            )
        return
    if origin.weights is not None:
        _load(units, layers, origin)
    if origin.recording is not None and _meta_names(units, layers):
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


def _slots(units: nn.Sequential, layers: list[int]):
    """(unit, owner module, attribute, model's name, tensor) of every local registration."""
    for i in layers:
        for prefix, module in units[i].named_modules(remove_duplicate=False):
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is not None:
                    yield units[i], module, attr, f"{prefix}.{attr}" if prefix else attr, t


def _meta_names(units: nn.Sequential, layers: list[int]) -> list[str]:
    return [name for _, _, _, name, t in _slots(units, layers) if t.is_meta]


def _install(module: nn.Module, attr: str, old: torch.Tensor, value: torch.Tensor, made: dict):
    new = made.get(id(old))
    if new is None:
        value = value.to(old.dtype)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(value, requires_grad=old.requires_grad)
        else:
            new = value
        made[id(old)] = new
    if attr in module._parameters:
        module._parameters[attr] = new
    else:
        module._buffers[attr] = new


def _load(units: nn.Sequential, layers: list[int], origin: Origin) -> None:
    names_of: dict[int, list[str]] = {}
    for name, t in origin.model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(t), []).append(name)
    for name, t in origin.model.named_buffers(remove_duplicate=False):
        names_of.setdefault(id(t), []).append(name)
    files = _files(Path(origin.weights))
    made: dict[int, torch.Tensor] = {}
    wanted = [s for s in _slots(units, layers) if s[4].is_meta]
    by_file: dict[Path, list] = {}
    for slot in wanted:
        for name in [slot[3], *names_of.get(id(slot[4]), [])]:
            if name in files:
                by_file.setdefault(files[name], []).append((slot, name))
                break
    from safetensors import safe_open  # a dependency of the hf extra

    for path, slots in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for (_, module, attr, _, old), name in slots:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(old.shape):
                    raise ValueError(
                        f"{name} has shape {shape} in {path}, but {tuple(old.shape)} in the model: "
                        "the checkpoint is of another configuration"
                    )
                _install(module, attr, old, f.get_tensor(name), made)


def _files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if single.exists():
        return _files(single)
    raise FileNotFoundError(
        f"weights={str(path)!r} holds neither model.safetensors nor model.safetensors.index.json; "
        "pass the directory save_pretrained wrote (safe_serialization), or a .safetensors file"
    )


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
        meta = [(module, attr, t) for _, module, attr, _, t in _slots(units, [i]) if t.is_meta]
        if not meta:
            continue
        todo = {id(source[id(t)][0]): source[id(t)][0] for _, _, t in meta if id(t) in source}
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
        for module, attr, t in meta:
            if id(t) in source:
                owner, name = source[id(t)]
                value = getattr(owner, name)
                if not value.is_meta:
                    _install(module, attr, t, value.detach(), made)
