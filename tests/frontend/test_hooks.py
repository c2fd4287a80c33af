"""Hooks on a captured model: forward hooks run in the pipeline as in the model, gradient
hooks are refused naming the hook and the module, a hook added after capture is refused at
the next call. Every run is compared with the plain model in float64, per parameter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.frontend import CaptureError

BATCH = 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) + x
        return self.head(x)


def build() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,))


def plain_gradients(model: nn.Module, x, y) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def worst(pipe: gpipe.Pipe, expected: dict[str, torch.Tensor]) -> float:
    got = dict(pipe.named_parameters())
    assert set(got) == set(expected)
    return max(float((got[n].grad - g).abs().max()) for n, g in expected.items())


def pipe_of(model: nn.Module, **options) -> gpipe.Pipe:
    x, _ = batch()
    options = {"balance": [2, 3], "chunks": 3, **options}
    return gpipe.Pipe.from_model(model, x[:2], split="blocks", **options)


@pytest.mark.parametrize(
    ("schedule", "checkpoint"), [("gpipe", "never"), ("1f1b", "always"), ("zb-h1", "except_last")]
)
def test_forward_hooks_and_pre_hooks_run_as_in_the_model(schedule, checkpoint):
    model = build()
    seen: list[torch.Tensor] = []
    model.blocks[1].register_forward_hook(lambda m, args, out: out * 2 + 0.1)
    model.blocks[2].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    model.blocks[0][0].register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    x, y = batch()
    expected = plain_gradients(model, x, y)  # the model's hooks act there too
    (plain_rows,) = seen
    pipe = pipe_of(model, schedule=schedule, checkpoint=checkpoint)
    seen.clear()  # export ran the forward (on fake tensors) while it captured
    pipe.step(x, y, F.cross_entropy)
    assert worst(pipe, expected) <= 1e-10
    # The recording hook ran on the real micro-batches, once each, and once more where a
    # micro-batch was recomputed.
    assert len(seen) == 3 + {"never": 0, "always": 3, "except_last": 2}[checkpoint]
    if checkpoint == "never":
        torch.testing.assert_close(torch.cat(seen), plain_rows, rtol=0, atol=1e-12)


def test_a_hooks_arithmetic_is_not_counted_twice():
    model = build()
    model.blocks[1].register_forward_hook(lambda m, args, out: out * 3)
    x, _ = batch()
    pipe = pipe_of(model, checkpoint="never")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)


def _full_backward(model):
    return model.blocks[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * 2,))


def _backward_pre(model):
    return model.blocks[1].register_full_backward_pre_hook(lambda m, go: (go[0] * 2,))


def _tensor(model):
    return model.blocks[1][0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))


def _post_accumulate(model):
    return model.head.bias.register_post_accumulate_grad_hook(lambda p: None)


def _on_the_model(model):
    return model.register_forward_hook(lambda m, args, out: out * 2)


def _global(model):
    return nn.modules.module.register_module_forward_hook(lambda m, args, out: None)


REFUSED = {
    "full backward hook": (_full_backward, "backward hook .* on blocks.1 \\(Sequential\\)"),
    "backward pre-hook": (_backward_pre, "backward pre-hook .* on blocks.1 \\(Sequential\\)"),
    "tensor hook": (_tensor, "tensor backward hook .* on tensor blocks.1.0.weight"),
    "post-accumulate hook": (_post_accumulate, "post-accumulate-grad hook .* head.bias"),
    "forward hook on the whole model": (_on_the_model, "forward hook .* on the model"),
    "global hook": (_global, "global forward hook .* every module"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_gradient_and_whole_model_hooks_are_refused_naming_hook_and_module(kind):
    register, message = REFUSED[kind]
    model = build()
    handle = register(model)
    try:
        with pytest.raises(CaptureError, match=message + ".*remove it"):
            pipe_of(model)
    finally:
        handle.remove()
    pipe_of(model)  # and built once removed


def test_a_hooked_module_that_cannot_be_one_call_is_refused():
    model = build()
    handle = model.blocks.register_forward_hook(lambda m, args, out: None)  # holds the splits
    with pytest.raises(CaptureError, match=r"forward hook .* on blocks .* holds split modules"):
        pipe_of(model)
    handle.remove()
    model.blocks[1][1].register_forward_hook(lambda m, args, out: None)
    # Tanh's operation is one call: kept, and exact.
    x, y = batch()
    pipe = pipe_of(model)
    pipe.step(x, y, F.cross_entropy)
    assert worst(pipe, plain_gradients(model, x, y)) <= 1e-10


class Twice(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) + x
        return self.head(torch.tanh(self.head.weight.T @ self.head(x).T).T)


def test_a_hooked_module_called_twice_is_refused():
    torch.manual_seed(0)
    model = Twice().double()
    model.head.register_forward_hook(lambda m, args, out: out + 1)
    with pytest.raises(CaptureError, match=r"forward hook .* on head \(Linear\).*runs twice"):
        pipe_of(model)


@pytest.mark.parametrize("register", [_full_backward, _tensor, _post_accumulate, _global])
def test_a_hook_added_after_capture_is_refused_at_the_next_call(register):
    model = build()
    pipe = pipe_of(model)
    x, y = batch()
    pipe.step(x, y, F.cross_entropy)
    handle = register(model)
    try:
        with pytest.raises(CaptureError, match=r"was added to .* after Pipe\.from_model"):
            pipe.step(x, y, F.cross_entropy)
        with pytest.raises(CaptureError, match=r"after Pipe\.from_model"):
            pipe(x)
    finally:
        handle.remove()
    for p in pipe.parameters():
        p.grad = None
    pipe.step(x, y, F.cross_entropy)  # removed: runs, exactly
    assert worst(pipe, plain_gradients(model, x, y)) <= 1e-10


def test_a_forward_hook_added_after_capture_is_refused():
    model = build()
    pipe = pipe_of(model)
    model.blocks[0].register_forward_hook(lambda m, args, out: out * 2)
    x, y = batch()
    said = r"forward hook .* added to blocks\.0 .* register it before"
    with pytest.raises(CaptureError, match=said):
        pipe.step(x, y, F.cross_entropy)
