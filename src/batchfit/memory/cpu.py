"""The ``cpu`` backend: real execution on the CPU, exact live-storage peak."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from batchfit.memory.heap import retain_freed_memory
from batchfit.memory.tracked_backend import TrackedBackend


def host_available_bytes() -> int | None:
    """Bytes of this host's memory available to a new allocation now, ``None`` when unknown.

    ``MemAvailable`` of ``/proc/meminfo`` (free memory plus what the kernel can reclaim) on
    Linux, else the free physical pages. A real cpu run larger than this would push the host
    into swap or the OOM killer rather than fail cleanly, so callers refuse it beforehand.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


class CpuBackend(TrackedBackend):
    """Run the step for real on the CPU under the live-storage tracker.

    Exact and deterministic (byte for byte run to run); slow for large models, since every
    op really runs. Defaults: no memory limit, no reserve, no rounding (``round_to=1``).

    Args:
        memory_limit: simulated device size (bytes, ``"2GiB"``, a device preset) or ``None``.
        reserve_bytes: subtracted from ``memory_limit`` (default 0).
        round_to: round each storage up to a multiple of this (default 1 = exact bytes).
        attention_kernels: ``"cuda"`` (default): attention runs the kernel CUDA would choose,
            as the estimate does; ``"own"``: the CPU's own choice (NOTE [ The estimate runs
            CUDA's attention kernel ]).

    Example:
        >>> import torch
        >>> backend = CpuBackend()
        >>> x = torch.ones(256)
        >>> backend.measure(lambda: x * 2, register=x).peak_bytes  # x and x * 2: 2 * 256 * 4
        2048
    """

    name = "cpu"
    host_memory = True
    estimate_is_exact = True
    simulates_one_rank = True

    def __init__(
        self,
        *,
        memory_limit: Any = None,
        reserve_bytes: Any = None,
        round_to: int | None = None,
        attention_kernels: str = "cuda",
    ):
        super().__init__(
            memory_limit=memory_limit,
            reserve_bytes=0 if reserve_bytes is None else reserve_bytes,
            round_to=1 if round_to is None else round_to,
        )
        self._set_attention_kernels(attention_kernels)

    def probing(self) -> contextlib.AbstractContextManager[None]:
        """Keep freed host pages in the heap between probes (NOTE [ Probing reuses host pages ])."""
        return retain_freed_memory()
