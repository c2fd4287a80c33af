"""Checkpoints written by this process alone, for the tests of their format, their checks and
their readers (train/test_checkpoint.py, test_checkpoint_integrity.py, cli/test_checkpoints.py
and the benchmarks)."""

from __future__ import annotations

import pathlib
import pickle

import torch
from torch import nn

import gpipe.train.checkpoint as ckpt
from gpipe.models import mlp
from gpipe.parallel import dcp as gpipe_dcp


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return mlp([4, 8, 8, 3])  # layers 0 (Linear), 1 (GELU), 2, 3, 4


def save(root, step: int, model: nn.Module, *, layers=None, optimizer=None, rng=None, **records):
    """A checkpoint of ``model`` (of its ``layers`` only, if given), written with DCP by this
    process alone."""
    state = model.state_dict()
    if layers is not None:
        state = {n: t for n, t in state.items() if int(n.split(".")[0]) in layers}
    tmp = ckpt.begin(root, step)
    ckpt.write(tmp, model=state, optimizer=optimizer, rng=rng)
    return ckpt.commit(root, tmp, ckpt.Manifest(step=step, **records))


DATA = "__0_0.distcp"  # what DCP wrote for rank 0


def run_of_two_checkpoints(folder: pathlib.Path) -> pathlib.Path:
    """``folder`` made a run's folder with checkpoints at steps 10 and 20 (:func:`newest`)."""
    root = folder / "checkpoints"
    model = make_model()
    for step in (10, 20):
        save(root, step, model, layout={"stages": 1})
        model[0].weight.data.add_(1.0)  # the two steps hold different weights
    return folder


def newest(run: pathlib.Path) -> pathlib.Path:
    return run / "checkpoints" / "step-000020"


def flip_a_byte(path: pathlib.Path, offset: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


class Payload:
    """What an attacker plants: unpickling it creates ``marker`` (harmless, and visible)."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def plant(folder, marker, **changes) -> None:
    """Rewrite ``folder``'s .metadata with ``changes`` (by default a :class:`Payload` in a
    field DCP does not check) and the manifest's SHA-256 recomputed, as an attacker would."""
    metadata = gpipe_dcp.read_metadata(folder)  # a genuine file: where the attacker starts
    for key, value in (changes or {"planner_data": Payload(marker)}).items():
        setattr(metadata, key, value)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    ckpt.write_manifest(folder, ckpt.read_manifest_file(folder))


def write_a_part(rank: int, root: str) -> dict[str, torch.Tensor]:
    """One rank of a 3-process save: ranks 0 and 1 are two stages of replica 0, rank 2 is
    replica 1 of rank 0's stage (the same tensors). Nothing pickle reads may be called."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def refused(*args, **kwargs):
        raise AssertionError("a pickle from a peer was read")

    for name in ("load", "loads", "Unpickler", "_Unpickler"):
        setattr(pickle, name, refused)
    distributed_c10d._unpickler = refused  # what torch's object collectives unpickle with
    stage = rank % 2
    torch.manual_seed(stage)
    tensors = {f"{stage}.weight": torch.randn(3, 4), "shared.step": torch.tensor(7.0)}
    groups = [{"params": list(tensors), "lr": 0.5}]
    tmp = ckpt.begin(root, 1) if rank == 0 else ckpt.staging_folder(root, 1)
    dist.barrier()
    ckpt.write(tmp, model=tensors, optimizer={"state": {}, "param_groups": groups},
               rng={stage: torch.get_rng_state()}, replica=rank // 2)  # fmt: skip
    dist.barrier()
    if rank == 0:
        ckpt.commit(root, tmp, ckpt.Manifest(step=1))
    return tensors
