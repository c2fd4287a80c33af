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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpipe.models import GPTConfig, gpt

CONFIG = GPTConfig(vocab_size=256, context=256, d_model=512, n_heads=8, n_layers=8, dropout=0.0)
ROOT = Path(__file__).resolve().parent.parent
OLD_REV = "9de4e29"  # the last commit of the torch.save format


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
    """gpipe.checkpoint as of ``rev`` (it needs only torch), imported under another name."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:src/gpipe/checkpoint.py"],
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
        from gpipe import checkpoint as ckpt
        from gpipe import checkpoint_integrity

        self.ckpt, self.integrity = ckpt, checkpoint_integrity

    def save(self, root: Path, step: int, model, optimizer) -> Path:
        c = self.ckpt
        names = {p: n for n, p in model.named_parameters()}
        tmp = c.begin(root, step)
        c.write(
            tmp, model=model.state_dict(),
            optimizer=c.optimizer_state_by_name(optimizer, names),
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
        c.load_optimizer_state_by_name(optimizer, names, loaded.optimizer)
        torch.set_rng_state(loaded.rng)


def measure(fmt, work: Path, repeats: int) -> dict[str, float]:
    model, optimizer = trained()
    fresh_model, fresh_optimizer = trained()
    saves, loads, folder = [], [], None
    for i in range(repeats + 1):  # the first round warms the page cache
        root = work / f"{type(fmt).__name__}-{i}"
        tick = time.perf_counter()
        folder = fmt.save(root, 100, model, optimizer)
        saves.append(time.perf_counter() - tick)
        tick = time.perf_counter()
        fmt.load(folder, fresh_model, fresh_optimizer)
        loads.append(time.perf_counter() - tick)
    for name, tensor in model.state_dict().items():  # loaded whole and bitwise
        assert torch.equal(tensor, fresh_model.state_dict()[name]), name
    files = [p for p in folder.rglob("*") if p.is_file()]
    return {
        "save": statistics.median(saves[1:]),
        "load": statistics.median(loads[1:]),
        "bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
    }


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
    rows = []
    try:
        for key in args.formats.split(","):
            fmt = formats[key]()
            rows.append((fmt.name, measure(fmt, work, args.repeats)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    lines = [
        f"GPT {CONFIG.n_layers} blocks, d_model {CONFIG.d_model}: {parameters:,} parameters, "
        f"float32, AdamW after one step: {state / mib:.1f} MiB of tensors. One process (K=1), "
        f"one thread, median of {args.repeats} after a warm-up round, page cache warm.",
        "",
        "| format | save (s) | load (s) | on disk (MiB) | files |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['save']:.3f} | {r['load']:.3f} | {r['bytes'] / mib:.1f} | "
            f"{r['files']} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(
            "# Checkpoints: the former format against DCP\n\n"
            "Regenerate: `PYTHONPATH=src python benchmarks/checkpoints.py --out "
            "docs/checkpoints.md`\n\n" + table + "\n"
        )


if __name__ == "__main__":
    main()
