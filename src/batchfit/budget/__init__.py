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

from batchfit.budget.budget_search import BudgetProgress, default_seq_lens, find_token_budget
from batchfit.budget.causal_lm_probe import TrainingStep, causal_lm_step
from batchfit.budget.confirm import (
    CategoryConfirmation,
    ConfirmPlan,
    ConfirmReport,
    RoleConfirmation,
    confirm_profile,
    plan_confirm,
    run_confirm,
)
from batchfit.budget.memory_model import MemoryModel, fit_memory_model, guess_max_batch
from batchfit.budget.model_profile import ROLES, ModelProfile, profile_model
from batchfit.budget.options import ProfileOptions
from batchfit.budget.probe import BudgetStep, CallableStep, Probe
from batchfit.budget.split import split_chunk_tokens, split_peak
from batchfit.budget.token_budget import COSTS, BudgetPoint, TokenBudget

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
