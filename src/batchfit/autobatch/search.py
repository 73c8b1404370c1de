"""The arithmetic of the batch-size search: a pure function of ``probe(batch_size)``.

No tensors, devices or ranks here (measuring, OOM handling and the agreement between ranks
live in the probe, :mod:`batchfit.autobatch.find`). The search keeps an open interval
``(lo, hi)`` of undecided sizes, where ``lo`` is the largest size known to fit and ``hi``
the smallest known not to, and shrinks it by probing one size inside at a time.

# NOTE [ Trial budget ]
A bisection probe at the midpoint leaves at most ``floor(U / 2)`` of ``U`` undecided sizes,
so finishing by bisection from ``U`` undecided sizes costs ``U.bit_length()``
(= ``ceil(log2(U + 1))``) probes. The search first probes ``low`` (to know that something
fits), then spends at most ``max_trials(low, high) = (high - low).bit_length() + 3`` probes:
before each *model-guided* probe it checks that, whatever the outcome, bisection could still
finish within that budget; when it could not, it bisects. Proof: the invariant
``trials so far + U.bit_length() <= budget`` holds after probing ``low`` (``1 +
(high - low).bit_length()``), a midpoint probe adds one trial and lowers ``U.bit_length()`` by
at least one (``ceil(log2(ceil(x / 2))) = ceil(log2 x) - 1`` for ``x >= 2``), and a guided probe
is made only when the invariant holds after either outcome; the loop ends at ``U = 0``. The
bound therefore holds for any probe, monotone or not, and leaves room for two guided probes that
do not halve the interval.

# NOTE [ Memory-model guess ]
Peak memory of one step is close to ``base + per_sample × batch_size`` (parameters,
gradients and optimizer state in ``base``; activations grow with the batch). With one exact
measurement ``(b0, p0)`` the guess assumes ``base = 0``: ``floor(target × b0 / p0)``, which
is a *lower* bound of the answer whenever ``base >= 0`` and ``p0 <= target``. With more
measurements it is the secant through the largest fitting size and the smallest failing one
above it (regula falsi), or the two largest fitting sizes (:func:`model_guess`). When the model
predicts that ``g`` fits and ``g + 1`` does not, the probe goes first to the one whose expected
outcome leaves fewer undecided sizes, so an accurate model ends the search in two probes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchfit.errors import DoesNotFitError
from batchfit.validation import check_int, check_positive_int

GUIDED_SLACK = 2  # model-guided probes that may fail to halve the interval (NOTE [ Trial budget ])


@dataclass(frozen=True)
class Trial:
    """One probed batch size.

    Attributes:
        batch_size: the size probed.
        peak_bytes: peak bytes measured (``None`` when the probe reports only a verdict).
        fits: the verdict used by the search.
        exact: ``peak_bytes`` is the true peak; ``False`` when the run was aborted once it
            exceeded the limit, so ``peak_bytes`` is only a lower bound.
        chosen_by: how the size was picked: ``"min"`` (the first probe), ``"model"`` (memory-model
            guess) or ``"bisect"`` (midpoint).
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
    """The outcome of :func:`search_largest`.

    Attributes:
        batch_size: the largest size found to fit; the next size up was probed and did not
            fit, unless ``batch_size`` is the upper bound.
        trials: every probe in order.
        max_trials: the bound the search guarantees (:func:`max_trials`).
    """

    batch_size: int
    trials: tuple[Trial, ...]
    max_trials: int

    @property
    def peak_bytes(self) -> int | None:
        """Peak bytes measured at :attr:`batch_size` (``None`` if the probe gave no peak)."""
        for t in self.trials:
            if t.batch_size == self.batch_size:
                return t.peak_bytes
        return None  # pragma: no cover - the chosen size is always a probed one


def max_trials(low: int, high: int) -> int:
    """The most probes :func:`search_largest` makes on ``[low, high]``: ``ceil(log2(high-low+1)) + 3``.

    One probe of ``low``, ``ceil(log2(high - low + 1))`` to bisect the rest and two model-guided
    probes that may not halve it (NOTE [ Trial budget ]).

    Example:
        >>> max_trials(1, 512)  # ceil(log2(512)) + 3 = 9 + 3
        12
    """
    return (high - low).bit_length() + 1 + GUIDED_SLACK


def _as_trial(batch_size: int, outcome: Trial | bool, chosen_by: str) -> Trial:
    if isinstance(outcome, Trial):
        return Trial(batch_size, outcome.peak_bytes, bool(outcome.fits), outcome.exact, chosen_by)
    return Trial(batch_size, None, bool(outcome), False, chosen_by)


