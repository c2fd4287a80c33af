"""Your files as documents: a plain text file (one document), a JSONL file (one record per
line, its text in a named field; also a ``.json`` array of records), a folder of such files,
or a ``datasets`` dataset saved with ``save_to_disk``; each document as bytes, tokenized by
the caller (``gpipe.train.sources``).

What cannot be text is refused while reading, each with one line that names the file and
where: an empty file, a binary one (a NUL byte) or one that is not UTF-8 (the byte's
offset), a line that is not JSON (its number), a record without the field or whose field
holds no string (the type it holds) — :class:`DataError`. Nothing is trained on in silence::

    texts = read_texts("train.jsonl", field="text")   # Texts(train=[b"...", ...], ...)
    train, val = hold_out(texts.train, 0.05)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["JSON_SUFFIXES", "DataError", "Record", "Texts", "hold_out", "read_texts"]

# A document: its bytes, or, for a sequence-to-sequence model, the (source, target) pair.
Record = bytes | tuple[bytes, bytes]
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
# The files of a saved ``datasets`` Dataset, and of a DatasetDict (``save_to_disk``).
_DATASET_FILES, _DATASET_DICT_FILE = ("dataset_info.json", "state.json"), "dataset_dict.json"
_VALIDATION_SPLITS = ("validation", "valid", "val", "test")
_JSON_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "true/false", type(None): "null"}  # fmt: skip


class DataError(ValueError):
    """A data file that cannot be read as documents: the file, where in it, and what to do."""


@dataclass(frozen=True)
class Texts:
    """Documents read from what a user named: ``train``, and ``val`` where the source has a
    split of its own (a saved DatasetDict's ``validation``); None: hold some out."""

    train: list[Record]
    val: list[Record] | None
    description: str
    files: tuple[Path, ...]  # what they were read from (what a cache of their tokens depends on)


def read_texts(path: str | Path, *, field: str = "text", target: str | None = None) -> Texts:
    """The documents at ``path``: a text file (one document), a JSONL file (a document per
    line, its text in ``field``; also a ``.json`` array of records), a folder of such files
    (every file under it, sorted by path, hidden ones skipped; empty ones add nothing), or a
    dataset saved by ``datasets``' ``save_to_disk`` (a record per row). With ``target`` each
    record is a (``field``, ``target``) pair, for a sequence-to-sequence model. Raises
    :class:`DataError` for what is not text (see the module's doc)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: name a text or JSONL file, a folder "
            "of them, or a dataset folder saved by datasets' save_to_disk"
        )
    if path.is_dir() and _is_saved_dataset(path):
        return _read_saved_dataset(path, field, target)
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )  # fmt: skip
    if not files:
        raise FileNotFoundError(f"{path} holds no files")
    records: list[Record] = []
    for file in files:
        records += _read_file(file, field, target)
    size = sum(len(r) if isinstance(r, bytes) else len(r[0]) + len(r[1]) for r in records)
    if not size:
        raise DataError(_nothing_in(path, len(files), len(records), field))
    where = str(path) if path.is_file() else f"{len(files)} files in {path}"
    documents = f"{len(records):,} document{'s' if len(records) > 1 else ''}"
    return Texts(records, None, f"{documents}, {size:,} bytes ({where})", tuple(files))


def _nothing_in(path: Path, files: int, records: int, field: str) -> str:
    if records:
        return f"{path}: its {records} records hold no text in {field!r}: name a field with text"
    if path.is_file():
        return f"{path} is empty: name a file that holds text"
    return f"{path}: its {files} files are empty: name a folder that holds text"


def _read_file(file: Path, field: str, target: str | None) -> list[Record]:
    raw = file.read_bytes()
    text = _text(file, raw)
    if file.suffix.lower() not in JSON_SUFFIXES:
        if target is not None:
            raise DataError(
                f"{file} is plain text, but pairs of --text-field {field} and --target-field "
                f"{target} come from JSONL records or a saved dataset: name those instead"
            )
        return [raw] if text.strip() else []  # an empty file adds no document
    if file.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{file}: not JSON ({error.msg} at line {error.lineno}, column {error.colno})"
            ) from None
        return [_record(row, field, target, f"{file}, record {n}") for n, row in enumerate(rows, 1)]
    records = []
    for n, line in enumerate(text.split("\n"), 1):  # "\n" alone: the line numbers editors show
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(
                f"{file}, line {n}: not a JSON record ({error.msg} at column {error.colno}); "
                'each line of a JSONL file is one record, e.g. {"text": "..."}'
            ) from None
        records.append(_record(row, field, target, f"{file}, line {n}"))
    return records


def _text(file: Path, raw: bytes) -> str:
    """``raw`` as text; a binary or non-UTF-8 file is refused at its first bad byte."""
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"{file} is binary, not text (a NUL byte at offset {nul:,}): name text or JSONL "
            "files (UTF-8)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"{file} is not UTF-8 text (byte 0x{raw[error.start]:02x} at offset "
            f"{error.start:,}): convert it (iconv -t UTF-8), or name another file"
        ) from None


def _record(row: Any, field: str, target: str | None, where: str) -> Record:
    wanted = {field: "--text-field"} if target is None else {
        field: "--text-field", target: "--target-field"}  # fmt: skip
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: a JSON {_kind(row)}, not a record (an object with a {field!r} field)"
        )
    for key, flag in wanted.items():
        if key not in row:
            raise DataError(
                f"{where}: no field {key!r} (it has {sorted(row)}); name the field that holds "
                f"the text with {flag}"
            )
        if not isinstance(row[key], str):
            raise DataError(
                f"{where}: field {key!r} holds a JSON {_kind(row[key])}, not a string of text; "
                f"name the field that holds the text with {flag}"
            )
    if target is None:
        return row[field].encode()
    return row[field].encode(), row[target].encode()


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / _DATASET_DICT_FILE).exists() or all(
        (folder / name).exists() for name in _DATASET_FILES
    )


def _read_saved_dataset(folder: Path, field: str, target: str | None) -> Texts:
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            f"{folder} is a dataset saved by datasets' save_to_disk: reading it needs the "
            "datasets library: pip install 'gpipe[datasets]'"
        ) from error
    loaded = datasets.load_from_disk(str(folder))
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    train_name = "train" if "train" in splits else sorted(splits)[0]
    val_name = next((n for n in _VALIDATION_SPLITS if n in splits and n != train_name), None)

    def column(rows: Any, name: str, key: str) -> list[bytes]:
        texts = rows[key]
        wrong = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
        if wrong is not None:
            raise DataError(
                f"{folder} (split {name}), row {wrong}: column {key!r} holds a "
                f"{type(texts[wrong]).__name__}, not text; name the text's column with "
                "--text-field"
            )
        return [text.encode() for text in texts]

    def records(name: str) -> list[Record]:
        rows = splits[name]
        missing = [k for k in (field, target) if k is not None and k not in rows.column_names]
        if missing:
            raise DataError(
                f"{folder} (split {name}) has no column {missing[0]!r} (its columns: "
                f"{rows.column_names}); name the text's column with --text-field"
            )
        if target is None:
            return list(column(rows, name, field))
        return list(zip(column(rows, name, field), column(rows, name, target), strict=True))

    train = records(train_name)
    val = records(val_name) if val_name else None
    files = tuple(sorted(p for p in folder.rglob("*") if p.is_file()))
    held = f", {len(val):,} in its {val_name} split" if val else ""
    description = f"{len(train):,} records of the saved dataset {folder} ({train_name}{held})"
    return Texts(train, val, description, files)


def hold_out(records: list[Record], fraction: float) -> tuple[list[Record], list[Record]]:
    """(train, validation): ``fraction`` of the documents, chosen by a fixed permutation (the
    same on every machine) and kept in their order; a single document is cut instead, at the
    line that ends before ``1 - fraction`` of its bytes."""
    if not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be in (0, 1), got {fraction}")
    if len(records) == 1 and isinstance(records[0], bytes):
        text = records[0]
        cut = int(len(text) * (1 - fraction))
        line = text.rfind(b"\n", 0, cut)
        cut = line + 1 if line > 0 else cut
        return [text[:cut]], [text[cut:]]
    if len(records) < 2:
        raise DataError("one record cannot be split into train and validation: name a "
                        "separate validation set (--val-data)")  # fmt: skip
    count = min(len(records) - 1, max(1, round(fraction * len(records))))
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(0))
    held = set(order[:count].tolist())
    train = [r for i, r in enumerate(records) if i not in held]
    return train, [r for i, r in enumerate(records) if i in held]
