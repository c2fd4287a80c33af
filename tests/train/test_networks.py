"""gpipe.train.networks: a built-in model's source builds the model that the constructor it
prints for ``gpipe export`` builds, counts its units, and bounds one micro-batch's memory."""

from __future__ import annotations

import pytest
import torch

import gpipe
from gpipe.train.networks import GPT, ConvNet

GPT_ARGS = {"vocab_size": 32, "context": 8, "d_model": 16, "n_heads": 2, "n_layers": 3}


@pytest.mark.parametrize("source", [GPT(GPT_ARGS), ConvNet({"channels": 4, "blocks": 1})],
                         ids=["gpt", "convnet"])  # fmt: skip
def test_the_printed_constructor_builds_the_sources_model(source):
    torch.manual_seed(0)
    built = source.build()
    torch.manual_seed(0)
    printed = eval(source.constructor(), {"gpipe": gpipe})  # what a user pastes
    assert len(built) == source.units() == len(printed)
    assert built.state_dict().keys() == printed.state_dict().keys()
    for name, tensor in built.state_dict().items():
        assert torch.equal(printed.state_dict()[name], tensor), name
    assert source.spec == {"kind": source.kind, "args": source.args}


def test_the_activation_floor_is_what_the_largest_layer_holds_for_one_micro_batch():
    # attention: scores and their softmax, (B, heads, T, T) float32 each
    assert GPT(GPT_ARGS).activation_floor(3, seq=8) == (
        3 * 2 * 8 * 8 * 4 * 2,
        "3 x 2 heads x 8^2 attention scores and softmax",
    )
    # a convolution's input and output, (B, channels, 8, 8) float32 each
    assert ConvNet({"channels": 4}).activation_floor(3, seq=0) == (
        3 * 4 * 64 * 4 * 2,
        "3 x 4 channels x 8 x 8 of a convolution's input and output",
    )
