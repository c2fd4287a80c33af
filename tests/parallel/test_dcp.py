"""gpipe.parallel.dcp, the one caller of DCP: a checkpoint is data, never code. A crafted
.metadata (a pickle) or stored object is refused, naming what it refers to, and nothing of it
runs; DCP's own reader would run it. How the metadata is read: test_dcp_metadata.py."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch

import gpipe.train.checkpoint as ckpt
from gpipe.parallel import dcp as gpipe_dcp
from saved_checkpoints import Payload, make_model, plant, save


def test_a_planted_metadata_payload_is_refused_and_never_runs(tmp_path):
    folder, marker = save(tmp_path, 1, make_model()), tmp_path / "marker"
    plant(folder, marker)
    manifest = ckpt.read_manifest(folder)  # the manifest and every SHA-256 agree
    refused = r"\.metadata refers to pathlib\.Path\.touch, which a DCP checkpoint never holds"
    for read in (ckpt.names, lambda m: ckpt.load_tensors(m, ["0.weight"])):
        with pytest.raises(ckpt.CheckpointError, match=refused):
            read(manifest)
    with pytest.raises(ckpt.CheckpointError, match=refused):
        ckpt.export_state_dict(folder)
    assert not marker.exists()
    with open(folder / ".metadata", "rb") as f:
        pickle.load(f)  # what DCP's own reader does: the payload is live
    assert marker.exists()


def test_metadata_pointing_outside_its_folder_is_refused(tmp_path):
    folder = save(tmp_path, 1, make_model())
    storage = gpipe_dcp.read_metadata(folder).storage_data
    index = next(iter(storage))
    away = {**storage, index: dataclasses.replace(storage[index], relative_path="../x.distcp")}
    plant(folder, None, storage_data=away)
    with pytest.raises(ckpt.CheckpointError, match=r"points to '\.\./x\.distcp', not a file"):
        ckpt.names(ckpt.read_manifest(folder))


def test_a_stored_object_that_is_not_data_is_refused(tmp_path):
    """DCP stores objects (an optimizer's hyperparameters) with torch.save and reads them
    with weights_only=False; gpipe reads them as data only."""
    model, marker = make_model(), tmp_path / "marker"
    names = list(model.state_dict())
    groups = [{"params": names, "lr": Payload(marker)}]
    folder = save(tmp_path, 1, model, optimizer={"state": {}, "param_groups": groups})
    with pytest.raises(ckpt.CheckpointError, match=r"its optimizer\.param_groups\.#0\.lr refers"):
        ckpt.load(ckpt.read_manifest(folder), model=names, optimizer=names)
    assert not marker.exists()


def test_a_tensor_larger_than_the_checkpoints_files_is_refused(tmp_path):
    folder = save(tmp_path, 1, make_model())
    metadata = gpipe_dcp.read_metadata(folder)
    entry = metadata.state_dict_metadata["model.0.weight"]
    entry.size = torch.Size([1 << 20, 1 << 20])  # 4 TiB of float32
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(gpipe_dcp.Refused, match=r"claims model\.0\.weight of 4398046511104 bytes"):
        gpipe_dcp.read_metadata(folder)


def test_a_whole_load_never_calls_an_unpickler_of_pickle(tmp_path, monkeypatch):
    """Metadata, tensors and stored objects (the step count, betas, lr): none reaches pickle's
    own Unpickler (torch.load(weights_only=True) has its own, restricted one)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    saved = optimizer.state_dict()
    state = {"state": {names[i]: v for i, v in saved["state"].items()},
             "param_groups": [{**g, "params": names} for g in saved["param_groups"]]}  # fmt: skip
    folder = save(tmp_path, 1, model, optimizer=state, rng={0: torch.get_rng_state()})

    def refused(*args, **kwargs):
        raise AssertionError("pickle's Unpickler was called")

    for name in ("load", "loads", "Unpickler", "_Unpickler"):
        monkeypatch.setattr(pickle, name, refused)
    loaded = ckpt.load(ckpt.read_manifest(folder), model=names, optimizer=names, rng=0)
    assert torch.equal(loaded.model["0.weight"], model[0].weight.detach())
    assert loaded.optimizer["param_groups"][0]["betas"] == saved["param_groups"][0]["betas"]
    assert torch.equal(loaded.rng, torch.get_rng_state())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_processes_save_one_checkpoint_and_none_reads_a_peers_pickle(tmp_path):
    """Each process writes its part without DCP's collectives (which pickle the plans they
    exchange); rank 0 merges the parts, read as data. An equal replica writes nothing twice."""
    from gpipe.parallel.launch import launch
    from saved_checkpoints import write_a_part

    written = launch(write_a_part, 3, args=(str(tmp_path),), timeout=60)
    folder = ckpt.find(tmp_path)
    assert not list(folder.glob("__*.metadata"))
    reader = gpipe_dcp.Reader(folder)
    assert {k for k in reader.entries if k.startswith("model.")} == {
        "model.0.weight", "model.1.weight", "model.shared.step"}  # fmt: skip
    loaded = ckpt.load(ckpt.read_manifest(folder), model=["0.weight", "1.weight", "shared.step"])
    for rank in (0, 1):
        for name, tensor in written[rank].items():
            assert torch.equal(loaded.model[name], tensor)
    assert (folder / "__2_0.distcp").stat().st_size < (folder / "__0_0.distcp").stat().st_size


def test_a_rank_writing_after_rank_0_is_not_warned_of_an_existing_checkpoint(tmp_path):
    """Each rank writes its part into one folder; DCP's check looks at rank 0's part."""
    from torch.distributed import checkpoint as torch_dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # meant
        warnings.filterwarnings("error", message="Detected an existing checkpoint")
        for rank in (0, 1):  # what save() does in rank R
            writer = gpipe_dcp._PartWriter(str(tmp_path), rank)
            torch_dcp.save({f"t{rank}": torch.ones(2)}, storage_writer=writer, no_dist=True)
    assert sorted(p.name for p in tmp_path.glob("__*.metadata")) == ["__0.metadata", "__1.metadata"]
