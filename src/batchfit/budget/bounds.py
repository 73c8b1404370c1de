"""What the probes measured so far prove about a candidate's peak: :func:`peak_lower_bound` and :func:`peak_upper_bound`.

Pure arithmetic on :class:`~batchfit.budget.probe.Probe` records (no tensors, no devices). The
budget search on real ranks uses them to decide which candidates it may leave unmeasured
(NOTE [ Skipped only when proven ] in :mod:`batchfit.budget.budget_search`).

NOTE [ The shape of a step's peak ]
Three facts about one micro-batch step, each following from how the step allocates:

1. **More never needs less.** A candidate whose sequences contain another's (as many
   sequences or more, each at least as long, matched longest to longest) peaks at least as
   high. Splitting a sequence into shorter ones, the tokens unchanged, never raises the peak
   (per-token terms stay, attention's terms shrink).
2. **The peak of ``b`` rows of one length is convex in ``b``.** At every point of the step
   the live bytes are an affine function of ``b`` (each tensor is either the state, or has
   the rows as a dimension), so the peak, the largest of them, is convex: the secant through
   two measured row counts, extended beyond them, bounds the peak from *below*; the chord
   between them bounds it from *above*.
3. **The state is live throughout.** Parameters, optimizer state and buffers registered
   before the step (``state`` bytes, read off a probe's breakdown) are live at every point;
   what the step adds at each point is ``c + a·b`` with ``c, a >= 0``. So ``(peak(b) −
   state) / b`` does not grow with ``b``: from a measured ``(b₀, p₀)``, ``peak(b) <= state +
   (b / b₀)·(p₀ − state)`` for ``b >= b₀`` (with ``state = 0``, the line through the origin).

A lower bound above the device proves a candidate does not fit; an upper bound within it
proves it cannot run out of memory. Neither uses the memory model's fit (a fit is not a proof:
a plateau set by the optimizer step made a line through two small probes say "twice the
peak" where 2 % more was measured).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from batchfit.budget.probe import Probe
from batchfit.memory.categories import BUFFERS, OPTIMIZER_STATE, PARAMETERS

#: Breakdown categories live at every point of a step (fact 3): the registered state.
STATE_CATEGORIES = (PARAMETERS, OPTIMIZER_STATE, BUFFERS)


class Shape(NamedTuple):
    """A micro-batch of ``rows`` sequences of ``seq_len`` tokens and one more of ``rest`` (``0 <= rest < seq_len``)."""

    seq_len: int
    rows: int
    rest: int

    @classmethod
    def of(cls, seq_len: int, tokens: int) -> Shape:
        """The shape of a candidate of ``tokens`` tokens at ``seq_len`` (:func:`~batchfit.budget.probe.candidate_lengths`)."""
        rows, rest = divmod(tokens, seq_len)
        return cls(seq_len, rows, rest)

    def counts(self) -> dict[int, int]:
        """``{length: sequences}``."""
        out = {self.seq_len: self.rows} if self.rows else {}
        if self.rest:
            out[self.rest] = out.get(self.rest, 0) + 1
        return out


def _shape(probe: Probe) -> Shape:
    return Shape.of(probe.seq_len, probe.total_tokens)


def contains(big: Shape, small: Shape) -> bool:
    """``big`` holds ``small``'s sequences, matched longest to longest, each at least as long (fact 1).

    Example:
        >>> contains(Shape(512, 2, 0), Shape(512, 1, 300)), contains(Shape(512, 1, 300), Shape(512, 2, 0))
        (True, False)
    """
    have, need = big.counts(), small.counts()
    # for every length x: the sequences of ``big`` at least x long are at least those of ``small``
    return all(
        sum(n for length, n in have.items() if length >= x) >= sum(n for length, n in need.items() if length >= x)
        for x in need
    )


def rows_to_cover(shape: Shape, seq_len: int) -> int | None:
    """How many sequences of ``seq_len`` hold ``shape``'s sequences cut out of them (fact 1); ``None`` if one is longer.

    Example:
        >>> rows_to_cover(Shape(256, 5, 100), 512)  # 2 + 2 + (1 + the 100-token one)
        3
    """
    if shape.rows == 0 and shape.rest == 0:
        return 0
    if max(shape.seq_len if shape.rows else 0, shape.rest) > seq_len:
        return None
    per_row = seq_len // shape.seq_len if shape.rows else 0
    if not shape.rows:
        return 1
    full, used = divmod(shape.rows, per_row)
    rows = full + (1 if used else 0)
    if not shape.rest:
        return rows
    # the last row's room, or the room every full row leaves, takes the remainder
    room = seq_len - used * shape.seq_len if used else seq_len - per_row * shape.seq_len
    return rows if room >= shape.rest else rows + 1


def state_bytes(trials: Iterable[Probe]) -> int:
    """The bytes live throughout a step (fact 3): the smallest state any probe's breakdown shows, 0 without one."""
    seen = [sum(p.breakdown.get(c, 0) for c in STATE_CATEGORIES) for p in trials if p.breakdown]
    return min(seen) if seen else 0