def model_guess(trials: list[Trial], target_bytes: int) -> int | None:
    """The largest batch size the memory model predicts to fit under ``target_bytes``.

    The anchor is the largest size that fit with an exact peak. Its partner is the smallest
    size above it that did not fit (a lower-bound peak from an aborted run counts: the true
    curve passes above it, so the guess errs high and the next failure tightens it, as in
    regula falsi), else the next-largest exact fitting size. One point alone assumes
    ``base = 0`` (NOTE [ Memory-model guess ]). ``None`` when no size fit with an exact peak,
    or when the two points do not grow with the batch size (noise, a flat peak).

    Example:
        >>> t = [Trial(1, 300, True), Trial(4, 600, True)]  # 100/sample above a base of 200
        >>> model_guess(t, 1000)  # 4 + (1000 - 600) // 100
        8
    """
    measured = {t.batch_size: t for t in trials if t.peak_bytes is not None}
    fitting = sorted((t for t in measured.values() if t.fits and t.exact), key=lambda t: t.batch_size)
    if not fitting:
        return None
    anchor = fitting[-1]
    above = sorted(
        (t for t in measured.values() if not t.fits and t.batch_size > anchor.batch_size),
        key=lambda t: t.batch_size,
    )
    other = above[0] if above else (fitting[-2] if len(fitting) > 1 else None)
    if other is None:
        if anchor.peak_bytes <= 0:
            return None
        return target_bytes * anchor.batch_size // anchor.peak_bytes
    (b1, p1), (b2, p2) = sorted(
        [(anchor.batch_size, anchor.peak_bytes), (other.batch_size, other.peak_bytes)]
    )
    if p2 <= p1:
        return None
    return anchor.batch_size + (target_bytes - anchor.peak_bytes) * (b2 - b1) // (p2 - p1)


def _undecided_after(candidate: int, lo: int, hi: int) -> tuple[int, int]:
    """Undecided sizes left if ``candidate`` fits, and if it does not."""
    return hi - candidate - 1, candidate - lo - 1


def _guided_candidate(guess: int, lo: int, hi: int) -> int:
    """Pick between ``guess`` (expected to fit) and ``guess + 1`` (expected not to), inside (lo, hi)."""
    g = min(max(guess, lo), hi - 1)  # the predicted answer, as a decided-or-undecided size
    if g <= lo:
        return lo + 1  # model says lo is the answer: confirm lo + 1 fails
    if g + 1 >= hi:
        return g  # hi is known to fail: confirm g fits
    # Expected outcomes: g fits (leaves hi - g - 1 undecided) or g + 1 fails (leaves g - lo).
    return g + 1 if g - lo < hi - g - 1 else g


def search_largest(
    probe: Callable[[int], Trial | bool],
    *,
    low: int,
    high: int,
    target_bytes: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> SearchResult:
    """The largest batch size in ``[low, high]`` for which ``probe`` says it fits.

    Probes ``low`` first, then model-guided guesses (when ``probe`` returns a :class:`Trial`
    with exact peaks and ``target_bytes`` is given) and midpoints of the undecided interval.
    Assumes that fitting is monotone (if ``b`` fits, every smaller size fits); when it is not,
    the result still satisfies "``batch_size`` fits and ``batch_size + 1`` was probed and did not".

    Args:
        probe: ``probe(batch_size)`` returns the verdict (``bool``) or a :class:`Trial`
            (its ``batch_size`` and ``chosen_by`` are filled in by the search). Exceptions
            propagate unchanged.
        low: smallest candidate (>= 1).
        high: largest candidate (>= low).
        target_bytes: the byte budget the verdicts were decided against; enables the memory
            model (NOTE [ Memory-model guess ]).
        on_trial: called with each :class:`Trial` as soon as it is decided (progress reporting).

    Returns:
        :class:`SearchResult` with the size and every trial.

    Raises:
        InvalidArgument: bad bounds.
        DoesNotFitError: ``low`` does not fit (``needed`` = its peak, a lower bound when the
            run was aborted; ``available`` = ``target_bytes``).

    Complexity: at most :func:`max_trials` ``(low, high) = ceil(log2(high - low + 1)) + 3``
    probes (NOTE [ Trial budget ]), for any probe.

    Example:
        >>> search_largest(lambda n: n <= 95, low=1, high=512).batch_size
        95
    """
    low = check_positive_int("low", low)
    high = check_int("high", high, minimum=low)
    if target_bytes is not None:
        target_bytes = check_int("target_bytes", target_bytes, minimum=0)
    budget = max_trials(low, high)
    first = _as_trial(low, probe(low), "min")
    trials: list[Trial] = [first]
    if on_trial is not None:
        on_trial(first)
    if not first.fits:
        at_least = "" if first.exact else "at least "
        if first.peak_bytes is not None and target_bytes is not None:
            detail = (
                f"its peak is {at_least}{first.peak_bytes:,} bytes against {target_bytes:,} allowed "
                f"(over by {at_least}{first.peak_bytes - target_bytes:,} bytes)"
            )
        else:
            detail = "the probe reported that it does not fit"
        raise DoesNotFitError(
            f"even the smallest candidate low={low} does not fit: {detail}",
            needed=first.peak_bytes,
            available=target_bytes,
        )
    lo, hi = low, high + 1  # lo fits; hi does not (high + 1 stands for "not probed, out of range")
    while hi - lo > 1:
        used = len(trials)
        candidate, chosen_by = (lo + hi) // 2, "bisect"
        guess = model_guess(trials, target_bytes) if target_bytes is not None else None
        if guess is not None:
            guided = _guided_candidate(guess, lo, hi)
            worst = max(_undecided_after(guided, lo, hi))
            if used + 1 + worst.bit_length() <= budget:  # NOTE [ Trial budget ]
                candidate, chosen_by = guided, "model"
        trial = _as_trial(candidate, probe(candidate), chosen_by)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        if trial.fits:
            lo = candidate
        else:
            hi = candidate
    return SearchResult(batch_size=lo, trials=tuple(trials), max_trials=budget)
