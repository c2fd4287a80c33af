"""Is a checkpoint intact, and which one to resume from.

``gpipe.train.checkpoint`` records the SHA-256 of each file DCP wrote in the manifest, and the
manifest's own; :func:`problems` checks a checkpoint against them (and its step against its
folder's name) and, since anyone can recompute a SHA-256, reads what DCP stored as data only
(:mod:`gpipe.parallel.dcp` refuses a checkpoint that holds anything else); :func:`listing`
reports every checkpoint of a run (``gpipe checkpoints DIR``), and :func:`choose` picks the
newest intact one to resume from, saying which newer ones it skipped and why.
"""

from __future__ import annotations

from pathlib import Path

from gpipe.parallel import dcp
from gpipe.train.checkpoint import (
    MANIFEST,
    UNFINISHED,
    CheckpointError,
    find,
    read_manifest_file,
    sha256_of,
)
from gpipe.train.run_folder import STEPS, checkpoints, step_folder

__all__ = ["choose", "listing", "problems"]


def problems(folder: str | Path) -> list[str]:
    """What is wrong with the checkpoint in ``folder`` (empty: intact): a missing,
    unreadable or edited manifest (or one of the former format), a step that is not the
    folder's, files missing, unreadable or whose bytes are not those saved (SHA-256 of the
    manifest), and, if the bytes are those saved, anything in them that is not DCP's data."""
    folder = Path(folder)
    try:
        manifest = read_manifest_file(folder)
    except CheckpointError as error:
        why = type(error.__cause__).__name__ if error.__cause__ else error
        return [f"cannot read its {MANIFEST} ({why})"]
    found = []
    if step_folder(manifest.step) != folder.name:
        found.append(f"its manifest says step {manifest.step}, not {folder.name}")
    if not manifest.files:
        found.append(f"its {MANIFEST} lists no files")
    for file, digest in manifest.files.items():
        found += _file_problems(folder / file, digest)
    if not found:
        try:
            dcp.Reader(folder).check_objects()
        except dcp.DcpFailure as error:
            found.append(str(error))
    return found


def _file_problems(path: Path, digest: str) -> list[str]:
    if not path.is_file():
        return [f"{path.name} is missing"]
    try:
        same = sha256_of(path) == digest
    except OSError as error:  # no permission, an I/O error: damage like any other
        return [f"{path.name} is unreadable ({error.strerror or type(error).__name__})"]
    return [] if same else [f"{path.name} is not the file saved (checksum differs)"]


def listing(path: str | Path) -> list[tuple[Path, list[str]]]:
    """Every checkpoint under a run or checkpoints folder, oldest first, with its problems
    (an unfinished save: ``["incomplete: ..."]``)."""
    folders = sorted(checkpoints(path).glob(STEPS))
    return [(folder, _state(folder)) for folder in folders if folder.is_dir()]


def _state(folder: Path) -> list[str]:
    if folder.name.endswith(UNFINISHED):
        return ["incomplete: a save that did not finish"]
    try:
        if not (folder / MANIFEST).is_file():
            return [f"incomplete: no {MANIFEST}"]
        return problems(folder)
    except OSError as error:  # a folder this user may not search
        return [f"{error.filename or folder} is unreadable ({error.strerror or error})"]


def choose(path: str | Path, *, strict: bool = False) -> tuple[Path, list[str]]:
    """The checkpoint to resume from, and warnings: ``path`` itself when it is one (which
    must be intact), else the newest intact checkpoint under it. Skipping a newer damaged
    or incomplete one is a warning, or with ``strict`` an error naming the remedy."""
    path = Path(path)
    if (path / MANIFEST).is_file() or not path.is_dir():
        folder = find(path)
        found = problems(folder)
        if found:
            raise CheckpointError(f"{folder} is damaged: {'; '.join(found)}")
        return folder, []
    rows = listing(path)
    notes = []
    for folder, found in reversed(rows):
        if not found:
            if notes and strict:
                raise CheckpointError(
                    "; ".join(notes) + f". Resume from {folder} explicitly (--resume {folder})"
                    ", or drop --strict-resume to fall back to it"
                )
            return folder, [
                n + f"; resuming from {folder.name}, the newest intact one" for n in notes
            ]
        notes.append(f"{folder} is skipped: {'; '.join(found)}")
    find(path)  # raises: no complete checkpoint
    raise CheckpointError(f"no intact checkpoint in {path}: " + "; ".join(notes))
