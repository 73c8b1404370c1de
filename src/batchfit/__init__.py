"""batchfit: make LLM training use accelerator memory fully without running out of it.

The pure core (no device code, no collectives): :mod:`batchfit.config` (batch plans),
:mod:`batchfit.minibatch` (prompt-aligned mini-batches, data-parallel padding),
:mod:`batchfit.loss` (exact loss weights), :mod:`batchfit.packing` (token-budget
micro-batch plans). Above it: :mod:`batchfit.memory` (measure or estimate peak memory),
:mod:`batchfit.budget` (automatic token budgets), :mod:`batchfit.autobatch` (batch-size
search for any model) and :mod:`batchfit.logprobs` (memory-bounded log-probs).

The names below are importable from ``batchfit`` directly; the heavier ones load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from batchfit.config import BatchConfig, BatchPlan, RolePlan
from batchfit.errors import (
    BatchConfigError,
    BatchError,
    BatchfitError,
    BudgetError,
    DoesNotFitError,
    InvalidArgument,
)

__version__ = "0.1.0"

_LAZY = {
    "load_config": "batchfit.config_io",
    "mini_batch_boundaries": "batchfit.minibatch",
    "prompt_boundaries": "batchfit.minibatch",
    "pad_for_data_parallel": "batchfit.minibatch",
    "split_for_data_parallel": "batchfit.minibatch",
    "slice_batch": "batchfit.minibatch",
    "loss_weights": "batchfit.loss",
    "plan_micro_batches": "batchfit.packing",
    "MicroBatchPlan": "batchfit.packing",
    "iter_micro_batches": "batchfit.microbatch",
    "sync_micro_batch_count": "batchfit.microbatch",
    "find_token_budget": "batchfit.budget",
    "TokenBudget": "batchfit.budget",
    "profile_model": "batchfit.budget.profile",
    "Sharding": "batchfit.sharding",
    "simulated_world": "batchfit.distributed",
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
