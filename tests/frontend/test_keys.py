"""Which checkpoint tensor fills which tensor of the model (a model of transformers' own
renaming: test_load, against from_pretrained)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpipe.frontend.files import Checkpoint
from gpipe.frontend.keys import KeyMap, is_hugging_face

safetensors = pytest.importorskip("safetensors.torch")


def test_a_plain_models_keys_are_its_state_dict_names(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2))
    model[2].weight = model[0].weight  # tied: one tensor, two names
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("2.")}
    del state["1.running_var"]
    state["head.weight"] = torch.zeros(1)
    safetensors.save_file(state, tmp_path / "model.safetensors")
    keys = KeyMap(model, Checkpoint(tmp_path))
    assert not keys.hugging_face and not is_hugging_face(model)
    assert keys.unexpected == ["head.weight"]
    assert keys.keys_for(["0.bias", "1.weight"]) == ["0.bias", "1.weight"]
    report = keys.check(model)
    # 2.weight is 0.weight, which the checkpoint fills; 2.bias and the variance are missing
    assert report.missing == ["1.running_var", "2.bias"]
    assert report.unexpected == ["head.weight"] and not report.complete
