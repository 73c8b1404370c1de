"""Labels a step sets while it runs, read by the tracker: its phase and the region an op belongs to.

NOTE [ Phases and regions ]
A step says where it is with two labels, which the live-storage tracker reads for every op:

- the **phase** (``forward``, ``backward``, ``optimizer``), refined by a **position** in
  the layer stack (``embed``, ``layer-first``, ``layers-middle``, ``layer-last``,
  ``head``): the tracker keeps a peak per ``phase:position``. Depth extrapolation
  (:mod:`batchfit.models.depth`) extrapolates each of these peaks on its own and takes the
  largest: where the peak sits may change with the number of layers (early in backward
  for a shallow model, late for a deep one), while the peak at one structural position
  stays affine in it.
- the **region** (a breakdown category such as ``logprob_head`` or ``optimizer_step``):
  storages created while a region is set are counted under it instead of ``activations``.

The labels are process-wide (not thread-local) on purpose: autograd may run backward hooks
on another thread than the one that set the label. Only one step runs at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
#: The phase of ops run outside any labelled phase.
UNLABELLED = "step"
#: Positions in the layer stack, in forward order (backward visits them in reverse).
EMBED, LAYER_FIRST, LAYERS_MIDDLE, LAYER_LAST, HEAD = "embed", "layer-first", "layers-middle", "layer-last", "head"


class _Labels:
    def __init__(self) -> None:
        self.phase: str = UNLABELLED
        self.position: str | None = None
        self.region: str | None = None


_labels = _Labels()


def current_phase() -> str:
    """``"phase"`` or ``"phase:position"`` as set by :func:`phase` and :func:`set_position` (``"step"`` outside any)."""
    if _labels.position is None:
        return _labels.phase
    return f"{_labels.phase}:{_labels.position}"


def coarse_phase() -> str:
    """The phase alone, without the position."""
    return _labels.phase


def set_position(name: str | None) -> None:
    """Set the position within the current phase (reset by every :func:`phase` entry and exit).

    Outside any phase it does nothing: a step's position hooks that fire when its model runs
    elsewhere (a trainer's own forward and backward) leave no label behind.
    """
    if _labels.phase != UNLABELLED:
        _labels.position = name


def current_region() -> str | None:
    """The region set by the innermost :func:`region` (``None`` outside any)."""
    return _labels.region


def set_region(name: str | None) -> None:
    """Set the region without a ``with`` block (for autograd hooks that end a region mid-backward)."""
    _labels.region = name


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the ops run inside as phase ``name``; the previous phase is restored on exit."""
    before = (_labels.phase, _labels.position)
    _labels.phase, _labels.position = name, None
    try:
        yield
    finally:
        _labels.phase, _labels.position = before


@contextlib.contextmanager
def region(name: str | None) -> Iterator[None]:
    """Count storages created inside under category ``name``; restored on exit (also on error)."""
    before = _labels.region
    _labels.region = name
    try:
        yield
    finally:
        _labels.region = before
