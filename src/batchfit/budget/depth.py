"""Depth extrapolation: measure a deep model's step from two shallow copies of it.

NOTE [ Peak memory is affine in depth ]
A decoder stack of identical layers adds the same bytes per layer to every phase of a
step: its parameters, gradients and optimizer state (sharded or not) and its saved
activations. Within a phase, the memory while layer ``j`` runs is affine in ``j`` away
from the ends of the stack; the two layers at each end differ by constants (FSDP2
prefetches the next layer's parameters and frees the previous layer's reduce-scatter one
layer late; the first layer has no predecessor). So the peak at each *position* -- the
two first layers, the two last, the interior (whose maximum sits at one of its own ends,
the same one at every depth), the embeddings, the head, the optimizer step -- is
``a + b·depth``, and two depths ``k1 < k2`` predict any depth ``L``:
``p(L) = p(k1) + (L - k1)·(p(k2) - p(k1)) / (k2 - k1)``. Which position holds the overall
peak may change with the depth (early in backward for a shallow model, late for a deep
one, or the optimizer step), so each position is extrapolated on its own (NOTE [ Phases
and regions ]) and the step's peak is the largest. The default depths 5 and 6 are the
smallest with an interior in both; 2 and 3 miss FSDP2's interior (measured: 2% low for a
checkpointed FSDP2 step, exact with 5 and 6). Verified to the byte against full-depth
estimates (tests/test_depth.py). Layers must be identical: :func:`uniform_layers` says
when they are not (per-layer attention types, dense-then-sparse MoE stacks), and the
caller then measures the full depth.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from batchfit.budget.side_by_side import Beside, Deferred, call_method
from batchfit.errors import InvalidArgument
from batchfit.memory import Backend, MemoryMeasurement
from batchfit.validation import check_positive_int

#: The two shallow depths measured by default: the smallest with an interior layer in both
#: (NOTE [ Peak memory is affine in depth ]).
DEFAULT_DEPTHS = (5, 6)


def uniform_layers(config: Any) -> bool:
    """True when every decoder layer of ``config`` has the same shape and kind.

    False when ``layer_types`` mixes kinds (sliding and full attention), when some layers
    are dense and others sparse (``mlp_only_layers``, ``first_k_dense_replace``), or when
    ``decoder_sparse_step`` skips layers.
    """
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(set(types)) > 1:
        return False
    if getattr(config, "mlp_only_layers", None):
        return False
    if (getattr(config, "first_k_dense_replace", 0) or 0) > 0:
        return False
    return (getattr(config, "decoder_sparse_step", 1) or 1) <= 1


def _extrapolate(p1: float, p2: float, k1: int, k2: int, depth: int) -> int:
    return round(p1 + (depth - k1) * (p2 - p1) / (k2 - k1))


class DepthExtrapolatedStep:
    """A step of a ``depth``-layer model measured from the same step at two shallow depths.

    :meth:`measure` measures both and extrapolates each phase's peak (NOTE [ Peak memory is
    affine in depth ]); it is a :class:`~batchfit.budget.probe.BudgetStep`.

    Args:
        steps: ``{depth: step}`` for exactly two depths below ``depth``, each a
            :class:`~batchfit.budget.probe.BudgetStep` (a :class:`~batchfit.budget.causal_lm_probe.TrainingStep`).
        depth: the number of layers of the model predicted.
        deeper: the deeper copy's :class:`~batchfit.budget.side_by_side.Beside` when it was built
            in a worker (:func:`build_depth_steps`); by default one over ``steps``' deeper copy.

    Raises:
        InvalidArgument: not two depths, a depth not below ``depth``, or steps on
            different backends.
    """

    def __init__(self, steps: dict[int, Any], depth: int, *, deeper: Beside | None = None):
        self.depth = check_positive_int("depth", depth)
        if len(steps) != 2:
            raise InvalidArgument(
                f"depth extrapolation needs steps at exactly two depths, but got depths={sorted(steps)}"
            )
        self.k1, self.k2 = sorted(steps)
        if self.k1 < 1 or self.k2 >= self.depth:
            raise InvalidArgument(
                f"the measured depths must be in [1, depth), but got depths=({self.k1}, {self.k2}) for depth={self.depth}; measure the full depth instead"
            )
        self.steps = {self.k1: steps[self.k1], self.k2: steps[self.k2]}
        backends = {id(s.backend) for s in self.steps.values()}
        if len(backends) != 1:
            raise InvalidArgument("the two shallow steps must share one backend, but got two backends")
        self.backend: Backend = steps[self.k1].backend
        self._deeper = deeper if deeper is not None else Beside(self.steps[self.k2], self.backend)

    @property
    def only_loss_tokens(self) -> bool:
        """The shallow steps' ``only_loss_tokens`` (a response-only head)."""
        return bool(getattr(self.steps[self.k1], "only_loss_tokens", False))

    @property
    def forward_only(self) -> bool:
        """The shallow steps' ``forward_only`` (a pass under ``no_grad``)."""
        return bool(getattr(self.steps[self.k1], "forward_only", False))

    @property
    def response_fraction(self) -> float | None:
        """The shallow steps' ``response_fraction``."""
        return getattr(self.steps[self.k1], "response_fraction", None)

    def remedies(self) -> list[Any]:
        """The shallow steps' remedies (they share the deep model's settings)."""
        return self.steps[self.k1].remedies()

    def measure(self, lengths: Sequence[int]) -> MemoryMeasurement:
        """The extrapolated measurement of one micro-batch of sequences of ``lengths`` tokens at full depth.

        A shallow run that exceeds the backend's limit decides at once: the full model, at
        least as large, does not fit either (its peak is then a lower bound, ``exceeded``).

        Returns:
            A :class:`~batchfit.memory.MemoryMeasurement` whose peak, phase peaks, breakdown
            and host bytes are extrapolated to :attr:`depth`.
        """
        start = time.perf_counter()
        # NOTE [ Shallow copies measured side by side ]: the deeper copy runs in a worker meanwhile, if any
        pending = self._deeper.start(call_method, "measure", list(lengths))
        try:
            shallow = self.steps[self.k1].measure(lengths)
        except BaseException:
            pending.drop()
            raise
        if shallow.exceeded:
            pending.drop()
            return replace(shallow, seconds=time.perf_counter() - start)
        deeper = pending.get()
        if deeper.exceeded:
            return replace(deeper, seconds=time.perf_counter() - start)
        result = extrapolate(shallow, deeper, self.k1, self.k2, self.depth, self.backend.limit_bytes)
        return replace(result, seconds=time.perf_counter() - start)

    def measure_state(self) -> MemoryMeasurement:
        """The state the step keeps between its calls at full depth, extrapolated from the two shallow steps'."""
        pending = self._deeper.start(call_method, "measure_state")
        shallow = self.steps[self.k1].measure_state()
        deeper = pending.get()
        return extrapolate(shallow, deeper, self.k1, self.k2, self.depth, self.backend.limit_bytes)



