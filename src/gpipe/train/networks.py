"""Where the main job's model comes from: one :class:`ModelSource` per kind of model.

A source builds the plain model from its arguments (the ``args`` of the spec saved in every
checkpoint, ``{"kind": ..., "args": ...}``), builds it as a ``Pipe`` of which each rank holds
only its own layers, and knows what the model returns. gpipe's own GPT and CNN are here; any
Hugging Face model is :class:`gpipe.train.hf.HFModel`.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
from torch import nn

from gpipe.models import GPTConfig, convnet, gpt
from gpipe.pipe import Pipe

__all__ = ["ConvNet", "GPT", "ModelSource", "call_args"]


class ModelSource:
    """A kind of model; ``args`` are what builds it (JSON, saved with every checkpoint)."""

    kind: ClassVar[str]
    family: str  # what it learns: an objective of gpipe.train.objectives
    deferred_batch_norm: ClassVar[bool] = False

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args

    @property
    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "args": self.args}

    def build(self) -> nn.Module:
        """The plain model, freshly initialized, in torch's default dtype."""
        raise NotImplementedError

    def units(self) -> int:
        """What ``--balance`` counts: the layers (units) of the pipelined model."""
        raise NotImplementedError

    def pipe(
        self, example: Any, *, weights: str | None = None, inference_only: bool = False,
        **options: Any,
    ) -> Pipe:  # fmt: skip
        """The model as a Pipe, each rank building only its own layers (from ``weights``, a
        ``save_pretrained`` folder, where given); ``inference_only``: a captured model's
        ``eval()`` graph only (``Pipe.from_model``'s), nothing to a model built by layers."""
        return Pipe(functools.partial(self.build), **options)

    def logits(self, output: Any) -> torch.Tensor:
        return output

    def aux_loss_coef(self) -> float | None:
        """The weight of the auxiliary loss the model's output carries (a mixture of
        experts' load balancing, ``gpipe.losses.auxiliary_loss``); None: it has none."""
        return None

    def constructor(self) -> str:
        """Python code that builds the plain model, for ``gpipe export``."""
        raise NotImplementedError

    def problems(self, *, seq: int, vocab: int, pretrained: bool = False) -> list[str]:
        """What cannot run with ``seq`` tokens per sample from a tokenizer of ``vocab`` ids
        (``pretrained``: from the folder's weights, whose shapes are fixed)."""
        return []

    def activation_floor(self, micro_batch: int, seq: int) -> tuple[int, str]:
        """A lower bound of the bytes one micro-batch of ``seq`` tokens (language models)
        needs in the model's largest layer, and what they are: no cut, schedule or
        re-materialization brings a rank below it."""
        return 0, "nothing"


class GPT(ModelSource):
    """gpipe's GPT (``gpipe.models.gpt``): args are :class:`gpipe.models.GPTConfig`'s."""

    kind, family = "gpt", "causal-lm"

    def build(self) -> nn.Module:
        return gpt(GPTConfig(**self.args))

    def units(self) -> int:
        # gpt(): the embedding, n_layers blocks, the head. Not built (even on the meta
        # device, the first build loads torch's meta kernels: seconds before any refusal).
        return self.args["n_layers"] + 2

    def constructor(self) -> str:
        return f"gpipe.models.gpt(gpipe.models.GPTConfig({call_args(self.args)}))"

    def activation_floor(self, micro_batch: int, seq: int) -> tuple[int, str]:
        return attention_floor(micro_batch, self.args["n_heads"], self.args["context"])


class ConvNet(ModelSource):
    """gpipe's ResNet-style CNN with batch norm (``gpipe.models.convnet``)."""

    kind, family, deferred_batch_norm = "convnet", "classify", True

    def build(self) -> nn.Module:
        return convnet(**self.args)

    def units(self) -> int:
        with torch.device("meta"):
            return len(self.build())

    def constructor(self) -> str:
        return f"gpipe.models.convnet({call_args(self.args)})"

    def activation_floor(self, micro_batch: int, seq: int) -> tuple[int, str]:
        # A convolution's output: (B, channels, 8, 8) float32, its input as large.
        channels = self.args["channels"]
        return micro_batch * channels * 64 * 4 * 2, (
            f"{micro_batch} x {channels} channels x 8 x 8 of a convolution's input and output"
        )


def attention_floor(micro_batch: int, heads: int, seq: int) -> tuple[int, str]:
    # Attention holds its scores and their softmax, (B, heads, T, T) each, in float32.
    scores = micro_batch * heads * seq * seq * 4 * 2
    return scores, f"{micro_batch} x {heads} heads x {seq}^2 attention scores and softmax"


def call_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())
