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
