"""Small reference models, written as ``nn.Sequential`` so that gpipe can cut them.

Used by the demo, the tests and the benchmarks; each layer of the Sequential is one
unit a stage boundary can fall between.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn
from torch.nn import functional as F

from gpipe.engine.skip import pop, stash

__all__ = ["GPTConfig", "convnet", "gpt", "gpt_tied_names", "mlp", "resnet", "unet"]


def mlp(widths: list[int], *, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers of the given widths with GELU (and dropout) between them."""
    layers: list[nn.Module] = []
    for i, (width_in, width_out) in enumerate(pairwise(widths)):
        layers.append(nn.Linear(width_in, width_out))
        if i < len(widths) - 2:
            layers.append(nn.GELU())
            if dropout:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    dropout: float = 0.1


class Embedding(nn.Module):
    """Token plus learned position embedding: ids (B, T) -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.token(ids) + self.position(positions))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.ln1 = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        attn_dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=attn_dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.resid_dropout(self.proj(y))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm and projection to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.out = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt(config: GPTConfig = GPTConfig(), *, tie_embeddings: bool = False) -> nn.Sequential:
    """A GPT-style language model: embedding, ``n_layers`` blocks, head (n_layers + 2 layers).

    With ``tie_embeddings`` the head's output projection is the token embedding (one
    tensor, initialized as in GPT-2): in a Pipe declare it with
    ``tied=[gpt_tied_names(config)]``.
    """
    model = nn.Sequential(
        Embedding(config), *(Block(config) for _ in range(config.n_layers)), Head(config)
    )
    if tie_embeddings:
        # The logits are then the embedding's rows against a unit-variance vector: at
        # nn.Embedding's N(0, 1) they would be ~sqrt(d_model) large and the first loss ~35,
        # not ln(vocab_size). GPT-2's std of 0.02 keeps them near zero.
        nn.init.normal_(model[0].token.weight, std=0.02)
        model[-1].out.weight = model[0].token.weight
    return model


def gpt_tied_names(config: GPTConfig) -> tuple[str, str]:
    """The whole-model names of the tied embedding and output weights of :func:`gpt`."""
    return ("0.token.weight", f"{config.n_layers + 1}.out.weight")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Residual(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm and a skip."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


def convnet(
    *, in_channels: int = 1, channels: int = 16, blocks: int = 2, classes: int = 10
) -> nn.Sequential:
    """A small ResNet-style CNN with batch norm: images (B, C, H, W) -> logits (B, classes)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        *(Residual(channels) for _ in range(blocks)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, classes),
    )


def resnet(
    *,
    widths: Sequence[int] = (32, 64, 128),
    blocks: int = 2,
    in_channels: int = 3,
    classes: int = 10,
) -> nn.Sequential:
    """A ResNet-style CNN that halves the resolution and doubles the width at each stage.

    Every residual block then costs about the same time while its parameters grow four
    times per stage: the usual case where balancing by parameter count goes wrong.
    (:func:`convnet` keeps one resolution and width throughout.)
    """

    def conv(c_in: int, c_out: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
        )

    layers: list[nn.Module] = [conv(in_channels, widths[0], 1)]
    for i, width in enumerate(widths):
        if i > 0:
            layers.append(conv(widths[i - 1], width, 2))  # (B, C, H, W) -> (B, 2C, H/2, W/2)
        layers += [Residual(width) for _ in range(blocks)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes)]
    return nn.Sequential(*layers)


# -- U-Net: long skip connections across stages ----------------------------------------------


def _conv(c_in: int, c_out: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(1, c_out), nn.GELU(), nn.Dropout(dropout)
    )


class UNetLevel(nn.Module):
    """One level of a U-Net, on the way down or up, joined to its twin by the skip ``skip``.

    Down: features are stashed as ``skip``, then the resolution halves. Up: the resolution
    doubles, then the features stashed as ``skip`` join. The skip name is per instance:
    gpipe reads ``gpipe_stashes``/``gpipe_pops`` from the module, which ``@skippable``
    sets on a class and this sets on each block.
    """

    def __init__(self, c_in: int, c_out: int, dropout: float, *, skip: str, down: bool) -> None:
        super().__init__()
        self.conv = _conv(c_in, c_out, dropout)
        self.skip, self.down = skip, down
        if down:
            self.gpipe_stashes = (skip,)
        else:
            self.gpipe_pops = (skip,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.down:
            x = self.conv(x)
            stash(self.skip, x)
            return F.max_pool2d(x, 2)
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(torch.cat([x, pop(self.skip)], dim=1))


def unet(*, in_channels: int = 1, channels: int = 8, classes: int = 3, dropout: float = 0.1):
    """A small U-Net for per-pixel classification: (B, C, H, W) -> (B, classes, H, W).

    Seven layers; the skip from layer 1 to layer 5 spans the middle of the network, so
    with balance [2, 2, 1, 2] it leaves stage 0 and arrives at stage 3 directly.
    """
    c = channels
    return nn.Sequential(
        _conv(in_channels, c, dropout),  # 0 stem
        UNetLevel(c, c, dropout, skip="skip1", down=True),  # 1
        UNetLevel(c, 2 * c, dropout, skip="skip2", down=True),  # 2
        _conv(2 * c, 2 * c, dropout),  # 3 bottleneck
        UNetLevel(4 * c, c, dropout, skip="skip2", down=False),  # 4
        UNetLevel(2 * c, c, dropout, skip="skip1", down=False),  # 5
        nn.Conv2d(c, classes, 1),  # 6 head
    )
