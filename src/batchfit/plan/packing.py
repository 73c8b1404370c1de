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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from batchfit.errors import BudgetError, InvalidArgument
from batchfit.plan.dealing import Indices, candidate_key, deal_micro_batches, deal_sequences
from batchfit.plan.render import micro_batch_plan_text
from batchfit.plan.single_cap import packer_for
from batchfit.plan.two_caps import two_cap_packer
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


def _int_array(values: Any) -> np.ndarray | None:
    """``values`` as int64 if it is a 1-D integer array or host tensor in ``[0, MAX_LENGTH]``, else ``None``.

    The fast path of :func:`_as_response_lengths`: whole-array checks instead of one per item
    (20,000 items took 0.05 s); ``None`` sends anything else through the item-by-item check.
    """
    if hasattr(values, "detach"):
        try:
            values = values.numpy()
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16): the checked path refuses it
            return None
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype == np.bool_:
        return None
    if not np.issubdtype(values.dtype, np.integer):
        return None
    if values.size and (int(values.min()) < 0 or int(values.max()) > MAX_LENGTH):
        return None
    return values.astype(np.int64)


def _as_response_lengths(response_lengths: Any, lens: np.ndarray) -> np.ndarray:
    """``response_lengths`` as int64, one per sequence, each in ``[0, lengths[i]]``."""
    if hasattr(response_lengths, "detach"):  # a tensor, possibly on an accelerator
        response_lengths = response_lengths.detach().cpu().resolve_conj().resolve_neg()
    values = _int_array(response_lengths)
    if values is None:  # anything else is checked item by item (its error names the item)
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


def _pad_ranks(
    ranks: list[list[Indices]], costs: list[list[int]], count: int
) -> tuple[tuple[tuple[Indices, ...], ...], tuple[tuple[int, ...], ...]]:
    # NOTE [ Pad rows cost one token ] (batchfit.batches.minibatch): a padding micro-batch is one pad row.
    out_r = tuple(tuple(r) + ((),) * (count - len(r)) for r in ranks)
    out_c = tuple(tuple(c) + (PADDING_MICRO_BATCH_COST,) * (count - len(c)) for c in costs)
    return out_r, out_c


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
      [ Best fit by distinct length ]). Above :data:`~batchfit.plan.single_cap.BEST_FIT_MAX_DISTINCT` distinct lengths,
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
    tokens plan in about 0.03 s (dp_size 1) to 0.1 s (dp_size 8, two candidates). Two caps,
    when the one-cap plan breaks the response cap: padded, O(log m) per sequence; packed,
    three best fits of O(log m + min(nx, ny)) each per sequence (NOTE [ Least room where both
    fit ] in :mod:`batchfit.plan.two_caps`): 20,000 RL rollouts in about 0.2 s of CPU.

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
    packer = packer_for(cost, sorted_lens)
    if rbudget is not None:
        packer = two_cap_packer(packer, resp, rbudget, cost == "padded")
    groups, costs = packer(sorted_lens, order, budget)
    if dp_size == 1:
        ranks, rank_costs = [[tuple(g) for g in groups]], [costs]
    else:
        chosen = deal_micro_batches(groups, costs, dp_size, balance)
        if balance:
            by_sequence = deal_sequences(sorted_lens, order, budget, dp_size, packer)
            if candidate_key(by_sequence) <= candidate_key(chosen):
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
        at = rs.__getitem__
        response_costs = tuple(tuple(sum(map(at, mb)) for mb in rank) for rank in padded_ranks)
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
