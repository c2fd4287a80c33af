"""DCP checkpoints: atomic writes, lookup, the manifest's checks, optimizer state by name,
loading into other cuts and Pipes, export. A crafted checkpoint refused, nothing of it run:
parallel/test_dcp.py.

Saving from a real K=2 pipeline (2 processes) and loading at K=1 and K=4, with replicas
and sharded ones, is in train/test_train_job.py, which has a checkpoint from the command line
to work on.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem

import gpipe
import gpipe.train.checkpoint as ckpt
from gpipe.models import mlp
from gpipe.train.optimizer_state import load_optimizer_state_by_name, optimizer_state_by_name
from saved_checkpoints import make_model, save

FILES = [".metadata", "__0_0.distcp", "manifest.json"]


def test_save_find_load_and_export(tmp_path):
    model = make_model()
    folder = save(tmp_path, 5, model, rng={0: torch.get_rng_state()})
    assert folder.name == "step-000005"
    assert sorted(p.name for p in folder.iterdir()) == FILES
    # The checkpoint, its folder of checkpoints, or the run folder above it all designate it.
    assert ckpt.find(folder) == folder == ckpt.find(tmp_path)
    (tmp_path / "run").mkdir()
    save(tmp_path / "run" / "checkpoints", 7, model)
    assert ckpt.find(tmp_path / "run").name == "step-000007"

    manifest = ckpt.read_manifest(tmp_path)
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp"]
    assert ckpt.names(manifest) == list(model.state_dict())
    assert torch.equal(ckpt.load_tensors(manifest, ["2.bias"])["2.bias"], model[2].bias)
    assert torch.equal(ckpt.load(manifest, model=[], rng=0).rng, torch.get_rng_state())
    assert ckpt.load(manifest, model=[], rng=1).rng is None  # saved by one rank only
    exported = ckpt.export_state_dict(folder)
    assert list(exported) == list(model.state_dict())  # whole-model order
    fresh = mlp([4, 8, 8, 3])
    fresh.load_state_dict(exported, strict=True)
    x = torch.randn(2, 4)
    assert torch.equal(fresh(x), model(x))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_is_plain_dcp(tmp_path):
    """DCP's own reader loads it, with nothing of gpipe: what torchtitan and DCP tools do."""
    model = make_model()
    folder = save(tmp_path, 1, model)
    state = {"model": {n: torch.zeros_like(t) for n, t in model.state_dict().items()}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    assert all(torch.equal(state["model"][n], t) for n, t in model.state_dict().items())


def test_names_no_checkpoint_holds_are_reported(tmp_path):
    save(tmp_path, 1, make_model(), layers=[0, 1])
    manifest = ckpt.read_manifest(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match=r"has no 1 of the names .*2\.weight"):
        ckpt.load_tensors(manifest, ["0.weight", "2.weight"])


def test_keep_prunes_old_checkpoints_and_latest_follows(tmp_path):
    model = make_model()
    for step in (1, 2, 3):
        tmp = ckpt.begin(tmp_path, step)
        ckpt.write(tmp, model=model.state_dict())
        ckpt.commit(tmp_path, tmp, ckpt.Manifest(step=step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    assert (tmp_path / "latest").read_text() == "step-000003"


def test_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    model = make_model()
    save(tmp_path, 10, model)
    before = ckpt.export_state_dict(tmp_path)

    model[0].weight.data.add_(1.0)
    real_write_item = filesystem._write_item

    def dies_half_way(transforms, stream, *args, **kwargs):
        stream.write(b"PK\x03\x04 half a zip file")  # some bytes reach the disk, then the crash
        raise OSError("No space left on device")

    tmp = ckpt.begin(tmp_path, 20)
    monkeypatch.setattr(filesystem, "_write_item", dies_half_way)
    with pytest.raises(ckpt.CheckpointError, match=r"cannot write .*rank 0: OSError: No space"):
        ckpt.write(tmp, model=model.state_dict())
    monkeypatch.setattr(filesystem, "_write_item", real_write_item)

    assert ckpt.find(tmp_path).name == "step-000010"  # the .tmp folder is ignored
    after = ckpt.export_state_dict(tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Committing the incomplete one is refused; the next save of that step starts afresh.
    with pytest.raises(ckpt.CheckpointError, match="were not written"):
        ckpt.commit(tmp_path, tmp, ckpt.Manifest(step=20))
    assert ckpt.begin(tmp_path, 20) == tmp and not any(tmp.iterdir())


def test_crash_before_the_rename_leaves_latest_alone(tmp_path, monkeypatch):
    model = make_model()
    save(tmp_path, 1, model)
    tmp = ckpt.begin(tmp_path, 2)
    ckpt.write(tmp, model=model.state_dict())
    monkeypatch.setattr(type(tmp), "rename", lambda self, target: (_ for _ in ()).throw(OSError))
    with pytest.raises(OSError):
        ckpt.commit(tmp_path, tmp, ckpt.Manifest(step=2))
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


def test_damaged_manifest_or_missing_file_is_a_clear_error(tmp_path):
    folder = save(tmp_path, 1, make_model())
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"missing or unreadable: \['__0_0.distcp'\]"):
        ckpt.read_manifest(folder)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match="cannot read"):
        ckpt.read_manifest(folder)
    (folder / "manifest.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ckpt.CheckpointError, match="not a gpipe checkpoint"):
        ckpt.read_manifest(folder)


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: r.update(step=r["step"] + 1),
        lambda r: r["layout"].pop("stages"),  # was a KeyError when resuming
        lambda r: r.pop("files"),
        lambda r: r.update(scheduler={"last_epoch": 3}),
    ],
    ids=["step", "layout-key", "files", "scheduler"],
)
def test_an_edited_manifest_is_refused_by_name(tmp_path, edit):
    folder = save(tmp_path, 4, make_model(), layout={"stages": 2}, scheduler={"last_epoch": 4})
    record = json.loads((folder / "manifest.json").read_text())
    edit(record)
    (folder / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest.json was edited \(its SHA-256"):
        ckpt.read_manifest(folder)


def test_the_former_format_is_refused_with_the_remedy(tmp_path):
    folder = tmp_path / "step-000003"
    folder.mkdir()
    record = {"format": "gpipe-checkpoint", "version": 1, "step": 3, "shards": {}}
    (folder / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(ckpt.CheckpointError, match=f"former checkpoint format.*{ckpt.FORMER}"):
        ckpt.read_manifest(folder)


def test_a_pipe_saved_at_k2_resumes_at_k3_bitwise(tmp_path):
    """Weights and AdamW state of a K=2 Pipe load into a K=3 one (one process), whose next
    steps are bitwise those of the K=2 Pipe continuing."""

    def pipe_of(balance):
        return gpipe.Pipe(make_model(), balance=balance, chunks=2)

    def step(pipe, optimizer, seed):
        torch.manual_seed(seed)
        x, y = torch.randn(6, 4), torch.randn(6, 3)
        loss = pipe.step(x, y, torch.nn.functional.mse_loss, seed=seed)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    two = pipe_of([2, 3])
    two_optimizer = torch.optim.AdamW(two.parameters(), lr=0.01)
    for seed in range(3):
        step(two, two_optimizer, seed)
    names = {p: n for n, p in two.named_parameters()}
    optimizer_state = optimizer_state_by_name(two_optimizer, names)
    manifest = ckpt.read_manifest(save(tmp_path, 3, two, optimizer=optimizer_state))

    three = pipe_of([1, 2, 2])
    three_optimizer = torch.optim.AdamW(three.parameters(), lr=0.5)
    three_names = {p: n for n, p in three.named_parameters()}
    loaded = ckpt.load(
        manifest, model=list(three.state_dict()), optimizer=list(three_names.values())
    )
    three.load_state_dict(loaded.model, strict=True)
    load_optimizer_state_by_name(three_optimizer, three_names, loaded.optimizer)
    for seed in (3, 4):
        assert step(three, three_optimizer, seed) == step(two, two_optimizer, seed)
    for name, tensor in two.state_dict().items():
        assert torch.equal(three.state_dict()[name], tensor), name
