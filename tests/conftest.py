"""Test-wide settings, and the fixtures of ``gpipe train`` runs (one tiny run per session)."""

import subprocess
from pathlib import Path

import pytest
import torch

from gpipe.__main__ import main
from train_runs import TINY, gpipe_command

# Two cores, several processes per test at times: one thread per process avoids
# oversubscription, which made small models an order of magnitude slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, cache) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("runs") / "a"
    done = gpipe_command("train", *TINY, "--sample-tokens", "12", "--out", str(out), cache=cache)
    assert done.returncode == 0, done.stderr
    return out, done


@pytest.fixture
def in_process(cache, monkeypatch, capfd):
    """``gpipe ...`` run by this process (its spawned ranks print to the captured fds)."""
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(cache))

    def command(*args: str) -> subprocess.CompletedProcess:
        code = main(list(args))
        captured = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return command
