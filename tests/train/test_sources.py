"""What a run reads: the user's files tokenized once (bytes, or the folder's tokenizer) into
a cache keyed by what the tokens depend on, with a validation split."""

from __future__ import annotations

import sys

import pytest
import torch

from gpipe.train.sources import Files, TextData
from gpipe.train.tokenizers import BYTES


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(tmp_path / "cache"))


def test_tokens_are_cached_once_and_rebuilt_when_the_data_changes(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"hello\nworld\n" * 20)
    data = TextData(Files(str(tmp_path / "a.txt")), None, 0.25, BYTES)
    first = data.load()
    assert bytes(first.train.tokens.tolist()) + bytes(first.val.tokens.tolist()) == (
        b"hello\nworld\n" * 20
    )
    assert len(list((tmp_path / "cache").glob("tokens-*.pt"))) == 1

    def tokenize_again():
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data, "_tokenize", tokenize_again)
    assert torch.equal(data.load().train.tokens, first.train.tokens)  # read from the cache
    (tmp_path / "a.txt").write_bytes(b"other text\n" * 30)
    with pytest.raises(AssertionError, match="tokenized again"):
        data.load()


def test_the_validation_set_is_named_or_the_datasets_own_split(tmp_path):
    (tmp_path / "t.txt").write_text("train text " * 10)
    (tmp_path / "v.txt").write_text("validation")
    named = TextData(Files(str(tmp_path / "t.txt")), Files(str(tmp_path / "v.txt")), 0.5, BYTES)
    split = named.load()
    assert bytes(split.val.tokens.tolist()) == b"validation"
    assert bytes(split.train.tokens.tolist()) == b"train text " * 10  # nothing held out
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict(
        train=datasets.Dataset.from_dict({"text": ["a b c", "d e f"]}),
        validation=datasets.Dataset.from_dict({"text": ["held"]}),
    ).save_to_disk(str(tmp_path / "saved"))
    split = TextData(Files(str(tmp_path / "saved")), None, 0.5, BYTES).load()
    assert bytes(split.val.tokens.tolist()) == b"held" and len(split.train) == 2


def test_a_saved_dataset_without_the_datasets_library_names_the_extra(tmp_path, monkeypatch):
    for name in ("dataset_info.json", "state.json"):
        (tmp_path / name).write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    data = TextData(Files(str(tmp_path)), None, 0.5, BYTES)
    with pytest.raises(ImportError, match=r"pip install 'gpipe\[datasets\]'"):
        data.load()
