"""batchfit: make LLM training use accelerator memory fully without running out of it.

The package in layers (each imports only the ones below it):

- :mod:`batchfit.plan`: pure planning — batch plans (:class:`BatchConfig`), token-budget
  micro-batch plans (:func:`plan_micro_batches`), the bracket search.
- :mod:`batchfit.batches`: tensor-level batching — prompt-aligned mini-batches, data-parallel
  padding, exact loss weights, row layouts, :func:`iter_micro_batches`.
- :mod:`batchfit.parallel`: collectives that agree across ranks, :class:`Sharding`, FSDP2/DDP.
- :mod:`batchfit.memory`: measuring (cuda, cpu) or estimating (fake tensors) peak memory.
- :mod:`batchfit.logprobs`: memory-bounded log-probs and entropy.
- :mod:`batchfit.models`: presets, building causal LMs with real or fake tensors, varlen attention.
- :mod:`batchfit.train`: the parts of an RL trainer's micro-batch step.
- :mod:`batchfit.budget` / :mod:`batchfit.autobatch`: token budgets (whose probe is the
  trainer's own step) and batch-size search.
- :mod:`batchfit.frameworks`, :mod:`batchfit.cli`: SkyRL and verl configs, the command line.

The names below are importable from ``batchfit`` directly; all but the batch plans load on
first use (``import batchfit`` stays light).
"""

from __future__ import annotations

import importlib
from typing import Any

# registers the frameworks' batch rules (NOTE [ Rules registered from above ] in batchfit.plan.rules)
import batchfit.frameworks  # noqa: F401
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
    # batch plans and micro-batch plans
    "load_config": "batchfit.frameworks.config_io",
    "plan_micro_batches": "batchfit.plan",
    "MicroBatchPlan": "batchfit.plan",
    # tensor-level batching
    "mini_batch_boundaries": "batchfit.batches",
    "prompt_boundaries": "batchfit.batches",
    "pad_for_data_parallel": "batchfit.batches",
    "split_for_data_parallel": "batchfit.batches",
    "slice_batch": "batchfit.batches",
    "loss_weights": "batchfit.batches",
    "iter_micro_batches": "batchfit.batches",
    "MicroBatch": "batchfit.batches",
    "collate_rollouts": "batchfit.batches.rollouts",
    # data parallelism
    "Sharding": "batchfit.parallel",
    "simulated_world": "batchfit.parallel",
    "sync_micro_batch_count": "batchfit.parallel",
    "reduce_figures": "batchfit.parallel.reduce",
    "parameter_agreement": "batchfit.parallel.reduce",
    # memory
    "get_backend": "batchfit.memory",
    "measure_peak": "batchfit.memory",
    "MemoryMeasurement": "batchfit.memory",
    # log-probs
    "logprobs_from_logits": "batchfit.logprobs",
    "logprobs_from_hidden": "batchfit.logprobs",
    "entropy_from_logits": "batchfit.logprobs",
    # models
    "build_causal_lm": "batchfit.models",
    "use_varlen_attention": "batchfit.models",
    # a trainer's micro-batch step
    "accumulate": "batchfit.train",
    "data_parallel_size": "batchfit.train",
    "forward_logprobs": "batchfit.train",
    "forward_values": "batchfit.train",
    "group_advantages": "batchfit.train",
    "initialize_optimizer_state": "batchfit.train",
    "micro_batch_loss": "batchfit.train",
    "model_logprobs": "batchfit.train",
    "model_values": "batchfit.train",
    "policy_loss": "batchfit.train",
    "response_columns": "batchfit.train",
    "value_loss": "batchfit.train",
    "PeakTracker": "batchfit.train",
    "MicroBatchGuard": "batchfit.train",
    # token budgets and batch sizes
    "find_token_budget": "batchfit.budget",
    "profile_model": "batchfit.budget",
    "ProfileOptions": "batchfit.budget",
    "ModelProfile": "batchfit.budget",
    "TokenBudget": "batchfit.budget",
    "find_batch_size": "batchfit.autobatch",
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
