"""AutoBatch's part of the search: the 1-D memory-model guess and the ``[low, high]`` entry point.

The search itself is :func:`batchfit.plan.bracket.largest_fitting` (bracket, bisection, the trial
bound of NOTE [ Trial budget ] in :mod:`batchfit.plan.bracket`); this module adds the guess
:func:`model_guess` and the "even ``low`` does not fit" error. :class:`Trial`,
:class:`SearchResult` and :func:`max_trials` are re-exported from :mod:`batchfit.plan.bracket`.

# NOTE [ Memory-model guess ]
Peak memory of one step is close to ``base + per_sample × batch_size`` (parameters,
gradients and optimizer state in ``base``; activations grow with the batch). With one exact
measurement ``(b0, p0)`` the guess assumes ``base = 0``: ``floor(target × b0 / p0)``, which
is a *lower* bound of the answer whenever ``base >= 0`` and ``p0 <= target``. With more
measurements it is the secant through the largest fitting size and the smallest failing one
above it (regula falsi), or the two largest fitting sizes (:func:`model_guess`). Which of
``g`` (predicted to fit) and ``g + 1`` is probed first: NOTE [ Guided candidate ] in
:mod:`batchfit.plan.bracket`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from batchfit.errors import DoesNotFitError
from batchfit.plan.bracket import SearchResult, Trial, largest_fitting, max_trials
from batchfit.validation import check_int, check_positive_int


def model_guess(trials: Sequence[Trial], target_bytes: int) -> int | None:
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


def search_largest(
    probe: Callable[[int], Trial | bool],
    *,
    low: int,
    high: int,
    target_bytes: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> SearchResult:
    """The largest batch size in ``[low, high]`` for which ``probe`` says it fits.

    :func:`batchfit.plan.bracket.largest_fitting` on ``[low, high]`` starting at ``low``, guided by
    :func:`model_guess` when ``target_bytes`` is given (and ``probe`` returns :class:`Trial`
    with exact peaks). Assumes that fitting is monotone; when it is not, the result still
    satisfies "``batch_size`` fits and ``batch_size + 1`` was probed and did not".

    Args:
        probe: ``probe(batch_size)`` returns the verdict (``bool``) or a :class:`Trial`
            (its ``batch_size`` and ``chosen_by`` are filled in by the search). Exceptions
            propagate unchanged.
        low: smallest candidate (>= 1), probed first.
        high: largest candidate (>= low).
        target_bytes: the byte budget the verdicts were decided against; enables the memory
            model (NOTE [ Memory-model guess ]).
        on_trial: called with each :class:`Trial` as soon as it is decided (progress reporting).

    Returns:
        :class:`~batchfit.plan.bracket.SearchResult` with the size and every trial.

    Raises:
        InvalidArgument: bad bounds.
        DoesNotFitError: ``low`` does not fit (``needed`` = its peak, a lower bound when the
            run was aborted; ``available`` = ``target_bytes``).

    Complexity: at most :func:`max_trials` ``(low, high) = ceil(log2(high - low + 1)) + 3``
    probes (NOTE [ Trial budget ] in :mod:`batchfit.plan.bracket`), for any probe.

    Example:
        >>> search_largest(lambda n: n <= 95, low=1, high=512).batch_size
        95
    """
    low = check_positive_int("low", low)
    high = check_int("high", high, minimum=low)
    if target_bytes is not None:
        target_bytes = check_int("target_bytes", target_bytes, minimum=0)
    budget = target_bytes

    def guess(trials: Sequence[Trial]) -> float | None:
        return None if budget is None else model_guess(trials, budget)

    found = largest_fitting(probe, low=low, high=high, guess=guess, start=low, on_trial=on_trial)
    if found.batch_size < low:
        first = found.trials[0]
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
    return found


__all__ = ["SearchResult", "Trial", "max_trials", "model_guess", "search_largest"]
