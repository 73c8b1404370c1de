"""The report of a confirm: estimate and measurement side by side, per role and per category.

What :func:`batchfit.budget.confirm.confirm_profile` returns (:class:`ConfirmReport`) and the
plan its two halves pass (:class:`ConfirmPlan`): plain records with their rendering-free
properties and their :class:`~batchfit.memory.calibration.Calibration`; running the step is in
:mod:`batchfit.budget.confirm`. NOTE [ Confirm like with like ] there says how the two sides
are made comparable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.budget.model_profile import (
    ModelProfile,
)
from batchfit.budget.options import ProfileOptions
from batchfit.errors import DoesNotFitError
from batchfit.memory import backend_class, format_bytes
from batchfit.memory.calibration import Calibration, ConfirmedRun


@dataclass(frozen=True)
class CategoryConfirmation:
    """One breakdown category: the estimate against the measurement.

    Attributes:
        category: the category (``parameters``, ``activations``, ``logprob_head``, …).
        estimated_bytes: the estimate at the device's rounding (NOTE [ Confirm like with like ]).
        measured_bytes: what the real run held in it at its peak.
    """

    category: str
    estimated_bytes: int
    measured_bytes: int

    @property
    def difference_bytes(self) -> int:
        """``estimated − measured`` (positive: the estimate was high)."""
        return self.estimated_bytes - self.measured_bytes

    @property
    def relative_error(self) -> float | None:
        """``(estimated − measured) / measured``; 0 when both are 0, ``None`` when only the measurement is."""
        return _relative(self.estimated_bytes, self.measured_bytes)

    def to_dict(self) -> dict[str, Any]:
        """``estimated_bytes``, ``measured_bytes``, ``difference_bytes`` and ``relative_error``."""
        return {
            "estimated_bytes": self.estimated_bytes,
            "measured_bytes": self.measured_bytes,
            "difference_bytes": self.difference_bytes,
            "relative_error": self.relative_error,
        }


def _relative(estimated: int, measured: int) -> float | None:
    if measured == 0:
        return 0.0 if estimated == 0 else None
    return (estimated - measured) / measured


@dataclass(frozen=True)
class ConfirmPoint:
    """What :func:`plan_confirm` decided for one role: the shape to run and the estimate to compare.

    Attributes:
        role: the role.
        cost: ``padded`` or ``packed``.
        seq_len: the binding length of the role's budget.
        lengths: the micro-batch's sequence lengths (:func:`~batchfit.budget.probe.candidate_lengths`).
        tokens: the budget at that length (``sum(lengths)`` packed, rows × ``seq_len`` padded).
        profiled_peak_bytes: the search's own peak there (the estimate backend's 512 B rounding).
        estimated_peak_bytes: the estimate at the device's rounding.
        estimated_breakdown: its bytes per category.
        budget_limit_bytes: the limit the search compared with (safety margin × usable).
        safety_margin: that margin.
    """

    role: str
    cost: str
    seq_len: int
    lengths: tuple[int, ...]
    tokens: int
    profiled_peak_bytes: int
    estimated_peak_bytes: int
    estimated_breakdown: dict[str, int]
    budget_limit_bytes: int
    safety_margin: float

    @property
    def shape(self) -> str:
        """``6 × 512 tokens`` (padded) or ``1,300 tokens (2 × 512 + 276)`` (packed)."""
        return _shape(self.cost, self.seq_len, self.lengths)


def _shape(cost: str, seq_len: int, lengths: Sequence[int]) -> str:
    if cost == "padded":
        return f"{len(lengths)} × {seq_len:,} tokens"
    whole = sum(1 for n in lengths if n == seq_len)
    rest = "".join(f" + {n:,}" for n in lengths if n != seq_len)
    return f"{sum(lengths):,} tokens ({whole} × {seq_len:,}{rest})"


@dataclass(frozen=True)
class ConfirmPlan:
    """The estimate half of a confirm (:func:`plan_confirm`); :func:`run_confirm` measures it.

    Plain values only (it pickles, so ranks can be handed one). ``points`` holds each role's
    shape and estimate; ``profile`` is the estimate's :class:`ModelProfile`.

    Attributes:
        model: the model's name (as the profile names it).
        config: the model's ``PretrainedConfig``.
        options: the :class:`ProfileOptions` (the device's backend, memory, reserve; no
            progress callback).
        dtype: the parameters' ``torch.dtype``.
        profile: the estimate, searched against the device's memory and reserve.
        backend: the device: ``cpu`` or ``cuda``.
        memory_limit: the device's bytes (cpu: the limit given; cuda: given, or the device's total).
        reserve_bytes: bytes of ``memory_limit`` no tracker sees (cpu: given or 0; cuda: given or measured).
        round_to: the device's storage rounding, at which ``points`` were estimated.
        untracked_bytes: cuda: memory in use outside torch's allocator before the runs; ``None`` on cpu.
        points: role -> :class:`ConfirmPoint`.
        seconds: wall time of the estimate.
    """

    model: str
    config: Any
    options: ProfileOptions
    dtype: Any
    profile: ModelProfile
    backend: str
    memory_limit: int
    reserve_bytes: int
    round_to: int
    untracked_bytes: int | None
    points: dict[str, ConfirmPoint]
    seconds: float = 0.0


@dataclass(frozen=True)
class RoleConfirmation:
    """One role's confirm run: its shape, the estimate against the measurement per category, the verdict.

    Attributes:
        role: the role.
        cost: ``padded`` or ``packed``.
        seq_len: the binding length.
        lengths: the micro-batch's sequence lengths.
        tokens: its tokens (the budget at that length).
        categories: per category, the estimate (at the device's rounding) and the measurement.
        estimated_peak_bytes: the estimate's peak at the device's rounding.
        measured_peak_bytes: the measured peak (cpu: tracked; cuda: ``max_memory_allocated``);
            a lower bound when ``exceeded``.
        profiled_peak_bytes: the budget search's own peak at this shape (512 B rounding).
        reserved_bytes: cuda: ``max_memory_reserved``; ``None`` on cpu.
        limit_bytes: what the device allows: memory − reserve.
        budget_limit_bytes: the limit the search compared with (safety margin × usable).
        safety_margin: that margin.
        fits: the run fitted the device on every rank (cuda: the reservation too).
        exceeded: the run was stopped at the limit (cpu) or ran out of memory (cuda).
        max_rank_bytes: the largest footprint over the ranks (this rank's on one process).
        seconds: wall time of the run.
    """

    role: str
    cost: str
    seq_len: int
    lengths: tuple[int, ...]
    tokens: int
    categories: tuple[CategoryConfirmation, ...]
    estimated_peak_bytes: int
    measured_peak_bytes: int
    profiled_peak_bytes: int
    reserved_bytes: int | None
    limit_bytes: int
    budget_limit_bytes: int
    safety_margin: float
    fits: bool
    exceeded: bool
    max_rank_bytes: int
    seconds: float

    @property
    def shape(self) -> str:
        """``6 × 512 tokens`` (padded) or ``1,300 tokens (2 × 512 + 276)`` (packed)."""
        return _shape(self.cost, self.seq_len, self.lengths)

    @property
    def relative_error(self) -> float | None:
        """The peak's ``(estimated − measured) / measured``."""
        return _relative(self.estimated_peak_bytes, self.measured_peak_bytes)

    @property
    def max_category_error(self) -> float | None:
        """The largest ``|relative error|`` over the categories (``None`` when one is undefined)."""
        errors = [c.relative_error for c in self.categories]
        if any(e is None for e in errors):
            return None
        return max((abs(e) for e in errors if e is not None), default=0.0)

    @property
    def allocator_overhead_bytes(self) -> int | None:
        """cuda: ``max_memory_reserved − max_memory_allocated``; ``None`` on cpu."""
        return None if self.reserved_bytes is None else self.reserved_bytes - self.measured_peak_bytes

    @property
    def footprint_bytes(self) -> int:
        """What the device's verdict is judged on: the peak, or the reservation when larger."""
        return max(self.measured_peak_bytes, self.reserved_bytes or 0)

    @property
    def within_budget_limit(self) -> bool:
        """The footprint stayed under the search's limit too (the safety margin was not eaten into)."""
        return self.fits and self.footprint_bytes <= self.budget_limit_bytes

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain values; ``categories`` maps each category to :meth:`CategoryConfirmation.to_dict`."""
        return {
            "cost": self.cost,
            "seq_len": self.seq_len,
            "lengths": list(self.lengths),
            "tokens": self.tokens,
            "shape": self.shape,
            "categories": {c.category: c.to_dict() for c in self.categories},
            "peak": {
                "estimated_bytes": self.estimated_peak_bytes,
                "measured_bytes": self.measured_peak_bytes,
                "difference_bytes": self.estimated_peak_bytes - self.measured_peak_bytes,
                "relative_error": self.relative_error,
            },
            "max_category_error": self.max_category_error,
            "profiled_peak_bytes": self.profiled_peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "allocator_overhead_bytes": self.allocator_overhead_bytes,
            "limit_bytes": self.limit_bytes,
            "budget_limit_bytes": self.budget_limit_bytes,
            "safety_margin": self.safety_margin,
            "fits": self.fits,
            "within_budget_limit": self.within_budget_limit,
            "exceeded": self.exceeded,
            "max_rank_bytes": self.max_rank_bytes,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class ConfirmReport:
    """The estimate and, per role, its confirm run on the real device.

    Attributes:
        profile: the estimate (its budgets, tables and breakdowns).
        model: the model's name.
        backend: the device: ``cpu`` or ``cuda``.
        device: the device's name (``torch.cuda.get_device_name``, or ``cpu``).
        memory_limit: the device's bytes.
        reserve_bytes: bytes of it no tracker sees, on both sides.
        round_to: the device's storage rounding, at which the compared estimate was made.
        profiled_round_to: the budget search's rounding (the estimate backend's default).
        roles: role -> :class:`RoleConfirmation`, in the profile's order.
        untracked_bytes: cuda: memory outside torch's allocator (CUDA context, NCCL, other
            processes), the largest of before and after the runs; ``None`` on cpu.
        world_size: the ranks that ran (1 on one process).
        differences: what differs between the estimate and the run, in words (NOTE [ Confirm
            like with like ]).
        estimate_seconds: wall time of the estimate half.
        allocator: cuda: the allocator setting the runs ran under (``caching`` or
            ``expandable_segments``, from ``PYTORCH_CUDA_ALLOC_CONF``: NOTE [ The allocator setting ]
            in :mod:`batchfit.memory.calibration`); ``""`` on cpu or when unknown.
    """

    profile: ModelProfile
    model: str
    backend: str
    device: str
    memory_limit: int
    reserve_bytes: int
    round_to: int
    profiled_round_to: int
    roles: dict[str, RoleConfirmation]
    untracked_bytes: int | None
    world_size: int = 1
    differences: tuple[str, ...] = ()
    estimate_seconds: float = 0.0
    allocator: str = ""

    @property
    def fits(self) -> bool:
        """Every role's run fitted the device."""
        return all(r.fits for r in self.roles.values())

    @property
    def limit_bytes(self) -> int:
        """What the device allows: ``memory_limit − reserve_bytes``."""
        return self.memory_limit - self.reserve_bytes

    @property
    def max_relative_error(self) -> float | None:
        """The largest ``|relative error|`` of any role's peak or category (``None`` when one is undefined)."""
        errors = [r.max_category_error for r in self.roles.values()]
        errors += [r.relative_error for r in self.roles.values()]
        if any(e is None for e in errors):
            return None
        return max((abs(e) for e in errors if e is not None), default=0.0)

    def error(self) -> DoesNotFitError | None:
        """The :class:`DoesNotFitError` of the roles whose run did not fit (one message), or ``None``."""
        failed = [r for r in self.roles.values() if not r.fits]
        if not failed:
            return None
        parts = [self._failure(r) for r in failed]
        worst = max(failed, key=lambda r: r.footprint_bytes)
        exc = DoesNotFitError("; ".join(parts), needed=worst.footprint_bytes, available=self.limit_bytes)
        exc.report = self  # type: ignore[attr-defined]
        return exc

    def _failure(self, r: RoleConfirmation) -> str:
        needed = r.footprint_bytes
        if r.exceeded and needed < self.limit_bytes:
            # NOTE [ The estimate runs CUDA's attention kernel ] was found this way: no margin or
            # reserve brings such a step under the limit, since what it held was already under it
            return (
                f"{r.role}: the confirm run of {r.shape} ({r.cost}) on {self.backend} ran out of memory holding "
                f"{format_bytes(needed)}, below the {format_bytes(self.limit_bytes)} the device allows: one "
                f"allocation asked for more than was left, which the estimate ({format_bytes(r.estimated_peak_bytes)}) "
                f"did not foresee, so the step runs code the estimate does not. Search on the device itself "
                f"(--backend {self.backend}, without --confirm), and report the model and this shape"
            )
        if r.exceeded:
            stop = "ran out of memory" if backend_class(self.backend).reads_device else "was stopped at the limit"
            ran = f"{stop} after {format_bytes(needed)}"
        elif (r.reserved_bytes or 0) > r.measured_peak_bytes:
            ran = f"reserved {format_bytes(needed)} ({format_bytes(r.measured_peak_bytes)} allocated)"
        else:
            ran = f"needs {format_bytes(needed)}"
        # the search's limit shrinks with the margin: margin × limit / needed brings this peak under it
        margin = max(0.01, math.floor(100 * r.safety_margin * self.limit_bytes / max(needed, 1)) / 100)
        short = format_bytes(max(needed - self.limit_bytes, 1))
        calibrate = (
            ""
            if r.exceeded
            else "; or save this device's reserve and margin with --confirm --calibration FILE"
        )
        return (
            f"{r.role}: the confirm run of {r.shape} ({r.cost}) on {self.backend} {ran}, more than the "
            f"{format_bytes(self.limit_bytes)} the device allows (memory {format_bytes(self.memory_limit)} − reserve "
            f"{format_bytes(self.reserve_bytes)}); the estimate said {format_bytes(r.estimated_peak_bytes)}. Lower the "
            f"safety margin to {margin:g} or less (safety_margin, now {r.safety_margin:g}) or raise the reserve by "
            f"{'at least ' if r.exceeded else ''}{short} (reserve_bytes), and profile again{calibrate}"
        )

    def calibration(self) -> Calibration | None:
        """What these runs measured on the device, as a :class:`~batchfit.memory.calibration.Calibration`.

        Built from the runs that ran to the end (a stopped run's peak is only a lower bound);
        ``None`` when none did.
        """
        done = [r for r in self.roles.values() if not r.exceeded and r.estimated_peak_bytes > 0]
        if not done:
            return None
        ratios: dict[str, float] = {}
        for r in done:
            for c in r.categories:
                if c.estimated_bytes > 0:
                    ratio = c.measured_bytes / c.estimated_bytes
                    ratios[c.category] = max(ratios.get(c.category, 0.0), ratio)
        overheads = [r.allocator_overhead_bytes or 0 for r in done]
        fractions = [(r.allocator_overhead_bytes or 0) / max(r.measured_peak_bytes, 1) for r in done]
        return Calibration(
            backend=self.backend,
            device=self.device,
            device_total_bytes=self.memory_limit,
            untracked_bytes=self.untracked_bytes or 0,
            allocator_overhead_bytes=max(0, *overheads),
            allocator_overhead_fraction=round(max(0.0, *fractions), 6),
            estimate_ratio=round(max(r.measured_peak_bytes / r.estimated_peak_bytes for r in done), 6),
            category_ratios={k: round(v, 6) for k, v in ratios.items()},
            runs=tuple(
                ConfirmedRun(
                    role=r.role,
                    seq_len=r.seq_len,
                    tokens=r.tokens,
                    estimated_bytes=r.estimated_peak_bytes,
                    measured_bytes=r.measured_peak_bytes,
                    reserved_bytes=r.reserved_bytes,
                )
                for r in done
            ),
            model=self.model,
            torch_version=str(torch.__version__),
            batchfit_version=_batchfit_version(),
            allocator=self.allocator,
        )

    def to_dict(self) -> dict[str, Any]:
        """The device, what differs, the verdict and each role's run as plain values (JSON-ready)."""
        return {
            "model": self.model,
            "backend": self.backend,
            "device": self.device,
            "memory_limit": self.memory_limit,
            "reserve_bytes": self.reserve_bytes,
            "limit_bytes": self.limit_bytes,
            "round_to": self.round_to,
            "profiled_round_to": self.profiled_round_to,
            "untracked_bytes": self.untracked_bytes,
            "world_size": self.world_size,
            "differences": list(self.differences),
            "fits": self.fits,
            "max_relative_error": self.max_relative_error,
            "estimate_seconds": self.estimate_seconds,
            "allocator": self.allocator,
            "roles": {role: r.to_dict() for role, r in self.roles.items()},
        }


def _batchfit_version() -> str:
    """The installed batchfit's version (the package root is above this layer)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("batchfit")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return ""
