"""Decoding through the pipeline with a key-value cache, for :mod:`gpipe.train.generation`.

The window's pipe cannot hold a cache: its captured stages take the model's token ids. So a
second capture, of a decode step: :class:`DecodeStep` wraps the Hugging Face causal LM with
transformers' own ``StaticCache`` of ``rows`` x ``length`` positions, its keys and values
registered as buffers (as transformers' ``TorchExportableModuleWithStaticCache`` does for
``torch.export``). Its forward takes ``input_ids`` (rows, n) and ``position`` (rows,: the
first token's), writes the new keys and values in place and returns the logits. It is
captured (its ``eval()`` graph only) and cut before the window pipe's blocks, with its
balance: layer i's cache is read and written by layer i's unit only, so each stage holds (and
allocates) the cache of its own layers. Two captures share the cache and hold the window
pipe's own weight tensors: one for the prompt at once, one for each new token.

Where the cache cannot be exact (no cache in the model, adapters, sharded or interleaved
stages, autocast, more tokens than the window, a cache that slides or that the forward
ignores), :func:`why_not` or a ``CaptureError`` says why, and generation runs the whole window
per token as before."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from gpipe.frontend import CaptureError, capture, origin_of
from gpipe.pipe import Pipe
from gpipe.pipe.assembly import capture_device

__all__ = ["DecodeStep", "Decoder", "decoder", "why_not"]

_PREFIX = "model."  # the wrapped model's names in the decode step
_CACHES = ("key_cache_", "value_cache_")  # the cache's buffers


class DecodeStep(nn.Module):
    """One decode step of ``model`` with a static key-value cache as buffers."""

    def __init__(self, model: nn.Module, rows: int, length: int) -> None:
        super().__init__()
        from transformers.cache_utils import StaticCache, StaticLayer

        self.model = model
        config = model.config.get_text_config()
        self.cache = StaticCache(config=config, max_cache_len=length)
        other = {type(layer).__name__ for layer in self.cache.layers} - {StaticLayer.__name__}
        if other:  # a sliding window's layers roll their tensors: not one position per token
            raise CaptureError(f"the model's cache has {', '.join(sorted(other))} layers")
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        weight = next(model.parameters())
        self.cache.early_initialization(rows, heads, size, weight.dtype, weight.device)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)

    def forward(self, input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):
            # the buffers as the capture sees them (fake or materialized, not on meta where
            # the step was built), and the position of the new token (not the cache's own
            # count, which no stage would hold)
            layer.keys, layer.device = getattr(self, f"key_cache_{i}"), position.device
            layer.values = getattr(self, f"value_cache_{i}")
            layer.cumulative_length = position[0].clone()
        positions = position[:1, None] + torch.arange(input_ids.shape[1], device=position.device)
        out = self.model(input_ids=input_ids, position_ids=positions, cache=self.cache,
                         use_cache=True)  # fmt: skip
        return out.logits

    def check(self, rows: int) -> None:
        """Raise CaptureError unless a step (on meta: no compute) writes every layer's cache,
        so that a model that takes ``cache=`` but ignores it is never decoded from a cache
        that stays empty."""
        ids = torch.zeros(rows, 1, dtype=torch.int64, device="meta")
        caches = [b for name, b in self.named_buffers() if name.startswith(_CACHES)]
        before = [b._version for b in caches]
        with torch.no_grad():
            self(ids, torch.zeros(rows, dtype=torch.int64, device="meta"))
        if any(b._version == v for b, v in zip(caches, before, strict=True)):
            raise CaptureError("the model's forward does not write transformers' cache=")


def why_not(pipe: Pipe, task: Any, *, length: int, window: int) -> str | None:
    """Why ``task``'s model on ``pipe`` decodes without a cache (None: it can use one);
    the same on every rank. ``length``: prompt and new tokens."""
    source = task.model
    if getattr(source, "kind", None) != "hf":
        return f"gpipe's {getattr(source, 'kind', 'own')} model has no key-value cache"
    if source.family != "causal-lm":
        return f"a {source.family} model is decoded without its cache"
    if source.args.get("lora"):
        return "LoRA adapters (the cached step is captured without them)"
    layout = pipe.layout
    if layout.shard or layout.virtual_stages != 1:
        return "sharded or interleaved stages"
    if length > window:
        return f"prompt and new tokens ({length}) exceed the window ({window}), which slides"
    if any(torch.is_autocast_enabled(d.type) for d in pipe.devices):
        return "autocast computes keys and values in another dtype than the weights'"
    return None


class Decoder:
    """The step's pipes by tokens per call (1: a new token; the prompt's length: the prompt,
    the cache and weights shared): ``decoder(tokens, start)`` feeds ``tokens`` (rows, n), the
    first at position ``start``, and gives the last one's logits (rows, vocab) on the last
    stage (None elsewhere); n without its own pipe goes token by token."""

    def __init__(self, pipes: dict[int, Pipe]) -> None:
        self.pipes = pipes

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor | None:
        n = tokens.shape[1]
        calls = [(tokens, start)] if n in self.pipes else [
            (tokens[:, i : i + 1], start + i) for i in range(n)
        ]  # fmt: skip
        out = None
        for part, first in calls:
            position = torch.full((part.shape[0],), first, dtype=torch.int64)
            out = self.pipes[part.shape[1]]({"input_ids": part, "position": position})
        return None if out is None else out[:, -1, :]

    @property
    def pipe(self) -> Pipe:
        return self.pipes[1]


def decoder(pipe: Pipe, task: Any, *, rows: int, length: int, prompt: int = 1) -> Decoder:
    """The decode step of ``task``'s model captured and cut as ``pipe`` is, for one token and
    for ``prompt`` tokens, holding ``pipe``'s weights (the same tensors) and an empty cache of
    ``rows`` x ``length``; collective over the pipeline. Raises ``CaptureError`` where the
    step cannot be captured."""
    source = task.model
    previous = torch.get_default_dtype()
    torch.set_default_dtype(task.dtype)
    try:
        with torch.device("meta"):
            step = DecodeStep(source.build(), rows, length)
        step.check(rows)
    except (AttributeError, TypeError, ValueError) as error:  # not a model with this cache
        raise CaptureError(f"{type(error).__name__}: {error}") from error
    finally:
        torch.set_default_dtype(previous)
    _adopt(step, pipe)
    pipes = {n: _captured(step, pipe, source.split(step.model), rows, n) for n in {1, prompt}}
    for n, captured in pipes.items():
        _fill(captured, pipe)
        if n != 1:
            _share_cache(pipes[1], captured)
        captured.eval()
    return Decoder(pipes)


def _adopt(step: DecodeStep, pipe: Pipe) -> None:
    """The step's model (on meta) takes this rank's tensors of ``pipe``, under the model's
    names, ties kept: the captured steps hold them, and none is made to be replaced."""
    held = {**dict(pipe.named_parameters()), **dict(pipe.named_buffers())}
    taken: dict[int, torch.Tensor] = {}
    for path, module in step.model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                real = held.get(f"{path}.{key}" if path else key, taken.get(id(tensor)))
                if tensor is not None and real is not None:
                    taken[id(tensor)] = table[key] = real


def _fill(captured: Pipe, pipe: Pipe) -> None:
    """``captured`` holds ``pipe``'s tensors (checked: each of its names is one of
    ``pipe``'s), and an empty cache."""
    weights = pipe.state_dict()
    buffers = dict(pipe.named_buffers())  # and those outside the state dict (rotary tables)
    known = {*weights, *buffers}
    names = [*captured.state_dict(), *dict(captured.named_buffers())]
    missing = [
        n for n in names if not n.startswith(_CACHES) and n.removeprefix(_PREFIX) not in known
    ]
    if missing:
        raise CaptureError(f"the decode step holds {missing[:4]}, which the window's pipe does not")
    own = captured.state_dict()
    captured.load_state_dict({k: weights[k.removeprefix(_PREFIX)] for k in own}, assign=True)
    with torch.no_grad():
        for name, buffer in captured.named_buffers():
            if name.startswith(_CACHES):
                buffer.zero_()  # the cache starts empty
            elif buffer is not buffers[name.removeprefix(_PREFIX)]:
                buffer.copy_(buffers[name.removeprefix(_PREFIX)])


