"""Training scripts as a user writes them, run in the processes the tests launch.

Every rank runs the same script, as under torchrun; each returns plain data (its batches,
its gradients by whole-model name, its parameters) for the test to compare with the
un-split model trained the ordinary way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpipe
from gpipe.models import GPTConfig, gpt, gpt_tied_names, lm_loss

SAMPLES, BATCH, EPOCHS = 32, 8, 2
TIED_GPT = GPTConfig(vocab_size=32, context=8, d_model=16, n_heads=2, n_layers=2, dropout=0.0)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(SAMPLES, 5, generator=generator),
        torch.randint(0, 3, (SAMPLES,), generator=generator),
    )


def shuffled_loader_script(rank: int) -> dict:
    """A shuffled DataLoader and a global-generator augmentation; step(seed=None)."""
    torch.manual_seed(0)
    pipe = gpipe.Pipe(mlp(), balance=[2, 3], chunks=2, group=dist.group.WORLD)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    steps = []
    for _ in range(EPOCHS):
        for x, y in loader:
            x = x + 0.01 * torch.randn_like(x)  # augmentation from the global generator
            loss = pipe.step(x, y, F.cross_entropy)
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
            steps.append({"x": x, "y": y, "grads": grads, "loss": loss})
            optimizer.step()
            optimizer.zero_grad()
    return {"steps": steps}


def tied_gpt() -> nn.Sequential:
    torch.manual_seed(0)
    return gpt(TIED_GPT, tie_embeddings=True).double()


def tied_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    shape = (BATCH, TIED_GPT.context)
    return [
        (
            torch.randint(0, 32, shape, generator=generator),
            torch.randint(0, 32, shape, generator=generator),
        )
        for _ in range(steps)
    ]


def optimizer_before_pipe_script(rank: int, steps: int) -> dict:
    """The optimizer built from the model's parameters, then the Pipe with tied weights."""
    model = tied_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    pipe = gpipe.Pipe(
        model,
        balance=[2, 2],
        chunks=2,
        group=dist.group.WORLD,
        tied=[list(gpt_tied_names(TIED_GPT))],
    )
    losses = []
    for x, y in tied_batches(steps):
        losses.append(pipe.step(x, y, lm_loss))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
        "losses": losses,
    }


