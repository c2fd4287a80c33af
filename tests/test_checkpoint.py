"""Sharded checkpoints: atomic writes, lookup, optimizer state by name, export.

Saving from a real K=2 pipeline and loading at K=1 and K=4 is in train/test_train_job.py, which
has a checkpoint from the command line to work on.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gpipe import checkpoint as ckpt
from gpipe.models import mlp


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return mlp([4, 8, 8, 3])  # layers 0 (Linear), 1 (GELU), 2, 3, 4


def train_a_little(model: nn.Sequential, params, steps: int = 3) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(params, lr=0.1)
    for _ in range(steps):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def save(root, step: int, model: nn.Sequential, cuts: list[list[int]]):
    """A checkpoint of ``model`` as if ranks held the layers in ``cuts``."""
    tmp = ckpt.begin(root, step)
    shards = {}
    state = model.state_dict()
    for rank, layers in enumerate(cuts):
        names = [n for n in state if int(n.split(".")[0]) in layers]
        shards.update(ckpt.write_shard(tmp, rank, model={n: state[n] for n in names}))
    return ckpt.commit(root, tmp, ckpt.Manifest(step=step, shards=shards))


def test_save_find_load_and_export(tmp_path):
    model = make_model()
    folder = save(tmp_path, 5, model, [[0, 1], [2, 3, 4]])
    assert folder.name == "step-000005"
    assert sorted(p.name for p in folder.iterdir()) == [
        "manifest.json",
        "shard-000.pt",
        "shard-001.pt",
    ]
    # The checkpoint, its folder of checkpoints, or the run folder above it all designate it.
    assert ckpt.find(folder) == folder == ckpt.find(tmp_path)
    (tmp_path / "run").mkdir()
    save(tmp_path / "run" / "checkpoints", 7, model, [[0, 1, 2, 3, 4]])
    assert ckpt.find(tmp_path / "run").name == "step-000007"

    manifest = ckpt.read_manifest(tmp_path)
    assert manifest.index["2.bias"] == "shard-001.pt"
    assert torch.equal(ckpt.load_tensors(manifest, ["2.bias"])["2.bias"], model[2].bias)
    exported = ckpt.export_state_dict(folder)
    assert list(exported) == list(model.state_dict())  # whole-model order
    fresh = mlp([4, 8, 8, 3])
    fresh.load_state_dict(exported, strict=True)
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), model(x))


def test_names_no_shard_holds_are_reported(tmp_path):
    save(tmp_path, 1, make_model(), [[0, 1]])
    manifest = ckpt.read_manifest(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"has no 1 of the names .*2\.weight"):
        ckpt.load_tensors(manifest, ["0.weight", "2.weight"])


def test_keep_prunes_old_checkpoints_and_latest_follows(tmp_path):
    model = make_model()
    for step in (1, 2, 3):
        tmp = ckpt.begin(tmp_path, step)
        shards = ckpt.write_shard(tmp, 0, model=model.state_dict())
        ckpt.commit(tmp_path, tmp, ckpt.Manifest(step=step, shards=shards), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    assert (tmp_path / "latest").read_text() == "step-000003"


def test_crash_while_writing_a_shard_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = make_model()
    save(tmp_path, 10, model, [[0, 1], [2, 3, 4]])
    before = ckpt.export_state_dict(tmp_path)

    model[0].weight.data.add_(1.0)
    real_save = torch.save

    def dies_half_way(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip file")  # some bytes reach the disk, then the crash
        raise OSError("No space left on device")

    tmp = ckpt.begin(tmp_path, 20)
    ckpt.write_shard(tmp, 0, model=model.state_dict())  # rank 0 finished its shard
    monkeypatch.setattr(torch, "save", dies_half_way)
    with pytest.raises(OSError, match="No space"):
        ckpt.write_shard(tmp, 1, model=model.state_dict())
    monkeypatch.setattr(torch, "save", real_save)

    assert not (tmp / ckpt.shard_file(1)).exists()  # no half-written file under its name
    assert [p.name for p in tmp.iterdir()] == ["shard-000.pt"]  # nor a stray temporary
    assert ckpt.find(tmp_path).name == "step-000010"  # the .tmp folder is ignored
    after = ckpt.export_state_dict(tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Committing the incomplete one is refused; the next save of that step starts afresh.
    shards = {ckpt.shard_file(r): {"names": []} for r in (0, 1)}
    with pytest.raises(ckpt.CheckpointError, match="were not written"):
        ckpt.commit(tmp_path, tmp, ckpt.Manifest(step=20, shards=shards))
    assert ckpt.begin(tmp_path, 20) == tmp and not any(tmp.iterdir())


def test_crash_before_the_rename_leaves_latest_alone(tmp_path, monkeypatch):
    model = make_model()
    save(tmp_path, 1, model, [[0, 1, 2, 3, 4]])
    tmp = ckpt.begin(tmp_path, 2)
    ckpt.write_shard(tmp, 0, model=model.state_dict())
    monkeypatch.setattr(type(tmp), "rename", lambda self, target: (_ for _ in ()).throw(OSError))
    with pytest.raises(OSError):
        shards = {"shard-000.pt": {"names": ["0.bias"]}}
        ckpt.commit(tmp_path, tmp, ckpt.Manifest(step=2, shards=shards))
    assert (tmp / "manifest.json").exists()  # complete but never renamed: still ignored
    assert ckpt.find(tmp_path).name == "step-000001"
    assert (tmp_path / "latest").read_text() == "step-000001"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p / "absent", "does not exist"),
        (lambda p: p, "no complete checkpoint"),
        (lambda p: (p / "file").write_text("x") and p / "file", "not a folder"),
    ],
)
def test_unusable_folders_are_clear_errors(tmp_path, setup, message):
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.read_manifest(setup(tmp_path))


def test_damaged_manifest_or_missing_shard_is_a_clear_error(tmp_path):
    folder = save(tmp_path, 1, make_model(), [[0, 1], [2, 3, 4]])
    (folder / "shard-001.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"missing or unreadable: \['shard-001.pt'\]"):
        ckpt.read_manifest(folder)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="cannot read"):
        ckpt.read_manifest(folder)
    (folder / "manifest.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ckpt.CheckpointError, match="not a gpipe checkpoint"):
        ckpt.read_manifest(folder)


def test_optimizer_state_by_name_moves_between_cuts(tmp_path):
    """Saved by 2 "ranks" (layers 0-1 | 2-4), loaded by 1 and by 3 with other cuts."""
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
        states.append(ckpt.optimizer_state_by_name(optimizer, names_of))
    assert set(states[1]["state"]) == set(cuts[1])

    tmp, shards = ckpt.begin(tmp_path, 3), {}
    for rank, (names, state) in enumerate(zip(cuts, states, strict=True)):
        model_part = {n: named[n].detach() for n in names}
        shards.update(ckpt.write_shard(tmp, rank, model=model_part, optimizer=state))
    manifest = ckpt.read_manifest(ckpt.commit(tmp_path, tmp, ckpt.Manifest(step=3, shards=shards)))

    three = [["0.weight"], ["0.bias", "2.weight"], ["2.bias", "4.weight", "4.bias"]]
    for new_cut in ([cuts[0] + cuts[1]], three):
        for names in new_cut:
            optimizer = torch.optim.AdamW(groups_for(names), lr=0.5)
            ckpt.load_optimizer_state_by_name(
                optimizer, names_of, ckpt.load_optimizer_state(manifest, names)
            )
            loaded = ckpt.optimizer_state_by_name(optimizer, names_of)
            saved = {n: s for state in states for n, s in state["state"].items()}
            for name in names:
                for key, value in saved[name].items():
                    assert torch.equal(loaded["state"][name][key], value), (name, key)
            assert optimizer.param_groups[0]["lr"] == 0.1  # the saved hyperparameters


def test_optimizer_groups_that_do_not_match_are_reported():
    model = make_model()
    names_of = {p: n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([{"name": "decay", "params": list(model.parameters())}])
    state = ckpt.optimizer_state_by_name(optimizer, names_of)
    other = torch.optim.AdamW([{"name": "other", "params": list(model.parameters())}])
    with pytest.raises(ckpt.CheckpointError, match="no param group 'other'"):
        ckpt.load_optimizer_state_by_name(other, names_of, state)
