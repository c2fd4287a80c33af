"""The model a ``Pipe`` was captured from, which the Pipe keeps following.

Its ``train()``/``eval()`` mode is read at every call of the Pipe (``model.eval()`` on the
original reaches the pipeline, and ``pipe.train()``/``eval()`` set the model's mode too, as one
switch); its hooks are watched (:class:`gpipe.frontend.hooks.HookWatch`); and its own order of
parameters and buffers is the order the Pipe lists them in, so that an optimizer's state dict
moves between the model's optimizer and the Pipe's.

A captured unit runs the graph of one mode for every module it inlined, so such modules must
share the model's mode; a module kept as a call (batch norm, a hooked module) is the model's
own object and keeps its own mode (e.g. a batch norm frozen in ``eval()`` while training).
"""

from __future__ import annotations

from torch import nn

from gpipe.frontend.cut import CaptureError
from gpipe.frontend.hooks import HookWatch
from gpipe.frontend.units import CapturedModel

__all__ = ["Original"]


class Original:
    """What a Pipe of a captured model follows: see the module doc."""

    def __init__(self, model: nn.Module, order: dict[str, int], inference_only: bool) -> None:
        self.model = model
        self.inference_only = inference_only  # no train() graph was captured
        self.order = order  # a tensor's name -> its place in the model's own order
        self.hooks = HookWatch(model)
        self._inlined: list[tuple[str, nn.Module]] | None = None  # known at the first call

    @classmethod
    def of(cls, module: nn.Module) -> Original | None:
        """The original of a captured model (None for any other module)."""
        if not isinstance(module, CapturedModel) or module.source is None:
            return None
        return cls(module.source[0], module.order, module.inference_only)

    def refuse_training(self, doing: str) -> None:
        """An inference-only capture holds no train() graph: its units would run the eval()
        graph (no dropout, batch norm's running statistics), so ``doing`` is refused."""
        if self.inference_only:
            raise CaptureError(
                f"{doing} trains, but this Pipe was captured with inference_only=True (its "
                "eval() graph only): build it with Pipe.from_model(..., inference_only=False)"
            )

    def follow(self, pipe: nn.Module) -> None:
        """Before each call of ``pipe``: refuse a hook added since capture, and take the
        model's mode."""
        self.hooks.check()
        mode = self.model.training
        if self._inlined is None:
            own = {id(m) for m in pipe.modules()}
            self._inlined = [(n, m) for n, m in self.model.named_modules() if id(m) not in own]
        for name, module in self._inlined:
            if module.training != mode:
                raise CaptureError(
                    f"{name} ({type(module).__name__}) is in {_mode(module.training)} mode while "
                    f"the model is in {_mode(mode)}: each captured unit runs its modules in the "
                    f"model's mode; set the mode on the whole model (model.{_mode(mode)} or "
                    f"pipe.{_mode(mode)})"
                )
        if pipe.training != mode:
            own = {id(m) for _, m in self.model.named_modules()}
            for module in pipe.modules():  # the model's own modules keep their own mode
                if id(module) not in own:
                    module.training = mode


def _mode(training: bool) -> str:
    return "train()" if training else "eval()"
