"""Model families for the capacity search: models that differ only in depth, and the
profile of any member extrapolated from one small member's.

GPipe's Table 1 grows a model by depth; so does :func:`gpipe.planner.capacity`. A
:class:`Family` builds a member of any depth (``gpt_family``: the GPT of ``gpipe.models`` by
``n_layers``; ``resnet_family``: the ResNet by ``blocks``); its blocks are identical, so a
deeper member's profile is a small one's with its blocks repeated (:func:`extrapolate`;
embedding, head, stem and classifier stay as they are), and :class:`FamilyCosts` measures the
small one once per micro-batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from gpipe.estimate.profile import Profile, profile

__all__ = ["Family", "FamilyCosts", "extrapolate", "gpt_family", "resnet_family"]


@dataclass(frozen=True)
class Family:
    """Models that differ only in depth: identical blocks between fixed layers.

    ``build(depth)`` makes the model; ``kinds(depth)`` names each of its layers' kind
    (layers of one kind are identical, e.g. ``["embedding", "block", "block", "head"]``);
    ``batch(n)`` gives ``n`` samples of (inputs, targets); ``loss_fn(output, target)``
    the loss. Everything is picklable (module-level functions and partials), so that
    :func:`gpipe.planner.verify_capacity` can send it to new processes.
    """

    name: str
    build: Callable[[int], nn.Sequential]
    kinds: Callable[[int], list[str]]
    batch: Callable[[int], tuple[Any, Any]]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batch_size: int  # samples per mini-batch, over all replicas
    profile_depth: int = 2  # the member profiled

    def describe(self, depth: int | None = None) -> str:
        at = "" if depth is None else f", depth {depth}"
        return f"{self.name}{at}, batch {self.batch_size}"


def _gpt_model(depth: int, *, d_model: int, heads: int, seq: int, vocab: int) -> nn.Sequential:
    from gpipe.models import GPTConfig, gpt

    # no dropout: its masks are memory the budget should not depend on a rate for
    config = GPTConfig(vocab, seq, d_model, heads, depth, dropout=0.0)
    return gpt(config)


def _gpt_kinds(depth: int) -> list[str]:
    return ["embedding", *["block"] * depth, "head"]


def _tokens(n: int, *, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, seq + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def gpt_family(*, d_model: int, heads: int, seq: int, vocab: int, batch: int) -> Family:
    """The GPT of ``gpipe.models`` by ``n_layers``, at a fixed width, context and vocabulary."""
    from gpipe.models import lm_loss

    return Family(
        name=f"GPT d_model {d_model}, {heads} heads, seq {seq}, vocab {vocab}",
        build=functools.partial(_gpt_model, d_model=d_model, heads=heads, seq=seq, vocab=vocab),
        kinds=_gpt_kinds,
        batch=functools.partial(_tokens, seq=seq, vocab=vocab),
        loss_fn=lm_loss,
        batch_size=batch,
    )


def _resnet_model(depth: int, *, channels: int, classes: int) -> nn.Sequential:
    from gpipe.models import resnet

    return resnet(widths=(channels, 2 * channels, 4 * channels), blocks=depth, classes=classes)


def _resnet_kinds(depth: int) -> list[str]:
    kinds = ["stem"]
    for level in range(3):
        if level:
            kinds.append(f"down{level}")
        kinds += [f"residual{level}"] * depth
    return [*kinds, "pool", "flatten", "classifier"]


def _images(n: int, *, image: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, image, image, generator=generator)
    return x, torch.randint(0, classes, (n,), generator=generator)


def resnet_family(*, channels: int, image: int, batch: int, classes: int = 10) -> Family:
    """The ResNet of ``gpipe.models`` by ``blocks`` (per resolution: depth d has 3·d blocks)."""
    from torch.nn import functional as F

    return Family(
        name=f"ResNet widths {channels}/{2 * channels}/{4 * channels}, {image}px",
        build=functools.partial(_resnet_model, channels=channels, classes=classes),
        kinds=_resnet_kinds,
        batch=functools.partial(_images, image=image, classes=classes),
        loss_fn=F.cross_entropy,
        batch_size=batch,
    )


def extrapolate(prof: Profile, kinds: Sequence[str], target: Sequence[str]) -> Profile:
    """The profile of a member whose layers have kinds ``target``, from the profile of one
    whose layers have kinds ``kinds``: each layer takes the measured costs of a layer of
    its kind (layers of a kind are identical, so any will do)."""
    if len(kinds) != len(prof.layers):
        raise ValueError(f"{len(kinds)} kinds for a profile of {len(prof.layers)} layers")
    of_kind = {kind: layer for kind, layer in zip(kinds, prof.layers, strict=True)}
    missing = sorted(set(target) - set(of_kind))
    if missing:
        raise ValueError(f"the profiled model has no layer of kind {missing}: profile a deeper one")
    layers = []
    for index, kind in enumerate(target):
        layer = of_kind[kind]
        layers.append(replace(layer, name=f"{index} {layer.name.partition(' ')[2]}"))
    return Profile(tuple(layers), prof.batch_size, prof.device)


@dataclass
class FamilyCosts:
    """A family's profiles by micro-batch size (measured once each) and parameter counts."""

    family: Family
    profiles: dict[int, Profile] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # parameters per layer, by kind

    def profile(self, samples: int) -> Profile:
        if samples not in self.profiles:
            torch.manual_seed(0)
            model = self.family.build(self.family.profile_depth)
            kinds = self.family.kinds(self.family.profile_depth)
            for kind, layer in zip(kinds, model, strict=True):
                self.counts[kind] = sum(p.numel() for p in layer.parameters())
            x, y = self.family.batch(samples)
            self.profiles[samples] = profile(
                model, x, "cpu", target=y, loss_fn=self.family.loss_fn, repeats=1, warmup=0
            )
        return self.profiles[samples]

    def at(self, depth: int, samples: int) -> Profile:
        small = self.profile(samples)
        family = self.family
        return extrapolate(small, family.kinds(family.profile_depth), family.kinds(depth))

    def parameters(self, depth: int) -> int:
        if not self.counts:  # counted by the first profile
            self.profile(1)
        return sum(self.counts[kind] for kind in self.family.kinds(depth))


def smallest_depth(family: Family, stages: int) -> int:
    """The shallowest member with a layer for each of ``stages`` stages."""
    depth = 1
    while len(family.kinds(depth)) < stages:
        depth += 1
    return depth
