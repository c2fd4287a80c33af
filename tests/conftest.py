"""Test-wide settings, and the fixtures of ``gpipe train`` runs (one tiny run per session)."""

import contextlib
import fcntl
import json
import multiprocessing.process
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from gpipe.__main__ import main
from train_runs import TINY, gpipe_command

# Two cores, several processes per test at times: one thread per process avoids
# oversubscription, which made small models an order of magnitude slower. The variable
# carries it to every process the suite starts (launch's ranks, gpipe commands, torchrun's),
# whose default is the cores shared by a job's processes: a K=1 rank then spun two threads,
# 3x the CPU of one on a busy machine.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    for item in items:  # the session's tiny run starts processes for whoever asks first
        if "tiny_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    # Tests that start processes first: they are the long ones, and the workers then end
    # together on short tests instead of one waiting for the other. xdist's worksteal hands
    # each of n workers one contiguous n-th of this order (and an idle one steals from the
    # end of another's), so each n-th starts with every n-th of the slow tests: all at the
    # front would be one worker's, the others stealing short tests from its far end.
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    items[:], left = [], len(items)
    for worker in range(workers):  # the n-ths' sizes as worksteal cuts them
        share, mine = left // (workers - worker), slow[worker::workers]
        left -= share
        items += [*mine, *fast[: max(share - len(mine), 0)]]
        del fast[: max(share - len(mine), 0)]
    items += fast


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


@pytest.fixture
def tiny_run(shared_dir, request) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``gpipe train`` run (K=2) for the whole session, made by the first test (of any
    worker) that asks; its files are read, never written, by the tests.

    It is tried once: should it fail, the test that made it fails with the run's own error
    (or its timeout) and every other one is skipped naming that test, so one failure reads
    as one, not as an error per dependent test (nor as a retry that trips over the failed
    run's folder)."""
    record = shared_dir / "tiny_run.json"
    with _locked(shared_dir / "tiny_run.lock"):
        if not record.exists():
            _make_tiny_run(shared_dir, record, request.node.nodeid)
    made = json.loads(record.read_text())
    if made["error"] is not None:
        if made["by"] == request.node.nodeid:
            pytest.fail(f"the session's tiny run failed: {made['error']}", pytrace=False)
        pytest.skip(f"the session's tiny run failed; {made['by']} reports its error")
    return Path(made["out"]), subprocess.CompletedProcess(*made["done"])


def _make_tiny_run(shared_dir: Path, record: Path, asker: str) -> None:
    """Run it in a new folder of its own, and record the outcome, whatever it is."""
    out = Path(tempfile.mkdtemp(prefix="tiny_run-", dir=shared_dir)) / "run"
    made = {"by": asker, "out": str(out), "done": None, "error": None}
    try:
        args = ["train", *TINY, "--sample-tokens", "12", "--out", str(out)]
        done = gpipe_command(*args, cache=shared_dir / "tiny_run_cache")
        made["done"] = [done.args, done.returncode, done.stdout, done.stderr]
        if done.returncode != 0:
            made["error"] = f"exit code {done.returncode}: {done.stderr[-3000:]}"
    except subprocess.TimeoutExpired as error:
        made["error"] = str(error)
    except BaseException as error:  # pytest-timeout or Ctrl-C: recorded, then passed on
        made["error"] = f"interrupted: {type(error).__name__}: {error}"
        raise
    finally:
        record.write_text(json.dumps(made))


@pytest.fixture
def in_process(cache, monkeypatch, capfd):
    """``gpipe ...`` run by this process (its spawned ranks print to the captured fds)."""
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(cache))

    def command(*args: str) -> subprocess.CompletedProcess:
        code = main(list(args))
        captured = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return command
