"""Sharded training checkpoints: one file per pipeline rank, loadable with any number of stages.

A pipelined model never exists in one place, so neither does its checkpoint. Each pipeline
rank writes one *shard*: its layers' parameters and buffers under their **whole-model names**
(``"3.qkv.weight"``, as ``Pipe.state_dict()`` gives them), its optimizer state keyed by the
same names (torch optimizers key state by position, which changes with the cut), and its
random-number state. A ``manifest.json`` beside the shards (:class:`Manifest`) records the
step, the run's configuration, the data position and which shard holds each name; this module
alone writes and reads both formats. Because everything is keyed by name, a checkpoint saved
by K stages loads into any other K (each rank reads just the shards holding its names), and
:func:`export_state_dict` merges the shards into one plain state dict for the un-split model.

Layout of a run's checkpoints::

    checkpoints/
      step-000200/            one complete checkpoint
        manifest.json
        shard-000.pt          pipeline rank 0 (its stage, or its virtual stages)
        shard-001.pt
      step-000400/
      latest                  "step-000400": the newest complete checkpoint

Writing is atomic at two levels. Every file is written under a temporary name, flushed to
disk and renamed; a checkpoint is assembled in ``step-NNNNNN.tmp/`` and renamed to its final
name only once every shard and the manifest are in place, after which ``latest`` is replaced.
A process that dies mid-write leaves a ``.tmp`` folder that readers ignore (and the next
save of that step removes); the previous checkpoint stays intact and ``latest`` still names it.

Multi-process protocol (see ``gpipe.train.trainer``)::

    if rank == 0: checkpoint.begin(root, step)                # then a barrier
    tmp = checkpoint.staging_folder(root, step)
    entry = checkpoint.write_shard(tmp, pp_rank, model=...)  # one writer per pipeline rank
    # gather every entry to rank 0, then:
    if rank == 0:                                            # then a barrier
        checkpoint.commit(root, tmp, Manifest(step=step, shards={**entry, ...}, ...))
"""

from __future__ import annotations

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
from torch import nn

__all__ = [
    "CheckpointError",
    "MANIFEST",
    "Manifest",
    "begin",
    "commit",
    "export_state_dict",
    "find",
    "load_optimizer_state",
    "load_tensors",
    "optimizer_state_by_name",
    "sha256_of",
    "read_manifest",
    "read_manifest_file",
    "load_optimizer_state_by_name",
    "rng_state",
    "shard_file",
    "staging_folder",
    "step_folder",
    "write_manifest",
    "write_shard",
]

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "gpipe-checkpoint"
VERSION = 1
_TMP = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not fit the model."""


@dataclass
class Manifest:
    """A checkpoint's ``manifest.json``: written by :func:`write_manifest` (through
    :func:`commit`), read by :func:`read_manifest`. The run's own records (``config``,
    ``model``, ``data``, ``layout``, ``scheduler``) are kept as given."""

    step: int
    # shard file -> its entry, as :func:`write_shard` returns it (names, stages, SHA-256)
    shards: dict[str, dict[str, Any]]
    config: dict[str, Any] | None = None  # the run's configuration
    model: dict[str, Any] | None = None  # what builds the model
    data: dict[str, Any] | None = None  # the data position
    layout: dict[str, Any] | None = None  # how the saving run was cut (stages, replicas, ...)
    scheduler: dict[str, Any] | None = None  # the learning-rate scheduler's state
    saved_at: str = ""  # stamped when written
    index: dict[str, str] = field(default_factory=dict)  # name -> its shard file (derived)
    path: Path | None = None  # the checkpoint's folder, once read (not saved)


def step_folder(step: int) -> str:
    return f"step-{step:06d}"


def shard_file(pp_rank: int) -> str:
    return f"shard-{pp_rank:03d}.pt"


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


def write_shard(
    folder: str | Path,
    pp_rank: int,
    *,
    model: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any] | None = None,
    stages: list[int] | None = None,
    rng: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write one pipeline rank's shard: its ``model`` tensors by whole-model name, its
    ``optimizer`` state by name (:func:`optimizer_state_by_name`), the ``stages`` it holds
    and its ``rng`` state (read back by :func:`rng_state`). Returns the shard's entry for
    :attr:`Manifest.shards`: ``{file: {names, stages, SHA-256}}``."""
    shard = {"model": dict(model), "optimizer": optimizer, "stages": stages, "rng": rng}
    digest = hashlib.sha256()

    def write(f: Any) -> None:
        class Hashing:  # torch.save writes through it: the bytes are hashed on the way
            def write(self, data: bytes) -> int:
                digest.update(data)
                return f.write(data)

            def flush(self) -> None:
                f.flush()

        torch.save(dict(shard), Hashing())

    _atomic_write(Path(folder) / shard_file(pp_rank), write)
    entry = {"names": list(model), "stages": stages, "sha256": digest.hexdigest()}
    return {shard_file(pp_rank): entry}


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
    write_manifest(tmp, manifest)
    final = root / step_folder(manifest.step)
    if final.exists():  # saving a step again (a rerun into the same folder): replace it
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    _atomic_write(root / LATEST, lambda f: f.write(final.name.encode()))
    if keep > 0:
        for stale in _complete(root)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def write_manifest(folder: str | Path, manifest: Manifest) -> None:
    """Write ``manifest`` as ``folder/manifest.json``, with the index of names it derives
    from the shards' entries (a shard without a SHA-256 is hashed here) and the time."""
    folder = Path(folder)
    missing = [name for name in manifest.shards if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"cannot commit {folder}: shards {missing} were not written")
    shards = {
        file: {**info, "sha256": info.get("sha256") or sha256_of(folder / file)}
        for file, info in manifest.shards.items()
    }
    index: dict[str, str] = {}
    for file, info in sorted(shards.items()):
        for name in info["names"]:
            if name in index:
                raise CheckpointError(f"{name!r} is in both {index[name]} and {file}")
            index[name] = file
    record = {**asdict(manifest), "shards": shards, "index": index}
    record.update(saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), format=FORMAT, version=VERSION)
    del record["path"]
    _atomic_write(folder / MANIFEST, lambda f: f.write(json.dumps(record, indent=1).encode()))


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}{_TMP}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- finding and reading ---------------------------------------------------------------------


