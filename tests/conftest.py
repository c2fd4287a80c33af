"""Test-wide settings, and the fixtures of ``gpipe train`` runs (one tiny run per session)."""

import contextlib
import fcntl
import json
import multiprocessing.process
import subprocess
from pathlib import Path

import pytest
import torch

from gpipe.__main__ import main
from train_runs import TINY, gpipe_command

# Two cores, several processes per test at times: one thread per process avoids
# oversubscription, which made small models an order of magnitude slower.
torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    for item in items:  # the session's tiny run starts processes for whoever asks first
        if "tiny_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    # Tests that start processes first (in their order): they are the long ones, and the
    # workers then end together on short tests instead of one waiting for the other.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def _fonts_found():
    """matplotlib lists the machine's fonts with ``fc-list`` (a process) the first time it
    draws after an install; done here, before any test, so no fast test is refused for it."""
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def _processes_only_in_slow_tests(request, monkeypatch):
    """A test that starts a process is marked ``slow``, so ``make test-fast`` stays fast:
    an unmarked one that tries fails here, saying so."""
    if request.node.get_closest_marker("slow"):
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.slow")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder every test worker of this session sees (pytest-xdist's workers share the
    parent of their base temporary folders)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if base.name.startswith("popen-gw") else base


@contextlib.contextmanager
def _locked(path: Path):
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def tiny_run(shared_dir) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``gpipe train`` run (K=2) for the whole session, made by the first worker that
    asks; its files are read, never written, by the tests."""
    out, record = shared_dir / "tiny_run", shared_dir / "tiny_run.json"
    with _locked(shared_dir / "tiny_run.lock"):
        if not record.exists():
            args = ["train", *TINY, "--sample-tokens", "12", "--out", str(out)]
            done = gpipe_command(*args, cache=shared_dir / "tiny_run_cache")
            record.write_text(json.dumps([done.args, done.returncode, done.stdout, done.stderr]))
    done = subprocess.CompletedProcess(*json.loads(record.read_text()))
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
