"""The interface every memory backend implements: :class:`Backend`."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.memory.measurement import MemoryMeasurement
from batchfit.memory.sizes import parse_memory
from batchfit.validation import check_positive_int, is_int


class Backend(abc.ABC):
    """Measures the peak bytes of one call of a step function; "does not fit" never crashes.

    Build models, optimizers and inputs inside :meth:`context` and on :attr:`device`, then
    call :meth:`measure`. Subclasses: ``cpu``, ``estimate``, ``cuda``
    (:func:`batchfit.memory.get_backend` picks one by name).

    Attributes:
        name: ``"cpu"``, ``"estimate"`` or ``"cuda"``.
        device: the ``torch.device`` on which to create tensors.
        memory_limit: bytes of the (real or simulated) device, ``None`` = unlimited.
        reserve_bytes: bytes of ``memory_limit`` no tracker sees (CUDA context, workspaces),
            subtracted from it to give :attr:`limit_bytes`.
        round_to: each storage is rounded up to a multiple of this many bytes (tracked
            backends only; the CUDA allocator rounds by itself).
    """

    name: str = ""

    def __init__(self, *, memory_limit: Any = None, reserve_bytes: Any = 0, round_to: int = 1):
        self.memory_limit = None if memory_limit is None else parse_memory(memory_limit, name="memory_limit")
        if is_int(reserve_bytes) and reserve_bytes == 0:
            self.reserve_bytes = 0
        else:
            self.reserve_bytes = parse_memory(reserve_bytes, name="reserve_bytes")
        self.round_to = check_positive_int("round_to", round_to)
        if self.memory_limit is not None and self.reserve_bytes >= self.memory_limit:
            raise InvalidArgument(
                f"reserve_bytes must be smaller than memory_limit={self.memory_limit}, but got reserve_bytes={self.reserve_bytes}; lower reserve_bytes or raise memory_limit"
            )

    @property
    def device(self) -> torch.device:
        """The device on which step functions create their tensors."""
        return torch.device("cpu")

    @property
    def limit_bytes(self) -> int | None:
        """Usable bytes: ``memory_limit - reserve_bytes``; ``None`` when unlimited."""
        return None if self.memory_limit is None else self.memory_limit - self.reserve_bytes

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Create models, optimizers and inputs inside this (re-entrant; a no-op by default)."""
        yield

    @abc.abstractmethod
    def measure(
        self,
        fn: Callable[[], Any],
        register: Any = (),
        categories: Sequence[str | None] | str | None = None,
        host_categories: Sequence[str] = (),
    ) -> MemoryMeasurement:
        """Run ``fn()`` once and return its peak memory; exceeding the limit is a result, not an error.

        Args:
            fn: the step, called with no arguments; its return value is dropped.
            register: state that exists before the call and stays alive during it (model,
                optimizer, input tensors, or a tuple of these), counted in the peak. Only
                needed by the tracked backends (cpu, estimate); cuda sees the device itself
                and uses it for the breakdown.
            categories: the breakdown category for each registered object (see
                :func:`batchfit.memory.registration.registered_tensors`).
            host_categories: categories that live in host memory (CPU offload): the
                tracked backends report them in ``host_bytes`` and leave them out of the
                device peak; cuda ignores them (it sees only the device).

        Returns:
            A :class:`MemoryMeasurement`; ``fits=False, exceeded=True`` when the call was
            aborted at the limit or ran out of device memory.

        Raises:
            Whatever ``fn`` raises other than running out of memory, unchanged.
        """

    def describe(self) -> dict[str, Any]:
        """The settings that qualify a measurement, for reports: name, device, bytes."""
        return {
            "backend": self.name,
            "device": str(self.device),
            "memory_limit": self.memory_limit,
            "reserve_bytes": self.reserve_bytes,
            "limit_bytes": self.limit_bytes,
            "round_to": self.round_to,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(memory_limit={self.memory_limit}, reserve_bytes={self.reserve_bytes}, "
            f"round_to={self.round_to})"
        )
