"""``sweep``: the batch-size search for every target fraction × mode of one task."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from batchfit.autobatch.batch_guess import Trial
from batchfit.autobatch.batch_search import (
    BatchSizeResult,
    check_batch_bounds,
    find_batch_size,
    limited_backend,
)
from batchfit.autobatch.task import TaskTrial, build_task, load_task
from batchfit.autobatch.task_names import DEFAULT_TASK, MODES
from batchfit.errors import InvalidArgument
from batchfit.validation import check_choice, check_number, check_positive_int

SweepProgress = Callable[[str, float, Trial], None]


def check_fractions(fractions: Sequence[Any]) -> tuple[float, ...]:
    """``fractions`` as floats, each in ``(0, 1]``; at least one.

    Raises:
        InvalidArgument: empty, or a fraction outside ``(0, 1]`` (named with its value).
    """
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Sequence) or not fractions:
        raise InvalidArgument(
            f"fractions must be a non-empty list of numbers in (0, 1], but got fractions={fractions!r}"
        )
    return tuple(check_number("fraction", f, low=0.0, high=1.0, low_open=True) for f in fractions)


def check_modes(modes: Sequence[Any]) -> tuple[str, ...]:
    """``modes`` checked against ``("train", "val")``; at least one.

    Raises:
        InvalidArgument: empty, or an unknown mode (the choices are listed).
    """
    if isinstance(modes, (str, bytes)) or not isinstance(modes, Sequence) or not modes:
        raise InvalidArgument(
            f"modes must be a non-empty list of 'train' and/or 'val', but got modes={modes!r}"
        )
    return tuple(check_choice("mode", m, MODES) for m in modes)


def sweep(
    task: str | Callable[[], Any] = DEFAULT_TASK,
    *,
    fractions: Sequence[float] = (0.8,),
    modes: Sequence[str] = MODES,
    steps_per_trial: int = 2,
    min_batch_size: int = 1,
    max_batch_size: int = 512,
    memory_limit: Any = None,
    backend: Any = "auto",
    reserve_bytes: Any = None,
    group: Any = None,
    progress: SweepProgress | None = None,
) -> list[BatchSizeResult]:
    """Run :func:`~batchfit.autobatch.find_batch_size` for every mode × fraction of one task.

    The task is built once per mode inside ``backend.context()`` (NOTE [ Tasks are built
    inside the backend's context ]); within a mode, the searches share the model and optimizer.

    Args:
        task: a task spec for :func:`~batchfit.autobatch.task.load_task` or a factory.
        fractions: target memory fractions, each in ``(0, 1]``.
        modes: ``"train"`` and/or ``"val"``.
        steps_per_trial, min_batch_size, max_batch_size, memory_limit, backend, reserve_bytes,
            group: as for :func:`~batchfit.autobatch.find_batch_size`.
        progress: called as ``progress(mode, fraction, trial)`` after each trial.

    Returns:
        One :class:`~batchfit.autobatch.BatchSizeResult` per mode × fraction, modes outermost.

    Raises:
        InvalidArgument: bad fractions, modes, bounds, backend or task (checked before any model
            is built).
        DoesNotFitError: ``min_batch_size`` does not fit for some mode × fraction.
    """
    fracs = check_fractions(fractions)
    mode_list = check_modes(modes)
    low, high = check_batch_bounds(min_batch_size, max_batch_size)
    check_positive_int("steps_per_trial", steps_per_trial)
    factory = load_task(task) if isinstance(task, str) else task
    if not callable(factory):
        raise InvalidArgument(f"task must be a spec 'module:function' or a factory, but got task={task!r}")
    be = limited_backend(backend, memory_limit, reserve_bytes)
    results: list[BatchSizeResult] = []
    for mode in mode_list:
        trial = TaskTrial(build_task(factory, be), mode)
        for fraction in fracs:
            callback = None if progress is None else _bind(progress, mode, fraction)
            results.append(
                find_batch_size(
                    trial,
                    mode=mode,
                    target_memory_fraction=fraction,
                    min_batch_size=low,
                    max_batch_size=high,
                    steps_per_trial=steps_per_trial,
                    backend=be,
                    group=group,
                    progress=callback if callback is not None else False,
                )
            )
    return results


def _bind(progress: SweepProgress, mode: str, fraction: float) -> Callable[[Trial], None]:
    return lambda trial: progress(mode, fraction, trial)
