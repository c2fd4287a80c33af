"""Ordinary user scripts, each compared with plain PyTorch training, per parameter, over
several steps: the ways a script could train another model than the un-split one without an
error (shared random state, tied weights and an optimizer built first, layers that write to
their input, padded token means) and the small API traps around them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import captured_models
import gpipe
import user_scripts
from gpipe.models import convnet, gpt, gpt_tied_names, lm_loss
from reference import reference_step, relative_error

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
MODES = ["always", "except_last", "never"]


# -- 1. the step seed leaves every rank's global generator where the others' is ----------------


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


# -- 2. tied weights: the caller's Parameter stays the one its optimizer holds ----------------


def _train_plain_tied(steps: int) -> nn.Sequential:
    plain = user_scripts.tied_gpt()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    for x, y in user_scripts.tied_batches(steps):
        lm_loss(plain(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return plain


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer-first", "pipe-first"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["one-step", "accumulate-2"])
def test_tied_weights_train_the_same_model_whenever_the_optimizer_is_built(
    optimizer_first, accumulate
):
    steps = 4
    plain = user_scripts.tied_gpt()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    model = copy.deepcopy(plain)
    if optimizer_first:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    pipe = gpipe.Pipe(
        model, balance=[2, 2], chunks=2, tied=[list(gpt_tied_names(user_scripts.TIED_GPT))]
    )
    if not optimizer_first:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    batches = user_scripts.tied_batches(steps * accumulate)
    for step in range(steps):
        for x, y in batches[step * accumulate : (step + 1) * accumulate]:
            lm_loss(plain(x), y).backward()
            pipe.step(x, y, lm_loss)
        for name, param in plain.named_parameters():
            ours = dict(pipe.named_parameters())[name]
            assert relative_error(ours.grad, param.grad) < 1e-10, (step, name)
        plain_opt.step()
        optimizer.step()
        plain_opt.zero_grad()
        optimizer.zero_grad()
    with torch.no_grad():  # a forward uses (and refreshes) every copy
        x = batches[0][0]
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-10, atol=1e-10)
    theirs = plain.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) < 1e-10, name


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_tied_weights_with_the_optimizer_built_first_across_processes():
    steps = 4
    ranks = gpipe.launch(
        user_scripts.optimizer_before_pipe_script, nprocs=2, args=(steps,), timeout=60
    )
    plain = dict(_train_plain_tied(steps).named_parameters(remove_duplicate=False))
    for rank in ranks:
        for name, value in rank["params"].items():
            assert relative_error(value, plain[name]) < 1e-10, name
    embedding, head = gpt_tied_names(user_scripts.TIED_GPT)
    assert embedding in ranks[0]["params"] and head in ranks[1]["params"]


# -- 3. layers that write to their input ------------------------------------------------------


class Shift(nn.Module):
    """In-model preprocessing that changes its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sub_(0.5)


def in_place_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        Shift(),
        nn.Linear(6, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.Dropout(0.2),
        nn.ReLU(inplace=True),
        nn.Linear(16, 4),
    ).double()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[2, 3, 2], [2, 1, 4], [1, 4, 2]])  # ReLU(inplace) first
def test_layers_that_write_to_their_input_train_as_in_the_plain_model(
    schedule, checkpoint, balance
):
    plain = in_place_model()
    pipe = gpipe.Pipe(
        copy.deepcopy(plain), balance=balance, chunks=4, checkpoint=checkpoint, schedule=schedule
    )
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=generator)
        caller = x.clone()
        loss = pipe.step(caller, y, F.cross_entropy, seed=step)
        assert torch.equal(caller, x)  # the caller's batch is not changed, let alone twice
        expected = reference_step(plain, x.clone(), y, F.cross_entropy, chunks=4, seed=step)
        assert relative_error(loss, expected) < 1e-10
        for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
            assert relative_error(ours.grad, theirs.grad) < 1e-10, (step, name)
            ours.grad, theirs.grad = None, None


# -- 5. a token mean over a padded batch ---------------------------------------------------


