"""No launched process outlives its launcher: stopped by SIGTERM, or killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src"
LONG_JOB = """
import time, gpipe

def work(rank):
    print("rank", rank, "working", flush=True)
    time.sleep(120)

if __name__ == "__main__":
    gpipe.launch(work, 2, timeout=30)
"""


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sent", "code"), [(signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_a_stopped_or_killed_launcher_leaves_no_process(tmp_path, sent, code):
    script = tmp_path / "job.py"
    script.write_text(LONG_JOB)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    launcher = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(2):  # both ranks started
            assert "working" in launcher.stdout.readline()
        ranks = [p for p in children(launcher.pid) if "spawn_main" in _cmdline(p)]
        assert len(ranks) == 2
        launcher.send_signal(sent)
        assert launcher.wait(timeout=30) == code
        deadline = time.monotonic() + 15
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in ranks)
    finally:
        launcher.kill()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""
