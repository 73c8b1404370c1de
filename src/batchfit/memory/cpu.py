"""The ``cpu`` backend: real execution on the CPU, exact live-storage peak."""

from __future__ import annotations

from typing import Any

from batchfit.memory.tracked import TrackedBackend


class CpuBackend(TrackedBackend):
    """Run the step for real on the CPU under the live-storage tracker.

    Exact and deterministic (byte for byte run to run); slow for large models, since every
    op really runs. Defaults: no memory limit, no reserve, no rounding (``round_to=1``).

    Args:
        memory_limit: simulated device size (bytes, ``"2GiB"``, a device preset) or ``None``.
        reserve_bytes: subtracted from ``memory_limit`` (default 0).
        round_to: round each storage up to a multiple of this (default 1 = exact bytes).

    Example:
        >>> import torch
        >>> backend = CpuBackend()
        >>> x = torch.ones(256)
        >>> backend.measure(lambda: x * 2, register=x).peak_bytes  # x and x * 2: 2 * 256 * 4
        2048
    """

    name = "cpu"

    def __init__(self, *, memory_limit: Any = None, reserve_bytes: Any = None, round_to: int | None = None):
        super().__init__(
            memory_limit=memory_limit,
            reserve_bytes=0 if reserve_bytes is None else reserve_bytes,
            round_to=1 if round_to is None else round_to,
        )
