"""A non-finite loss or gradient: the step is refused on every rank and changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
import gpipe.train.checkpoint as ckpt
from gpipe.parallel.launch import launch
from injected_faults import Overflows, nonfinite

pytestmark = pytest.mark.timeout(200)  # multi-process: a hang fails


@pytest.mark.parametrize("where", ["input", "gradient"])
def test_a_non_finite_step_is_refused_and_changes_no_gradient(where):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)]
    if where == "gradient":
        layers.insert(2, Overflows())
    pipe = gpipe.Pipe(nn.Sequential(*layers), balance=[2, len(layers) - 2], chunks=2)
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    if where == "gradient":  # a clean first step needs the overflow out of the way
        before = {n: None for n, _ in pipe.named_parameters()}
    else:
        pipe.step(x, y, F.cross_entropy)
        before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        x = x.clone()
        x[1, 2] = float("nan")
    with pytest.raises(gpipe.NonFiniteError, match="the step was refused") as info:
        pipe.step(x, y, F.cross_entropy)
    if where == "gradient":
        assert "a non-finite gradient of '0.weight'" in str(info.value)
    for name, p in pipe.named_parameters():
        assert (p.grad is None and before[name] is None) or torch.equal(p.grad, before[name])


class Huge(nn.Module):
    """Scales the gradient passing back through it by 1e20: finite, but its square is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e20 + (x - x * 1e20).detach()  # the value of x, the gradient 1e20 x


def test_a_finite_gradient_whose_norm_passes_float32_is_not_refused():
    # The per-step check sums squares in float32 (fast); such a norm reads as infinite and
    # must be summed again in float64 before it refuses anything.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Huge(), nn.Linear(4, 3))
    pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2)
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    loss = pipe.step(x, y, F.mse_loss)
    assert torch.isfinite(loss)
    grad = dict(pipe.named_parameters())["0.weight"].grad
    assert torch.isfinite(grad).all() and not torch.isfinite(grad.float().pow(2).sum())
    assert torch.isfinite(grad.double().norm())


@pytest.mark.parametrize("where", ["input", "gradient"])
@pytest.mark.slow
def test_a_non_finite_step_is_refused_on_every_rank(where):
    outcomes = launch(nonfinite, 2, args=(where,), timeout=30)
    for outcome in outcomes:
        assert outcome["type"] == "NonFiniteError", outcome
        assert all(g is None for g in outcome["grads"])  # nothing reaches the weights
        if where == "gradient":
            assert "rank 0: a non-finite gradient of '0.weight'" in outcome["message"]
        else:
            assert "the loss is nan" in outcome["message"]


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_non_finite_steps_are_refused_and_the_last_checkpoint_stays_good(in_process, tmp_path):
    out = tmp_path / "nf"
    done = in_process(
        "train", "--size", "tiny", "--steps", "4", "--lr", "1e30", "--warmup", "0",
        "--grad-clip", "0", "--save-every", "1", "--skip-nonfinite", "1", "--out", str(out),
        "--sample-tokens", "0",
    )  # fmt: skip
    assert done.returncode == 1
    assert "step 2 (1 refused in all): the step was refused" in done.stdout
    assert "step 3 (2 refused in all)" in done.stdout  # one skipped, the second stops the run
    assert "failed in rank" in done.stderr and "NonFiniteError" in done.stderr
    manifest = ckpt.read_manifest(out)
    assert manifest.step == 1  # the last good step
    state = ckpt.export_state_dict(out)
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
