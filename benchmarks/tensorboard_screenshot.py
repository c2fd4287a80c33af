"""A TensorBoard screenshot of a ``gpipe train`` run: the picture in the README.

    python benchmarks/tensorboard_screenshot.py [--out docs/img/tensorboard.png]

Trains the tiny GPT for 200 steps (K=2, about a minute), serves the run folder with
``tensorboard --logdir`` on localhost and renders its scalars page in headless Chromium
(``apt-get install -y chromium``); nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PORT = 6123
BROWSER = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--hide-scrollbars", "--window-size=1600,1300",
           "--virtual-time-budget=25000"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/tensorboard.png")
    args = parser.parse_args()
    if shutil.which("chromium") is None:
        sys.exit("needs chromium: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as work:
        runs = Path(work) / "runs"
        subprocess.run(
            [sys.executable, "-m", "gpipe", "train", "--size", "tiny", "--steps", "200",
             "--eval-every", "20", "--save-every", "0", "--sample-tokens", "0",
             "--progress", "lines", "--log-every", "50", "--out", str(runs / "gpt-tiny-K2")],
            check=True,
        )  # fmt: skip
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(runs),
             "--host", "127.0.0.1", "--port", str(PORT)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{PORT}/"
            for _ in range(60):  # until it serves
                try:
                    urllib.request.urlopen(url, timeout=2).close()
                    break
                except OSError:
                    time.sleep(1)
            out = Path(args.out).resolve()
            subprocess.run(
                [*BROWSER, f"--user-data-dir={work}/browser", f"--screenshot={out}",
                 url + "#scalars&tagFilter=train%7Cval&_smoothingWeight=0.6"],
                check=True, timeout=180, stderr=subprocess.DEVNULL,
                env={**os.environ, "DBUS_SESSION_BUS_ADDRESS": "disabled:"},
            )  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
