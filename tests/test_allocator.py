"""gpipe.cpu_allocator: what each policy does to freed CPU tensors, seen in resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gpipe.allocator import _glibc, cpu_allocator, environment

needs_glibc = pytest.mark.skipif(_glibc() is None, reason="mallopt is glibc's")

# Fills 256 MiB in 4 MiB tensors, frees them, and prints how much of it stays resident.
_PROGRAM = textwrap.dedent(
    """
    import os, sys, torch
    from gpipe import cpu_allocator

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    cpu_allocator(sys.argv[1])
    before = resident()
    held = [torch.ones(2**20) for _ in range(64)]
    filled = resident()
    del held
    print(filled - before, resident() - before)
    """
)


def _resident_after_free(policy: str, env: dict[str, str] | None = None) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, policy],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    filled, kept = map(float, out.stdout.split())
    return filled, kept


@needs_glibc
@pytest.mark.slow
def test_cache_keeps_freed_tensors_and_return_gives_them_back():
    filled, kept = _resident_after_free("cache")
    assert filled > 200 and kept > 200  # reused by the next tensors, not given back
    filled, kept = _resident_after_free("return")
    assert filled > 200 and kept < 32  # each tensor's mapping went back when freed


@needs_glibc
@pytest.mark.slow
def test_the_environment_gives_a_starting_process_the_same_policy():
    filled, kept = _resident_after_free("default", environment("cache"))
    assert filled > 200 and kept > 200
    filled, kept = _resident_after_free("default", environment("return"))
    assert filled > 200 and kept < 32
    assert environment("default") == {}


def test_an_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown policy 'fast'.*'cache'"):
        cpu_allocator("fast")
    with pytest.raises(ValueError, match=r"unknown policy 'fast'"):
        environment("fast")
