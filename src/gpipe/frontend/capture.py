"""Capture any model's own forward with ``torch.export`` and cut it into units.

``capture(model, example, split="model.layers")`` exports the model (non-strict, the batch and
every other dimension dynamic where export can keep them so), once in ``train()`` and once in
``eval()`` mode, and cuts both graphs at the split modules (``gpipe.frontend.cut``). Batch norm
layers are kept as calls of the original modules, so that ``eval()`` and deferred batch norm
act on them as on the model, and so are modules with forward hooks, so that their hooks run;
gradient hooks are refused (``gpipe.frontend.hooks``). The result is a ``CapturedModel``: an
``nn.Sequential`` of units that ``Pipe`` trains like any other, its parameters the model's own
tensors.
"""

from __future__ import annotations

import difflib
import inspect
import traceback
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.export import Dim, export
from torch.export.graph_signature import InputKind
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree as pytree

from gpipe.frontend.cut import CaptureError, Piece, cut_graph, keep_as_calls
from gpipe.frontend.holders import units_of
from gpipe.frontend.hooks import forward_hooked, refuse_gradient_hooks
from gpipe.frontend.units import CapturedModel

__all__ = ["CaptureError", "capture", "fit_devices", "split_points"]

Split = str | Sequence[str] | None


def split_points(model: nn.Module, split: Split) -> list[str]:
    """The module paths where ``model`` may be cut.

    ``split`` names a container (every child of it: a ``ModuleList`` of blocks, or any
    module), or lists module paths; ``None`` takes the largest ``ModuleList`` of the model.
    """
    modules = dict(model.named_modules())
    if split is None:
        lists = [(len(m), name) for name, m in modules.items() if isinstance(m, nn.ModuleList)]
        if not lists:
            raise CaptureError(
                f"{type(model).__name__} has no nn.ModuleList of blocks to cut at; pass "
                "split= the name of the module whose children are the blocks, or a list of "
                "module paths"
            )
        return [f"{max(lists)[1]}.{child}" for child in modules[max(lists)[1]]._modules]
    if isinstance(split, str):
        _check_known(model, modules, [split])
        children = [f"{split}.{c}" if split else c for c in modules[split]._modules]
        if not children:
            raise CaptureError(f"split={split!r} names a module without children; {_hint(model)}")
        return children
    paths = list(split)
    if not paths or not all(isinstance(p, str) for p in paths):
        raise CaptureError(f"split must be a module name or a list of them, got {split!r}")
    _check_known(model, modules, paths)
    return paths


def capture(
    model: nn.Module,
    example: Any,
    *,
    split: Split = None,
    dynamic: bool = True,
    device: torch.device | str | None = None,
    inference_only: bool = False,
) -> CapturedModel:
    """Export ``model`` on ``example`` (a tensor, a tuple of positional tensors, or a dict of
    keyword tensors) and cut it before each split module; see the module doc.

    ``device``: where the units will run (default: where the model's tensors are, the CPU for
    a model on meta). A model may take other branches on other devices (transformers' MoE
    picks ``histc``'s dtype by device type), so a model on meta, or on a device of another
    type, is exported on fake tensors of ``device``: shapes only, no memory.
    ``inference_only``: one export, of ``eval()``, serving both modes (a model never trained)."""
    paths = split_points(model, split)
    refuse_gradient_hooks(model)
    hooked = forward_hooked(model, paths)
    _refuse_constants(example)
    target = _target_device(model, device)
    fakes = _needs_fakes(model, target)
    if fakes:
        _check_present(target)
    source = (model, example, split, dynamic)
    args, kwargs = (
        ((), dict(example))
        if isinstance(example, dict)
        else (example if isinstance(example, tuple) else (example,), {})
    )
    kept = [
        name
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward
    ]
    kept += [name for name in hooked if name not in kept]
    was_training = {m: m.training for m in model.modules()}  # each module's, kept as it is
    exported = {}
    try:
        for mode in (False,) if inference_only else (True, False):
            model.train(mode)
            exported[mode] = _cut_in_mode(
                model, (args, kwargs), dynamic, target if fakes else None, paths, (kept, hooked)
            )
    finally:
        for m, mode in was_training.items():
            m.training = mode
    train, evaluate = exported.get(True, exported[False]), exported[False]
    if [p.name for p in train] != [p.name for p in evaluate]:
        raise CaptureError(
            "train() and eval() capture cut the model differently: "
            f"{[p.name for p in train]} vs {[p.name for p in evaluate]}"
        )
    captured = units_of(model, paths, train, evaluate, target)
    captured.source, captured.inference_only = source, inference_only
    captured.train(model.training)
    for m, mode in was_training.items():  # the kept modules are the model's: as they were
        m.training = mode
    return captured


