"""An optimizer's state by parameter name (train/optimizer_state.py): saved by one cut of the
model, loaded by another; groups that do not match are named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpipe.train.checkpoint as ckpt
from gpipe.train.optimizer_state import load_optimizer_state_by_name, optimizer_state_by_name
from saved_checkpoints import make_model, save


def train_a_little(model: nn.Module, params, steps: int = 3) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_optimizer_state_by_name_moves_between_cuts(tmp_path):
    """Stepped by 2 "ranks" (layers 0-1 | 2-4), loaded by 1 and by 3 with other cuts."""
    model = make_model()
    named = dict(model.named_parameters())
    cuts = [["0.weight", "0.bias"], ["2.weight", "2.bias", "4.weight", "4.bias"]]

    def groups_for(names):  # named groups, as gpipe train builds them
        decay = [named[n] for n in names if named[n].dim() >= 2]
        rest = [named[n] for n in names if named[n].dim() < 2]
        return [{"name": "decay", "params": decay}, {"name": "no_decay", "params": rest}]

    names_of = {p: n for n, p in named.items()}
    states = []
    for names in cuts:
        optimizer = train_a_little(model, groups_for(names))
        states.append(optimizer_state_by_name(optimizer, names_of))
    assert set(states[1]["state"]) == set(cuts[1])
    # What the 2 ranks' DCP writes hold together: every name's state and group.
    merged = {
        "state": {**states[0]["state"], **states[1]["state"]},
        "param_groups": [
            {**g0, "params": g0["params"] + g1["params"]}
            for g0, g1 in zip(states[0]["param_groups"], states[1]["param_groups"], strict=True)
        ],
    }
    manifest = ckpt.read_manifest(save(tmp_path, 3, model, optimizer=merged))

    three = [["0.weight"], ["0.bias", "2.weight"], ["2.bias", "4.weight", "4.bias"]]
    saved = merged["state"]
    for new_cut in ([cuts[0] + cuts[1]], three):
        for names in new_cut:
            optimizer = torch.optim.AdamW(groups_for(names), lr=0.5)
            loaded = ckpt.load(manifest, model=[], optimizer=names).optimizer
            load_optimizer_state_by_name(optimizer, names_of, loaded)
            again = optimizer_state_by_name(optimizer, names_of)
            for name in names:
                for key, value in saved[name].items():
                    assert torch.equal(again["state"][name][key], value), (name, key)
            assert optimizer.param_groups[0]["lr"] == 0.1  # the saved hyperparameters


def test_optimizer_groups_that_do_not_match_are_reported():
    model = make_model()
    names_of = {p: n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([{"name": "decay", "params": list(model.parameters())}])
    state = optimizer_state_by_name(optimizer, names_of)
    other = torch.optim.AdamW([{"name": "other", "params": list(model.parameters())}])
    with pytest.raises(ckpt.CheckpointError, match="no param group 'other'"):
        load_optimizer_state_by_name(other, names_of, state)