def _complete(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    found = [
        p
        for p in root.glob("step-*")
        if p.is_dir() and not p.name.endswith((_TMP, ".old")) and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda p: p.name)


def find(path: str | Path) -> Path:
    """The checkpoint folder ``path`` designates: a checkpoint itself, a folder of
    checkpoints (its newest complete one) or a run's output folder (``path/checkpoints``).

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
    for root in (path, path / "checkpoints"):
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
        f"folders holding one (in {path} or {path / 'checkpoints'})"
    )


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of the checkpoint ``path`` designates (see :func:`find`), whose shards
    must all be readable."""
    folder = find(path)
    manifest = read_manifest_file(folder)
    unreadable = [file for file in manifest.shards if not os.access(folder / file, os.R_OK)]
    if unreadable:
        raise CheckpointError(f"{folder}: shard files missing or unreadable: {unreadable}")
    return manifest


def read_manifest_file(folder: str | Path) -> Manifest:
    """The manifest in checkpoint ``folder`` as written (its shards unchecked); raises
    ``CheckpointError`` if it cannot be read, is not one, or is of a newer format."""
    folder = Path(folder)
    try:
        record = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {folder / MANIFEST}: {error}") from error
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{folder / MANIFEST} is not a gpipe checkpoint manifest")
    if record.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format version {record['version']}; this gpipe reads "
            f"up to {VERSION}: upgrade gpipe"
        )
    known = {f.name for f in fields(Manifest)} - {"path"}
    try:
        return Manifest(**{k: v for k, v in record.items() if k in known}, path=folder)
    except TypeError as error:  # step or shards missing
        raise CheckpointError(f"{folder / MANIFEST} is incomplete: {error}") from error


def _shards_for(manifest: Manifest, names: Iterable[str]) -> dict[str, list[str]]:
    """{shard file: [names it provides]}; raises for names no shard holds."""
    index, wanted = manifest.index, list(names)
    missing = [n for n in wanted if n not in index]
    if missing:
        shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
        raise CheckpointError(
            f"checkpoint {manifest.path} has no {len(missing)} of the names this model "
            f"needs ({shown}): was it saved from another model or configuration?"
        )
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(index[name], []).append(name)
    return by_file


def _load_shard(manifest: Manifest, file: str) -> dict[str, Any]:
    path = Path(manifest.path) / file
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointError(
            f"cannot read shard {path} (damaged, or not written by gpipe?): {error}"
        ) from error


