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
    SearchLimit,
    pack_padded,
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
#   Each best fit finds its micro-batch in O(log m) plus the shorter of two scans (NOTE [ Least
#   room where both fit ]): 20,000 rollouts in 0.19 s of CPU (`benchmarks/packing.py --two-caps`);
# - then, for at most SMALL_PLAN_MAX_SEQUENCES sequences above the lower bound (the larger of
#   the response bound ``⌈Σ responses / R⌉`` and ``⌈Σ lengths / C⌉``, packed, or the one-cap
#   optimum, padded), the depth-first search of NOTE [ Small plans are searched ] with both
#   caps (:func:`_fewer_two_caps`).
# Both caps are hard; an oversize sequence (over either cap, ``oversize="alone"``) runs alone.


def _group_costs(lens: list[int], groups: list[list[int]], padded: bool) -> list[int]:
    """Token cost of each group of positions of ``lens``."""
    at = lens.__getitem__
    if padded:
        return [len(g) * max(map(at, g)) for g in groups]
    return [sum(map(at, g)) for g in groups]


def _two_cap_order(lens: np.ndarray, resps: np.ndarray, budget: int, rbudget: int, by: str) -> np.ndarray:
    """Positions, largest first by ``by`` (``"length"``, then the larger response; or ``"size"``,
    ``max(length / C, response / R)``); ties by position (lens is sorted descending, ties by index)."""
    if by == "length":
        if not len(lens):
            return np.arange(0)
        scale = int(resps.max()) + 1
        if int(lens.max()) < (1 << 62) // scale:  # one int64 key, sorted in one pass
            return np.argsort(-(lens * scale + resps), kind="stable")
        return np.lexsort((-resps, -lens))  # stable: ties keep their positions
    size = np.maximum(lens / budget, resps / rbudget)
    return np.argsort(-size, kind="stable")


# NOTE [ Least room where both fit ]
# A packed best fit asks, for each sequence, for the micro-batch with the least room in one
# dimension D (the least ``(room_D, id)``) among the open ones whose rooms hold the sequence in
# both dimensions, D and the other, O. The open micro-batches are kept twice as sorted keys
# ``room << shift | id`` (one int each, so bisection and insertion run in C; ``key & mask`` is
# the id): ``by_D`` sorted by room in D, each beside its key in O, and ``by_O`` sorted by room
# in O, each beside its key in D. Bisection finds the ``nx`` with room for the sequence in D and
# the ``ny`` with room in O; the answer is among both, so either scan finds it:
# - along ``by_D`` from the least room: the first whose O room holds the sequence. It stops at
#   the answer, at once when D binds;
# - across the ``ny`` of ``by_O``: the least D key among them (``min`` in C) that holds the
#   sequence. It reads all ``ny``, few when O binds (when responses bind, nearly every
#   micro-batch has token room and few have response room).
# The least room in D first (most sequences stop there when D binds), then the shorter of the
# two: O(log m + min(nx, ny)) steps per sequence, plus list insertions (a memmove in C). Both
# dimensions run the same steps on the lists swapped, and a micro-batch that takes a sequence
# goes back in below where it was (its room only shrinks). A micro-batch whose room in either dimension
# is below every sequence still to place (the least length and the least response after this
# step) holds nothing more and leaves the lists. Neither changes the choice: before issue 29 the
# scan ran along ``by_D`` alone, to the answer or the end, O(m) per sequence when O binds (6.8 s
# for 20,000 rollouts); tests/packing_two_caps_oracle.py keeps it, and the tests compare.

