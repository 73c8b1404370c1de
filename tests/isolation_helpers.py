"""Shared by tests/test_isolation.py (FSDP2) and tests/test_fsdp1.py (FSDP1): probes stopped on purpose.

NOTE [ Probes are isolated ] (:mod:`batchfit.memory.isolation`): a probe after an aborted
probe measures what a probe on the fresh model does. These helpers abort one (at a limit, or
with the device's out-of-memory error in a layer's forward or backward) and give the figures
two probes are compared by, and what a probe must leave in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchfit.parallel.shard import unwrap

#: How a probe is stopped: at a limit below its peak, or out of memory in forward or in backward.
ABORTS = ["limit", "oom-in-forward", "oom-in-backward"]


class OutOfMemoryAt:
    """Raise the device's out-of-memory error once, in the forward of layer 1 or the backward of layer 0.

    ``model`` may be wrapped (FSDP1, DDP, PEFT). ``fired`` says whether the error was raised.
    """

    def __init__(self, model: torch.nn.Module, where: str):
        self.fired = False
        layers = unwrap(model).model.layers
        if where == "oom-in-forward":
            self.handle = layers[1].register_forward_hook(lambda m, args, out: self._raise())
        else:
            # the gradient of layer 0's output arrives once layer 1's backward has run
            self.handle = layers[0].register_forward_hook(self._on_output)

    def _on_output(self, module, args, out):
        if torch.is_grad_enabled() and out.requires_grad and not self.fired:
            out.register_hook(lambda grad: self._raise())

    def _raise(self):
        if not self.fired:
            self.fired = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def aborted_probe(
    backend: Any, step: Callable[[], None], model: torch.nn.Module, optimizer: Any, abort: str, fresh_peak: int
):
    """``backend``'s measurement of ``step`` stopped as ``abort`` says (one of :data:`ABORTS`).

    ``"limit"`` stops it above 80% of ``fresh_peak`` (the fresh probe's peak); the others raise
    out of memory in the model (:class:`OutOfMemoryAt`), which the backend turns into its result.
    """
    if abort == "limit":
        with backend.stopping_above(int(0.8 * fresh_peak)):
            return backend.measure(step, register=(model, optimizer))
    with OutOfMemoryAt(model, abort) as oom:
        m = backend.measure(step, register=(model, optimizer))
    assert oom.fired
    return m


def held(model: torch.nn.Module, optimizer: Any) -> tuple[list, dict]:
    """The gradient tensors and the optimizer's state tensors, by identity: what a probe must leave in place."""
    grads = [p.grad for p in model.parameters()]
    state = {id(p): dict(s) for p, s in optimizer.state.items()}
    return grads, state


def figures(m) -> tuple[int, dict[str, int], int]:
    """What two probes must agree on: the peak, its breakdown by category, the host bytes."""
    return m.peak_bytes, dict(m.breakdown), m.host_bytes
