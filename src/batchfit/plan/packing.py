"""Token-budget micro-batch plans: which sequences run together in one forward/backward.

A pure function of the sequence lengths (numpy only, no tensors, no collectives): every
data-parallel rank computes the same :class:`MicroBatchPlan` locally. The tensor side
(iterating a batch along a plan, agreeing on counts across ranks) is
:mod:`batchfit.batches.microbatch`.

Guarantees of :func:`plan_micro_batches`:

- **hard cap**: every micro-batch costs at most ``token_budget`` (unlike verl's
  ``rearrange_micro_batches``, which fixes the count first and overshoots the budget);
- **every index exactly once**, over all ranks;
- **equal counts**: every rank has ``num_micro_batches`` micro-batches; ranks short of it get
  padding micro-batches (see NOTE [ Pad rows cost one token ] in :mod:`batchfit.batches.minibatch`),
  without which FSDP/DDP ranks deadlock (SkyRL #1060);
- **deterministic**: ties are broken by index, so the plan is the same on every rank;
- **a second cap** (optional): with ``response_lengths`` and ``response_budget``, every
  micro-batch also holds at most ``response_budget`` response (loss) tokens, the cost of a
  response-only head (NOTE [ Two caps ]).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from batchfit.errors import BudgetError, InvalidArgument
from batchfit.validation import (
    MAX_COUNT,
    MAX_RANKS,
    check_bool,
    check_choice,
    check_int,
    check_int_sequence,
    describe,
    is_int,
    short_repr,
)

__all__ = [
    "COSTS",
    "OVERSIZE",
    "PADDING_MICRO_BATCH_COST",
    "MicroBatchPlan",
    "plan_micro_batches",
    "split_chunks",
]

COSTS = ("padded", "packed")
"""``padded``: a micro-batch costs ``count × longest length``; ``packed``: the sum of lengths."""

OVERSIZE = ("raise", "alone", "split")
"""What to do with a sequence longer than the budget: raise :class:`BudgetError`, run it alone, or
run it alone in chunks of at most the budget (NOTE [ Over-long sequences run in chunks ] in
:mod:`batchfit.train.long_sequence`)."""

PADDING_MICRO_BATCH_COST = 1
# Longest sequence a plan accepts (2**40 tokens, far beyond any context length): bounds every
# length so sums over millions of sequences stay exact and a uint64 length is never read negative.
MAX_LENGTH = 2**40
"""Cost of a padding micro-batch: one pad row with one valid token (NOTE [ Pad rows cost one token ])."""

MAX_PADDING_MICRO_BATCHES = 2**24
"""Most padding micro-batches :meth:`MicroBatchPlan.pad_to` appends over all ranks (each is a tuple in memory)."""

Indices = tuple[int, ...]


def _is_container(outputs: Any) -> bool:
    """A list, tuple, numpy array or tensor with a first dimension."""
    if isinstance(outputs, (list, tuple)):
        return True
    return hasattr(outputs, "shape") and hasattr(outputs, "ndim") and outputs.ndim >= 1 and not isinstance(outputs, str)


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches per data-parallel rank, each a tuple of sequence indices.

    Attributes:
        ranks: ``ranks[r][k]`` is the tuple of input indices of micro-batch ``k`` of rank
            ``r``. A padding micro-batch is the empty tuple ``()``: it runs one pad row that
            costs one token and carries no loss (NOTE [ Pad rows cost one token ]).
        costs: ``costs[r][k]`` is the cost of that micro-batch in tokens (1 for padding).
        token_budget: the budget ``C`` the plan was made for.
        cost: ``"padded"`` or ``"packed"``.
        oversize: indices longer than ``token_budget``, each run alone (``oversize="alone"``);
            their micro-batches are the only ones whose cost exceeds the budget.
        lengths: valid tokens per sequence, in input order.
        response_costs: ``response_costs[r][k]`` is the response (loss) tokens of that
            micro-batch, the sum of its sequences' ``response_lengths`` (0 for padding), in
            both costs (NOTE [ Two caps ]); ``None`` when the plan was made without
            ``response_lengths``.
        response_budget: the cap on ``response_costs`` the plan was made for, or ``None``.
        response_lengths: response (loss) tokens per sequence, in input order, or ``None``.
        split: ``(index, chunks)`` of each sequence longer than ``token_budget`` in a plan made
            with ``oversize="split"``: it runs alone, in ``chunks`` passes of at most
            ``token_budget`` tokens (:func:`split_chunks`); also listed in ``oversize``.
        split_tokens: the most tokens one pass of a split sequence runs (``oversize="split"``):
            ``token_budget`` unless the plan was given a smaller ``split_tokens`` (a split pass
            also holds the whole sequence's keys and values: :func:`batchfit.budget.split_chunk_tokens`);
            ``None`` for other plans.

    "Plan order" is rank-major: rank 0's micro-batches in order, each in its index order,
    then rank 1's, and so on; padding micro-batches contribute no sequence.
    """

    ranks: tuple[tuple[Indices, ...], ...]
    costs: tuple[tuple[int, ...], ...]
    token_budget: int
    cost: str
    oversize: Indices = ()
    lengths: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=np.int64), compare=False, repr=False
    )
    response_costs: tuple[tuple[int, ...], ...] | None = None
    response_budget: int | None = None
    response_lengths: np.ndarray | None = field(default=None, compare=False, repr=False)
    split: tuple[tuple[int, int], ...] = ()
    split_tokens: int | None = None

    @property
    def split_extra_forwards(self) -> int:
        """What splitting costs: chunk forwards beyond one per split sequence, ``Σ (chunks − 1)``.

        Each split sequence's chunks but the last run twice, once without gradients to keep
        their keys and values and once with them (NOTE [ Over-long sequences run in chunks ]).
        """
        return sum(chunks - 1 for _, chunks in self.split)

    def describe(self) -> str:
        """A few lines of plain text: micro-batches, ranks, budget, use, and what was split (:func:`batchfit.plan.render.micro_batch_plan_text`)."""
        from batchfit.plan.render import micro_batch_plan_text

        return micro_batch_plan_text(self)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks."""
        return len(self.ranks)

    @property
    def num_sequences(self) -> int:
        """Number of (real) sequences planned."""
        return len(self.lengths)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank, the same on every rank (padding included)."""
        return len(self.ranks[0]) if self.ranks else 0

    @cached_property
    def num_padding_micro_batches(self) -> int:
        """Padding micro-batches summed over all ranks."""
        return sum(1 for rank in self.ranks for mb in rank if not mb)

    def is_padding(self, rank: int, k: int) -> bool:
        """True if micro-batch ``k`` of ``rank`` is a padding micro-batch."""
        return not self.ranks[rank][k]

    @cached_property
    def rank_costs(self) -> tuple[int, ...]:
        """Total cost per rank (padding micro-batches included)."""
        return tuple(sum(c) for c in self.costs)

    @cached_property
    def total_cost(self) -> int:
        """Cost summed over every micro-batch of every rank."""
        return sum(self.rank_costs)

    @cached_property
    def utilization(self) -> float:
        """``Σ cost / (micro-batch count over all ranks × token_budget)``; 1.0 for an empty plan."""
        slots = self.num_micro_batches * self.dp_size * self.token_budget
        return self.total_cost / slots if slots else 1.0

    @cached_property
    def imbalance(self) -> float:
        """Max over mean rank cost (1.0 is perfect balance; 1.0 for an empty plan)."""
        mean = self.total_cost / self.dp_size if self.dp_size else 0
        return max(self.rank_costs) / mean if mean else 1.0

    @cached_property
    def lower_bound(self) -> int:
        """Fewest micro-batches per rank that any plan could have: ``⌈Σ min(length, C) / (dp_size · C)⌉``.

        With ``dp_size=1`` this is ``⌈Σ per-sequence cost / budget⌉``. Lengths are clipped to
        the budget because an oversize sequence fills one micro-batch alone. For
        ``cost="padded"`` the true optimum can be higher (padding is unavoidable when lengths
        differ); the plan's count is that optimum (see :func:`plan_micro_batches`).

        With a ``response_budget`` ``R``, the larger of this and the same bound on response
        tokens, ``⌈Σ min(response, R) / (dp_size · R)⌉``.
        """
        clipped = _exact_sum(np.minimum(self.lengths, self.token_budget))
        bound = -(-clipped // (self.dp_size * self.token_budget)) if clipped else 0
        if self.response_budget is not None and self.response_lengths is not None:
            responses = _exact_sum(np.minimum(self.response_lengths, self.response_budget))
            bound = max(bound, -(-responses // (self.dp_size * self.response_budget)))
        return bound

    @cached_property
    def rank_lower_bounds(self) -> tuple[int, ...]:
        """Per rank, ``⌈Σ min(length, C) over its sequences / C⌉`` (and the response bound, as in :attr:`lower_bound`)."""
        clipped = np.minimum(self.lengths, self.token_budget)
        bounds = [-(-_exact_sum(clipped[self.order(r)]) // self.token_budget) for r in range(self.dp_size)]
        if self.response_budget is not None and self.response_lengths is not None:
            responses = np.minimum(self.response_lengths, self.response_budget)
            bounds = [
                max(b, -(-_exact_sum(responses[self.order(r)]) // self.response_budget))
                for r, b in enumerate(bounds)
            ]
        return tuple(bounds)

    @cached_property
    def padding_tokens(self) -> int:
        """Pad tokens inside real micro-batches: ``Σ cost − Σ lengths`` (0 for ``packed``).

        Padding micro-batches are not counted here (see ``num_padding_micro_batches``).
        """
        real = sum(c for rank, costs in zip(self.ranks, self.costs) for mb, c in zip(rank, costs) if mb)
        return real - _exact_sum(self.lengths)

    def order(self, rank: int | None = None) -> np.ndarray:
        """Input indices in plan order: of all ranks (rank-major) or of one ``rank``.

        Raises:
            InvalidArgument: ``rank`` is not in ``[0, dp_size)``.
        """
        ranks = self.ranks if rank is None else [self.ranks[self._check_rank(rank)]]
        flat = [i for r in ranks for mb in r for i in mb]
        return np.asarray(flat, dtype=np.int64)

    def _check_rank(self, rank: int) -> int:
        if not is_int(rank) or not 0 <= rank < self.dp_size:
            raise InvalidArgument(f"rank must be an integer in [0, {self.dp_size}), but got rank={rank!r}")
        return int(rank)

    def restore_order(self, outputs: Any, rank: int | None = None) -> Any:
        """Put per-sequence outputs produced in plan order back into input order.

        Args:
            outputs: one entry per sequence in plan order (see :meth:`order`): a list/tuple,
                or a numpy array or tensor with the sequence dimension first (e.g. the
                concatenated outputs of the real micro-batches; skip padding micro-batches).
            rank: ``None``: ``outputs`` cover every rank (rank-major) and the result is in input
                order, ``result[i]`` for sequence ``i``. A rank: ``outputs`` cover that rank only
                and the result is sorted by input index (``sorted(plan.order(rank))``).

        Returns:
            The same kind of container (list for list/tuple input), reordered.

        Raises:
            InvalidArgument: ``outputs`` does not have one entry per planned sequence, or a bad
                ``rank``.

        Example:
            >>> plan = plan_micro_batches([3, 5, 2], token_budget=5, cost="packed")
            >>> plan.order().tolist()  # 5 alone, then 3 + 2
            [1, 0, 2]
            >>> plan.restore_order(["out1", "out0", "out2"])
            ['out0', 'out1', 'out2']
        """
        order = self.order(rank)
        if not _is_container(outputs):
            raise InvalidArgument(
                f"outputs must be a list, tuple, numpy array or tensor with one entry per sequence, but got "
                f"outputs={describe(outputs)}"
            )
        if len(outputs) != len(order):
            where = "all ranks" if rank is None else f"rank {rank}"
            raise InvalidArgument(
                f"outputs must have one entry per sequence of {where} in plan order ({len(order)}), "
                f"but got len(outputs)={len(outputs)}; concatenate the outputs of real micro-batches only"
            )
        inverse = np.argsort(order, kind="stable")
        if isinstance(outputs, (list, tuple)):
            return [outputs[j] for j in inverse.tolist()]
        if isinstance(outputs, np.ndarray):
            return outputs[inverse]
        import torch  # only when given tensors: the plan itself needs numpy alone

        if isinstance(outputs, torch.Tensor):
            return outputs[torch.as_tensor(inverse, device=outputs.device)]
        raise InvalidArgument(
            f"outputs must be a list, tuple, numpy array or tensor, but got {type(outputs).__name__}"
        )

    def pad_to(self, num_micro_batches: int) -> MicroBatchPlan:
        """A plan with padding micro-batches appended so each rank has ``num_micro_batches``.

        Raises:
            InvalidArgument: ``num_micro_batches`` is smaller than the current count.
        """
        if not is_int(num_micro_batches) or num_micro_batches < self.num_micro_batches:
            raise InvalidArgument(
                f"num_micro_batches must be >= the plan's count {self.num_micro_batches} (an integer), but got "
                f"num_micro_batches={describe(num_micro_batches)}; a plan can only grow with padding"
            )
        extra = num_micro_batches - self.num_micro_batches
        if extra * max(self.dp_size, 1) > MAX_PADDING_MICRO_BATCHES:
            raise InvalidArgument(
                f"num_micro_batches={short_repr(num_micro_batches)} would append {extra:,} padding micro-batches to "
                f"each of {self.dp_size} ranks (at most {MAX_PADDING_MICRO_BATCHES:,} in all); the plan has "
                f"{self.num_micro_batches}: pass another rank's count, not a size in tokens or samples"
            )
        if not extra:
            return self
        ranks, costs = _pad_ranks(
            [list(r) for r in self.ranks], [list(c) for c in self.costs], num_micro_batches
        )
        response_costs = None
        if self.response_costs is not None:
            response_costs = tuple(tuple(c) + (0,) * (num_micro_batches - len(c)) for c in self.response_costs)
        return MicroBatchPlan(
            ranks=ranks,
            costs=costs,
            token_budget=self.token_budget,
            cost=self.cost,
            oversize=self.oversize,
            lengths=self.lengths,
            response_costs=response_costs,
            response_budget=self.response_budget,
            response_lengths=self.response_lengths,
            split=self.split,
            split_tokens=self.split_tokens,
        )


def split_chunks(length: int, chunk_tokens: int, *, index: int | None = None) -> tuple[tuple[int, int], ...]:
    """The token ranges ``[start, end)`` a sequence of ``length`` tokens runs in, no pass over ``chunk_tokens``.

    NOTE [ Over-long sequences run in chunks ] (:mod:`batchfit.train.long_sequence`): every
    pass but the last also runs the next chunk's first token as a label, so every chunk but
    the last holds ``chunk_tokens − 1`` tokens and the last at most ``chunk_tokens``:
    ``⌈(length − 1) / (chunk_tokens − 1)⌉`` chunks, one when the sequence fits.

    Raises:
        BudgetError: ``chunk_tokens < 2`` for a longer sequence (no pass could hold a token
            and its label), naming the sequence (``index``) and the smallest budget holding it.
        InvalidArgument: ``length`` or ``chunk_tokens`` is not a positive integer.

    Example:
        >>> split_chunks(8, 4)  # passes [0, 4), [3, 7), [6, 8): 4 + 4 + 2 tokens
        ((0, 3), (3, 6), (6, 8))
    """
    length = check_int("length", length, minimum=1, maximum=MAX_LENGTH)
    chunk_tokens = check_int("chunk_tokens", chunk_tokens, minimum=1, maximum=MAX_COUNT)
    if length <= chunk_tokens:
        return ((0, length),)
    if chunk_tokens < 2:
        name = "the sequence" if index is None else f"sequence {index}"
        raise BudgetError(
            f"{name} has {length} tokens and cannot run in chunks of chunk_tokens={chunk_tokens} (a pass runs "
            f"a token and the next one's label); raise the token budget to at least 2 (at least {length} to run it unsplit)"
        )
    step = chunk_tokens - 1
    count = -(-(length - 1) // step)
    return tuple((j * step, (j + 1) * step if j < count - 1 else length) for j in range(count))


def _exact_sum(values: np.ndarray) -> int:
    """``values.sum()`` as an exact Python int (numpy's int64 sum wraps around silently)."""
    if not values.size:
        return 0
    if int(values.max()) <= np.iinfo(np.int64).max // values.size:
        return int(values.sum())
    return sum(values.tolist())


def _objects(values: list | tuple) -> np.ndarray:
    """A 1-D object array holding ``values`` as they are (``np.asarray(..., dtype=object)`` broadcasts nested ones)."""
    arr = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        arr[i] = value
    return arr


def _as_lengths(lengths: Any) -> np.ndarray:
    if isinstance(lengths, (str, bytes, Mapping)) or lengths is None:
        raise InvalidArgument(
            f"lengths must be a list, numpy array or 1-D tensor of ints (valid tokens per sequence), but got "
            f"lengths={describe(lengths)}; pass attention_mask.sum(-1)"
        )
    if hasattr(lengths, "detach"):  # a tensor, possibly on an accelerator
        lengths = lengths.detach().cpu().resolve_conj().resolve_neg().numpy()
    try:
        arr = np.asarray(lengths)
    except (ValueError, TypeError, OverflowError):  # ragged nested lists, objects numpy cannot read
        arr = _objects(lengths) if isinstance(lengths, (list, tuple)) else None
    if arr is None or arr.ndim != 1:
        shape = "none" if arr is None else arr.shape
        raise InvalidArgument(
            f"lengths must be 1-D (one int per sequence), but got shape {shape}: lengths={short_repr(lengths)}"
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        first = next((i for i, v in enumerate(arr.tolist()) if not is_int(v)), None)
        which = f"lengths[{first}]={describe(arr[first])}" if first is not None else f"dtype {arr.dtype}"
        if first is None:  # integers too large for an int64: an object array of Python ints
            big = int(np.argmax([abs(v) for v in arr.tolist()]))
            which = f"lengths[{big}]={short_repr(arr[big])}"
        raise InvalidArgument(
            f"lengths must be integers of at most {MAX_LENGTH:,} tokens (valid tokens per sequence), but got "
            f"{which}; pass attention_mask.sum(-1) or a list of ints"
        )
    too_long = np.flatnonzero(arr > MAX_LENGTH)
    if too_long.size:
        i = int(too_long[0])
        raise InvalidArgument(
            f"lengths must be at most {MAX_LENGTH:,} tokens, but got lengths[{i}]={int(arr[i]):,}; "
            "pass valid tokens per sequence (attention_mask.sum(-1))"
        )
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(
            f"lengths must be >= 1, but got lengths[{i}]={int(arr[i])}; every sequence has at least one "
            "valid token (drop empty sequences first)"
        )
    return arr


def _check_budget(token_budget: Any) -> int:
    if not is_int(token_budget) or not 1 <= token_budget <= MAX_COUNT:
        raise BudgetError(
            f"token_budget must be a positive integer number of tokens (at most 2**62), but got "
            f"token_budget={describe(token_budget)}"
        )
    return int(token_budget)


def _as_response_lengths(response_lengths: Any, lens: np.ndarray) -> np.ndarray:
    """``response_lengths`` as int64, one per sequence, each in ``[0, lengths[i]]``."""
    if hasattr(response_lengths, "detach"):  # a tensor, possibly on an accelerator
        response_lengths = response_lengths.detach().cpu().resolve_conj().resolve_neg()
    values = check_int_sequence("response_lengths", response_lengths, minimum=0, maximum=MAX_LENGTH)
    if len(values) != len(lens):
        raise InvalidArgument(
            f"response_lengths must have one entry per sequence ({len(lens)}, as lengths), but got "
            f"len(response_lengths)={len(values)}; pass loss_mask.sum(-1) of the same batch"
        )
    arr = np.asarray(values, dtype=np.int64).reshape(len(values))
    over = np.flatnonzero(arr > lens)
    if over.size:
        i = int(over[0])
        raise InvalidArgument(
            f"response_lengths must be at most lengths (response tokens are among a sequence's valid "
            f"tokens), but got response_lengths[{i}]={int(arr[i])} > lengths[{i}]={int(lens[i])}; pass "
            "loss_mask.sum(-1) and attention_mask.sum(-1) of the same rows"
        )
    return arr


def _check_response_budget(response_budget: Any) -> int:
    if not is_int(response_budget) or not 1 <= response_budget <= MAX_COUNT:
        raise BudgetError(
            f"response_budget must be a positive integer number of response tokens (at most 2**62) or None, "
            f"but got response_budget={describe(response_budget)}"
        )
    return int(response_budget)


def _pack_padded(lens: np.ndarray, idx: np.ndarray, budget: int) -> tuple[list[list[int]], list[int]]:
    """Greedy consecutive runs over lengths sorted in descending order (``padded`` cost).

    A run led by length ``L`` takes the next ``max(1, C // L)`` sequences. This is optimal
    for the count: some micro-batch holds the longest sequence, so it has at most ``C // L0``
    members, and swapping them for the next-longest ones never raises any other micro-batch's
    cost (induction on the rest). O(number of micro-batches) Python steps.
    """
    lens, idx = lens.tolist(), idx.tolist()
    groups: list[list[int]] = []
    costs: list[int] = []
    i, n = 0, len(lens)
    while i < n:
        j = min(n, i + max(1, budget // lens[i]))
        groups.append(idx[i:j])
        costs.append((j - i) * lens[i])
        i = j
    return groups, costs


def _pack_packed(lens: np.ndarray, idx: np.ndarray, budget: int) -> tuple[list[list[int]], list[int]]:
    """Largest-first, smallest-fill over lengths sorted in descending order (``packed`` cost).

    Each micro-batch takes the longest remaining sequences while they fit, then fills the rest
    with the shortest remaining ones while they fit. Prefix sums and bisection make each
    micro-batch O(log n), so the Python loop runs once per micro-batch, not per sequence.
    Bound: a micro-batch closes only when the shortest remaining sequence ``s`` does not fit,
    so every micro-batch but the last holds more than ``C − s`` tokens; with sequences of at
    most ``C / k`` tokens the count is at most ``⌈Σ / ((1 − 1/k)·C)⌉ + 1``. Used only when
    there are more than :data:`BEST_FIT_MAX_DISTINCT` distinct lengths.
    """
    lens, idx = lens.tolist(), idx.tolist()
    prefix = [0]
    for length in lens:
        prefix.append(prefix[-1] + length)
    groups: list[list[int]] = []
    costs: list[int] = []
    lo, hi = 0, len(lens)
    while lo < hi:
        # front: the longest remaining while they fit (at least one: an oversize sequence runs alone)
        j = max(lo + 1, min(hi, bisect.bisect_right(prefix, prefix[lo] + budget) - 1))
        load = prefix[j] - prefix[lo]
        room = budget - load
        # back: the shortest remaining while they fit: the largest t with prefix[hi] - prefix[hi - t] <= room
        back = hi if room <= 0 else max(j, bisect.bisect_left(prefix, prefix[hi] - room, j, hi + 1))
        groups.append(idx[lo:j] + idx[back:hi])
        costs.append(load + prefix[hi] - prefix[back])
        lo, hi = j, back
    return groups, costs


# NOTE [ Best fit by distinct length ]
# Best-fit decreasing (BFD) puts each sequence, longest first, into the open micro-batch with
# the least room that still holds it. Two facts let it run once per distinct length instead of
# once per sequence:
# - Equal lengths fill one micro-batch before the next: after ``L`` goes into the tightest room
#   ``r >= L``, the room ``r - L`` is the tightest one left if it still holds ``L``. So a room
#   ``r`` takes ``⌊r / L⌋`` sequences of length ``L`` in one step (fewer if they run out), and
#   micro-batches with the same room take them in turn.
# - Lengths only decrease, so the rooms that can hold the current length form a stack, tightest
#   on top: a room left after taking ``L`` is below ``L`` and waits (bucketed by room, a heap of
#   the waiting room values) until the length drops to it; rooms released when the length
#   drops from ``L`` to ``L' < L`` lie in ``[L', L)``, below every room already on the stack.
# Micro-batches with the same room are interchangeable for every later choice, so the count and
# the multiset of costs are those of per-sequence BFD whatever the ties (the tests compare with
# a per-sequence reference). Each step of the loop moves a list of micro-batches at C speed;
# sequence positions are then assigned to micro-batches by one ``np.repeat`` (each step takes
# the next sequences of its length in sorted order).


def _pack_best_fit(lens: np.ndarray, idx: np.ndarray, budget: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing over lengths sorted in descending order (``packed`` cost).

    Each sequence goes to the open micro-batch with the least room that still holds it, else
    opens a new one; an oversize sequence runs alone. Bound: at most ``11/9·OPT + 4``
    micro-batches (Johnson, 1973); on the benchmark's distributions within 0.4% of the lower
    bound ``⌈Σ / C⌉``. Runs per distinct length (NOTE [ Best fit by distinct length ]): O(n log n)
    numpy work, plus a Python loop of one step per distinct length and one per (room, length)
    pair that takes sequences, never more than one per sequence, and in practice a few per
    distinct length (about 0.02 s for 100k sequences of at most 4096 tokens). Deterministic:
    micro-batches with equal rooms are taken in the order they got that room.
    """
    n = len(lens)
    if n == 0:
        return [], []
    starts = np.flatnonzero(np.r_[True, lens[1:] != lens[:-1]])
    values = lens[starts].tolist()
    counts = np.diff(np.r_[starts, n]).tolist()
    ready: list[tuple[int, list[int]]] = []  # (room, micro-batches): rooms >= length, tightest on top
    waiting: dict[int, list[int]] = {}  # room < length -> micro-batches with that room
    heap: list[int] = []  # -room for every key of waiting
    step_batches: list[int] = []  # per step, the micro-batch that takes sequences ...
    step_takes: list[int] = []  # ... and how many (consecutive in sorted order)
    opened = 0

    for length, m in zip(values, counts):
        while heap and -heap[0] >= length:  # rooms that now hold the length: tightest on top
            room = -heapq.heappop(heap)
            ready.append((room, waiting.pop(room)))
        while m and ready:
            room, batches = ready[-1]
            k = room // length  # >= 1: ready rooms hold the length
            if m >= k * len(batches):  # every micro-batch with this room takes k
                ready.pop()
                full = batches
                m -= k * len(batches)
            else:  # the first q take k, the next takes r and stays ready (tighter, on top)
                q, r = divmod(m, k)
                full = batches[:q]
                rest = batches[q + 1 :] if r else batches[q:]
                if rest:
                    ready[-1] = (room, rest)
                else:
                    ready.pop()
                if r:
                    step_batches.append(batches[q])
                    step_takes.append(r)
                    ready.append((room - r * length, [batches[q]]))
                m = 0
            if full:
                step_batches += full
                step_takes += [k] * len(full)
                left = room - k * length  # < length: waits until the length drops to it
                if left in waiting:
                    waiting[left] += full
                elif left:
                    waiting[left] = full
                    heapq.heappush(heap, -left)
        if m:  # nothing open holds it: new micro-batches of k each (oversize: k = 1, alone)
            k = max(1, budget // length)
            q, r = divmod(m, k)
            full = list(range(opened, opened + q))
            opened += q
            step_batches += full
            step_takes += [k] * q
            left = budget - k * length
            if q and left > 0:
                if left in waiting:
                    waiting[left] += full
                else:
                    waiting[left] = full
                    heapq.heappush(heap, -left)
            if r:
                step_batches.append(opened)
                step_takes.append(r)
                ready.append((budget - r * length, [opened]))
                opened += 1
    batch_of = np.repeat(np.asarray(step_batches, dtype=np.int64), np.asarray(step_takes, dtype=np.int64))
    perm = np.argsort(batch_of, kind="stable")  # by micro-batch, longest first inside
    sizes = np.bincount(batch_of, minlength=opened)
    bounds = np.r_[0, np.cumsum(sizes)]
    costs = np.add.reduceat(lens[perm], bounds[:-1]).tolist()
    flat = idx[perm].tolist()
    edges = bounds.tolist()
    return [flat[a:b] for a, b in itertools.pairwise(edges)], costs


BEST_FIT_MAX_DISTINCT = 32_768
"""Up to this many distinct lengths, ``packed`` plans use best-fit decreasing (about 0.02 s
per 100k sequences of at most a few thousand tokens, 0.07 s with 32k distinct lengths); above
it, the vectorised largest-first/smallest-fill packer (about 0.05–0.1 s per 100k sequences,
but a few percent more micro-batches)."""


Packer = Callable[[np.ndarray, np.ndarray, int], tuple[list[list[int]], list[int]]]

SMALL_PLAN_MAX_SEQUENCES = 64
"""Up to this many sequences, a packed plan above the lower bound is searched for one with fewer
micro-batches (NOTE [ Small plans are searched ])."""

SMALL_PLAN_NODE_LIMIT = 20_000
"""Search nodes per attempt (about 20–50 ms of Python at most); past it the best-fit plan stays."""


class _SearchLimit(Exception):
    pass


# NOTE [ Small plans are searched ]
# Best-fit decreasing is within 11/9 of the optimum, which for the few to few dozen
# sequences one rank holds means one micro-batch too many in about 1.5% of random cases, and
# one extra step out of five is 20% more time. So when a small plan has more micro-batches
# than the lower bound ⌈Σ lengths / C⌉, a depth-first search tries one fewer: sequences longest
# first, each into a micro-batch with room (micro-batches of equal load are interchangeable,
# so only the first of each load is tried, which also opens at most one empty micro-batch),
# pruned when the tokens left exceed the room left. Found: try one fewer again, down to the
# lower bound. Not found within SMALL_PLAN_NODE_LIMIT nodes: keep what is known. The cap is
# never relaxed (verl's ⌈Σ/C⌉ count reaches the bound by letting micro-batches exceed C).


def _fewer_micro_batches(lens: list[int], budget: int, count: int) -> list[list[int]] | None:
    """Positions of ``lens`` (descending) in ``count`` micro-batches of at most ``budget``, or ``None``.

    ``None`` when no such plan exists or the search ran past :data:`SMALL_PLAN_NODE_LIMIT`.
    """
    n = len(lens)
    suffix = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + lens[i]
    loads = [0] * count
    groups: list[list[int]] = [[] for _ in range(count)]
    nodes = 0

    def place(i: int, room: int) -> bool:
        nonlocal nodes
        if i == n:
            return True
        if suffix[i] > room:
            return False
        nodes += 1
        if nodes > SMALL_PLAN_NODE_LIMIT:
            raise _SearchLimit
        length = lens[i]
        tried: set[int] = set()
        for b in range(count):
            load = loads[b]
            if load in tried or load + length > budget:
                continue
            tried.add(load)
            loads[b] = load + length
            groups[b].append(i)
            if place(i + 1, room - length):
                return True
            loads[b] = load
            groups[b].pop()
        return False

    try:
        return groups if place(0, count * budget) else None
    except _SearchLimit:
        return None


def _pack_best_fit_then_search(
    lens: np.ndarray, idx: np.ndarray, budget: int
) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing; for at most :data:`SMALL_PLAN_MAX_SEQUENCES` sequences then NOTE [ Small plans are searched ]."""
    groups, costs = _pack_best_fit(lens, idx, budget)
    if len(lens) > SMALL_PLAN_MAX_SEQUENCES:
        return groups, costs
    values = lens.tolist()
    if not values or values[0] > budget:  # an oversize sequence runs alone: keep best fit
        return groups, costs
    bound = -(-sum(values) // budget)
    best = None
    count = len(groups) - 1
    while count >= bound:
        found = _fewer_micro_batches(values, budget, count)
        if found is None:
            break
        best = [g for g in found if g]
        count = len(best) - 1
    if best is None:
        return groups, costs
    order = idx.tolist()
    return [[order[i] for i in g] for g in best], [sum(values[i] for i in g) for g in best]


# NOTE [ Two caps ]
# With a response-only head (``model_logprobs(only_loss_tokens=True)``) a micro-batch's peak
# has two parts: the trunk pays for its tokens (``token_budget``: rows × longest for padded
# rows, the sum of lengths packed) and the head for its response (loss) tokens. The head
# gathers the loss positions before the projection in both layouts, so a micro-batch's
# response cost is the sum of its sequences' response lengths, padded or packed. A plan with
# a ``response_budget`` is a 2-D vector bin packing:
# - first the one-cap plan; if every micro-batch of it holds the response cap, it is the plan
#   (a response cap that never binds changes nothing but the reported ``response_costs``);
# - else best fit in two dimensions (:func:`_pack_two_caps`). ``packed``: three best fits, the
#   one with fewest micro-batches wins (TWO_CAP_PACKED_VARIANTS): longest first, into the
#   micro-batch with the least token room where both fit; longest first, least response
#   room; largest normalised size ``max(length / C, response / R)`` first, least room in the
#   sequence's own tighter dimension. No single rule wins on every length distribution (RL
#   rollouts where long sequences have long responses favour the first; mixtures of
#   long-prompt/short-answer and short-prompt/long-answer rollouts the second). ``padded``:
#   longest first (then largest response), into the micro-batch with the least response room
#   that holds it and has a free row (every open micro-batch is at least as wide as the
#   sequence, so rows are the only token constraint), else a new one of ``C // length`` rows.
#   Each best fit scans the open micro-batches sorted by room from the first that is large
#   enough to the first where the other cap holds too: O(log m) when one cap dominates, O(m)
#   per sequence at worst (packed, dp 8: about 0.03 s for 2,048 rollouts, 0.7–1.4 s for
#   20,000; padded 0.07 s: benchmarks/packing_two_caps.py);
# - then, for at most SMALL_PLAN_MAX_SEQUENCES sequences above the lower bound (the larger of
#   the response bound ``⌈Σ responses / R⌉`` and ``⌈Σ lengths / C⌉``, packed, or the one-cap
#   optimum, padded), the depth-first search of NOTE [ Small plans are searched ] with both
#   caps (:func:`_fewer_two_caps`).
# Both caps are hard; an oversize sequence (over either cap, ``oversize="alone"``) runs alone.

def _group_costs(lens: list[int], groups: list[list[int]], padded: bool) -> list[int]:
    """Token cost of each group of positions of ``lens``."""
    if padded:
        return [len(g) * max(lens[p] for p in g) for g in groups]
    return [sum(lens[p] for p in g) for g in groups]


def _two_cap_order(lens: np.ndarray, resps: np.ndarray, budget: int, rbudget: int, by: str) -> np.ndarray:
    """Positions, largest first by ``by`` (``"length"``, then the larger response; or ``"size"``,
    ``max(length / C, response / R)``); ties by position (lens is sorted descending, ties by index)."""
    if by == "length":
        return np.lexsort((np.arange(len(lens)), -resps, -lens))
    size = np.maximum(lens / budget, resps / rbudget)
    return np.argsort(-size, kind="stable")


def _find_fit(rooms: list[tuple[int, int]], need: int, other: list[int], other_need: int) -> int:
    """The first micro-batch in ``rooms`` (sorted (room, id)) with room >= need whose other room fits, or -1."""
    for k in range(bisect.bisect_left(rooms, (need, -1)), len(rooms)):
        b = rooms[k][1]
        if other[b] >= other_need:
            return b
    return -1


def _best_fit_padded(ls: list[int], rs: list[int], order: list[int], budget: int, rbudget: int) -> list[list[int]]:
    """Padded rows: each sequence (longest first) into the micro-batch with the least response room
    that holds it and has a free row (then fewest free rows, then oldest), else a new one."""
    groups: list[list[int]] = []
    open_: list[tuple[int, int, int]] = []  # (response room, free rows, micro-batch), rows > 0
    for p in order:
        length, r = ls[p], rs[p]
        fits = length <= budget and r <= rbudget
        if fits:
            pos = bisect.bisect_left(open_, (r, 0, 0))
            if pos < len(open_):
                room, free, b = open_.pop(pos)
                groups[b].append(p)
                if free > 1:
                    bisect.insort(open_, (room - r, free - 1, b))
                continue
        groups.append([p])
        if fits and budget // length > 1:
            bisect.insort(open_, (rbudget - r, budget // length - 1, len(groups) - 1))
    return groups


def _best_fit_packed(
    ls: list[int], rs: list[int], order: list[int], budget: int, rbudget: int, dimension: str
) -> list[list[int]]:
    """Packed: each sequence into the micro-batch with the least room in ``dimension``
    (``"tokens"``, ``"responses"``, or ``"tighter"``: the sequence's larger normalised size)
    among those where both fit, else a new one; an oversize sequence runs alone."""
    shortest = min(ls, default=1)
    groups: list[list[int]] = []
    room_l: list[int] = []
    room_r: list[int] = []
    by_l: list[tuple[int, int]] = []  # (token room, micro-batch) of micro-batches that hold a sequence more
    by_r: list[tuple[int, int]] = []  # (response room, micro-batch), the same micro-batches
    for p in order:
        length, r = ls[p], rs[p]
        b = -1
        if length <= budget and r <= rbudget:
            tokens = dimension == "tokens" or (dimension == "tighter" and length * rbudget >= r * budget)
            b = _find_fit(by_l, length, room_r, r) if tokens else _find_fit(by_r, r, room_l, length)
        if b >= 0:
            del by_l[bisect.bisect_left(by_l, (room_l[b], b))]
            del by_r[bisect.bisect_left(by_r, (room_r[b], b))]
            groups[b].append(p)
            room_l[b] -= length
            room_r[b] -= r
        else:
            b = len(groups)
            groups.append([p])
            room_l.append(budget - length)
            room_r.append(rbudget - r)
            if length > budget or r > rbudget:  # oversize: alone
                continue
        if room_l[b] >= shortest:
            bisect.insort(by_l, (room_l[b], b))
            bisect.insort(by_r, (room_r[b], b))
    return groups


TWO_CAP_PACKED_VARIANTS = (("length", "tokens"), ("length", "responses"), ("size", "tighter"))
"""(order, best-fit dimension) of the packed two-cap best fits; the one with fewest micro-batches wins."""


def _pack_two_caps(
    lens: np.ndarray, idx: np.ndarray, budget: int, resps: np.ndarray, rbudget: int, padded: bool
) -> list[list[int]]:
    """Best fit under both caps (NOTE [ Two caps ]); groups of positions of ``lens`` (sorted descending)."""
    ls, rs = lens.tolist(), resps.tolist()
    if padded:
        return _best_fit_padded(ls, rs, _two_cap_order(lens, resps, budget, rbudget, "length").tolist(), budget, rbudget)
    best: list[list[int]] | None = None
    for by, dimension in TWO_CAP_PACKED_VARIANTS:
        order = _two_cap_order(lens, resps, budget, rbudget, by).tolist()
        groups = _best_fit_packed(ls, rs, order, budget, rbudget, dimension)
        if best is None or len(groups) < len(best):
            best = groups
    return best or []


def _fewer_two_caps(
    lens: list[int], resps: list[int], budget: int, rbudget: int, count: int, padded: bool
) -> list[list[int]] | None:
    """Positions of ``lens`` in ``count`` micro-batches under both caps, or ``None`` (NOTE [ Two caps ]).

    ``lens`` is sorted descending for ``padded`` (a micro-batch's first sequence sets its width).
    ``None`` when no such plan exists or the search ran past :data:`SMALL_PLAN_NODE_LIMIT`.
    """
    n = len(lens)
    suffix_l = [0] * (n + 1)
    suffix_r = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_l[i] = suffix_l[i + 1] + lens[i]
        suffix_r[i] = suffix_r[i + 1] + resps[i]
    loads = [0] * count  # tokens (packed) or rows (padded)
    widths = [0] * count
    rloads = [0] * count
    groups: list[list[int]] = [[] for _ in range(count)]
    nodes = 0

    def place(i: int, room: int, rroom: int) -> bool:
        nonlocal nodes
        if i == n:
            return True
        if suffix_r[i] > rroom or (not padded and suffix_l[i] > room):
            return False
        nodes += 1
        if nodes > SMALL_PLAN_NODE_LIMIT:
            raise _SearchLimit
        length, r = lens[i], resps[i]
        tried: set[tuple[int, int, int]] = set()
        for b in range(count):
            key = (loads[b], widths[b], rloads[b])
            if key in tried or rloads[b] + r > rbudget:
                continue
            if padded:
                width = widths[b] or length
                if (loads[b] + 1) * width > budget:
                    continue
            elif loads[b] + length > budget:
                continue
            tried.add(key)
            old_width = widths[b]
            loads[b] += 1 if padded else length
            widths[b] = widths[b] or length
            rloads[b] += r
            groups[b].append(i)
            if place(i + 1, room - length, rroom - r):
                return True
            loads[b] -= 1 if padded else length
            widths[b] = old_width
            rloads[b] -= r
            groups[b].pop()
        return False

    try:
        return groups if place(0, count * budget, count * rbudget) else None
    except _SearchLimit:
        return None


def _pack_two_caps_then_search(
    lens: np.ndarray, idx: np.ndarray, budget: int, resps: np.ndarray, rbudget: int, padded: bool
) -> tuple[list[list[int]], list[int]]:
    """Two-cap best fit, then for small plans the search (NOTE [ Two caps ]); groups of input indices."""
    groups = _pack_two_caps(lens, idx, budget, resps, rbudget, padded)
    ls, rs = lens.tolist(), resps.tolist()
    oversize = any(length > budget for length in ls) or any(r > rbudget for r in rs)
    if 0 < len(ls) <= SMALL_PLAN_MAX_SEQUENCES and not oversize:
        if padded:
            bound = len(_pack_padded(lens, idx, budget)[0])  # the one-cap optimum
        else:
            bound = -(-sum(ls) // budget)
        bound = max(bound, -(-sum(rs) // rbudget))
        order = _two_cap_order(lens, resps, budget, rbudget, "length" if padded else "size").tolist()
        count = len(groups) - 1
        while count >= bound:
            found = _fewer_two_caps([ls[p] for p in order], [rs[p] for p in order], budget, rbudget, count, padded)
            if found is None:
                break
            groups = [[order[q] for q in g] for g in found if g]
            count = len(groups) - 1
    # inside a micro-batch, longest first (then by position: the sorted order, ties by index)
    groups = [sorted(g) for g in groups]
    positions = idx.tolist()
    return [[positions[p] for p in g] for g in groups], _group_costs(ls, groups, padded)


def _two_cap_packer(packer: Packer, resp: np.ndarray, rbudget: int, padded: bool) -> Packer:
    """``packer``'s plan when it holds the response cap, else the two-cap packer (NOTE [ Two caps ]).

    ``resp`` is indexed by input index (the packers see input indices in ``idx``).
    """

    def pack(lens: np.ndarray, idx: np.ndarray, budget: int) -> tuple[list[list[int]], list[int]]:
        groups, costs = packer(lens, idx, budget)
        if all(len(g) == 1 or int(resp[g].sum()) <= rbudget for g in groups):
            return groups, costs
        return _pack_two_caps_then_search(lens, idx, budget, resp[idx], rbudget, padded)

    return pack


def _packer(cost: str, lengths: np.ndarray) -> Packer:
    """The packer for ``cost``, chosen once per plan (by the distinct ``lengths``, sorted, of all sequences)."""
    if cost == "padded":
        return _pack_padded
    # lengths are sorted, so the distinct count is one more than the number of changes
    distinct = 1 + int(np.count_nonzero(lengths[1:] != lengths[:-1])) if len(lengths) else 0
    return _pack_best_fit_then_search if distinct <= BEST_FIT_MAX_DISTINCT else _pack_packed


def _snake(n: int, dp_size: int) -> np.ndarray:
    """Rank of each of ``n`` items dealt boustrophedon: 0..d-1, d-1..0, 0..d-1, ...

    Over items sorted in descending order, the spread of the rank sums is at most the
    largest item minus the smallest: each forward/backward pair of rounds shifts any two
    ranks apart by at most that round's range, and the ranges telescope.
    """
    pos = np.arange(n, dtype=np.int64)
    rnd, col = np.divmod(pos, dp_size)
    return np.where(rnd % 2 == 0, col, dp_size - 1 - col)


def _pad_ranks(
    ranks: list[list[Indices]], costs: list[list[int]], count: int
) -> tuple[tuple[tuple[Indices, ...], ...], tuple[tuple[int, ...], ...]]:
    # NOTE [ Pad rows cost one token ] (batchfit.batches.minibatch): a padding micro-batch is one pad row.
    out_r = tuple(tuple(r) + ((),) * (count - len(r)) for r in ranks)
    out_c = tuple(tuple(c) + (PADDING_MICRO_BATCH_COST,) * (count - len(c)) for c in costs)
    return out_r, out_c


def _deal_micro_batches(
    groups: list[list[int]], costs: list[int], dp_size: int, balance: bool
) -> tuple[list[list[Indices]], list[list[int]]]:
    """Assign whole micro-batches to ranks: at most ``⌈M / dp_size⌉`` each."""
    order = sorted(range(len(groups)), key=lambda g: (-costs[g], g)) if balance else list(range(len(groups)))
    rank_of = _snake(len(order), dp_size) if balance else np.arange(len(order)) % dp_size
    ranks: list[list[Indices]] = [[] for _ in range(dp_size)]
    rank_costs: list[list[int]] = [[] for _ in range(dp_size)]
    for g, r in zip(order, rank_of.tolist()):
        ranks[r].append(tuple(groups[g]))
        rank_costs[r].append(costs[g])
    return ranks, rank_costs


def _deal_sequences(
    lens: np.ndarray, idx: np.ndarray, budget: int, dp_size: int, packer: Packer
) -> tuple[list[list[Indices]], list[list[int]]]:
    """Assign sequences to ranks (boustrophedon over descending lengths), then pack each rank."""
    rank_of = _snake(len(idx), dp_size)
    ranks: list[list[Indices]] = []
    rank_costs: list[list[int]] = []
    for r in range(dp_size):
        mask = rank_of == r
        groups, costs = packer(lens[mask], idx[mask], budget)
        ranks.append([tuple(g) for g in groups])
        rank_costs.append(costs)
    return ranks, rank_costs


def _candidate_key(candidate: tuple[list[list[Indices]], list[list[int]]]) -> tuple[int, int]:
    ranks, costs = candidate
    return max(len(r) for r in ranks), max(sum(c) for c in costs)


def plan_micro_batches(
    lengths: Sequence[int] | np.ndarray | Any,
    token_budget: int,
    *,
    dp_size: int = 1,
    cost: str = "padded",
    balance: bool = True,
    oversize: str = "raise",
    response_lengths: Sequence[int] | np.ndarray | Any | None = None,
    response_budget: int | None = None,
    split_tokens: int | None = None,
) -> MicroBatchPlan:
    """Plan micro-batches that never exceed ``token_budget``, as few as possible, equal over ranks.

    With ``response_lengths`` and ``response_budget``, no micro-batch holds more than
    ``response_budget`` response (loss) tokens either: the head's cost with a response-only
    head (``model_logprobs(only_loss_tokens=True)``), which gathers the loss positions before
    the projection, so a micro-batch's response cost is the **sum** of its sequences'
    response lengths in both layouts (``padded`` rows and ``packed`` rows alike), while its
    token cost stays ``count × longest`` or the sum of lengths. A micro-batch fits when both
    caps hold (NOTE [ Two caps ]).

    Algorithm (sequences sorted by length, longest first, ties by index):

    - ``cost="padded"`` (micro-batch cost ``count × longest``): greedy consecutive runs; a run
      led by length ``L`` holds ``C // L`` sequences. The count is **optimal**: no plan under
      the cap has fewer micro-batches (per rank: ``⌈M*/dp_size⌉`` with ``M*`` the optimum
      for one rank).
    - ``cost="packed"`` (cost = sum of lengths): best-fit decreasing (at most
      ``11/9·OPT + 4``; within 0.4% of the lower bound on the benchmark's distributions,
      100k sequences included), run once per distinct length rather than per sequence (NOTE
      [ Best fit by distinct length ]). Above :data:`BEST_FIT_MAX_DISTINCT` distinct lengths,
      largest-first then fill with the shortest (every micro-batch but the last holds more
      than ``C −`` the shortest sequence left), which bounds the time.
    - ``dp_size > 1``: two candidate plans, the one with fewer micro-batches per rank wins (then
      the lower maximum rank cost, then the first): (1) sequences dealt to ranks boustrophedon
      over descending lengths (rank costs differ by at most the longest length), then packed
      per rank; (2) all sequences packed together, whole micro-batches dealt to ranks (at most
      ``⌈M/dp_size⌉`` each, which keeps the padded optimum). With ``balance=False`` only (2)
      is used, dealt round-robin in packing order.
    - ``balance=True`` also orders each rank's micro-batches by cost, largest first, so that
      the ``k``-th micro-batches of all ranks (which run in lockstep under FSDP) match.
    - Ranks short of the maximum count get padding micro-batches (cost 1, no sequence).
    - With a ``response_budget``: each packing above is kept if all its micro-batches hold the
      response cap; otherwise it is replaced by a best fit in two dimensions, searched for one
      micro-batch fewer when small (NOTE [ Two caps ]). The count is at least
      ``plan.lower_bound``, which then covers both caps.

    Complexity: O(n log n) numpy work for the sort and the output. Python steps: padded,
    one per micro-batch; packed, best fit: a few per distinct length (at most one per
    sequence), largest-first: O(log n) per micro-batch. 100k sequences of at most 4096
    tokens plan in about 0.03 s (dp_size 1) to 0.1 s (dp_size 8, two candidates).

    Args:
        lengths: valid tokens per sequence (list, numpy array or 1-D tensor), each >= 1.
        token_budget: the largest cost ``C`` of a micro-batch, in tokens.
        dp_size: data-parallel ranks.
        cost: ``"padded"`` or ``"packed"`` (see :data:`COSTS`).
        balance: balance rank costs and align micro-batches across ranks (see above).
        oversize: ``"raise"`` (default) or ``"alone"``: a sequence longer than the budget
            (or with more response tokens than ``response_budget``) runs alone in its own
            micro-batch and is listed in ``plan.oversize``. ``"split"``: as ``"alone"``, and
            each sequence longer than ``token_budget`` is listed in ``plan.split`` with the
            chunks it runs in (:func:`split_chunks`; ``batchfit.train.micro_batch_backward``
            runs them, NOTE [ Over-long sequences run in chunks ]); one over only the
            response budget runs alone, whole.
        response_lengths: response (loss) tokens per sequence (``loss_mask.sum(-1)``), each in
            ``[0, lengths[i]]``; the plan reports ``response_costs``. ``None``: no response cost.
        response_budget: the largest response cost of a micro-batch (needs
            ``response_lengths``); ``None``: no second cap, and the plan is the one-cap plan.
        split_tokens: with ``oversize="split"``, the most tokens one pass of a split sequence
            runs, in ``[2, token_budget]`` (default ``token_budget``): a split pass also holds
            the sequence's keys and values, so its chunk must be smaller than the budget
            (:func:`batchfit.budget.split_chunk_tokens` finds it).

    Returns:
        A :class:`MicroBatchPlan`; the same inputs always give the same plan.

    Raises:
        BudgetError: ``token_budget`` or ``response_budget`` is not a positive integer, or
            (``oversize="raise"``) a sequence is longer than the budget or has more response
            tokens than ``response_budget`` (names its index, its size and the smallest budget
            that holds every sequence).
        InvalidArgument: bad ``lengths``, ``response_lengths``, ``dp_size``, ``cost``,
            ``balance`` or ``oversize``; ``response_budget`` without ``response_lengths``.

    Example:
        >>> plan = plan_micro_batches([100, 30, 70, 40], token_budget=140, cost="packed")
        >>> plan.ranks  # best fit: 40 fills the 40 tokens left beside 100, then 70 + 30
        (((0, 3), (2, 1)),)
        >>> plan.num_micro_batches, plan.lower_bound
        (2, 2)
        >>> plan = plan_micro_batches([100, 30, 70, 40], token_budget=140, cost="packed",
        ...                           response_lengths=[60, 20, 50, 30], response_budget=80)
        >>> plan.ranks, plan.response_costs  # 100 + 40 would hold 90 response tokens
        ((((0, 1), (2, 3)),), ((80, 80),))
    """
    lens = _as_lengths(lengths)
    budget = _check_budget(token_budget)
    dp_size = check_int("dp_size", dp_size, minimum=1, maximum=MAX_RANKS)
    cost = check_choice("cost", cost, COSTS)
    oversize = check_choice("oversize", oversize, OVERSIZE)
    balance = check_bool("balance", balance)
    resp = None if response_lengths is None else _as_response_lengths(response_lengths, lens)
    rbudget = None if response_budget is None else _check_response_budget(response_budget)
    chunk = budget if split_tokens is None else check_int("split_tokens", split_tokens, minimum=2, maximum=budget)
    if split_tokens is not None and oversize != "split":
        raise InvalidArgument(
            f"split_tokens={chunk} is read only when sequences are split; pass oversize='split' or drop split_tokens"
        )
    if rbudget is not None and resp is None:
        raise InvalidArgument(
            f"response_budget={rbudget} needs response_lengths (response tokens per sequence, "
            "loss_mask.sum(-1)); pass both, or neither for a plan on token_budget alone"
        )

    over_tokens = lens > budget
    over = np.flatnonzero(over_tokens)
    if over.size and oversize == "raise":
        i = int(over[0])
        others = (
            f" ({over.size} sequences are over the budget, longest {int(lens.max())})"
            if over.size > 1
            else ""
        )
        raise BudgetError(
            f"sequence {i} has {int(lens[i])} tokens, more than token_budget={budget}{others}; raise "
            f"token_budget to at least {int(lens.max())}, truncate or drop the sequence, or pass "
            "oversize='alone' to run it alone in a micro-batch over the budget (or 'split' to run it in chunks)"
        )
    if rbudget is not None:
        over_responses = resp > rbudget
        over_r = np.flatnonzero(over_responses)
        if over_r.size and oversize == "raise":
            i = int(over_r[0])
            others = (
                f" ({over_r.size} sequences are over it, largest {int(resp.max())})" if over_r.size > 1 else ""
            )
            raise BudgetError(
                f"sequence {i} has {int(resp[i])} response tokens, more than response_budget={rbudget}{others}; "
                f"raise response_budget to at least {int(resp.max())}, truncate or drop the sequence, or pass "
                "oversize='alone' to run it alone in a micro-batch over the budget"
            )
        over = np.flatnonzero(over_tokens | over_responses)

    order = np.argsort(-lens, kind="stable")  # longest first, ties by index
    sorted_lens = lens[order]
    packer = _packer(cost, sorted_lens)
    if rbudget is not None:
        packer = _two_cap_packer(packer, resp, rbudget, cost == "padded")
    groups, costs = packer(sorted_lens, order, budget)
    if dp_size == 1:
        ranks, rank_costs = [[tuple(g) for g in groups]], [costs]
    else:
        chosen = _deal_micro_batches(groups, costs, dp_size, balance)
        if balance:
            by_sequence = _deal_sequences(sorted_lens, order, budget, dp_size, packer)
            if _candidate_key(by_sequence) <= _candidate_key(chosen):
                chosen = by_sequence
        ranks, rank_costs = chosen
    if balance:
        for r in range(dp_size):
            perm = sorted(
                range(len(ranks[r])), key=lambda k, c=rank_costs[r]: -c[k]
            )  # stable: ties keep order
            ranks[r] = [ranks[r][k] for k in perm]
            rank_costs[r] = [rank_costs[r][k] for k in perm]
    count = max((len(r) for r in ranks), default=0)
    padded_ranks, padded_costs = _pad_ranks(ranks, rank_costs, count)
    frozen = lens.copy()
    frozen.setflags(write=False)
    response_costs = frozen_resp = None
    if resp is not None:
        rs = resp.tolist()
        response_costs = tuple(tuple(sum(rs[i] for i in mb) for mb in rank) for rank in padded_ranks)
        frozen_resp = resp.copy()
        frozen_resp.setflags(write=False)
    return MicroBatchPlan(
        ranks=padded_ranks,
        costs=padded_costs,
        token_budget=budget,
        cost=cost,
        oversize=tuple(over.tolist()),
        lengths=frozen,
        response_costs=response_costs,
        response_budget=rbudget,
        response_lengths=frozen_resp,
        split=_split(lens, budget, chunk) if oversize == "split" else (),
        split_tokens=chunk if oversize == "split" else None,
    )


def _split(lens: np.ndarray, budget: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """``(index, chunks)`` of every sequence longer than ``budget``, in passes of at most ``chunk`` tokens (:func:`split_chunks`)."""
    return tuple((int(i), len(split_chunks(int(lens[i]), chunk, index=int(i)))) for i in np.flatnonzero(lens > budget))
