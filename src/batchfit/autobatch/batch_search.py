"""``find_batch_size``: the search of :mod:`~batchfit.autobatch.batch_guess` on a memory backend, on every rank.

# NOTE [ Ranks agree on every trial ]
Every rank runs every trial. After each trial one all-reduce (max) of
``[does not fit, failing rank + 1, peak bytes, peak is a lower bound]`` gives every rank the
same verdict (any rank over its own target = does not fit), the same peak (the largest) and
the same error flag; the byte target used by the memory model is the smallest over the
ranks. The search is a deterministic function of these, so every rank probes the same sizes
in the same order, runs the same number of collectives and returns the same size: no rank
waits on another (Linnaeus searches on rank 0 and the other ranks time out). The trial itself
must not communicate: a rank that runs out of memory mid-step would leave its peers waiting
in, e.g., DDP's gradient all-reduce. Measure the unwrapped module (``ddp_model.module``); DDP's
gradient buckets (about one more copy of the gradients) are then not counted, so keep room for
them in the fraction or the reserve. An exception
other than running out of memory on one rank is re-raised there, and the other ranks raise
:class:`~batchfit.errors.BatchfitError` naming that rank instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from batchfit.autobatch.batch_guess import Trial, search_largest
from batchfit.autobatch.task import TaskTrial, is_task
from batchfit.autobatch.task_names import MODES
from batchfit.errors import DoesNotFitError, InvalidArgument, Phrase, Setting
from batchfit.memory import Backend, format_bytes, get_backend
from batchfit.parallel.distributed import (
    agree,
    agreed_max,
    all_reduce_min,
    check_same_arguments,
    get_rank,
    get_world_size,
)
from batchfit.validation import check_choice, check_int, check_number, check_positive_int

logger = logging.getLogger("batchfit.autobatch")

ProgressCallback = Callable[[Trial], None]


@dataclass(frozen=True)
class BatchSizeResult:
    """The batch size chosen by :func:`find_batch_size`, with every trial behind it.

    Attributes:
        batch_size: the largest size whose peak stayed within ``target_bytes`` on every rank.
        mode: ``"train"`` or ``"val"``.
        memory_fraction: the target fraction of :attr:`limit_bytes`.
        target_bytes: ``floor(memory_fraction × limit_bytes)``, the smallest over the ranks:
            what each peak is compared against (``peak <= target`` = fits).
        limit_bytes: this rank's usable bytes, ``backend.limit_bytes`` (``memory_limit`` minus
            the reserve; on cuda, total device memory minus the reserve by default).
        peak_bytes: the peak measured at :attr:`batch_size` (largest over the ranks).
        trials: every probe in order (batch size, peak, verdict, how it was chosen).
        max_trials: the bound on ``len(trials)`` the search guarantees.
        backend: the backend's name.
        world_size: ranks that took part.
        max_batch_size: the largest candidate the search was allowed (keyword-only).
    """

    batch_size: int
    mode: str
    memory_fraction: float
    target_bytes: int
    limit_bytes: int
    peak_bytes: int | None
    trials: tuple[Trial, ...]
    max_trials: int
    backend: str
    world_size: int = 1
    max_batch_size: int = field(kw_only=True)

    @property
    def capped_by_max_batch_size(self) -> bool:
        """True when the answer is ``max_batch_size`` itself: it fits, and larger sizes were not tried.

        The search stopped at the bound, not at the memory; a larger batch may fit too (raise
        ``max_batch_size`` to find out).
        """
        return self.batch_size == self.max_batch_size

    @property
    def next_peak_bytes(self) -> int | None:
        """The peak measured at ``batch_size + 1`` (a lower bound if aborted), ``None`` if not probed."""
        for t in self.trials:
            if t.batch_size == self.batch_size + 1:
                return t.peak_bytes
        return None

    def to_row(self) -> dict[str, Any]:
        """The report row: ``mode, memory_fraction, batch_size, peak_bytes, trials`` and context.

        ``capped_by_max_batch_size`` says the answer is the search's upper bound
        (:attr:`capped_by_max_batch_size`); ``trials`` is the number of trials; ``trial_log``
        lists them.
        """
        return {
            "mode": self.mode,
            "memory_fraction": self.memory_fraction,
            "batch_size": self.batch_size,
            "max_batch_size": self.max_batch_size,
            "capped_by_max_batch_size": self.capped_by_max_batch_size,
            "peak_bytes": self.peak_bytes,
            "target_bytes": self.target_bytes,
            "limit_bytes": self.limit_bytes,
            "trials": len(self.trials),
            "max_trials": self.max_trials,
            "backend": self.backend,
            "world_size": self.world_size,
            "trial_log": [t.to_dict() for t in self.trials],
        }


def check_batch_bounds(min_batch_size: Any, max_batch_size: Any) -> tuple[int, int]:
    """``(min_batch_size, max_batch_size)`` as ints with ``1 <= min <= max``.

    Raises:
        InvalidArgument: either is not an integer, ``min < 1`` or ``max < min`` (named, with a fix).
    """
    low = check_positive_int("min_batch_size", min_batch_size)
    high = check_int("max_batch_size", max_batch_size)
    if high < low:
        raise InvalidArgument(
            f"max_batch_size must be >= min_batch_size={low}, but got max_batch_size={high}; raise max_batch_size or lower min_batch_size"
        )
    return low, high


def limited_backend(backend: Any, memory_limit: Any, reserve_bytes: Any) -> Backend:
    """The backend for a search at a memory fraction: :func:`~batchfit.memory.get_backend`, with a limit.

    Raises:
        InvalidArgument: a bad backend or size, or a backend without a memory limit (a fraction
            of "unlimited").
    """
    be = get_backend(backend, memory_limit=memory_limit, reserve_bytes=reserve_bytes)
    if be.limit_bytes is None:
        raise InvalidArgument(
            f"a memory limit is needed for a target fraction, but backend {be.name!r} has memory_limit=None; pass memory_limit (e.g. '16GiB' or 'a100-40gb')"
        )
    return be


@contextlib.contextmanager
def _evaluating(modules: list[torch.nn.Module]) -> Iterator[None]:
    """``eval()`` + ``no_grad`` for a plain trial callable in val mode; training flags restored."""
    flags = [(m, m.training) for m in modules]
    try:
        for m in modules:
            m.eval()
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.train(training)


def _modules_in(objects: Any) -> list[torch.nn.Module]:
    if isinstance(objects, torch.nn.Module):
        return [objects]
    if isinstance(objects, (list, tuple)):
        return [m for o in objects for m in _modules_in(o)]
    return []


def _report(
    progress: bool | ProgressCallback | None, trial: Trial, mode: str, fraction: float, group: Any
) -> None:
    if callable(progress):
        progress(trial)
    elif progress and get_rank(group) == 0:
        peak = "?" if trial.peak_bytes is None else f"{trial.peak_bytes:,}"
        logger.info(
            f"autobatch {mode} @ {fraction:g}: batch_size={trial.batch_size} peak={peak} bytes "
            f"{'fits' if trial.fits else 'does not fit'} ({trial.chosen_by})"
        )



@dataclass(frozen=True)
class _Checked:
    """:func:`find_batch_size`'s arguments once checked, and the step each trial runs."""

    mode: str
    fraction: float
    low: int
    high: int
    steps: int
    backend: Backend
    wrap: Callable[[], contextlib.AbstractContextManager[None]]
    step: Callable[[int], Any]
    persistent: Any


