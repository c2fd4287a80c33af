"""Any model as it is: captured, cut, pipelined, and trained exactly as the model itself.

Every case compares each parameter's gradient with the plain model's on the same micro-batches
(tests/captured_models.py builds the models: Hugging Face GPT-2, Llama, BERT, a torchvision-
style ResNet, a model whose skips jump cuts).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe
from captured_models import (
    CASES,
    HF,
    Blocks,
    Case,
    captured,
    captured_steps,
    reference_gradients,
    transformers,
    worst_error,
)
from gpipe.frontend import CaptureError, capture, split_points
from gpipe.layout import even_balance
from gpipe.parallel.launch import launch
from reference import running_stats_of_unsplit_batch

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]
REMAT = ["always", "except_last", "never"]


def needs(name: str):
    return pytest.mark.skipif(
        name in HF and transformers is None, reason="transformers (gpipe[hf]) not installed"
    )


MODELS = [pytest.param(name, marks=needs(name)) for name in CASES]


def assert_trains_as(model, pipe, case, inputs, targets, tolerance=1e-10):
    """One pipelined step gives the plain model's gradients on the same micro-batches."""
    loss = pipe.step(inputs, targets, case.loss)
    _, grads, _ = reference_gradients(case, model, inputs, targets, pipe.chunks)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= tolerance, (where, error)
    return loss


def pipe_of(name, schedule="gpipe", checkpoint="except_last", dtype=torch.float64, **options):
    model, units = captured(name, dtype)
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    options = {"balance": even_balance(len(units), 2 * virtual), "chunks": 3, **options}
    if virtual == 2:
        options["chunks"] = 4
    pipe = gpipe.Pipe(
        copy.deepcopy(units), schedule=schedule, checkpoint=checkpoint, tied=units.tied, **options
    )
    return model, pipe


@pytest.mark.parametrize("remat", REMAT)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", MODELS)
def test_every_schedule_and_remat_gives_the_models_gradients(name, schedule, remat):
    case = CASES[name]
    model, pipe = pipe_of(name, schedule, remat)
    inputs, targets = case.batch(size=11)  # uneven micro-batches
    loss = pipe.step(inputs, targets, case.loss)
    expected_loss, grads, _ = reference_gradients(case, model, inputs, targets, pipe.chunks)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-10, (where, error)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_float32_within_1e5(name):
    case = CASES[name]
    model, pipe = pipe_of(name, "1f1b", dtype=torch.float32)
    inputs, targets = case.batch(dtype=torch.float32)
    pipe.step(inputs, targets, case.loss)
    _, grads, _ = reference_gradients(case, model, inputs, targets, pipe.chunks)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-5, (where, error)


@needs("hf-gpt2")
def test_from_model_one_call_keeps_the_models_names_and_finds_the_tie():
    case = CASES["hf-gpt2"]
    model = case.build()
    plain = copy.deepcopy(model)
    pipe = gpipe.Pipe.from_model(
        model, case.example(), split="transformer.h", balance=[2, 3], chunks=4
    )
    names = {n for n, _ in plain.named_parameters(remove_duplicate=False)}
    assert {n for n, _ in pipe.named_parameters(remove_duplicate=False)} == names
    assert "lm_head.weight" in names and "transformer.wte.weight" in names
    inputs, targets = case.batch()
    pipe.step(inputs, targets, case.loss)
    # The tie is found, not declared: both names carry the one tensor's gradient.
    grads = dict(pipe.named_parameters(remove_duplicate=False))
    torch.testing.assert_close(grads["lm_head.weight"].grad, grads["transformer.wte.weight"].grad)
    # The state dict loads into the original model, strictly, and gives its outputs.
    fresh = case.build()
    fresh.load_state_dict(pipe.state_dict(), strict=True)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(pipe(inputs).logits, fresh(inputs).logits)


@needs("hf-gpt2")
def test_eval_mode_and_dropout_masks_independent_of_cut_and_schedule():
    case = CASES["hf-gpt2"]
    model = case.build(dropout=0.1)
    units = capture(model, case.example(), split=case.split)
    inputs, targets = case.batch()
    grads = []
    for balance, schedule in [([2, 3], "gpipe"), ([1, 4], "1f1b"), ([1, 1, 1, 2], "zb-h1")]:
        pipe = gpipe.Pipe(
            copy.deepcopy(units), balance=balance, chunks=3, schedule=schedule, tied=units.tied
        )
        pipe.step(inputs, targets, case.loss, seed=7)
        grads.append({n: p.grad for n, p in pipe.named_parameters()})
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=0, atol=1e-12)
    # Dropout did act: a plain train-mode forward differs from eval's...
    pipe.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(inputs).logits, model(inputs).logits)
        pipe.train()
        assert not torch.allclose(pipe(inputs).logits, model(inputs).logits)


