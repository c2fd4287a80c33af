"""gpipe.train.inputs: what a run needs, checked before any process starts and before the
run's folder is made: its data, its output folder, the memory its model needs at its peak."""

from __future__ import annotations

import pytest

from gpipe.__main__ import main

# Bad data: one line naming the file and where, before any process starts (a test that
# started one would fail: conftest refuses it outside the slow tests) and before the run's
# folder is made.
BAD_DATA = [
    ("empty.jsonl", b"", "{f} is empty: name a file that holds text"),
    ("empty.txt", b"", "{f} is empty: name a file that holds text"),
    ("missing.jsonl", b'{"text": "a"}\n{"body": "b"}\n', "{f}, line 2: no field 'text' (it has "
     "['body']); name the field that holds the text with --text-field"),
    ("number.jsonl", b'{"text": 3}\n', "{f}, line 1: field 'text' holds a JSON number, not a "
     "string of text"),
    ("malformed.jsonl", b'{"text": "a"}\n{"text": "b",}\n', "{f}, line 2: not a JSON record ("),
    ("model.bin", b"\x7fELF\x02\x01\x01\x00\x00", "{f} is binary, not text (a NUL byte at "
     "offset 7)"),
    ("latin1.txt", "naïve".encode("latin-1"), "{f} is not UTF-8 text (byte 0xef at offset 2)"),
    ("short.txt", b"a short text", "--data {f}: the train set: 11 tokens hold no window of 33 "
     "tokens: more data, or a shorter --seq"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "message"), BAD_DATA, ids=[b[0] for b in BAD_DATA])
def test_bad_data_is_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, name,
                                                     content, message):  # fmt: skip
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "run"
    assert main(["train", "--size", "tiny", "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpipe train: error: {message.format(f=data)}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_an_output_folder_that_is_not_a_run_is_refused(tmp_path, monkeypatch, capsys):
    """--out at a model's folder once overwrote its config.json: the model no longer loaded."""
    model = tmp_path / "my-qwen"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    assert main(["train", "--size", "tiny", "--out", str(model)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"gpipe train: error: --out {model} holds config.json, and is not a gpipe run: gpipe "
        "writes a run only into a new or empty folder or its own run's; choose another --out\n"
    )
    assert [p.name for p in model.iterdir()] == ["config.json"]
    assert (model / "config.json").read_text() == '{"model_type": "qwen2"}'


def test_a_model_too_large_for_this_machine_is_refused_with_its_peak(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    """The README's Qwen at 4 layers (2.6 B parameters) was OOM-killed after 1m43s."""
    from gpipe.train import inputs

    monkeypatch.setattr(inputs, "available_memory", lambda: 2 * 2**30)
    out = tmp_path / "run"
    # 12 x 1024^2 x 24 blocks and the embeddings: 303 M parameters, 16 bytes each with AdamW
    argv = ["train", "--model-config", "d_model=1024,n_layers=24", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "gpipe train: error: --model gpt: 302,901,248 parameters; a process needs about 2.6 "
        "GiB at its peak (its stage's parameters, gradients and optimizer state in float32, "
        "before activations), 2 processes 5.3 GiB, more than the 2.0 GiB this machine has "
        "available; train a smaller model (--model-config), or use more --stages or --shard "
        "with --replicas\n"
    )
    assert not out.exists()