def _least_room_fit(
    by_d: list[int], o_of_d: list[int], need_d: int, by_o: list[int], d_of_o: list[int], need_o: int, kx: int
) -> int:
    """The position in ``by_d`` of the least key that is at least ``need_d`` and whose key in the
    other dimension is at least ``need_o``, or -1 (NOTE [ Least room where both fit ]).

    ``by_d`` and ``by_o`` are the sorted keys of the open micro-batches in each dimension;
    ``o_of_d[i]`` is the other key of ``by_d[i]``, and ``d_of_o[i]`` that of ``by_o[i]``; ``kx`` is
    where ``need_d`` bisects ``by_d`` (the caller has looked at the first candidate already).
    """
    ky = bisect.bisect_left(by_o, need_o)
    if len(by_d) - kx <= len(by_o) - ky:  # nx <= ny: along by_d
        i = kx
        for key in o_of_d[kx:]:
            if key >= need_o:
                return i
            i += 1
        return -1
    keys = d_of_o[ky:]
    if not keys:
        return -1
    least = min(keys)
    if least < need_d:  # some lack room in D: the least of those that have it
        least = min([key for key in keys if key >= need_d], default=-1)
        if least < 0:
            return -1
    return bisect.bisect_left(by_d, least, kx)


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
    ls: list[int],
    rs: list[int],
    order: list[int],
    budget: int,
    rbudget: int,
    dimension: str,
    rests: tuple[list[int], list[int]] | None = None,
) -> list[list[int]]:
    """Packed: each sequence into the micro-batch with the least room in ``dimension``
    (``"tokens"``, ``"responses"``, or ``"tighter"``: the sequence's larger normalised size)
    among those where both fit, else a new one; an oversize sequence runs alone.

    Ties go to the micro-batch opened first. O(log m + min(nx, ny)) per sequence (NOTE [ Least
    room where both fit ]). ``rests`` is :func:`least_still_to_place` of ``order``, when the caller
    has it already.
    """
    shift = _shift(ls)
    mask = (1 << shift) - 1
    rest_l, rest_r = least_still_to_place(ls, rs, order) if rests is None else rests
    bisect_left = bisect.bisect_left
    groups: list[list[int]] = []
    by_l: list[int] = []  # sorted keys (token room << shift | micro-batch) of the open micro-batches
    r_of_l: list[int] = []  # the response key of each, aligned with by_l
    by_r: list[int] = []  # sorted keys (response room << shift | micro-batch) of the same
    l_of_r: list[int] = []  # the token key of each, aligned with by_r
    for p, open_l, open_r in zip(order, rest_l, rest_r):
        length, r = ls[p], rs[p]
        if length > budget or r > rbudget:  # oversize: alone
            groups.append([p])
            continue
        need_l, need_r = length << shift, r << shift
        # D, the dimension of least room, and O, the other: the same steps serve both
        if dimension == "tokens" or (dimension == "tighter" and length * rbudget >= r * budget):
            by_d, o_of_d, need_d, open_d, by_o, d_of_o, need_o, open_o = (
                by_l, r_of_l, need_l, open_l, by_r, l_of_r, need_r, open_r
            )
        else:
            by_d, o_of_d, need_d, open_d, by_o, d_of_o, need_o, open_o = (
                by_r, l_of_r, need_r, open_r, by_l, r_of_l, need_l, open_l
            )
        i = bisect_left(by_d, need_d)
        if i == len(by_d):
            i = -1
        elif o_of_d[i] < need_o:  # the least room in D lacks room in O
            i = _least_room_fit(by_d, o_of_d, need_d, by_o, d_of_o, need_o, i)
        if i >= 0:
            kd, ko = by_d.pop(i), o_of_d.pop(i)
            j = bisect_left(by_o, ko)
            del by_o[j], d_of_o[j]
            groups[kd & mask].append(p)
            kd -= need_d
            ko -= need_o
            if kd >= open_d and ko >= open_o:  # less room than before: back in below where it was
                i = bisect_left(by_d, kd, 0, i)
                by_d.insert(i, kd)
                o_of_d.insert(i, ko)
                j = bisect_left(by_o, ko, 0, j)
                by_o.insert(j, ko)
                d_of_o.insert(j, kd)
            continue
        b = len(groups)
        groups.append([p])
        kl = (budget - length) << shift | b
        kr = (rbudget - r) << shift | b
        if kl >= open_l and kr >= open_r:
            j = bisect_left(by_l, kl)
            by_l.insert(j, kl)
            r_of_l.insert(j, kr)
            j = bisect_left(by_r, kr)
            by_r.insert(j, kr)
            l_of_r.insert(j, kl)
    return groups


def _shift(ls: list[int]) -> int:
    """The bits the micro-batch ids take in a key (ids < 2**shift)."""
    return max(len(ls), 1).bit_length()


def least_still_to_place(
    ls: list[int] | np.ndarray, rs: list[int] | np.ndarray, order: list[int] | np.ndarray
) -> tuple[list[int], list[int]]:
    """Per step of ``order``, the least length and the least response still to place after it, shifted
    as keys: a micro-batch with less room than that in either dimension holds nothing more and leaves
    the lists (NOTE [ Least room where both fit ]). Lists or arrays (arrays skip a conversion)."""
    shift = _shift(ls)
    return _least_after(ls, order, shift), _least_after(rs, order, shift)