def _row_peaks(trials: Iterable[Probe], seq_len: int) -> list[tuple[int, int]]:
    """``(rows, peak)`` of the whole-row probes of ``seq_len`` that ran to completion, by rows."""
    peaks: dict[int, int] = {}
    for p in trials:
        shape = _shape(p)
        if p.seq_len == seq_len and shape.rest == 0 and shape.rows and not p.exceeded and not p.predicted:
            peaks[shape.rows] = max(p.peak_bytes, peaks.get(shape.rows, 0))
    return sorted(peaks.items())


def peak_lower_bound(trials: Sequence[Probe], seq_len: int, tokens: int) -> int:
    """The most the probes measured so far prove a candidate of ``tokens`` tokens at ``seq_len`` needs (0: nothing).

    A measured probe it contains (fact 1; an aborted probe's peak is a lower bound of its own,
    so it counts), and at its own length the secant of two whole-row probes extended to its
    rows (fact 2).
    """
    shape = Shape.of(seq_len, tokens)
    bound = 0
    for p in trials:
        if not p.predicted and contains(shape, _shape(p)):
            bound = max(bound, p.peak_bytes)
    rows = _row_peaks(trials, seq_len)
    for (b1, p1), (b2, p2) in itertools.pairwise(rows):
        if b2 < shape.rows:
            bound = max(bound, math.floor(p2 + (p2 - p1) / (b2 - b1) * (shape.rows - b2)))
    return bound


def peak_upper_bound(trials: Sequence[Probe], seq_len: int, tokens: int) -> int | None:
    """The least the probes measured so far prove a candidate of ``tokens`` tokens at ``seq_len`` stays within; ``None``: unbounded.

    For each length ``L`` with whole-row probes that ran to completion, the candidate cut into
    ``n`` sequences of ``L`` (:func:`rows_to_cover`, fact 1) is bounded by a measured ``n``, the
    chord between the measured row counts around ``n`` (fact 2), or the line from the state
    through the largest measured below it (fact 3).
    """
    shape = Shape.of(seq_len, tokens)
    state = state_bytes(trials)
    best: float = math.inf
    for length in sorted({p.seq_len for p in trials}):
        n = rows_to_cover(shape, length)
        rows = _row_peaks(trials, length)
        if n is None or not rows:
            continue
        below = [(b, p) for b, p in rows if b <= n]
        above = [(b, p) for b, p in rows if b >= n]
        if above and below:
            (b1, p1), (b2, p2) = below[-1], above[0]
            best = min(best, p1 if b1 == b2 else p1 + (p2 - p1) * (n - b1) / (b2 - b1))
        elif above:
            best = min(best, above[0][1])
        else:
            b0, p0 = below[-1]
            best = min(best, state + n / b0 * max(p0 - state, 0))
    return None if math.isinf(best) else math.ceil(best)


__all__ = ["STATE_CATEGORIES", "Shape", "contains", "peak_lower_bound", "peak_upper_bound", "rows_to_cover", "state_bytes"]
