"""The models ``gpipe train`` knows, one :class:`Task` each: presets, model, data, loss.

A task is everything the training loop must not branch on: how to build the model from its
spec, which data it reads, its loss and its unit of throughput. Adding a model to the main
job is adding a task to :data:`TASKS`; nothing else changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from gpipe.data import TokenWindows, digits, stdlib_corpus
from gpipe.models import GPTConfig, convnet, gpt
from gpipe.pipe import Pipe

__all__ = [
    "TASKS",
    "Data",
    "Digits",
    "HFLlama",
    "LanguageModel",
    "Task",
    "build_model",
    "constructor",
]


@dataclass
class Data:
    """What one rank reads: indexable sets giving ``(inputs, targets)`` for index tensors."""

    train: Any
    val: Any
    val_indices: torch.Tensor  # the fixed validation samples
    description: str


class Task:
    """One model of the main job. Subclasses fill in the class attributes and methods."""

    name: ClassVar[str]
    unit: ClassVar[str]  # what throughput counts: "tokens", "images"
    # size -> the model's shape (``model_keys``) and the training defaults that suit it
    presets: ClassVar[dict[str, dict[str, Any]]]
    model_keys: ClassVar[tuple[str, ...]]
    deferred_batch_norm: ClassVar[bool] = False
    writes_text: ClassVar[bool] = False  # the job samples text from it at the end
    classifies: ClassVar[bool] = False  # validation reports accuracy (see ``correct``)

    def spec_args(self, seq: int, model_args: dict[str, Any]) -> dict[str, Any]:
        """The constructor arguments of the model (saved with every checkpoint)."""
        raise NotImplementedError

    def build(self, args: dict[str, Any]) -> nn.Sequential:
        raise NotImplementedError

    def units(self, args: dict[str, Any]) -> int:
        """What ``--balance`` counts: the layers of the Sequential ``build`` returns."""
        with torch.device("meta"):
            return len(self.build(args))

    def pipe(self, args: dict[str, Any], **options: Any) -> Pipe:
        """The model as a Pipe, each rank building only its own layers."""
        return Pipe(functools.partial(self.build, args), **options)

    def logits(self, output: Any) -> torch.Tensor:
        """The tensor of scores in the model's output (for sampling text)."""
        return output

    def constructor(self, args: dict[str, Any]) -> str:
        """Python code that builds the plain model, for ``gpipe export``."""
        raise NotImplementedError

    def problems(self, given: dict[str, Any]) -> list[str]:
        """What cannot run with these command-line options (before any process starts)."""
        return []

    def prepare(self) -> Any:
        """Once, before the ranks start: returns what they are handed (or None)."""
        return None

    def data(self, *, seq: int, batch: int, eval_batches: int, prepared: Any) -> Data:
        raise NotImplementedError

    def samples(self, seq: int) -> int:
        """Units of throughput per sample."""
        return 1

    # The options that size a micro-batch's activations, named when they cannot fit.
    size_options: ClassVar[tuple[str, ...]] = ("batch",)

    def activation_floor(self, args: dict[str, Any], micro_batch: int) -> tuple[int, str]:
        """A lower bound of the bytes that one micro-batch of ``micro_batch`` samples needs
        in the model's largest layer, and what they are: no cut, schedule or
        re-materialization brings a rank below it."""
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), target)

    def count(self, target: torch.Tensor) -> float:
        """What ``loss`` averages over in a micro-batch (``Pipe.step(count=...)``)."""
        return len(target)

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> int:
        """Correctly classified samples (a task that ``classifies``)."""
        return 0


