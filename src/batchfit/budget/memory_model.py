"""The memory model of a training step: ``peak(b, s) ≈ base + a·b·s + q·b·s²``.

``b`` is the batch size (sequences), ``s`` the sequence length. ``base`` holds what does not
grow with the batch (parameters, gradients, optimizer state), ``a`` the bytes per token
(activations, logits), ``q`` the bytes per token per position (attention scores when the
attention kernel materialises them). :func:`fit_memory_model` fits it by least squares with
non-negative ``a`` and ``q``; :func:`guess_max_batch` turns probes into the next candidate of
the budget search. Pure arithmetic on numbers: no tensors, no devices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from batchfit.errors import InvalidArgument

# (batch_size, seq_len, peak_bytes) of a probe that ran to completion; a packed probe of ``T``
# tokens at length ``s`` counts ``T / s`` sequences (fractional).
Point = tuple[float, int, int]


@dataclass(frozen=True)
class MemoryModel:
    """A fitted ``peak(b, s) = base + linear·b·s + quadratic·b·s²`` (bytes).

    Attributes:
        base: bytes that do not grow with the batch (may be slightly negative when the fit
            extrapolates; it is a fit, not a measurement).
        linear: bytes per token (``a``), ``>= 0``.
        quadratic: bytes per token per position (``q``), ``>= 0``.
        r2: coefficient of determination of the fit on its points (1 = exact).
        max_residual: the largest ``|measured - predicted|`` over the points, in bytes.
        n_points: probes the fit used.
    """

    base: float
    linear: float
    quadratic: float
    r2: float
    max_residual: float
    n_points: int

    def predict(self, batch_size: float, seq_len: float) -> float:
        """Predicted peak bytes of a micro-batch of ``batch_size`` sequences of ``seq_len`` tokens."""
        tokens = batch_size * seq_len
        return self.base + self.linear * tokens + self.quadratic * tokens * seq_len

    def bytes_per_sequence(self, seq_len: float) -> float:
        """Bytes one more sequence of ``seq_len`` tokens adds (``a·s + q·s²``)."""
        return self.linear * seq_len + self.quadratic * seq_len * seq_len

    def max_batch_size(self, seq_len: float, limit_bytes: float) -> float:
        """The (fractional) batch size whose predicted peak equals ``limit_bytes``.

        Returns ``inf`` when the model does not grow with the batch, and a negative number
        when even the base exceeds the limit.
        """
        per = self.bytes_per_sequence(seq_len)
        if per <= 0:
            return math.inf
        return (limit_bytes - self.base) / per

    def to_dict(self) -> dict[str, float | int]:
        """The coefficients and fit quality as plain numbers (JSON-ready)."""
        return asdict(self)


def fit_memory_model(points: Iterable[Point]) -> MemoryModel:
    """Least-squares fit of ``peak = base + a·b·s + q·b·s²`` with ``a, q >= 0``.

    Tries the four supports ``{a, q}``, ``{a}``, ``{q}``, ``{}`` (``base`` always free) and
    keeps the feasible one with the smallest squared error, preferring fewer terms on ties
    (points from one length cannot tell ``a`` from ``q``; they are reported as ``a``).
    Cost: four 3-column least-squares solves, O(n) for n points.

    Args:
        points: ``(batch_size, seq_len, peak_bytes)`` of probes that ran to completion.

    Returns:
        The fitted :class:`MemoryModel`.

    Raises:
        InvalidArgument: no points.

    Example:
        >>> m = fit_memory_model([(1, 10, 130), (2, 10, 160), (1, 20, 180)])  # 100 + 2·bs + 0.1·bs²
        >>> round(m.base), round(m.linear, 3), round(m.quadratic, 3)
        (100, 2.0, 0.1)
    """
    pts = [(float(b), float(s), float(p)) for b, s, p in points]
    if not pts:
        raise InvalidArgument("points must hold at least one (batch_size, seq_len, peak_bytes), but got []")
    data = np.asarray(pts, dtype=np.float64)
    tokens = data[:, 0] * data[:, 1]
    columns = {"a": tokens, "q": tokens * data[:, 1]}
    y = data[:, 2]
    best: tuple[float, int, dict[str, float]] | None = None
    for support in (("a", "q"), ("a",), ("q",), ()):
        coef = _solve(y, [columns[name] for name in support])
        if coef is None or any(c < 0 for c in coef[1:]):
            continue
        values = {"base": coef[0], **dict(zip(support, coef[1:]))}
        sse = float(np.sum((y - _evaluate(values, columns)) ** 2))
        # NOTE: a relative tolerance on ties, so collinear data picks the smaller support.
        if best is None or sse < best[0] * (1 - 1e-9) - 1e-6:
            best = (sse, len(support), values)
    assert best is not None  # the empty support always solves
    values = best[2]
    residual = y - _evaluate(values, columns)
    sst = float(np.sum((y - y.mean()) ** 2))
    sse = float(np.sum(residual**2))
    r2 = 1.0 if sst == 0 else max(0.0, 1.0 - sse / sst)
    return MemoryModel(
        base=float(values["base"]),
        linear=float(values.get("a", 0.0)),
        quadratic=float(values.get("q", 0.0)),
        r2=r2,
        max_residual=float(np.max(np.abs(residual))),
        n_points=len(pts),
    )


def _solve(y: np.ndarray, cols: list[np.ndarray]) -> list[float] | None:
    """Least squares of ``y`` on ``[1, *cols]`` with column scaling; ``None`` if degenerate."""
    design = np.column_stack([np.ones_like(y), *cols])
    scale = np.max(np.abs(design), axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(design / scale, y, rcond=None)
    coef = coef / scale
    if not np.all(np.isfinite(coef)):
        return None
    return [float(c) for c in coef]


def _evaluate(values: dict[str, float], columns: dict[str, np.ndarray]) -> np.ndarray:
    out = np.full_like(columns["a"], values["base"])
    for name in ("a", "q"):
        if name in values:
            out = out + values[name] * columns[name]
    return out


def _secant(at_len: Sequence[tuple[float, int]]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of the line through the two largest batch sizes, if it rises."""
    if len(at_len) < 2:
        return None
    (b1, p1), (b2, p2) = at_len[-2], at_len[-1]
    slope = (p2 - p1) / (b2 - b1)
    if slope <= 0:
        return None
    return p2 - slope * b2, slope


def guess_max_batch(
    points: Iterable[Point], seq_len: int, limit_bytes: float, state_bytes: float = 0.0
) -> float | None:
    """Predict the largest batch size at ``seq_len`` whose peak stays within ``limit_bytes``.

    The guess of the budget search (:func:`batchfit.plan.bracket.largest_fitting`), from
    the probes that ran to completion so far, most local evidence first:

    1. two or more probes at ``seq_len``: the secant through the two largest batch sizes
       (near the limit, where activations dominate; small batches can sit on a plateau set by
       the optimizer step);
    2. one probe at ``seq_len``: the line from the base (the intercepts of the other lengths'
       secants, else ``state_bytes``, the state the step holds whatever its batch) through it;
    3. none: the model fitted on each other length's two largest probes when they span two
       lengths; with one other length ``s0``, its per-sequence slope scaled by ``s/s0`` (for
       ``s < s0``; this over-estimates the slope because ``q >= 0``, so the guess errs small)
       or by ``(s/s0)²`` (for ``s > s0``, erring small again).

    Returns:
        A fractional batch size (the search floors it), ``inf`` when the peak does not grow
        with the batch, or ``None`` when nothing is known yet.

    Example:
        >>> guess_max_batch([(1, 100, 1_100), (2, 100, 1_200)], 100, 2_000)  # 1000 + 100·b
        10.0
    """
    by_len: dict[int, dict[float, int]] = {}
    for b, s, p in points:
        by_len.setdefault(int(s), {})[float(b)] = int(p)
    lines = {s: _secant(sorted(bp.items())) for s, bp in by_len.items()}
    here = sorted(by_len.get(seq_len, {}).items())
    line = lines.get(seq_len)
    if line is not None:
        return _solve_line(*line, limit_bytes)
    intercepts = [ln[0] for s, ln in lines.items() if ln is not None and s != seq_len]
    base = max(0.0, min(intercepts)) if intercepts else max(0.0, float(state_bytes))
    if here:
        b, p = here[-1]
        slope = (p - base) / b if p > base else p / b
        return _solve_line(p - slope * b, slope, limit_bytes)
    others = [s for s in by_len if s != seq_len]
    if not others:
        return None
    if len(others) >= 2:
        near = [(b, s, p) for s in others for b, p in sorted(by_len[s].items())[-2:]]
        guess = fit_memory_model(near).max_batch_size(seq_len, limit_bytes)
    else:
        s0 = others[0]
        b0, p0 = sorted(by_len[s0].items())[-1]
        slope0 = lines[s0][1] if lines[s0] is not None else ((p0 - base) / b0 if p0 > base else p0 / b0)
        ratio = seq_len / s0
        guess = _solve_line(base, slope0 * (ratio if ratio <= 1 else ratio * ratio), limit_bytes)
    low, high = _bounds_from_other_lengths(by_len, seq_len, limit_bytes)
    return min(max(guess, low), high)


def _bounds_from_other_lengths(
    by_len: dict[int, dict[float, int]], seq_len: int, limit_bytes: float
) -> tuple[float, float]:
    """Bounds on the largest batch at ``seq_len`` implied by the model's shape (``a, q >= 0``).

    If ``b0`` sequences of ``s0`` fit, one sequence of ``s`` costs at most ``(s/s0)`` (``s < s0``)
    or ``(s/s0)²`` (``s > s0``) times one of ``s0``, so ``b0·s0/s`` (or ``b0·(s0/s)²``) fits;
    if ``b1`` does not fit, more than ``b1·(s0/s)²`` (or ``b1·s0/s``) does not either.
    These clamp a fitted guess that extrapolates badly; they are not measurements.
    """
    low, high = 0.0, math.inf
    for s0, bp in by_len.items():
        if s0 == seq_len:
            continue
        ratio = s0 / seq_len
        fit = [b for b, p in bp.items() if p <= limit_bytes]
        fail = [b for b, p in bp.items() if p > limit_bytes]
        if fit:
            low = max(low, max(fit) * (ratio if ratio >= 1 else ratio * ratio))
        if fail:
            high = min(high, min(fail) * (ratio * ratio if ratio >= 1 else ratio))
    return low, max(high, low)


def _solve_line(intercept: float, slope: float, limit_bytes: float) -> float:
    if slope <= 0:
        return math.inf
    return (limit_bytes - intercept) / slope


# NOTE [ Each phase is a line in tokens ]
# A step's peak is the largest of its phases' peaks (NOTE [ Phases and regions ]: forward,
# backward and optimizer, at each position of the layer stack), and at one length s each phase's
# peak follows the memory model over the candidate's sequences: what it holds whatever the batch
# (state, gathered parameters, communication buffers, the optimizer step's temporaries) plus
# a·T + q·(k·s² + r²) for T = k·s + r tokens (k whole sequences, one remainder r). Where the
# overall peak sits moves with the tokens: one sequence of qwen2.5-7b peaks in the backward
# through the embedding, 22 in the backward through the head, so a line through the overall
# peaks mispredicts the first far candidate (7 rows where 22 fit). The packed search therefore
# guesses tokens phase by phase, from this length's probes that ran to completion:
# - three or more whose remainders show the curvature (CURVATURE_SHOWS): the model through the
#   three whose peaks are nearest the limit, exact when the step is the model (the synthetic
#   steps of tests/test_budget.py), where lines creep up on the answer one overshoot at a time;
# - else two: the line through the two nearest (q = 0), the secant method;
# - one: the line from what it holds whatever the batch (its breakdown's state categories,
#   STATE_CATEGORIES) through its peak, which errs small where the breakdown counts a
#   batch-independent temporary as activations;
# and takes the fewest tokens at which any phase reaches the limit. A fit with a negative term
# falls back to the line. On the verl example the first length takes 5, 5 and 4 probes (policy,
# its old log-probs, the reference) where rows then a remainder took 6, 6 and 7 (`batchfit
# profile --config examples/verl_grpo.yaml --json`, the trials). A guess only picks the next
# candidate: every answer is still measured to fit, and one token more not to.

PhasePoint = tuple[int, Mapping[str, int], Mapping[str, int]]
"""``(tokens, phase peaks, state bytes at each phase's peak)`` of one probe that ran to completion."""


def guess_tokens_by_phase(points: Sequence[PhasePoint], seq_len: int, limit_bytes: float) -> float | None:
    """The (fractional) token count at which the first phase's peak reaches ``limit_bytes`` (NOTE [ Each phase is a line in tokens ]).

    Args:
        points: completed probes at ``seq_len``, as :data:`PhasePoint`.
        seq_len: the length of the candidates' whole sequences.
        limit_bytes: the search's limit.

    Returns:
        ``T + 0.5`` for the most tokens ``T`` every phase's model keeps within the limit; ``inf``
        when no phase grows with the tokens; ``None`` without points.

    Example:
        >>> guess_tokens_by_phase([(100, {"fwd": 1_100}, {"fwd": 1_000})], 1_000, 2_000)  # 1000 + 1·T
        1000.5
        >>> guess_tokens_by_phase([(100, {"fwd": 1_100}, {}), (200, {"fwd": 1_300}, {})], 1_000, 2_000)
        550.5
    """
    by_phase: dict[str, dict[int, tuple[int, int]]] = {}
    for tokens, peaks, state in points:
        for phase, peak in peaks.items():
            by_phase.setdefault(phase, {})[int(tokens)] = (int(peak), int(state.get(phase, 0)))
    if not by_phase:
        return None
    best = math.inf
    for seen in by_phase.values():
        model = _phase_model(seen, seq_len, limit_bytes)
        if model is not None:
            best = min(best, _most_tokens_within(model, seq_len, limit_bytes) + 0.5)
    return best


_BYTE_ROUNDING = 0.25  # under half a byte: the float error of a model of whole-byte peaks


def _rows_term(tokens: int, seq_len: int) -> int:
    """``k·s² + r²`` of ``tokens = k·s + r``: the quadratic term's tokens × positions."""
    whole, rest = divmod(tokens, seq_len)
    return whole * seq_len * seq_len + rest * rest


def _phase_model(seen: dict[int, tuple[int, int]], seq_len: int, limit: float) -> tuple[float, float, float] | None:
    """``(base, a, q)`` of one phase's peaks ``{tokens: (peak, state)}``; ``None`` when it does not grow."""
    near = sorted(seen.items(), key=lambda item: abs(item[1][0] - limit))
    if len(near) >= 3 and _curvature_shows(near[0][0], near[1][0], near[2][0], seq_len):
        (t1, (p1, _)), (t2, (p2, _)), (t3, (p3, _)) = near[:3]
        rows = np.array([[1.0, t, _rows_term(t, seq_len)] for t in (t1, t2, t3)])
        try:
            base, a, q = np.linalg.solve(rows, np.array([p1, p2, p3], dtype=float))
        except np.linalg.LinAlgError:
            base = a = q = -1.0
        if q * _rows_term(max(t1, t2, t3), seq_len) >= 0.5 and a >= 0:  # a curvature of a byte or more
            return float(base), float(a), float(q)
    if len(near) >= 2:
        (t1, (p1, _)), (t2, (p2, _)) = near[:2]
        slope = (p2 - p1) / (t2 - t1)
        return None if slope <= 0 else (p1 - slope * t1, slope, 0.0)
    ((t1, (p1, state)),) = near
    return None if p1 <= state or t1 <= 0 else (float(state), (p1 - state) / t1, 0.0)


# The share of the largest remainder term (s²/4) by which three probes' remainders must stand off
# a line in tokens for their peaks to tell the q term from the line's (NOTE [ Each phase is a line
# in tokens ]).
CURVATURE_SHOWS = 0.1


def _curvature_shows(t1: int, t2: int, t3: int, seq_len: int) -> bool:
    """Whether three candidates' remainders identify ``q``: ``k·s² + r² = T·s − r·(s − r)``, so ``q``
    is only seen through ``r·(s − r)``, which must stand off a line through the three by
    :data:`CURVATURE_SHOWS` of its largest value, else the fit turns a real step's small
    nonlinearity into a curvature (verl's policy_forward: 4 tokens off)."""
    tokens = np.array([t1, t2, t3], dtype=float)
    rest = tokens % seq_len
    bend = rest * (seq_len - rest)
    line = np.polyfit(tokens, bend, 1)
    return float(np.max(np.abs(bend - np.polyval(line, tokens)))) >= CURVATURE_SHOWS * seq_len * seq_len / 4


def _most_tokens_within(model: tuple[float, float, float], seq_len: int, limit: float) -> int:
    """The most tokens whose ``base + a·T + q·(k·s² + r²)`` stays within ``limit`` (−1 when none)."""
    base, a, q = model
    limit += _BYTE_ROUNDING  # peaks are whole bytes: a model that meets the limit exactly fits
    if q == 0:
        return math.floor((limit - base) / a)
    low, high = -1, 1
    while base + a * high + q * _rows_term(high, seq_len) <= limit:
        low, high = high, high * 2  # the model grows at least linearly: a few doublings
    while high - low > 1:
        mid = (low + high) // 2
        if base + a * mid + q * _rows_term(mid, seq_len) <= limit:
            low = mid
        else:
            high = mid
    return low
