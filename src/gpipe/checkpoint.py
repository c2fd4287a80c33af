"""Sharded training checkpoints: one file per pipeline rank, loadable with any number of stages.

A pipelined model never exists in one place, so neither does its checkpoint. Each pipeline
rank writes one *shard*: its layers' parameters and buffers under their **whole-model names**
(``"3.qkv.weight"``, as ``Pipe.state_dict()`` gives them), its optimizer state keyed by the
same names (torch optimizers key state by position, which changes with the cut), and its
random-number state. A ``manifest.json`` beside the shards records the step, the run's
configuration, the data position and which shard holds each name. Because everything is keyed
by name, a checkpoint saved by K stages loads into any other K (each rank reads just the shards
holding its names), and :func:`export_state_dict` merges the shards into one plain state dict
for the un-split model.

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

    if rank == 0: tmp = checkpoint.begin(root, step)     # then a barrier
    checkpoint.write_shard(tmp, pp_rank, shard)           # one writer per pipeline rank
    # gather every shard's names to rank 0, then:
    if rank == 0: checkpoint.commit(root, tmp, manifest)  # then a barrier
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CheckpointError",
    "MANIFEST",
    "begin",
    "commit",
    "export_state_dict",
    "find",
    "load_optimizer_state",
    "load_tensors",
    "optimizer_state_by_name",
    "sha256_of",
    "read_manifest",
    "load_optimizer_state_by_name",
    "shard_file",
    "staging_folder",
    "step_folder",
    "write_shard",
]

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "gpipe-checkpoint"
VERSION = 1
_TMP = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not fit the model."""


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


def write_shard(folder: str | Path, pp_rank: int, shard: Mapping[str, Any]) -> str:
    """Write one pipeline rank's shard (``{"model": ..., "optimizer": ..., "rng": ...}``);
    return its SHA-256, for the manifest (``shards[file]["sha256"]``)."""
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
    return digest.hexdigest()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def commit(
    root: str | Path, tmp: str | Path, manifest: Mapping[str, Any], *, keep: int = 0
) -> Path:
    """Write the manifest, give the checkpoint its final name, point ``latest`` at it.

    ``manifest`` must hold ``step`` and ``shards`` (file name -> {"names": [...], ...}); the
    name index is added here. ``keep`` > 0 deletes all but the newest ``keep`` checkpoints.
    Returns the final folder.
    """
    root, tmp = Path(root), Path(tmp)
    manifest = dict(manifest)
    missing = [name for name in manifest["shards"] if not (tmp / name).is_file()]
    if missing:
        raise CheckpointError(f"cannot commit {tmp}: shards {missing} were not written")
    manifest["shards"] = {
        file: {**info, "sha256": info.get("sha256") or sha256_of(tmp / file)}
        for file, info in manifest["shards"].items()
    }
    index: dict[str, str] = {}
    for file, info in sorted(manifest["shards"].items()):
        for name in info["names"]:
            if name in index:
                raise CheckpointError(f"{name!r} is in both {index[name]} and {file}")
            index[name] = file
    manifest.update(format=FORMAT, version=VERSION, index=index)
    _atomic_write(tmp / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    final = root / step_folder(int(manifest["step"]))
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


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint ``path`` designates (see :func:`find`); adds ``path``."""
    folder = find(path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {folder / MANIFEST}: {error}") from error
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder / MANIFEST} is not a gpipe checkpoint manifest")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format version {manifest['version']}; this gpipe reads "
            f"up to {VERSION}: upgrade gpipe"
        )
    unreadable = [file for file in manifest["shards"] if not os.access(folder / file, os.R_OK)]
    if unreadable:
        raise CheckpointError(f"{folder}: shard files missing or unreadable: {unreadable}")
    manifest["path"] = str(folder)
    return manifest


def _shards_for(manifest: Mapping[str, Any], names: Iterable[str]) -> dict[str, list[str]]:
    """{shard file: [names it provides]}; raises for names no shard holds."""
    index, wanted = manifest["index"], list(names)
    missing = [n for n in wanted if n not in index]
    if missing:
        shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
        raise CheckpointError(
            f"checkpoint {manifest['path']} has no {len(missing)} of the names this model "
            f"needs ({shown}): was it saved from another model or configuration?"
        )
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(index[name], []).append(name)
    return by_file


def _load_shard(manifest: Mapping[str, Any], file: str) -> dict[str, Any]:
    path = Path(manifest["path"]) / file
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointError(
            f"cannot read shard {path} (damaged, or not written by gpipe?): {error}"
        ) from error


def load_tensors(manifest: Mapping[str, Any], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The model tensors ``names`` (whole-model names), read from whichever shards hold them."""
    tensors: dict[str, torch.Tensor] = {}
    for file, wanted in _shards_for(manifest, names).items():
        model = _load_shard(manifest, file)["model"]
        tensors.update({name: model[name] for name in wanted})
    return tensors


def load_optimizer_state(manifest: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
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


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """One plain state dict of the whole model (all shards merged), for the un-split model."""
    manifest = read_manifest(path)
    tensors = load_tensors(manifest, manifest["index"])
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