class LanguageModel(Task):
    """A byte-level GPT on the Python standard library's source (``gpipe.data``)."""

    name, unit = "gpt", "tokens"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(
            d_model=32, n_heads=2, n_layers=2, dropout=0.1,
            seq=32, batch=8, steps=40, lr=3e-3, warmup=5, eval_every=20, save_every=20,
        ),
        # the default run: a few minutes on 2 CPU cores, the loss falling from ~5.5 to ~2
        "small": dict(
            d_model=128, n_heads=4, n_layers=4, dropout=0.0,
            seq=64, batch=16, steps=500, lr=3e-3, warmup=20, eval_every=50, save_every=100,
        ),
        "base": dict(
            d_model=256, n_heads=8, n_layers=8, dropout=0.1,
            seq=128, batch=32, steps=2000, lr=1e-3, warmup=100, eval_every=200, save_every=500,
        ),
    }  # fmt: skip
    model_keys = ("d_model", "n_heads", "n_layers", "dropout")
    writes_text = True

    def spec_args(self, seq: int, model_args: dict[str, Any]) -> dict[str, Any]:
        return dict(vocab_size=256, context=seq, **model_args)

    def build(self, args: dict[str, Any]) -> nn.Sequential:
        return gpt(GPTConfig(**args))

    def units(self, args: dict[str, Any]) -> int:
        # gpt(): the embedding, n_layers blocks, the head. Not built (even on the meta
        # device, the first build loads torch's meta kernels: seconds before any refusal).
        return args["n_layers"] + 2

    def constructor(self, args: dict[str, Any]) -> str:
        return f"gpipe.models.gpt(gpipe.models.GPTConfig({_call_args(args)}))"

    def prepare(self) -> None:
        stdlib_corpus()  # built and cached once here, so that the ranks only read it

    def data(self, *, seq: int, batch: int, eval_batches: int, prepared: Any) -> Data:
        corpus = stdlib_corpus()
        val = TokenWindows(corpus.val, seq=seq)
        return Data(
            train=TokenWindows(corpus.train, seq=seq),
            val=val,
            val_indices=val.evenly_spaced(eval_batches * batch),
            description=corpus.describe(),
        )

    def samples(self, seq: int) -> int:
        return seq

    size_options = ("seq", "batch")

    def activation_floor(self, args: dict[str, Any], micro_batch: int) -> tuple[int, str]:
        # Attention holds its scores and their softmax, (B, heads, T, T) each, in float32.
        seq, heads = args["context"], args["n_heads"]
        scores = micro_batch * heads * seq * seq * 4 * 2
        return scores, f"{micro_batch} x {heads} heads x {seq}^2 attention scores and softmax"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float().flatten(0, 1), target.flatten(), ignore_index=-100)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != -100).sum()  # a token mean: exact also where targets are padded


class Digits(Task):
    """A small ResNet with deferred batch norm on scikit-learn's 8x8 digits."""

    name, unit = "resnet", "images"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(
            channels=8, blocks=2, batch=32, steps=40, lr=3e-3, warmup=5, eval_every=20,
            save_every=20,
        ),
        "small": dict(
            channels=16, blocks=4, batch=64, steps=300, lr=3e-3, warmup=20, eval_every=50,
            save_every=100,
        ),
        "base": dict(
            channels=32, blocks=8, batch=128, steps=1000, lr=2e-3, warmup=50, eval_every=100,
            save_every=250,
        ),
    }  # fmt: skip
    model_keys = ("channels", "blocks")
    deferred_batch_norm = classifies = True

    def spec_args(self, seq: int, model_args: dict[str, Any]) -> dict[str, Any]:
        return dict(in_channels=1, classes=10, **model_args)

    def build(self, args: dict[str, Any]) -> nn.Sequential:
        return convnet(**args)

    def constructor(self, args: dict[str, Any]) -> str:
        return f"gpipe.models.convnet({_call_args(args)})"

    def problems(self, given: dict[str, Any]) -> list[str]:
        found = []
        if "seq" in given:
            found.append("--seq applies to --model gpt only")
        try:
            import sklearn  # noqa: F401
        except ImportError:
            found.append(
                "--model resnet trains on scikit-learn's digits: pip install 'gpipe[digits]'"
            )
        return found

    def prepare(self) -> Any:
        return digits()  # small: handed to the ranks, which then need not import scikit-learn

    def data(self, *, seq: int, batch: int, eval_batches: int, prepared: Any) -> Data:
        images = prepared if prepared is not None else digits()
        return Data(
            train=_Pairs(images.train_images, images.train_labels),
            val=_Pairs(images.val_images, images.val_labels),
            val_indices=torch.arange(len(images.val_labels)),
            description=images.describe(),
        )

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> int:
        return int((output.argmax(-1) == target).sum())

    def activation_floor(self, args: dict[str, Any], micro_batch: int) -> tuple[int, str]:
        # A convolution's output: (B, channels, 8, 8) float32, its input as large.
        channels = args["channels"]
        return micro_batch * channels * 64 * 4 * 2, (
            f"{micro_batch} x {channels} channels x 8 x 8 of a convolution's input and output"
        )


