"""The hooks a model carries, and which of them a captured pipeline can run as the model does.

``torch.export`` runs a module's forward hooks while it traces, so their arithmetic is in the
graph but their Python (a counter, a list of activations) ran once, at capture. gpipe instead
keeps a module that has forward hooks or forward pre-hooks as one call of the module itself
(as batch norm is kept), so that its hooks run for real each time the module runs: once per
micro-batch, and again where a stage is recomputed (``checkpoint=``), as under
``torch.utils.checkpoint``. A hooked module that cannot be one call (several tensors in or out,
called twice, no work of its own, the whole model, a parent of the split modules) is refused.

Gradient hooks are refused: a pipeline computes each gradient in M micro-batch parts, each
scaled by its micro-batch's share of the loss, so a module's backward hook, backward pre-hook,
or a tensor's ``register_hook`` / ``register_post_accumulate_grad_hook`` would see M partial
gradients instead of the model's one, and anything but a linear hook would change the update.
Module hooks set globally (``register_module_forward_hook``...) are refused too.

:class:`HookWatch` notices a hook added to the model after capture, at the Pipe's next call.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from gpipe.frontend.cut import CaptureError

__all__ = ["HookWatch", "forward_hooked", "refuse_gradient_hooks"]

_GRADIENT = "gradients reach it per micro-batch (M partial gradients, not the model's one)"
_REMEDY = (
    "remove it (handle.remove()) before Pipe.from_model and transform p.grad after pipe.step, "
    "before the optimizer steps"
)
_FORWARD = ("_forward_pre_hooks", "_forward_hooks")
_KIND_FORWARD = ("forward hook", "forward pre-hook")
_MODULE_GRADIENT = ("_backward_pre_hooks", "_backward_hooks")
_TENSOR = ("_backward_hooks", "_post_accumulate_grad_hooks")
_GLOBAL = (
    "_global_forward_pre_hooks", "_global_forward_hooks",
    "_global_backward_pre_hooks", "_global_backward_hooks",
)  # fmt: skip
_KIND = {
    "_forward_pre_hooks": "forward pre-hook",
    "_forward_hooks": "forward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_backward_hooks": "backward hook",
    "_post_accumulate_grad_hooks": "post-accumulate-grad hook",
}

Hook = tuple[str, str, int]  # (kind, where, the handle's id)


def _name(fn: object) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _ours(fn: object) -> bool:
    """Hooks that are not the model's to keep: gpipe's own (gradient reduction),
    torch.distributed's (FSDP), and transformers' output capture (``output_router_logits``,
    ``output_hidden_states``), whose only effect, outputs collected into the model's return
    value, the capture traced into the graph."""
    owner = getattr(getattr(fn, "func", fn), "__module__", None) or ""
    return owner.startswith(("gpipe.", "torch.distributed", "transformers.utils.output_capturing"))


def _hooks(model: nn.Module) -> Iterator[tuple[Hook, object]]:
    """Every hook that acts on ``model``'s computation, with its function."""
    for name in _GLOBAL:
        for key, fn in getattr(torch_module, name).items():
            yield ("global " + _KIND[name.replace("_global", "")], "every module", key), fn
    for path, module in model.named_modules(remove_duplicate=False):
        where = f"{path or 'the model'} ({type(module).__name__})"
        for attr in (*_FORWARD, *_MODULE_GRADIENT):
            for key, fn in getattr(module, attr).items():
                yield (_KIND[attr], where, key), fn
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    for path, tensor in tensors:
        for attr in _TENSOR:
            for key, fn in (getattr(tensor, attr, None) or {}).items():
                yield (f"tensor {_KIND[attr]}", f"tensor {path}", key), fn


def refuse_gradient_hooks(model: nn.Module) -> None:
    """CaptureError naming the first hook the pipeline cannot run as the model does, other
    than forward hooks on modules (those are kept as calls: :func:`forward_hooked`)."""
    for (kind, where, _), fn in _hooks(model):
        if _ours(fn) or (kind in _KIND_FORWARD and not where.startswith("the model (")):
            continue
        if kind.startswith("global"):
            why = "it acts on the Pipe and every unit, not on the model's modules"
            remedy = "remove it, or register it on the model's modules instead"
        elif "forward" in kind:
            why = "the model's whole forward is cut into stages and runs once per micro-batch"
            remedy = "remove it, or register it on a submodule"
        else:
            why, remedy = _GRADIENT, _REMEDY
        raise CaptureError(
            f"{kind} {_name(fn)!r} on {where}: gpipe cannot run it as the model does ({why}); "
            f"{remedy}"
        )


def forward_hooked(model: nn.Module, split: list[str]) -> dict[str, str]:
    """Modules with forward hooks or pre-hooks, to keep as calls: path -> what to name in an
    error (CaptureError for a module that holds split modules: it cannot be one call)."""
    hooked: dict[str, str] = {}
    for path, module in model.named_modules():
        fns = [fn for attr in _FORWARD for fn in getattr(module, attr).values() if not _ours(fn)]
        if not fns or not path:
            continue
        said = f"forward hook {_name(fns[0])!r} on {path} ({type(module).__name__})"
        inner = [s for s in split if s.startswith(path + ".")]
        if inner:
            raise CaptureError(
                f"{said}: the module holds split modules ({inner[0]}, ...), so it cannot run "
                "as one call, which its hooks need; remove the hook, or register it on the "
                "split modules or inside them"
            )
        hooked[path] = said
    return hooked


class HookWatch:
    """The model's hooks when it was captured; :meth:`check` refuses one added since."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._known = {hook for hook, fn in _hooks(model) if not _ours(fn)}
        self._seen = RemovableHandle.next_id

    def check(self) -> None:
        if RemovableHandle.next_id == self._seen:  # no hook registered anywhere since
            return
        for hook, fn in _hooks(self.model):
            if hook not in self._known and not _ours(fn):
                kind, where, _ = hook
                raise CaptureError(
                    f"{kind} {_name(fn)!r} was added to {where} after Pipe.from_model captured "
                    "the model, and the pipeline would not run it; remove it, or register it "
                    "before Pipe.from_model (forward hooks then run, gradient hooks are refused)"
                )
        self._seen = RemovableHandle.next_id
