"""The ``cuda`` backend: real execution, ``torch.cuda`` peak statistics, OOM caught."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.memory.base import Backend
from batchfit.memory.categories import ACTIVATIONS, storage_bytes
from batchfit.memory.measurement import MemoryMeasurement


class CudaBackend(Backend):
    """Run the step on a CUDA device and read the allocator's peak; an OOM is "does not fit".

    ``peak_bytes`` is ``torch.cuda.max_memory_allocated`` over the call (everything
    allocated on the device, registered state included, rounded by the allocator) and
    ``reserved_bytes`` is ``torch.cuda.max_memory_reserved``: the caching allocator's
    segments, which is where a real OOM happens (fragmentation included). A call fits when
    both stay within ``limit_bytes``. Before every call the previous call's cached blocks
    are released (``gc.collect()``, ``empty_cache()``) and the peak statistics reset, so one
    trial's cache cannot change the next verdict. On ``torch.OutOfMemoryError`` the call's
    frames are dropped, its memory released, and the result has ``fits=False,
    exceeded=True``; the peak is then the bytes reached before the failure (NOTE [ What
    counts as OOM ] in :mod:`batchfit.memory.base`). After every call, once the statistics
    are read, the registered state is restored (FSDP2 modules resharded, gradients and
    optimizer state as before; NOTE [ Probes are isolated ] in
    :mod:`batchfit.memory.isolation`) and the cache is emptied again when the call was
    aborted or its restoration freed memory (layers an aborted or forward-only step left
    gathered), so they do not stay reserved until the next trial.

    Setting ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before the process starts
    makes reserved memory follow allocated memory closely (less fragmentation), so more of
    the device is usable at the same verdict; the estimate backend's safety margin assumes
    some fragmentation either way.

    Args:
        memory_limit: device bytes to plan for; default the device's total memory.
        reserve_bytes: bytes of ``memory_limit`` torch cannot use; default measured at
            construction as ``total - free - torch.cuda.memory_reserved()`` (the CUDA
            context and other processes).
        round_to: informational (the allocator rounds to 512 B by itself); default 512.
        device: the CUDA device (default, and for ``"cuda"`` without an index, the current
            one: ``torch.cuda.current_device()``, as set by ``torch.cuda.set_device(local_rank)``).

    Raises:
        InvalidArgument: CUDA is not available.
    """

    name = "cuda"
    reads_device = True

    def __init__(
        self,
        *,
        memory_limit: Any = None,
        reserve_bytes: Any = None,
        round_to: int | None = None,
        device: torch.device | int | str | None = None,
    ):
        if not torch.cuda.is_available():
            raise InvalidArgument(
                "backend='cuda' needs a CUDA device, but torch.cuda.is_available() is False; use backend='estimate' (or 'auto') to estimate without a GPU"
            )
        index = None if device is None else torch.device(device).index
        self._device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        total = int(torch.cuda.get_device_properties(self._device).total_memory)
        if reserve_bytes is None:
            free, total_now = torch.cuda.mem_get_info(self._device)
            reserve_bytes = max(0, int(total_now) - int(free) - int(torch.cuda.memory_reserved(self._device)))
        super().__init__(
            memory_limit=total if memory_limit is None else memory_limit,
            reserve_bytes=reserve_bytes,
            round_to=512 if round_to is None else round_to,
        )

    @property
    def device(self) -> torch.device:
        """The CUDA device measured."""
        return self._device

    def _prepare(
        self,
        registered: list[tuple[torch.Tensor, str]],
        parameters: list[torch.nn.Parameter],
        host_categories: Sequence[str],
    ) -> tuple[dict[str, int], int]:
        # device bytes per category as the allocator holds them (512-byte blocks), and the bytes
        # of the categories offloaded to the host (not the device's; as the tracked backends
        # count them); the tensors are let go
        host = set(host_categories)
        device = storage_bytes([(t, c) for t, c in registered if c not in host], self.round_to)
        offloaded = storage_bytes([(t, c) for t, c in registered if c in host])
        return device, sum(offloaded.values())

    @contextlib.contextmanager
    def _running(self, state: tuple[dict[str, int], int]) -> Iterator[None]:
        gc.collect()
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()  # the previous trial's cached blocks must not shape this one
        torch.cuda.reset_peak_memory_stats(self._device)
        yield
        torch.cuda.synchronize(self._device)

    @contextlib.contextmanager
    def capped(self) -> Iterator[None]:
        """Inside, the caching allocator refuses to reserve more than :attr:`limit_bytes` on this device.

        ``torch.cuda.set_per_process_memory_fraction(limit / total)``: a step that would go
        above the limit raises ``torch.OutOfMemoryError`` there, the same on every rank. The
        fraction before is put back on exit (1.0, PyTorch's default, when torch cannot tell it).
        """
        limit = self.limit_bytes
        total = int(torch.cuda.get_device_properties(self._device).total_memory)
        if limit is None or limit >= total:
            yield
            return
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        before = float(getter(self._device)) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(limit / total, self._device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, self._device)

    def _release(self) -> None:
        torch.cuda.empty_cache()  # after the state is restored (Backend.measure)

    def _result(self, state: tuple[dict[str, int], int], exceeded: bool, seconds: float) -> MemoryMeasurement:
        peak = int(torch.cuda.max_memory_allocated(self._device))
        reserved = int(torch.cuda.max_memory_reserved(self._device))
        device, host_bytes = state
        breakdown = {k: v for k, v in device.items() if v}
        rest = peak - sum(breakdown.values())
        if rest > 0:
            breakdown[ACTIVATIONS] = rest
        limit = self.limit_bytes
        return MemoryMeasurement(
            peak_bytes=peak,
            fits=not exceeded and (limit is None or max(peak, reserved) <= limit),
            limit_bytes=limit,
            backend=self.name,
            breakdown=breakdown,
            exceeded=exceeded,
            seconds=seconds,
            reserved_bytes=reserved,
            host_bytes=host_bytes,
        )
