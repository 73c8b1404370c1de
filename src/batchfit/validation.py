"""Reusable argument checks with one wording everywhere.

Each check returns the (possibly normalised) value or raises :class:`InvalidArgument`
whose message reads ``"<name> must be <rule>, but got <name>=<value!r>"`` plus a hint.
``bool`` is rejected wherever an integer is meant.
"""

from __future__ import annotations

import difflib
import math
import numbers
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from batchfit.errors import InvalidArgument

T = TypeVar("T")

REPR_LIMIT = 60
"""Longest ``repr`` of a value quoted in an error message (longer ones end in ``...``)."""

MAX_COUNT = 2**62
"""Largest count (samples, ranks, tokens, steps) the public API accepts: far above any real
batch, small enough that products of a few counts and their float ratios stay exact and finite."""


MAX_RANKS = 2**20
"""Largest data-parallel size the public API accepts (each rank is a list in a plan)."""


def short_repr(value: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters (a huge string or tensor stays a short message)."""
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(value: Any) -> str:
    """``repr`` (truncated) and type, for messages: ``"'3' (str)"``."""
    return f"{short_repr(value)} ({type(value).__name__})"


def as_number(value: Any) -> Any:
    """A number written as a string (``"1e-3"``, ``"0.5"``: YAML reads a float without a dot as a string, command-line
    overrides are strings) as a float; anything else unchanged, for a check to judge.

        >>> as_number("1e-3"), as_number(2), as_number("two")
        (0.001, 2, 'two')
    """
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def is_int(value: Any) -> bool:
    """True for integers (Python or numpy), False for ``bool`` and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as ``int`` if it is an integer in ``[minimum, maximum]``; else raise InvalidArgument.

    A 0-d integer tensor or numpy scalar counts as an integer; ``bool`` does not.
    """
    if isinstance(value, _array_types()) and value.ndim == 0 and _integer_dtype(value.dtype):
        value = value.item()
    if not is_int(value):
        raise InvalidArgument(f"{name} must be an integer, but got {name}={describe(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, but got {name}={short_repr(value)}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(
            f"{name} must be an integer <= {maximum:,}, but got {name}={short_repr(value)}; "
            "is it a typo, or a count in the wrong unit?"
        )
    return value


def _array_types() -> tuple[type, ...]:
    """numpy arrays, and tensors when torch is loaded (a value cannot be a tensor otherwise: stay light)."""
    torch = sys.modules.get("torch")
    return (np.ndarray, torch.Tensor) if torch is not None else (np.ndarray,)


def _scalar_types() -> tuple[type, ...]:
    return (np.generic, *_array_types())


def _integer_dtype(dtype: Any) -> bool:
    """An integer dtype of numpy or torch (bool excluded)."""
    if hasattr(dtype, "is_floating_point"):  # torch.dtype
        return not dtype.is_floating_point and not dtype.is_complex and str(dtype) != "torch.bool"
    return bool(np.issubdtype(dtype, np.integer))


def check_count(name: str, value: Any, *, minimum: int = 1) -> int:
    """An integer in ``[minimum, MAX_COUNT]``: a size, a rank count, a number of rows or steps."""
    return check_int(name, value, minimum=minimum, maximum=MAX_COUNT)


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` as ``bool`` if it is ``True``/``False`` (numpy's included); else raise."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidArgument(f"{name} must be True or False, but got {name}={describe(value)}")


def check_key(name: str, value: Any) -> str:
    """A field name of a batch: a ``str``."""
    if not isinstance(value, str):
        raise InvalidArgument(
            f"{name} must be the name of a batch field (a str such as 'attention_mask'), but got {name}={describe(value)}"
        )
    return value


def check_keys(name: str, value: Any) -> list[str] | None:
    """``None`` or a list/tuple of field names (``str``)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise InvalidArgument(
            f"{name} must be None or a list of field names (e.g. ['input_ids']), but got {name}={describe(value)}"
        )
    for i, key in enumerate(value):
        check_key(f"{name}[{i}]", key)
    return list(value)


def check_int_sequence(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> list[int]:
    """A 1-D sequence of integers (list, tuple, 1-D integer tensor or array) as a list of ints.

    Bools, floats, strings, nested lists and tensors of another rank or dtype are refused.
    """
    if isinstance(value, _array_types()):
        if value.ndim != 1 or not (_integer_dtype(value.dtype) or value.shape[0] == 0):
            shape = tuple(value.shape)
            raise InvalidArgument(
                f"{name} must be a 1-D integer tensor or a list of ints, but got a {type(value).__name__} "
                f"of shape {shape} and dtype {value.dtype}"
            )
        items = value.tolist()
    elif isinstance(value, (list, tuple, range)):
        items = list(value)
    else:
        raise InvalidArgument(
            f"{name} must be a list, tuple or 1-D integer tensor of ints, but got {name}={describe(value)}"
        )
    out = []
    for i, item in enumerate(items):
        if isinstance(item, _scalar_types()) and getattr(item, "ndim", 0) == 0:
            item = item.item()
        if not is_int(item):
            raise InvalidArgument(f"{name} must hold integers only, but got {name}[{i}]={describe(item)}")
        item = int(item)
        if (minimum is not None and item < minimum) or (maximum is not None and item > maximum):
            lo = "-inf" if minimum is None else minimum
            hi = "inf" if maximum is None else f"{maximum:,}"
            raise InvalidArgument(f"{name} must hold integers in [{lo}, {hi}], but got {name}[{i}]={short_repr(item)}")
        out.append(item)
    return out


def check_ranges(name: str, value: Any) -> list[tuple[int, int]]:
    """A sequence of ``(start, end)`` integer pairs as a list of tuples (bounds are checked by the caller)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise InvalidArgument(
            f"{name} must be a list of (start, end) row ranges such as [(0, 4), (4, 8)], but got {name}={describe(value)}"
        )
    out = []
    for k, pair in enumerate(value):
        if isinstance(pair, _array_types()):
            pair = pair.tolist()
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(is_int(v) for v in pair):
            raise InvalidArgument(
                f"{name} must be a list of (start, end) pairs of integers, but got {name}[{k}]={describe(pair)}"
            )
        out.append((int(pair[0]), int(pair[1])))
    return out


def check_mapping(name: str, value: Any, *, optional: bool = True) -> dict[Any, Any]:
    """``None`` (when ``optional``, as ``{}``) or a mapping, as a ``dict``."""
    if value is None and optional:
        return {}
    if not isinstance(value, Mapping):
        what = "None or a mapping" if optional else "a mapping"
        raise InvalidArgument(f"{name} must be {what} (a dict of field name to value), but got {name}={describe(value)}")
    return dict(value)


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
        raise InvalidArgument(f"{name} must be a finite number, but got {name}={short_repr(value)}")
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
    if any(_equal(value, c) for c in options):
        return value
    listed = ", ".join(repr(c) for c in options)
    hint = ""
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [str(c) for c in options], n=1)
        if close:
            hint = f"; did you mean {close[0]!r}?"
    raise InvalidArgument(f"{name} must be one of {listed}, but got {name}={short_repr(value)}{hint}")


def _equal(value: Any, choice: Any) -> bool:
    """``value == choice`` as ``in`` tests it, False when the comparison is not a truth value (arrays)."""
    try:
        return value is choice or bool(value == choice)
    except Exception:  # numpy/torch arrays compare element-wise
        return False


def closest(value: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to ``value`` by spelling, or ``None`` if nothing is close."""
    found = difflib.get_close_matches(value, list(candidates), n=1)
    return found[0] if found else None
