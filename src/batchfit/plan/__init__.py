"""Pure planning: functions of sizes, lengths and counts, no tensors on a device and no collectives.

- :mod:`~batchfit.plan.config`: :class:`BatchConfig` → :class:`BatchPlan` (train / mini / micro
  batch sizes, epochs, data-parallel layout; every fault in one :class:`~batchfit.BatchConfigError`).
- :mod:`~batchfit.plan.packing`: :func:`plan_micro_batches`, token-budget micro-batch plans equal
  on every rank; its packers are :mod:`~batchfit.plan.single_cap` (one cap),
  :mod:`~batchfit.plan.two_caps` (tokens and response tokens) and :mod:`~batchfit.plan.dealing`
  (over data-parallel ranks).
- :mod:`~batchfit.plan.bracket`: :func:`largest_fitting`, the bracket search over a probe
  (``probe(candidate) -> fits``) that the token budget and AutoBatch share.

Every rank computes the same plan from the same inputs without talking to the others.
"""

from batchfit.plan.bracket import SearchResult, Trial, largest_fitting
from batchfit.plan.config import BatchConfig, BatchPlan, RolePlan
from batchfit.plan.packing import COSTS, MicroBatchPlan, plan_micro_batches

__all__ = [
    "COSTS",
    "BatchConfig",
    "BatchPlan",
    "MicroBatchPlan",
    "RolePlan",
    "SearchResult",
    "Trial",
    "largest_fitting",
    "plan_micro_batches",
]
