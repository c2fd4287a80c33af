"""Training checkpoints through PyTorch's Distributed Checkpoint (DCP), loadable with any cut.

A pipelined model never exists in one place, so neither does its checkpoint. Every process
writes its part with ``torch.distributed.checkpoint`` (through :mod:`gpipe.parallel.dcp`):
its layers' parameters and buffers under their **whole-model names** (``model.3.qkv.weight``,
as ``Pipe.state_dict()`` gives them), its optimizer state keyed by the same names (torch
optimizers key state by position, which changes with the cut) and its random-number state.
DCP stores each tensor once with its global shape and where each chunk lies, so a
checkpoint saved by K stages, R replicas, sharded or not, loads into any other layout (each
rank reads just its names, DCP's planner cutting what it needs), and DCP's own tools (and
torchtitan's) read it. A ``manifest.json`` beside DCP's files (:class:`Manifest`) records
the step, the run's configuration, the data position, the learning-rate scheduler and the
SHA-256 of every file (and of itself); this module alone writes and reads it.

Layout of a run's checkpoints::

    checkpoints/
      step-000200/            one complete checkpoint
        manifest.json
        .metadata             DCP's: every key's shape, dtype and chunks
        __0_0.distcp          what rank 0 wrote (one file per rank)
        __1_0.distcp
      step-000400/
      latest                  "step-000400": the newest complete checkpoint

Writing is atomic: a checkpoint is assembled in ``step-NNNNNN.tmp/`` and renamed to its
final name only once DCP's files and the manifest are in place (each written under a
temporary name, flushed and renamed), after which ``latest`` is replaced. A process that
dies mid-write leaves a ``.tmp`` folder that readers ignore (and the next save of that step
removes); the previous checkpoint stays intact and ``latest`` still names it.

Multi-process protocol (see ``gpipe.train.trainer``)::

    if rank == 0: checkpoint.begin(root, step)                # then a barrier
    tmp = checkpoint.staging_folder(root, step)
    checkpoint.write(tmp, model=..., optimizer=..., rng=..., replica=...)  # every rank
    # a barrier: every rank's part written
    if rank == 0:                                             # then a barrier
        checkpoint.commit(root, tmp, Manifest(step=step, ...))  # merges DCP's metadata

Checkpoints of gpipe's former format (version 1: one ``torch.save`` file per pipeline rank)
are refused, naming the remedy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from gpipe.base.files import fsync_folder, write_file
from gpipe.parallel import dcp
from gpipe.train.run_folder import CHECKPOINTS, STEPS, step_folder

__all__ = [
    "CheckpointError",
    "LATEST",
    "MANIFEST",
    "UNFINISHED",
    "Loaded",
    "Manifest",
    "begin",
    "commit",
    "export_state_dict",
    "find",
    "holds",
    "load",
    "load_tensors",
    "read_manifest",
    "read_manifest_file",
    "sha256_of",
    "staging_folder",
    "write",
    "write_manifest",
]

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "gpipe-checkpoint"
VERSION = 2  # 1: torch.save shards (gpipe up to commit 9de4e29); 2: DCP
FORMER = "9de4e29"  # the last commit that wrote (and reads) version 1
# A step's folder being assembled, and the one a save of the same step is replacing: every
# reader skips both.
_TMP, _OLD = ".tmp", ".old"
UNFINISHED = (_TMP, _OLD)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not fit the model."""


@dataclass
class Manifest:
    """A checkpoint's ``manifest.json`` (format :data:`VERSION`): written by
    :func:`write_manifest` (through :func:`commit`), read by :func:`read_manifest`, here only.
    A ``gpipe train`` run's records, kept as given (None: not written by gpipe train):"""

    step: int
    config: dict[str, Any] | None = None  # the run's TrainConfig, as a dict
    model: dict[str, Any] | None = None  # what builds the model (train.tasks' spec)
    data: dict[str, Any] | None = None  # the data position (EpochSampler.state_dict())
    layout: dict[str, Any] | None = None  # the saving run's Layout.to_dict() and balance
    scheduler: dict[str, Any] | None = None  # the lr scheduler's state (and a GradScaler's)
    saved_at: str = ""  # stamped when written
    files: dict[str, str] = field(default_factory=dict)  # DCP's file -> its SHA-256 (derived)
    path: Path | None = None  # the checkpoint's folder, once read (not saved)