def load_tensors(manifest: Manifest, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The model tensors ``names`` (whole-model names), read from whichever shards hold them."""
    tensors: dict[str, torch.Tensor] = {}
    for file, wanted in _shards_for(manifest, names).items():
        model = _load_shard(manifest, file)["model"]
        tensors.update({name: model[name] for name in wanted})
    return tensors


def load_optimizer_state(manifest: Manifest, names: Iterable[str]) -> dict[str, Any]:
    """The optimizer state of parameters ``names``, keyed by name (as saved by
    :func:`optimizer_state_by_name`), merged from whichever shards hold them."""
    state: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    wanted = set(names)
    for file in _shards_for(manifest, wanted):
        saved = _load_shard(manifest, file).get("optimizer")
        if saved is None:
            continue
        # Cloned: the shard is memory-mapped, and the optimizer keeps what it is given.
        state.update(
            {
                n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for n, s in saved["state"].items()
                if n in wanted
            }
        )
        for position, group in enumerate(saved["param_groups"]):
            key = group.get("name", f"#{position}")
            merged = groups.setdefault(key, {**group, "params": []})
            merged["params"] += [n for n in group["params"] if n in wanted]
    return {"state": state, "param_groups": list(groups.values())}


def rng_state(manifest: Manifest, pp_rank: int) -> dict[str, Any]:
    """The random-number state pipeline rank ``pp_rank`` saved (empty if none)."""
    file = shard_file(pp_rank)
    return (_load_shard(manifest, file).get("rng") or {}) if file in manifest.shards else {}


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """One plain state dict of the whole model (all shards merged), for the un-split model."""
    manifest = read_manifest(path)
    tensors = load_tensors(manifest, manifest.index)
    # Layer by layer; within a layer, in the order its shard's state dict had.
    return {name: t.clone() for name, t in sorted(tensors.items(), key=lambda kv: _layer(kv[0]))}


def _layer(name: str) -> float:
    head = name.partition(".")[0]
    return int(head) if head.isdigit() else float("inf")


# -- optimizer state by parameter name ------------------------------------------------------


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[nn.Parameter, str]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter names in place of positions.

    ``names`` maps each parameter to its whole-model name (``{p: n for n, p in
    pipe.named_parameters()}``). Param groups keep their hyperparameters; a group's
    ``"name"`` entry, if it has one, is how :func:`load_optimizer_state_by_name` matches it.
    """
    saved = optimizer.state_dict()
    position_to_name: dict[int, str] = {}
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        for position, parameter in zip(saved_group["params"], group["params"], strict=True):
            position_to_name[position] = names[parameter]
    return {
        "state": {position_to_name[i]: s for i, s in saved["state"].items()},
        "param_groups": [
            {**g, "params": [position_to_name[i] for i in g["params"]]}
            for g in saved["param_groups"]
        ],
    }


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[nn.Parameter, str], state: Mapping[str, Any]
) -> None:
    """Load a by-name optimizer state (from any cut of the model) into ``optimizer``.

    Groups are matched by their ``"name"`` entry (else by position); the saved
    hyperparameters win. Every parameter of ``optimizer`` that has state in ``state`` gets it;
    a parameter the saved optimizer had not stepped yet has none, as it would.
    """
    by_key = {g.get("name", f"#{i}"): g for i, g in enumerate(state["param_groups"])}
    current = optimizer.state_dict()
    groups, per_position = [], {}
    for i, (group, saved_group) in enumerate(
        zip(optimizer.param_groups, current["param_groups"], strict=True)
    ):
        key = group.get("name", f"#{i}")
        if key not in by_key:
            raise CheckpointError(
                f"the checkpoint's optimizer has no param group {key!r} (it has {sorted(by_key)})"
            )
        group_names = [names[p] for p in group["params"]]
        stray = set(group_names) - set(by_key[key]["params"])
        if stray:
            raise CheckpointError(
                f"parameters {sorted(stray)[:4]} are in group {key!r} here but not in the "
                f"checkpoint's optimizer"
            )
        hyper = {k: v for k, v in by_key[key].items() if k != "params"}
        groups.append({**hyper, "params": saved_group["params"]})
        for position, name in zip(saved_group["params"], group_names, strict=True):
            if name in state["state"]:
                per_position[position] = state["state"][name]
    optimizer.load_state_dict({"state": per_position, "param_groups": groups})
