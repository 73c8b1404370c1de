"""Measurement with the live-storage tracker, shared by the ``cpu`` and ``estimate`` backends."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchfit.memory.base import Backend
from batchfit.memory.measurement import MemoryMeasurement
from batchfit.memory.registration import (
    GRADIENTS,
    registered_tensors,
    restore_grads_after_abort,
    trainable_parameters,
)
from batchfit.memory.tracker import MemoryLimitExceeded, MemoryTracker


class TrackedBackend(Backend):
    """A backend whose peak comes from :class:`~batchfit.memory.tracker.MemoryTracker`.

    The tracker aborts the call as soon as live bytes exceed :attr:`limit_bytes` (NOTE
    [ Abort above the limit ] in the tracker), so a probe far above the limit costs little.
    Gradients are counted as ``"gradients"`` from the moment autograd accumulates them
    into ``param.grad`` (post-accumulate-grad hooks on the registered modules' parameters).
    """

    def measure(
        self,
        fn: Callable[[], Any],
        register: Any = (),
        categories: Sequence[str | None] | str | None = None,
        host_categories: Sequence[str] = (),
    ) -> MemoryMeasurement:
        """Run ``fn()`` once under the tracker; see :meth:`Backend.measure`."""
        pairs = registered_tensors(register, categories)
        restore_grads = restore_grads_after_abort(register)
        start = time.perf_counter()
        tracker = MemoryTracker(
            round_to=self.round_to, limit_bytes=self.limit_bytes, host_categories=host_categories
        )
        exceeded = False
        with self.context():
            handles = [
                p.register_post_accumulate_grad_hook(lambda p: tracker.recategorize(p.grad, GRADIENTS))
                for p in trainable_parameters(register)
            ]
            try:
                with tracker:
                    for tensor, category in pairs:
                        tracker.register_tensor(tensor, category)
                    del pairs
                    fn()
            except MemoryLimitExceeded:
                # The simulated OOM; the frames of the aborted call die with the exception.
                exceeded = True
            finally:
                for handle in handles:
                    handle.remove()
        if exceeded:
            restore_grads()
            gc.collect()
        peak = tracker.peak_bytes
        limit = self.limit_bytes
        return MemoryMeasurement(
            peak_bytes=peak,
            fits=not exceeded and (limit is None or peak <= limit),
            limit_bytes=limit,
            backend=self.name,
            breakdown=dict(tracker.peak_breakdown),
            exceeded=exceeded,
            seconds=time.perf_counter() - start,
            host_bytes=tracker.host_bytes,
            phase_peaks=dict(tracker.phase_peaks),
            phase_breakdowns={k: dict(v) for k, v in tracker.phase_breakdowns.items()},
        )