@dataclass
class Loaded:
    """What :func:`load` read: whole tensors by name, the optimizer state by name (as
    ``gpipe.train.optimizer_state`` gives it), one pipeline rank's random-number state."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    rng: torch.Tensor | None = None


# -- writing ---------------------------------------------------------------------------------


def staging_folder(root: str | Path, step: int) -> Path:
    """The temporary folder in which the checkpoint of ``step`` is assembled."""
    return Path(root) / (step_folder(step) + _TMP)


def begin(root: str | Path, step: int) -> Path:
    """Create (afresh) the :func:`staging_folder` of ``step``; return it."""
    tmp = staging_folder(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a save that died
    tmp.mkdir(parents=True)
    return tmp


def write(
    folder: str | Path,
    *,
    model: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any] | None = None,
    rng: Mapping[int, torch.Tensor] | None = None,
    replica: int = 0,
) -> None:
    """Write this process's part of a checkpoint into ``folder`` with DCP: its ``model``
    tensors by whole-model name (``DTensor`` shards as such), its ``optimizer`` state by
    name (``gpipe.train.optimizer_state``) and ``rng``, ``{pipeline rank: torch's random
    state}``. Every process of the job calls it, then :func:`commit` once all have; what a
    ``replica`` other than the first writes: :func:`gpipe.parallel.dcp.save`."""
    state: dict[str, Any] = {"model": dict(model)}
    if optimizer is not None:
        state["optimizer"] = _optimizer_as_saved(optimizer)
    if rng:
        state["rng"] = {str(rank): value for rank, value in rng.items()}
    try:
        dcp.save(state, folder, replica=replica)
    except dcp.DcpFailure as error:
        raise CheckpointError(f"cannot write the checkpoint in {folder}: {error}") from None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit(root: str | Path, tmp: str | Path, manifest: Manifest, *, keep: int = 0) -> Path:
    """Write the manifest into ``tmp`` (:func:`write_manifest`), give the checkpoint its
    final name, point ``latest`` at it. ``keep`` > 0 deletes all but the newest ``keep``
    checkpoints. Returns the final folder.
    """
    root, tmp = Path(root), Path(tmp)
    try:
        dcp.merge(tmp)  # every rank's part, written by :func:`write`
    except dcp.DcpFailure as error:
        raise CheckpointError(f"cannot commit {tmp}: {error}") from None
    write_manifest(tmp, manifest)
    final = root / step_folder(manifest.step)
    old = final.with_name(final.name + _OLD)  # left by a save that died replacing it
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():  # saving a step again (a rerun into the same folder): replace it
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_folder(root)
    write_file(root / LATEST, lambda f: f.write(final.name.encode()))
    if keep > 0:
        for stale in _complete(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def write_manifest(folder: str | Path, manifest: Manifest) -> None:
    """Write ``manifest`` as ``folder/manifest.json`` with the SHA-256 of every file DCP
    wrote there, the time, and its own checksum (an edited manifest is a damaged one)."""
    folder = Path(folder)
    if not (folder / dcp.METADATA).is_file():
        raise CheckpointError(
            f"cannot commit {folder}: its files were not written (no {dcp.METADATA})"
        )
    files = {
        p.name: sha256_of(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST and _TMP not in p.name
    }
    record = {**asdict(manifest), "files": files}
    record.update(saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), format=FORMAT, version=VERSION)
    del record["path"]
    record["sha256"] = _digest(record)
    write_file(folder / MANIFEST, lambda f: f.write(json.dumps(record, indent=1).encode()))


def _digest(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# -- finding and reading ---------------------------------------------------------------------


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    found = [
        p
        for p in root.glob(STEPS)
        if p.is_dir() and not p.name.endswith(UNFINISHED) and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def find(path: str | Path) -> Path:
    """The checkpoint folder ``path`` designates: a checkpoint itself, a folder of
    checkpoints (its newest complete one) or a run's folder (its ``checkpoints/``).

    Raises ``CheckpointError`` saying what was looked for when there is none.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder; give a checkpoint or run folder")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointError(f"{path} is not readable (permissions)")
    if (path / MANIFEST).is_file():
        return path
    for root in (path, path / CHECKPOINTS):
        latest = root / LATEST
        if latest.is_file():
            named = root / latest.read_text().strip()
            if (named / MANIFEST).is_file():
                return named
        complete = _complete(root) if root.is_dir() else []
        if complete:
            return complete[-1]
    raise CheckpointError(
        f"no complete checkpoint in {path}: expected {MANIFEST} there, or step-NNNNNN/ "
        f"folders holding one (in {path} or {path / CHECKPOINTS})"
    )


