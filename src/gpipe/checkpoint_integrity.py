"""Is a checkpoint intact, and which one to resume from.

``gpipe.checkpoint`` records the SHA-256 of each file DCP wrote in the manifest, and the
manifest's own; :func:`problems` checks a checkpoint against them (and its step against its
folder's name), :func:`listing` reports every
checkpoint of a run (``gpipe checkpoints DIR``), and :func:`choose` picks the newest intact one
to resume from, saying which newer ones it skipped and why.
"""

from __future__ import annotations

from pathlib import Path

from gpipe.checkpoint import (
    MANIFEST,
    CheckpointError,
    find,
    read_manifest_file,
    sha256_of,
    step_folder,
)

__all__ = ["choose", "listing", "problems"]

_UNFINISHED = (".tmp", ".old")


def problems(folder: str | Path) -> list[str]:
    """What is wrong with the checkpoint in ``folder`` (empty: intact): a missing,
    unreadable or edited manifest (or one of the former format), a step that is not the
    folder's, files missing or whose bytes are not those saved (SHA-256 of the manifest)."""
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
        if not (folder / file).is_file():
            found.append(f"{file} is missing")
        elif sha256_of(folder / file) != digest:
            found.append(f"{file} is not the file saved (checksum differs)")
    return found


def listing(path: str | Path) -> list[tuple[Path, list[str]]]:
    """Every checkpoint under a run or checkpoints folder, oldest first, with its problems
    (an unfinished save: ``["incomplete: ..."]``)."""
    path = Path(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    rows = []
    for folder in sorted(p for p in root.glob("step-*") if p.is_dir()):
        if folder.name.endswith(_UNFINISHED):
            rows.append((folder, ["incomplete: a save that did not finish"]))
        elif not (folder / MANIFEST).is_file():
            rows.append((folder, [f"incomplete: no {MANIFEST}"]))
        else:
            rows.append((folder, problems(folder)))
    return rows


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
