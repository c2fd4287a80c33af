"""Read a checkpoint's whole model into one plain state dict for the un-split model.

    gpipe export runs/gpt-small-20250101-120000              # newest checkpoint of a run
    gpipe export runs/.../checkpoints/step-000300 -o gpt.pt

``gpipe train`` saves DCP checkpoints (``gpipe.checkpoint``); the exported file
is an ordinary ``torch.save``-d state dict with the whole model's names, which loads into the
model built without gpipe::

    model = gpipe.models.gpt(gpipe.models.GPTConfig(...))   # printed by this command
    model.load_state_dict(torch.load("gpt.pt"))

A ``.json`` file beside it records the model's kind and constructor arguments.

A Hugging Face model (``gpipe train --model DIR``) is exported as its own kind of folder:
``save_pretrained``'s (its configuration, safetensors and tokenizer), which
``AutoModelFor...from_pretrained(folder)`` loads::

    gpipe export runs/my-qwen-small-...            # -> runs/my-qwen-small-.../model-step-NNNNNN/
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from gpipe import checkpoint as ckpt
from gpipe.checkpoint_integrity import problems

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


def export(checkpoint: str | Path, out: str | Path | None = None, dtype: str | None = None) -> Path:
    """Write the merged state dict of ``checkpoint`` to ``out`` (and its ``.json``), or a
    Hugging Face model's ``save_pretrained`` folder; return it."""
    manifest = ckpt.read_manifest(checkpoint)
    folder = manifest.path
    damage = problems(folder)  # DCP itself checks no bytes: the manifest's SHA-256 do
    if damage:
        raise ckpt.CheckpointError(f"{folder} is damaged: {'; '.join(damage)}")
    pretrained = (manifest.model or {}).get("kind") == "hf"
    if out is None:
        run_folder = folder.parent.parent if folder.parent.name == "checkpoints" else Path(".")
        name = f"model-{ckpt.step_folder(manifest.step)}"
        out = run_folder / (name if pretrained else f"{name}.pt")
    out = Path(out)
    if not pretrained and out.suffix == ".json":
        raise ckpt.CheckpointError(
            f"-o {out}: the weights need another name than the .json file written beside "
            "them (e.g. model.pt)"
        )
    state = ckpt.export_state_dict(folder)
    if dtype is not None:
        cast = getattr(torch, dtype)
        state = {k: v.to(cast) if v.is_floating_point() else v for k, v in state.items()}
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if pretrained:  # transformers' save_pretrained: config.json, safetensors, tokenizer
            from gpipe.train.hf import save_pretrained

            tokenizer = manifest.config.get("tokenizer")
            tokenizer = tokenizer if tokenizer and Path(tokenizer).is_dir() else None
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained(manifest.model, state, tmp, tokenizer=tokenizer)
            shutil.rmtree(out, ignore_errors=True)
        else:
            with open(tmp, "wb") as f:  # an OSError names an unwritable path
                torch.save(state, f)
            info = {"model": manifest.model, "step": manifest.step, "source": str(folder)}
            out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
        os.replace(tmp, out)
    except OSError as error:
        raise ckpt.CheckpointError(
            f"-o {out}: cannot write there ({error.strerror or error}); choose a writable path"
        ) from None
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
    return out


def run(args: argparse.Namespace) -> int:
    try:
        out = export(args.checkpoint, args.out, args.dtype)
    except ckpt.CheckpointError as error:
        print(f"gpipe export: error: {error}", file=sys.stderr)
        return 2
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
