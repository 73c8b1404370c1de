"""The result of a budget search: :class:`TokenBudget` (and :class:`BudgetPoint`, one per length)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchfit.budget.memory_model import MemoryModel
from batchfit.budget.probe import Probe
from batchfit.errors import InvalidArgument
from batchfit.memory.sizes import format_bytes
from batchfit.plan.packing import COSTS
from batchfit.validation import check_choice, check_positive_int


@dataclass(frozen=True)
class BudgetPoint:
    """The verified largest micro-batch at one probed sequence length, or a verified fit at a length that does not bind.

    A padded search counts sequences: ``max_batch_size`` rows of ``seq_len`` fit and one row
    more does not. A packed search counts tokens (NOTE [ Packed budgets count tokens ] in
    :mod:`batchfit.budget.budget_search`): ``max_tokens`` tokens fit (sequences of ``seq_len`` and one
    shorter remainder) and one token more does not. At a length shorter than one already
    searched, the budget found so far is measured once; when it fits there, that length
    cannot lower the budget and is not searched further (``largest`` is ``False``, NOTE [ A
    length that does not bind ]).

    Attributes:
        seq_len: the probed length.
        max_batch_size: the most whole sequences of ``seq_len`` measured to fit.
        peak_bytes: the peak measured for the largest fitting candidate.
        next_peak_bytes: the peak measured for the candidate one above it (a lower bound when
            that probe was aborted), ``None`` when ``capped``.
        probes: probes spent at this length.
        capped: the search stopped at its batch-size cap, not at the memory limit.
        breakdown: bytes per category at the peak of ``max_batch_size`` (one rank's).
        host_bytes: host bytes at that peak (CPU offload), not in ``peak_bytes``.
        max_tokens: a packed search's largest fitting token count, ``None`` for a padded one.
        response_tokens: with a response-only head, the response (loss) tokens of the
            largest fitting candidate; ``None`` otherwise.
        largest: ``max_batch_size`` (``max_tokens``) is the largest that fits, the next size
            measured not to; ``False``: it was measured to fit and nothing larger was tried.
        measured: ``False`` when the point was not probed but proven to fit by the probes of a
            longer length (NOTE [ Lengths the probes already decide ]); ``peak_bytes`` is then
            that proof's upper bound.
    """

    seq_len: int
    max_batch_size: int
    peak_bytes: int
    next_peak_bytes: int | None
    probes: int
    capped: bool = False
    breakdown: dict[str, int] = field(default_factory=dict, compare=False)
    host_bytes: int = 0
    max_tokens: int | None = None
    response_tokens: int | None = None
    largest: bool = True
    measured: bool = True

    def __repr__(self) -> str:
        """One short line: the length, what fits there and its peak (the breakdown is in :meth:`to_dict`)."""
        how = "" if self.largest and self.measured else (" (not probed)" if not self.measured else " (fits, not the largest)")
        return (
            f"BudgetPoint(seq_len={self.seq_len:,}, max_batch_size={self.max_batch_size:,}, tokens={self.tokens:,}, "
            f"peak={format_bytes(self.peak_bytes)}{', capped' if self.capped else ''}){how}"
        )

    __str__ = __repr__

    @property
    def tokens(self) -> int:
        """The tokens one micro-batch may hold at this length: ``max_tokens``, or ``max_batch_size × seq_len``."""
        return self.max_batch_size * self.seq_len if self.max_tokens is None else self.max_tokens

    def to_dict(self) -> dict[str, Any]:
        """The fields and ``tokens`` as plain values."""
        return {
            "seq_len": self.seq_len,
            "max_batch_size": self.max_batch_size,
            "tokens": self.tokens,
            "peak_bytes": self.peak_bytes,
            "next_peak_bytes": self.next_peak_bytes,
            "probes": self.probes,
            "capped": self.capped,
            "breakdown": dict(self.breakdown),
            "host_bytes": self.host_bytes,
            "response_tokens": self.response_tokens,
            "largest": self.largest,
            "measured": self.measured,
        }


@dataclass(frozen=True)
class TokenBudget:
    """A token budget ``C``: any micro-batch with cost ``<= C`` (and sequences ``<= max_seq_len``) fits.

    With ``cost="padded"`` a micro-batch of ``b`` sequences padded to ``s`` costs ``b·s``;
    with ``cost="packed"`` it costs the sum of its lengths (see ``docs/budget.md`` for what
    each guarantees and how it is checked).

    Attributes:
        tokens: the budget ``C`` = min over probed lengths of their :attr:`BudgetPoint.tokens`.
        max_seq_len: the longest sequence the budget covers.
        cost: ``"padded"`` or ``"packed"``.
        points: one :class:`BudgetPoint` per probed length, longest first.
        memory_model: the fit ``peak(b, s) ≈ base + a·b·s + q·b·s²`` of the probes.
        probes: how many probes (measured training steps) the search ran.
        limit_bytes: the limit the search compared peaks against
            (``safety_margin × usable_bytes``, the minimum over ranks).
        usable_bytes: memory limit minus reserve.
        safety_margin: the fraction of ``usable_bytes`` allowed.
        backend: ``"cpu"``, ``"estimate"`` or ``"cuda"``.
        role: the profiled role (``"policy"``, ``"critic"``, …) or ``None``.
        trials: every probe, in order.
        model_check: what checking the budget against the memory model found.
        parts: for a budget combined by :meth:`min`, the budgets it combines.
        response_tokens: the second cap of a response-only head (NOTE [ A budget in two
            dimensions ]): any micro-batch of cost ``<= tokens`` with ``<= response_tokens``
            response (loss) tokens fits. ``None``: the head runs on every token, no second cap.
        response_fraction: the share of response tokens the probes held (``None``: every
            token but each sequence's first).
    """

    tokens: int
    max_seq_len: int
    cost: str
    points: tuple[BudgetPoint, ...]
    memory_model: MemoryModel | None
    probes: int
    limit_bytes: int
    usable_bytes: int
    safety_margin: float
    backend: str
    role: str | None = None
    trials: tuple[Probe, ...] = ()
    model_check: str = ""
    parts: tuple[TokenBudget, ...] = field(default=())
    response_tokens: int | None = None
    response_fraction: float | None = None

    def __repr__(self) -> str:
        """One short line: ``C``, its length, cost, role, backend, limit and probe count.

        The points, trials and memory model (thousands of characters) are left to
        :meth:`to_dict`; a combined budget lists its parts' roles and tokens.

        Example: ``TokenBudget(tokens=28,672, max_seq_len=4,096, cost='padded', role='policy',
        backend='estimate', limit=61.20 GiB, probes=9)``.
        """
        fields = [f"tokens={self.tokens:,}"]
        if self.response_tokens is not None:
            fields.append(f"response_tokens={self.response_tokens:,}")
        fields += [f"max_seq_len={self.max_seq_len:,}", f"cost={self.cost!r}"]
        if self.role is not None:
            fields.append(f"role={self.role!r}")
        fields += [f"backend={self.backend!r}", f"limit={format_bytes(self.limit_bytes)}", f"probes={self.probes}"]
        if self.parts:
            fields.append("parts=[" + ", ".join(f"{p.role or '?'}: {p.tokens:,}" for p in self.parts) + "]")
        return f"TokenBudget({', '.join(fields)})"

    __str__ = __repr__

    def max_batch_size(self, seq_len: int) -> int:
        """Sequences of ``seq_len`` tokens (padded) one micro-batch may hold: ``tokens // seq_len``.

        Raises:
            InvalidArgument: ``seq_len`` is not an integer in ``[1, max_seq_len]``.

        Example: with ``tokens=12288`` and ``max_seq_len=4096``, ``max_batch_size(1000)`` is
        12 (= 12288 // 1000).
        """
        seq_len = check_positive_int("seq_len", seq_len)
        if seq_len > self.max_seq_len:
            raise InvalidArgument(
                f"seq_len must be <= max_seq_len={self.max_seq_len} (the longest length the budget was "
                f"found for), but got seq_len={seq_len}; run find_token_budget with max_seq_len={seq_len}"
            )
        return self.tokens // seq_len

    def fits(self, batch_size: int, seq_len: int) -> bool:
        """True if ``batch_size`` sequences padded to ``seq_len`` stay within the budget.

        ``False`` (not an error) for ``seq_len > max_seq_len``: the budget says nothing there.

        Raises:
            InvalidArgument: ``batch_size`` or ``seq_len`` is not a positive integer.
        """
        batch_size = check_positive_int("batch_size", batch_size)
        seq_len = check_positive_int("seq_len", seq_len)
        return seq_len <= self.max_seq_len and batch_size * seq_len <= self.tokens

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain values (JSON-ready), parts included."""
        return {
            "tokens": self.tokens,
            "response_tokens": self.response_tokens,
            "response_fraction": self.response_fraction,
            "max_seq_len": self.max_seq_len,
            "cost": self.cost,
            "role": self.role,
            "backend": self.backend,
            "limit_bytes": self.limit_bytes,
            "usable_bytes": self.usable_bytes,
            "safety_margin": self.safety_margin,
            "probes": self.probes,
            "points": [p.to_dict() for p in self.points],
            "breakdown": self.breakdown,
            "memory_model": None if self.memory_model is None else self.memory_model.to_dict(),
            "model_check": self.model_check,
            "trials": [t.to_dict() for t in self.trials],
            "parts": [p.to_dict() for p in self.parts],
        }

    @staticmethod
    def min(*budgets: TokenBudget) -> TokenBudget:
        """Combine budgets of several roles (policy, critic, reference…): the smallest wins.

        The result has the smallest ``tokens``, ``max_seq_len`` and ``response_tokens`` (of
        the budgets that have one); its points,
        memory model and limits are those of the binding budget, ``probes`` is the total,
        ``role`` joins the roles with ``+`` and ``parts`` holds the inputs (a micro-batch
        size shared by every role must fit each of them — SkyRL #1060's critic OOM).

        Raises:
            InvalidArgument: no budgets, a non-budget, or budgets with different ``cost``.

        Example: ``TokenBudget.min(policy, critic).tokens == min(policy.tokens, critic.tokens)``.
        """
        if not budgets:
            raise InvalidArgument("TokenBudget.min needs at least one budget, but got none")
        for i, b in enumerate(budgets):
            if not isinstance(b, TokenBudget):
                raise InvalidArgument(
                    f"TokenBudget.min takes TokenBudget objects, but got budgets[{i}]={b!r} "
                    f"({type(b).__name__})"
                )
        costs = sorted({b.cost for b in budgets})
        if len(costs) > 1:
            raise InvalidArgument(
                f"budgets to combine must share one cost, but got costs={costs!r}; profile every role "
                "with the same cost"
            )
        if len(budgets) == 1:
            return budgets[0]
        binding = min(budgets, key=lambda b: (b.tokens, b.max_seq_len))
        roles = [b.role or f"#{i}" for i, b in enumerate(budgets)]
        caps = [b.response_tokens for b in budgets if b.response_tokens is not None]
        return TokenBudget(
            tokens=binding.tokens,
            max_seq_len=min(b.max_seq_len for b in budgets),
            cost=binding.cost,
            points=binding.points,
            memory_model=binding.memory_model,
            probes=sum(b.probes for b in budgets),
            limit_bytes=binding.limit_bytes,
            usable_bytes=binding.usable_bytes,
            safety_margin=binding.safety_margin,
            backend=binding.backend,
            role="+".join(roles),
            trials=(),
            model_check=binding.model_check,
            parts=tuple(budgets),
            response_tokens=min(caps) if caps else None,
            response_fraction=binding.response_fraction,
        )

    @property
    def binding_point(self) -> BudgetPoint | None:
        """The probed length that sets ``tokens`` (the longest one if several do; a searched one first)."""
        setting = [p for p in self.points if p.tokens == self.tokens]
        return next((p for p in setting if p.largest), setting[0] if setting else None)

    @property
    def breakdown(self) -> dict[str, int]:
        """One rank's bytes per category at the peak of the binding point (empty when unknown)."""
        point = self.binding_point
        return {} if point is None else dict(point.breakdown)

    @property
    def binding_role(self) -> str | None:
        """For a combined budget, the role that sets ``tokens``; else ``role``."""
        if not self.parts:
            return self.role
        return min(self.parts, key=lambda b: (b.tokens, b.max_seq_len)).role


def check_cost(cost: Any) -> str:
    """Validate a cost name (``"padded"`` or ``"packed"``)."""
    return check_choice("cost", cost, COSTS)
