"""Searches on real ranks that no rank can hang: :func:`guarded_search` and its :class:`SearchGuard`.

NOTE [ One rank runs out ]
Ranks that search together run the same probes, and a probe of a sharded model holds
collectives (FSDP2 all-gathers each layer's parameters and reduce-scatters its gradients) on
the model's own process group (NOTE [ A model's own process group ] in
:mod:`batchfit.parallel.shard`). A rank that leaves a step early, or a search, or never starts
one, leaves the others waiting in a collective it never enters: forever on gloo, until the
watchdog kills them on NCCL. The rule: **a step stopped on one rank is stopped on every rank
before anyone enters another collective, and every way out of a search is agreed or
announced.** On real ranks (:func:`~batchfit.parallel.distributed.is_distributed`):

1. Nothing stops a step on one rank only, by design.
   - Tracked backends (cpu, estimate) do not abort at the limit at all: the search runs every
     probe to the end on every rank (:meth:`batchfit.memory.Backend.running_to_the_end`;
     shards are uneven, so with 3 ranks one rank crossed the limit mid-step where the others
     did not, and hung them), records each rank's peak, and the ranks then agree in one
     all-reduce (max of the peaks, "does not fit" on any rank). The verdict is exact: a
     probe fits when every rank's whole step stayed under the limit.
   - cuda cannot be told to go on: every rank's allocator is capped at the same limit
     (:meth:`batchfit.memory.Backend.capped`) and the search only runs a candidate whose peak
     the probes measured so far bound within it. A candidate is left unmeasured only when
     the measurements *prove* it: a lower bound above the device (any backend), or on cuda
     an upper bound above it (NOTE [ Skipped only when proven ] in
     :mod:`batchfit.budget.budget_search`). Never on a prediction of the fit: a larger probe's peak
     put on smaller candidates, or the whole peak scaled with the tokens, made real ranks
     find budgets 2.8× to 8.6× below one process's.
2. When a step does stop on one rank anyway (a real out-of-memory error, a bug, an
   interrupt), that rank says so at once in the default group's store: a key named after the
   search and the probe (:meth:`SearchGuard.signal`). The ranks waiting for it stop waiting:
   on gloo, ``Work.wait`` is what a waiting rank is in, and inside a search it waits in slices
   of :data:`POLL_SECONDS` and looks at the keys between them; it raises
   :class:`~batchfit.memory.base.RankRanOutOfMemory`, which
   :meth:`batchfit.memory.Backend.measure` counts as running out, so the step unwinds and its
   state is restored (NOTE [ Probes are isolated ]). On NCCL, ``wait`` does not block the
   host: a watcher thread aborts the model's communicator (``ProcessGroup.abort``). The keys,
   the polling wait and the watcher are :mod:`batchfit.parallel.rank_signals`' (NOTE [ Ranks
   signal through the store ]), shared with the training loop's guard
   (:mod:`batchfit.train.micro_batch_guard`).
3. Every rank learns the verdict before anyone enters another collective of that model: the
   probe ends in one all-reduce on the default group, which the abandoned collective did not
   touch. A model group left with a collective one rank never entered is never used again:
   the search stops with one :class:`~batchfit.errors.ProbeAbandoned` on every rank (or the
   failing rank's own error there and a :class:`~batchfit.errors.BatchfitError` elsewhere).
   A rank that ran out after the step's last collective (the optimizer step) left nothing
   behind: that candidate simply does not fit and the search goes on.
4. Every budget search begins by joining (:meth:`SearchGuard.join`; ``find_batch_size``'s
   trials do not communicate, so its per-trial agreement is its guard): each rank writes a store key
   carrying the search's tag (``find_token_budget(role='policy')``) and its number on that
   rank, and waits for the others' at most :func:`~batchfit.parallel.distributed.search_timeout`.
   A rank that skipped the search, or is in another one, is named on every rank. The model
   every rank shards is compared the same way before its first collective
   (:func:`batchfit.parallel.shard.check_same_model`: config and parameter shapes), so ranks
   that built different models fail with one line naming what differs instead of a
   collective mismatch. Through the store, not a collective: a rank that failed before it
   cannot pair its own agreement with it (:func:`~batchfit.parallel.distributed.gather_through_store`).
5. Every way out of a search that is not agreed (an exception raised on one rank outside
   the agreements, ``KeyboardInterrupt`` or ``SystemExit`` anywhere) sets the search's
   ``left`` key before it propagates (:meth:`SearchGuard.running`); every other rank's next
   wait (in a step or in an agreement) raises :class:`RankLeftSearch`, and the groups that
   wait was in are not used again: the run is over. At the agreement points (each probe, the
   setup) ``BaseException`` is caught, agreed on and re-raised on its own rank, the others
   raising a :class:`~batchfit.errors.BatchfitError` naming it. A rank killed
   outright closes its connections (gloo: the collective fails, naming the lost rank), and
   what waits outside Python (DDP's reducer) is bounded by the process group's timeout, one
   setting for every group (:func:`~batchfit.parallel.distributed.collective_timeout`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from batchfit.errors import BatchfitError
from batchfit.memory.base import RankRanOutOfMemory
from batchfit.memory.tracker import WORK_WAIT
from batchfit.parallel.distributed import gather_through_store, is_agreed, mark_agreed
from batchfit.parallel.rank_signals import (
    POLL_SECONDS,
    RankSignals,
    aborting_nccl,
    install_polling_wait,
    listening,
    ranks_tag,
)
from batchfit.parallel.shard import model_groups

__all__ = ["POLL_SECONDS", "RankLeftSearch", "SearchGuard", "guarded_search"]

# NOTE [ Ranks signal through the store ] in batchfit.parallel.rank_signals: the keys, the
# polling Work.wait and the NCCL watcher this guard uses, shared with the training loop's guard
install_polling_wait(WORK_WAIT)

_counters: dict[tuple[int, ...], Any] = {}  # the searches of each set of ranks, counted on every rank alike


class RankLeftSearch(BatchfitError):
    """Another rank left the search without the others (an error of its own, an interrupt): this rank stops too."""


class _Probe:
    """One guarded probe: its index, what it measures, whether this rank abandoned a collective."""

    def __init__(self, signals: RankSignals, index: int, what: str):
        self.signals, self.index, self.what = signals, index, what
        self.abandoned = False

    def failed_rank(self) -> int | None:
        return self.signals.failed_rank(self.index)


def _agreed(exc: BaseException) -> bool:
    return is_agreed(exc) or isinstance(exc, RankLeftSearch)


class SearchGuard:
    """The guard of one search on real ranks (NOTE [ One rank runs out ]).

    Made by :func:`guarded_search` on every rank, in the same order. Inside it, each probe
    runs in ``with guard.probe(index, what) as p: measure(...)`` with the same ``index`` on
    every rank; a rank whose measurement stopped early calls :meth:`signal`; ``p.abandoned``
    says whether this rank gave up a collective because another rank ran out.
    """

    def __init__(self, ranks: list[int], rank: int, tag: str) -> None:
        self.ranks, self.rank, self.tag = ranks, rank, tag
        self.number = next(_counters.setdefault(tuple(ranks), itertools.count()))
        self.search = f"{ranks_tag(ranks)}/{self.number}"
        self._signals = RankSignals(f"batchfit/search/{self.search}", "probe")
        self._probe: _Probe | None = None

    # ----------------------------------------------------------------- joining
    def join(self) -> None:
        """Wait (at most :func:`~batchfit.parallel.distributed.search_timeout`) until every rank has started this search, the same one.

        Raises:
            BatchfitError: naming the ranks that did not start it in time, or the ranks that
                are in another search (a different tag), on every rank.
        """
        tags = gather_through_store(
            f"search/{self.search}/join", self.tag, what=f"search {self.number} ({self.tag})", ranks=self.ranks
        )
        if len(set(tags.values())) > 1:
            detail = ", ".join(f"rank {r} is in {t}" for r, t in sorted(tags.items()))
            raise mark_agreed(BatchfitError(
                f"the ranks are in different searches (search {self.number} of each): {detail}; every rank must run "
                "the same searches in the same order"
            ))

    # ----------------------------------------------------------------- leaving
    def check(self) -> None:
        """Raise if another rank left this search, or ran out of memory in this rank's current probe."""
        probe = self._probe
        if probe is not None:
            failed = probe.failed_rank()
            if failed is not None:
                probe.abandoned = True
                raise RankRanOutOfMemory(failed, probe.what)
        left = self._signals.left()
        if left is not None and left[0] != self.rank:
            rank, why = left
            raise RankLeftSearch(
                f"rank {rank} left {self.tag} alone ({why}); rank {self.rank} stops too (see rank {rank}'s error)"
            )

    def leave(self, exc: BaseException) -> None:
        """This rank leaves the search with ``exc``, which the others do not know of: tell them."""
        self._signals.leave(self.rank, exc)

    @contextlib.contextmanager
    def running(self) -> Iterator[SearchGuard]:
        """The search's body: waits poll the store; a way out that is not agreed is announced (NOTE above)."""
        with WORK_WAIT.active(), listening(self.check):
            try:
                yield self
            except BaseException as exc:
                if not _agreed(exc):
                    self.leave(exc)
                raise

    # ----------------------------------------------------------------- probes
    @contextlib.contextmanager
    def probe(self, index: int, what: str) -> Iterator[_Probe]:
        """Guard one probe: waits give up and NCCL communicators are aborted when another rank runs out."""
        probe = _Probe(self._signals, index, what)

        def abandon() -> None:
            probe.abandoned = True

        self._probe = probe
        try:
            with aborting_nccl(lambda: probe.failed_rank() is not None, model_groups(), abandon):
                yield probe
        finally:
            self._probe = None

    def signal(self, index: int) -> None:
        """This rank left probe ``index`` early (out of memory, an error): tell the others at once."""
        self._signals.signal(index, self.rank)

    def forget(self, index: int) -> None:
        """Drop probe ``index``'s key once every rank has agreed on it."""
        self._signals.forget(index)


@contextlib.contextmanager
def guarded_search(tag: str, group: Any = None) -> Iterator[SearchGuard | None]:
    """Run one search's body guarded on real ranks (NOTE [ One rank runs out ]); ``None`` elsewhere.

    Every rank of ``group`` must enter it, for the same search (``tag`` names it:
    ``"find_token_budget(role='policy')"``). On real ranks it joins first (bounded by
    :func:`~batchfit.parallel.distributed.search_timeout`), then yields the :class:`SearchGuard`
    inside which waits poll and a way out that is not agreed is announced.

    Raises:
        BatchfitError: a rank did not start the search in time, or started another one; inside,
            :class:`RankLeftSearch` when another rank left.
    """
    from batchfit.parallel.distributed import is_distributed

    if not is_distributed(group):
        yield None
        return
    import torch.distributed as dist

    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    guard = SearchGuard(ranks, dist.get_rank(), tag)
    guard.join()
    with guard.running():
        yield guard