def token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_padded_token_mean_is_exact_with_count(schedule):
    config = user_scripts.TIED_GPT
    torch.manual_seed(0)
    plain = gpt(config).double()
    pipe = gpipe.Pipe(copy.deepcopy(plain), balance=[2, 2], chunks=4, schedule=schedule)
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(0, 32, (8, 8), generator=generator)
    y = torch.randint(0, 32, (8, 8), generator=generator)
    lengths = torch.tensor([8, 1, 2, 8, 5, 3, 8, 7])  # micro-batch 1 is mostly padding
    y[torch.arange(8)[None, :] >= lengths[:, None]] = -100
    y[2:4] = -100  # and micro-batch 1 holds no token at all
    token_loss(plain(x), y).backward()
    loss = pipe.step(x, y, token_loss, count=lambda t: (t != -100).sum())
    assert torch.isfinite(loss)
    for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        assert relative_error(ours.grad, theirs.grad) < 1e-10, name


def test_count_is_checked():
    pipe = gpipe.Pipe(user_scripts.mlp(), balance=[2, 3], chunks=2)
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match=r"count.* > 0 in all"):
        pipe.step(x, y, F.cross_entropy, count=lambda t: 0)
    with pytest.raises(ValueError, match="use reduction='mean'"):
        pipe.step(x, y, F.cross_entropy, reduction="sum", count=len)


# -- small traps ----------------------------------------------------------------------------


def test_interleaved_defaults_to_two_stages_per_device_and_refuses_one():
    model = user_scripts.mlp()
    pipe = gpipe.Pipe(model, balance=[1, 1, 1, 2], chunks=4, schedule="interleaved-1f1b")
    assert pipe.virtual_stages == 2 and len(pipe.devices) == 2
    with pytest.raises(gpipe.PartitionError, match=r"virtual_stages=1.*with 1 it is plain '1f1b'"):
        gpipe.Pipe(model, balance=[2, 3], chunks=4, schedule="interleaved-1f1b", virtual_stages=1)


def test_one_micro_batch_on_several_devices_says_there_is_no_pipelining():
    with pytest.warns(UserWarning, match=r"chunks=1\) on 2 devices"):
        gpipe.Pipe(user_scripts.mlp(), balance=[2, 3])


def test_the_loss_is_float64_in_one_process_too():
    pipe = gpipe.Pipe(user_scripts.mlp(), balance=[2, 3], chunks=2)
    loss = pipe.step(torch.randn(4, 5), torch.randint(0, 3, (4,)), F.cross_entropy)
    assert loss.dtype == torch.float64 and not loss.requires_grad


# -- 4. a factory's own initialization -------------------------------------------------------


def _eager(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return user_scripts.custom_init_factory()


@pytest.mark.parametrize("balance", [[1, 4], [2, 3], [3, 1, 1], [1, 1, 1, 1, 1]])
def test_a_factory_builds_what_the_factory_builds(balance):
    eager = _eager(11)
    pipe = gpipe.Pipe(user_scripts.custom_init_factory, balance=balance, chunks=2, init_seed=11)
    theirs = eager.state_dict()
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    assert abs(float(theirs["0.weight"].std()) - 0.02) < 0.005  # the factory's own init
    x, y = torch.randint(0, 32, (4, 3)), torch.randint(0, 32, (4, 3))
    lm_loss(eager(x), y).backward()
    pipe.step(x, y, lm_loss)
    for (name, ours), theirs_param in zip(pipe.named_parameters(), eager.parameters(), strict=True):
        assert relative_error(ours.grad, theirs_param.grad) < 1e-10, name


def test_a_factory_is_recorded_once_and_its_record_dropped(monkeypatch):
    # The record holds every operation of the whole model: each process makes it once and
    # keeps none of it once its own layers are built (docs/capacity.md).
    import weakref

    from gpipe import assembly

    records = []

    def recording(factory, **options):
        model, record = original(factory, **options)
        records.append(weakref.ref(record))
        return model, record

    original = assembly.record_model
    monkeypatch.setattr(assembly, "record_model", recording)
    pipe = gpipe.Pipe(user_scripts.custom_init_factory, balance=[2, 3], chunks=2, init_seed=11)
    assert len(records) == 1 and records[0]() is None
    theirs = _eager(11).state_dict()
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, theirs[name]), name


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_each_process_builds_its_layers_as_the_factory_does():
    ranks = gpipe.launch(user_scripts.factory_script, nprocs=2, timeout=60)
    theirs = _eager(11).state_dict()
    assert set(ranks[0]) | set(ranks[1]) == set(theirs)
    for rank in ranks:
        for name, value in rank.items():
            assert torch.equal(value, theirs[name]), name


