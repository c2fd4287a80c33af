"""Ordinary user scripts with their own optimizer and its tools, each compared with plain
PyTorch training, per parameter, over several steps: tied weights and an optimizer built
first, a frozen tie, torch's clip_grad_norm_ and float16's GradScaler on a Pipe.

(A step's random state: test_stepping; layers that write their input: engine/test_stage,
their buffers: engine/test_state; padded token means: engine/test_loss; a factory's own
initialization: test_assembly.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import captured_models
import gpipe
import user_scripts
from gpipe.models import gpt_tied_names, lm_loss
from reference import relative_error

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
MODES = ["always", "except_last", "never"]


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
