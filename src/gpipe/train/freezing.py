"""``gpipe train --freeze PATTERNS``: parameters whose whole-model name (as the exported state
dict names it, ``1.qkv.weight``, ``model.layers.0.mlp.up_proj.weight``) matches one of the
comma-separated ``fnmatch`` patterns are frozen: ``requires_grad`` False on every rank that
holds them (each rank applies the same patterns to its own), and left out of the optimizer.
The library's step leaves them without gradients, and trains the rest exactly."""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

__all__ = ["freeze", "patterns"]


def patterns(spec: str | None) -> list[str]:
    return [p.strip() for p in (spec or "").split(",") if p.strip()]


def freeze(named: list[tuple[str, nn.Parameter]], spec: str | None) -> list[str]:
    """Freeze the parameters of ``named`` (this rank's) that ``spec`` matches; their names."""
    chosen = patterns(spec)
    frozen = [n for n, p in named if any(fnmatchcase(n, pattern) for pattern in chosen)]
    for name, parameter in named:
        if name in frozen:
            parameter.requires_grad_(False)
    return frozen
