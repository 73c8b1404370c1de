"""Keep freed host memory in the process heap while real CPU steps are probed.

NOTE [ Probing reuses host pages ]
A cpu-backend probe allocates gigabytes and frees them, and the next probe allocates them
again. glibc's malloc serves blocks above ``M_MMAP_THRESHOLD`` (128 KiB, raised
dynamically up to 32 MiB) with fresh ``mmap`` calls and gives trimmed heap tops back to the
kernel, so every probe faults in every page anew: on this project's 2-core machine a
148k-token step of the tiny model spent 5 s of its 16 s in the kernel (2.9 million minor
page faults). Raising both thresholds while probing keeps the freed pages mapped: the
same step then takes 0 s of system time. It changes only where freed memory waits, not
what a step allocates, so the tracker's figures are the same.

NOTE [ What the heap is given back ]
``mallopt`` changes the whole process and glibc has no getter, so what is put back on exit
is what this module knows was there (:func:`_thresholds_before`):

- the values the process started with: ``GLIBC_TUNABLES`` (``glibc.malloc.mmap_threshold``,
  ``glibc.malloc.trim_threshold``) or ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
  as glibc read them at start-up (``/proc/self/environ``), else glibc's defaults (128 KiB);
- once this module has set them, the values it put back last time.

When the start-up environment sets a threshold this module cannot read, it leaves the heap
alone (the block is then a no-op). Limitations, since nothing can read the thresholds:
glibc's *dynamic* mmap threshold (raised by each freed mmapped block up to 32 MiB) cannot
be switched on again by ``mallopt``, so after the first block the thresholds stay fixed at
the values above instead of rising; and a ``mallopt`` call by other code of the process
(no getter tells) is overwritten on exit by the values above.

Nested and concurrent blocks share one change (a count under a lock): the first entered
sets the thresholds, the last to exit restores them. A failure while setting them undoes
what was set before the exception propagates; on exit every restoring call runs even when
one raises (NOTE [ Every undo step runs ] in :mod:`batchfit.patching`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from batchfit.patching import SharedChange, undo_all

# mallopt parameters (malloc.h) and glibc's defaults.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_DEFAULT_THRESHOLD = 128 * 1024
_RETAIN = 2**31 - 1  # mallopt takes a C int

# (parameter, GLIBC_TUNABLES name, environment alias), in the order they are set
_PARAMETERS = (
    (_M_MMAP_THRESHOLD, "glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_"),
    (_M_TRIM_THRESHOLD, "glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_"),
)


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both; musl has neither
    except (OSError, AttributeError):
        return None
    return libc


def _startup_environment() -> Mapping[str, str]:
    """The environment the process started with (what glibc read), ``{}`` when unreadable."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def _parse_size(text: str) -> int | None:
    try:
        value = int(text.strip(), 0)
    except ValueError:
        return None
    return value if 0 <= value <= _RETAIN else None


def _thresholds_before(env: Mapping[str, str]) -> dict[int, int] | None:
    """``{parameter: value}`` the process started with (NOTE [ What the heap is given back ]); ``None`` when unreadable."""
    tunables: dict[str, str] = {}
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        name, sep, value = item.partition("=")
        if sep:
            tunables[name.strip()] = value
    before: dict[int, int] = {}
    for parameter, tunable, alias in _PARAMETERS:
        text = tunables.get(tunable, env.get(alias))
        if text is None:
            before[parameter] = _DEFAULT_THRESHOLD
            continue
        value = _parse_size(text)
        if value is None:
            return None
        before[parameter] = value
    return before


class _RetainedHeap(SharedChange):
    """glibc's thresholds raised while at least one block is inside (NOTE [ Probing reuses host pages ]).

    Attributes:
        users: blocks inside now (any thread).
        restore: the thresholds put back by the last exit (``None``: not known yet).
    """

    def __init__(self) -> None:
        super().__init__()
        self.restore: dict[int, int] | None = None
        self._libc: Any = None  # the libc the first user changed; None: the heap is left alone

    def _install(self) -> None:
        """Raise both thresholds, or leave the heap alone (no glibc, unreadable start-up values, a refused call)."""
        libc = _glibc()
        if libc is None:
            return
        restore = self.restore if self.restore is not None else _thresholds_before(_startup_environment())
        if restore is None:
            return  # set at start-up to something unreadable: leave it as it is
        undo: list[Callable[[], object]] = []
        try:
            for parameter, _, _ in _PARAMETERS:
                if not libc.mallopt(parameter, _RETAIN):  # refused: that call changed nothing
                    undo_all(reversed(undo))
                    return
                undo.append(functools.partial(libc.mallopt, parameter, restore[parameter]))
        except BaseException as exc:
            undo_all(reversed(undo), exc)
            raise
        self._libc, self.restore = libc, restore

    def _uninstall(self) -> None:
        """Put the thresholds back and trim the heap, every call even when one raises."""
        libc, restore, self._libc = self._libc, self.restore, None
        if libc is None or restore is None:  # the heap was left alone
            return
        steps: list[Callable[[], object]] = [
            functools.partial(libc.mallopt, parameter, restore[parameter])
            for parameter, _, _ in reversed(_PARAMETERS)
        ]
        steps.append(functools.partial(libc.malloc_trim, 0))
        undo_all(steps)


# NOTE [ Shared and counted ] in batchfit.patching
_HEAP = _RetainedHeap()


@contextlib.contextmanager
def retain_freed_memory() -> Iterator[None]:
    """Inside, freed host memory stays in the heap for the next allocation; on exit it goes back.

    glibc only (a no-op elsewhere, and where the start-up environment set the thresholds to
    values this module cannot read). Re-entrant and thread-safe: nested blocks share one
    change. See NOTE [ Probing reuses host pages ] and NOTE [ What the heap is given back ].

    Raises:
        Whatever a ``mallopt`` call raises (``ctypes``), after undoing what was set.
    """
    with _HEAP.active():
        yield
