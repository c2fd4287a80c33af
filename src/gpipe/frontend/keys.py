"""Which checkpoint tensor becomes which tensor of the model: the names ``from_pretrained`` maps.

A Hugging Face model's keys go through transformers' own renaming: the model's conversion
mapping (``get_model_conversion_mapping``: legacy names, a ``base_model_prefix`` added or
dropped, Mixtral's per-expert ``w1``/``w3`` fused into ``mlp.experts.gate_up_proj``) applied
by ``core_model_loading.rename_source_key`` as ``convert_and_load_state_dict_in_model``
applies it, and the model's rules for keys to ignore (``_keys_to_ignore_on_load_*``, old
checkpoints' rotary ``inv_freq``). Any other model's keys are its ``state_dict`` names.

Only names are read (an index, or one file's header), so :meth:`KeyMap.check` compares the
whole model with the checkpoint before anything is captured or read, the same on every rank.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

from torch import nn

from gpipe.frontend.files import Checkpoint
from gpipe.frontend.report import LoadReport
from gpipe.frontend.units import tensor_names

__all__ = ["KeyMap", "is_hugging_face"]


def is_hugging_face(model: nn.Module) -> bool:
    if "transformers" not in sys.modules:  # a model of transformers imported it
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


class KeyMap:
    """The model's names each checkpoint key fills (``targets``), and the checkpoint keys
    that fill none (``unexpected``)."""

    def __init__(self, model: nn.Module, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.targets: dict[str, list[str]] = {}
        self._ignored: re.Pattern | None = None  # the model's rule for keys it may lack
        self.hugging_face = is_hugging_face(model)
        if self.hugging_face:
            self.unexpected = self._hugging_face(model)
        else:
            names = {n for group in tensor_names(model).values() for n in group}
            self.targets = {k: [k] for k in checkpoint.names() if k in names}
            self.unexpected = sorted(k for k in checkpoint.names() if k not in names)

    def ignore_missing(self, name: str) -> bool:
        """Whether the model allows a checkpoint without ``name``."""
        return self._ignored is not None and self._ignored.search(name) is not None

    def keys_for(self, names: Iterable[str]) -> list[str]:
        """The checkpoint keys that fill any of ``names``."""
        wanted = set(names)
        return [key for key, targets in self.targets.items() if wanted.intersection(targets)]

    def check(self, model: nn.Module) -> LoadReport:
        """The whole model against the checkpoint's names: what is missing or unexpected."""
        filled = {name for targets in self.targets.values() for name in targets}
        by_tensor: dict[int, list[str]] = {}  # a tensor's persistent names (tied: several)
        for name, t in model.state_dict(keep_vars=True).items():
            by_tensor.setdefault(id(t), []).append(name)
        missing = [
            names[0]
            for names in by_tensor.values()
            if not filled.intersection(names) and not any(map(self.ignore_missing, names))
        ]
        return LoadReport(str(self.checkpoint.path), sorted(missing), list(self.unexpected))

    def _hugging_face(self, model: nn.Module) -> list[str]:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
        from transformers.utils.loading_report import LoadStateDictInfo

        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if not isinstance(m, WeightConverter)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        expected = model.state_dict()
        prefix = model.base_model_prefix
        unexpected = set()
        for key in self.checkpoint.names():
            target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if target not in expected and key in expected:  # transformers' own fallback
                target, pattern = rename_source_key(key, [], [], prefix, expected)
            if target not in expected:
                unexpected.add(key)
                continue
            targets = [target]
            if pattern is not None:  # one key into several tensors (a fused qkv split)
                patterns = by_pattern[pattern].target_patterns
                targets = [target.replace(patterns[0], p) for p in patterns]
            self.targets[key] = targets
        info = LoadStateDictInfo(
            missing_keys=set(), unexpected_keys=unexpected, mismatched_keys=set(),
            error_msgs=[], conversion_errors={}, skipped_pp_keys=set(),
        )  # fmt: skip
        model._adjust_missing_and_unexpected_keys(info)  # the model's own "ignore" rules
        if model._keys_to_ignore_on_load_missing:
            patterns = model._keys_to_ignore_on_load_missing
            self._ignored = re.compile("|".join(f"({p})" for p in patterns))
        return sorted(info.unexpected_keys)
