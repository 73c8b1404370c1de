"""batchfit: make LLM training use accelerator memory fully without running out of it.

The pure core (no device code, no collectives) is importable on its own:
:mod:`batchfit.config` (batch plans), :mod:`batchfit.minibatch` (prompt-aligned
mini-batches and data-parallel padding), :mod:`batchfit.loss` (exact loss weights).
"""

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
]