def test_deferred_batch_norm_keeps_the_parameters_an_optimizer_was_built_with():
    torch.manual_seed(0)
    plain = convnet(channels=4, blocks=2).double()
    model = copy.deepcopy(plain)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # before the Pipe
    pipe = gpipe.Pipe(model, balance=[4, 4], chunks=2, deferred_batch_norm=True)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(6, 1, 6, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 10, (6,), generator=generator)
        reference_step(plain, x, y, F.cross_entropy, chunks=2, seed=step)
        pipe.step(x, y, F.cross_entropy, seed=step)
        plain_opt.step()
        optimizer.step()
        plain_opt.zero_grad()
        optimizer.zero_grad()
    for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
        assert relative_error(ours, theirs) < 1e-10, name


# -- issue 27, 1: layers that write their own buffers (spectral norm, a moving average) ---------


class MovingAverage(nn.Module):
    """Subtracts a running mean it updates in forward; skips the update when recomputing,
    as the docs once advised."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and not gpipe.is_recomputing():
            with torch.no_grad():
                self.mean.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return x - self.mean


class CountCalls(nn.Module):
    """A naive counter buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def stateful_model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    middle = {
        "spectral-norm": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)),
        "moving-average": lambda: MovingAverage(16),
    }[kind]()
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), middle, CountCalls(), nn.Tanh(), nn.Linear(16, 4)
    ).double()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("kind", ["spectral-norm", "moving-average"])
def test_layers_that_write_their_buffers_train_as_in_the_plain_model(kind, checkpoint, schedule):
    """The recomputation starts from the buffers the first forward found, and every forward
    writes them once, in order, as plain gradient accumulation does."""
    plain = stateful_model(kind)
    pipe = gpipe.Pipe(
        copy.deepcopy(plain), balance=[2, 4], chunks=4, checkpoint=checkpoint, schedule=schedule
    )
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=generator)
        reference_step(plain, x, y, F.cross_entropy, chunks=4, seed=step)
        pipe.step(x, y, F.cross_entropy, seed=step)
        for (name, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
            assert relative_error(ours.grad, theirs.grad) < 1e-10, (step, name)
        plain_opt.step()
        optimizer.step()
        plain_opt.zero_grad()
        optimizer.zero_grad()
    theirs = plain.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) < 1e-10, name
    assert int(pipe.state_dict()["3.calls"]) == 3 * 4  # once per micro-batch


class SpectralNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(
            [nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)) for _ in range(3)]
        )
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def test_a_captured_spectral_norm_model_trains_as_in_the_plain_model():
    torch.manual_seed(0)
    plain = SpectralNet().double()
    example = (torch.randn(2, 6, dtype=torch.float64),)
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(plain), example, split="blocks", balance=[2, 3], chunks=4
    )
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=generator)
        for x_m, y_m in zip(x.tensor_split(4), y.tensor_split(4), strict=True):
            (F.cross_entropy(plain(x_m), y_m) / 4).backward()
        pipe.step(x, y, F.cross_entropy)
        ours = dict(pipe.named_parameters())
        for name, theirs in plain.named_parameters():
            assert relative_error(ours[name].grad, theirs.grad) < 1e-10, (step, name)
            ours[name].grad, theirs.grad = None, None
    theirs = plain.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) < 1e-10, name


