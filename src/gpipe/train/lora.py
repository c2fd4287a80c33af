"""``gpipe train --model DIR --lora r=8,alpha=16,targets=q_proj,v_proj``: low-rank adapters
(LoRA, Hu et al. 2021) through ``peft``, the field's standard, trained exactly.

* **Where the adapters go**: ``peft.inject_adapter_in_model`` wraps each target ``nn.Linear``
  of the whole model (a ``lora.Linear``: the frozen ``base_layer``, ``lora_A``, ``lora_B``)
  before the model is captured, so the pipeline's stages hold peft's own modules and the
  parameters keep peft's names (``…q_proj.base_layer.weight``, ``…q_proj.lora_A.default.weight``).
* **The same adapters on every rank**: each process builds the whole model (with the folder's
  weights) and injects under ``torch.manual_seed(seed)``, so every rank's ``lora_A`` is
  peft's initialization drawn from the same seed, and ``lora_B`` starts at zero: the pipeline
  is the un-split peft model (``tests/train/test_lora.py``). The price: each rank reads the
  whole model once, where a run without ``--lora`` reads only its own stage's tensors.
* **Only the adapters train**: every other parameter is frozen (no gradient, not in the
  optimizer).
* **Export**: ``gpipe export`` writes the merged model, a plain ``save_pretrained`` folder
  (``W + alpha/r · B A``, as ``merge_and_unload``), and :func:`save_adapter` the adapter
  alone, a folder ``peft.PeftModel.from_pretrained(base, folder)`` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["freeze_base", "inject", "merged", "parse", "save_adapter"]

ADAPTER = "default"  # peft's name for the one adapter
_KEYS = {"r": int, "alpha": float, "dropout": float, "targets": list}
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def parse(spec: str) -> dict[str, Any]:
    """``r=8,alpha=16,targets=q_proj,v_proj`` (names after ``targets=`` are its list) as
    ``{"r": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}``; raises
    ValueError naming what is wrong. Defaults: r 8, alpha 2r, dropout 0, targets peft's for the
    model type."""
    args: dict[str, Any] = {}
    key = None
    for part in (p.strip() for p in spec.split(",")):
        if "=" not in part and key == "targets" and part:
            args["targets"].append(part)
            continue
        key, _, value = part.partition("=")
        if key not in _KEYS or not value:
            raise ValueError(
                f"--lora {spec}: {part!r} is not KEY=VALUE of r, alpha, dropout, targets; e.g. "
                "--lora r=8,alpha=16,targets=q_proj,v_proj"
            )
        try:
            args[key] = [value] if key == "targets" else _KEYS[key](value)
        except ValueError:
            raise ValueError(f"--lora {spec}: {key}={value} is not a number") from None
    r = args.setdefault("r", 8)
    args.setdefault("alpha", 2.0 * r)
    args.setdefault("dropout", 0.0)
    args.setdefault("targets", None)
    if r < 1 or not 0 <= args["dropout"] < 1:
        raise ValueError(f"--lora {spec}: r must be >= 1 and dropout in [0, 1)")
    return args


def _config(args: dict[str, Any]) -> Any:
    try:
        from peft import LoraConfig
    except ImportError:
        raise ImportError("--lora needs peft: pip install 'gpipe[lora]'") from None
    return LoraConfig(
        r=args["r"], lora_alpha=args["alpha"], lora_dropout=args["dropout"],
        target_modules=args["targets"],
    )  # fmt: skip


def inject(model: nn.Module, args: dict[str, Any], *, seed: int) -> nn.Module:
    """``model`` with peft's adapters of ``args`` in it (in place), drawn from ``seed``."""
    from peft import inject_adapter_in_model

    config = _config(args)
    if config.target_modules is None:  # peft's own choice for the model type
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as targets

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in targets:
            raise ValueError(
                f"--lora: peft knows no target modules for model type {model_type}; name "
                "them, e.g. --lora targets=q_proj,v_proj"
            )
        config.target_modules = set(targets[model_type])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    return model.train(model.training)  # the new modules in the model's mode


def freeze_base(named: list[tuple[str, nn.Parameter]]) -> list[str]:
    """Freeze every parameter but the adapters'; the names of those left to train."""
    trained = []
    for name, parameter in named:
        adapter = ".lora_" in name
        parameter.requires_grad_(adapter)
        if adapter:
            trained.append(name)
    return trained


def merged(state: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The plain model's state dict: each wrapped weight plus ``alpha/r · B A`` under its
    own name again (``q_proj.weight``), the adapters gone."""
    scale = args["alpha"] / args["r"]
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        if key.endswith(".base_layer.weight"):
            prefix = key[: -len(".base_layer.weight")]
            a, b = state[prefix + _A], state[prefix + _B]
            value = value + (b @ a) * scale  # as peft's merge: in the weight's dtype
        out[name] = value
    return out


def save_adapter(
    state: dict[str, torch.Tensor], args: dict[str, Any], folder: str | Path, *, base: str = ""
) -> Path:
    """The adapters of ``state`` as peft writes them (``adapter_config.json``,
    ``adapter_model.safetensors``), for ``PeftModel.from_pretrained(base_model, folder)``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(args)
    config.target_modules = sorted(
        {k[: -len(_A)].rsplit(".", 1)[-1] for k in state if k.endswith(_A)}
    )
    config.base_model_name_or_path = base or None
    config.save_pretrained(str(folder))
    adapters = {
        "base_model.model." + k.replace(f".{ADAPTER}.", "."): v.contiguous()
        for k, v in state.items() if ".lora_" in k
    }  # fmt: skip
    save_file(adapters, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder
