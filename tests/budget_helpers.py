"""A synthetic memory backend for budget searches: peaks from a formula, no tensors (test_budget, test_guard).

- :class:`SyntheticBackend`: a step's peak is ``peak_fn(b, s)`` (or ``peak_fn(lengths)``), aborted
  above the limit as the tracked backends abort.
- :func:`shape_step`: the step it measures, returning the candidate's lengths.
"""

from __future__ import annotations

from batchfit.memory import Backend, MemoryMeasurement


class SyntheticBackend(Backend):
    """A backend whose step returns the micro-batch's lengths and whose peak is ``peak_fn(b, s)``.

    ``b`` sequences of ``s`` tokens: a padded candidate; with ``peak_fn`` taking one
    argument, it gets the lengths themselves (packed candidates). Like the cpu/estimate
    backends, a run above ``limit_bytes`` is aborted: it reports the bytes at the abort
    (``limit + 1``, a lower bound) with ``exceeded=True``. ``fail`` injects "does not fit"
    for chosen candidates (an OOM on this rank only).
    """

    name = "synthetic"

    def __init__(self, peak_fn, limit_bytes, fail=()):
        super().__init__()
        self.peak_fn, self._limit, self.fail = peak_fn, limit_bytes, set(fail)
        self.calls = []

    @property
    def limit_bytes(self):
        return self._limit

    def measure(self, fn, register=(), categories=None, host_categories=()):
        lengths = fn()
        b, s = len(lengths), max(lengths)
        self.calls.append((b, s))
        by_lengths = self.peak_fn.__code__.co_argcount == 1
        peak = self.peak_fn(lengths) if by_lengths else self.peak_fn(b, s)
        if (b, s) in self.fail or peak > self._limit:
            return MemoryMeasurement(min(peak, self._limit + 1), False, self._limit, self.name, exceeded=True)
        return MemoryMeasurement(peak, True, self._limit, self.name)

    def _prepare(self, registered, parameters, host_categories):  # measure is overridden
        raise NotImplementedError

    def _running(self, state):
        raise NotImplementedError

    def _result(self, state, exceeded, seconds):
        raise NotImplementedError


def shape_step(lengths):
    return lengths
