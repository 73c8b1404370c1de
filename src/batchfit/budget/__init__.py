"""Token budgets: the largest micro-batch cost that fits in memory, found by measuring the trainer's own step.

:func:`profile_model` builds a model for each RL role and finds each role's budget with
:func:`find_token_budget`, which measures one micro-batch of a :class:`BudgetStep` at several
shapes and returns a :class:`TokenBudget` ``C`` such that any micro-batch with cost ``<= C``
fits. The probe is :class:`~batchfit.budget.causal_lm_probe.TrainingStep`: a trainer's micro-batch step
(:mod:`batchfit.train`) on a synthetic RL micro-batch (NOTE [ One micro-batch step ]). The
pieces are usable alone: :func:`batchfit.plan.largest_fitting` (the search, a pure function
of a probe, shared with :mod:`batchfit.autobatch`), :func:`fit_memory_model` /
:class:`MemoryModel` (``peak ≈ base + a·b·s + q·b·s²``) and :func:`guess_max_batch` (the
search's guess). :func:`confirm_profile` runs the real step once at each role's budget on the
device and compares it with the estimate per category (``batchfit profile --confirm``).
"""

from __future__ import annotations

import importlib
from typing import Any

# NOTE [ A light --help ] in batchfit.cli: the package's names load on first use, so a light module
# (batchfit.budget.settings, which the command line builds its parser from) imports no torch
_LAZY = {
    "BudgetProgress": "batchfit.budget.budget_search",
    "default_seq_lens": "batchfit.budget.budget_search",
    "find_token_budget": "batchfit.budget.budget_search",
    "TrainingStep": "batchfit.budget.causal_lm_probe",
    "causal_lm_step": "batchfit.budget.causal_lm_probe",
    "CategoryConfirmation": "batchfit.budget.confirm",
    "ConfirmPlan": "batchfit.budget.confirm",
    "ConfirmReport": "batchfit.budget.confirm",
    "RoleConfirmation": "batchfit.budget.confirm",
    "confirm_profile": "batchfit.budget.confirm",
    "plan_confirm": "batchfit.budget.confirm",
    "run_confirm": "batchfit.budget.confirm",
    "MemoryModel": "batchfit.budget.memory_model",
    "fit_memory_model": "batchfit.budget.memory_model",
    "guess_max_batch": "batchfit.budget.memory_model",
    "ROLES": "batchfit.budget.model_profile",
    "ModelProfile": "batchfit.budget.model_profile",
    "profile_model": "batchfit.budget.model_profile",
    "ProfileOptions": "batchfit.budget.options",
    "BudgetStep": "batchfit.budget.probe",
    "CallableStep": "batchfit.budget.probe",
    "Probe": "batchfit.budget.probe",
    "split_chunk_tokens": "batchfit.budget.split",
    "split_peak": "batchfit.budget.split",
    "COSTS": "batchfit.budget.token_budget",
    "BudgetPoint": "batchfit.budget.token_budget",
    "TokenBudget": "batchfit.budget.token_budget",
}

__all__ = [
    "COSTS",
    "ROLES",
    "BudgetPoint",
    "BudgetProgress",
    "BudgetStep",
    "CallableStep",
    "CategoryConfirmation",
    "ConfirmPlan",
    "ConfirmReport",
    "MemoryModel",
    "ModelProfile",
    "Probe",
    "ProfileOptions",
    "RoleConfirmation",
    "TokenBudget",
    "TrainingStep",
    "causal_lm_step",
    "confirm_profile",
    "default_seq_lens",
    "find_token_budget",
    "fit_memory_model",
    "guess_max_batch",
    "plan_confirm",
    "profile_model",
    "run_confirm",
    "split_chunk_tokens",
    "split_peak",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchfit.budget' has no attribute {name!r}")
