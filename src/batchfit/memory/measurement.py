"""The result of measuring one call of a step function: :class:`MemoryMeasurement`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MemoryMeasurement:
    """Peak memory of one call of a step function on one backend.

    Attributes:
        peak_bytes: peak bytes during the call, registered state included (cpu/estimate:
            live tensor storages; cuda: ``torch.cuda.max_memory_allocated``). For a call
            aborted because it exceeded the limit (``exceeded``), the bytes reached at the
            abort: a lower bound of the true peak.
        fits: ``peak_bytes <= limit_bytes`` and not ``exceeded`` (``True`` without a limit
            unless a real OOM happened).
        limit_bytes: usable bytes (``memory_limit - reserve_bytes``), ``None`` = unlimited.
        backend: ``"cpu"``, ``"estimate"`` or ``"cuda"``.
        breakdown: bytes per category at the peak, e.g. ``parameters``, ``gradients``,
            ``optimizer_state``, ``buffers``, ``inputs``, ``activations`` (everything created
            by the step that is not yet a gradient: activations and temporaries). Empty when
            unavailable.
        exceeded: the call was stopped by the limit (cpu/estimate) or by a real OOM (cuda).
        seconds: wall time of the measurement.
        host_bytes: bytes held in host memory at the peak (CPU offload), not in ``peak_bytes``.
        phase_peaks: the peak of each phase of the step (``forward``, ``backward``,
            ``optimizer``; NOTE [ Phases and regions ]); empty when unavailable.
        phase_breakdowns: the breakdown at each phase's peak.
        reserved_bytes: cuda only: the caching allocator's peak reservation
            (``max_memory_reserved``), ``None`` elsewhere.
    """

    peak_bytes: int
    fits: bool
    limit_bytes: int | None
    backend: str
    breakdown: dict[str, int] = field(default_factory=dict)
    exceeded: bool = False
    seconds: float = 0.0
    host_bytes: int = 0
    phase_peaks: dict[str, int] = field(default_factory=dict)
    phase_breakdowns: dict[str, dict[str, int]] = field(default_factory=dict)
    reserved_bytes: int | None = None

    @property
    def footprint_bytes(self) -> int:
        """What a fit is judged on: the peak, or the allocator's reservation when larger (cuda)."""
        return max(self.peak_bytes, self.reserved_bytes or 0)

    @property
    def headroom_bytes(self) -> int | None:
        """``limit_bytes - peak_bytes`` (negative when it does not fit), ``None`` without a limit."""
        return None if self.limit_bytes is None else self.limit_bytes - self.peak_bytes
