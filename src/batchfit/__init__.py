"""batchfit: make LLM training use accelerator memory fully without running out of it.

The pure core (no device code, no collectives): :mod:`batchfit.plan.config` (batch plans),
:mod:`batchfit.batches.minibatch` (prompt-aligned mini-batches, data-parallel padding),
:mod:`batchfit.batches.weights` (exact loss weights), :mod:`batchfit.plan.packing` (token-budget
micro-batch plans). Above it: :mod:`batchfit.memory` (measure or estimate peak memory),
:mod:`batchfit.budget` (automatic token budgets), :mod:`batchfit.autobatch` (batch-size
search for any model) and :mod:`batchfit.logprobs` (memory-bounded log-probs).

The names below are importable from ``batchfit`` directly; the heavier ones load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from batchfit.errors import (
    BatchConfigError,
    BatchError,
    BatchfitError,
    BudgetError,
    DoesNotFitError,
    InvalidArgument,
)
from batchfit.plan.config import BatchConfig, BatchPlan, RolePlan

__version__ = "0.1.0"

_LAZY = {
    "load_config": "batchfit.frameworks.config_io",
    "mini_batch_boundaries": "batchfit.batches.minibatch",
    "prompt_boundaries": "batchfit.batches.minibatch",
    "pad_for_data_parallel": "batchfit.batches.minibatch",
    "split_for_data_parallel": "batchfit.batches.minibatch",
    "slice_batch": "batchfit.batches.minibatch",
    "loss_weights": "batchfit.batches.weights",
    "plan_micro_batches": "batchfit.plan.packing",
    "MicroBatchPlan": "batchfit.plan.packing",
    "iter_micro_batches": "batchfit.batches.microbatch",
    "sync_micro_batch_count": "batchfit.parallel.distributed",
    "find_token_budget": "batchfit.budget",
    "TokenBudget": "batchfit.budget",
    "profile_model": "batchfit.budget.profile",
    "Sharding": "batchfit.parallel.sharding",
    "simulated_world": "batchfit.parallel.distributed",
    "find_batch_size": "batchfit.autobatch",
    "get_backend": "batchfit.memory",
    "measure_peak": "batchfit.memory",
    "logprobs_from_logits": "batchfit.logprobs",
    "logprobs_from_hidden": "batchfit.logprobs",
    "entropy_from_logits": "batchfit.logprobs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "BatchConfig",
    "BatchConfigError",
    "BatchError",
    "BatchPlan",
    "BatchfitError",
    "BudgetError",
    "DoesNotFitError",
    "InvalidArgument",
    "RolePlan",
    "__version__",
    *_LAZY,
]
