"""Which unit holds which of the model's tensors: the model's names (all of a tensor's), its
order, the tensors the forward never reads, and the parameters several units read (tied)."""

from __future__ import annotations

import torch
from torch import nn

from gpipe.frontend import capture


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.blocks[1].spare = nn.Linear(4, 4)  # never called: stays with its block
        self.alias = self.blocks[0]  # a second name of block 0's tensors
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x @ self.embed.weight.T * self.scale  # the embedding, read again at the end


def test_units_hold_the_models_names_in_its_order_and_report_the_tie():
    torch.manual_seed(0)
    model = Tied().double()
    units = capture(model, (torch.randint(0, 8, (2, 3)),), split="blocks")
    assert [u.unit_name for u in units] == [
        "before blocks.0",
        "blocks.0",
        "blocks.1",
        "after blocks.1",
    ]
    held = [list(u.state_dict()) for u in units]
    assert held[0] == ["embed.weight"]
    assert held[1] == ["blocks.0.weight", "blocks.0.bias", "alias.weight", "alias.bias"]
    assert held[2] == [
        "blocks.1.weight", "blocks.1.bias", "blocks.1.spare.weight", "blocks.1.spare.bias"
    ]  # fmt: skip
    assert held[3] == ["scale", "embed.weight"]  # where they are read, in the model's order
    assert units.tied == [("0.embed.weight", "3.embed.weight")]
    assert units[3].embed.weight is units[0].embed.weight is model.embed.weight
    whole = {k for u in units for k in u.state_dict()}
    assert whole == set(model.state_dict())
    tokens = torch.randint(0, 8, (5, 3))
    torch.testing.assert_close(units(tokens), model(tokens))
