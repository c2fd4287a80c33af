"""Read a checkpoint's whole model into one plain state dict for the un-split model.

    gpipe export runs/gpt-small-20250101-120000              # newest checkpoint of a run
    gpipe export runs/.../checkpoints/step-000300 -o gpt.pt

``gpipe train`` saves DCP checkpoints (``gpipe.train.checkpoint``); the exported file
is an ordinary ``torch.save``-d state dict with the whole model's names, which loads into the
model built without gpipe::

    model = gpipe.models.gpt(gpipe.models.GPTConfig(...))   # printed by this command
    model.load_state_dict(torch.load("gpt.pt"))

A ``.json`` file beside it records the model's kind and constructor arguments. An existing
``-o`` is replaced only where gpipe export wrote it (``--force`` replaces any other, but never a
checkpoint's or a run's own files).

A Hugging Face model (``gpipe train --model DIR``) is exported as its own kind of folder:
``save_pretrained``'s (its configuration, safetensors and tokenizer), which
``AutoModelFor...from_pretrained(folder)`` loads::

    gpipe export runs/my-qwen-small-...            # -> runs/my-qwen-small-.../model-step-NNNNNN/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import gpipe.train.checkpoint as ckpt
from gpipe.base.files import write_file, write_folder
from gpipe.train.checkpoint_integrity import problems
from gpipe.train.outputs import EXPORT_RECORD, OutputError, export_problem
from gpipe.train.run_folder import export_target

__all__ = ["configure", "export", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("checkpoint", help="checkpoint folder, its checkpoints/ or its run folder")
    parser.add_argument(
        "-o",
        "--out",
        help="output file (default: RUN/model-step-NNNNNN.pt beside checkpoints/; "
        "a Hugging Face model: the folder RUN/model-step-NNNNNN/)",
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating tensors"
    )
    parser.add_argument(
        "--force", action="store_true",
        help="replace an existing -o that gpipe export did not write (never a checkpoint's or "
        "a run's own files)",
    )  # fmt: skip


def export(
    checkpoint: str | Path,
    out: str | Path | None = None,
    dtype: str | None = None,
    *,
    force: bool = False,
) -> Path:
    """Write the merged state dict of ``checkpoint`` to ``out`` (and its ``.json``), or a
    Hugging Face model's ``save_pretrained`` folder; return it. Never into a checkpoint or
    over a run's files; over what exists only where gpipe export wrote it, or ``force``
    (``gpipe.train.outputs``)."""
    manifest = ckpt.read_manifest(checkpoint)
    folder = manifest.path
    damage = problems(folder)  # DCP itself checks no bytes: the manifest's SHA-256 do
    if damage:
        raise ckpt.CheckpointError(f"{folder} is damaged: {'; '.join(damage)}")
    pretrained = (manifest.model or {}).get("kind") == "hf"
    out = Path(out) if out is not None else export_target(folder, manifest.step, folder=pretrained)
    if not pretrained and out.suffix == ".json":
        raise OutputError(
            f"-o {out}: the weights need another name than the .json file written beside "
            "them (e.g. model.pt)"
        )
    record = out / EXPORT_RECORD if pretrained else out.with_suffix(".json")
    problem = export_problem(out, record, force=force)
    if problem is not None:
        raise OutputError(f"-o {out}: {problem}")
    state = ckpt.export_state_dict(folder)
    if dtype is not None:
        cast = getattr(torch, dtype)
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    info = json.dumps({"model": manifest.model, "step": manifest.step, "source": str(folder)},
                      indent=1) + "\n"  # fmt: skip
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if pretrained:  # transformers' save_pretrained: config.json, safetensors, tokenizer
            write_folder(out, lambda into: _save_pretrained(manifest, state, into, info))
        else:
            write_file(out, lambda f: torch.save(state, f))
            write_file(record, lambda f: f.write(info.encode()))
    except OSError as error:
        raise OutputError(
            f"-o {out}: cannot write there ({error.strerror or error}); choose a writable path"
        ) from None
    return out


def _save_pretrained(manifest: ckpt.Manifest, state: dict, folder: Path, info: str) -> None:
    from gpipe.train.hf import save_pretrained

    tokenizer = manifest.config.get("tokenizer") if manifest.config else None
    tokenizer = tokenizer if tokenizer and Path(tokenizer).is_dir() else None
    save_pretrained(manifest.model, state, folder, tokenizer=tokenizer)
    (folder / EXPORT_RECORD).write_text(info)


def run(args: argparse.Namespace) -> int:
    out = export(args.checkpoint, args.out, args.dtype, force=args.force)
    manifest = ckpt.read_manifest(args.checkpoint)
    spec = manifest.model
    if out.is_dir():  # a Hugging Face model's save_pretrained folder
        from gpipe.train.hf import FAMILIES

        auto = FAMILIES[spec["args"]["family"]]
        print(f"gpipe export: step {manifest.step} of {manifest.path} -> {out}/ (save_pretrained)")
        print("load it as any Hugging Face model:")
        print(f"    model = transformers.{auto}.from_pretrained({str(out)!r})")
        return 0
    state = torch.load(out, weights_only=True, mmap=True)
    count = sum(t.numel() for t in state.values())
    print(
        f"gpipe export: step {manifest.step} of {manifest.path}: {len(state)} tensors, "
        f"{count:,} numbers -> {out}"
    )
    if spec:
        from gpipe.train import constructor

        code = constructor(spec)
        print("load it into the plain model:")
        print(f"    import torch, {code.split('(')[0].rsplit('.', 1)[0]}")
        print(f"    model = {code}")
        print(f"    model.load_state_dict(torch.load({str(out)!r}))")
    return 0
