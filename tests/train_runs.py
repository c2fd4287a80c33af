"""Running ``gpipe ...`` as a user would, for the tests of the main job and of its faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"
TINY = ["--size", "tiny", "--steps", "10", "--save-every", "5", "--eval-every", "5"]


def gpipe_command(*args: str, cache: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    """``gpipe ARGS`` in a new process."""
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)  # not under torchrun: the command spawns its processes
    return subprocess.run(
        [sys.executable, "-m", "gpipe", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}
