"""Building a Pipe: its layout from the keywords, the layers from a model or a factory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpipe
import user_scripts
from gpipe.models import convnet, lm_loss, mlp
from reference import reference_step, relative_error, twin, worst_gradient_error

BATCH = 10


@pytest.mark.parametrize(
    ("devices", "schedule", "balance"),
    [
        (None, "gpipe", [9]),
        (["cpu"] * 2, "1f1b", [5, 4]),
        (["cpu"] * 2, "interleaved-1f1b", [3, 2, 2, 2]),
    ],
)
def test_without_a_balance_the_layers_are_split_evenly_over_the_devices(devices, schedule, balance):
    """Before, a raw TypeError (missing 'balance'); gpipe train split evenly already."""
    torch.manual_seed(0)
    model = mlp([16, 32, 32, 32, 32, 8]).double()  # 9 layers: 5 Linear, 4 ReLU
    x, y = torch.randn(BATCH, 16, dtype=torch.float64), torch.randint(0, 8, (BATCH,))
    reference = twin(model)
    pipe = gpipe.Pipe(model, devices=devices, chunks=4, schedule=schedule)
    assert pipe.balance == balance and pipe.transport == "local"  # one process
    loss = pipe.step(x, y, F.cross_entropy, seed=1)
    expected = reference_step(reference, x, y, F.cross_entropy, chunks=4, seed=1)
    assert relative_error(loss, expected) <= 1e-10
    worst, where = worst_gradient_error(pipe, reference)
    assert worst <= 1e-10, where


def test_a_layout_is_the_keywords_in_one_value():
    """Pipe(layout=Layout(...)) trains as its keywords do (they build the same Layout); its
    stages are the devices' (by default that many CPU devices)."""
    torch.manual_seed(0)
    model = mlp([16, 32, 32, 8]).double()  # 5 layers
    x, y = torch.randn(BATCH, 16, dtype=torch.float64), torch.randint(0, 8, (BATCH,))
    reference = twin(model)
    layout = gpipe.Layout(stages=2, chunks=4, schedule="1f1b", checkpoint="always")
    pipe = gpipe.Pipe(model, layout=layout)
    assert pipe.layout == layout and pipe.balance == [3, 2] and len(pipe.devices) == 2
    spelled = gpipe.Pipe(twin(model), devices=["cpu"] * 2, chunks=4, schedule="1f1b",
                         checkpoint="always")  # fmt: skip
    assert spelled.layout == layout
    loss = pipe.step(x, y, F.cross_entropy, seed=1)
    expected = reference_step(reference, x, y, F.cross_entropy, chunks=4, seed=1)
    assert relative_error(loss, expected) <= 1e-10
    assert worst_gradient_error(pipe, reference)[0] <= 1e-10


def test_a_layout_and_its_keywords_or_other_devices_are_refused():
    model, layout = mlp([4, 4, 4]), gpipe.Layout(stages=2, chunks=2)
    with pytest.raises(TypeError, match=r"Pipe\(layout=...\) was also given chunks"):
        gpipe.Pipe(model, layout=layout, chunks=2)
    with pytest.raises(gpipe.PartitionError, match="stages=2 but devices has 3 entries"):
        gpipe.Pipe(model, layout=layout, devices=["cpu"] * 3)
    with pytest.raises(gpipe.PartitionError, match="replicas=2 but data_parallel_group holds 1"):
        gpipe.Pipe(model, layout=gpipe.Layout(stages=2, replicas=2))
    with pytest.raises(gpipe.PartitionError, match="shard must be one of params, all"):
        gpipe.Pipe(model, shard="both")


def test_without_a_balance_fewer_layers_than_stages_is_refused():
    with pytest.raises(gpipe.PartitionError, match=r"2 devices needs at least 2 layers"):
        gpipe.Pipe(nn.Sequential(nn.Linear(2, 2)), devices=["cpu", "cpu"])


# -- the layout's defaults and traps ---------------------------------------------------------


def test_interleaved_defaults_to_two_stages_per_device_and_refuses_one():
    model = user_scripts.mlp()
    pipe = gpipe.Pipe(model, balance=[1, 1, 1, 2], chunks=4, schedule="interleaved-1f1b")
    assert pipe.virtual_stages == 2 and len(pipe.devices) == 2
    with pytest.raises(gpipe.PartitionError, match=r"virtual_stages=1.*with 1 it is plain '1f1b'"):
        gpipe.Pipe(model, balance=[2, 3], chunks=4, schedule="interleaved-1f1b", virtual_stages=1)


def test_one_micro_batch_on_several_devices_says_there_is_no_pipelining():
    with pytest.warns(UserWarning, match=r"chunks=1\) on 2 devices"):
        gpipe.Pipe(user_scripts.mlp(), balance=[2, 3])


# -- a factory's own initialization -------------------------------------------------------


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
    # keeps none of it, nor the whole model on meta, once its own layers are built
    # (docs/capacity.md). Both must be gone by the trim that gives their pages back: held
    # until then, each process of a K=8 GPT of 400 blocks kept 12 MiB more (a peak 4-7
    # MiB higher).
    import weakref

    from gpipe.base import allocator
    from gpipe.pipe import assembly

    records, alive_at_trim = [], []

    def recording(factory, **options):
        model, record = original(factory, **options)
        records.extend([weakref.ref(model), weakref.ref(record)])
        return model, record

    def trim():
        alive_at_trim.append([r() is not None for r in records])

    original = assembly.record_model
    monkeypatch.setattr(assembly, "record_model", recording)
    monkeypatch.setattr(allocator, "trim", trim)
    pipe = gpipe.Pipe(user_scripts.custom_init_factory, balance=[2, 3], chunks=2, init_seed=11)
    assert len(records) == 2 and all(r() is None for r in records)
    assert alive_at_trim == [[False, False]]
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
