"""gpipe.base.files: a file or folder written whole or not at all, never through a link."""

from __future__ import annotations

import os
import tempfile

import pytest

from gpipe.base.files import write_file, write_folder


def _fail(file):
    file.write(b"half")
    raise OSError("disk full")


def test_a_failure_mid_write_leaves_nothing_new(tmp_path):
    with pytest.raises(OSError, match="disk full"):
        write_file(tmp_path / "x.pt", _fail)
    assert list(tmp_path.iterdir()) == []


def test_a_failure_mid_write_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "x.json"
    write_file(path, lambda f: f.write(b"old"))
    with pytest.raises(OSError, match="disk full"):
        write_file(path, _fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_a_link_planted_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"theirs")
    (tmp_path / "x.json").symlink_to(victim)
    write_file(tmp_path / "x.json", lambda f: f.write(b"ours"))
    assert victim.read_bytes() == b"theirs"
    assert not (tmp_path / "x.json").is_symlink()
    assert (tmp_path / "x.json").read_bytes() == b"ours"
    assert os.stat(tmp_path / "x.json").st_mode & 0o777 == 0o666 & ~_umask()  # as open() makes


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    # The temporary name is made exclusively: a name already taken (here the first one
    # tried, planted as a link) is passed over for a fresh one.
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    victim = tmp_path / "victim"
    victim.write_bytes(b"theirs")
    (tmp_path / ".x.json.planted.tmp").symlink_to(victim)
    write_file(tmp_path / "x.json", lambda f: f.write(b"ours"))
    assert victim.read_bytes() == b"theirs"
    assert (tmp_path / "x.json").read_bytes() == b"ours"
    assert (tmp_path / ".x.json.planted.tmp").is_symlink()  # left as it was
    assert next(names, None) is None  # the planted name was tried, then the fresh one


def test_write_folder_puts_the_new_folder_in_place_of_the_old(tmp_path):
    out = tmp_path / "model"
    for text in ("first", "second"):
        write_folder(out, lambda into, text=text: (into / "weights").write_text(text))
        assert (out / "weights").read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # nothing aside, no tmp


def test_write_folder_leaves_the_old_folder_when_the_writing_fails(tmp_path):
    out = tmp_path / "model"
    write_folder(out, lambda into: (into / "weights").write_text("old"))
    with pytest.raises(OSError, match="disk full"):
        write_folder(out, _fail_into)
    assert (out / "weights").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _fail_into(folder):
    with open(folder / "weights", "wb") as file:
        _fail(file)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
