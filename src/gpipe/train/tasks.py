"""What one run trains: a :class:`Task` is a model source, an objective and a data source.

Every run takes the same path: the model from a :class:`~gpipe.train.networks.ModelSource`
(gpipe's GPT or CNN, or any Hugging Face model: :class:`~gpipe.train.hf.HFModel`), its
objective by the model's family (:mod:`gpipe.train.objectives`), its data from
:mod:`gpipe.train.sources` (the user's files, or the built-in data). The built-in models are
recipes (:data:`RECIPES`): presets, and which source of each kind they take by default; any
other ``--model`` is a Hugging Face folder or ``config.json`` (:data:`HF_FOLDER`).

    gpipe train --model gpt                            # GPT on the stdlib's source, bytes
    gpipe train --model gpt --data notes.txt           # the same GPT on your text
    gpipe train --model ./my-qwen --data train.jsonl   # fine-tune your checkpoint
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpipe.losses import auxiliary_loss, warn_per_microbatch
from gpipe.pipe import Pipe
from gpipe.train.hf import HFModel, decoder_start
from gpipe.train.networks import GPT, ConvNet, ModelSource
from gpipe.train.objectives import OBJECTIVES, MaskedLM, Objective, Seq2Seq
from gpipe.train.sources import DigitsData, Files, Stdlib, TextData
from gpipe.train.tokenizers import BYTES, has_tokenizer

__all__ = [
    "HF_FOLDER",
    "RECIPES",
    "SOURCES",
    "Data",
    "Recipe",
    "Task",
    "build_model",
    "constructor",
    "sized_rates",
    "recipe_of",
    "source_of",
    "task_of",
]


@dataclass
class Data:
    """What one rank reads: indexable sets of samples, for :meth:`Task.batch`."""

    train: Any
    val: Any
    val_indices: torch.Tensor  # the fixed validation samples
    description: str


@dataclass(frozen=True)
class Recipe:
    """A kind of ``--model``: its presets (by ``--size``: the model's shape, ``model_keys``,
    and the training defaults that suit it), how its source is made from the resolved model
    arguments, and its data when no ``--data`` is given."""

    name: str
    presets: dict[str, dict[str, Any]]
    model_keys: tuple[str, ...]
    model: Callable[[dict[str, Any], int, int], ModelSource]  # (model_args, seq, vocab)
    data: str = "stdlib"  # "stdlib" or "digits"

    def preset(self, size: str) -> dict[str, Any]:
        """The training of ``--size`` (a Hugging Face model's rates then by its own size:
        :func:`sized_rates`)."""
        return dict(self.presets[size])


_LM_TRAINING = {  # a language model's training by --size
    "tiny": dict(seq=32, batch=8, steps=40, lr=3e-3, warmup=5, eval_every=20, save_every=20),
    # the default run: a few minutes on 2 CPU cores, the loss falling from ~5.5 to ~2
    "small": dict(seq=64, batch=16, steps=500, lr=3e-3, warmup=20, eval_every=50, save_every=100),
    "base": dict(seq=128, batch=32, steps=2000, lr=1e-3, warmup=100, eval_every=200,
                 save_every=500),
}  # fmt: skip
_GPT_SHAPES = {
    "tiny": dict(d_model=32, n_heads=2, n_layers=2, dropout=0.1),
    "small": dict(d_model=128, n_heads=4, n_layers=4, dropout=0.0),
    "base": dict(d_model=256, n_heads=8, n_layers=8, dropout=0.1),
}


def _llama(args: dict[str, Any], seq: int, vocab: int) -> ModelSource:
    h, heads = args["hidden_size"], args["heads"]
    config = dict(
        model_type="llama", vocab_size=vocab, max_position_embeddings=seq, hidden_size=h,
        intermediate_size=8 * h // 3 // 16 * 16 or 16, num_hidden_layers=args["n_layers"],
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        tie_word_embeddings=False,
    )  # fmt: skip
    return HFModel({"config": config, "family": "causal-lm"})


_RESNET_PRESETS = {
    "tiny": dict(channels=8, blocks=2, batch=32, steps=40, lr=3e-3, warmup=5, eval_every=20,
                 save_every=20),
    "small": dict(channels=16, blocks=4, batch=64, steps=300, lr=3e-3, warmup=20,
                  eval_every=50, save_every=100),
    "base": dict(channels=32, blocks=8, batch=128, steps=1000, lr=2e-3, warmup=50,
                 eval_every=100, save_every=250),
}  # fmt: skip
_LLAMA_PRESETS = {
    size: {"hidden_size": g["d_model"], "heads": g["n_heads"], "n_layers": g["n_layers"],
           **_LM_TRAINING[size]}
    for size, g in _GPT_SHAPES.items()
}  # fmt: skip


def _gpt(args: dict[str, Any], seq: int, vocab: int) -> ModelSource:
    return GPT(dict(vocab_size=vocab, context=seq, **args))


def _convnet(args: dict[str, Any], seq: int, vocab: int) -> ModelSource:
    return ConvNet(dict(in_channels=1, classes=10, **args))


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "gpt",
            {s: {**_GPT_SHAPES[s], **_LM_TRAINING[s]} for s in _LM_TRAINING},
            ("d_model", "n_heads", "n_layers", "dropout"),
            _gpt,
        ),
        Recipe("resnet", _RESNET_PRESETS, ("channels", "blocks"), _convnet, data="digits"),
        # A random byte-level Llama: the path of any Hugging Face configuration.
        Recipe("hf-llama", _LLAMA_PRESETS, ("hidden_size", "heads", "n_layers"), _llama),
    )
}
# Any other --model: a Hugging Face folder or config.json; its shape is its configuration's
# (model_args: {"config", "family", "split"}, see resolve), the presets are training only.
HF_FOLDER = Recipe(
    "hf",
    {s: {**t, "seq": 2 * t["seq"], "lr": 1e-3} for s, t in _LM_TRAINING.items()},
    (),
    lambda args, seq, vocab: HFModel(args),
)


def sized_rates(parameters: int, preset: dict[str, Any], *, pretrained: bool) -> dict[str, Any]:
    """A Hugging Face model's peak learning rate and warm-up by its own size (``--size`` is
    the training's length only): from scratch, 6e-4 at GPT-2's 124M parameters, scaled by
    1/sqrt(size) and kept within [1.5e-4, 3e-3] (a 1M-parameter model takes 3e-3: 3e-4
    barely moves it); fine-tuning from weights, a tenth of that within [1e-5, 3e-4], with
    half the warm-up."""
    scratch = min(3e-3, max(1.5e-4, 6e-4 * (124e6 / max(parameters, 1)) ** 0.5))
    if not pretrained:
        return {"lr": float(f"{scratch:.1e}")}
    return {"lr": float(f"{min(3e-4, max(1e-5, scratch / 10)):.1e}"),
            "warmup": max(1, preset["warmup"] // 2)}  # fmt: skip


def recipe_of(model: str) -> Recipe:
    return RECIPES.get(model, HF_FOLDER)


# A checkpoint's model kind -> its source (gpipe's former kinds, "resnet" and "hf-llama",
# were written only in the checkpoint format that gpipe.train.checkpoint refuses).
SOURCES: dict[str, Callable[[dict[str, Any]], ModelSource]] = {
    source.kind: source for source in (GPT, ConvNet, HFModel)
}


def source_of(spec: dict[str, Any]) -> ModelSource:
    """The model source of a checkpoint's spec ``{"kind": ..., "args": {...}}``."""
    if spec["kind"] not in SOURCES:
        raise ValueError(f"unknown model kind {spec['kind']!r}; known: {sorted(SOURCES)}")
    return SOURCES[spec["kind"]](spec["args"])


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The plain (un-split) model of a checkpoint's spec."""
    return source_of(spec).build()