@needs("hf-gpt2")
def test_eager_attention_stays_causal_because_the_models_own_mask_is_carried():
    """A hand-written wrapper that calls GPT-2's blocks without the mask trains a non-causal
    model under eager attention, silently; capture carries the model's own mask."""
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    case = CASES["hf-gpt2"]
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(model), case.example(), split="transformer.h", balance=[2, 2], chunks=3
    )
    inputs, targets = case.batch()
    assert_trains_as(model, pipe, case, inputs, targets)
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64  # a later token must not change earlier logits
    with torch.no_grad():
        before, after = pipe(inputs).logits, pipe(changed).logits
    torch.testing.assert_close(before[:, :-1], after[:, :-1], rtol=0, atol=0)
    assert not torch.equal(before[:, -1], after[:, -1])


@needs("hf-gpt2")
def test_an_encoder_decoder_cut_in_both_stacks():
    """T5: the encoder's output crosses every decoder cut (cross-attention); the shared
    embedding is tied across the stages; the decoder stack's own config holds a cache flag."""
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).double()
    g = torch.Generator().manual_seed(0)
    ids, labels = (
        torch.randint(1, 64, (6, 8), generator=g),
        torch.randint(1, 64, (6, 5), generator=g),
    )
    inputs = {"input_ids": ids, "decoder_input_ids": model._shift_right(labels)}
    case = CASES["hf-gpt2"]  # its loss: cross entropy of .logits
    split = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(model), {k: v[:2] for k, v in inputs.items()}, split=split,
        balance=[3, 3], chunks=3, schedule="1f1b",
    )  # fmt: skip
    assert_trains_as(model, pipe, case, inputs, labels)


@needs("hf-llama")
def test_batch_and_sequence_length_change_without_capturing_again():
    case = CASES["hf-llama"]
    model, pipe = pipe_of("hf-llama", "1f1b")
    for step, (size, length) in enumerate([(7, 5), (12, 9), (5, 3)]):
        pipe.zero_grad()
        inputs, targets = case.batch(step, size=size, length=length)
        pipe.step(inputs, targets, case.loss)
        _, grads, _ = reference_gradients(case, model, inputs, targets, pipe.chunks)
        error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
        assert error <= 1e-10, (size, length, where, error)


def test_batch_norm_deferred_on_a_captured_resnet_gives_the_whole_batch_statistics():
    case = CASES["resnet"]
    model, pipe = pipe_of("resnet", "gpipe", "always", deferred_batch_norm=True)
    inputs, targets = case.batch()
    pipe.step(inputs, targets, case.loss)
    expected = running_stats_of_unsplit_batch(model, inputs, pipe.chunks)
    state = pipe.state_dict()
    assert set(expected) <= set(state)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12)


def test_buffers_the_forward_mutates_are_the_models():
    """Batch norm without deferral updates its running statistics at every micro-batch, as
    the plain model run micro-batch by micro-batch does."""
    case = CASES["resnet"]
    model, pipe = pipe_of("resnet", "1f1b", "never")
    inputs, targets = case.batch()
    pipe.step(inputs, targets, case.loss)
    _, _, trained = reference_gradients(case, model, inputs, targets, pipe.chunks)
    buffers = dict(pipe.named_buffers())
    for name, value in trained.named_buffers():
        torch.testing.assert_close(buffers[name], value, rtol=1e-10, atol=0)


@needs("hf-llama")
def test_auto_balance_and_the_timeline_work_on_captured_units():
    case = CASES["hf-llama"]
    model = case.build()
    pipe = gpipe.Pipe.from_model(
        model, case.example(), split=case.split, balance="auto", devices=["cpu", "cpu"], chunks=3
    )
    assert sum(pipe.balance) == case.units and len(pipe.balance) == 2
    inputs, targets = case.batch()
    pipe.step(inputs, targets, case.loss, trace=True)
    assert {a.action.kind.name for a in pipe.last_trace} >= {"FORWARD", "BACKWARD"}
    _, grads, _ = reference_gradients(case, model, inputs, targets, pipe.chunks)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-10, (where, error)
    # The planner profiles the units like any layers.
    _, units = captured("hf-llama")
    plan = gpipe.plan(
        units, inputs, devices=2, target=targets, loss_fn=case.loss, repeats=1, warmup=0,
        chunks=[3], checkpoints=["never"],
    )  # fmt: skip
    assert plan.candidates and all(sum(c.balance) == case.units for c in plan.candidates)


# -- clear errors -------------------------------------------------------------------------------