class HFLlama(LanguageModel):
    """A Hugging Face Llama (random, byte-level) on the same corpus, pipelined as it is:
    ``Pipe.from_model`` captures its own forward and cuts it between its decoder layers."""

    name = "hf-llama"
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        size: {
            **{k: v for k, v in preset.items() if k not in LanguageModel.model_keys},
            "hidden_size": preset["d_model"], "heads": preset["n_heads"],
            "n_layers": preset["n_layers"],
        }
        for size, preset in LanguageModel.presets.items()
    }  # fmt: skip
    model_keys = ("hidden_size", "heads", "n_layers")

    def spec_args(self, seq: int, model_args: dict[str, Any]) -> dict[str, Any]:
        h, heads = model_args["hidden_size"], model_args["heads"]
        return dict(
            vocab_size=256, max_position_embeddings=seq, hidden_size=h,
            intermediate_size=8 * h // 3 // 16 * 16 or 16, num_hidden_layers=model_args["n_layers"],
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
            tie_word_embeddings=False,
        )  # fmt: skip

    def build(self, args: dict[str, Any]) -> nn.Module:
        import transformers

        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**args))

    def units(self, args: dict[str, Any]) -> int:
        return args["num_hidden_layers"] + 2  # embedding (and rotary, mask), blocks, head

    def activation_floor(self, args: dict[str, Any], micro_batch: int) -> tuple[int, str]:
        shape = {"context": args["max_position_embeddings"], "n_heads": args["num_attention_heads"]}
        return super().activation_floor(shape, micro_batch)

    def pipe(self, args: dict[str, Any], **options: Any) -> Pipe:
        example = torch.zeros(2, args["max_position_embeddings"], dtype=torch.int64)
        return Pipe.from_model(
            functools.partial(self.build, args), (example,), split="model.layers",
            **options,
        )  # fmt: skip

    def constructor(self, args: dict[str, Any]) -> str:
        return f"transformers.LlamaForCausalLM(transformers.LlamaConfig({_call_args(args)}))"

    def problems(self, given: dict[str, Any]) -> list[str]:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return ["--model hf-llama needs Hugging Face transformers: pip install 'gpipe[hf]'"]
        return []

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return super().loss(output.logits, target)

    def logits(self, output: Any) -> torch.Tensor:
        return output.logits


TASKS: dict[str, Task] = {task.name: task for task in (LanguageModel(), Digits(), HFLlama())}


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The plain (un-split) model of a checkpoint's spec ``{"kind": ..., "args": {...}}``."""
    if spec["kind"] not in TASKS:
        raise ValueError(f"unknown model kind {spec['kind']!r}; known: {sorted(TASKS)}")
    return TASKS[spec["kind"]].build(spec["args"])


def constructor(spec: dict[str, Any]) -> str:
    """Python code that builds the plain model of ``spec``."""
    return TASKS[spec["kind"]].constructor(spec["args"])


def _call_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


class _Pairs:
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]
