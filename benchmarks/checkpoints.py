"""Checkpoint save and load: gpipe's former format against DCP, in the same run.

    PYTHONPATH=src python benchmarks/checkpoints.py [--out docs/checkpoints.md]

The former format (one ``torch.save`` file per pipeline rank plus a hand-built manifest with
each shard's SHA-256) is read from git history (``--old-rev``, the last commit that had it),
so both are timed by one process on the same disk, the same model and optimizer state. Each
save and load is what ``gpipe train`` does for one process holding the whole model (K=1):
save = the state dicts written, the manifest committed (checksums included) and the folder
renamed; load = the checkpoint verified against its manifest, then the weights and the
optimizer state read into a fresh model and optimizer. Medians of ``--repeats``, after the
page cache holds the files (a warm-up round), so the figures are the formats' own cost, not
the disk's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpipe.models import GPTConfig, gpt
from gpipe.train.checkpoint import sha256_of

CONFIG = GPTConfig(vocab_size=256, context=256, d_model=512, n_heads=8, n_layers=8, dropout=0.0)
ROOT = Path(__file__).resolve().parent.parent
OLD_REV = "9de4e29"  # the last commit of the torch.save format


# What docs/checkpoints.md says after the table (told there once).
CHECKED = """
## What is checked before a checkpoint is used

A checkpoint is data, never code. `gpipe train --resume`, `gpipe export` and `gpipe
checkpoints` check each one (`gpipe.train.checkpoint_integrity.problems`) before using it:

- the manifest: gpipe's format and version, its own SHA-256, a step that is its folder's;
- every file DCP wrote: present, readable (a file that cannot be read, for its permissions or
  an I/O error, is damage like any other: resume falls back with a warning naming it) and
  holding the bytes saved (SHA-256);
- DCP's `.metadata`, a pickle, is never unpickled: `gpipe.parallel.dcp_metadata` walks its
  opcodes and builds only DCP's own types (its metadata dataclasses, `torch.Size`, dtypes,
  the strided layout, the checkpoint's path), each field checked against DCP's schema; any
  other opcode, global or field is refused, naming the file and what it holds, as is a file
  nested too deep or claiming tensors larger than its files; every file it points to must
  lie beside it, with no stream transforms;
- the objects DCP stored (an optimizer's hyperparameters, `torch.save` bytes, which DCP's
  own planner reads with `weights_only=False`) load with `weights_only=True`.

A SHA-256 anyone can recompute proves only that no bytes changed by accident: the last two
checks are what refuse a crafted checkpoint whose hashes were recomputed, instead of running
it (benchmarks/faults.py's checkpoint rows; tests/train/test_checkpoint_integrity.py). What
stays the user's to protect is who may write the run folder: a checkpoint replaced by another
genuine one (other weights) is read like any.
"""

NOTES = """\
What the rows do. Both write the same tensors once (one file per rank; here one rank) and
check every byte against the manifest's SHA-256 before loading. The former format hashed
each file while `torch.save` wrote it and read its file back memory-mapped; DCP writes each
tensor as its own record with its place in the global tensor (what lets any layout read
it), the manifest's checksums take a second pass over the files once DCP is done, and a load
allocates each tensor from DCP's metadata and copies it into the model. What DCP buys for
that: the checkpoint is PyTorch's own format (`dcp.load`, torchtitan and DCP's tools read
it), a sharded replica writes its own shards instead of gathering whole tensors first, and
any number of stages, replicas and shards read it back, DCP's planner cutting each tensor
from the chunks that hold it."""


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model after one AdamW step (so that the optimizer has state)."""
    torch.manual_seed(0)
    model = gpt(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 32))
    model(x).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def old_module(rev: str):
    """gpipe's checkpoint module as of ``rev`` (then at the top of the package; it needs only
    torch), imported under another name."""
    former = "src/gpipe/" + "checkpoint.py"  # moved to train/ since: no path of today's tree
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{former}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_checkpoint.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_checkpoint"] = module
    spec.loader.exec_module(module)
    return module


class Old:
    name = "torch.save shards + manifest (former)"

    def __init__(self, rev: str) -> None:
        self.ckpt = old_module(rev)

    def save(self, root: Path, step: int, model, optimizer) -> Path:
        c = self.ckpt
        names = {p: n for n, p in model.named_parameters()}
        tmp = c.begin(root, step)
        entry = c.write_shard(
            tmp, 0, model=model.state_dict(),
            optimizer=c.optimizer_state_by_name(optimizer, names),
            stages=[0], rng={"torch": torch.get_rng_state()},
        )  # fmt: skip
        return c.commit(root, tmp, c.Manifest(step=step, shards=entry))

    def load(self, folder: Path, model, optimizer) -> None:
        c = self.ckpt
        manifest = c.read_manifest(folder)
        for file, info in manifest.shards.items():  # what --resume verifies first
            assert c.sha256_of(folder / file) == info["sha256"]
        names = {p: n for n, p in model.named_parameters()}
        model.load_state_dict(c.load_tensors(manifest, list(model.state_dict())))
        state = c.load_optimizer_state(manifest, list(names.values()))
        c.load_optimizer_state_by_name(optimizer, names, state)
        torch.set_rng_state(c.rng_state(manifest, 0)["torch"].clone())


