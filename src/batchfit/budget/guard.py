"""A probe on real ranks that one rank's out-of-memory error cannot hang: :class:`ProbeGuard`.

NOTE [ One rank runs out ]
A sharded step holds collectives: FSDP2 all-gathers each layer's parameters and
reduce-scatters its gradients. When one rank runs out of memory in the middle of a step, it
leaves the step, while the other ranks wait in the next collective for it, forever (gloo)
or until NCCL's watchdog kills them. The search therefore does four things on real ranks:

1. It does not provoke it. Tracked backends run every probe to the end (NOTE [ Real ranks
   run their probes to the end ]); cuda caps every rank's allocator at the same limit
   (:meth:`batchfit.memory.Backend.capped`), and the search only runs a candidate whose peak
   the measurements so far predict within that limit (NOTE [ Only predicted fits on real
   ranks ] in :mod:`batchfit.budget.find`).
2. When it happens anyway, the rank that ran out says so at once: it sets a key of the
   default group's store, named after the search and the probe (:meth:`ProbeGuard.signal`).
3. The ranks waiting for it stop waiting. On gloo, ``Work.wait`` is what a waiting rank is
   in: inside a guarded probe it waits in slices of :data:`POLL_SECONDS` and looks at the key
   between them; when it is set it raises :class:`~batchfit.memory.base.RankRanOutOfMemory`,
   which :meth:`batchfit.memory.Backend.measure` counts as running out, so the step unwinds
   and its state is restored (NOTE [ Probes are isolated ]). On NCCL, ``wait`` does not
   block the host (the kernel waits on the device): a watcher thread looks at the key and
   aborts the model's communicator (``ProcessGroup.abort``, NCCL's ``ncclCommAbort``), which
   ends the waiting kernels with an error.
4. Every rank learns it before anyone enters another collective of that model: the
   verdicts are agreed on the default group, which the abandoned collective did not touch
   (each model has a process group of its own, NOTE [ A model's own process group ]). The
   model's group is left with a collective one rank never entered, so it is never used
   again: the search stops with one :class:`~batchfit.errors.ProbeAbandoned` on every rank.
   A rank that ran out after the step's last collective (in the optimizer step) left no
   collective behind: that candidate simply does not fit and the search goes on.

DDP all-reduces gradients from C++ (the reducer), where no Python ``wait`` can be polled:
there the model group's timeout bounds the wait.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

from batchfit.memory.base import RankRanOutOfMemory
from batchfit.memory.patches import ClassPatch
from batchfit.parallel.shard import model_groups

#: How long a guarded ``Work.wait`` blocks before it looks at the store again.
POLL_SECONDS = 0.05

_searches = itertools.count()  # every rank starts its searches in the same order
_active = threading.local()  # the guarded probe of this thread, if any


def _work_class() -> type | None:
    import torch.distributed as dist

    return getattr(dist, "Work", None) if dist.is_available() else None


_WAIT = ClassPatch(_work_class, "wait")


@_WAIT.bind
def _polling_wait(work: Any, timeout: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``Work.wait`` that, inside a guarded probe, gives up when another rank has run out (NOTE above)."""
    probe = getattr(_active, "probe", None)
    if probe is None or args or kwargs:
        return _WAIT.call_below(work, *(() if timeout is None else (timeout,)), *args, **kwargs)
    given = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
    deadline = time.monotonic() + given if given > 0 else None
    step = datetime.timedelta(seconds=POLL_SECONDS)
    while True:
        try:
            return _WAIT.call_below(work, step)
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
        failed = probe.failed_rank()
        if failed is not None:
            probe.abandoned = True
            raise RankRanOutOfMemory(failed, probe.what)
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"Work.wait timed out after {given:g} s")


class _Probe:
    """One guarded probe: its store key, what it measures, whether this rank abandoned a collective."""

    def __init__(self, store: Any, key: str, what: str):
        self.store, self.key, self.what = store, key, what
        self.abandoned = False

    def failed_rank(self) -> int | None:
        if not self.store.check([self.key]):
            return None
        return int(self.store.get(self.key).decode())


class ProbeGuard:
    """Guards the probes of one search on real ranks (NOTE [ One rank runs out ]).

    Every rank makes one per search, in the same order, and passes each probe the same
    index: ``with guard.probe(index, what) as p: measure(...)``; a rank whose measurement ran
    out of memory calls :meth:`signal`; ``p.abandoned`` says whether this rank gave up a
    collective because another rank ran out.
    """

    def __init__(self, rank: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.search = next(_searches)
        self._store = dist.distributed_c10d._get_default_store()

    def _key(self, index: int) -> str:
        return f"batchfit/search/{self.search}/probe/{index}/ran_out"

    @contextlib.contextmanager
    def probe(self, index: int, what: str) -> Iterator[_Probe]:
        """Guard one probe: waits give up and NCCL communicators are aborted when another rank runs out."""
        probe = _Probe(self._store, self._key(index), what)
        stop = threading.Event()
        watcher = None
        nccl = [g for g in model_groups() if _backend(g) == "nccl"]
        if nccl:
            watcher = threading.Thread(target=_watch, args=(probe, nccl, stop), daemon=True)
            watcher.start()
        _WAIT.acquire()
        _active.probe = probe
        try:
            yield probe
        finally:
            _active.probe = None
            _WAIT.release()
            stop.set()
            if watcher is not None:
                watcher.join()

    def signal(self, index: int) -> None:
        """This rank ran out of memory in probe ``index``: tell the others at once."""
        self._store.set(self._key(index), str(self.rank))

    def forget(self, index: int) -> None:
        """Drop probe ``index``'s key once every rank has agreed on it."""
        with contextlib.suppress(Exception):  # a key never set, or a store without delete
            self._store.delete_key(self._key(index))


def _backend(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # destroyed or aborted
        return ""


def _watch(probe: _Probe, groups: list[Any], stop: threading.Event) -> None:
    """NCCL: abort the models' communicators as soon as another rank has run out."""
    while not stop.wait(POLL_SECONDS):
        if probe.failed_rank() is not None:
            probe.abandoned = True
            for group in groups:
                with contextlib.suppress(Exception):
                    group.abort()
            return