def constructor(spec: dict[str, Any]) -> str:
    """Python code that builds the plain model of ``spec``."""
    return source_of(spec).constructor()


class Task:
    """One run's model, objective and data (see the module doc); made by :func:`task_of`."""

    def __init__(
        self, *, model: ModelSource, objective: Objective, data: TextData | DigitsData,
        seq: int, packing: str, weights: str | None, dtype: str,
    ) -> None:  # fmt: skip
        self.model, self.objective, self.source = model, objective, data
        self.seq, self.packing, self.weights = seq, packing, weights
        self.dtype = torch.float64 if dtype == "float64" else torch.float32
        self.unit, self.writes_text = objective.unit, objective.writes_text
        self.classifies = objective.classifies
        self.deferred_batch_norm = model.deferred_batch_norm
        self.size_options = ("seq", "batch") if isinstance(data, TextData) else ("batch",)

    @property
    def tokenizer(self) -> Any:
        return self.source.tokenizer if isinstance(self.source, TextData) else None

    # -- the model -------------------------------------------------------------------------

    def units(self) -> int:
        return self.model.units()

    def pipe(self, *, resume: bool = False, **options: Any) -> Pipe:
        """The model as a Pipe in this run's dtype; from the weights unless ``resume`` (the
        checkpoint's are loaded next)."""
        weights = None if resume else self.weights
        example = self.objective.example(self.seq) if isinstance(self.source, TextData) else None
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            pipe = self.model.pipe(example, weights=weights, **options)
        finally:
            torch.set_default_dtype(previous)
        warn_per_microbatch(self.model.aux_loss_coef(), pipe.chunks)
        return pipe

    def logits(self, output: Any) -> torch.Tensor:
        return self.model.logits(output)

    def activation_floor(self, micro_batch: int) -> tuple[int, str]:
        return self.model.activation_floor(micro_batch, self.seq)

    # -- the data --------------------------------------------------------------------------

    def prepare(self) -> Any:
        """Once, before the ranks start: returns what they are handed (or None)."""
        return self.source.prepare()

    def data(self, *, batch: int, eval_batches: int, prepared: Any, chunks: int = 1) -> Data:
        """The train and validation samples; ``chunks``: the fewest a forward takes."""
        if isinstance(self.source, DigitsData):
            images = self.source.load(prepared)
            val = _Pairs(images.val_images, images.val_labels)
            train = _Pairs(images.train_images, images.train_labels)
            return Data(train, val, torch.arange(len(val)), images.describe())
        split = self.source.load()
        made = {}
        for side, documents in (("train", split.train), ("validation", split.val)):
            try:
                made[side] = self.objective.samples(
                    documents, seq=self.seq, packing=self.packing, tokenizer=self.tokenizer
                )
            except ValueError as error:
                raise ValueError(f"the {side} set: {error}") from None
        val = made["validation"]
        if len(val) < chunks:
            raise ValueError(
                f"the validation set holds {len(val)} sample(s), fewer than --chunks {chunks}: "
                "hold out more (--val-fraction), or name a larger --val-data"
            )
        return Data(made["train"], val, val.evenly_spaced(eval_batches * batch),
                    split.description)  # fmt: skip

    def batch(self, samples: Any, indices: torch.Tensor, *, seed: int) -> tuple[Any, Any]:
        """(inputs, targets) of the samples at ``indices``; ``seed``: their randomness (the
        masked LM's masks), the same on every rank."""
        generator = torch.Generator().manual_seed(seed)
        inputs, targets = self.objective.batch(
            samples[indices], generator=generator, tokenizer=self.tokenizer
        )
        if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
            inputs = inputs.to(self.dtype)
        return inputs, targets

    def samples(self) -> int:
        """Units of throughput per sample."""
        return self.seq if self.unit == "tokens" else 1

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The objective's mean over ``target``, plus the model's auxiliary loss (a mixture
        of experts' load balancing) as its own ``loss`` adds it."""
        loss = self.objective.loss(self.model.logits(output), target)
        aux = auxiliary_loss(output, self.model.aux_loss_coef())
        return loss if isinstance(aux, float) else loss + aux.to(loss.dtype)

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return self.objective.count(target)

    def correct(self, output: Any, target: torch.Tensor) -> int:
        return self.objective.correct(self.model.logits(output), target)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text.encode())

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def problems(self) -> list[str]:
        """What cannot run (before any process starts)."""
        found = []
        tokenizer = self.tokenizer
        if tokenizer is not None:
            found += self.model.problems(seq=self.seq, vocab=tokenizer.vocab_size,
                                         pretrained=self.weights is not None)  # fmt: skip
            if isinstance(self.objective, MaskedLM) and tokenizer.mask is None:
                found.append(
                    f"a masked LM needs a tokenizer with a mask token; {tokenizer.name} has "
                    "none: --tokenizer a folder whose tokenizer has one"
                )
        if self.packing == "pack" and not self.objective.packs and tokenizer is not None:
            found.append(
                "--packing pack joins documents into one stream; a sequence-to-sequence model "
                "learns each (source, target) pair on its own: --packing pad"
            )
        return found


