"""Integer helpers for the batch rules' fixes: divisors, the nearest candidates, "a or b".

Pure functions of integers; time does not grow with the numbers (a fix needs some divisors,
not all), so a 10¹⁶-prompt typo is answered at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# Trial division stops here: fixes need some divisors, not all, and time must not grow with n.
DIVISOR_SEARCH_LIMIT = 100_000


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` (≥ 1), increasing: all of them up to ``n = DIVISOR_SEARCH_LIMIT²`` (10¹⁰);
    above, those up to the limit and their co-divisors (O(limit) time, for a suggested fix)."""
    small, large = [], []
    for i in range(1, min(math.isqrt(n), DIVISOR_SEARCH_LIMIT) + 1):
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
    return small + large[::-1]


def nearest(candidates: Iterable[int], value: int, k: int = 2) -> list[int]:
    """The ``k`` candidates closest to ``value`` (ties to the smaller), in increasing order."""
    return sorted(sorted(set(candidates), key=lambda c: (abs(c - value), c))[:k])


def or_list(values: list[int]) -> str:
    """``[2, 4]`` → ``"2 or 4"``."""
    return " or ".join(str(v) for v in values)


def multiples_near(step: int, value: int, k: int = 2) -> list[int]:
    """The ``k`` positive multiples of ``step`` closest to ``value``."""
    below = max(value // step, 1) * step
    return nearest([below, below + step, max(below - step, step)], value, k)


def splits_heads(sp: int, heads: int, kv_heads: int) -> bool:
    """Ulysses can split ``heads`` query and ``kv_heads`` key/value heads over ``sp`` ranks.

    verl's ``validate_ulysses_config``: ``heads`` divisible by ``sp``; the kv heads divisible by
    ``sp`` or dividing it (they are repeated when fewer than ``sp``). Example: 32 heads, 8 kv
    heads: ``sp=4`` splits, ``sp=3`` does not.
    """
    return heads % sp == 0 and (kv_heads % sp == 0 or sp % kv_heads == 0)


def sequence_parallel_fixes(sp: int, world: int, heads: int, kv_heads: int, k: int = 2) -> tuple[list[int], list[int]]:
    """Valid fixes of a sequence-parallel size: ``(sp sizes, world sizes)``, both empty-able, every one valid.

    The sp sizes (above 1) divide ``world`` and split the heads (:func:`splits_heads`), nearest
    ``sp`` first; the world sizes are multiples of ``sp`` near ``world``, offered only when
    ``sp`` itself splits the heads (more GPUs cannot make 32 heads split over 3).

    Example: ``sequence_parallel_fixes(3, 16, 32, 8) == ([2, 4], [])`` (main suggested 15 or 18 GPUs).
    """
    sizes = nearest([d for d in divisors(world) if d > 1 and splits_heads(d, heads, kv_heads)], sp, k)
    worlds = multiples_near(sp, world, k) if splits_heads(sp, heads, kv_heads) else []
    return sizes, worlds
