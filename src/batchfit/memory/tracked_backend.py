"""Measurement with the live-storage tracker, shared by the ``cpu`` and ``estimate`` backends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from batchfit.memory.base import Backend
from batchfit.memory.categories import GRADIENTS
from batchfit.memory.cuda_attention import cuda_attention
from batchfit.memory.measurement import MemoryMeasurement
from batchfit.memory.tracker import MemoryLimitExceeded, MemoryTracker
from batchfit.patching import undo_all
from batchfit.validation import check_choice

#: Whose attention kernels a tracked step runs: CUDA's choice, or the CPU's own.
ATTENTION_KERNELS = ("cuda", "own")


@dataclass
class _Trial:
    tracker: MemoryTracker
    registered: list[tuple[torch.Tensor, str]]
    parameters: list[torch.nn.Parameter]


class TrackedBackend(Backend):
    """A backend whose peak comes from :class:`~batchfit.memory.tracker.MemoryTracker`.

    The call runs inside :meth:`context`. The tracker aborts it as soon as live bytes exceed
    :attr:`limit_bytes` (NOTE [ Abort above the limit ] in the tracker), so a probe far above
    the limit costs little. Gradients are counted as ``"gradients"`` from the moment autograd
    accumulates them into ``param.grad`` (post-accumulate-grad hooks on the registered
    modules' parameters).

    The step's ``scaled_dot_product_attention`` runs the kernel CUDA would choose
    (``attention_kernels="cuda"``, the default: batchfit sizes GPU steps, and the cpu backend
    is the estimate's referee), or the CPU's own choice (``"own"``): NOTE [ The estimate runs
    CUDA's attention kernel ] in :mod:`batchfit.memory.cuda_attention`.
    """

    runs_past_limit = True

    def _set_attention_kernels(self, attention_kernels: str) -> None:
        self.attention_kernels = check_choice("attention_kernels", attention_kernels, ATTENTION_KERNELS)

    def _prepare(
        self,
        registered: list[tuple[torch.Tensor, str]],
        parameters: list[torch.nn.Parameter],
        host_categories: Sequence[str],
    ) -> _Trial:
        return _Trial(self._tracker(host_categories), registered, parameters)

    def _tracker(self, host_categories: Sequence[str]) -> MemoryTracker:
        """The trial's tracker: a dispatch mode here; the estimate's is fed by its fake mode."""
        return MemoryTracker(round_to=self.round_to, limit_bytes=self._abort_bytes(), host_categories=host_categories)

    @contextlib.contextmanager
    def _running(self, state: _Trial) -> Iterator[None]:
        tracker = state.tracker
        kernels = cuda_attention() if self.runs_cuda_attention else contextlib.nullcontext()
        with self.context(), kernels:
            handles = []
            try:  # a hook that fails to register removes the ones registered before it
                for p in state.parameters:
                    handles.append(
                        p.register_post_accumulate_grad_hook(
                            # a hook registered before this one may have taken the gradient (ZeRO-2)
                            lambda p: None if p.grad is None else tracker.recategorize(p.grad, GRADIENTS)
                        )
                    )
                state.parameters = []
                with tracker:
                    for tensor, category in state.registered:
                        tracker.register_tensor(tensor, category)
                    state.registered = []  # counted; the step may now free them
                    yield
            finally:
                undo_all(handle.remove for handle in reversed(handles))

    def _aborted(self, exc: Exception) -> bool:
        return isinstance(exc, MemoryLimitExceeded)  # the simulated OOM

    def _result(self, state: _Trial, exceeded: bool, seconds: float) -> MemoryMeasurement:
        tracker = state.tracker
        limit = self.limit_bytes
        return MemoryMeasurement(
            peak_bytes=tracker.peak_bytes,
            fits=not exceeded and (limit is None or tracker.peak_bytes <= limit),
            limit_bytes=limit,
            backend=self.name,
            breakdown=dict(tracker.peak_breakdown),
            exceeded=exceeded,
            seconds=seconds,
            host_bytes=tracker.host_bytes,
            phase_peaks=dict(tracker.phase_peaks),
            phase_breakdowns={k: dict(v) for k, v in tracker.phase_breakdowns.items()},
        )
