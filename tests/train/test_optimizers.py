"""``--optimizer`` (``gpipe.train.optimizers``): AdamW, Adam and SGD step a pipeline as the
plain torch optimizer steps the un-split model; the trainer's optimizer is the chosen class
with the chosen hyper-parameters; options of another optimizer are refused."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.parallel.launch import launch
from gpipe.train import ConfigError, TrainConfig, Trainer, optimizers, resolve

CHOICES = {
    "adamw": dict(optimizer="adamw", beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.2),
    "adam": dict(optimizer="adam", beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.2),
    "sgd": dict(optimizer="sgd", momentum=0.9, weight_decay=0.2),
}
# The same, written as the plain torch optimizer's arguments (weight decay: matrices only).
PLAIN = {
    "adamw": (torch.optim.AdamW, dict(betas=(0.8, 0.99), eps=1e-6)),
    "adam": (torch.optim.Adam, dict(betas=(0.8, 0.99), eps=1e-6)),
    "sgd": (torch.optim.SGD, dict(momentum=0.9)),
}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def plain_optimizer(net: nn.Module, name: str) -> torch.optim.Optimizer:
    kind, arguments = PLAIN[name]
    matrices = [p for p in net.parameters() if p.dim() >= 2]
    vectors = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.2}, {"params": vectors, "weight_decay": 0.0}]
    return kind(groups, lr=0.05, **arguments)


@pytest.mark.parametrize("name", list(CHOICES))
def test_each_optimizer_steps_the_pipeline_as_torchs_steps_the_plain_model(name):
    config = TrainConfig(lr=0.05, **CHOICES[name])
    plain = model()
    pipe = gpipe.Pipe(copy.deepcopy(plain), balance=[2, 2], chunks=2)
    ours, theirs = optimizers.build(list(pipe.parameters()), config), plain_optimizer(plain, name)
    assert type(ours) is PLAIN[name][0]
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    for _ in range(3):
        pipe.step(x, y, F.cross_entropy)
        F.cross_entropy(plain(x), y).backward()
        for optimizer in (ours, theirs):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    expected = dict(plain.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p, expected[n], rtol=1e-5, atol=1e-6, msg=n)
    assert not torch.equal(p, model().state_dict()[n])  # it moved


def _optimizer_at(rank: int, config: TrainConfig):
    optimizer = Trainer(rank, config).optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return type(optimizer).__name__, groups


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_trainers_optimizer_is_the_chosen_one(tmp_path, cache, monkeypatch):
    name = "sgd"  # the class and its own options (Adam's: in the test above)
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(cache))
    config = resolve({"size": "tiny", "lr": 0.05, "warmup": 0, "lr_schedule": "constant",
                      "out": str(tmp_path), **CHOICES[name]})  # fmt: skip
    for kind, groups in launch(_optimizer_at, 2, args=(config,), backend="gloo", timeout=60):
        assert kind == PLAIN[name][0].__name__
        for group in groups:
            expected = {**PLAIN[name][1], "lr": 0.05}
            assert {k: group[k] for k in expected} == expected
            assert group["weight_decay"] == (0.2 if group["name"] == "decay" else 0.0)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"momentum": 0.9}, "--momentum 0.9 applies to --optimizer sgd, not --optimizer adamw: "
         "drop --momentum, or choose --optimizer sgd"),
        ({"optimizer": "sgd", "beta1": 0.8, "eps": 1e-6}, "--beta1 0.8 applies to --optimizer "
         "adamw or adam, not --optimizer sgd: drop --beta1"),
        ({"optimizer": "sgd", "beta1": 0.8, "eps": 1e-6}, "--eps 1e-06 applies to"),
        ({"beta2": 1.0}, "--beta2 must be in [0, 1), got 1.0"),
        ({"eps": 0.0}, "--eps must be > 0, got 0.0"),
        ({"optimizer": "sgd", "momentum": -0.1}, "--momentum must be in [0, 1), got -0.1"),
    ],
)  # fmt: skip
def test_a_bad_combination_is_refused_with_the_remedy(options, expected, tmp_path):
    with pytest.raises(ConfigError) as error:
        resolve({"size": "tiny", "out": str(tmp_path), **options})
    assert expected in str(error.value)


def test_adamw_stays_the_default_with_its_old_hyperparameters():
    config = TrainConfig()
    assert (config.optimizer, config.weight_decay) == ("adamw", 0.1)
    assert optimizers.hyperparameters(config) == dict(
        lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8
    )
    assert {f.name for f in dataclasses.fields(config)} >= {"beta1", "beta2", "eps", "momentum"}
