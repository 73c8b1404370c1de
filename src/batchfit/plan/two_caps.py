"""Packers under two caps: a token budget and a response (loss-token) budget (NOTE [ Two caps ]).

A two-cap packer keeps a one-cap packer's plan when it holds the response cap too, else packs
in two dimensions (best fits, then a small search). Pure functions of the lengths (numpy only);
:func:`batchfit.plan.packing.plan_micro_batches` is the public entry.
"""

from __future__ import annotations

import bisect

import numpy as np

from batchfit.plan.single_cap import (
    SMALL_PLAN_MAX_SEQUENCES,
    SMALL_PLAN_NODE_LIMIT,
    Packer,
    _pack_padded,
    _SearchLimit,
)

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