def _least_after(values: list[int] | np.ndarray, order: list[int] | np.ndarray, shift: int) -> list[int]:
    """Per step of ``order``, the least of ``values`` over the steps after it, shifted left by ``shift``
    (0 after the last step: nothing is placed after it)."""
    if not len(order):
        return []
    least = np.minimum.accumulate(np.asarray(values, dtype=np.int64)[order][::-1])[::-1]
    if int(least[-1]) < 1 << (62 - shift):  # least[-1] is the largest: shifted in int64 exactly
        shifted = (least[1:] << shift).tolist()
    else:
        shifted = [v << shift for v in least[1:].tolist()]
    shifted.append(0)
    return shifted


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
    orders: dict[str, tuple[list[int], tuple[list[int], list[int]]]] = {}  # two variants share an order
    for by, dimension in TWO_CAP_PACKED_VARIANTS:
        if by not in orders:
            order = _two_cap_order(lens, resps, budget, rbudget, by)
            orders[by] = order.tolist(), least_still_to_place(lens, resps, order)
        order, rests = orders[by]
        groups = _best_fit_packed(ls, rs, order, budget, rbudget, dimension, rests=rests)
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
            raise SearchLimit
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
    except SearchLimit:
        return None


def _pack_two_caps_then_search(
    lens: np.ndarray, idx: np.ndarray, budget: int, resps: np.ndarray, rbudget: int, padded: bool
) -> tuple[list[list[int]], list[int]]:
    """Two-cap best fit, then for small plans the search (NOTE [ Two caps ]); groups of input indices."""
    groups = _pack_two_caps(lens, idx, budget, resps, rbudget, padded)
    ls, rs = lens.tolist(), resps.tolist()
    oversize = bool(len(ls)) and (int(lens.max()) > budget or int(resps.max()) > rbudget)
    if 0 < len(ls) <= SMALL_PLAN_MAX_SEQUENCES and not oversize:
        if padded:
            bound = len(pack_padded(lens, idx, budget)[0])  # the one-cap optimum
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


# NOTE [ When one cap cannot hold the other ]
# Both packed one-cap packers leave at most one micro-batch at most half full: best fit opens a
# micro-batch for a sequence only when it fits in no other (one that left the open lists has
# less room than every sequence still to place), so any two micro-batches hold more than ``C``
# together; largest-first/smallest-fill closes one only when the shortest remaining sequence
# does not fit, so each but the last holds more than ``C / 2``. A one-cap plan therefore has at
# most ``⌊2·Σ lengths / C⌋ + 1`` micro-batches, and when no sequence is over the response cap
# and the responses sum to more than ``R`` times that, one of its micro-batches is over ``R``
# (pigeonhole): the two-cap packer runs without building it. The plan is the same; only the
# one-cap pass is saved (RL rollouts whose responses bind, `benchmarks/packing.py --two-caps`).


def _one_cap_cannot_hold(lens: np.ndarray, resps: np.ndarray, budget: int, rbudget: int) -> bool:
    """Whether every packed one-cap plan of ``lens`` has a micro-batch over ``rbudget`` responses
    (NOTE [ When one cap cannot hold the other ])."""
    if not len(resps) or int(resps.max()) > rbudget:
        return False
    most = 2 * int(lens.sum()) // budget + 1
    return int(resps.sum()) > rbudget * most


def two_cap_packer(packer: Packer, resp: np.ndarray, rbudget: int, padded: bool) -> Packer:
    """``packer``'s plan when it holds the response cap, else the two-cap packer (NOTE [ Two caps ]).

    ``resp`` is indexed by input index (the packers see input indices in ``idx``).
    """

    def pack(lens: np.ndarray, idx: np.ndarray, budget: int) -> tuple[list[list[int]], list[int]]:
        if not padded and _one_cap_cannot_hold(lens, resp[idx], budget, rbudget):
            return _pack_two_caps_then_search(lens, idx, budget, resp[idx], rbudget, padded)
        groups, costs = packer(lens, idx, budget)
        if all(len(g) == 1 or int(resp[g].sum()) <= rbudget for g in groups):
            return groups, costs
        return _pack_two_caps_then_search(lens, idx, budget, resp[idx], rbudget, padded)

    return pack
