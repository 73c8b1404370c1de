"""A live-storage tracker: the exact peak of bytes held by tensors during a block of code.

:class:`MemoryTracker` is a ``TorchDispatchMode`` that sees every op's outputs, records each
output's untyped storage once (keyed by its ``_cdata``) and forgets it when the storage dies
(``weakref.finalize``). The running sum of live storage bytes and its maximum are the
"live-byte peak" of the block, which on the CPU matched the CPU profiler within 256 bytes
and is deterministic run to run; under ``FakeTensorMode`` it predicts the same peak with no
allocation (``../shared/DESIGN.md``, memory measurement facts).

Storages that exist before the tracker starts (parameters, buffers, inputs, optimizer
state) are invisible to it until registered with :meth:`MemoryTracker.register`.

With ``limit_bytes`` the tracker behaves like a device that runs out of memory: the op
whose output takes the live bytes above the limit raises :class:`MemoryLimitExceeded`
(see NOTE [ Abort above the limit ]).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchfit.memory.registration import categorized_tensors

OTHER = "activations"


class MemoryLimitExceeded(Exception):
    """Live bytes went above the tracker's ``limit_bytes``: the tracked block is aborted.

    Internal control flow, the simulated counterpart of ``torch.OutOfMemoryError``: raised
    from inside the dispatch mode (or :meth:`MemoryTracker.register`) and caught by the
    memory backends, which report "does not fit". ``reached`` is the live byte count at the
    abort (a lower bound of the peak the block would have had), ``limit`` the limit.
    """

    def __init__(self, reached: int, limit: int):
        self.reached = reached
        self.limit = limit
        super().__init__(f"live bytes {reached} exceeded the limit of {limit} bytes")


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple if multiple > 1 else nbytes


class MemoryTracker(TorchDispatchMode):
    """Track live tensor-storage bytes and their peak inside ``with MemoryTracker() as t:``.

    Args:
        round_to: round each storage up to a multiple of this many bytes (512 models the CUDA
            caching allocator's block size; 1 = exact bytes).
        limit_bytes: if given, raise :class:`MemoryLimitExceeded` as soon as the live bytes
            exceed it (``None`` = no limit).

    Attributes:
        current_bytes: bytes held now by tracked storages.
        peak_bytes: the largest ``current_bytes`` seen since the start or the last
            :meth:`reset_peak`.
        peak_breakdown: bytes per category at the moment of the peak (registered
            categories such as ``"parameters"``; op outputs count as ``"activations"``).

    Example:
        >>> x = torch.randn(1024)
        >>> with MemoryTracker() as t:
        ...     t.register(x, category="inputs")
        ...     y = x * 2
        >>> t.peak_bytes
        8192
    """

    def __init__(self, *, round_to: int = 1, limit_bytes: int | None = None):
        super().__init__()
        self.round_to = int(round_to)
        self.limit_bytes = None if limit_bytes is None else int(limit_bytes)
        self._live: dict[int, tuple[int, str]] = {}
        self._by_category: dict[str, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = {}

    # ----------------------------------------------------------------- bookkeeping
    def _add(self, storage: Any, category: str) -> None:
        key = storage._cdata
        nbytes = _round_up(int(storage.nbytes()), self.round_to)
        old = self._live.get(key)
        if old is not None:
            if old[0] == nbytes:
                return
            # resized in place (resize_/set_): account the difference only
            self._change(-old[0], old[1])
        else:
            weakref.finalize(storage, self._free, key)
        self._live[key] = (nbytes, category)
        self._change(nbytes, category)

    def _change(self, delta: int, category: str) -> None:
        self.current_bytes += delta
        self._by_category[category] = self._by_category.get(category, 0) + delta
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_breakdown = {k: v for k, v in self._by_category.items() if v}
            # NOTE [ Abort above the limit ]
            # Raising here, right after the op whose output crossed the limit, stops the
            # block the way a real allocation failure would, so a probe far above the limit
            # costs little. Only growth can cross it (frees never raise, so weakref
            # finalizers stay silent), and the bookkeeping is complete before the raise.
            if self.limit_bytes is not None and self.current_bytes > self.limit_bytes:
                raise MemoryLimitExceeded(self.current_bytes, self.limit_bytes)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._change(-entry[0], entry[1])

    # ----------------------------------------------------------------- public API
    def register(self, *objects: Any, category: str = "inputs") -> None:
        """Count storages that already exist (created before the tracker or outside it).

        Accepts tensors, ``nn.Module`` (parameters, buffers and existing gradients), a
        ``torch.optim.Optimizer`` (its state tensors), and mappings or iterables of these.
        A storage already tracked is not counted twice.
        """
        for obj in objects:
            for t, _ in categorized_tensors(obj, category):
                self._add(t.untyped_storage(), category)

    def register_tensor(self, tensor: torch.Tensor, category: str) -> None:
        """Count the storage of ``tensor`` alone (not its ``.grad``) under ``category``.

        A storage already tracked keeps its first category.
        """
        self._add(tensor.untyped_storage(), category)

    def recategorize(self, tensor: torch.Tensor, category: str) -> None:
        """Move a tracked storage's bytes to ``category`` (the total is unchanged).

        Used for storages whose role is known only after they were created, such as a
        gradient produced by a backward op and then accumulated into ``param.grad``.
        Untracked storages are ignored.
        """
        key = tensor.untyped_storage()._cdata
        entry = self._live.get(key)
        if entry is None or entry[1] == category:
            return
        nbytes, old = entry
        self._live[key] = (nbytes, category)
        self._by_category[old] -= nbytes
        self._by_category[category] = self._by_category.get(category, 0) + nbytes

    def reset_peak(self) -> None:
        """Start a new peak measurement from the bytes held now."""
        self.peak_bytes = self.current_bytes
        self.peak_breakdown = {k: v for k, v in self._by_category.items() if v}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t.untyped_storage(), OTHER)
        return out
