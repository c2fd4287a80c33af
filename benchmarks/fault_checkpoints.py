"""The fault matrix's checkpoint rows (``benchmarks/faults.py``): a run's newest checkpoint
damaged, unreadable or crafted, then resumed, exported and listed as a user would.

The crafted one is what an attacker with write access to the run folder makes: a genuine
checkpoint whose ``.metadata`` (DCP's pickle) carries a payload that would create a marker
file, with the manifest's SHA-256 recomputed (tests/train/test_checkpoint.py's ``plant``).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import gpipe.train.checkpoint as ckpt
from gpipe.__main__ import main
from gpipe.train.run_folder import CHECKPOINTS, step_folder
from saved_checkpoints import plant

SHARD = "__1_0.distcp"  # rank 1's DCP file
MARKER = "payload-ran"  # created in the run's copy if the crafted checkpoint's payload runs


def _flip(newest: Path) -> None:
    data = bytearray((newest / SHARD).read_bytes())
    data[300] ^= 0xFF
    (newest / SHARD).write_bytes(bytes(data))


def _truncate(newest: Path) -> None:
    shard = newest / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _unreadable(newest: Path) -> None:
    if os.geteuid() != 0:
        (newest / SHARD).chmod(0)
    else:  # root reads a chmod 000 file: a regular file whose every read fails instead
        (newest / SHARD).unlink()
        (newest / SHARD).symlink_to("/proc/self/mem")


def _crafted(newest: Path) -> None:
    plant(newest, newest.parents[1] / MARKER)


REFUSED = "refers to pathlib.Path.touch, which a DCP checkpoint never holds"

DAMAGE = [
    ("a flipped byte in the newest shard", _flip, "is not the file saved"),
    ("the newest manifest deleted", lambda f: (f / ckpt.MANIFEST).unlink(), "incomplete"),
    ("the newest shard truncated to half its size", _truncate, "is not the file saved"),
    (
        "the newest shard unreadable (chmod 000; as root, reads failing with EIO)",
        _unreadable,
        f"{SHARD} is unreadable",
    ),
    (
        "a crafted newest checkpoint (a pickle payload in .metadata, SHA-256 recomputed)",
        _crafted,
        REFUSED,
    ),
]


def rows_checkpoints(work: Path, train: Callable, left_in: Callable) -> list[tuple]:
    """Resume from each damaged copy of a 10-step run (checkpoints at 5 and 10); export and
    list the crafted one. ``train``/``left_in``: faults.py's ``gpipe_train``/``left_in``."""
    out = work / "ckpt"
    job = train("--size", "tiny", "--steps", "10", "--save-every", "5", "--sample-tokens",
                "0", "--out", str(out), cache=work / "cache")  # fmt: skip
    job.communicate(timeout=300)
    rows = []
    for i, (name, damage, named) in enumerate(DAMAGE):
        copy = work / f"ckpt-{i}"
        shutil.copytree(out, copy)
        damage(copy / CHECKPOINTS / step_folder(10))
        if damage is _crafted:  # read before the resume replaces it with its own step 10
            rows += _crafted_read(copy)
        started = time.monotonic()
        resumed = train("--resume", str(copy), "--steps", "11", "--sample-tokens", "0",
                        cache=work / "cache")  # fmt: skip
        stdout, stderr = resumed.communicate(timeout=300)
        seconds = time.monotonic() - started
        warned = "warning:" in stderr and named in stderr and "resumed from step 5" in stdout
        ran = (copy / MARKER).exists()
        outcome = f"exit {resumed.returncode}" + (", warned, resumed from step 5" if warned else "")
        outcome += ", the payload ran" if ran else ""
        rows.append((f"resume with {name}", "falls back to the newest intact one, with a "
                     "warning naming why", seconds, seconds, outcome, left_in(resumed.pid),
                     warned and resumed.returncode == 0 and not ran))  # fmt: skip
    return rows


def _crafted_read(run: Path) -> list[tuple]:
    """`gpipe export` and `gpipe checkpoints` of the crafted copy, in this process."""
    rows = []
    for command, promise in [
        (["export", str(run / CHECKPOINTS / step_folder(10))], "refused in one line"),
        (["checkpoints", str(run)], "listed as refused, not intact"),
    ]:
        said = io.StringIO()
        started = time.monotonic()
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            code = main(command)
        seconds = time.monotonic() - started
        line = next((s for s in said.getvalue().splitlines() if REFUSED in s), "")
        line = line.replace(str(run), "RUN")
        ran = (run / MARKER).exists()
        held = (code == 2 if command[0] == "export" else code == 0) and bool(line) and not ran
        outcome = f"exit {code}: {line[:200]}" + (", the payload ran" if ran else "")
        rows.append((f"gpipe {command[0]} of the crafted checkpoint", promise + ", nothing of it "
                     "runs", seconds, seconds, outcome, 0, held))  # fmt: skip
    return rows
