"""gpipe.cpu_allocator: what each policy does to freed CPU tensors, seen in resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gpipe.base.allocator import _glibc, cpu_allocator, environment, started_with

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


# Records a GPT of 8 and of 264 blocks on meta, builds its last block, drops the rest, trims:
# prints how much the deeper record grew the process while alive, and how much it left.
_RECORD = textwrap.dedent(
    """
    import functools, os
    from gpipe.base.allocator import trim
    from gpipe.materialize import record_model, replay_layers
    from gpipe.models import GPTConfig, gpt

    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def grown(depth):
        config = GPTConfig(vocab_size=64, context=8, d_model=64, n_heads=2, n_layers=depth)
        before = resident()
        model, record = record_model(functools.partial(gpt, config), seed=0)
        replay_layers(model, record, seed=0, layers=[depth])  # the last block only
        alive = resident() - before
        last = model[depth]
        del model, record
        trim()
        return alive, resident() - before

    grown(4)  # the recorder's first-use cost
    (alive, left), (deeper_alive, deeper_left) = grown(8), grown(264)
    print(deeper_alive - alive, deeper_left - left)
    """
)


@needs_glibc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_return_gives_back_most_of_a_whole_model_s_record():
    # Python's own arenas kept about 80 % of it resident (the few objects that outlive the
    # record pin them); with malloc and a trim, under half stays.
    with started_with("return"):
        out = subprocess.run(
            [sys.executable, "-c", _RECORD], capture_output=True, text=True, timeout=240
        )
    assert out.returncode == 0, out.stderr
    alive, left = map(float, out.stdout.split())
    assert alive > 4  # MiB: the 256 more blocks' record is there to be given back
    assert left < 0.6 * alive, (alive, left)
    assert environment("return")["PYTHONMALLOC"] == "malloc"
