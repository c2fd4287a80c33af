"""A checkpoint's safetensors files: which file holds each tensor, each damage named with its
path. (Loading them into a model: test_load.)"""

from __future__ import annotations

import json

import pytest
import torch

from gpipe.frontend.files import Checkpoint, CheckpointError

safetensors = pytest.importorskip("safetensors.torch")


def _shards(path):
    """A directory of two shards and their index, as save_pretrained writes it."""
    safetensors.save_file({"a": torch.ones(2, 3)}, path / "one.safetensors")
    safetensors.save_file({"b": torch.zeros(4), "c": torch.arange(3.0)}, path / "two.safetensors")
    weight_map = {"a": "one.safetensors", "b": "two.safetensors", "c": "two.safetensors"}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_an_index_names_the_file_of_each_tensor_and_slices_read_only_those_asked(tmp_path):
    checkpoint = Checkpoint(_shards(tmp_path))
    assert checkpoint.names() == ["a", "b", "c"]
    assert checkpoint.files["c"] == tmp_path / "two.safetensors"
    with checkpoint.slices(["a", "c"]) as found:
        assert set(found) == {"a", "c"} and found["a"].get_shape() == [2, 3]
        assert torch.equal(found["c"][1:], torch.tensor([1.0, 2.0]))
    single = tmp_path / "model.safetensors"
    safetensors.save_file({"w": torch.ones(1)}, single)
    assert Checkpoint(single).names() == ["w"]


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda data: data[:-4], r"is truncated: \d+ bytes, but its header describes \d+"),
        (lambda data: b"\x00\xff" * 300, r"is not a safetensors file"),
        (lambda data: b"", r"is empty \(0 bytes\)"),
        (lambda data: b"version https://git-lfs.github.com/spec/v1\n", "is a Git LFS pointer"),
    ],
    ids=["truncated", "garbage", "empty", "lfs-pointer"],
)
def test_a_damaged_file_is_named_with_what_is_wrong(damage, said, tmp_path):
    file = tmp_path / "model.safetensors"
    safetensors.save_file({"w": torch.ones(8)}, file)
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(CheckpointError, match=rf"{file} {said}.*save it again"):
        Checkpoint(tmp_path)


def test_a_broken_index_or_a_missing_file_is_named(tmp_path):
    _shards(tmp_path)
    (tmp_path / "two.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lists shards that do not exist: .*two\."):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="is not a safetensors index"):
        Checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds neither model\.safetensors nor"):
        Checkpoint(tmp_path / "elsewhere")


def test_an_index_of_another_save_than_its_shards_is_named(tmp_path):
    _shards(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "z": "one.safetensors"}}))
    checkpoint = Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"does not hold \['z'\].*different saves"):
        checkpoint.slices(["z"]).__enter__()
