"""The arithmetic of the budget search: a probe function in, the largest fitting batch size out.

:func:`search_max_batch` knows nothing of tensors, devices or ranks: it calls
``probe(batch_size) -> Probe`` and an optional ``guess(probes) -> float`` (the memory model's
prediction, :func:`batchfit.budget.memory_model.guess_max_batch`) and returns a batch size
that was *measured* to fit while the next one was *measured* not to (STYLE.md rule 5).
:func:`doubling_search` is the blind strategy it replaces (SkyRL #1060), kept for the
benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from batchfit.errors import BatchfitError
from batchfit.validation import check_positive_int


@dataclass(frozen=True)
class Probe:
    """One measured candidate: did ``batch_size`` sequences of ``seq_len`` tokens fit?

    Attributes:
        batch_size, seq_len: the candidate.
        peak_bytes: the peak measured; when ``exceeded``, the bytes reached when the step
            was aborted (a lower bound).
        fits: the peak stayed within the search limit (on every rank).
        exceeded: the step was aborted or ran out of memory, so ``peak_bytes`` is only a
            lower bound and the memory model does not use it.
    """

    batch_size: int
    seq_len: int
    peak_bytes: int
    fits: bool
    exceeded: bool = False

    def to_dict(self) -> dict[str, int | bool]:
        """The fields as plain values (JSON-ready)."""
        return asdict(self)


@dataclass(frozen=True)
class SearchResult:
    """The outcome of one search at one sequence length.

    Attributes:
        max_batch_size: the largest batch size measured to fit (0 when even the first
            candidate, 1, does not fit). Unless it equals the search's ``max_batch_size`` cap,
            ``max_batch_size + 1`` was measured not to fit.
        probes: every probe, in the order run.
    """

    max_batch_size: int
    probes: tuple[Probe, ...]

    @property
    def fitting_probe(self) -> Probe | None:
        """The probe of ``max_batch_size`` (``None`` when nothing fits)."""
        return next((p for p in self.probes if p.fits and p.batch_size == self.max_batch_size), None)


ProbeFn = Callable[[int], Probe]
GuessFn = Callable[[Sequence[Probe]], "float | None"]

# After this many probes whose outcome contradicts the guess, the search stops trusting it:
# bisection when bracketed, doubling when not (the safeguard of a safeguarded Newton method).
_MAX_MISSES = 2


def search_max_batch(
    probe: ProbeFn,
    *,
    guess: GuessFn | None = None,
    start: int = 1,
    max_batch_size: int | None = None,
    max_probes: int = 64,
) -> SearchResult:
    """Find the largest batch size that fits, guided by a memory model, verified by measurement.

    Each step keeps a bracket ``lo < answer + 1 <= hi`` (``lo`` measured to fit, ``hi``
    measured not to, ``hi`` unknown at first) and probes the guess floored and clamped into
    ``(lo, hi)``. With a good guess that is two probes: the predicted size (fits) and the one
    above (does not). Guesses that prove wrong twice are replaced by bisection inside the
    bracket, or doubling before there is one, so a bad model costs at most O(log answer)
    probes more. Without ``guess`` the search starts at ``start``, doubles, then bisects.

    The probe must be monotone: if ``b`` does not fit, no larger batch fits.

    Args:
        probe: runs one candidate; returns a :class:`Probe` whose ``fits`` is the verdict.
        guess: ``guess(probes_so_far) -> predicted largest fitting batch size`` (fractional,
            ``inf`` for unbounded, ``None`` for unknown).
        start: the first candidate when the guess gives none.
        max_batch_size: an upper cap (``None`` = no cap); reaching it ends the search.
        max_probes: a guard against a non-monotone probe.

    Returns:
        :class:`SearchResult` with the largest measured fit and every probe.

    Raises:
        InvalidArgument: ``start``, ``max_batch_size`` or ``max_probes`` is not a positive int.
        BatchfitError: ``max_probes`` probes without closing the bracket (a non-monotone
            probe).

    Example:
        >>> fits = lambda b: Probe(b, 1, 10 * b, fits=b <= 95)
        >>> r = search_max_batch(fits, guess=lambda probes: 95.5)
        >>> r.max_batch_size, [p.batch_size for p in r.probes]
        (95, [95, 96])
    """
    start = check_positive_int("start", start)
    max_probes = check_positive_int("max_probes", max_probes)
    if max_batch_size is not None:
        max_batch_size = check_positive_int("max_batch_size", max_batch_size)
    cap = max_batch_size if max_batch_size is not None else 2**62
    lo: int = 0
    hi: int | None = None
    probes: list[Probe] = []
    misses = 0
    while lo < cap and (hi is None or hi - lo > 1):
        if len(probes) >= max_probes:
            raise BatchfitError(
                f"the search made max_probes={max_probes} probes without closing the bracket "
                f"(fits up to {lo}, fails at {hi}); the probe is not monotone in the batch size, or its memory does not "
                "grow with it: pass max_batch_size to cap the search"
            )
        predicted = None if guess is None or misses >= _MAX_MISSES else guess(probes)
        candidate = min(_next_candidate(lo, hi, predicted, start), cap)
        result = probe(candidate)
        probes.append(result)
        if predicted is not None and (candidate <= predicted) != result.fits:
            misses += 1
        if result.fits:
            lo = candidate
        else:
            hi = candidate
    return SearchResult(max_batch_size=lo, probes=tuple(probes))


def _next_candidate(lo: int, hi: int | None, predicted: float | None, start: int) -> int:
    """The guess floored and clamped into ``(lo, hi)``; bisection/doubling without one."""
    if predicted is None or math.isnan(predicted):
        if hi is not None:
            return max((lo + hi) // 2, lo + 1)
        return start if lo == 0 else 2 * lo
    candidate = int(min(predicted, 2**62)) if predicted >= 0 else 0
    candidate = max(candidate, lo + 1)
    if hi is not None:
        candidate = min(candidate, hi - 1)
    return candidate


def doubling_search(probe: ProbeFn, *, start: int = 1, max_batch_size: int | None = None) -> SearchResult:
    """Blind doubling then bisection, as SkyRL #1060 describes its profiler (the baseline).

    Doubles from ``start`` until a size does not fit, then bisects between the last fit and
    the first failure. Cost: about ``2·log2(answer)`` probes, and the doubling overshoots
    the limit by up to 2×.

    Args and Returns: as :func:`search_max_batch` without a guess.

    Example:
        >>> r = doubling_search(lambda b: Probe(b, 1, b, fits=b <= 95))
        >>> r.max_batch_size, len(r.probes)
        (95, 14)
    """
    return search_max_batch(probe, guess=None, start=start, max_batch_size=max_batch_size)
