"""The packed two-cap best fit as it was before issue 29 (a test oracle, not used by batchfit).

``best_fit_packed`` scans the open micro-batches sorted by room from the least that is large
enough to the first whose other room fits: O(m) per sequence when the other cap binds (6.8 s
for 20,000 rollouts). batchfit.plan.two_caps._best_fit_packed must return the same groups, in
the same order (tests/test_packing_two_caps.py); this copy is kept verbatim for that.
"""

from __future__ import annotations

import bisect


def find_fit(rooms: list[tuple[int, int]], need: int, other: list[int], other_need: int) -> int:
    """The first micro-batch in ``rooms`` (sorted (room, id)) with room >= need whose other room fits, or -1."""
    for k in range(bisect.bisect_left(rooms, (need, -1)), len(rooms)):
        b = rooms[k][1]
        if other[b] >= other_need:
            return b
    return -1


def best_fit_packed(
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
            b = find_fit(by_l, length, room_r, r) if tokens else find_fit(by_r, r, room_l, length)
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