class Dcp:
    name = "DCP (torch.distributed.checkpoint)"

    def __init__(self) -> None:
        import gpipe.train.checkpoint as ckpt
        import gpipe.train.checkpoint_integrity as checkpoint_integrity
        import gpipe.train.optimizer_state as optimizer_state

        self.ckpt, self.integrity, self.by_name = ckpt, checkpoint_integrity, optimizer_state

    def save(self, root: Path, step: int, model, optimizer) -> Path:
        c = self.ckpt
        names = {p: n for n, p in model.named_parameters()}
        tmp = c.begin(root, step)
        c.write(
            tmp, model=model.state_dict(),
            optimizer=self.by_name.optimizer_state_by_name(optimizer, names),
            rng={0: torch.get_rng_state()},
        )  # fmt: skip
        return c.commit(root, tmp, c.Manifest(step=step))

    def load(self, folder: Path, model, optimizer) -> None:
        c = self.ckpt
        assert not self.integrity.problems(folder)  # what --resume verifies first
        manifest = c.read_manifest(folder)
        names = {p: n for n, p in model.named_parameters()}
        loaded = c.load(manifest, model=list(model.state_dict()),
                        optimizer=list(names.values()), rng=0)  # fmt: skip
        model.load_state_dict(loaded.model)
        self.by_name.load_optimizer_state_by_name(optimizer, names, loaded.optimizer)
        torch.set_rng_state(loaded.rng)


def measure(formats: list, work: Path, repeats: int) -> list[dict[str, float]]:
    """Each format's median save and load, in alternating rounds (so that a machine that
    gets slower or faster moves both alike), and its files."""
    model, optimizer = trained()
    fresh = [trained() for _ in formats]
    times = [{"save": [], "load": []} for _ in formats]
    folders = [None] * len(formats)
    for i in range(repeats + 1):  # the first round warms the page cache
        for f, fmt in enumerate(formats):
            root = work / f"{type(fmt).__name__}-{i}"
            tick = time.perf_counter()
            folders[f] = fmt.save(root, 100, model, optimizer)
            times[f]["save"].append(time.perf_counter() - tick)
            tick = time.perf_counter()
            fmt.load(folders[f], *fresh[f])
            times[f]["load"].append(time.perf_counter() - tick)
    rows = []
    for f, folder in enumerate(folders):
        for name, tensor in model.state_dict().items():  # loaded whole and bitwise
            assert torch.equal(tensor, fresh[f][0].state_dict()[name]), name
        files = [p for p in folder.rglob("*") if p.is_file()]
        tick = time.perf_counter()
        for path in files:  # what both formats' SHA-256 of their files costs (part of each)
            sha256_of(path)
        checksums = time.perf_counter() - tick
        rows.append({
            "checksums": checksums,
            "save": statistics.median(times[f]["save"][1:]),
            "load": statistics.median(times[f]["load"][1:]),
            "bytes": sum(p.stat().st_size for p in files),
            "files": len(files),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    parser.add_argument("--formats", default="old,dcp", help="old, dcp or both (default)")
    parser.add_argument("--old-rev", default=OLD_REV, help="the commit of the former format")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=None, help="folder for the checkpoints")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, optimizer = trained()
    parameters = sum(p.numel() for p in model.parameters())
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ) + sum(t.numel() * t.element_size() for t in model.state_dict().values())
    formats = {"old": lambda: Old(args.old_rev), "dcp": Dcp}
    work = Path(tempfile.mkdtemp(dir=args.work))
    chosen = [formats[key]() for key in args.formats.split(",")]
    load_before = os.getloadavg()[0]
    try:
        rows = list(zip([f.name for f in chosen], measure(chosen, work, args.repeats), strict=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    lines = [
        f"GPT {CONFIG.n_layers} blocks, d_model {CONFIG.d_model}: {parameters:,} parameters, "
        f"float32, AdamW after one step: {state / mib:.1f} MiB of tensors. One process (K=1), "
        f"one thread; median of {args.repeats} rounds (each saves and loads with every format "
        f"in turn) after a warm-up round, page cache warm. torch {torch.__version__}, "
        f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs (1-minute load "
        f"average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after): figures move "
        f"from run to run; compare rows of one run.",
        "",
        "| format | save (s) | load (s) | of each, SHA-256 of the files (s) | on disk (MiB) "
        "| files |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['save']:.3f} | {r['load']:.3f} | {r['checksums']:.3f} | "
            f"{r['bytes'] / mib:.1f} | {r['files']} |"
        )
    lines += ["", NOTES]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            "# Checkpoints: the former format against DCP\n\n"
            "Regenerate: `PYTHONPATH=src python benchmarks/checkpoints.py --out "
            "docs/checkpoints.md`\n\n" + table + "\n" + CHECKED
        )


if __name__ == "__main__":
    main()
