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

from __future__ import annotations

import importlib
from typing import Any

# NOTE [ A light --help ] in batchfit.cli: the package's names load on first use (a light module such as
# batchfit.memory.sizes imports no torch)
_LAZY = {
    "BACKEND_NAMES": "batchfit.memory.backends",
    "BACKENDS": "batchfit.memory.backends",
    "backend_class": "batchfit.memory.backends",
    "backend_name": "batchfit.memory.backends",
    "get_backend": "batchfit.memory.backends",
    "measure_peak": "batchfit.memory.backends",
    "Backend": "batchfit.memory.base",
    "is_out_of_memory": "batchfit.memory.base",
    "CpuBackend": "batchfit.memory.cpu",
    "CudaBackend": "batchfit.memory.cuda",
    "DEFAULT_SAFETY_MARGIN": "batchfit.memory.cuda_untracked",
    "UntrackedMemory": "batchfit.memory.cuda_untracked",
    "untracked_memory": "batchfit.memory.cuda_untracked",
    "DEFAULT_ESTIMATE_TARGET": "batchfit.memory.sizes",
    "DEFAULT_ROUND_TO": "batchfit.memory.estimate",
    "EstimateBackend": "batchfit.memory.estimate",
    "MemoryMeasurement": "batchfit.memory.measurement",
    "DEVICE_MEMORY": "batchfit.memory.sizes",
    "format_bytes": "batchfit.memory.sizes",
    "parse_memory": "batchfit.memory.sizes",
    "MemoryLimitExceeded": "batchfit.memory.tracker",
    "MemoryTracker": "batchfit.memory.tracker",
}

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchfit.memory' has no attribute {name!r}")
