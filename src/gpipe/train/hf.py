"""Any Hugging Face model as the main job's model: a ``save_pretrained`` folder (with or
without weights) or a ``config.json``, of a causal LM, masked LM or sequence-to-sequence
family, trained as it is through ``Pipe.from_model``.

* **The configuration** (:func:`read_config`) is the folder's, with the fields the user
  overrides (``--model-config num_hidden_layers=4,hidden_size=256``); it is saved whole in
  every checkpoint, so a resumed or exported run needs nothing from the folder.
* **The family** comes from the configuration's ``architectures`` (``LlamaForCausalLM``:
  ``AutoModelForCausalLM``), else from its model type; ``--family`` overrides it.
* **Weights**: fine-tuning builds the model on ``meta`` and each rank reads only its own
  tensors from the folder's safetensors (``Pipe.from_model(weights=...)``); from scratch,
  the model is a function, and each rank's layers are exactly those of
  ``torch.manual_seed(seed); AutoModelFor...from_config(config)``.
* **The cut**: before each block of the model's lists of blocks (every ``nn.ModuleList``
  not inside another: a decoder's layers; an encoder's, then a decoder's), or ``--split``.
* Mixtures of experts run transformers' ``batched_mm`` experts, whose shapes do not depend
  on the routing (the default implementation's do, which no captured graph can hold).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gpipe.train.lora as lora
from gpipe.pipe import Pipe
from gpipe.train.networks import ModelSource, attention_floor

__all__ = [
    "FAMILIES", "HFModel", "blocks", "decoder_start", "families_of", "family_of", "has_weights",
    "parse_overrides", "read_config", "save_pretrained",
]  # fmt: skip

# family -> the Auto class that builds it
FAMILIES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
}
_MAPPINGS = {  # family -> transformers' table of model type -> class name
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
}
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "a Hugging Face model needs transformers: pip install 'gpipe[hf]'"
        ) from error
    return transformers


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``"num_hidden_layers=4,hidden_size=256"`` -> their values (JSON where they read as
    JSON: numbers, true/false, null, lists; else the text)."""
    values: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--model-config: {item!r} is not FIELD=VALUE")
        try:
            values[key.strip()] = json.loads(value)
        except ValueError:
            values[key.strip()] = value.strip()
    return values


