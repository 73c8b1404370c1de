"""What a training loop costs beyond time: peak memory per micro-batch, bytes of collectives per step.

Both are dispatch modes around a block of the loop (the memory tracker of
:mod:`batchfit.memory`, and :class:`CollectiveBytes`), read and reset at each boundary the
loop cares about. They count real execution on the CPU, the way the ``cpu`` backend
measures a budget's probes, so a micro-batch's peak compares directly with the
``limit_bytes`` of the :class:`~batchfit.budget.TokenBudget` it was planned with.
:class:`DevicePeaks` reads the same peak from the CUDA allocator's statistics, with no mode.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchfit.memory import MemoryTracker
from batchfit.memory.categories import registered_tensors
from batchfit.validation import check_positive_int

__all__ = ["COLLECTIVES", "HOST", "CollectiveBytes", "DevicePeaks", "PeakTracker"]

#: The category of tensors :class:`PeakTracker` registers as host memory (not counted).
HOST = "host"


class PeakTracker:
    """Live-storage peak of the bytes a block holds, read piece by piece: ``with PeakTracker(model, optimizer) as t``.

    ``state`` (model, optimizer, anything alive before the block) is registered as the
    cpu backend registers a probe's state; everything created inside is tracked (gradients
    accumulated over micro-batches included). ``host`` (tensors, or mappings of them such as
    the rollout batch) is registered as host memory: never counted, and an op that returns a
    view of it (``batch["attention_mask"].detach()``) does not count it as new device bytes.
    :meth:`take` returns the peak since the previous call (or the start) and starts a new
    one from the bytes held now.

    Example:
        >>> model = torch.nn.Linear(256, 256)
        >>> with PeakTracker(model) as t:
        ...     y = model(torch.ones(4, 256))
        ...     first = t.take()
        >>> first  # weight, bias, input, output
        271360

    ``limit_bytes`` caps the block as the cpu backend caps a probe: the op whose output takes
    the bytes held above it raises :class:`~batchfit.memory.MemoryLimitExceeded` (the simulated
    counterpart of ``torch.OutOfMemoryError``, which :class:`~batchfit.train.MicroBatchGuard`
    counts as running out).
    """

    def __init__(self, *state: Any, host: Any = (), round_to: int = 1, limit_bytes: int | None = None):
        self._state, self._host = state, host
        if limit_bytes is not None:
            limit_bytes = check_positive_int("limit_bytes", limit_bytes)
        self.limit_bytes = limit_bytes
        self._tracker = MemoryTracker(round_to=round_to, host_categories=(HOST,), limit_bytes=limit_bytes)

    def __enter__(self) -> PeakTracker:
        self._tracker.__enter__()
        try:
            for tensor, category in registered_tensors(self._host, HOST) + registered_tensors(self._state, None):
                self._tracker.register_tensor(tensor, category)
        except BaseException:
            self._tracker.__exit__(*sys.exc_info())  # leave no dispatch mode behind
            raise
        self._state = self._host = ()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tracker.__exit__(*exc)

    @property
    def current_bytes(self) -> int:
        """Bytes held now."""
        return self._tracker.current_bytes

    def take(self) -> int:
        """The peak bytes since the last :meth:`take` (or the start); starts the next peak from now."""
        peak = self._tracker.peak_bytes
        self._tracker.reset_peak()
        return peak


class DevicePeaks:
    """The CUDA allocator's own peak per block: ``torch.cuda.max_memory_allocated``, then ``reset_peak_memory_stats``.

    What :class:`PeakTracker` reads on the CPU, read from the device: :meth:`take` returns the
    largest allocated bytes since the previous call and starts the next peak from the bytes
    held now (one statistics read and one reset, no synchronisation); :attr:`current_bytes` is
    ``torch.cuda.memory_allocated``. Both count what torch's allocator hands to tensors, not
    what it reserves beyond them (the safety margin's share, docs/budget.md).

    Args:
        device: the CUDA device (default the current one).
    """

    def __init__(self, device: Any = None):
        self.device = device

    @property
    def current_bytes(self) -> int:
        """Bytes torch's allocator holds for tensors now."""
        return int(torch.cuda.memory_allocated(self.device))

    def take(self) -> int:
        """The peak allocated bytes since the last :meth:`take` (or the last reset); starts the next peak from now."""
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


def _collective_ops() -> dict[Any, tuple[str, int]]:
    """``{op: (kind, index of the argument whose bytes are counted)}``: the gathered output, the scattered input."""
    ops: dict[Any, tuple[str, int]] = {}
    c10d = getattr(torch.ops, "c10d", None)
    for name, kind, index in (
        ("_allgather_base_", "all_gather", 0),
        ("allgather_into_tensor_coalesced_", "all_gather", 0),
        ("allgather_", "all_gather", 0),
        ("_reduce_scatter_base_", "reduce_scatter", 1),
        ("reduce_scatter_tensor_coalesced_", "reduce_scatter", 1),
        ("reduce_scatter_", "reduce_scatter", 1),
        ("allreduce_", "all_reduce", 0),
    ):
        op = getattr(c10d, name, None) if c10d is not None else None
        if op is not None:
            ops[op.default] = (kind, index)
    return ops


#: The kinds of collectives :class:`CollectiveBytes` counts.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Bytes of this rank's collectives inside ``with CollectiveBytes() as c:``, by kind.

    Counts the c10d ops that FSDP2 and DDP dispatch: an all-gather by its output (the
    gathered parameters), a reduce-scatter by its input (the unsharded gradients), an
    all-reduce by its tensor. ``bytes[kind]`` and ``calls[kind]`` accumulate;
    :meth:`take` returns them and starts again from 0.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ops = _collective_ops()
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        self.calls = dict.fromkeys(COLLECTIVES, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counted = self._ops.get(func)
        if counted is not None:
            kind, index = counted
            self.bytes[kind] += _nbytes(args[index]) if index < len(args) else 0
            self.calls[kind] += 1
        return func(*args, **(kwargs or {}))

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(bytes, calls)`` by kind since the last :meth:`take` (or the start); both restart at 0."""
        out = (dict(self.bytes), dict(self.calls))
        self.bytes = dict.fromkeys(COLLECTIVES, 0)
        self.calls = dict.fromkeys(COLLECTIVES, 0)
        return out
