"""A guard around a trainer's micro-batches: each peak against its prediction, an out-of-memory recovered at a lower budget.

:class:`MicroBatchGuard` is made once per trained model, on every rank, and runs every
mini-batch of the loop (:meth:`MicroBatchGuard.mini_batch`) and what follows it
(:meth:`MicroBatchGuard.step`, :meth:`MicroBatchGuard.outside`)::

    guard = MicroBatchGuard(model, profile.train)          # a TokenBudget, or a token count
    for mini in mini_batches:
        guard.mini_batch(
            plan=lambda budget: plan_micro_batches(lengths, budget, dp_size=dp, cost="packed"),
            micro_batches=lambda plan: iter_micro_batches(mini, plan, rank, layout="packed"),
            run=lambda mb, plan: micro_batch_backward(model, mb, plan=plan, scale=dp),
        )
        guard.step(optimizer)

NOTE [ A micro-batch runs out ]
A micro-batch that runs out of memory (NOTE [ What the guard counts as out of memory ]) stops
the mini-batch on every rank; its partial gradients are dropped, the mini-batch is planned
again at a lower budget (NOTE [ The lowered budget ]) and runs again from its first
micro-batch; the lower budget holds for the rest of the run. The optimizer step that follows
is the one an uninterrupted run at the lower budget takes: the same plan, the same
micro-batches, accumulated from no gradient (the guard starts every mini-batch from gradients
that are ``None`` or zero, as ``zero_grad`` leaves them, and checks it). Nothing is applied
twice (no optimizer step runs between the attempts), nothing is lost (the attempt that
succeeds runs every micro-batch of the plan), and no rank waits in a collective another rank
will not enter. How, by what the model's collectives do inside a micro-batch:

- **A bare model** (one process, or ranks that synchronise by hand after the guard): the
  micro-batches run as :func:`~batchfit.train.accumulate` runs them; a failure is this
  process's own (on real ranks the agreement below tells the others).
- **DDP.** DDP talks inside a micro-batch only where it syncs: the backward's
  all-reduce (in C++, where no wait can listen), the forward's broadcast of buffers (the first
  forward after a synchronising backward) and, once, the rebuilt buckets' broadcast. So every
  micro-batch of the plan runs in ``no_sync()`` with the buffer broadcast off
  (``require_forward_param_sync = False``): no collective at all. At the end of the attempt
  the ranks agree in one all-reduce on the guard's own process group (each rank's figures:
  whether it ran out, where, the budget it proposes). When none ran out, every rank runs one
  more micro-batch, the plan's padding micro-batch (NOTE [ Pad rows cost one token ]: one
  token, a zero loss, every parameter in its graph) outside ``no_sync()``: DDP's own
  synchronising backward all-reduces the accumulated gradients (adding zeros: the bits of
  :func:`~batchfit.train.accumulate`'s last synchronising micro-batch), its forward broadcasts
  the buffers, and the buckets are rebuilt at that point, every rank there. Buffers are thus
  broadcast once per mini-batch, after its micro-batches instead of before them: the same for
  buffers that do not change (rotary frequencies), not for running statistics (BatchNorm).
  A rank that ran out learns nothing from the others until the agreement: they finish their
  micro-batches of the attempt (work thrown away), which costs no polling on the path that
  does not fail. DDP over one process runs the same way (with no agreement), so that no
  synchronising backward is ever left half done in DDP's reducer.
- **FSDP2 (and FSDP1) on real ranks** all-gather and reduce-scatter inside every micro-batch.
  The micro-batches run as :func:`~batchfit.train.accumulate` runs them, with every
  ``Work.wait`` listening to the store (NOTE [ Ranks signal through the store ] in
  :mod:`batchfit.parallel.rank_signals`): the rank that ran out sets the attempt's key and
  goes to the agreement; a rank waiting in a collective it will never complete gives it up
  (:class:`~batchfit.memory.base.RankRanOutOfMemory`) and goes there too (on NCCL a watcher
  thread aborts the model's communicators). A process group left with a collective that one
  rank never entered cannot be used again, and rebinding a sharded model to a new one is not
  done here: when any rank gave up a collective, every rank raises one
  :class:`RestartAtLowerBudget` naming the lowered budget to restart with (its
  ``token_budget``). When none did (the rank ran out after the last collective of the
  mini-batch), the group is whole and the mini-batch runs again, as under DDP. Without a
  failure the micro-batches are :func:`~batchfit.train.accumulate`'s, bit for bit.

Every attempt on real ranks ends in that one agreement, on a gloo group the guard makes for
itself at construction (every rank constructs its guards in the same order), never the model's:
an abandoned collective is left on the model's group alone. The agreement listens to the store
too, so a rank that left the loop elsewhere (an out-of-memory in the optimizer step, an error
between mini-batches inside :meth:`MicroBatchGuard.outside`) stops the others with one error
naming it instead of the process group's timeout. An error other than running out, on any
rank, is agreed on like a probe's (NOTE [ Ranks agree or say why ] in
:mod:`batchfit.parallel.distributed`): the rank re-raises its own, the others a
:class:`~batchfit.errors.BatchfitError` naming it. What runs outside a micro-batch (the
optimizer step, DDP's synchronising pass, any block in :meth:`MicroBatchGuard.outside`) is
not retried: an out-of-memory there is :class:`OutOfMemoryOutsideMicroBatch`.

NOTE [ What the guard counts as out of memory ]
:func:`batchfit.memory.is_out_of_memory` decides it (NOTE [ What counts as OOM ] in
:mod:`batchfit.memory.base`: ``torch.OutOfMemoryError``, cuBLAS's and CUDA's allocation
failures, the CPU allocator's), and the cpu backend's memory cap too
(:class:`~batchfit.memory.MemoryLimitExceeded`, raised by a capped
:class:`~batchfit.train.PeakTracker`); nothing else is caught. :class:`RankRanOutOfMemory`
is not this rank running out but learning that another did.

NOTE [ The lowered budget ]
Peak memory is affine in a micro-batch's tokens above what is held before it (parameters,
optimizer state, gradients: ``base``), so a micro-batch of cost ``c`` that needed at least
``needed`` bytes fits ``target`` bytes at a cost of ``c × (target − base) / (needed − base)``
tokens. The figures come from the failure itself: the cpu cap's ``reached`` and ``limit``; CUDA's
message, "Tried to allocate X … of which F is free … Of the allocated memory A is allocated by
PyTorch", gives ``needed = A + X`` and the limit ``A + F`` (what the allocator reserves beyond
what it allocated, the fragmentation it could not use, is left out); ``base`` is the bytes held
when the micro-batch started (the peak source's ``current_bytes``, 0 without one). The target
is the margin's share of that limit (``margin × limit``, the same share the budget was searched
under), or the guard's ``limit_bytes`` (a :class:`~batchfit.budget.TokenBudget`'s) when lower.
The new budget is that cost, rounded down, and strictly below ``c``; the ranks take the
smallest one proposed. ``needed`` is a lower bound (the allocation that failed, not the peak the
micro-batch would have reached), so an attempt at the new budget can run out again, further on:
it lowers again from its own figures, at most ``max_retries`` times per mini-batch. Without
figures (an error message that has none, no limit known) the fallback is half the failing
micro-batch's cost, said so in the log. A micro-batch of cost 1, or a base above the limit,
has nothing lower to go to: :class:`MicroBatchesDoNotFit`.

NOTE [ Drift ]
Each micro-batch's peak (one read of the peak source, :class:`~batchfit.train.DevicePeaks` on
CUDA) is compared with the prediction of the budget's memory model (``base + a·Σl + q·Σl²`` over
its sequences' lengths, packed; ``base + a·b·s + q·b·s²`` for ``b`` rows padded to ``s``). A peak
above the prediction by more than the margin's share (``peak > predicted × (2 − margin)``: 15%
with the default margin 0.85) is drift: the first one is logged once with its figures; later
ones are counted (:attr:`MicroBatchGuard.drift_count`) and marked in their records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from batchfit.errors import BatchError, BatchfitError, BudgetError, DoesNotFitError, InvalidArgument
from batchfit.memory import DEFAULT_SAFETY_MARGIN, MemoryLimitExceeded, is_out_of_memory
from batchfit.memory.base import RankRanOutOfMemory
from batchfit.memory.isolation import isolate
from batchfit.memory.tracker import WORK_WAIT
from batchfit.parallel.distributed import (
    agreed_max,
    get_rank,
    get_world_size,
    is_agreed,
    is_distributed,
    mark_agreed,
    search_timeout,
)
from batchfit.parallel.rank_signals import (
    RankSignals,
    aborting_nccl,
    install_polling_wait,
    listening,
    ranks_tag,
)
from batchfit.parallel.shard import model_groups
from batchfit.parallel.shard_state import zero_state
from batchfit.plan.packing import MicroBatchPlan
from batchfit.train.accumulate import _is_ddp, _is_fsdp, _is_fsdp1
from batchfit.train.measure import DevicePeaks
from batchfit.validation import check_int, check_number, check_positive_int, describe

__all__ = [
    "MicroBatchGuard",
    "MicroBatchRecord",
    "MicroBatchesDoNotFit",
    "MiniBatchRecord",
    "OutOfMemoryOutsideMicroBatch",
    "RankLeftTraining",
    "RestartAtLowerBudget",
    "Shortfall",
    "lowered_budget",
    "ran_out",
]

# NOTE [ Ranks signal through the store ]: the one polling layer, shared with the budget search
install_polling_wait(WORK_WAIT)

#: How many times one mini-batch may be planned again at a lower budget before the guard gives up.
DEFAULT_MAX_RETRIES = 3

_LOG = logging.getLogger(__name__)
_counters: dict[tuple[int, ...], Any] = {}  # the guards of each set of ranks, counted on every rank alike
_FIGURES = 10  # the integers each rank brings to an attempt's agreement (_Failure.row)


# ----------------------------------------------------------------------------- errors


class MicroBatchesDoNotFit(DoesNotFitError):
    """A mini-batch ran out of memory at every budget the guard tried, or at a budget it cannot go below.

    Raised on every rank by :meth:`MicroBatchGuard.mini_batch` after ``max_retries`` lowered
    budgets, or when the failing micro-batch costs one token or the memory held before it is
    above the limit (NOTE [ The lowered budget ]). ``budgets`` lists the budgets tried, in
    order; ``shortfalls`` the failures; ``needed`` and ``available`` are the last failure's bytes.
    """

    def __init__(self, message: str, *, budgets: Sequence[int], shortfalls: Sequence[Shortfall]):
        last = shortfalls[-1] if shortfalls else None
        super().__init__(
            message,
            needed=None if last is None else last.needed_bytes,
            available=None if last is None else last.limit_bytes,
        )
        self.budgets = tuple(budgets)
        self.shortfalls = tuple(shortfalls)


class OutOfMemoryOutsideMicroBatch(BatchfitError):
    """This rank ran out of memory outside a micro-batch (the optimizer step, a collective): not retried.

    Raised by :meth:`MicroBatchGuard.outside` (and :meth:`MicroBatchGuard.step`, and DDP's
    synchronising pass): lowering the token budget would change nothing there. On real ranks
    the others are told through the store; their next guarded wait raises
    :class:`RankLeftTraining`. ``what`` names the block; the out-of-memory error is the ``__cause__``.
    """

    def __init__(self, message: str, what: str):
        self.what = what
        super().__init__(message)


class RestartAtLowerBudget(BatchfitError):
    """A sharded model's micro-batch ran out of memory on one rank and another gave up a collective: restart lower.

    Raised on every rank by :meth:`MicroBatchGuard.mini_batch` under FSDP2 (or FSDP1) on real
    ranks (NOTE [ A micro-batch runs out ]): the model's process group holds a collective one
    rank never entered and cannot be used again. ``token_budget`` is the lowered budget to
    restart the run with; ``shortfall`` the failure that set it.
    """

    def __init__(self, message: str, token_budget: int, shortfall: Shortfall):
        self.token_budget = token_budget
        self.shortfall = shortfall
        super().__init__(message)


class RankLeftTraining(BatchfitError):
    """Another rank left the guarded loop without the others (an error outside a micro-batch): this rank stops too."""


# ----------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class MicroBatchRecord:
    """One micro-batch as it ran: its place, size, predicted and measured peak.

    Attributes:
        position: its index among the rank's micro-batches of the plan.
        rows: sequences in it (0 for a padding micro-batch).
        cost: its cost in the plan, in tokens.
        predicted_bytes: the budget's memory model's peak for it (``None``: no model, or no peak read).
        peak_bytes: its measured peak (``None``: no peak source).
        drift: the peak is above the prediction by more than the margin's share (NOTE [ Drift ]).
    """

    position: int
    rows: int
    cost: int
    predicted_bytes: int | None
    peak_bytes: int | None
    drift: bool = False

    @property
    def ratio(self) -> float | None:
        """``peak_bytes / predicted_bytes``, ``None`` when either is unknown."""
        if self.peak_bytes is None or not self.predicted_bytes:
            return None
        return self.peak_bytes / self.predicted_bytes


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """One micro-batch that ran out of memory, and the budget the guard went to (NOTE [ The lowered budget ]).

    Attributes:
        rank: the rank that ran out (when several did, the one whose proposal was the lowest).
        mini_batch: the guard's count of mini-batches when it happened (0 = the first).
        attempt: which attempt of that mini-batch (0 = the first).
        position, rows, cost: the micro-batch's place in its plan, its sequences and tokens.
        token_budget: the budget the attempt ran at.
        lowered_to: the budget agreed for what follows.
        needed_bytes, limit_bytes, base_bytes: the figures it was lowered by (``None``: unknown).
    """

    rank: int
    mini_batch: int
    attempt: int
    position: int
    rows: int
    cost: int
    token_budget: int
    lowered_to: int
    needed_bytes: int | None
    limit_bytes: int | None
    base_bytes: int | None

    def describe(self) -> str:
        """``"micro-batch 2 of mini-batch 5 (3 rows, 412 tokens) on rank 1"``."""
        return (
            f"micro-batch {self.position} of mini-batch {self.mini_batch} ({self.rows} rows, {self.cost:,} tokens) "
            f"on rank {self.rank}"
        )

    def figures(self) -> str:
        """The bytes it was lowered by, in words."""
        if self.needed_bytes is None or self.limit_bytes is None:
            return "the error gave no figures, so the budget went to half the micro-batch's cost"
        base = "" if self.base_bytes is None else f", {self.base_bytes:,} B held before it"
        return f"it needed at least {self.needed_bytes:,} B of a {self.limit_bytes:,} B limit{base}"


@dataclasses.dataclass(frozen=True)
class MiniBatchRecord:
    """What :meth:`MicroBatchGuard.mini_batch` ran: the attempt that succeeded and the failures before it.

    Attributes:
        index: the guard's count of mini-batches (0 = the first).
        token_budget: the budget the successful attempt ran at.
        micro_batches: that attempt's micro-batches (the synchronising pass of DDP not included).
        outputs: what ``run`` returned for each of them, in order.
        shortfalls: the failed attempts before it, in order (empty: none).
    """

    index: int
    token_budget: int
    micro_batches: tuple[MicroBatchRecord, ...]
    outputs: tuple[Any, ...]
    shortfalls: tuple[Shortfall, ...] = ()

    @property
    def retried(self) -> bool:
        """The mini-batch ran more than once."""
        return bool(self.shortfalls)

    @property
    def peak_bytes(self) -> int | None:
        """The largest micro-batch peak of the successful attempt (``None``: no peak source)."""
        peaks = [m.peak_bytes for m in self.micro_batches if m.peak_bytes is not None]
        return max(peaks) if peaks else None


# ----------------------------------------------------------------------------- pure parts


def ran_out(exc: BaseException) -> bool:
    """True when ``exc`` is this process running out of memory (NOTE [ What the guard counts as out of memory ])."""
    if isinstance(exc, MemoryLimitExceeded):
        return True
    return is_out_of_memory(exc) and not isinstance(exc, RankRanOutOfMemory)


_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|B|KiB|MiB|GiB|TiB)"


def _size(match: re.Match[str] | None) -> int | None:
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def cuda_oom_figures(message: str) -> tuple[int | None, int | None, int | None]:
    """``(requested, free, allocated)`` bytes from a CUDA out-of-memory message (``None`` where it has none).

    Reads PyTorch's caching allocator's message ("Tried to allocate 2.00 GiB. GPU 0 has a total
    capacity of 79.19 GiB of which 1.06 GiB is free. … Of the allocated memory 75.02 GiB is
    allocated by PyTorch, …") and its older form ("… 130.35 MiB already allocated; 47.06 MiB
    free; …"). The sizes are rounded there to two decimals of their unit.

    Example:
        >>> cuda_oom_figures("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        ...                  "8.00 GiB of which 0 bytes is free. Of the allocated memory 7.50 GiB is allocated by PyTorch")
        (20971520, 0, 8053063680)
    """
    requested = _size(re.search(rf"Tried to allocate {_SIZE}", message))
    free = _size(re.search(rf"of which {_SIZE} is free", message) or re.search(rf"{_SIZE} free", message))
    allocated = _size(
        re.search(rf"Of the allocated memory {_SIZE} is allocated by PyTorch", message)
        or re.search(rf"{_SIZE} already allocated", message)
    )
    return requested, free, allocated


def lowered_budget(
    cost: int, *, needed: int, limit: int, base: int = 0, margin: float = DEFAULT_SAFETY_MARGIN
) -> int | None:
    """The budget at which a micro-batch of ``cost`` tokens that needed ``needed`` bytes fits (NOTE [ The lowered budget ]).

    ``cost × (target − base) / (needed − base)`` rounded down, at most ``cost − 1``, with
    ``target = margin × limit`` (``limit`` itself when the margin's share is not above
    ``base``). Complexity O(1).

    Returns:
        The new budget, ``>= 1``; ``None`` when there is nothing lower to go to (``cost`` is 1,
        or ``base`` is not below ``limit``).

    Example:
        >>> # 1,000 tokens needed 900 MB above a 100 MB base; 0.85 x 800 MB = 680 MB -> 1000 x 580 / 800 = 725
        >>> lowered_budget(1000, needed=900_000_000, limit=800_000_000, base=100_000_000, margin=0.85)
        725
    """
    if cost <= 1 or limit <= base:
        return None
    target = margin * limit
    if target <= base:
        target = limit
    tokens = cost - 1 if needed <= base else math.floor(cost * (target - base) / (needed - base))
    return max(1, min(cost - 1, tokens))


@runtime_checkable
class BudgetLike(Protocol):
    """What the guard reads from a :class:`~batchfit.budget.TokenBudget` (the budget layer sits above ``train``)."""

    tokens: int
    memory_model: Any
    safety_margin: float
    limit_bytes: int


class PeakSource(Protocol):
    """Where the guard reads a micro-batch's peak: :class:`~batchfit.train.PeakTracker`, :class:`~batchfit.train.DevicePeaks`."""

    @property
    def current_bytes(self) -> int: ...

    def take(self) -> int: ...


def memory_model_predictor(memory_model: Any) -> Callable[[np.ndarray, str], float]:
    """``predict(lengths, cost)``: the peak of a micro-batch of those sequences by a fitted memory model (NOTE [ Drift ]).

    ``memory_model`` has ``base``, ``linear`` and ``quadratic`` (a
    :class:`~batchfit.budget.MemoryModel`): packed, ``base + a·Σl + q·Σl²``; padded, ``b``
    rows of the longest ``s``: ``base + a·b·s + q·b·s²``.
    """
    base = float(memory_model.base)
    linear, quadratic = float(memory_model.linear), float(memory_model.quadratic)

    def predict(lengths: np.ndarray, cost: str) -> float:
        if lengths.size == 0:
            return base + linear + quadratic  # a pad row: one token
        if cost == "packed":
            return (
                base
                + linear * float(lengths.sum())
                + quadratic * float((lengths.astype(np.float64) ** 2).sum())
            )
        longest = float(lengths.max())
        return base + lengths.size * longest * (linear + quadratic * longest)

    return predict


# ----------------------------------------------------------------------------- the guard


def _wrapping(model: torch.nn.Module) -> str:
    """``"ddp"``, ``"sharded"`` (collectives inside every micro-batch) or ``"bare"``."""
    if _is_ddp(model):
        return "ddp"
    if _is_fsdp(model) or _is_fsdp1(model) or zero_state(model) is not None:
        return "sharded"
    return "bare"


def _own_groups(model: torch.nn.Module) -> list[Any]:
    """The process groups ``model``'s collectives run on (FSDP2's mesh, DDP's or FSDP1's group), as far as known."""
    groups: list[Any] = []
    group = getattr(model, "process_group", None)
    if group is not None:
        groups.append(group)
    if _is_fsdp(model):
        from torch.distributed.tensor import DTensor

        for param in model.parameters():
            if isinstance(param, DTensor):
                mesh = param.device_mesh
                groups += [mesh.get_group(dim) for dim in range(mesh.ndim)]
                break
    return groups


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclasses.dataclass
class _Failure:
    """This rank's failure in one attempt: where, and the figures it proposes a budget from."""

    position: int
    rows: int
    cost: int
    proposal: int | None  # None: nothing lower (MicroBatchesDoNotFit)
    needed: int | None
    limit: int | None
    base: int | None

    def row(self, learned: bool) -> list[int]:
        def plus_one(value: int | None) -> int:
            return 0 if value is None else value + 1

        return [1, self.position, self.rows, self.cost, self.proposal or 0, plus_one(self.needed),
                plus_one(self.limit), plus_one(self.base), int(learned), int(self.proposal is None)]  # fmt: skip


def _unpack(row: Sequence[int]) -> _Failure:
    def minus_one(value: int) -> int | None:
        return None if value == 0 else int(value) - 1

    return _Failure(
        position=int(row[1]),
        rows=int(row[2]),
        cost=int(row[3]),
        proposal=None if row[9] else int(row[4]),
        needed=minus_one(row[5]),
        limit=minus_one(row[6]),
        base=minus_one(row[7]),
    )


@dataclasses.dataclass
class _Attempt:
    """One attempt's outcome on this rank."""

    plan: MicroBatchPlan | None = None
    records: list[MicroBatchRecord] = dataclasses.field(default_factory=list)
    outputs: list[Any] = dataclasses.field(default_factory=list)
    failure: _Failure | None = None
    learned: bool = False  # gave up a wait because another rank ran out
    error: BaseException | None = None
    pending: Iterator[Any] | None = None  # the micro-batches not yet drawn (DDP: the synchronising one)
    snapshot: Any = None  # what isolate() took before it (NOTE [ Probes are isolated ])


class MicroBatchGuard:
    """Runs a trainer's mini-batches so that running out of memory in a micro-batch lowers the budget instead of crashing.

    NOTE [ A micro-batch runs out ] (the protocol, per strategy), [ The lowered budget ],
    [ Drift ]. Make one per trained model, on every rank, in the same order; call
    :meth:`mini_batch` for every mini-batch on every rank, then the optimizer step through
    :meth:`step` (or inside :meth:`outside`).

    Args:
        model: the trained model, bare, DDP, FSDP2 (or FSDP1), as its micro-batches run it.
        token_budget: the budget to start from: a token count, or a
            :class:`~batchfit.budget.TokenBudget` (its ``tokens``; its memory model predicts
            each micro-batch's peak, its ``safety_margin`` is the margin, its ``limit_bytes``
            the bytes a lowered budget aims under).
        predict: ``predict(lengths, cost) -> bytes``, a micro-batch's predicted peak from its
            sequences' lengths (a numpy array) and the plan's cost; default the budget's memory
            model (:func:`memory_model_predictor`), else none (no drift is reported).
        margin: the share of the limit a micro-batch may reach, in ``(0, 1]``: drift is a peak
            above ``predicted × (2 − margin)``, and a lowered budget aims at ``margin × limit``.
            Default the budget's ``safety_margin``, else :data:`~batchfit.memory.DEFAULT_SAFETY_MARGIN`.
        limit_bytes: the bytes a lowered budget aims under at most (default the budget's
            ``limit_bytes``; ``None``: the limit each failure reports, times ``margin``).
        peaks: where each micro-batch's peak is read: ``"auto"`` (:class:`~batchfit.train.DevicePeaks`
            for a model on CUDA, else none), ``None``, or an object with ``take()`` and
            ``current_bytes`` (a :class:`~batchfit.train.PeakTracker`, entered by the caller;
            with ``limit_bytes`` it is the cpu backend's cap, a second way to run out).
        max_retries: lowered budgets one mini-batch may try before :class:`MicroBatchesDoNotFit`.
        rank: this process' data-parallel rank in the plans (default: 0 for a plan of one rank,
            the process' rank for a plan over every rank).
        group: the process group the ranks agree on; default one the guard makes (gloo, every
            rank). Never one the model's collectives use.
        logger: where the lowered budgets and the first drift are logged (default this module's).

    Attributes:
        token_budget: the budget now (lowered ones hold for the rest of the run).
        shortfalls: every failure so far, in order.
        drift_count: micro-batches whose peak drifted above the prediction (NOTE [ Drift ]).
        first_drift: ``(mini-batch index, record)`` of the first one, ``None`` if none.

    Raises:
        InvalidArgument: a bad argument (named, with its value).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        token_budget: int | BudgetLike,
        *,
        predict: Callable[[np.ndarray, str], float] | None = None,
        margin: float | None = None,
        limit_bytes: int | None = None,
        peaks: Any = "auto",
        max_retries: int = DEFAULT_MAX_RETRIES,
        rank: int | None = None,
        group: Any = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(
                f"model must be a torch.nn.Module (the trained model), but got model={describe(model)}"
            )
        budget = (
            token_budget
            if isinstance(token_budget, BudgetLike) and not isinstance(token_budget, int)
            else None
        )
        tokens = budget.tokens if budget is not None else token_budget
        self.token_budget = check_positive_int("token_budget", tokens)
        if predict is None and budget is not None and budget.memory_model is not None:
            predict = memory_model_predictor(budget.memory_model)
        if predict is not None and not callable(predict):
            raise InvalidArgument(
                f"predict must be a function predict(lengths, cost) -> bytes, or None, but got predict={describe(predict)}"
            )
        self._predict = predict
        if margin is None:
            margin = budget.safety_margin if budget is not None else DEFAULT_SAFETY_MARGIN
        self.margin = check_number("margin", margin, low=0.0, high=1.0, low_open=True)
        if limit_bytes is None and budget is not None:
            limit_bytes = budget.limit_bytes
        self.limit_bytes = None if limit_bytes is None else check_positive_int("limit_bytes", limit_bytes)
        self.max_retries = check_int("max_retries", max_retries, minimum=0)
        self.rank = None if rank is None else check_int("rank", rank, minimum=0)
        self.peaks = self._peak_source(model, peaks)
        self.model = model
        self._params = [p for p in model.parameters() if p.requires_grad]  # read once: the model keeps them
        self._kept: set[int] = set()  # the parameters whose gradient was allocated (zero) at the mini-batch's start
        self.wrapping = _wrapping(model)
        self.logger = logger if logger is not None else _LOG
        self.shortfalls: list[Shortfall] = []
        self.drift_count = 0
        self.first_drift: tuple[int, MicroBatchRecord] | None = None
        self._mini_batches = 0
        self._distributed = is_distributed()
        self._group = group
        self._signals: RankSignals | None = None
        self._attempt_key: str | None = None
        self._failed_wait = False
        self._learned_any = False  # a rank gave up a collective in the last attempt agreed on
        self._me, self._world = get_rank(), get_world_size()
        if self._distributed:
            self._join(group)

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _peak_source(model: torch.nn.Module, peaks: Any) -> Any:
        if isinstance(peaks, str):
            if peaks != "auto":
                raise InvalidArgument(
                    f"peaks must be 'auto', None, or an object with take() and current_bytes (a PeakTracker, "
                    f"DevicePeaks), but got peaks={peaks!r}"
                )
            device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
            return DevicePeaks(device) if device is not None else None
        if peaks is not None and not (
            callable(getattr(peaks, "take", None)) and hasattr(peaks, "current_bytes")
        ):
            raise InvalidArgument(
                "peaks must be 'auto', None, or an object with take() and current_bytes (a PeakTracker, DevicePeaks), "
                f"but got peaks={describe(peaks)}"
            )
        return peaks

    def _join(self, group: Any) -> None:
        import torch.distributed as dist

        ranks = list(range(self._world))
        if group is None:  # NOTE [ A micro-batch runs out ]: the agreement never uses the model's group
            group = dist.new_group(ranks, backend="gloo", timeout=search_timeout())
        elif any(group is g for g in _own_groups(self.model)):
            raise InvalidArgument(
                "group must be a process group the model's collectives do not use (the ranks agree there after one "
                "gave up a collective of the model's), but got the model's own group; pass group=None"
            )
        self._group = group
        number = next(_counters.setdefault(tuple(ranks), itertools.count()))
        self._signals = RankSignals(f"batchfit/train/{ranks_tag(ranks)}/{number}", "attempt")

    # ------------------------------------------------------------------ listening (NOTE [ A micro-batch runs out ])
    def _check_attempt(self) -> None:
        """In a collective of the model's: give it up when another rank ran out in this attempt, or left."""
        signals, key = self._signals, self._attempt_key
        if signals is not None and key is not None:
            failed = signals.failed_rank(key)  # type: ignore[arg-type]
            if failed is not None and failed != self._me:
                self._failed_wait = True
                raise RankRanOutOfMemory(failed, f"attempt {key} of a guarded mini-batch")
        self._check_left()

    def _check_left(self) -> None:
        """In any guarded wait: stop when another rank left the loop without the others."""
        if self._signals is None:
            return
        left = self._signals.left()
        if left is not None and left[0] != self._me:
            rank, why = left
            raise RankLeftTraining(
                f"rank {rank} left the guarded training loop ({why}); rank {self._me} stops too (see rank {rank}'s error)"
            )

    @contextlib.contextmanager
    def _listening(self, check: Callable[[], None]) -> Iterator[None]:
        if not self._distributed:
            yield
            return
        with WORK_WAIT.active(), listening(check):
            yield

    def _leave(self, exc: BaseException) -> None:
        if self._signals is not None and not is_agreed(exc) and not isinstance(exc, RankLeftTraining):
            self._signals.leave(self._me, exc)

    # ------------------------------------------------------------------ outside a micro-batch
    @contextlib.contextmanager
    def outside(self, what: str) -> Iterator[None]:
        """A block outside the micro-batches (the optimizer step, a collective): an out-of-memory there is not retried.

        Raises:
            OutOfMemoryOutsideMicroBatch: the block ran out of memory (its error the ``__cause__``).
                On real ranks the others are told (their next guarded wait raises
                :class:`RankLeftTraining`), as they are of any other error that leaves the block.
        """
        try:
            yield
        except BaseException as exc:
            if ran_out(exc):
                error = OutOfMemoryOutsideMicroBatch(
                    f"rank {self._me} ran out of memory in {what}, outside a micro-batch, so a lower token budget "
                    f"(now {self.token_budget:,}) would not help and it is not retried: {_first_line(exc)}",
                    what,
                )
                self._leave(error)
                raise error from exc
            self._leave(exc)
            raise

    def step(self, optimizer: torch.optim.Optimizer, *, zero_grad: bool = True) -> None:
        """``optimizer.step()`` then ``optimizer.zero_grad(set_to_none=True)``, inside :meth:`outside`."""
        with self.outside("the optimizer step"):
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ one mini-batch
    def mini_batch(
        self,
        plan: Callable[[int], MicroBatchPlan],
        micro_batches: Callable[[MicroBatchPlan], Iterable[Any]],
        run: Callable[[Any, MicroBatchPlan], Any],
        *,
        peaks: Any = "guard",
    ) -> MiniBatchRecord:
        """Run one mini-batch's micro-batches at the current budget, lowering it and running again when one runs out.

        Every rank calls it for every mini-batch. The gradients it leaves are the mini-batch's,
        synchronised as ``accumulate`` leaves them; run the optimizer step next (:meth:`step`).

        Args:
            plan: ``plan(token_budget)``: the mini-batch's :class:`~batchfit.plan.MicroBatchPlan` at
                that budget (e.g. ``plan_micro_batches(lengths, token_budget, dp_size=dp)``); called
                again after a failure, with the lower budget.
            micro_batches: ``micro_batches(plan)``: this rank's micro-batches of ``plan``, in order
                (e.g. ``iter_micro_batches(mini, plan, rank)``); under DDP the plan has one
                padding micro-batch more than ``plan`` gave, the synchronising pass (NOTE above).
            run: ``run(micro_batch, plan)``: its forward and backward (e.g.
                ``micro_batch_backward(model, mb, plan=plan, scale=dp)``); what it returns is kept
                in the record's ``outputs``. It must run a padding micro-batch too (zero loss).
            peaks: this call's peak source instead of the guard's (as the ``peaks`` argument).

        Returns:
            The :class:`MiniBatchRecord` of the attempt that succeeded.

        Raises:
            MicroBatchesDoNotFit: it ran out at every budget tried (``max_retries`` lowered ones),
                or at one it cannot go below.
            RestartAtLowerBudget: a sharded model on real ranks, a collective given up (NOTE above).
            BatchError: ``micro_batches`` gave another count than the plan; gradients that are
                neither ``None`` nor zero at the start.
            InvalidArgument: ``plan`` returned no plan, or one above the budget it was given.
            Whatever ``run`` raises that is not running out of memory (on every rank: this
            rank's own, a :class:`~batchfit.errors.BatchfitError` naming it elsewhere).
        """
        source = (
            self.peaks
            if isinstance(peaks, str) and peaks == "guard"
            else self._peak_source(self.model, peaks)
        )
        index = self._mini_batches
        self._mini_batches += 1
        try:
            self._check_fresh_gradients(index)
            shortfalls: list[Shortfall] = []
            budgets = [self.token_budget]
            while True:
                attempt = self._attempt(index, len(shortfalls), plan, micro_batches, run, source)
                figures = self._agree(index, len(shortfalls), attempt)
                if not figures:
                    record = MiniBatchRecord(
                        index,
                        self.token_budget,
                        tuple(attempt.records),
                        tuple(attempt.outputs),
                        tuple(shortfalls),
                    )
                    if attempt.pending is not None:  # DDP: NOTE [ A micro-batch runs out ]
                        self._synchronise(attempt, run)
                    return record
                self._drop(attempt)
                del attempt
                shortfall = self._lower(index, len(shortfalls), figures, shortfalls, budgets)
                shortfalls.append(shortfall)
                budgets.append(self.token_budget)
        except BaseException as exc:
            self._leave(exc)
            raise

    def _check_fresh_gradients(self, index: int) -> None:
        """Every trainable parameter's gradient is ``None`` or zero (NOTE [ A micro-batch runs out ]), else BatchError.

        Remembers which are allocated (zero): a failed attempt leaves those zero, the others ``None``.
        """
        self._kept = {id(p) for p in self._params if p.grad is not None}
        for p in self._params:
            if p.grad is not None and bool((_local(p.grad) != 0).any()):
                name = next((n for n, q in self.model.named_parameters() if q is p), "a parameter")
                raise BatchError(
                    f"MicroBatchGuard.mini_batch starts each mini-batch from no gradient, but {name} holds a non-zero "
                    f"gradient before mini-batch {index}; call optimizer.zero_grad() (or guard.step(optimizer)) after "
                    "each optimizer step, and accumulate one optimizer step's micro-batches in one mini_batch call"
                )

    def _plan(self, plan: Callable[[int], MicroBatchPlan], budget: int, lowered: bool) -> MicroBatchPlan:
        try:
            got = plan(budget)
        except BudgetError as exc:
            if not lowered:
                raise
            raise MicroBatchesDoNotFit(
                f"the mini-batch cannot be planned at the lowered token_budget={budget:,} ({exc}); plan with "
                "oversize='split' (a sequence over the budget runs in chunks with the same gradient) or 'alone'",
                budgets=[budget],
                shortfalls=self.shortfalls[-1:],
            ) from exc
        if not isinstance(got, MicroBatchPlan):
            raise InvalidArgument(
                f"plan(token_budget) must return a MicroBatchPlan (plan_micro_batches(...)), but plan({budget}) "
                f"returned {describe(got)}"
            )
        if got.token_budget > budget:
            raise InvalidArgument(
                f"plan(token_budget) must plan at the budget it is given, but plan({budget}) returned a plan with "
                f"token_budget={got.token_budget}; pass the argument to plan_micro_batches"
            )
        return got

    def _plan_rank(self, plan: MicroBatchPlan) -> int:
        if self.rank is not None:
            if self.rank >= plan.dp_size:
                raise InvalidArgument(
                    f"rank must be a data-parallel rank of the plan, in [0, {plan.dp_size}), but got rank={self.rank}"
                )
            return self.rank
        if plan.dp_size == 1:
            return 0
        if plan.dp_size == self._world:
            return self._me
        raise InvalidArgument(
            f"the plan is dealt over dp_size={plan.dp_size} ranks, neither 1 nor the {self._world} processes: pass "
            "MicroBatchGuard(rank=...) this process' data-parallel rank"
        )

    def _attempt(
        self,
        index: int,
        attempt_number: int,
        plan_fn: Callable[[int], MicroBatchPlan],
        micro_batches: Callable[[MicroBatchPlan], Iterable[Any]],
        run: Callable[[Any, MicroBatchPlan], Any],
        source: Any,
    ) -> _Attempt:
        out = _Attempt()
        ddp = self.wrapping == "ddp"  # one process too: no synchronising backward is ever left half done
        listens = self._distributed and self.wrapping == "sharded"
        self._attempt_key = f"{index}.{attempt_number}" if self._distributed else None
        self._failed_wait = False
        if self.wrapping == "sharded":  # NOTE [ Probes are isolated ]: the FSDP state put back if it fails
            out.snapshot = isolate(self.model)
        try:
            with contextlib.ExitStack() as stack:
                if listens:
                    stack.enter_context(self._listening(self._check_attempt))
                    stack.enter_context(
                        aborting_nccl(
                            lambda: self._signals.failed_rank(self._attempt_key) not in (None, self._me),  # type: ignore[union-attr,arg-type]
                            [*model_groups(), *_own_groups(self.model)],
                            lambda: setattr(self, "_failed_wait", True),
                        )
                    )
                plan = self._plan(plan_fn, self.token_budget, lowered=bool(self.shortfalls))
                count = plan.num_micro_batches
                if ddp:
                    plan = plan.pad_to(count + 1)  # the synchronising pass: NOTE [ A micro-batch runs out ]
                    stack.enter_context(self.model.no_sync())
                    self.model.require_forward_param_sync = False  # no buffer broadcast in the micro-batches
                out.plan = plan
                r = self._plan_rank(plan)
                items = iter(micro_batches(plan))
                if source is not None:
                    source.take()  # the first micro-batch's peak starts here
                for k in range(count):
                    start = source.current_bytes if source is not None else None
                    try:
                        mb = next(items, _END)
                        if mb is _END:
                            raise BatchError(
                                f"micro_batches(plan) gave {k} micro-batches but the plan has {plan.num_micro_batches}; "
                                "yield every micro-batch of the plan it is given (iter_micro_batches(batch, plan, rank))"
                            )
                        result = run(mb, plan)  # DDP inside no_sync(); FSDP2 and FSDP1 sync, as accumulate runs them
                        del mb
                    except BaseException as exc:
                        if ran_out(exc):
                            out.failure = self._failure(exc, plan, r, k, start, source)
                        elif isinstance(exc, RankRanOutOfMemory):
                            out.learned = True
                        else:
                            raise
                        break
                    out.outputs.append(result)
                    out.records.append(self._record(index, plan, r, k, source))
                if out.failure is None and not out.learned:
                    if ddp:
                        out.pending = items
                    elif next(items, _END) is not _END:
                        raise BatchError(
                            f"micro_batches(plan) gave more micro-batches than the plan's {count}; yield the micro-batches "
                            "of the plan it is given"
                        )
        except BaseException as exc:  # an interrupt too: agreed on, then re-raised on this rank
            out.error = exc
        if (out.failure is not None or out.error is not None) and listens and self._signals is not None:
            self._signals.signal(self._attempt_key, self._me)  # type: ignore[arg-type]  # the others stop waiting
        out.learned = out.learned or self._failed_wait
        return out

    def _failure(
        self, exc: BaseException, plan: MicroBatchPlan, r: int, k: int, start: int | None, source: Any
    ) -> _Failure:
        """This rank's figures for the micro-batch that ran out (NOTE [ The lowered budget ])."""
        indices, cost = plan.ranks[r][k], int(plan.costs[r][k])
        needed = limit = None
        if isinstance(exc, MemoryLimitExceeded):
            needed, limit = int(exc.reached), int(exc.limit)
        else:
            requested, free, allocated = cuda_oom_figures(str(exc))
            if allocated is None and source is not None:
                allocated = int(
                    source.current_bytes
                )  # the failed micro-batch's frames still hold their tensors
            if requested is not None and allocated is not None:
                needed = allocated + requested
                if free is not None:
                    limit = allocated + free
        if self.limit_bytes is not None:  # the target is then at most limit_bytes
            own = math.ceil(self.limit_bytes / self.margin)
            limit = own if limit is None else min(limit, own)
        if needed is not None and limit is not None:
            proposal = lowered_budget(cost, needed=needed, limit=limit, base=start or 0, margin=self.margin)
        else:
            proposal = max(1, cost // 2) if cost > 1 else None  # no figures: NOTE [ The lowered budget ]
        return _Failure(k, len(indices), cost, proposal, needed, limit, start)

    def _record(self, index: int, plan: MicroBatchPlan, r: int, k: int, source: Any) -> MicroBatchRecord:
        indices, cost = plan.ranks[r][k], int(plan.costs[r][k])
        if source is None:
            return MicroBatchRecord(k, len(indices), cost, None, None)
        peak = int(source.take())
        predicted = None
        if self._predict is not None:
            predicted = int(self._predict(plan.lengths[list(indices)], plan.cost))
        drift = predicted is not None and predicted > 0 and peak > predicted * (2.0 - self.margin)
        record = MicroBatchRecord(k, len(indices), cost, predicted, peak, drift)
        if drift:
            self.drift_count += 1
            if self.first_drift is None:
                self.first_drift = (index, record)
                self.logger.warning(
                    "batchfit: micro-batch %d of mini-batch %d (%d rows, %s tokens) peaked at %s B, %.1f%% above the "
                    "%s B its budget's memory model predicts (more than the margin's %.0f%%); later drifts are only "
                    "counted (MicroBatchGuard.drift_count)",
                    k, index, len(indices), f"{cost:,}", f"{peak:,}", 100 * (peak / predicted - 1), f"{predicted:,}",
                    100 * (1 - self.margin),
                )  # fmt: skip
        return record

    # ------------------------------------------------------------------ agreeing and recovering
    def _agree(self, index: int, attempt_number: int, attempt: _Attempt) -> list[_Failure | None]:
        """Every rank's failure of this attempt (empty when none ran out); errors are agreed on and raised."""
        failure = attempt.failure
        if not self._distributed:
            if attempt.error is not None:
                raise attempt.error
            return [failure] if failure is not None else []
        row = (
            failure.row(attempt.learned)
            if failure is not None
            else [0] * (_FIGURES - 2) + [int(attempt.learned), 0]
        )
        values = [0] * (self._world * _FIGURES)
        values[self._me * _FIGURES : (self._me + 1) * _FIGURES] = row
        with self._listening(self._check_left):
            try:
                out = agreed_max(
                    values, attempt.error, group=self._group, what=f"mini-batch {index}'s micro-batches"
                )
            finally:
                if self._signals is not None and self._attempt_key is not None:
                    self._signals.forget(self._attempt_key)
                self._attempt_key = None
        rows = [out[r * _FIGURES : (r + 1) * _FIGURES] for r in range(self._world)]
        self._learned_any = any(row[8] for row in rows)
        if not any(row[0] for row in rows):
            if (
                self._learned_any
            ):  # a wait given up with no failure behind it cannot happen; say so, do not go on
                raise mark_agreed(
                    BatchfitError(
                        f"a rank gave up a collective in mini-batch {index} although no rank reported running out of "
                        "memory; the model's process group cannot be used again"
                    )
                )
            return []
        return [_unpack(row) if row[0] else None for row in rows]

    def _drop(self, attempt: _Attempt) -> None:
        """Drop the attempt's partial gradients and reset the model's sharded state (NOTE [ Probes are isolated ])."""
        if attempt.snapshot is not None:
            attempt.snapshot.restore(finished=False)
        for p in self._params:
            if id(p) not in self._kept:
                p.grad = None
            elif p.grad is not None:  # kept allocated (zero_grad(set_to_none=False)): back to zero
                _local(p.grad).zero_()
        attempt.records.clear()
        attempt.outputs.clear()
        attempt.pending = None
        gc.collect()  # reference cycles through the failed micro-batch's frames and graph
        if torch.cuda.is_available() and any(p.is_cuda for p in self._params):
            torch.cuda.empty_cache()  # the retry starts from an allocator without the failed attempt's cached blocks

    def _lower(
        self,
        index: int,
        attempt_number: int,
        figures: list[_Failure | None],
        shortfalls: list[Shortfall],
        budgets: list[int],
    ) -> Shortfall:
        """Agree on the lower budget, or stop on every rank (every rank computes the same from the same figures)."""
        failed = [(r, f) for r, f in enumerate(figures) if f is not None]
        if (
            self.token_budget <= 1
        ):  # nothing below one token, whatever the micro-batch (one alone over the budget)
            failed = [(r, dataclasses.replace(f, proposal=None)) for r, f in failed]
        hopeless = [(r, f) for r, f in failed if f.proposal is None]
        rank, binding = hopeless[0] if hopeless else min(failed, key=lambda rf: (rf[1].proposal, rf[0]))
        # below the budget too: a micro-batch that ran alone over it (oversize="alone") costs more
        lowered = (
            self.token_budget if binding.proposal is None else min(binding.proposal, self.token_budget - 1)
        )
        shortfall = Shortfall(
            rank, index, attempt_number, binding.position, binding.rows, binding.cost, self.token_budget, lowered,
            binding.needed, binding.limit, binding.base,
        )  # fmt: skip
        self.shortfalls.append(shortfall)
        tried = ", ".join(f"{b:,}" for b in budgets)
        if hopeless:
            why = (
                "the budget is one token" if self.token_budget <= 1
                else "it costs one token" if binding.cost <= 1
                else "the memory held before it is above the limit"
            )  # fmt: skip
            raise mark_agreed(MicroBatchesDoNotFit(
                f"{shortfall.describe()} ran out of memory at token_budget={self.token_budget:,} and there is no lower "
                f"budget to try: {why} ({shortfall.figures()}); budgets tried: {tried}",
                budgets=budgets, shortfalls=[*shortfalls, shortfall],
            ))  # fmt: skip
        if len(shortfalls) >= self.max_retries:
            raise mark_agreed(MicroBatchesDoNotFit(
                f"mini-batch {index} ran out of memory at every budget tried ({tried}; the last time in "
                f"{shortfall.describe()}: {shortfall.figures()}); max_retries={self.max_retries} lowered budgets were "
                "tried, so the guard gives up: lower the token budget or the safety margin, or raise max_retries",
                budgets=budgets, shortfalls=[*shortfalls, shortfall],
            ))  # fmt: skip
        if self._distributed and self.wrapping == "sharded" and self._learned_any:
            self.token_budget = lowered
            raise mark_agreed(RestartAtLowerBudget(
                f"{shortfall.describe()} ran out of memory at token_budget={shortfall.token_budget:,} "
                f"({shortfall.figures()}), and a rank gave up a collective of the sharded model's, whose process group "
                f"cannot be used again: restart the run with token_budget={lowered:,} (NOTE [ A micro-batch runs out ])",
                lowered, shortfall,
            ))  # fmt: skip
        self.token_budget = lowered
        self.logger.warning(
            "batchfit: %s ran out of memory at token budget %s (%s); the budget is %s from now on, and the "
            "mini-batch runs again from its first micro-batch",
            shortfall.describe(), f"{shortfall.token_budget:,}", shortfall.figures(), f"{lowered:,}",
        )  # fmt: skip
        return shortfall

    def _synchronise(self, attempt: _Attempt, run: Callable[[Any, MicroBatchPlan], Any]) -> None:
        """DDP: the plan's padding micro-batch, synchronising (NOTE [ A micro-batch runs out ])."""
        model, plan = self.model, attempt.plan
        with self.outside("DDP's synchronising pass (the gradients' all-reduce)"):
            last = next(attempt.pending, _END)  # type: ignore[arg-type]
            attempt.pending = None
            if last is _END:
                raise BatchError(
                    f"micro_batches(plan) gave fewer micro-batches than the plan's {plan.num_micro_batches}; yield "  # type: ignore[union-attr]
                    "every micro-batch of the plan it is given (iter_micro_batches(batch, plan, rank))"
                )
            model.require_forward_param_sync = (
                True  # this forward broadcasts the buffers, as DDP's first one does
            )
            run(last, plan)
            del last
            reducer = getattr(model, "reducer", None)
            if reducer is not None and torch.is_grad_enabled() and reducer._rebuild_buckets():
                # the buckets DDP rebuilds after its first synchronising backward are broadcast from
                # rank 0 at the next forward: here, where every rank is, not inside a micro-batch
                model._has_rebuilt_buckets = True


_END = object()


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
