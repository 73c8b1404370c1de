"""Keep freed host memory in the process heap while real CPU steps are probed.

NOTE [ Probing reuses host pages ]
A cpu-backend probe allocates gigabytes and frees them, and the next probe allocates them
again. glibc's malloc serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB, raised
dynamically up to 32 MiB) with fresh ``mmap`` calls and gives trimmed heap tops back to the
kernel, so every probe faults in every page anew: on this project's 2-core machine a
148k-token step of the tiny model spent 5 s of its 16 s in the kernel (2.9 million minor
page faults). Raising both thresholds while probing keeps the freed pages mapped: the
same step then takes 0 s of system time. It changes only where freed memory waits, not
what a step allocates, so the tracker's figures are the same. The defaults are put back
afterwards (the thresholds then stay fixed at their default values rather than dynamic).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
from collections.abc import Iterator

# mallopt parameters (malloc.h) and glibc's defaults.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DEFAULT_THRESHOLD = 128 * 1024
_RETAIN = 2**31 - 1  # mallopt takes a C int


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both; musl has neither
    except (OSError, AttributeError):
        return None
    return libc


@contextlib.contextmanager
def retain_freed_memory() -> Iterator[None]:
    """Inside, freed host memory stays in the heap for the next allocation; on exit it goes back.

    glibc only (a no-op elsewhere). See NOTE [ Probing reuses host pages ].
    """
    libc = _glibc()
    if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, _RETAIN):
        yield
        return
    libc.mallopt(_M_TRIM_THRESHOLD, _RETAIN)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _DEFAULT_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_THRESHOLD)
        libc.malloc_trim(0)