def read_config(model: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The configuration of ``model`` (a folder with ``config.json``, or such a file) with
    ``overrides``, as a dict (``to_dict()``); raises ValueError naming an unknown field or a
    configuration transformers refuses.

    Fields derived from others (a layer type per layer, the head size) are derived anew from
    the overridden ones, as if the configuration had been written with them.
    """
    transformers = transformers_module()
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"--model {model}: no config.json there; name a folder that save_pretrained "
            "wrote, a config.json, or a built-in model"
        )
    raw = json.loads(file.read_text())
    if "model_type" not in raw:
        raise ValueError(f"--model {model}: {file} has no model_type, which says the family")
    make = transformers.AutoConfig.for_model
    config = make(**raw)
    known = config.to_dict()
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=3)
            raise ValueError(
                f"--model-config {key}: not a field of {type(config).__name__}"
                + (f"; close: {', '.join(close)}" if close else "")
            )
    if not overrides:
        return known
    try:
        return make(**{**_written(raw, known), **overrides}).to_dict()
    except Exception as error:  # transformers' own validation of the fields together
        first = str(error).strip().splitlines()[-1].strip()
        raise ValueError(
            f"--model-config: transformers refuses the configuration: {first}"
        ) from None


def _written(raw: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """The fields of a saved configuration that the others do not determine (save_pretrained
    writes derived ones too)."""
    make = transformers_module().AutoConfig.for_model
    kept = {}
    for key, value in raw.items():
        try:
            derived = make(**{k: v for k, v in raw.items() if k != key}).to_dict().get(key)
        except Exception:  # needed by the others
            derived = None
        if key == "model_type" or derived != full.get(key):
            kept[key] = value
    return kept


def families_of(model_type: str) -> list[str]:
    """The families transformers builds a model type as."""
    from transformers.models.auto import modeling_auto

    return [f for f, name in _MAPPINGS.items() if model_type in getattr(modeling_auto, name)]


def family_of(config: dict[str, Any]) -> str | None:
    """The family of a configuration: by its architectures, else by its model type."""
    from transformers.models.auto import modeling_auto

    tables = {f: getattr(modeling_auto, name) for f, name in _MAPPINGS.items()}
    for architecture in config.get("architectures") or []:
        for family, table in tables.items():
            if architecture in table.values():
                return family
    kind = config.get("model_type")
    if kind in tables["seq2seq"]:
        return "seq2seq"
    if kind in tables["causal-lm"] and not config.get("is_encoder_decoder"):
        return "causal-lm"
    return "masked-lm" if kind in tables["masked-lm"] else None


def decoder_start(config: dict[str, Any]) -> int:
    """The token a sequence-to-sequence decoder starts from."""
    start = _first(config, "decoder_start_token_id", "pad_token_id", "bos_token_id")
    return 0 if start is None else int(start)


def has_weights(folder: str | Path) -> bool:
    return Path(folder).is_dir() and any((Path(folder) / f).exists() for f in _WEIGHT_FILES)


def blocks(model: nn.Module) -> list[str]:
    """Where to cut: the children of every ``nn.ModuleList`` not inside another, in order."""
    lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    outer = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    return [f"{name}.{child}" for name in outer for child in model.get_submodule(name)._modules]


class HFModel(ModelSource):
    """A Hugging Face model of ``args["config"]`` (a configuration's ``to_dict()``) and
    ``args["family"]``; ``args["split"]``: module paths to cut before (None: :func:`blocks`)."""

    kind = "hf"

    def __init__(self, args: dict[str, Any]) -> None:
        super().__init__(args)
        self.family = args["family"]

    def config(self) -> Any:
        return transformers_module().AutoConfig.for_model(**self.args["config"])

    def build(self) -> nn.Module:
        auto = getattr(transformers_module(), FAMILIES[self.family])
        return auto.from_config(
            self.config(), dtype=torch.get_default_dtype(), experts_implementation="batched_mm"
        )

    def split(self, model: nn.Module) -> list[str]:
        return list(self.args.get("split") or blocks(model))

    def parameter_count(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.build().parameters())

    def units(self) -> int:
        with torch.device("meta"):
            model = self.build()
        return len(self.split(model)) + 2  # the work before the first block, the blocks, after

    def pipe(self, example: Any, *, weights: str | None = None, **options: Any) -> Pipe:
        if self.args.get("lora"):  # the whole model on each rank, the same adapters
            model = lora.inject(self._whole(weights, options.get("init_seed", 0)),
                                self.args["lora"], seed=options.get("init_seed", 0))  # fmt: skip
            pipe = Pipe.from_model(model, example, split=self.split(model), **options)
            lora.freeze_base(list(pipe.named_parameters()))
            return pipe
        if weights is None:  # from scratch: the construction replayed, layer by layer
            with torch.device("meta"):
                split = self.split(self.build())
            return Pipe.from_model(self.build, example, split=split, **options)
        with torch.device("meta"):
            model = self.build()
        return Pipe.from_model(model, example, split=self.split(model), weights=weights, **options)

    def _whole(self, weights: str | None, seed: int) -> nn.Module:
        """The whole model: the folder's weights, else ``seed``'s initialization."""
        if weights is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return self.build()
        auto = getattr(transformers_module(), FAMILIES[self.family])
        return auto.from_pretrained(
            weights, config=self.config(), dtype=torch.get_default_dtype(),
            experts_implementation="batched_mm",
        )  # fmt: skip

    def logits(self, output: Any) -> torch.Tensor:
        return output.logits

    def aux_loss_coef(self) -> float | None:
        config = self.args["config"]
        if not config.get("output_router_logits"):
            return None  # the model returns no load-balancing loss, and its own loss has none
        return _first(config, "router_aux_loss_coef")

    def constructor(self) -> str:
        auto = FAMILIES[self.family]
        return (
            f"transformers.{auto}.from_config(transformers.AutoConfig.for_model("
            f"**{self.args['config']!r}))"
        )

    def problems(self, *, seq: int, vocab: int, pretrained: bool = False) -> list[str]:
        config, found = self.args["config"], []
        size = _first(config, "vocab_size")
        if size is not None and vocab > size:
            # The folder's weights fix the embedding's rows: a larger vocab_size is a model
            # trained from scratch.
            larger = f"--model-config vocab_size={vocab}"
            remedy = f"--init random {larger} (from scratch)" if pretrained else larger
            found.append(
                f"the tokenizer has {vocab:,} tokens, the model's vocab_size is {size:,}: use "
                f"the model's own tokenizer (--tokenizer auto), or {remedy}"
            )
        positions = _first(config, "max_position_embeddings", "n_positions")
        if positions is not None and seq > positions:
            found.append(
                f"--seq {seq} is longer than the model's {positions} positions "
                f"(max_position_embeddings): lower --seq"
            )
        return found

    def activation_floor(self, micro_batch: int, seq: int) -> tuple[int, str]:
        config = self.args["config"]
        heads = _first(config, "num_attention_heads", "n_head", "encoder_attention_heads") or 1
        return attention_floor(micro_batch, heads, seq)


def save_pretrained(
    spec: dict[str, Any],
    state: dict[str, torch.Tensor],
    folder: str | Path,
    *,
    tokenizer: str | None = None,
) -> Path:
    """The plain model of ``spec`` holding ``state``, written by transformers' own
    ``save_pretrained`` into ``folder`` (with the tokenizer of the folder ``tokenizer``), so
    that ``AutoModelFor...from_pretrained(folder)`` loads it. A LoRA run's adapters are merged
    into it, and also written alone in ``folder/adapter`` (``gpipe.train.lora``)."""
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    adapters = spec["args"].get("lora")
    if adapters:  # the plain model, each adapter merged into its weight; and the adapters
        lora.save_adapter(state, adapters, Path(folder) / "adapter")
        state = lora.merged(state, adapters)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(floating[0] if floating else previous)
    try:
        model = HFModel(spec["args"]).build()
    finally:
        torch.set_default_dtype(previous)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(folder)
    if tokenizer is not None:
        transformers_module().AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    return Path(folder)


def _first(config: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` that the configuration (or its text part) sets."""
    for part in (config, config.get("text_config") or {}):
        for key in keys:
            if part.get(key) is not None:
                return part[key]
    return None
