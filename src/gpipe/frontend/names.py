"""The model's own names, order and mode for a module that holds a captured model's units.

A unit registers the model's tensors under the model's names, and ``Pipe`` registers each unit
under its index, so inside the Pipe a name reads ``"<unit>.<model's name>"``. :class:`ModelNames`
drops the unit index wherever names face the user: ``named_parameters``, ``named_buffers``,
``state_dict`` and ``load_state_dict`` speak the model's names, in the model's own order (not
the order the forward uses them), so a state dict moves between the Pipe and the original model
(a rank's is a shard of the model's), and so does an optimizer's (its state is by position).
``train()``/``eval()`` switch the original model too, and each call follows the model's mode
and refuses a hook added to it since capture (:class:`gpipe.frontend.original.Original`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from gpipe.frontend.original import Original
from gpipe.frontend.units import CapturedModel

__all__ = ["ModelNames"]


class ModelNames:
    """Mixin for an ``nn.Module`` (``class Pipe(ModelNames, nn.Module)``); active when the
    module sets ``self._original`` (``Original.of(module)``: None unless it is captured)."""

    _original: Original | None = None

    @property
    def _captured(self) -> bool:
        return self._original is not None

    def _follow_model(self) -> None:
        """Before each call: the original model's mode, and no hook added to it since capture."""
        if self._original is not None:
            self._original.follow(self)

    def train(self, mode: bool = True):
        if self._original is not None:
            self._original.model.train(mode)
        return super().train(mode)

    def _in_model_order(self, named: Iterator[tuple[str, Any]], prefix: str, unique: bool):
        """``named`` (every name of every tensor) in the model's order, each tensor under its
        first name there when ``unique`` (as torch lists a tied tensor)."""
        order = self._original.order
        public = [(self._public(name, prefix), t) for name, t in named]
        public.sort(key=lambda item: order.get(item[0][len(prefix) :], len(order)))
        seen: set[int] = set()
        for name, t in public:
            if not unique or id(t) not in seen:
                seen.add(id(t))
                yield name, t

    def _public(self, name: str, prefix: str = "") -> str:
        if not self._captured:
            return name
        return prefix + CapturedModel.original_name(name[len(prefix) :])

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if not self._captured:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        every = super().named_parameters(prefix, recurse, remove_duplicate=False)
        return self._in_model_order(every, prefix, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if not self._captured:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        every = super().named_buffers(prefix, recurse, remove_duplicate=False)
        ordered = self._in_model_order(every, prefix, remove_duplicate)
        # export's constants are not the model's buffers
        return ((n, b) for n, b in ordered if not n[len(prefix) :].startswith("_constants."))

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        if not self._captured:
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if destination is None:
            destination = OrderedDict()
        # A tensor two units hold (a tied copy) appears once, as in the model.
        order = self._original.order
        inner = super().state_dict(keep_vars=keep_vars).items()
        for name, value in sorted(inner, key=lambda kv: order.get(self._public(kv[0]), len(order))):
            destination.setdefault(prefix + CapturedModel.original_name(name), value)
        return destination

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign=False):
        if not self._captured:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        mine = {n: CapturedModel.original_name(n) for n in super().state_dict(keep_vars=True)}
        missing = sorted({o for o in mine.values() if o not in state_dict})
        unexpected = sorted(set(state_dict) - set(mine.values()))
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys "
                f"{missing}, unexpected keys {unexpected} (a rank holds only its stages: "
                "strict=False loads a shard)"
            )
        inner = {name: state_dict[o] for name, o in mine.items() if o in state_dict}
        super().load_state_dict(inner, strict=False, assign=assign)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)