class CountsInAParameter(nn.Linear):
    """A step counter kept in a frozen Parameter: gpipe can restore buffers, not this."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


def test_a_forward_that_writes_a_parameter_is_refused_under_remat():
    model = nn.Sequential(nn.Linear(5, 8), CountsInAParameter(8, 8), nn.Linear(8, 3))
    x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    never = gpipe.Pipe(copy.deepcopy(model), balance=[2, 1], chunks=2, checkpoint="never")
    never.step(x, y, F.cross_entropy)
    assert int(never.state_dict()["1.calls"]) == 2  # the remedy: once per micro-batch
    pipe = gpipe.Pipe(model, balance=[2, 1], chunks=2)
    with pytest.raises(RuntimeError, match=r"writes parameters in place \(1\.calls\).*'never'"):
        pipe.step(x, y, F.cross_entropy)


# -- issue 27, 2 and 3: a frozen tie keeps grad None; copies equal whenever the user reads them --


def _tied_adamw_ranks(processes: int, steps: int, *, freeze: bool, accumulate: int) -> list:
    args = (steps, freeze, accumulate)
    if processes == 1:
        return [user_scripts.tied_adamw_script(None, *args)]
    return gpipe.launch(user_scripts.tied_adamw_script, nprocs=2, args=args, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.slow
def test_a_frozen_tied_weight_keeps_no_gradient(processes):
    """AdamW's weight decay must not move a frozen tied weight (a zero .grad would)."""
    steps = 3
    plain, _ = user_scripts.train_plain_tied_adamw(steps, freeze=True, accumulate=1)
    ranks = _tied_adamw_ranks(processes, steps, freeze=True, accumulate=1)
    theirs = plain.state_dict()
    for rank in ranks:
        assert all(g is None for step in rank["tied_grads"] for g in step.values())
        for name, value in rank["state"].items():
            assert relative_error(value, theirs[name]) < 1e-10, name
    embedding, _ = gpt_tied_names(user_scripts.TIED_GPT)
    assert torch.equal(
        ranks[0]["state"][embedding], user_scripts.tied_gpt().state_dict()[embedding]
    )


@pytest.mark.skipif(captured_models.transformers is None, reason="needs transformers")
def test_a_frozen_hugging_face_tied_embedding_keeps_no_gradient():
    case = captured_models.CASES["hf-gpt2"]  # wte and lm_head: one tensor, found by capture
    plain = case.build()
    plain.transformer.wte.weight.requires_grad_(False)
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(plain), case.example(), split=case.split, balance=[2, 3], chunks=4
    )
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (pipe, plain)
    ]
    for step in range(2):
        x, y = case.batch(step)
        case.loss(plain(x), y).backward()
        pipe.step(x, y, case.loss)
        every = dict(pipe.named_parameters(remove_duplicate=False))
        assert every["transformer.wte.weight"].grad is None
        assert every["lm_head.weight"].grad is None
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    theirs = plain.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) < 1e-10, name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.slow
def test_tied_copies_are_equal_right_after_the_optimizer_step(processes):
    """Optimizer built before the Pipe, gradients accumulated over two steps: after the
    last optimizer step (no forward since) the state dict and the caller's model are the
    plain model's."""
    steps = 3
    plain, plain_grads = user_scripts.train_plain_tied_adamw(steps, freeze=False, accumulate=2)
    ranks = _tied_adamw_ranks(processes, steps, freeze=False, accumulate=2)
    theirs = plain.state_dict()
    for rank in ranks:
        for name, value in rank["state"].items():
            assert relative_error(value, theirs[name]) < 1e-10, name
        for step, grads in enumerate(rank["tied_grads"]):
            for name, grad in grads.items():
                assert relative_error(grad, plain_grads[step]) < 1e-10, (step, name)
    if processes == 1:
        x = user_scripts.tied_batches(1)[0][0]
        with torch.no_grad():
            torch.testing.assert_close(ranks[0]["model"](x), plain(x), rtol=1e-10, atol=1e-10)


# -- issue 27, 4: torch.nn.utils.clip_grad_norm_ on a Pipe -----------------------------------------


def _train_plain_clipped(edit: str, max_norm: float) -> dict:
    plain = user_scripts.mlp()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    for x, y in user_scripts.clip_batches(3):
        F.cross_entropy(plain(x), y).backward()
        if edit == "halve":
            for p in plain.parameters():
                p.grad.div_(2)
        else:
            torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad()
    return dict(plain.named_parameters())


def _between_stage_norms() -> float:
    """A max_norm above each stage's first gradient norm but below the whole model's."""
    plain = user_scripts.mlp()
    x, y = user_scripts.clip_batches(1)[0]
    F.cross_entropy(plain(x), y).backward()
    stages = [[p.grad for p in plain[:2].parameters()], [p.grad for p in plain[2:].parameters()]]
    norms = [torch.cat([g.flatten() for g in grads]).norm().item() for grads in stages]
    whole = (norms[0] ** 2 + norms[1] ** 2) ** 0.5
    return (max(norms) + whole) / 2


