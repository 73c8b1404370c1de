"""What a budget search measures (:class:`BudgetStep`) and what it keeps of each measurement (:class:`Probe`).

The search itself is :func:`batchfit.plan.largest_fitting`; a :class:`BudgetStep` measures one
micro-batch of given sequence lengths (:class:`batchfit.budget.causal_lm_probe.TrainingStep`, the
trainer's own step, or :class:`batchfit.budget.depth.DepthExtrapolatedStep`); a :class:`Probe`
is what the budget keeps of each measured candidate (the memory model needs the length and
the tokens, the report shows every probe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

from batchfit.errors import Phrase, Setting
from batchfit.memory import Backend, MemoryMeasurement

#: What any step's failure to fit one sequence can be helped by (a step names more of its own),
#: naming settings (NOTE [ Messages in the caller's vocabulary ] in :mod:`batchfit.errors`).
GENERIC_REMEDIES = (
    Phrase("reduce ", Setting("max_seq_len")),
    Phrase("give more memory (", Setting("memory_limit"), ", ", Setting("safety_margin"), ")"),
)


@runtime_checkable
class BudgetStep(Protocol):
    """One micro-batch of a training (or forward-only) step, measured at any shape.

    Attributes:
        backend: the :class:`~batchfit.memory.Backend` it measures on.
    """

    backend: Backend

    def measure(self, lengths: Sequence[int]) -> MemoryMeasurement:
        """The peak memory of one micro-batch of sequences of ``lengths`` tokens (``fits=False`` when it ran out)."""
        ...

    def remedies(self) -> list[str | Phrase]:
        """What would make one longer sequence fit, the remedies already in use left out (for error messages).

        A :class:`~batchfit.errors.Phrase` names its settings by their keyword names, so the
        error can be written in the caller's vocabulary (keyword arguments or CLI flags).
        """
        ...


class CallableStep:
    """A :class:`BudgetStep` around a plain function ``fn(lengths)`` that runs one micro-batch.

    Args:
        fn: runs one step on sequences of the given lengths (e.g. random tokens).
        backend: measures it.
        register: state that exists before each call (model, optimizer), counted in the peak
            (:meth:`batchfit.memory.Backend.measure`).
    """

    def __init__(self, fn: Callable[[list[int]], Any], backend: Backend, register: Any = ()):
        self.fn, self.backend, self.register = fn, backend, register

    def measure(self, lengths: Sequence[int]) -> MemoryMeasurement:
        """``backend.measure(lambda: fn(lengths), register=register)``."""
        lengths = list(lengths)
        return self.backend.measure(lambda: self.fn(lengths), register=self.register)

    def remedies(self) -> list[str | Phrase]:
        """Only :data:`GENERIC_REMEDIES`: nothing is known of the function."""
        return list(GENERIC_REMEDIES)


def candidate_lengths(size: int, seq_len: int, cost: str) -> list[int]:
    """The sequences a candidate stands for: ``size`` rows of ``seq_len`` (padded), or ``size`` tokens (packed).

    A packed candidate is as many sequences of ``seq_len`` as fit in ``size`` tokens and one
    shorter remainder: the most memory any split of ``size`` tokens into sequences no longer
    than ``seq_len`` can need (the attention and head terms grow with each sequence's length).

    Example:
        >>> candidate_lengths(3, 4, "padded"), candidate_lengths(10, 4, "packed")
        ([4, 4, 4], [4, 4, 2])
    """
    if cost == "padded":
        return [seq_len] * size
    whole, rest = divmod(size, seq_len)
    return [seq_len] * whole + ([rest] if rest else [])


def response_tokens(length: int, fraction: float | None = None) -> int:
    """The response (loss) tokens of a probe's sequence of ``length`` tokens: ``⌈fraction × length⌉``.

    At most ``length − 1`` (a sequence's first token is never predicted, so at least one
    prompt token), and ``length − 1`` when ``fraction`` is ``None`` (every token the loss
    can read). ``fraction`` is read as the nearest fraction with a denominator up to 10⁶, so
    ``0.2 × 10`` is exactly 2.

    Example:
        >>> response_tokens(10, 0.2), response_tokens(10), response_tokens(1, 0.5)
        (2, 9, 0)
    """
    if fraction is None:
        return max(length - 1, 0)
    share = Fraction(fraction).limit_denominator(10**6)
    return min(max(length - 1, 0), -(-share.numerator * length // share.denominator))


def response_cap(step: Any, lengths: Sequence[int]) -> int | None:
    """The response tokens of ``step``'s micro-batch of ``lengths`` when its head runs only on them, else ``None``.

    A step runs a response-only head when its ``only_loss_tokens`` is true (a
    :class:`~batchfit.budget.causal_lm_probe.TrainingStep`, or a depth-extrapolated one); its sequences
    then hold :func:`response_tokens` ``(L, step.response_fraction)`` response tokens each.
    """
    if not getattr(step, "only_loss_tokens", False):
        return None
    fraction = getattr(step, "response_fraction", None)
    return sum(response_tokens(length, fraction) for length in lengths)


@dataclass(frozen=True)
class Probe:
    """One measured candidate: did ``batch_size`` sequences of at most ``seq_len`` tokens (``tokens`` in all) fit?

    Attributes:
        batch_size: sequences in the micro-batch.
        seq_len: the longest sequence (all of them for a padded candidate; all but a shorter
            remainder for a packed one).
        peak_bytes: the peak measured; when ``exceeded``, the bytes reached when the step
            was aborted (a lower bound).
        fits: the peak stayed within the search limit (on every rank).
        exceeded: the step was aborted or ran out of memory, so ``peak_bytes`` is only a
            lower bound and the memory model does not use it.
        breakdown: this rank's bytes per category at the peak (see
            :class:`batchfit.memory.MemoryMeasurement`); empty when unknown.
        host_bytes: host bytes at the peak (CPU offload), not in ``peak_bytes``.
        tokens: the tokens of every sequence (``batch_size × seq_len`` when ``None``).
        predicted: not run: the probes measured before proved it does not fit, or (on a
            device that cannot run past its limit) that it might run out (real ranks only,
            NOTE [ Skipped only when proven ] in :mod:`batchfit.budget.budget_search`); ``peak_bytes``
            is the bound that decided it.
        phase_peaks: this rank's peak of each phase of the step (NOTE [ Phases and regions ]);
            empty when the backend has none (cuda). Guides the next guess only (NOTE [ Each
            phase is a line in tokens ]), not in :meth:`to_dict`.
        phase_state: this rank's bytes in :data:`~batchfit.memory.categories.STATE_CATEGORIES`
            at each phase's peak.
    """

    batch_size: int
    seq_len: int
    peak_bytes: int
    fits: bool
    exceeded: bool = False
    breakdown: dict[str, int] = field(default_factory=dict, compare=False)
    host_bytes: int = 0
    tokens: int | None = None
    predicted: bool = False
    phase_peaks: dict[str, int] = field(default_factory=dict, compare=False)
    phase_state: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def total_tokens(self) -> int:
        """``tokens``, or ``batch_size × seq_len``."""
        return self.batch_size * self.seq_len if self.tokens is None else self.tokens

    def shape(self) -> str:
        """The candidate in tokens, as the sequences it is made of (for progress lines).

        Whole sequences of ``seq_len`` and, for a packed candidate, one shorter remainder
        (:func:`candidate_lengths`): two packed probes at one length with the same count of
        sequences but different tokens read differently.

        Example:
            >>> Probe(4, 32768, 0, False, tokens=99538).shape(), Probe(3, 8192, 0, True).shape()
            ('3×32,768 + 1,234 = 99,538 tokens', '3×8,192 = 24,576 tokens')
        """
        whole, rest = divmod(self.total_tokens, self.seq_len)
        if self.batch_size != whole + (rest > 0):  # not sequences of seq_len and one remainder
            return f"{self.batch_size:,} sequences ≤ {self.seq_len:,}, {self.total_tokens:,} tokens"
        rows = f"{whole:,}×{self.seq_len:,}" if whole else ""
        if not rest:
            return f"{rows} = {self.total_tokens:,} tokens"
        return f"{rows} + {rest:,} = {self.total_tokens:,} tokens" if whole else f"1×{rest:,} = {rest:,} tokens"

    def to_dict(self) -> dict[str, object]:
        """The fields as plain values (JSON-ready), ``tokens`` filled in."""
        out = {**asdict(self), "tokens": self.total_tokens}
        del out["phase_peaks"], out["phase_state"]
        return out


__all__ = ["GENERIC_REMEDIES", "BudgetStep", "CallableStep", "Probe", "candidate_lengths", "response_cap", "response_tokens"]
