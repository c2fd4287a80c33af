"""The user's files as documents: read as plain Python reads them, and what is not text
refused with one line that names the file and where."""

from __future__ import annotations

import json

import pytest

from gpipe.train.texts import DataError, hold_out, read_texts


def test_a_text_file_is_one_document_of_its_bytes(tmp_path):
    (tmp_path / "notes.txt").write_bytes("café\nline two\n".encode())
    texts = read_texts(tmp_path / "notes.txt")
    assert texts.train == [(tmp_path / "notes.txt").read_bytes()] and texts.val is None
    assert "1 document, 15 bytes" in texts.description


def test_jsonl_records_give_their_text_field(tmp_path):
    rows = [{"text": "first", "n": 1}, {"text": "second é", "n": 2}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_texts(tmp_path / "d.jsonl").train == [r["text"].encode() for r in rows]
    (tmp_path / "a.json").write_text(json.dumps(rows))  # a JSON array of records too
    assert read_texts(tmp_path / "a.json").train == [b"first", "second é".encode()]
    pairs = [{"src": "a", "tgt": "b"}, {"src": "c", "tgt": "d"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in pairs))
    assert read_texts(tmp_path / "p.jsonl", field="src", target="tgt").train == [
        (b"a", b"b"), (b"c", b"d"),
    ]  # fmt: skip
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="is plain text, but pairs"):
        read_texts(tmp_path / "notes.txt", target="tgt")


def test_a_folder_is_every_file_under_it_in_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("two")
    (tmp_path / "1.md").write_text("one")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "three"}) + "\n")
    (tmp_path / ".hidden").write_text("never")
    (tmp_path / "empty.txt").write_text("")  # adds no document
    texts = read_texts(tmp_path)
    assert texts.train == [b"one", b"two", b"three"]  # 1.md, b/2.txt, c.jsonl
    assert "3 documents, 11 bytes (4 files in" in texts.description
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_texts(tmp_path / "missing")


# What is not text: one line each, naming the file, where, and what to do.
BAD = [
    ("empty.jsonl", b"", {}, "{f} is empty: name a file that holds text"),
    ("empty.txt", b"", {}, "{f} is empty: name a file that holds text"),
    ("blank.jsonl", b"\n\n  \n", {}, "{f} is empty"),
    ("nothing.jsonl", b'{"text": ""}\n', {}, "{f}: its 1 records hold no text in 'text'"),
    (
        "missing.jsonl",
        b'{"text": "a"}\n{"body": "b"}\n',
        {},
        "{f}, line 2: no field 'text' (it has ['body']); name the field that holds the text "
        "with --text-field",
    ),
    (
        "pairs.jsonl",
        b'{"src": "a"}\n',
        {"field": "src", "target": "tgt"},
        "{f}, line 1: no field 'tgt' (it has ['src']); name the field that holds the text with "
        "--target-field",
    ),
    (
        "number.jsonl",
        b'{"text": "a"}\n\n{"text": 3}\n',
        {},
        "{f}, line 3: field 'text' holds a JSON number, not a string of text",
    ),
    (
        "list.jsonl",
        b'{"text": ["a", "b"]}\n',
        {},
        "{f}, line 1: field 'text' holds a JSON array, not a string of text",
    ),
    ("row.jsonl", b'"just text"\n', {}, "{f}, line 1: a JSON string, not a record"),
    (
        "malformed.jsonl",
        b'{"text": "a"}\n{"text": "b",}\n',
        {},
        "{f}, line 2: not a JSON record (Expecting property name enclosed in double quotes at "
        "column 14); each line of a JSONL file is one record",
    ),
    (
        "array.json",
        b'[{"text": "a"},\n {"text"}]',
        {},
        "{f}: not JSON (Expecting ':' delimiter at line 2, column 9)",
    ),
    ("record.json", b'[{"text": "a"}, {"n": 1}]', {}, "{f}, record 2: no field 'text'"),
    (
        "weights.bin",
        b"PK\x03\x04\x00\x00\x08\x00",
        {},
        "{f} is binary, not text (a NUL byte at offset 4): name text or JSONL files (UTF-8)",
    ),
    (
        "latin1.txt",
        "café au lait".encode("latin-1"),
        {},
        "{f} is not UTF-8 text (byte 0xe9 at offset 3): convert it (iconv -t UTF-8)",
    ),
    (
        "latin1.jsonl",
        '{"text": "é"}'.encode("latin-1"),
        {},
        "{f} is not UTF-8 text (byte 0xe9 at offset 10)",
    ),
]


@pytest.mark.parametrize(("name", "content", "fields", "message"), BAD, ids=[b[0] for b in BAD])
def test_what_is_not_text_is_refused_with_the_file_and_where(tmp_path, name, content, fields,
                                                              message):  # fmt: skip
    file = tmp_path / name
    file.write_bytes(content)
    with pytest.raises(DataError) as error:
        read_texts(file, **fields)
    text = str(error.value)
    assert text.startswith(message.format(f=file)), text
    assert "\n" not in text


def test_a_binary_file_in_a_folder_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("some text")
    (tmp_path / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(DataError, match=r"photo\.png is binary, not text \(a NUL byte at offset 8"):
        read_texts(tmp_path)
    (tmp_path / "photo.png").unlink()
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(DataError, match="its 1 files are empty"):
        read_texts(tmp_path)


def test_a_saved_dataset_gives_its_rows_and_its_validation_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": [f"row {i}" for i in range(5)], "label": list(range(5))}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "one"))
    texts = read_texts(tmp_path / "one")
    assert texts.train == [t.encode() for t in rows["text"]] and texts.val is None
    both = datasets.DatasetDict(
        train=datasets.Dataset.from_dict(rows),
        validation=datasets.Dataset.from_dict({"text": ["held"], "label": [9]}),
    )
    both.save_to_disk(str(tmp_path / "two"))
    texts = read_texts(tmp_path / "two")
    assert len(texts.train) == 5 and texts.val == [b"held"]
    with pytest.raises(DataError, match=r"has no column 'body' \(its columns"):
        read_texts(tmp_path / "one", field="body")
    with pytest.raises(DataError, match=r"\(split train\), row 0: column 'label' holds a int"):
        read_texts(tmp_path / "one", field="label")


def test_holding_out_takes_whole_documents_or_the_end_of_one():
    records = [f"doc {i}".encode() for i in range(20)]
    train, val = hold_out(records, 0.2)
    assert len(val) == 4 and sorted(train + val) == sorted(records)
    assert train == [r for r in records if r not in val]  # in their order
    assert hold_out(records, 0.2) == (train, val)  # the same every time
    text = b"".join(f"line {i}\n".encode() for i in range(10))
    head, tail = hold_out([text], 0.25)
    assert head[0] + tail[0] == text and tail[0].startswith(b"line ") and len(tail[0]) < 25
    with pytest.raises(DataError, match="one record cannot be split"):
        hold_out([(b"a", b"b")], 0.5)
