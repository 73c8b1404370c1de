"""Measure the peak memory of one call of a step function, reporting "does not fit" instead of crashing.

Three backends behind one interface (:class:`Backend`, chosen by :func:`get_backend`):

- ``cpu``: real execution under the live-storage tracker; exact and deterministic.
- ``estimate``: the same tracker under ``FakeTensorMode`` on the CPU; no allocation,
  predicts a CUDA device (``memory_limit``, ``reserve_bytes``, 512 B rounding).
- ``cuda``: ``torch.cuda`` peak statistics; ``torch.OutOfMemoryError`` becomes ``fits=False``.

All three share :meth:`Backend.measure` (NOTE [ What counts as OOM ]).

Example:
    >>> import torch
    >>> backend = get_backend("cpu", memory_limit="1MiB")
    >>> x = torch.ones(1024)
    >>> m = backend.measure(lambda: torch.ones(512 * 1024), register=x)
    >>> m.fits, m.exceeded  # 4 KiB + 2 MiB > 1 MiB: aborted at the limit
    (False, True)
"""

from batchfit.memory.backends import (
    BACKEND_NAMES,
    BACKENDS,
    backend_class,
    backend_name,
    get_backend,
    measure_peak,
)
from batchfit.memory.base import Backend, is_out_of_memory
from batchfit.memory.cpu import CpuBackend
from batchfit.memory.cuda import CudaBackend
from batchfit.memory.cuda_untracked import DEFAULT_SAFETY_MARGIN, UntrackedMemory, untracked_memory
from batchfit.memory.estimate import (
    DEFAULT_ESTIMATE_TARGET,
    DEFAULT_ROUND_TO,
    EstimateBackend,
)
from batchfit.memory.measurement import MemoryMeasurement
from batchfit.memory.sizes import DEVICE_MEMORY, format_bytes, parse_memory
from batchfit.memory.tracker import MemoryLimitExceeded, MemoryTracker

__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "DEFAULT_ESTIMATE_TARGET",
    "DEFAULT_ROUND_TO",
    "DEFAULT_SAFETY_MARGIN",
    "DEVICE_MEMORY",
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "EstimateBackend",
    "MemoryLimitExceeded",
    "MemoryMeasurement",
    "MemoryTracker",
    "UntrackedMemory",
    "backend_class",
    "backend_name",
    "format_bytes",
    "get_backend",
    "is_out_of_memory",
    "measure_peak",
    "parse_memory",
    "untracked_memory",
]
