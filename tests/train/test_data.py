"""The data sets of ``gpipe train``: the stdlib's files, digits, token documents and their
windows, and the resumable sampler (the user's files: test_texts.py)."""

from __future__ import annotations

import pathlib

import pytest
import torch

import gpipe.train.data as data


def test_the_stdlib_is_split_by_file_name():
    files = data.stdlib_files()
    val_files = [f for f in files if data.is_validation(f)]
    assert len(files) > 50 and 0 < len(val_files) < len(files) / 4
    elsewhere = [f for f in files if data.is_validation(pathlib.Path("/elsewhere") / f.name)]
    assert elsewhere == val_files  # the name decides: the same split on every machine


def test_missing_stdlib_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \.py files"):
        data.stdlib_files(tmp_path)


def test_windows_pair_each_byte_with_the_next():
    text = torch.arange(50, dtype=torch.uint8)
    windows = data.TokenWindows(text, seq=8)
    assert len(windows) == 6  # (50 - 1) // 8
    x, y = windows[torch.tensor([0, 5])]
    assert x.shape == y.shape == (2, 8) and x.dtype == torch.int64
    assert torch.equal(x[0], torch.arange(8)) and torch.equal(y[0], torch.arange(1, 9))
    assert torch.equal(y[1], torch.arange(41, 49))
    assert windows.evenly_spaced(3).tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="no window"):
        data.TokenWindows(text[:5], seq=8)


def test_sampler_visits_every_item_once_per_epoch_and_resumes_exactly():
    sampler = data.EpochSampler(10, seed=7)
    first = sampler.take(4).tolist() + sampler.take(6).tolist()
    assert sorted(first) == list(range(10))
    crossing = sampler.take(7)  # epoch 1: 7 of 10
    state = sampler.state_dict()
    assert state == {"seed": 7, "epoch": 1, "index": 7, "items": 10}
    expected = sampler.take(9)  # runs into epoch 2

    resumed = data.EpochSampler(10, seed=7)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.take(9), expected)
    assert sorted(crossing.tolist() + expected[:3].tolist()) == list(range(10))
    assert data.EpochSampler(10, seed=8).take(10).tolist() != first  # the seed matters

    with pytest.raises(ValueError, match="seed 7"):
        data.EpochSampler(10, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"epoch of 10 items, this data has 5: .* other data"):
        data.EpochSampler(5, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="outside an epoch of 5"):  # a state without "items"
        data.EpochSampler(5, seed=7).load_state_dict({"seed": 7, "epoch": 1, "index": 7})


def test_hash_seed_is_stable_and_mixes():
    assert data.hash_seed(0, 1) == data.hash_seed(0, 1)
    seeds = {data.hash_seed(0, step, replica) for step in range(100) for replica in range(2)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)


def test_generated_bytes_read_as_text_with_escapes_where_they_are_not():
    # what a byte-level model may write: UTF-8, a cut sequence, stray bytes, a terminal escape
    written = "é = 1\n\tπ".encode() + b"\xe2\x28" + b"\xff\r\x1b[2J\x7f"
    assert data.readable(written) == "é = 1\n\tπ\\xe2(\\xff\\x0d\\x1b[2J\\x7f"
    assert "\ufffd" not in data.readable(written)


def test_digits_are_normalized_and_split_once():
    pytest.importorskip("sklearn")
    digits = data.digits()
    assert digits.train_images.shape == (1500, 1, 8, 8) and digits.val_images.shape[0] == 297
    assert abs(float(digits.train_images.mean())) < 1e-4
    assert set(digits.train_labels.tolist()) == set(range(10))
    again = data.digits()
    assert torch.equal(again.val_images, digits.val_images)  # the same split every time


def test_windows_packed_and_padded_are_the_documents_cut_as_written():
    documents = data.Documents.of([[1, 2, 3, 4, 5, 6, 7], [8, 9], [10]])
    assert documents[1].tolist() == [8, 9] and documents.lengths.tolist() == [7, 2, 1]
    stream = documents.joined([0])
    assert stream.tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 8, 9, 0, 10]
    packed = data.PackedWindows(stream, length=4, stride=3)  # seq 3: windows of seq + 1
    tokens, real = packed[torch.arange(len(packed))]
    assert tokens.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7], [7, 0, 8, 9]] and real.all()
    padded = data.PaddedWindows(documents, length=4, stride=3, pad=-1)
    tokens, real = padded[torch.arange(len(padded))]
    # each document on its own; [10] alone has no next token to learn
    assert tokens.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7], [8, 9, -1, -1]]
    assert real.sum(1).tolist() == [4, 4, 2]
    pairs = data.PairedSamples(documents, data.Documents.of([[1], [2, 3], [4, 5, 6]]),
                               length=2, target_length=3, pad=0)  # fmt: skip
    source, source_real, target, target_real = pairs[torch.tensor([0, 2])]
    assert source.tolist() == [[1, 2], [10, 0]] and source_real.sum(1).tolist() == [2, 1]
    assert target.tolist() == [[1, 0, 0], [4, 5, 6]] and target_real.sum(1).tolist() == [1, 3]