def holds(path: str | Path) -> bool:
    """Whether ``path`` designates a complete checkpoint (:func:`find` finds one)."""
    with contextlib.suppress(CheckpointError):
        return bool(find(path))
    return False


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of the checkpoint ``path`` designates (see :func:`find`), whose files
    must all be readable."""
    folder = find(path)
    manifest = read_manifest_file(folder)
    unreadable = [file for file in manifest.files if not os.access(folder / file, os.R_OK)]
    if unreadable:
        raise CheckpointError(f"{folder}: files missing or unreadable: {unreadable}")
    return manifest


def read_manifest_file(folder: str | Path) -> Manifest:
    """The manifest in checkpoint ``folder`` as written (its files unchecked); raises
    ``CheckpointError`` if it cannot be read, is not one, was edited, or is of another
    format version."""
    folder = Path(folder)
    try:
        record = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {folder / MANIFEST}: {error}") from error
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{folder / MANIFEST} is not a gpipe checkpoint manifest")
    version = record.get("version", 0)
    if version > VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format version {version}; this gpipe reads up to "
            f"{VERSION}: upgrade gpipe"
        )
    if version < VERSION:
        raise CheckpointError(
            f"{folder} is in gpipe's former checkpoint format (version {version}: torch.save "
            f"shards), which this gpipe (DCP, version {VERSION}) does not read: resume or "
            f"export it with gpipe at commit {FORMER}"
        )
    if record.get("sha256") != _digest(record):
        raise CheckpointError(f"{folder / MANIFEST} was edited (its SHA-256 differs)")
    known = {f.name for f in fields(Manifest)} - {"path"}
    try:
        return Manifest(**{k: v for k, v in record.items() if k in known}, path=folder)
    except TypeError as error:  # step missing
        raise CheckpointError(f"{folder / MANIFEST} is incomplete: {error}") from error


def _reader(manifest: Manifest) -> dcp.Reader:
    try:
        return dcp.Reader(manifest.path)
    except dcp.DcpFailure as error:  # damaged, unreadable or refused: it names the file
        raise CheckpointError(str(error)) from error


def names(manifest: Manifest) -> list[str]:
    """The model's tensor names the checkpoint holds, in the order they were saved."""
    entries = _reader(manifest).entries
    return [k.removeprefix("model.") for k in entries if k.startswith("model.")]


