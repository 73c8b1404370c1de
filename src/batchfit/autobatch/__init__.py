"""Find the largest batch size that fits a target fraction of device memory, for any model, on every rank.

- :func:`find_batch_size` (:mod:`~batchfit.autobatch.batch_search`): the search on a memory backend,
  in ``train`` or ``val`` mode, with verdicts agreed across torch.distributed ranks.
- :func:`search_largest` (:mod:`~batchfit.autobatch.batch_guess`): the shared search
  :func:`batchfit.plan.bracket.largest_fitting` on ``[low, high]`` with AutoBatch's memory-model
  guess :func:`model_guess` (bounded trials).
- :class:`Task` (:mod:`~batchfit.autobatch.task`): model + ``make_batch`` + ``loss`` for the
  CLI, with built-in tasks in :mod:`~batchfit.autobatch.builtin_tasks`.
- :func:`sweep` (:mod:`~batchfit.autobatch.fraction_sweep`) and :mod:`~batchfit.autobatch.report`: every fraction ×
  mode, as report rows.
"""

from __future__ import annotations

import importlib
from typing import Any

# NOTE [ A light --help ] in batchfit.cli: the package's names load on first use
_LAZY = {
    "SearchResult": "batchfit.autobatch.batch_guess",
    "Trial": "batchfit.autobatch.batch_guess",
    "max_trials": "batchfit.autobatch.batch_guess",
    "model_guess": "batchfit.autobatch.batch_guess",
    "search_largest": "batchfit.autobatch.batch_guess",
    "BatchSizeResult": "batchfit.autobatch.batch_search",
    "find_batch_size": "batchfit.autobatch.batch_search",
    "REPORT_FIELDS": "batchfit.autobatch.report",
    "check_report_path": "batchfit.autobatch.report",
    "report_rows": "batchfit.autobatch.report",
    "write_report": "batchfit.autobatch.report",
    "sweep": "batchfit.autobatch.fraction_sweep",
    "BUILTIN_TASKS": "batchfit.autobatch.task_names",
    "MODES": "batchfit.autobatch.task_names",
    "Task": "batchfit.autobatch.task",
    "TaskTrial": "batchfit.autobatch.task",
    "build_task": "batchfit.autobatch.task",
    "is_task": "batchfit.autobatch.task",
    "load_task": "batchfit.autobatch.task",
}

__all__ = [
    "BUILTIN_TASKS",
    "MODES",
    "REPORT_FIELDS",
    "BatchSizeResult",
    "SearchResult",
    "Task",
    "TaskTrial",
    "Trial",
    "build_task",
    "check_report_path",
    "find_batch_size",
    "is_task",
    "load_task",
    "max_trials",
    "model_guess",
    "report_rows",
    "search_largest",
    "sweep",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchfit.autobatch' has no attribute {name!r}")