def task_of(config: Any) -> Task:
    """The task of a resolved :class:`~gpipe.train.TrainConfig`."""
    recipe = recipe_of(config.model)
    is_text = recipe.data != "digits"
    tokenizer = config.tokenizer if is_text else None
    vocab = 256 if tokenizer in (None, BYTES) else _vocab(tokenizer)
    model = recipe.model(config.model_args, config.seq, vocab)
    objective = _objective(model, config)
    if is_text:
        train = Stdlib() if config.data is None else Files(
            config.data, config.text_field, config.target_field if objective.pairs else None
        )  # fmt: skip
        val = None if config.val_data is None else Files(
            config.val_data, config.text_field, config.target_field if objective.pairs else None
        )  # fmt: skip
        data: TextData | DigitsData = TextData(
            train, val, config.val_fraction, tokenizer, pairs=objective.pairs
        )
    else:
        data = DigitsData()
    weights = config.model if config.init == "pretrained" else None
    return Task(model=model, objective=objective, data=data, seq=config.seq,
                packing=config.packing, weights=weights, dtype=config.dtype)  # fmt: skip


def _objective(model: ModelSource, config: Any) -> Objective:
    if model.family == "masked-lm":
        return MaskedLM(config.mask_prob)
    if model.family == "seq2seq":
        start = decoder_start(model.args["config"])
        return Seq2Seq(start)
    return OBJECTIVES[model.family]()


def _vocab(folder: str) -> int:
    from gpipe.train.tokenizers import load

    return load(folder).vocab_size


def tokenizer_of(model: str) -> str:
    """``--tokenizer auto``: the model folder's own tokenizer, else bytes."""
    folder = Path(model)
    return str(folder.resolve()) if has_tokenizer(folder) else BYTES


class _Pairs:
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]
