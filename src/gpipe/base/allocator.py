"""How the process's C allocator treats the memory of freed CPU tensors (glibc only).

PyTorch's CPU tensors come from ``malloc``. glibc gives a large block its own fresh mapping
(above an mmap threshold that grows with use) and hands memory at the top of its heap back
to the system; either way the next tensor of that size page-faults on freshly zeroed pages.
GPUs do not pay this: PyTorch's caching allocator keeps freed blocks. Two policies:

* ``"cache"``: blocks up to 32 MiB (glibc's largest threshold) come from the heap, and the
  heap is never trimmed. Freed tensors are reused while still in the cache, as the CUDA
  allocator does. Resident memory stays at its high-water mark. A split backward (B now,
  W later) gains the most: it holds more at once, so with glibc's default its W keeps
  landing on fresh pages (``benchmarks/split_backward.py``).
* ``"return"``: every block over 64 KiB is its own mapping, given back when freed, so the
  process's peak follows the bytes actually live. This is for memory-bound runs (what
  ``gpipe.planner.capacity`` measures with); it is slower. Processes started with it
  (:func:`environment`) also take Python's small objects from ``malloc`` instead of
  Python's own arenas (``PYTHONMALLOC=malloc``): a 1 MiB arena goes back only when its
  last object dies, so the few objects that outlive recording a model on ``meta`` (the
  local layers) kept every arena of the record resident (measured: 0.05 MiB per block of
  a GPT, the *whole* model's, in every process); :func:`trim` then gives the record's pages
  back.

The setting holds for the calling process from now on; call it in each rank (``gpipe train
--cpu-allocator``). With jemalloc or tcmalloc preloaded it changes nothing that matters.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from functools import cache

__all__ = ["POLICIES", "cpu_allocator", "environment", "started_with", "trim"]

POLICIES = ("default", "cache", "return")

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LARGEST_MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more on 64-bit
_NEVER_TRIM = 2**31 - 1
_RETURN_MMAP_THRESHOLD = 64 * 2**10


@cache
def _glibc() -> ctypes.CDLL | None:
    # glibc's soname first: find_library runs a process (ldconfig) to look it up.
    for find in (lambda: "libc.so.6", lambda: ctypes.util.find_library("c")):
        name = find()
        try:
            libc = ctypes.CDLL(name)
            libc.gnu_get_libc_version  # noqa: B018 -- only glibc has it
            libc.mallopt  # noqa: B018
        except (OSError, AttributeError, TypeError):
            continue
        return libc
    return None


def cpu_allocator(policy: str) -> None:
    """Set this process's allocator policy: ``"cache"``, ``"return"`` or ``"default"``.

    ``"default"`` leaves glibc as it is (it cannot be restored once changed in a process).
    """
    settings = _settings(policy, "cpu_allocator")
    if not settings:
        return
    libc = _glibc()
    if libc is None:
        raise RuntimeError(
            f"cpu_allocator({policy!r}) needs glibc's mallopt, which this platform lacks; "
            "leave the policy at 'default', or preload jemalloc or tcmalloc (LD_PRELOAD)"
        )
    for parameter, value in settings:
        if libc.mallopt(parameter, value) != 1:
            raise RuntimeError(
                f"cpu_allocator({policy!r}): glibc refused mallopt({parameter}, {value})"
            )


def environment(policy: str) -> dict[str, str]:
    """The same policy for processes about to start: glibc reads these variables at start."""
    names = {
        _M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_",
        _M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_",
    }
    variables = {names[p]: str(value) for p, value in _settings(policy, "environment")}
    if policy == "return":
        variables["PYTHONMALLOC"] = "malloc"  # read by the interpreter at start only
    return variables


def trim() -> None:
    """Give the memory the C allocator holds free back to the system (glibc's
    ``malloc_trim``: whole free pages, also inside the heap); nothing elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def started_with(policy: str) -> Iterator[None]:
    """Processes started inside the block (e.g. by ``gpipe.launch``) run with ``policy``;
    this process's environment is restored after."""
    variables = environment(policy)
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _settings(policy: str, caller: str) -> tuple[tuple[int, int], ...]:
    """mallopt's (parameter, value) pairs for ``policy``; none for ``"default"``."""
    if policy not in POLICIES:
        raise ValueError(f"{caller}: unknown policy {policy!r}; choose one of {POLICIES}")
    if policy == "cache":
        return (_M_MMAP_THRESHOLD, _LARGEST_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, _NEVER_TRIM)
    if policy == "return":
        return ((_M_MMAP_THRESHOLD, _RETURN_MMAP_THRESHOLD),)
    return ()
