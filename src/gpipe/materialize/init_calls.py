"""The ``nn.init`` functions that return at once on ``meta`` (``trunc_normal_``,
``orthogonal_``, ``sparse_``, ``dirac_``): their draws depend on the values drawn (rejection
sampling, QR), so no operation of theirs reaches the dispatcher there. While a factory is
recorded (``gpipe.materialize.record``) they are patched to hand each call on a meta tensor to
the recording, which replays it whole on the real tensor."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["InitCall", "init_functions_recorded"]


class InitCall:
    """An ``nn.init`` function that does nothing on meta (its draws depend on the values drawn:
    rejection sampling, QR): recorded whole, called on the real tensor at replay."""

    def __init__(self, name: str, fn: Callable, random: bool) -> None:
        self.name, self.fn, self.random = name, fn, random

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"torch.nn.init.{self.name}"


# Name in torch.nn.init -> draws random numbers. trunc_normal_ calls the private helper.
_META_NO_OPS = {
    "_no_grad_trunc_normal_": True,
    "orthogonal_": True,
    "sparse_": True,
    "dirac_": False,
}


class _Patch:
    """torch.nn.init patched while any thread records; each thread's calls go to its record."""

    lock = threading.Lock()
    users = 0
    originals: dict[str, Callable] = {}  # noqa: RUF012
    local = threading.local()


def _recorded(call: InitCall) -> Callable:
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recording = getattr(_Patch.local, "recording", None)
        if recording is None or not tensor.is_meta:
            return call.fn(tensor, *args, **kwargs)
        return recording.observe_call(call, tensor, args, kwargs)

    return functools.wraps(call.fn)(init)


@contextmanager
def init_functions_recorded(recording: Any) -> Iterator[None]:
    """While in the block, this thread's calls on meta tensors go to ``recording``'s
    ``observe_call``."""
    with _Patch.lock:
        if _Patch.users == 0:
            for name, random in _META_NO_OPS.items():
                _Patch.originals[name] = original = getattr(torch.nn.init, name)
                setattr(torch.nn.init, name, _recorded(InitCall(name, original, random)))
        _Patch.users += 1
    outer, _Patch.local.recording = getattr(_Patch.local, "recording", None), recording
    try:
        yield
    finally:
        _Patch.local.recording = outer
        with _Patch.lock:
            _Patch.users -= 1
            if _Patch.users == 0:
                for name, original in _Patch.originals.items():
                    setattr(torch.nn.init, name, original)