def find_batch_size(
    trial: Any,
    *,
    mode: str = "train",
    target_memory_fraction: float = 0.8,
    min_batch_size: int = 1,
    max_batch_size: int = 512,
    steps_per_trial: int = 2,
    memory_limit: Any = None,
    backend: Any = "auto",
    group: Any = None,
    progress: bool | ProgressCallback | None = True,
    register: Any = None,
    reserve_bytes: Any = None,
) -> BatchSizeResult:
    """The largest batch size whose peak memory stays within a fraction of the device, on every rank.

    Each candidate runs ``steps_per_trial`` steps under ``backend.measure``; its peak is the
    largest over them (so lazily created optimizer state counts). It fits when
    ``peak <= floor(target_memory_fraction × backend.limit_bytes)``. The search (memory-model
    guesses, then bisection; :func:`~batchfit.autobatch.batch_guess.search_largest`) takes at most
    ``ceil(log2(max_batch_size - min_batch_size + 1)) + 3`` trials. Under torch.distributed,
    every rank runs every trial and the verdicts are all-reduced (NOTE [ Ranks agree on every
    trial ]), so all ranks return the same size.

    Args:
        trial: either a :class:`~batchfit.autobatch.task.Task` (the step for ``mode`` is built
            from it: train = forward, backward, optimizer step; val = ``eval()`` + ``no_grad``
            forward with the loss), or a callable ``trial(batch_size)`` that builds a batch and
            runs one step. For a callable, pass the objects that live across steps (model,
            optimizer) in ``register`` or as ``trial.persistent``; in val mode the call runs under
            ``torch.no_grad()`` with the registered modules in ``eval()``. The trial must not
            communicate across ranks (use ``ddp_model.module``; NOTE [ Ranks agree on every trial ]).
        mode: ``"train"`` or ``"val"``.
        target_memory_fraction: in ``(0, 1]``.
        min_batch_size, max_batch_size: the candidate range, ``1 <= min <= max``.
        steps_per_trial: steps per candidate (>= 1; 2 counts optimizer state created by the
            first ``step()``).
        memory_limit: device bytes or a name (``"16GiB"``, ``"a100-40gb"``) when ``backend`` is a
            name; required for ``cpu`` and ``estimate`` (on cuda: total device memory).
        backend: ``"auto"``, ``"cpu"``, ``"estimate"``, ``"cuda"`` or a
            :class:`batchfit.memory.Backend`. Models measured on ``estimate`` must have been built
            inside ``backend.context()``, so pass the Backend object you built them with.
        group: the torch.distributed process group (``None`` = the default group, or single rank).
        progress: a callback receiving each :class:`~batchfit.autobatch.batch_guess.Trial`; ``True``
            logs each trial on rank 0 to the ``batchfit.autobatch`` logger (INFO); ``False``/``None``
            is silent. The library never prints.
        register: objects counted in every peak (default: ``trial.persistent`` if present).
        reserve_bytes: bytes of ``memory_limit`` no tracker sees, when ``backend`` is a name.

    Returns:
        :class:`BatchSizeResult`.

    Raises:
        InvalidArgument: a bad argument, or no memory limit (a fraction of "unlimited").
        DoesNotFitError: even ``min_batch_size`` does not fit; the message says by how much.
        BatchfitError: another rank's trial raised (this rank raises instead of waiting).
        Exception: whatever the trial raises on this rank other than running out of memory.

    Example:
        >>> from batchfit.memory import Backend, get_backend
        >>> be = get_backend("cpu", memory_limit="64MiB")
        >>> find_batch_size(lambda b: torch.zeros(b, 1024), backend=be, progress=False).batch_size
        512
    """

    def setup() -> _Checked:
        # everything the search needs; anything here may fail on one rank only
        checked_mode = check_choice("mode", mode, MODES)
        fraction = check_number(
            "target_memory_fraction", target_memory_fraction, low=0.0, high=1.0, low_open=True
        )
        low, high = check_batch_bounds(min_batch_size, max_batch_size)
        steps = check_positive_int("steps_per_trial", steps_per_trial)
        if not (callable(trial) or is_task(trial)):
            raise InvalidArgument(
                f"trial must be a Task or a callable trial(batch_size), but got trial={trial!r} ({type(trial).__name__})"
            )
        if progress is not None and not isinstance(progress, bool) and not callable(progress):
            raise InvalidArgument(f"progress must be a bool or a callable, but got progress={progress!r}")
        be = limited_backend(backend, memory_limit, reserve_bytes)

        wrap: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
        if isinstance(trial, TaskTrial):
            if trial.mode != checked_mode:
                raise InvalidArgument(
                    f"trial was built for mode={trial.mode!r}, but got mode={checked_mode!r}; build a TaskTrial for {checked_mode!r}"
                )
            step = trial
            persistent = trial.persistent if register is None else register
        elif is_task(trial):
            step = TaskTrial(trial, checked_mode)
            persistent = step.persistent if register is None else register
        else:
            step = trial
            persistent = getattr(trial, "persistent", ()) if register is None else register
            modules = _modules_in(persistent)
            wrap = (lambda: _evaluating(modules)) if checked_mode == "val" else contextlib.nullcontext
        if isinstance(step, TaskTrial):
            with be.context():
                step.prepare()
        return _Checked(checked_mode, fraction, low, high, steps, be, wrap, step, persistent)

    # NOTE [ Ranks agree or say why ]: a rank whose arguments, backend or task fail raises everywhere
    checked = agree(setup, group=group, what="find_batch_size's setup")
    mode, fraction, low, high, steps = checked.mode, checked.fraction, checked.low, checked.high, checked.steps
    be, wrap, step, persistent = checked.backend, checked.wrap, checked.step, checked.persistent
    limit = be.limit_bytes
    check_same_arguments(
        {
            "mode": mode,
            "target_memory_fraction": fraction,
            "min_batch_size": low,
            "max_batch_size": high,
            "steps_per_trial": steps,
        },
        group=group,
        what="find_batch_size",
    )

    local_target = math.floor(fraction * limit)
    target = all_reduce_min(local_target, group)

    def run(batch_size: int) -> None:
        with wrap():
            for _ in range(steps):
                step(batch_size)

    def probe(batch_size: int) -> Trial:
        error: BaseException | None = None
        peak, over, inexact = 0, True, True
        try:
            m = be.measure(lambda: run(batch_size), register=persistent)
            peak, inexact = int(m.peak_bytes), bool(m.exceeded)
            breakdowns[batch_size] = dict(m.breakdown)  # this rank's, for a does-not-fit error
            # cuda: the allocator's reservation counts too (real OOMs happen there)
            over = inexact or m.footprint_bytes > local_target
        except BaseException as exc:  # not an OOM (measure reports those), an interrupt too: agree, then re-raise
            error = exc
        # NOTE [ Ranks agree on every trial ] (NOTE [ Ranks agree or say why ])
        over_any, peak_max, inexact_any = agreed_max(
            [int(over), peak, int(inexact)], error, group=group, what=f"the trial at batch_size={batch_size}"
        )
        measured = Trial(batch_size, peak_max, not over_any, exact=not inexact_any)
        probed.append(measured)
        return measured

    probed: list[Trial] = []
    breakdowns: dict[int, dict[str, int]] = {}
    try:
        found = search_largest(
            probe,
            low=low,
            high=high,
            target_bytes=target,
            on_trial=lambda t: _report(progress, t, mode, fraction, group),
        )
    except DoesNotFitError as exc:
        first = probed[0]
        at_least = "" if first.exact else "at least "
        world = get_world_size(group)
        of = (
            f"{fraction:g} × {limit:,}"
            if world == 1
            else f"the smallest {fraction:g} × usable over {world} ranks"
        )
        parts = sorted(((b, c) for c, b in breakdowns.get(low, {}).items() if b > 0), reverse=True)
        by_category = ", ".join(f"{c.replace('_', ' ')} {format_bytes(b)}" for b, c in parts)
        stopped = "where it was stopped: " if not first.exact else ""
        # NOTE [ Messages in the caller's vocabulary ] (batchfit.errors): the CLI says --min-bs, --fractions, --memory
        raise DoesNotFitError(
            Phrase(
                "even ",
                Setting("min_batch_size", low),
                f" does not fit in {mode} mode: its peak is {at_least}{first.peak_bytes:,} bytes",
                f" ({stopped}{by_category})" if by_category else "",
                f", over the target {of} = {target:,} bytes by {at_least}{first.peak_bytes - target:,} bytes",
            ),
            needed=exc.needed,
            available=target,
            breakdown=breakdowns.get(low, {}),
            reserve_bytes=int(be.reserve_bytes or 0),
            usable_bytes=limit,
            remedies=[
                # at 1 there is nothing lower to offer
                *([Phrase("lower ", Setting("min_batch_size"))] if low > 1 else []),
                Phrase("raise ", Setting("target_memory_fraction"), " or ", Setting("memory_limit")),
                "use a smaller model",
            ],
        ) from None
    return BatchSizeResult(
        batch_size=found.batch_size,
        mode=mode,
        memory_fraction=fraction,
        target_bytes=target,
        limit_bytes=limit,
        peak_bytes=found.peak_bytes,
        trials=found.trials,
        max_trials=found.max_trials,
        backend=be.name,
        world_size=get_world_size(group),
        max_batch_size=high,
    )