def _captured(step: DecodeStep, pipe: Pipe, split: list[str], rows: int, tokens: int) -> Pipe:
    """The step for ``tokens`` per call as a Pipe cut as ``pipe`` is (``Pipe.from_model``'s
    steps, its eval() graph only: it is never trained), on meta but for its cache."""
    example = {
        "input_ids": torch.zeros(rows, tokens, dtype=torch.int64),
        "position": torch.zeros(rows, dtype=torch.int64),
    }
    devices = pipe.devices if pipe.group is None else None
    step, origin = origin_of(step, None, 0)
    device = capture_device(devices, pipe.group)
    captured = capture(step, example, split=[_PREFIX + p for p in split], device=device,
                       inference_only=True)  # fmt: skip
    captured.origin = origin
    layout = replace(pipe.layout, chunks=1, schedule="gpipe", replicas=1, shard=None)
    with warnings.catch_warnings():  # one micro-batch: a token goes through stage by stage
        warnings.filterwarnings("ignore", message=r"Pipe\(chunks=1\)")
        return Pipe(
            captured, tied=captured.tied, balance=pipe.balance, layout=layout, group=pipe.group,
            timeout=pipe.timeout, devices=devices,
            transport=pipe.transport if pipe.transport != "local" else "auto",
        )  # fmt: skip


def _share_cache(source: Pipe, target: Pipe) -> None:
    """``target``'s units hold ``source``'s cache tensors (the units are cut alike)."""
    for mine, theirs in zip(source.stages, target.stages, strict=True):
        for unit, other in zip(mine.layers, theirs.layers, strict=True):
            for name, buffer in unit.named_buffers(recurse=False):
                if name.startswith(_CACHES):
                    other.register_buffer(name, buffer, persistent=False)
