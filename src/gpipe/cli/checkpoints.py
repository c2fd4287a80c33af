"""List a run's checkpoints and whether each is intact.

    gpipe checkpoints runs/gpt-small-20250101-120000

Each checkpoint is checked against its manifest (every file's SHA-256, its own, the step); an
unfinished save shows as incomplete. ``gpipe train --resume`` takes the newest intact one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpipe.train.checkpoint import LATEST, CheckpointError
from gpipe.train.checkpoint_integrity import listing

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("folder", help="a run folder or its checkpoints/ folder")


def run(args: argparse.Namespace) -> int:
    rows = listing(args.folder)
    if not rows:
        raise CheckpointError(
            f"no checkpoint in {args.folder}: give a run folder or its checkpoints/"
        )
    latest_file = rows[0][0].parent / LATEST
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    for folder, problems in rows:
        state = "intact" if not problems else "; ".join(problems)
        mark = "  <- latest" if folder.name == latest else ""
        print(f"{Path(folder).name:<18} {state}{mark}")
    return 0
