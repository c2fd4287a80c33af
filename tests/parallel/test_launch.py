"""gpipe.parallel.launch: K local processes from a plain ``python`` command, each with its
share of the cores, the caller's environment and outputs, the job's store on loopback in the
launcher; a mesh that does not form is started once more."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpipe.parallel import launch as launch_module
from gpipe.parallel.launch import LaunchError, launch, threads_per_process
from launch_probes import (
    FLAKY_MESH,
    environment_and_output,
    job_store,
    rank_of,
    thread_count,
)

# 127.0.0.1 and ::1 as /proc/net writes them
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}


@pytest.mark.slow
def test_launch_shares_the_cores_unless_told(monkeypatch):
    """Each process computes with its share of the cores (torch's default, all of them in
    every process, oversubscribes them); OMP_NUM_THREADS, when set, decides."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch(thread_count, 2, timeout=60) == [threads_per_process(2)] * 2
    if threads_per_process(1) >= 2:  # torch takes no more threads than there are cores
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert launch(thread_count, 2, timeout=60) == [2, 2]


@pytest.mark.slow
def test_a_mesh_that_does_not_form_is_started_once_more(monkeypatch, tmp_path):
    """Gloo's full mesh sometimes fails to connect on a busy machine, before anything ran:
    the job starts once more (a warning says so); a second such failure is raised."""
    monkeypatch.setenv("GPIPE_FLAKY_MESH", str(tmp_path))
    with pytest.warns(UserWarning, match="gloo's connections did not form"):
        assert launch(rank_of, 2, backend=FLAKY_MESH, timeout=30) == [0, 1]
    for marker in tmp_path.iterdir():
        marker.unlink()
    monkeypatch.setattr(launch_module, "_launch", _once_without_retry(launch_module._launch))
    with pytest.warns(UserWarning), pytest.raises(LaunchError, match="connectFullMesh"):
        launch(rank_of, 2, backend=FLAKY_MESH, timeout=30)


def _once_without_retry(run):
    """Both attempts fail: the first one's failure is the only one."""

    def attempt(*args, again=True, **kwargs):
        for marker in Path(os.environ["GPIPE_FLAKY_MESH"]).iterdir():
            marker.unlink()
        return run(*args, again=again, **kwargs)

    return attempt


@pytest.mark.slow
def test_each_launch_gives_its_processes_the_environment_and_outputs_of_the_call(
    monkeypatch, capfd
):
    """Forked from a server started at the first launch, the processes still get what a
    fresh interpreter would: the variables and the standard output as they are now."""
    monkeypatch.setenv("GPIPE_TEST_VALUE", "first")
    assert launch(environment_and_output, 2, args=("GPIPE_TEST_VALUE",)) == ["first"] * 2
    capfd.readouterr()
    monkeypatch.setenv("GPIPE_TEST_VALUE", "second")
    assert launch(environment_and_output, 2, args=("GPIPE_TEST_VALUE",)) == ["second"] * 2
    printed = capfd.readouterr().out
    assert "rank 0 says hello" in printed and "rank 1 says hello" in printed


@pytest.mark.slow
def test_the_launched_jobs_store_is_the_launchers_on_loopback_only():
    """torch's store listens on every interface, in rank 0 (SIGSTOP of rank 0 took it, and
    every process waited on): under launch it is the launcher's, on 127.0.0.1 alone."""
    for seen in launch(job_store, 2, args=(os.getpid(),), timeout=30):
        assert seen["addresses"] and set(seen["addresses"]) <= LOOPBACK, seen
        assert seen["launcher"] and not seen["rank"], seen