def _refuse_constants(example: Any) -> None:
    path_leaves, _ = pytree.tree_flatten_with_path(example)
    constants = [
        f"{pytree.keystr(path)}={leaf!r}"
        for path, leaf in path_leaves
        if not isinstance(leaf, torch.Tensor)
    ]
    if constants:
        raise CaptureError(
            f"the example holds values that are not tensors: {', '.join(constants)}; the "
            "inputs are split into micro-batches and carried between stages, so pass tensors "
            "only, and set options on the model instead (e.g. model.config.output_attentions)"
        )


def _cut_in_mode(
    model: nn.Module,
    inputs: tuple[tuple, dict],
    dynamic: bool,
    fake_device: torch.device | None,
    paths: list[str],
    calls: tuple[list[str], list[str]],
) -> list[Piece]:
    """The model exported in its current mode, the modules of ``calls`` (batch norms, and
    those with forward hooks) kept as calls, cut at ``paths``."""
    args, kwargs = inputs
    program = _export(model, args, kwargs, dynamic, fake_device)
    gm = program.graph_module
    specs = program.graph_signature.input_specs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, specs, strict=True):
        node.meta["gpipe_attr"] = spec.kind != InputKind.USER_INPUT
    keep_as_calls(gm, model, *calls)
    return cut_graph(program, gm, model, paths, _sources(model, args, kwargs))


def fit_devices(
    captured: CapturedModel, devices: Sequence[torch.device], local: Sequence[int]
) -> None:
    """Make each unit of ``local`` run the graph captured for its device's type (``devices``:
    every unit's device). Units captured for another type take the graphs of a capture for
    theirs (on fake tensors: no memory). Where adjacent units run on devices of different
    types, both captures must carry the same values across their cut, else CaptureError."""
    captured_for = captured[0].capture_device
    others = {d.type: d for d in devices if d.type != captured_for.type}
    if not others:
        return
    if captured.source is None:
        raise CaptureError(
            f"the units were captured for {captured_for} and would run on "
            f"{', '.join(map(str, others.values()))}; capture them there: "
            f"capture(model, example, device=...)"
        )
    model, example, split, dynamic = captured.source
    by_type = {captured_for.type: captured}
    for kind, device in others.items():
        by_type[kind] = capture(
            model, example, split=split, dynamic=dynamic, device=device,
            inference_only=captured.inference_only,
        )  # fmt: skip
        names = [u.unit_name for u in by_type[kind]]
        if names != [u.unit_name for u in captured]:
            raise CaptureError(
                f"the model cuts into other units on {kind} than on {captured_for.type}: "
                f"{names} vs {[u.unit_name for u in captured]}; put every stage on one device type"
            )
    for i in range(len(devices) - 1):
        a, b = devices[i].type, devices[i + 1].type
        if a != b and by_type[a][i].boundary("out") != by_type[b][i + 1].boundary("in"):
            raise CaptureError(
                f"the model carries other values across the cut before "
                f"{captured[i + 1].unit_name!r} on {a} than on {b} (its forward depends on the "
                f"device type), so units {i} on {devices[i]} and {i + 1} on {devices[i + 1]} "
                "cannot be joined; put both on one device type, or cut elsewhere"
            )
    for i in local:
        if devices[i].type != captured_for.type:
            captured[i].use_graphs(by_type[devices[i].type][i])


def _target_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    real = [t.device for t in [*model.parameters(), *model.buffers()] if not t.is_meta]
    return real[0] if real else torch.device("cpu")


def _check_present(device: torch.device) -> None:
    """Fake tensors of a device type this PyTorch cannot run abort the process: refuse."""
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    present = getattr(backend, "is_available", lambda: False)()
    count = getattr(backend, "device_count", lambda: 0)() if present else 0
    if not present or (device.index is not None and device.index >= count):
        raise CaptureError(
            f"cannot capture for {device}: this machine's PyTorch has "
            f"{count} {device.type} device(s); pass devices it has (e.g. devices=['cpu'])"
        )