def test_torch_clip_grad_norm_in_one_process_with_tied_weights_clips_the_whole_model():
    plain = user_scripts.tied_gpt()
    model = copy.deepcopy(plain)
    pipe = gpipe.Pipe(
        model, balance=[2, 2], chunks=2, tied=[list(gpt_tied_names(user_scripts.TIED_GPT))]
    )
    optimizer, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (pipe, plain))
    for x, y in user_scripts.tied_batches(3):
        lm_loss(plain(x), y).backward()
        pipe.step(x, y, lm_loss)
        expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        norm = torch.nn.utils.clip_grad_norm_(pipe.parameters(), 0.05)
        assert relative_error(norm, expected) < 1e-10
        plain_opt.step()
        optimizer.step()
        plain_opt.zero_grad()
        optimizer.zero_grad()
    theirs = plain.state_dict()
    for name, value in pipe.state_dict().items():
        assert relative_error(value, theirs[name]) < 1e-10, name


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_torch_clip_grad_norm_across_processes_is_refused_and_the_pipes_clips_exactly():
    """Per-stage clipping (each rank by its own norm) is refused inside the optimizer step it
    would change, the first one (no step after it needed: a run's last is checked too), also
    when no stage reaches max_norm but the whole model does; pipe.clip_grad_norm_ and a
    rescale that is the same on every rank train the un-split model."""
    between = _between_stage_norms()
    variants = [("torch", 0.3), ("torch", between), ("pipe", between), ("pipe", 10.0)]
    variants = [(*variant, "pipeline") for variant in [*variants, ("halve", 0.0)]]
    outcomes = gpipe.launch(user_scripts.clipping_script, nprocs=2, args=(variants,), timeout=90)
    for edit, max_norm, layout in variants:
        ranks = [outcome[(edit, max_norm, layout)] for outcome in outcomes]
        if edit == "torch":
            untrained = dict(user_scripts.mlp().named_parameters())
            for rank in ranks:
                assert rank["error"].startswith("ClippedPerStageError"), rank["error"]
                assert "pipe.clip_grad_norm_(max_norm)" in rank["error"]
                assert rank["where"] == (0, "optimizer")
                for name, value in rank["params"].items():  # no weight changed
                    assert torch.equal(value, untrained[name]), (max_norm, name)
            continue
        theirs = _train_plain_clipped(edit, max_norm)
        for rank in ranks:
            assert rank["error"] is None
            for name, value in rank["params"].items():
                assert relative_error(value, theirs[name]) < 1e-6, (edit, name)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_torch_clip_grad_norm_with_replicas_is_refused():
    """Before the first optimizer step, also where no stage's own norm reaches max_norm
    (replicas; sharded gradients cannot show that case, README's Traps)."""
    between = _between_stage_norms()
    variants = [
        ("torch", 0.3, "replicas"), ("torch", between, "replicas"), ("torch", 0.3, "sharded")
    ]  # fmt: skip
    outcomes = gpipe.launch(user_scripts.clipping_script, nprocs=4, args=(variants,), timeout=120)
    for outcome in outcomes:
        for variant in variants:
            assert outcome[variant]["error"].startswith("ClippedPerStageError"), variant
            assert outcome[variant]["where"] == (0, "optimizer"), variant


# -- issue 27, 5: token means over padded batches -------------------------------------------------


def _padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (8, 8), generator=generator)
    labels = torch.randint(0, 32, (8, 8), generator=generator)
    lengths = torch.tensor([8, 1, 2, 8, 5, 3, 8, 7])
    labels[torch.arange(8)[None, :] >= lengths[:, None]] = -100
    labels[2:4] = -100  # micro-batch 1 (of 4) holds no label that counts
    return x, labels


