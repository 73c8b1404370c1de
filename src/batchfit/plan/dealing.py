"""Dealing over data-parallel ranks: whole micro-batches, or sequences then packed per rank.

Pure functions of the lengths and the groups (numpy only);
:func:`batchfit.plan.packing.plan_micro_batches` builds candidates with them and keeps the best.
"""

from __future__ import annotations

import numpy as np

from batchfit.plan.single_cap import Packer

Indices = tuple[int, ...]
"""The input indices of one micro-batch's sequences."""


def _snake(n: int, dp_size: int) -> np.ndarray:
    """Rank of each of ``n`` items dealt boustrophedon: 0..d-1, d-1..0, 0..d-1, ...

    Over items sorted in descending order, the spread of the rank sums is at most the
    largest item minus the smallest: each forward/backward pair of rounds shifts any two
    ranks apart by at most that round's range, and the ranges telescope.
    """
    pos = np.arange(n, dtype=np.int64)
    rnd, col = np.divmod(pos, dp_size)
    return np.where(rnd % 2 == 0, col, dp_size - 1 - col)


def deal_micro_batches(
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


def deal_sequences(
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


def candidate_key(candidate: tuple[list[list[Indices]], list[list[int]]]) -> tuple[int, int]:
    """How a dealt candidate ranks (lower is better): micro-batches per rank, then the largest rank cost."""
    ranks, costs = candidate
    return max(len(r) for r in ranks), max(sum(c) for c in costs)