def extrapolate(
    m1: MemoryMeasurement, m2: MemoryMeasurement, k1: int, k2: int, depth: int, limit_bytes: int | None
) -> MemoryMeasurement:
    """Extrapolate two measurements at depths ``k1 < k2`` to ``depth``, phase by phase.

    Every phase's peak, the breakdown at the peak phase (each category extrapolated from
    that phase's breakdowns, negatives clamped to 0), the host bytes and the allocator's
    reservation (cuda's ``reserved_bytes``, when both have it) are extrapolated; ``fits``
    compares the larger of peak and reservation with ``limit_bytes``, as cuda's own
    measurements do. Without phase peaks (cuda) the overall peaks are extrapolated.
    """
    line: Callable[[float, float], int] = lambda a, b: _extrapolate(a, b, k1, k2, depth)  # noqa: E731
    phases = sorted(set(m1.phase_peaks) & set(m2.phase_peaks))
    phase_peaks = {ph: line(m1.phase_peaks[ph], m2.phase_peaks[ph]) for ph in phases}
    if phase_peaks:
        top = max(phase_peaks, key=lambda ph: phase_peaks[ph])
        peak = phase_peaks[top]
        b1, b2 = m1.phase_breakdowns.get(top, {}), m2.phase_breakdowns.get(top, {})
    else:
        peak = line(m1.peak_bytes, m2.peak_bytes)
        b1, b2 = m1.breakdown, m2.breakdown
    breakdown = {cat: max(0, line(b1.get(cat, 0), b2.get(cat, 0))) for cat in dict.fromkeys([*b1, *b2])}
    phase_breakdowns = {
        ph: {
            cat: max(0, line(m1.phase_breakdowns[ph].get(cat, 0), m2.phase_breakdowns[ph].get(cat, 0)))
            for cat in dict.fromkeys([*m1.phase_breakdowns[ph], *m2.phase_breakdowns[ph]])
        }
        for ph in phases
        if ph in m1.phase_breakdowns and ph in m2.phase_breakdowns
    }
    reserved = None
    if m1.reserved_bytes is not None and m2.reserved_bytes is not None:
        reserved = max(peak, line(m1.reserved_bytes, m2.reserved_bytes))
    return MemoryMeasurement(
        peak_bytes=peak,
        fits=limit_bytes is None or max(peak, reserved or 0) <= limit_bytes,
        limit_bytes=limit_bytes,
        backend=m2.backend,
        breakdown={k: v for k, v in breakdown.items() if v},
        exceeded=False,
        seconds=m1.seconds + m2.seconds,
        host_bytes=max(0, line(m1.host_bytes, m2.host_bytes)),
        phase_peaks=phase_peaks,
        phase_breakdowns=phase_breakdowns,
        reserved_bytes=reserved,
    )


def build_depth_steps(
    make_step: Callable[[int], Any], depth: int, depths: tuple[int, int] = DEFAULT_DEPTHS, *, backend: Any = None
) -> DepthExtrapolatedStep | Any:
    """The step of a ``depth``-layer model: extrapolated from ``depths`` when ``depth`` is deeper.

    Args:
        make_step: ``make_step(n_layers)`` builds the model with ``n_layers`` layers and
            returns its step.
        depth: the model's real depth.
        depths: the two shallow depths to measure.
        backend: the backend ``make_step`` builds on: given, inside a
            :func:`~batchfit.budget.side_by_side.side_by_side` block the deeper copy is built (and
            then measured) in a worker meanwhile (NOTE [ Shallow copies measured side by side ]).

    Returns:
        ``make_step(depth)`` when ``depth <= max(depths)`` (nothing to gain), else a
        :class:`DepthExtrapolatedStep` over ``make_step(k)`` for ``k`` in ``depths``.
    """
    k1, k2 = sorted(depths)
    if depth <= k2:
        return make_step(depth)
    # NOTE [ Shallow copies measured side by side ]: the deeper copy built in its worker meanwhile
    deeper = None if backend is None else Beside.building(functools.partial(make_step, k2), backend)
    if deeper is None:
        return DepthExtrapolatedStep({k1: make_step(k1), k2: make_step(k2)}, depth)
    shallow = make_step(k1)
    deeper.built()
    return DepthExtrapolatedStep({k1: shallow, k2: Deferred(deeper)}, depth, deeper=deeper)
