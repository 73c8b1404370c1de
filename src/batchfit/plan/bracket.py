"""The largest size that fits: one bracket search over a probe function, shared by every search.

:func:`largest_fitting` knows nothing of tensors, devices or ranks (measuring, OOM handling and
the agreement between ranks live in the probe): it calls ``probe(size)`` for a verdict and an
optional ``guess(trials)`` for a memory model's prediction, and returns a size that was
*measured* to fit while the next one was *measured* not to (STYLE.md rule 5). Users:
:mod:`batchfit.budget` (unbounded, guided by the 2-D model ``peak(b, s)``) and
:mod:`batchfit.autobatch` (``[low, high]``, guided by a 1-D line ``peak(b)``).

The search keeps a bracket ``lo < answer + 1 <= hi``: ``lo`` is the largest size known to fit
(``low - 1`` before anything fits), ``hi`` the smallest known not to (``high + 1``, or
``cap + 1``, or none before a failure; the bound itself is never probed). Each step probes one
size strictly inside: the guess (when the safeguard below allows it), else a blind step --
bisection when bounded; doubling then bisection (a galloping search) when unbounded.

# NOTE [ Trial budget ]
Finishing blindly from ``U = hi - lo - 1`` undecided sizes by midpoints costs
``U.bit_length()`` (= ``ceil(log2(U + 1))``) probes: a midpoint leaves at most ``floor(U / 2)``.
Before each *guided* probe (the guess, or ``start``) the search checks that, whatever its
outcome, the blind strategy could still finish within the bound; when it could not, it takes
the blind step. A potential ``Φ(lo, hi)`` bounds the blind cost still to come:

- bounded, ``[low, high]``: ``Φ = U.bit_length()`` and the bound is
  ``max_trials(low, high) = (high - low).bit_length() + 3 = ceil(log2(high - low + 1)) + 3``.
  Initially ``Φ = (high - low + 1).bit_length() <= (high - low).bit_length() + 1``; a midpoint
  probe adds one trial and lowers ``Φ`` by at least one (``ceil(log2(ceil(x / 2))) =
  ceil(log2 x) - 1`` for ``x >= 2``); a guided probe is made only when ``trials + Φ <= bound``
  holds after either outcome; the loop ends at ``U = 0``. The bound leaves room for two guided
  probes that do not halve the interval.
- unbounded (``high=None``): the blind step is ``min(2·lo, midpoint)`` (``1`` when nothing fits),
  ``Φ = min(U.bit_length(), lo.bit_length() + 1) - 2·lo.bit_length()`` (``U = ∞`` before a
  failure) and the invariant is ``trials + Φ <= 3``. A blind step adds one trial and lowers
  ``Φ`` by at least one (checked exhaustively for ``lo < 300``, ``hi < 1300`` and ``hi = ∞``
  in tests/test_search.py); at the end ``Φ = -2·answer.bit_length()``, so the search makes at
  most ``unbounded_max_trials(answer) = 2·ceil(log2(answer + 1)) + 3`` probes. A guess that
  overshoots costs one probe, not ``log2`` of the overshoot: the gallop restarts from ``lo``.

Both bounds hold for any probe, monotone or not (a non-monotone probe only makes the answer
"fits, and the next size was probed and did not").

# NOTE [ Guided candidate ]
A guess ``p`` (fractional) predicts that ``g = floor(p)`` fits and ``g + 1`` does not. Before a
failure is measured in an unbounded search, the probe goes to ``g`` (a fit gives the model an
exact peak; a failure's peak is an abort's lower bound). Otherwise it goes to the one whose
expected outcome leaves fewer undecided sizes. Either way an accurate guess ends the search in
two probes.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.validation import check_int, check_positive_int, describe

GUIDED_SLACK = 2  # guided probes that may fail to shrink the blind cost (NOTE [ Trial budget ])
_UNBOUNDED_BASE = 1  # Φ(0, ∞) = 1: the unbounded potential before any probe (NOTE [ Trial budget ])
NO_CAP = 2**62  # the cap of an unbounded search given none: far above any batch size

CHOSEN_BY = ("min", "start", "model", "bisect", "double")


@dataclass(frozen=True)
class Trial:
    """One probed size.

    Attributes:
        batch_size: the size probed.
        peak_bytes: peak bytes measured (``None`` when the probe reports only a verdict).
        fits: the verdict the search used.
        exact: ``peak_bytes`` is the true peak; ``False`` when the run was aborted once it
            exceeded the limit, so ``peak_bytes`` is only a lower bound.
        chosen_by: how the size was picked: ``"min"`` (``start`` = ``low``, the first probe),
            ``"start"`` (another ``start``), ``"model"`` (the guess), ``"bisect"`` (midpoint) or
            ``"double"`` (twice the largest fit, unbounded searches).
    """

    batch_size: int
    peak_bytes: int | None
    fits: bool
    exact: bool = True
    chosen_by: str = "bisect"

    def to_dict(self) -> dict[str, object]:
        """The trial as a JSON-ready mapping."""
        return {
            "batch_size": self.batch_size,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "exact": self.exact,
            "chosen_by": self.chosen_by,
        }


@dataclass(frozen=True)
class SearchResult:
    """The outcome of :func:`largest_fitting`.

    Attributes:
        batch_size: the largest size measured to fit; ``low - 1`` when ``low`` was measured not
            to fit. Unless it is the upper bound (``high`` or ``cap``), ``batch_size + 1`` was
            probed and did not fit.
        trials: every probe, in order.
        max_trials: the bound the search guaranteed: :func:`max_trials` when bounded,
            :func:`unbounded_max_trials` of the answer when not.
    """

    batch_size: int
    trials: tuple[Trial, ...]
    max_trials: int

    @property
    def fitting_trial(self) -> Trial | None:
        """The trial of :attr:`batch_size` (``None`` when nothing fits)."""
        return next((t for t in self.trials if t.fits and t.batch_size == self.batch_size), None)

    @property
    def peak_bytes(self) -> int | None:
        """Peak bytes measured at :attr:`batch_size` (``None`` if nothing fits or no peak)."""
        best = self.fitting_trial
        return None if best is None else best.peak_bytes


ProbeFn = Callable[[int], "Trial | bool"]
GuessFn = Callable[[Sequence[Trial]], "float | None"]


def max_trials(low: int, high: int) -> int:
    """The most probes a search on ``[low, high]`` makes: ``ceil(log2(high - low + 1)) + 3``.

    ``ceil(log2(high - low + 1)) + 1`` to bisect (``low`` included) and two guided probes that
    may not halve the interval (NOTE [ Trial budget ]).

    Example:
        >>> max_trials(1, 512)  # ceil(log2(512)) + 3 = 9 + 3
        12
    """
    return (high - low).bit_length() + 1 + GUIDED_SLACK


def unbounded_max_trials(answer: int) -> int:
    """The most probes an unbounded search whose answer is ``answer`` makes: ``2·ceil(log2(answer + 1)) + 3``.

    Doubling to the first failure and bisecting below it cost about ``2·log2(answer)``; the
    constant holds the first probe and two guided probes (NOTE [ Trial budget ]).

    Example:
        >>> unbounded_max_trials(95)  # 2·ceil(log2(96)) + 3 = 2·7 + 3
        17
    """
    return 2 * max(answer, 0).bit_length() + _UNBOUNDED_BASE + GUIDED_SLACK


def potential(lo: int, hi: int, bounded: bool) -> int:
    """``Φ(lo, hi)``: the blind cost still to come, in the units of NOTE [ Trial budget ].

    ``hi`` is the smallest size known not to fit (or the bound + 1). Exposed for the test that
    checks the unbounded invariant exhaustively.
    """
    undecided = (hi - lo - 1).bit_length()
    if bounded:
        return undecided
    return min(undecided, lo.bit_length() + 1) - 2 * lo.bit_length()


def blind_step(lo: int, hi: int, bounded: bool) -> tuple[int, str]:
    """The blind candidate inside ``(lo, hi)``: the midpoint (bounded) or ``min(2·lo, midpoint)``, with its label."""
    middle = (lo + hi) // 2
    double = max(2 * lo, 1)
    if bounded or double > middle:
        return middle, "bisect"
    return double, "double"


def _guided(predicted: float, lo: int, hi: int, prefer_fit: bool) -> int:
    """NOTE [ Guided candidate ]: ``floor(predicted)`` or the size above, inside ``(lo, hi)``."""
    g = hi - 1 if predicted >= hi else lo if predicted <= lo else math.floor(predicted)  # -inf: lo
    if g <= lo:
        return lo + 1  # the model says lo is the answer: confirm lo + 1 fails
    if prefer_fit or g + 1 >= hi:
        return g
    # expected outcomes: g fits (leaves hi - g - 1 undecided) or g + 1 fails (leaves g - lo)
    return g + 1 if g - lo < hi - g - 1 else g


def _as_trial(size: int, outcome: Trial | bool, chosen_by: str) -> Trial:
    if isinstance(outcome, Trial):
        return Trial(size, outcome.peak_bytes, bool(outcome.fits), outcome.exact, chosen_by)
    try:
        if outcome is None:
            raise TypeError
        fits = bool(outcome)
    except Exception:  # None, or a tensor/array of several values
        raise InvalidArgument(
            f"probe({size}) must return a verdict (True/False) or a Trial, but returned {describe(outcome)}"
        ) from None
    return Trial(size, None, fits, False, chosen_by)


def _as_guess(predicted: Any) -> float | None:
    """The guess as a float (NaN for unknown), or ``None``; a clear error for anything else."""
    if predicted is None:
        return None
    if isinstance(predicted, bool) or not isinstance(predicted, numbers.Real):
        raise InvalidArgument(
            f"guess(trials) must return a number (a predicted size; inf, NaN or None for unknown), but returned "
            f"{describe(predicted)}"
        )
    return float(predicted)


def largest_fitting(
    probe: ProbeFn,
    *,
    low: int = 1,
    high: int | None = None,
    cap: int | None = None,
    guess: GuessFn | None = None,
    start: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> SearchResult:
    """The largest size ``>= low`` for which ``probe`` says it fits, guided by ``guess``, verified by measurement.

    Each step probes one size inside the bracket (module docstring): ``start`` first when the
    guess gives none, then the guess (NOTE [ Guided candidate ]) while the trial bound allows it,
    else bisection (bounded) or doubling then bisection (unbounded). With an accurate guess that
    is two probes: the predicted size (fits) and the one above (does not).

    Fitting should be monotone (if ``b`` does not fit, no larger size does); when it is not,
    the result still satisfies "``batch_size`` fits and ``batch_size + 1`` was probed and did
    not", and the bound still holds.

    Args:
        probe: ``probe(size)`` returns the verdict (``bool``) or a :class:`Trial` (its
            ``batch_size`` and ``chosen_by`` are filled in by the search). Exceptions propagate.
        low: the smallest candidate (>= 1).
        high: the largest candidate (>= low), or ``None`` for an unbounded search.
        cap: unbounded searches only: the largest size probed, a safety stop for probes whose
            memory does not grow; reaching it ends the search (``None`` = :data:`NO_CAP`, ``2**62``).
        guess: ``guess(trials_so_far) -> predicted largest fitting size`` (fractional, ``inf``
            for "everything fits", ``None`` or NaN for unknown).
        start: the first candidate when the guess gives none (default ``low``).
        on_trial: called with each :class:`Trial` as soon as it is decided (progress).

    Returns:
        :class:`SearchResult`: the largest measured fit (``low - 1`` if ``low`` does not fit)
        and every trial.

    Raises:
        InvalidArgument: bad ``low``, ``high``, ``cap`` or ``start``, or both ``high`` and ``cap``.

    Complexity: at most :func:`max_trials` ``(low, high) = ceil(log2(high - low + 1)) + 3``
    probes when bounded, :func:`unbounded_max_trials` ``(answer) = 2·ceil(log2(answer + 1)) + 3``
    when not, for any probe and any guess (NOTE [ Trial budget ]).

    Example:
        >>> r = largest_fitting(lambda b: b <= 95, guess=lambda trials: 95.5)
        >>> r.batch_size, [t.batch_size for t in r.trials]
        (95, [95, 96])
        >>> largest_fitting(lambda b: b <= 95, low=1, high=512).batch_size
        95
    """
    for name, fn in (("probe", probe), ("guess", guess), ("on_trial", on_trial)):
        if not callable(fn) and not (fn is None and name != "probe"):
            raise InvalidArgument(f"{name} must be a function, but got {name}={describe(fn)}")
    low = check_positive_int("low", low)
    if high is not None:
        high = check_int("high", high, minimum=low)
        if cap is not None:
            raise InvalidArgument(
                f"cap applies to unbounded searches only, but got cap={cap!r} with high={high!r}; pass one of them"
            )
    if cap is not None:
        cap = check_int("cap", cap, minimum=low)
    start = low if start is None else check_int("start", start, minimum=low)
    bounded = high is not None
    limit = max_trials(low, high) if high is not None else _UNBOUNDED_BASE + GUIDED_SLACK
    top = high if high is not None else (cap if cap is not None else max(NO_CAP, low))
    start = min(start, top)
    lo, hi = low - 1, top + 1  # lo fits (low - 1: nothing yet); hi does not (top + 1: not probed)
    failed = False  # a failure was measured (not just the bound)
    trials: list[Trial] = []

    def allowed(candidate: int) -> bool:
        worst = max(potential(candidate, hi, bounded), potential(lo, candidate, bounded))
        return len(trials) + 1 + worst <= limit

    while hi - lo > 1:
        predicted = _as_guess(guess(trials)) if guess is not None else None
        candidate, chosen_by = blind_step(lo, hi, bounded)
        if predicted is not None and not math.isnan(predicted):
            guided = _guided(predicted, lo, hi, prefer_fit=not bounded and not failed)
            if allowed(guided):
                candidate, chosen_by = guided, "model"
        elif not trials and allowed(start):
            candidate, chosen_by = start, "min" if start == low else "start"
        trial = _as_trial(candidate, probe(candidate), chosen_by)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        if trial.fits:
            lo = candidate
        else:
            hi, failed = candidate, True
    bound = limit if bounded else unbounded_max_trials(lo)
    return SearchResult(batch_size=lo, trials=tuple(trials), max_trials=bound)


__all__ = [
    "GUIDED_SLACK",
    "NO_CAP",
    "GuessFn",
    "ProbeFn",
    "SearchResult",
    "Trial",
    "largest_fitting",
    "max_trials",
    "unbounded_max_trials",
]