@pytest.mark.parametrize("name", ["causal_lm", "masked_lm"])
def test_padded_token_means_of_gpipe_losses_train_as_in_the_plain_model(name):
    loss_fn = getattr(gpipe.losses, name)()
    torch.manual_seed(0)
    plain = gpt(user_scripts.TIED_GPT).double()
    pipe = gpipe.Pipe(copy.deepcopy(plain), balance=[2, 2], chunks=4)
    optimizer, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (pipe, plain))
    for step in range(2):
        x, labels = _padded_batch(step)
        expected = loss_fn(plain(x), labels)  # the whole batch's token mean
        expected.backward()
        loss = pipe.step(x, labels, loss_fn)
        assert relative_error(loss, expected.detach()) < 1e-10
        for (name_, ours), theirs in zip(pipe.named_parameters(), plain.parameters(), strict=True):
            assert relative_error(ours.grad, theirs.grad) < 1e-10, (step, name_)
        plain_opt.step()
        optimizer.step()
        plain_opt.zero_grad()
        optimizer.zero_grad()


@pytest.mark.skipif(captured_models.transformers is None, reason="needs transformers")
def test_causal_lm_gives_a_hugging_face_models_own_labels_loss():
    case = captured_models.CASES["hf-llama"]
    plain = case.build()
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(plain), case.example(), split=case.split, balance=[2, 3], chunks=4
    )
    x, labels = _padded_batch(0)
    own = plain(input_ids=x, labels=labels).loss  # shifted inside, averaged in float32
    expected = gpipe.losses.causal_lm()(plain(input_ids=x), labels)  # the same, in float64
    assert relative_error(expected.detach(), own.detach()) < 1e-6
    expected.backward()
    loss = pipe.step(x, labels, gpipe.losses.causal_lm())
    assert relative_error(loss, expected.detach()) < 1e-10
    ours = dict(pipe.named_parameters())
    for name, theirs in plain.named_parameters():
        assert relative_error(ours[name].grad, theirs.grad) < 1e-10, name


def test_a_padded_mean_without_count_warns_once_and_an_empty_micro_batch_says_why():
    torch.manual_seed(0)
    pipe = gpipe.Pipe(gpt(user_scripts.TIED_GPT).double(), balance=[2, 2], chunks=4)
    x, labels = _padded_batch(0)
    full = labels.clone()
    full[full == -100] = 0  # nothing ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, full, token_loss)  # no -100: a sample mean is the token mean
        pipe.step(x, labels, token_loss, count=lambda t: (t != -100).sum())
    labels[2:4] = 5  # every micro-batch counts something
    with pytest.warns(UserWarning, match=r"count=lambda y: \(y != -100\)\.sum\(\).*gpipe\.losses"):
        pipe.step(x, labels, token_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, labels, token_loss)  # once per Pipe
    x, labels = _padded_batch(0)
    with pytest.raises(
        gpipe.NonFiniteError, match=r"micro-batch 1's targets are all below 0.*count="
    ):
        pipe.step(x, labels, token_loss)


# -- issue 27, 6: float16's GradScaler -------------------------------------------------------------


def _train_plain_scaled() -> tuple[dict, list, list]:
    plain = user_scripts.scaler_model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    scaler = user_scripts.new_scaler()
    losses, scales = [], []
    for step, (x, y) in enumerate(user_scripts.clip_batches(user_scripts.SCALER_STEPS)):
        plain[3].armed = step == user_scripts.OVERFLOW_STEP
        total = 0.0
        for x_m, y_m in zip(x.double().tensor_split(2), y.tensor_split(2), strict=True):
            loss = F.cross_entropy(plain(x_m), y_m) * len(x_m) / len(x)
            scaler.scale(loss).backward()
            total += float(loss.detach())
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        losses.append(total)
        scales.append(scaler.get_scale())
    return dict(plain.named_parameters()), losses, scales


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.slow
def test_a_grad_scaler_skips_an_overflowing_step_on_every_rank_as_in_the_plain_model(processes):
    """The step's gradients overflow on the last stage's rank only: every rank's scaler
    skips it and lowers its scale, as the plain model's does; step returns the unscaled
    loss."""
    theirs, losses, scales = _train_plain_scaled()
    if processes == 1:
        ranks = [user_scripts.scaler_script(None)]
    else:
        ranks = gpipe.launch(user_scripts.scaler_script, nprocs=2, timeout=60)
    assert scales[user_scripts.OVERFLOW_STEP] < scales[user_scripts.OVERFLOW_STEP - 1]
    for rank in ranks:
        assert rank["scales"] == scales
        assert rank["losses"] == pytest.approx(losses, rel=1e-12)
        for name, value in rank["params"].items():
            assert relative_error(value, theirs[name]) < 1e-10, name
