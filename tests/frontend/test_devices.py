"""A captured model runs the graph of the device type it runs on.

transformers' MoE picks ``histc``'s dtype by the device type (integers off the CPU), so a graph
captured on meta failed at the first step on the CPU. References: the plain model, built as
``torch.manual_seed(0); factory()``, on the same micro-batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe
from captured_models import CASES, reference_gradients, transformers, worst_error
from gpipe.frontend import CaptureError, capture, fit_devices

CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.mark.skipif(transformers is None, reason="needs gpipe[hf] (transformers)")
def test_an_moe_built_by_a_function_trains_on_the_cpu():
    """Before: NotImplementedError "histogram_cpu" not implemented for 'Int' at step 1."""

    def qwen_moe():
        config = transformers.Qwen2MoeConfig(
            vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
            shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64,
        )  # fmt: skip
        return transformers.Qwen2MoeForCausalLM(config)

    case = CASES["hf-llama"]  # token ids in, logits out: its batch and loss
    pipe = gpipe.Pipe.from_model(qwen_moe, case.example(torch.float32), balance=[2, 1], chunks=2)
    torch.manual_seed(0)
    plain = qwen_moe()
    inputs, targets = case.batch(dtype=torch.float32)
    pipe.step(inputs, targets, case.loss)
    _, grads, _ = reference_gradients(case, plain, inputs, targets, 2)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-5, (where, error)


class DeviceBranch(nn.Module):
    """Computes differently by device type, as transformers' MoE does."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        x = self.blocks[0](x)
        if x.device.type == "cpu":
            x = torch.tanh(x)
        return self.blocks[1](x)


def _captured_for_meta():
    torch.manual_seed(0)
    model = DeviceBranch().double()
    example = (torch.randn(2, 4, dtype=torch.float64),)
    return model, capture(copy.deepcopy(model), example, split="blocks", device="meta")


def test_units_captured_for_another_device_type_are_captured_again_for_theirs():
    model, units = _captured_for_meta()
    assert units[0].capture_device == META  # meta's branch: no tanh
    pipe = gpipe.Pipe(units, balance=[1, 1], chunks=2)
    assert {unit.capture_device for unit in pipe.stages[0].layers + pipe.stages[1].layers} == {CPU}
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    pipe.step(x, y, nn.functional.mse_loss)
    for m in range(2):
        piece = slice(3 * m, 3 * m + 3)
        (nn.functional.mse_loss(model(x[piece]), y[piece]) / 2).backward()
    ours = dict(pipe.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-10, atol=1e-12)


def test_units_on_two_device_types_must_carry_the_same_values():
    _, units = _captured_for_meta()
    fit_devices(units, [META, META], [0, 1])  # one type: nothing to join
    with pytest.raises(
        CaptureError,
        match=r"other values across the cut before 'blocks\.1' on cpu than on meta.*"
        r"put both on one device type",
    ):
        fit_devices(units, [CPU, META], [0])
    _, units = _captured_for_meta()
    units.source = None  # a capture that cannot be repeated
    with pytest.raises(
        CaptureError, match=r"captured for meta and would run on cpu; capture them there"
    ):
        fit_devices(units, [CPU, CPU], [0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="names a device this machine lacks")
def test_capturing_for_a_device_this_torch_lacks_is_refused_not_a_crash():
    """Fake CUDA tensors in a CPU-only PyTorch abort the process (a c10::Error)."""
    with torch.device("meta"):
        model = DeviceBranch()
    with pytest.raises(CaptureError, match=r"cannot capture for cuda:0: .* 0 cuda device"):
        gpipe.Pipe.from_model(model, (torch.randn(2, 4),), split="blocks", devices=["cuda:0"])
