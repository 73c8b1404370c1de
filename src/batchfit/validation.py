"""Reusable argument checks with one wording everywhere.

Each check returns the (possibly normalised) value or raises :class:`InvalidArgument`
whose message reads ``"<name> must be <rule>, but got <name>=<value!r>"`` plus a hint.
``bool`` is rejected wherever an integer is meant.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from batchfit.errors import InvalidArgument

T = TypeVar("T")


def is_int(value: Any) -> bool:
    """True for integers (Python or numpy), False for ``bool`` and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` as ``int`` if it is an integer ``>= minimum``; else raise InvalidArgument."""
    if not is_int(value):
        raise InvalidArgument(f"{name} must be an integer, but got {name}={value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, but got {name}={value!r}")
    return value


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as ``int`` if it is an integer ``>= 1``; else raise InvalidArgument."""
    return check_int(name, value, minimum=1)


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as ``float`` if it is a finite real number inside the interval.

    The interval is ``[low, high]``; ``low_open``/``high_open`` exclude the ends.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, but got {name}={value!r}")
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = f"{left}{lo}, {hi}{right}"
        raise InvalidArgument(f"{name} must be in {interval}, but got {name}={value!r}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[T]) -> T:
    """Return ``value`` if it is one of ``choices``; else raise, listing the choices and the closest."""
    options = list(choices)
    if value in options:
        return value
    listed = ", ".join(repr(c) for c in options)
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [str(c) for c in options], n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
    raise InvalidArgument(f"{name} must be one of {listed}, but got {name}={value!r}{hint}")


def closest(value: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to ``value`` by spelling, or ``None`` if nothing is close."""
    found = difflib.get_close_matches(value, list(candidates), n=1)
    return found[0] if found else None