def test_a_split_name_that_matches_nothing_lists_the_candidates():
    model = CASES["resnet"].build()
    with pytest.raises(CaptureError, match=r"not modules of ResNet.*layer1.*candidates"):
        split_points(model, "layers1")
    with pytest.raises(CaptureError, match=r"no nn\.ModuleList"):
        split_points(model, None)
    assert split_points(model, "layer2") == ["layer2.0", "layer2.1"]


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), Branchy()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Branchy(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # a branch on a value: export cannot capture it
            return super().forward(x)
        return x


def test_a_model_export_cannot_capture_names_the_module_and_the_remedy():
    with pytest.raises(CaptureError, match=r"(?s)in blocks\.1 \(Branchy\.forward\).*remedies"):
        capture(DataDependent(), (torch.randn(2, 4),), split="blocks")


@needs("hf-llama")
def test_a_model_cast_after_capture_is_refused_where_its_graph_fixes_dtypes():
    case = CASES["hf-llama"]
    _, units = captured("hf-llama", torch.float32)
    pipe = gpipe.Pipe(copy.deepcopy(units), balance=[2, 3], chunks=2).double()
    inputs, targets = case.batch()
    with pytest.raises(TypeError, match=r"captured with torch\.float32 .* capture it again"):
        pipe.step(inputs, targets, case.loss)
    # The ResNet's graph names no floating dtype: cast after capture, it trains as the model.
    model, units = captured("resnet", torch.float32)
    pipe = gpipe.Pipe(copy.deepcopy(units), balance=[3, 3], chunks=2).double()
    inputs, targets = CASES["resnet"].batch()
    pipe.step(inputs, targets, CASES["resnet"].loss)
    plain = copy.deepcopy(model).double()
    _, grads, _ = reference_gradients(CASES["resnet"], plain, inputs, targets, 2)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-10, (where, error)


def test_an_example_with_python_values_is_refused_with_the_remedy():
    with pytest.raises(CaptureError, match=r"not tensors: \['flag'\]=True.*model\.config"):
        capture(Blocks(), {"x": torch.randn(2, 4), "flag": True}, split="blocks")


def test_a_dimension_fixed_at_capture_is_checked_with_a_clear_error():
    _, units = captured("skips")
    with pytest.raises(ValueError, match=r"dimension 1.* fixed at 8"):
        units(torch.randn(3, 9, dtype=torch.float64))


# -- many processes ---------------------------------------------------------------------------


# In processes, the cases whose building or wiring differs there, each once: weights read
# per rank (GPT-2) and batch norm's buffers (ResNet) on two; a function replayed rank by rank
# (Llama) and skips crossing stages on three, where a middle stage both receives and sends.
# Every cut of every case (BERT's too) is taken in one process above: the transport between
# processes does not depend on the model.
PROCESS_CASES = {2: ("hf-gpt2", "resnet"), 3: ("hf-llama", "skips")}


def _runs(stages: int, weights: str) -> list[dict]:
    schedules, remats = ["gpipe", "1f1b", "zb-h1"], REMAT
    runs = []
    names = [n for n in CASES if n not in HF or transformers is not None]
    for i, name in enumerate(n for n in names if n in PROCESS_CASES[stages]):
        units = CASES[name].units
        runs.append(
            {
                "model": name,
                "balance": even_balance(units, stages),
                "chunks": 3,
                "schedule": schedules[(i + stages) % 3],
                "checkpoint": remats[(i + 2 * stages) % 3],
                "factory": name == "hf-llama",
                "weights": weights if name == "hf-gpt2" else None,
            }
        )
    return runs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.slow
def test_many_processes_give_the_models_gradients(stages, tmp_path):
    """Each rank captures the model; Llama is built rank by rank from a function, GPT-2 from
    meta and a save_pretrained checkpoint."""
    if transformers is not None:
        CASES["hf-gpt2"].build().save_pretrained(tmp_path, max_shard_size="20KB")
    runs = _runs(stages, str(tmp_path))
    results = launch(captured_steps, stages, args=(runs,), timeout=200)
    for index, run_ in enumerate(runs):
        case: Case = CASES[run_["model"]]
        model = case.build()
        inputs, targets = case.batch()
        expected_loss, grads, _ = reference_gradients(case, model, inputs, targets, 3)
        seen = {}
        for rank_results in results:
            got = rank_results[index]
            assert got["loss"] == pytest.approx(expected_loss, rel=1e-12)
            assert got["meta_left"] == 0
            seen.update(got["grads"])
        assert set(seen) == set(grads), run_
        for name, grad in grads.items():
            scale = grad.norm().item() or 1.0
            assert (seen[name] - grad).norm().item() / scale <= 1e-10, (run_, name)
        # Each rank's state dict is its shard of the model's, under the model's names.
        shards = [r[index]["state"] for r in results]
        assert set().union(*shards) == set(model.state_dict())
        model.load_state_dict(shards[-1], strict=False)


@needs("hf-llama")
def test_from_model_without_a_balance_splits_the_units_evenly_over_the_devices():
    """Before: a raw TypeError, missing 'balance'."""
    case = CASES["hf-llama"]
    model = case.build()
    pipe = gpipe.Pipe.from_model(
        copy.deepcopy(model), case.example(), devices=["cpu"] * 2, chunks=3
    )
    assert pipe.balance == [3, 2]  # 5 units: the embedding, 3 blocks, the head
    assert_trains_as(model, pipe, case, *case.batch())