def _needs_fakes(model: nn.Module, target: torch.device) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.is_meta or t.device.type != target.type for t in tensors)


def _sources(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """Export's name of each input, in the order of the flat inputs: ``L['input_ids']``."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    paths, _ = pytree.tree_flatten_with_path(dict(bound))
    names = {id(leaf): "L" + pytree.keystr(path) for path, leaf in paths}
    return [names.get(id(leaf), "") for leaf in pytree.tree_leaves((args, kwargs))]


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic: bool, fake: torch.device | None):
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    dims = pytree.tree_map(
        lambda t: {d: Dim.AUTO for d in range(t.dim())} if isinstance(t, torch.Tensor) else None,
        dict(bound),
    )
    with _no_cache(model), _no_stack_traces(), _on_fakes(model, fake) as as_fake:
        args, kwargs = pytree.tree_map(as_fake, (args, kwargs))
        try:
            return export(
                model, args, kwargs, dynamic_shapes=dims if dynamic else None, strict=False
            )
        except Exception as error:
            raise CaptureError(_explain(model, error)) from error


@contextmanager
def _on_fakes(model: nn.Module, device: torch.device | None):
    """While exporting: the model's tensors as fake tensors on ``device`` (shapes, no memory;
    None: as they are), so that its forward takes the branches it takes there. Yields the
    conversion for the example's tensors."""
    if device is None:
        yield lambda x: x
        return
    mode = FakeTensorMode()
    made: dict[int, torch.Tensor] = {}

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in made:
            shape = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            value = FakeTensor(mode, shape, device)
            made[id(t)] = (
                nn.Parameter(value, t.requires_grad) if isinstance(t, nn.Parameter) else value
            )
        return made[id(t)]

    saved = []  # (table, key, tensor): registered tensors and plain tensor attributes
    for module in model.modules():
        for table in (module._parameters, module._buffers, vars(module)):
            saved += [(table, k, t) for k, t in table.items() if isinstance(t, torch.Tensor)]
    for table, key, t in saved:
        table[key] = fake(t)
    try:
        yield fake
    finally:
        for table, key, t in saved:
            table[key] = t


@contextmanager
def _no_stack_traces():
    """Export records the Python stack of every node it makes (~10% of its time); nothing here
    reads those traces (``_explain`` names the module from the exception's own traceback)."""
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved


@contextmanager
def _no_cache(model: nn.Module):
    """Hugging Face models return a key-value cache for generation; training has none.
    Sub-models may hold configs of their own (an encoder-decoder's decoder stack)."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    saved = {key: c.use_cache for key, c in configs.items() if getattr(c, "use_cache", False)}
    for key in saved:
        configs[key].use_cache = False
    try:
        yield
    finally:
        for key, value in saved.items():
            configs[key].use_cache = value


def _explain(model: nn.Module, error: Exception) -> str:
    names = {id(m): name for name, m in model.named_modules()}
    where = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            where = (names[id(owner)] or "the model", type(owner).__name__, frame.f_code.co_name)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    place = f" in {where[0]} ({where[1]}.{where[2]})" if where else ""
    return (
        f"torch.export could not capture {type(model).__name__}{place}: "
        f"{type(error).__name__}: {first}\n"
        "remedies: cut so that this module runs inside one unit (split= at other modules), "
        "wrap the offending code in a module that export can trace, or pass the model's "
        "inputs as tensors only (no Python values that change between steps)"
    )


def _check_known(model: nn.Module, modules: dict[str, nn.Module], paths: list[str]) -> None:
    unknown = [p for p in paths if p not in modules]
    if unknown:
        close = {p: difflib.get_close_matches(p, list(modules), n=3) for p in unknown}
        raise CaptureError(
            f"split names {unknown} that are not modules of {type(model).__name__}"
            + "".join(f"; close to {p!r}: {c}" for p, c in close.items() if c)
            + f"; {_hint(model)}"
        )


def _hint(model: nn.Module) -> str:
    lists = [
        f"{name} ({len(m)} blocks)"
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList | nn.Sequential) and name
    ]
    return "candidates: " + (", ".join(lists[:8]) if lists else "the model's children")