def load(
    manifest: Manifest,
    *,
    model: Iterable[str],
    optimizer: Iterable[str] | None = None,
    rng: int | None = None,
) -> Loaded:
    """Read the whole tensors ``model`` (whole-model names), the optimizer state of the
    parameters ``optimizer`` (names) and pipeline rank ``rng``'s random state, from any
    layout's checkpoint; this process alone (no collective)."""
    reader = _reader(manifest)
    entries = reader.entries
    wanted = list(model)
    missing = [n for n in wanted if f"model.{n}" not in entries]
    if missing:
        shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
        raise CheckpointError(
            f"checkpoint {manifest.path} has no {len(missing)} of the names this model "
            f"needs ({shown}): was it saved from another model or configuration?"
        )
    state: dict[str, Any] = {"model": {n: _empty(entries, f"model.{n}") for n in wanted}}
    parameters = set(optimizer or ())
    if parameters:
        state["optimizer"] = _optimizer_template(entries, parameters)
    if rng is not None and f"rng.{rng}" in entries:
        state["rng"] = {str(rng): _empty(entries, f"rng.{rng}")}
    try:
        reader.load(state)
    except dcp.Refused as error:  # names the checkpoint and what is not data in it
        raise CheckpointError(str(error)) from error
    except Exception as error:
        raise CheckpointError(
            f"cannot read checkpoint {manifest.path} (damaged, or not written by gpipe?): {error}"
        ) from error
    return Loaded(
        model=state["model"],
        optimizer=_optimizer_as_read(state["optimizer"]) if parameters else None,
        rng=state.get("rng", {}).get(str(rng)),
    )


# -- the optimizer state (by name: gpipe.train.optimizer_state) as DCP keys -------------------
# optimizer.state.{name}.{what}, optimizer.param_groups.{group}.{hyperparameter} and
# optimizer.group_of.{name}: the group of each parameter, groups keyed by their "name".


def _optimizer_as_saved(optimizer: Mapping[str, Any]) -> dict[str, Any]:
    groups, group_of = {}, {}
    for i, group in enumerate(optimizer["param_groups"]):
        key = group.get("name", f"#{i}")
        groups[key] = {k: v for k, v in group.items() if k != "params"}
        group_of.update({name: key for name in group["params"]})
    return {"state": dict(optimizer["state"]), "param_groups": groups, "group_of": group_of}


def _empty(entries: Mapping[str, Any], key: str) -> torch.Tensor | None:
    """What DCP fills for ``key``: a tensor of its size and type, or None (an object)."""
    if entries[key] is None:
        return None
    size, dtype = entries[key]
    return torch.empty(size, dtype=dtype)


def _optimizer_template(entries: Mapping[str, Any], parameters: set[str]) -> dict[str, Any]:
    """The optimizer keys of ``parameters`` the checkpoint holds, for DCP to fill."""
    saved: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key in entries:  # a parameter's names hold no "." key: rpartition splits them off
        if key.startswith("optimizer.state."):
            name, _, what = key.removeprefix("optimizer.state.").rpartition(".")
            if name in parameters:
                saved.setdefault(name, {})[what] = _empty(entries, key)
        elif key.startswith("optimizer.param_groups."):
            group, _, what = key.removeprefix("optimizer.param_groups.").rpartition(".")
            groups.setdefault(group, {})[what] = _empty(entries, key)
    group_of = {n: None for n in parameters if f"optimizer.group_of.{n}" in entries}
    return {"state": saved, "group_of": group_of, "param_groups": groups}


def _optimizer_as_read(saved: dict[str, Any]) -> dict[str, Any]:
    members: dict[str, list[str]] = {g: [] for g in saved["param_groups"]}
    for name, group in saved["group_of"].items():
        members[group].append(name)
    groups = [{**hyper, "params": members[g]} for g, hyper in saved["param_groups"].items()]
    return {"state": saved["state"], "param_groups": groups}


def load_tensors(manifest: Manifest, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The model tensors ``names`` (whole-model names), whole."""
    return load(manifest, model=names).model


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """One plain state dict of the whole model, for the un-split model."""
    manifest = read_manifest(path)
    tensors = load_tensors(manifest, names(manifest))
    # Layer by layer; within a layer, in the order it was saved.
    return dict(sorted(tensors.items(), key=lambda kv: _layer(kv[0])))


def _layer(name: str) -> float:
    head = name.partition(".")[0]
    return int(head) if head.isdigit() else float("inf")
