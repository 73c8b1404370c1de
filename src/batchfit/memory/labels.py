"""Labels a step sets while it runs, read by the tracker: its phase and the region an op belongs to.

NOTE [ Phases and regions ]
A step says where it is with two labels, which the live-storage tracker reads for every op:

- the **phase** (``forward``, ``backward``, ``optimizer``), refined by a **position** in
  the layer stack (``embed``, ``layer-first``, ``layers-middle``, ``layer-last``,
  ``head``): the tracker keeps a peak per ``phase:position``. Depth extrapolation
  (:mod:`batchfit.budget.depth`) extrapolates each of these peaks on its own and takes the
  largest: where the peak sits may change with the number of layers (early in backward
  for a shallow model, late for a deep one), while the peak at one structural position
  stays affine in it.
- the **region** (a breakdown category such as ``logprob_head`` or ``optimizer_step``):
  storages created while a region is set are counted under it instead of ``activations``.

Where the labels live: on the trackers, not in the process. Each
:class:`~batchfit.memory.tracker.MemoryTracker` owns one :class:`_Labels` and reads only
its own; a ``contextvars.ContextVar`` holds the labels of the trackers active in the
current context (the innermost last). The functions of this module write to every label
set of the calling context (nested trackers see the same step) and read the innermost;
outside any tracker they do nothing and read the defaults (``"step"``, no region), for the
cost of one ``ContextVar.get``, since a trainer's own hooks call them on its hot path. A
tracker entered inside a labelled block starts from the labels in force there.

A context variable is right because the tracked backends only run CPU or fake-CPU tensors,
and for those autograd runs the whole backward (tensor and module hooks,
post-accumulate-grad hooks, the recomputation of activation checkpointing, reentrant or
not) on the thread that called ``backward()``, in that thread's current context
(``tests/test_tracker_state.py`` checks it). Autograd hands work to other threads only for
accelerator tensors (one worker thread per device, whose Python hooks do not run in the
caller's context): a CUDA backward's hooks would not reach these labels, and the ``cuda``
backend does not read them. Another thread (async checkpointing, a data loader) starts
with an empty context on Python 3.11-3.13, so its calls are no-ops and cannot relabel the
measured step; a thread given the context explicitly (``contextvars.copy_context().run``,
or ``thread_inherit_context`` on free-threaded 3.14) shares the measured step's labels, as
asyncio tasks created inside the block do.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
#: The phase of ops run outside any labelled phase.
UNLABELLED = "step"
#: Positions in the layer stack, in forward order (backward visits them in reverse).
EMBED, LAYER_FIRST, LAYERS_MIDDLE, LAYER_LAST, HEAD = (
    "embed",
    "layer-first",
    "layers-middle",
    "layer-last",
    "head",
)


class _Labels:
    """The labels of one tracker (NOTE [ Phases and regions ]); ``owner`` is the tracker while it is active."""

    __slots__ = ("owner", "phase", "position", "region")

    def __init__(self, owner: Any = None) -> None:
        self.phase: str = UNLABELLED
        self.position: str | None = None
        self.region: str | None = None
        self.owner: Any = owner

    def key(self) -> str:
        """``"phase"`` or ``"phase:position"``."""
        return self.phase if self.position is None else f"{self.phase}:{self.position}"


# The labels of the trackers active in the current context, innermost last.
_ACTIVE: contextvars.ContextVar[tuple[_Labels, ...]] = contextvars.ContextVar(
    "batchfit_tracker_labels", default=()
)


def _in_context() -> tuple[_Labels, ...]:
    """The label sets of the trackers active in the calling context (for the tracker's patches)."""
    return _ACTIVE.get()


def _push(mine: _Labels) -> None:
    """Make ``mine`` the innermost labels of the calling context, starting from the labels in force."""
    active = _ACTIVE.get()
    if active:
        inner = active[-1]
        mine.phase, mine.position, mine.region = inner.phase, inner.position, inner.region
    _ACTIVE.set((*active, mine))


def _pop(mine: _Labels) -> None:
    """Remove ``mine`` from the calling context (by identity, so trackers may exit out of order)."""
    active = _ACTIVE.get()
    for i in range(len(active) - 1, -1, -1):
        if active[i] is mine:
            _ACTIVE.set(active[:i] + active[i + 1 :])
            return


def current_phase() -> str:
    """``"phase"`` or ``"phase:position"`` as set by :func:`phase` and :func:`set_position` (``"step"`` outside any)."""
    active = _ACTIVE.get()
    return active[-1].key() if active else UNLABELLED


def coarse_phase() -> str:
    """The phase alone, without the position."""
    active = _ACTIVE.get()
    return active[-1].phase if active else UNLABELLED


def set_position(name: str | None) -> None:
    """Set the position within the current phase (reset by every :func:`phase` entry and exit).

    Outside any phase it does nothing: a step's position hooks that fire when its model runs
    elsewhere (a trainer's own forward and backward) leave no label behind. Outside any
    tracker it does nothing either.
    """
    for labels in _ACTIVE.get():
        if labels.phase != UNLABELLED:
            labels.position = name


def current_region() -> str | None:
    """The region set by the innermost :func:`region` (``None`` outside any)."""
    active = _ACTIVE.get()
    return active[-1].region if active else None


def set_region(name: str | None) -> None:
    """Set the region without a ``with`` block (for autograd hooks that end a region mid-backward)."""
    for labels in _ACTIVE.get():
        labels.region = name


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the ops run inside as phase ``name``; the previous phase is restored on exit.

    On exit every tracker of the context gets the phase that was in force at entry (also a
    tracker entered inside the block and still active).
    """
    active = _ACTIVE.get()
    if not active:
        yield
        return
    before = (active[-1].phase, active[-1].position)
    for labels in active:
        labels.phase, labels.position = name, None
    try:
        yield
    finally:
        for labels in _ACTIVE.get():
            labels.phase, labels.position = before


@contextlib.contextmanager
def region(name: str | None) -> Iterator[None]:
    """Count storages created inside under category ``name``; restored on exit (also on error)."""
    active = _ACTIVE.get()
    if not active:
        yield
        return
    before = active[-1].region
    for labels in active:
        labels.region = name
    try:
        yield
    finally:
        for labels in _ACTIVE.get():
            labels.region = before
