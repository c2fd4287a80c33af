"""Files written whole or not at all, and never through a link: the one way gpipe writes
a file (:func:`write_file`) or a folder (:func:`write_folder`) that a crash or a planted
link must not leave half-written or redirected."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["fsync_folder", "write_file", "write_folder"]


def write_file(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """``write`` a file into a new temporary file beside ``path``, then rename it over
    ``path`` (a link at ``path`` is replaced, never followed): whole or not at all, and on
    disk (the file before the rename, the folder's entry after it)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600: as open() would have made it
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_folder(path.parent)


def write_folder(path: Path, write: Callable[[Path], Any]) -> None:
    """``write`` a folder into a new temporary one beside ``path``, then put it in place
    of ``path`` (what was there is removed once the new one is in place)."""
    temporary = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    aside = None
    try:
        os.chmod(temporary, 0o777 & ~_umask())
        write(temporary)
        if path.is_dir() and not path.is_symlink():
            aside = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, aside / path.name)
        elif os.path.lexists(path):
            os.unlink(path)
        os.replace(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def fsync_folder(folder: Path) -> None:
    """Put ``folder``'s entries (a rename) on disk."""
    with contextlib.suppress(OSError):  # a file system that cannot: nothing more to do
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)  # read by setting it: put back at once
    os.umask(mask)
    return mask
