"""Ranks tell each other through the store that one of them stopped: :class:`RankSignals`, and waits that listen.

NOTE [ Ranks signal through the store ]
A rank that stops in the middle of a step that holds collectives (out of memory, an error)
leaves the others waiting in a collective it never enters: forever on gloo, until the watchdog
kills them on NCCL. The collective itself cannot carry the news, so it goes through the default
group's store, which every rank reaches without a collective:

- **A key per step.** :class:`RankSignals` names one key per step of a guarded run (a budget
  search's probe, a training mini-batch's attempt): the rank that leaves the step early sets it
  to its rank (:meth:`RankSignals.signal`), and every rank drops it once they have all agreed
  on the step (:meth:`RankSignals.forget`). A key ``left`` per run says that a rank left the
  whole run (:meth:`RankSignals.leave`).
- **Waits that listen.** Inside :func:`listening`, a ``Work.wait`` wrapped by the polling layer
  (:func:`install_polling_wait` puts it on the one ``Work.wait`` patch,
  :data:`batchfit.memory.tracker.WORK_WAIT`) blocks in slices of :data:`POLL_SECONDS` and calls
  the listener's ``check`` between them; ``check`` raises to give the wait up (the budget
  search's :class:`~batchfit.budget.guard.SearchGuard` raises
  :class:`~batchfit.memory.base.RankRanOutOfMemory`). On gloo that is where a waiting rank is.
- **NCCL.** ``wait`` does not block the host there; :func:`aborting_nccl` runs a thread that
  aborts the given communicators (``ProcessGroup.abort``) as soon as a key says so.

This module holds the mechanism only, shared by the budget search's guard (NOTE [ One rank runs
out ] in :mod:`batchfit.budget.guard`) and the training loop's (NOTE [ A micro-batch runs out ]
in :mod:`batchfit.train.micro_batch_guard`); each decides what a signal means. It imports
nothing above ``parallel``: the patch it layers on is handed to :func:`install_polling_wait`
by its users.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "POLL_SECONDS",
    "RankSignals",
    "aborting_nccl",
    "install_polling_wait",
    "listening",
    "nccl_groups",
    "ranks_tag",
]

#: How long a listening ``Work.wait`` blocks before it calls its listener's ``check`` again.
POLL_SECONDS = 0.05

_listener = threading.local()  # the check of this thread's listening block, if any
_installed: list[Any] = []  # the patches the polling layer is on (each once)


def ranks_tag(ranks: Sequence[int]) -> str:
    """``"0-1-2"``: the ranks of a guarded run, as its keys name them."""
    return "-".join(map(str, ranks))


class RankSignals:
    """The store keys of one guarded run on real ranks (NOTE [ Ranks signal through the store ]).

    Keys: ``{prefix}/{item}/{index}/ran_out`` for step ``index`` (``prefix="batchfit/search/0-1/3"``,
    ``item="probe"``) and ``{prefix}/left`` for the run. Every rank makes the same object for the
    same run; nothing here is a collective.
    """

    def __init__(self, prefix: str, item: str) -> None:
        import torch.distributed as dist

        self.prefix, self.item = prefix, item
        self._store = dist.distributed_c10d._get_default_store()

    def key(self, index: int) -> str:
        """The key of step ``index``."""
        return f"{self.prefix}/{self.item}/{index}/ran_out"

    def left_key(self) -> str:
        """The key that says a rank left the run."""
        return f"{self.prefix}/left"

    def signal(self, index: int, rank: int) -> None:
        """``rank`` left step ``index`` early: tell the others at once."""
        self._store.set(self.key(index), str(rank))

    def failed_rank(self, index: int) -> int | None:
        """The rank that left step ``index`` early, ``None`` while none has."""
        key = self.key(index)
        if not self._store.check([key]):
            return None
        return int(self._store.get(key).decode())

    def forget(self, index: int) -> None:
        """Drop step ``index``'s key once every rank has agreed on the step."""
        with contextlib.suppress(Exception):  # a key never set, or a store without delete
            self._store.delete_key(self.key(index))

    def leave(self, rank: int, exc: BaseException) -> None:
        """``rank`` leaves the run with ``exc``, which the others do not know of: say so (its type and first words)."""
        first = " ".join(str(exc).split())[:160]
        why = type(exc).__name__ + (f": {first}" if first else "")
        with contextlib.suppress(Exception):  # the store itself may be gone
            self._store.set(self.left_key(), f"{rank}:{why}")

    def left(self) -> tuple[int, str] | None:
        """``(rank, why)`` of the rank that left the run, ``None`` while none has."""
        if not self._store.check([self.left_key()]):
            return None
        rank, _, why = self._store.get(self.left_key()).decode().partition(":")
        return int(rank), why


@contextlib.contextmanager
def listening(check: Callable[[], None]) -> Iterator[None]:
    """Inside, this thread's listening waits call ``check()`` every :data:`POLL_SECONDS`; it raises to give a wait up.

    The polling layer must be installed (:func:`install_polling_wait`) and the patch active
    (``WORK_WAIT.active()``) for waits to listen. Nested blocks: the innermost check is called,
    the outer one again after it.
    """
    outer = getattr(_listener, "check", None)
    _listener.check = check
    try:
        yield
    finally:
        _listener.check = outer


def _polling_wait(call: Callable[..., Any], work: Any, timeout: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``Work.wait`` that, inside :func:`listening`, waits in slices and calls the listener's check between them.

    A layer of the one ``Work.wait`` patch (:data:`batchfit.memory.tracker.WORK_WAIT`), inside
    the tracker's: the polling wait's allocations are the backend's, as the whole wait's are.
    A wait given its own timeout still ends after it (``RuntimeError``, as gloo's).
    """
    check = getattr(_listener, "check", None)
    if check is None or args or kwargs:
        return call(work, *(() if timeout is None else (timeout,)), *args, **kwargs)
    given = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
    deadline = time.monotonic() + given if given > 0 else None
    step = datetime.timedelta(seconds=POLL_SECONDS)
    while True:
        try:
            return call(work, step)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
        check()
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"Work.wait timed out after {given:g} s")


def install_polling_wait(patch: Any) -> None:
    """Put the polling wait on ``patch`` (a :class:`~batchfit.patching.LayeredPatch` of ``Work.wait``), once.

    Every user calls it with :data:`batchfit.memory.tracker.WORK_WAIT` when it is imported; the
    first call registers the layer (inside the layers registered before it, the tracker's), the
    others find it there.
    """
    if any(p is patch for p in _installed):
        return
    patch.layer(_polling_wait)
    _installed.append(patch)


def _backend(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # destroyed or aborted
        return ""


def nccl_groups(groups: Sequence[Any]) -> list[Any]:
    """The groups of ``groups`` whose backend is NCCL (the ones whose waits do not block the host)."""
    return [g for g in groups if _backend(g) == "nccl"]


@contextlib.contextmanager
def aborting_nccl(failed: Callable[[], bool], groups: Sequence[Any], on_abort: Callable[[], None]) -> Iterator[None]:
    """Inside, a thread aborts the NCCL communicators of ``groups`` as soon as ``failed()`` (NOTE above).

    ``on_abort()`` runs first, on that thread. Nothing is started when none of ``groups`` is NCCL.
    """
    nccl = nccl_groups(groups)
    if not nccl:
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(POLL_SECONDS):
            if failed():
                on_abort()
                for group in nccl:
                    with contextlib.suppress(Exception):
                        group.abort()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
