"""Packers under one cap: sequences sorted longest first into micro-batches of at most a token budget.

Each packer takes lengths sorted in descending order, their input indices and the budget, and
returns groups of input indices with their costs (:data:`Packer`); :func:`packer_for` picks one per
plan. Pure functions of the lengths (numpy only); :func:`batchfit.plan.packing.plan_micro_batches`
is the public entry.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable

import numpy as np


def pack_padded(lens: np.ndarray, idx: np.ndarray, budget: int) -> tuple[list[list[int]], list[int]]:
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


class SearchLimit(Exception):
    """A small-plan search ran past :data:`SMALL_PLAN_NODE_LIMIT` nodes (caught where it runs; never leaves the planner)."""


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
            raise SearchLimit
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
    except SearchLimit:
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


def packer_for(cost: str, lengths: np.ndarray) -> Packer:
    """The packer for ``cost``, chosen once per plan (by the distinct ``lengths``, sorted, of all sequences)."""
    if cost == "padded":
        return pack_padded
    # lengths are sorted, so the distinct count is one more than the number of changes
    distinct = 1 + int(np.count_nonzero(lengths[1:] != lengths[:-1])) if len(lengths) else 0
    return _pack_best_fit_then_search if distinct <= BEST_FIT_MAX_DISTINCT else _pack_packed
