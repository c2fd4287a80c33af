"""One step of a Pipe: its random numbers, its loss and its reads of the host."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpipe
import user_scripts
from gpipe.models import GPTConfig, gpt, lm_loss, mlp
from pipe.test_pipe import make_case
from reference import relative_error

# -- the step seed leaves every rank's global generator where the others' is ----------------


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_shuffled_dataloader_feeds_every_rank_the_same_batch():
    """Rank 0 (inputs) and rank 1 (targets) draw their batches from their own global
    generators: with step(seed=None) those must advance alike, or the last stage scores
    one batch's outputs against another batch's targets."""
    ranks = gpipe.launch(user_scripts.shuffled_loader_script, nprocs=2, timeout=60)
    first, last = ranks[0]["steps"], ranks[1]["steps"]
    assert len(first) == len(last) == user_scripts.EPOCHS * user_scripts.SAMPLES // 8
    plain = user_scripts.mlp()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step, (a, b) in enumerate(zip(first, last, strict=True)):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"]), step
        loss = F.cross_entropy(plain(a["x"]), a["y"])
        loss.backward()
        assert a["loss"].dtype == b["loss"].dtype == torch.float64  # the same on every rank
        assert relative_error(b["loss"], loss.detach()) < 1e-6, step
        grads = {**a["grads"], **b["grads"]}
        for name, param in plain.named_parameters():
            assert relative_error(grads[name], param.grad) < 1e-5, (step, name)
        optimizer.step()
        optimizer.zero_grad()


def test_the_loss_is_float64_in_one_process_too():
    pipe = gpipe.Pipe(user_scripts.mlp(), balance=[2, 3], chunks=2)
    loss = pipe.step(torch.randn(4, 5), torch.randint(0, 3, (4,)), F.cross_entropy)
    assert loss.dtype == torch.float64 and not loss.requires_grad


def test_step_restores_global_rng_when_seeded():
    model, x, y, loss_fn = make_case("gpt", torch.float64)
    pipe = gpipe.Pipe(model, balance=[2, 2], chunks=2)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    pipe.step(x, y, loss_fn, seed=3)
    assert torch.equal(torch.get_rng_state(), before)


def test_unseeded_steps_follow_torch_manual_seed():
    model, x, y, loss_fn = make_case("gpt", torch.float64)
    pipe = gpipe.Pipe(model, balance=[2, 2], chunks=2)
    torch.manual_seed(7)
    first = pipe.step(x, y, loss_fn)
    torch.manual_seed(7)
    again = pipe.step(x, y, loss_fn)
    different = pipe.step(x, y, loss_fn)
    assert first == again
    assert first != different


# -- reads of the host: one per step ---------------------------------------------------------

_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


class HostReads:
    """Counts the reads of tensor values into Python during ``pipe.step`` (on an
    accelerator each one waits for the device), leaving out the step seed's draw from
    torch's CPU generator, which never waits for a device."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        self.where: list[str] = []
        self._drawing = False
        for name in _READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, original))
        draw = gpipe.base.rng.draw_step_seed

        def drawing() -> int:
            self._drawing = True
            try:
                return draw()
            finally:
                self._drawing = False

        monkeypatch.setattr(gpipe.base.rng, "draw_step_seed", drawing)

    def _counted(self, name, original):
        def read(tensor, *args, **kwargs):
            if not self._drawing:
                self.count += 1
                self.where.append(name)
            return original(tensor, *args, **kwargs)

        return read


def _token_batch():
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(0, 32, (8, 8), generator=generator)
    labels = x.clone()
    labels[:, 6:] = -100
    return x, labels


@pytest.mark.parametrize(
    ("loss", "schedule", "checkpoint", "balance"),
    [
        ("mse", "gpipe", "except_last", [7]),
        ("mse", "1f1b", "never", [4, 3]),
        ("cross_entropy", "zb-h1", "always", [2, 2]),
        ("causal_lm", "gpipe", "always", [1, 2, 1]),
        ("causal_lm", "interleaved-1f1b", "never", [1, 1, 1, 1]),
    ],
)
def test_a_step_reads_the_host_once(monkeypatch, loss, schedule, checkpoint, balance):
    # The loss, the non-finite check and the -100 warning's check share one read.
    torch.manual_seed(0)
    if loss == "mse":
        model = mlp([8, 16, 16, 16, 4])
        x, y = torch.randn(8, 8), torch.randn(8, 4)
        loss_fn = F.mse_loss
    else:
        model = gpt(GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=2))
        x, y = _token_batch()
        loss_fn = gpipe.losses.causal_lm() if loss == "causal_lm" else lm_loss
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    pipe = gpipe.Pipe(
        model, balance=balance, devices=["cpu"] * (len(balance) // virtual), chunks=4,
        schedule=schedule, checkpoint=checkpoint, virtual_stages=virtual,
    )  # fmt: skip
    pipe.step(x, y, loss_fn)  # the first step learns what it learns once
    reads = HostReads(monkeypatch)
    for _ in range(3):
        loss_value = pipe.step(x, y, loss_fn)
        pipe.zero_grad()
    assert reads.count <= 3, reads.where
    assert torch.isfinite(loss_value)
