"""Token budgets: the largest micro-batch cost that fits in memory, found by measuring.

:func:`find_token_budget` probes a training step at several sequence lengths and returns a
:class:`TokenBudget` ``C`` such that any micro-batch with cost ``<= C`` fits. The pieces are
usable alone: :func:`batchfit.search.largest_fitting` (the search, a pure function of a probe,
shared with :mod:`batchfit.autobatch`), :func:`fit_memory_model` / :class:`MemoryModel`
(``peak ≈ base + a·b·s + q·b·s²``) and :func:`guess_max_batch` (the search's guess).
"""

from batchfit.budget.find import BudgetProgress, default_seq_lens, find_token_budget
from batchfit.budget.memory_model import MemoryModel, fit_memory_model, guess_max_batch
from batchfit.budget.probe import Probe
from batchfit.budget.token_budget import COSTS, BudgetPoint, TokenBudget

__all__ = [
    "COSTS",
    "BudgetPoint",
    "BudgetProgress",
    "MemoryModel",
    "Probe",
    "TokenBudget",
    "default_seq_lens",
    "find_token_budget",
    "fit_memory_model",
    "guess_max_batch",
]