class Scaled(nn.Module):
    """A layer with parameters made in ``__init__`` (no reset_parameters)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.mix = nn.Parameter(torch.randn(width, width) * 0.1)
        self.register_buffer("mask", torch.tril(torch.ones(width, width)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ (self.mix * self.mask) * self.gain)


def custom_init_factory() -> nn.Sequential:
    """A factory that initializes as Hugging Face models do: normal(0, 0.02) everywhere."""
    model = nn.Sequential(
        nn.Embedding(32, 16), Scaled(16), nn.Linear(16, 16), Scaled(16), nn.Linear(16, 32)
    )

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    model.apply(init)
    return model.double()


def factory_script(rank: int) -> dict:
    """Each rank builds only its own layers from the factory."""
    pipe = gpipe.Pipe(
        custom_init_factory, balance=[2, 3], chunks=2, group=dist.group.WORLD, init_seed=11
    )
    return {n: t.detach().clone() for n, t in pipe.state_dict().items()}


def tied_adamw_script(rank: int | None, steps: int, freeze: bool, accumulate: int) -> dict:
    """Tied weights with AdamW (weight decay) built before the Pipe; the embedding frozen or
    not; ``accumulate`` pipe.step calls per optimizer step. Nothing reads the model between
    the last optimizer step and the state dict."""
    model = tied_gpt()
    model[0].token.weight.requires_grad_(not freeze)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    group = dist.group.WORLD if rank is not None else None
    pipe = gpipe.Pipe(
        model, balance=[2, 2], chunks=2, group=group, tied=[list(gpt_tied_names(TIED_GPT))]
    )
    tied_grads = []
    for step, (x, y) in enumerate(tied_batches(steps * accumulate)):
        pipe.step(x, y, lm_loss)
        if (step + 1) % accumulate == 0:
            every = dict(pipe.named_parameters(remove_duplicate=False))
            tied_grads.append({n: every[n].grad for n in gpt_tied_names(TIED_GPT) if n in every})
            optimizer.step()
            optimizer.zero_grad()
    state = {n: t.detach().clone() for n, t in pipe.state_dict().items()}
    return {"state": state, "tied_grads": tied_grads, "model": model if rank is None else None}


def train_plain_tied_adamw(steps: int, *, freeze: bool, accumulate: int) -> tuple[nn.Module, list]:
    """The un-split tied model trained as :func:`tied_adamw_script` trains it."""
    plain = tied_gpt()
    plain[0].token.weight.requires_grad_(not freeze)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step, (x, y) in enumerate(tied_batches(steps * accumulate)):
        lm_loss(plain(x), y).backward()
        if (step + 1) % accumulate == 0:
            grads.append(plain[0].token.weight.grad)
            optimizer.step()
            optimizer.zero_grad()
    return plain, grads


def clip_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(4)
    return [
        (torch.randn(8, 5, generator=generator), torch.randint(0, 3, (8,), generator=generator))
        for _ in range(steps)
    ]


def clipping_script(rank: int, variants: list[tuple[str, float, str]]) -> dict:
    """Each variant ``(edit, max_norm, layout)`` trains the MLP for 3 steps, editing the
    gradients between ``step`` and the optimizer step (``"torch"``:
    torch.nn.utils.clip_grad_norm_; ``"pipe"``: pipe.clip_grad_norm_; ``"halve"``: every
    gradient divided by 2). ``layout``: ``"pipeline"`` (2 ranks), ``"replicas"`` or
    ``"sharded"`` (2 replicas x 2 stages, 4 ranks). Returns, per variant, the error raised
    (if any), where (``(step, "step" or "optimizer")``) and the parameters."""
    outcomes = {}
    for edit, max_norm, layout in variants:
        options: dict = {"group": dist.group.WORLD}
        if layout != "pipeline":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
            options = {"group": mesh.get_group("pp"), "data_parallel_group": mesh.get_group("dp")}
            if layout == "sharded":
                options["shard"] = "params"
        pipe = gpipe.Pipe(mlp(), balance=[2, 3], chunks=2, **options)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
        error = where = None
        try:
            for step, (x, y) in enumerate(clip_batches(3)):
                where = (step, "step")
                pipe.step(x, y, F.cross_entropy)
                if edit == "torch":
                    torch.nn.utils.clip_grad_norm_(pipe.parameters(), max_norm)
                elif edit == "pipe":
                    pipe.clip_grad_norm_(max_norm)
                else:
                    for p in pipe.parameters():
                        p.grad.div_(2)
                where = (step, "optimizer")
                optimizer.step()
                optimizer.zero_grad()
            where = None
        except Exception as raised:  # the test reads what was raised
            error = f"{type(raised).__name__}: {raised}"
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        if layout == "sharded":
            params = pipe.full_state_dict()
        outcomes[(edit, max_norm, layout)] = {"error": error, "where": where, "params": params}
    return outcomes


class _Overflow(torch.autograd.Function):
    """x + p; backward puts an infinity into p's gradient (the head's overflow) while armed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: torch.Tensor, armed: bool) -> torch.Tensor:
        ctx.armed = armed
        return x + p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_p = grad.sum(0) * (float("inf") if ctx.armed else 1.0)
        return grad, grad_p, None


class OverflowsWhenArmed(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Overflow.apply(x, self.bias, self.armed)


SCALER_STEPS, OVERFLOW_STEP = 4, 1


def scaler_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), OverflowsWhenArmed(16), nn.Tanh(),
        nn.Linear(16, 3),
    ).double()  # fmt: skip


def new_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)


def scaler_script(rank: int | None) -> dict:
    """Mixed precision's recipe (the model in float64: only the scaler's logic is under
    test): step(scaler=), unscale, the Pipe's clip, scaler.step and update. The last
    stage's gradients overflow at OVERFLOW_STEP, the first stage's do not."""
    model = scaler_model()
    group = dist.group.WORLD if rank is not None else None
    pipe = gpipe.Pipe(model, balance=[3, 3], chunks=2, group=group)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = new_scaler()
    losses, scales = [], []
    for step, (x, y) in enumerate(clip_batches(SCALER_STEPS)):
        model[3].armed = step == OVERFLOW_STEP  # a meta layer elsewhere: harmless
        losses.append(float(pipe.step(x.double(), y, F.cross_entropy, scaler=scaler)))
        scaler.unscale_(optimizer)
        pipe.clip_grad_norm_(1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return {"params": params, "losses": losses, "scales": scales}
