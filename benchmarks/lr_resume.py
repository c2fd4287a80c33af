"""The learning rate of a run resumed with more steps: no jump, the decay stretched to the new end.

    python benchmarks/lr_resume.py [--out docs/img/lr-resume.png]

Three tiny runs of ``gpipe train``: 40 steps, then ``--resume`` of it with ``--steps 60``, and
an uninterrupted 60-step run for comparison; each one's learning rate per step from its
``metrics.jsonl``, drawn on one plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["--size", "tiny", "--eval-every", "0", "--sample-tokens", "0", "--warmup", "5"]


def train(out: Path, *extra: str) -> None:
    cmd = [sys.executable, "-m", "gpipe", "train", *COMMON, "--out", str(out), *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)


def rates(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/lr-resume.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory() as tmp:
        first, whole = Path(tmp) / "first", Path(tmp) / "whole"
        train(first, "--steps", "40", "--save-every", "40")
        before = rates(first)
        train(first, "--resume", str(first), "--steps", "60")
        after = {s: lr for s, lr in rates(first).items() if s > 40}
        train(whole, "--steps", "60", "--save-every", "0")
        straight = rates(whole)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(
        list(straight), list(straight.values()), color="0.7", lw=4, label="60 steps, uninterrupted"
    )
    ax.plot(list(before), list(before.values()), lw=1.8, label="40 steps (--steps 40)")
    ax.plot(list(after), list(after.values()), lw=1.8, label="resumed at 40 with --steps 60")
    ax.axvline(40.5, color="0.5", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("gpipe train --resume with more --steps: the rate goes on, no jump")
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"step 40: {before[40]:.3e}; step 41 resumed: {after[41]:.3e}; wrote {args.out}")


if __name__ == "__main__":
    main()
