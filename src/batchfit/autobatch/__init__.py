"""Find the largest batch size that fits a target fraction of device memory, for any model, on every rank.

- :func:`find_batch_size` (:mod:`~batchfit.autobatch.batch_search`): the search on a memory backend,
  in ``train`` or ``val`` mode, with verdicts agreed across torch.distributed ranks.
- :func:`search_largest` (:mod:`~batchfit.autobatch.batch_guess`): the shared search
  :func:`batchfit.plan.bracket.largest_fitting` on ``[low, high]`` with AutoBatch's memory-model
  guess :func:`model_guess` (bounded trials).
- :class:`Task` (:mod:`~batchfit.autobatch.task`): model + ``make_batch`` + ``loss`` for the
  CLI, with built-in tasks in :mod:`~batchfit.autobatch.builtin_tasks`.
- :func:`sweep` and :mod:`~batchfit.autobatch.report`: every fraction × mode, as report rows.
"""

from batchfit.autobatch.batch_guess import SearchResult, Trial, max_trials, model_guess, search_largest
from batchfit.autobatch.batch_search import BatchSizeResult, find_batch_size
from batchfit.autobatch.report import REPORT_FIELDS, check_report_path, report_rows, write_report
from batchfit.autobatch.sweep import sweep
from batchfit.autobatch.task import BUILTIN_TASKS, MODES, Task, TaskTrial, build_task, is_task, load_task

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
