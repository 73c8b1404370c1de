"""A device's own reserve and safety margin, measured by a confirm run: :class:`Calibration`.

``batchfit profile --confirm --calibration FILE`` (:func:`batchfit.budget.confirm.confirm_profile`)
runs the real step once at each role's budget and writes what it saw on the user's device: the
device's total, memory in use outside torch's allocator, the caching allocator's reservation
beyond what was allocated, and how the measured peak compares with the estimate, in all and per
category. ``batchfit profile --calibration FILE`` reads it back and profiles with the reserve and
safety margin it implies (:func:`calibrated_limits`, NOTE [ Calibrated reserve and margin ])
instead of the defaults (the untracked terms of :mod:`batchfit.memory.cuda_untracked`, margin 0.85).

Each file records the allocator setting its runs ran under (:func:`allocator_setting`, NOTE
[ The allocator setting ]): ``caching`` or ``expandable_segments``, ``""`` when unknown.

The file is JSON; :func:`load_calibration` validates every field and names the file and the
field of the first fault. Example::

    >>> cal = Calibration(backend="cuda", device="NVIDIA H100 80GB HBM3", device_total_bytes=85_520_809_984,
    ...                   untracked_bytes=550_000_000, allocator_overhead_bytes=400_000_000,
    ...                   allocator_overhead_fraction=0.02, estimate_ratio=1.003)
    >>> limits = calibrated_limits(cal)
    >>> limits.reserve_bytes, limits.safety_margin   # 0.98 / (1.003 × 1.02) = 0.9579… → 0.957
    (550000000, 0.957)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.memory.sizes import format_bytes
from batchfit.plan.placement import (
    ALLOCATOR_CONF_VARIABLES,
    ALLOCATORS,
    allocator_setting,
    process_allocator_setting,
)
from batchfit.validation import check_choice, check_number, is_int

#: The ``format`` field of a calibration file.
CALIBRATION_FORMAT = "batchfit-calibration"
#: The schema version written and accepted.
CALIBRATION_VERSION = 1
#: The devices a calibration is measured on.
CALIBRATION_BACKENDS = ("cpu", "cuda")
#: The allocator settings a calibration names (NOTE [ The allocator setting ]); ``""``: unknown.
ALLOCATOR_SETTINGS = ("", *ALLOCATORS)
#: Fraction of the usable memory :func:`calibrated_limits` keeps back for what one fresh confirm
#: run cannot show (NOTE [ Calibrated reserve and margin ]).
DEFAULT_SLACK = 0.02


@dataclass(frozen=True)
class ConfirmedRun:
    """One confirm run a calibration was measured from (provenance; the formula reads :class:`Calibration`'s fields).

    Attributes:
        role: the role confirmed (``policy``, ``critic``, …).
        seq_len: the budget's binding length.
        tokens: the micro-batch's tokens.
        estimated_bytes: the estimate's peak at that shape (the device's rounding).
        measured_bytes: the measured peak (cuda: ``max_memory_allocated``).
        reserved_bytes: cuda: ``max_memory_reserved``; ``None`` on cpu.
    """

    role: str
    seq_len: int
    tokens: int
    estimated_bytes: int
    measured_bytes: int
    reserved_bytes: int | None = None


@dataclass(frozen=True)
class Calibration:
    """What a confirm run measured on the user's device, to derive the reserve and margin from.

    Attributes:
        backend: the device measured: ``cuda`` or ``cpu`` (a simulated device of ``--memory``).
        device: the device's name (``torch.cuda.get_device_name``, or ``cpu``).
        device_total_bytes: the memory confirmed: the device's total (cuda, unless a smaller
            ``memory_limit`` was given), or the simulated device's ``memory_limit`` (cpu).
        untracked_bytes: memory in use on the device outside torch's caching allocator (CUDA
            context, NCCL's buffers, other processes): ``total − free − memory_reserved`` at its
            largest, before and after the runs; 0 on cpu.
        allocator_overhead_bytes: the largest ``max_memory_reserved − max_memory_allocated`` of
            the runs (the caching allocator's rounding and fragmentation); 0 on cpu.
        allocator_overhead_fraction: the largest ``(reserved − allocated) / allocated`` of the runs.
        estimate_ratio: the largest ``measured peak / estimated peak`` of the runs.
        category_ratios: ``measured / estimated`` per breakdown category, the largest over the runs
            (categories the estimate put at 0 bytes are left out); for reading, not in the formula.
        runs: the confirm runs measured.
        model: the model confirmed.
        torch_version: the torch that ran them.
        batchfit_version: the batchfit that wrote the file.
        allocator: the CUDA allocator setting the runs ran under, one of :data:`ALLOCATOR_SETTINGS`
            (:func:`allocator_setting`); ``""`` when unknown (a cpu calibration, a file written
            before the field existed).
    """

    backend: str
    device: str
    device_total_bytes: int
    untracked_bytes: int
    allocator_overhead_bytes: int
    allocator_overhead_fraction: float
    estimate_ratio: float
    category_ratios: dict[str, float] = field(default_factory=dict)
    runs: tuple[ConfirmedRun, ...] = ()
    model: str = ""
    torch_version: str = ""
    batchfit_version: str = ""
    allocator: str = ""

    def __post_init__(self) -> None:
        _validate(asdict(self) | {"runs": [asdict(r) for r in self.runs]}, where="Calibration")

    def to_dict(self) -> dict[str, Any]:
        """The calibration as the JSON document :meth:`save` writes (``format`` and ``version`` first)."""
        data = asdict(self)
        data["runs"] = [asdict(r) for r in self.runs]
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, **data}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON to ``path``: a file there is replaced whole or left as it was.

        NOTE [ Writes replace, never truncate ] in :mod:`batchfit.fileio`.

        Raises:
            OSError: the file cannot be written (``path`` is then as it was).
        """
        from batchfit.fileio import write_text

        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "calibration", fix: str | None = None) -> Calibration:
        """Validate a document written by :meth:`to_dict` and build the calibration.

        Raises:
            InvalidArgument: ``where`` (the file), the first field at fault, its value and ``fix``.
        """
        _validate_document(
            data, where, fix or "write it again with batchfit profile --confirm --calibration FILE"
        )
        fields = {k: v for k, v in data.items() if k not in ("format", "version")}
        fields["runs"] = tuple(ConfirmedRun(**r) for r in fields.get("runs", ()))
        fields["category_ratios"] = {k: float(v) for k, v in fields.get("category_ratios", {}).items()}
        for name in ("allocator_overhead_fraction", "estimate_ratio"):
            fields[name] = float(fields[name])
        return cls(**fields)


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Read and validate a calibration file written by ``batchfit profile --confirm --calibration FILE``.

    Raises:
        InvalidArgument: the file is missing, unreadable, not JSON, or a field is missing, unknown
            or out of its domain: one message naming the path and the field, and how to write the
            file again.
    """
    where = f"calibration file {os.fspath(path)!r}"
    again = f"write it again with batchfit profile --confirm --calibration {os.fspath(path)}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise InvalidArgument(
            f"{where} does not exist; write one with batchfit profile --confirm --calibration {os.fspath(path)}"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{where} cannot be read ({exc}); {again}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(
            f"{where} is not JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); {again}"
        ) from None
    return Calibration.from_dict(data, where=where, fix=again)


# The fields of a document, each with its check: value -> the fault after the field's name, or None.
def _need(ok: bool, rule: str, value: Any) -> str | None:
    return None if ok else f" must be {rule}, but got {value!r}"


def _nonneg_int(v: Any) -> str | None:
    return _need(is_int(v) and v >= 0, "an integer >= 0", v)


def _pos_int(v: Any) -> str | None:
    return _need(is_int(v) and v > 0, "an integer > 0", v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _text(v: Any) -> str | None:
    return _need(isinstance(v, str), "a string", v)


def _ratios(v: Any) -> str | None:
    ok = isinstance(v, dict) and all(isinstance(k, str) and _is_number(x) and x >= 0 for k, x in v.items())
    return _need(ok, "an object of category names to finite numbers >= 0", v)


_ALLOCATOR_CHOICES = ", ".join(map(repr, ALLOCATOR_SETTINGS))

_RUN_FIELDS = {
    "role": _text,
    "seq_len": _pos_int,
    "tokens": _pos_int,
    "estimated_bytes": _pos_int,
    "measured_bytes": _pos_int,
    "reserved_bytes": lambda v: None if v is None else _nonneg_int(v),
}


def _runs(v: Any) -> str | None:
    if not isinstance(v, (list, tuple)):
        return _need(False, "a list of confirm runs", v)
    for i, run in enumerate(v):
        if not isinstance(run, dict):
            return f"[{i}] must be an object with the fields {', '.join(_RUN_FIELDS)}, but got {run!r}"
        missing = [k for k in _RUN_FIELDS if k not in run and k != "reserved_bytes"]
        if missing:
            return f"[{i}].{missing[0]} is missing"
        unknown = sorted(set(run) - set(_RUN_FIELDS))
        if unknown:
            return f"[{i}].{unknown[0]} is unknown (the fields are {', '.join(_RUN_FIELDS)})"
        for k, check in _RUN_FIELDS.items():
            fault = check(run.get(k))
            if fault:
                return f"[{i}].{k}{fault}"
    return None


_FIELDS: dict[str, Any] = {
    "backend": lambda v: _need(v in CALIBRATION_BACKENDS, f"one of {', '.join(CALIBRATION_BACKENDS)}", v),
    "device": _text,
    "device_total_bytes": _pos_int,
    "untracked_bytes": _nonneg_int,
    "allocator_overhead_bytes": _nonneg_int,
    "allocator_overhead_fraction": lambda v: _need(_is_number(v) and v >= 0, "a finite number >= 0", v),
    "estimate_ratio": lambda v: _need(_is_number(v) and v > 0, "a finite number > 0", v),
    "category_ratios": _ratios,
    "runs": _runs,
    "model": _text,
    "torch_version": _text,
    "batchfit_version": _text,
    "allocator": lambda v: _need(v in ALLOCATOR_SETTINGS, f"one of {_ALLOCATOR_CHOICES}", v),
}
_REQUIRED = (
    "backend",
    "device",
    "device_total_bytes",
    "untracked_bytes",
    "allocator_overhead_bytes",
    "allocator_overhead_fraction",
    "estimate_ratio",
)


def _validate(data: dict[str, Any], where: str) -> None:
    for name, check in _FIELDS.items():
        fault = check(data[name]) if name in data else None
        if fault:
            raise InvalidArgument(f"{where}: field {name}{fault}")
    total, untracked = data.get("device_total_bytes"), data.get("untracked_bytes")
    if untracked >= total:
        raise InvalidArgument(
            f"{where}: field untracked_bytes must be below device_total_bytes={total}, but got {untracked}"
        )


def _validate_document(data: Any, where: str, again: str) -> None:
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where} must hold a JSON object, but holds a {type(data).__name__}; {again}")
    if data.get("format") != CALIBRATION_FORMAT:
        raise InvalidArgument(
            f"{where}: field format must be {CALIBRATION_FORMAT!r}, but got {data.get('format')!r}; "
            f"is it a calibration file? {again}"
        )
    if data.get("version") != CALIBRATION_VERSION:
        raise InvalidArgument(
            f"{where}: field version must be {CALIBRATION_VERSION}, but got {data.get('version')!r}; {again}"
        )
    for name in _REQUIRED:
        if name not in data:
            raise InvalidArgument(f"{where}: field {name} is missing; {again}")
    unknown = sorted(set(data) - set(_FIELDS) - {"format", "version"})
    if unknown:
        raise InvalidArgument(
            f"{where}: field {unknown[0]!r} is unknown (the fields are {', '.join(_FIELDS)}); {again}"
        )
    try:
        _validate(data, where)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{exc}; {again}") from None


@dataclass(frozen=True)
class CalibratedLimits:
    """The memory, reserve and safety margin a profile should use on a calibrated device.

    Attributes:
        memory_limit: the calibrated device's total bytes.
        reserve_bytes: bytes no tracker sees (the calibration's ``untracked_bytes``).
        safety_margin: the fraction of the usable bytes a peak may reach.
        estimate_ratio: ``r`` of the formula (at least 1).
        overhead_fraction: ``f`` of the formula.
        slack: ``s`` of the formula.
        calibration: the calibration they come from.
    """

    memory_limit: int
    reserve_bytes: int
    safety_margin: float
    estimate_ratio: float
    overhead_fraction: float
    slack: float
    calibration: Calibration

    def profile_settings(self) -> dict[str, Any]:
        """``memory_limit``, ``reserve_bytes`` and ``safety_margin`` as :class:`~batchfit.budget.ProfileOptions` fields."""
        return {
            "memory_limit": self.memory_limit,
            "reserve_bytes": self.reserve_bytes,
            "safety_margin": self.safety_margin,
        }

    def describe(self) -> str:
        """``reserve 524.52 MiB (held outside torch's allocator), safety margin 0.957 = 0.98 / (1.0030 measured/estimated × 1.0200 allocator reserved/allocated), from 2 confirm runs on cuda (…)``."""
        cal = self.calibration
        return (
            f"reserve {format_bytes(self.reserve_bytes)} (held outside torch's allocator), safety margin "
            f"{self.safety_margin:g} = {1 - self.slack:g} / ({self.estimate_ratio:.4f} measured/estimated × "
            f"{1 + self.overhead_fraction:.4f} allocator reserved/allocated), from {len(cal.runs) or 'the'} "
            f"confirm run{'s' if len(cal.runs) != 1 else ''} on {cal.backend} ({cal.device}, "
            f"{format_bytes(cal.device_total_bytes)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The limits and the terms of the formula as plain values."""
        return {
            "memory_limit": self.memory_limit,
            "reserve_bytes": self.reserve_bytes,
            "safety_margin": self.safety_margin,
            "estimate_ratio": self.estimate_ratio,
            "overhead_fraction": self.overhead_fraction,
            "slack": self.slack,
            "backend": self.calibration.backend,
            "device": self.calibration.device,
        }


def calibrated_limits(
    calibration: Calibration, *, backend: str | None = None, slack: float = DEFAULT_SLACK
) -> CalibratedLimits:
    """The reserve and safety margin a profile should use on the calibrated device.

    NOTE [ Calibrated reserve and margin ]
    A budget is safe on the device when the peak ``P`` the search compares with its limit (the
    estimate's, or a tracked run's) leaves room on the real device for everything else:
    ``untracked + reserved ≤ total``, where the caching allocator reserves
    ``reserved = allocated · (1 + f)`` and allocates ``allocated = P · r``. The calibration
    measured each term on the user's device, and the formula takes each at its worst:

    - ``reserve = untracked_bytes``: memory outside torch's allocator (CUDA context, NCCL's
      buffers, other processes), the larger of before and after the confirm runs (NCCL
      allocates on the first collective); 0 on cpu.
    - ``r = max(1, estimate_ratio)``: the largest measured/estimated peak of the runs; an
      estimate that came out high earns no larger margin.
    - ``f = allocator_overhead_fraction``: the largest ``(reserved − allocated) / allocated``.
    - ``safety_margin = (1 − s) / (r · (1 + f))``, rounded down to 3 decimals, where the slack
      ``s`` (:data:`DEFAULT_SLACK` = 2%) keeps back what one fresh run cannot show: a long
      training run's allocator state after many shapes (every confirm run starts from an empty
      cache), and kernels that size their workspaces by shape.

    Then ``P ≤ margin · (total − reserve)`` gives ``untracked + P·r·(1 + f) ≤ (1 − s)·(total −
    untracked) + untracked ≤ total``. Only the total ratio enters: a limit bounds the total, and
    a small category off by rounding (buffers of a few hundred bytes) would otherwise decide the
    margin; the per-category ratios are in the file to read.

    Args:
        calibration: what a confirm measured.
        backend: the backend the profile runs on; a calibration applies to the backend it was
            measured on and to ``estimate`` (which predicts that device). ``None``: not checked.
        slack: ``s`` above, in ``[0, 1)``.

    Returns:
        :class:`CalibratedLimits` (its :meth:`~CalibratedLimits.profile_settings` are
        :class:`~batchfit.budget.ProfileOptions` fields).

    Raises:
        InvalidArgument: a calibration from another device than ``backend``, or a bad ``slack``.
    """
    if not isinstance(calibration, Calibration):
        raise InvalidArgument(
            f"calibration must be a Calibration, but got a {type(calibration).__name__}; load one with load_calibration(path)"
        )
    slack = check_number("slack", slack, low=0.0, high=1.0, high_open=True)
    if backend is not None:
        check_choice("backend", backend, ("cpu", "cuda", "estimate"))
        if backend not in (calibration.backend, "estimate"):
            raise InvalidArgument(
                f"a calibration measured on {calibration.backend} does not apply to backend={backend!r}; "
                f"use backend={calibration.backend!r} or 'estimate', or calibrate on {backend} "
                f"(batchfit profile --confirm --backend {backend} --calibration FILE)"
            )
    r = max(1.0, calibration.estimate_ratio)
    f = calibration.allocator_overhead_fraction
    margin = math.floor((1 - slack) / (r * (1 + f)) * 1000) / 1000
    if margin <= 0:
        raise InvalidArgument(
            f"the calibration's ratios leave no usable memory (estimate_ratio={calibration.estimate_ratio}, "
            f"allocator_overhead_fraction={f}); confirm again (batchfit profile --confirm --calibration FILE)"
        )
    return CalibratedLimits(
        memory_limit=calibration.device_total_bytes,
        reserve_bytes=calibration.untracked_bytes,
        safety_margin=margin,
        estimate_ratio=r,
        overhead_fraction=f,
        slack=slack,
        calibration=calibration,
    )


__all__ = [
    "ALLOCATOR_CONF_VARIABLES",
    "ALLOCATOR_SETTINGS",
    "CALIBRATION_FORMAT",
    "CALIBRATION_VERSION",
    "DEFAULT_SLACK",
    "CalibratedLimits",
    "Calibration",
    "ConfirmedRun",
    "allocator_setting",
    "calibrated_limits",
    "load_calibration",
    "process_allocator_setting",
]
