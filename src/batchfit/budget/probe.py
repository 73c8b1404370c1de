"""One measured candidate of the budget search: :class:`Probe` (a batch size at a sequence length).

The search itself is :func:`batchfit.search.largest_fitting`; a :class:`Probe` is what the
budget keeps of each step it measured (the 2-D memory model needs the length, the report
shows every probe).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from batchfit.search import Trial


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
        breakdown: this rank's bytes per category at the peak (see
            :class:`batchfit.memory.MemoryMeasurement`); empty when unknown.
        host_bytes: host bytes at the peak (CPU offload), not in ``peak_bytes``.
    """

    batch_size: int
    seq_len: int
    peak_bytes: int
    fits: bool
    exceeded: bool = False
    breakdown: dict[str, int] = field(default_factory=dict, compare=False)
    host_bytes: int = 0

    def to_dict(self) -> dict[str, object]:
        """The fields as plain values (JSON-ready)."""
        return asdict(self)

    def as_trial(self) -> Trial:
        """The verdict and peak as the search's :class:`~batchfit.search.Trial` (``exact`` = not ``exceeded``)."""
        return Trial(self.batch_size, self.peak_bytes, self.fits, exact=not self.exceeded)


__all__ = ["Probe"]
