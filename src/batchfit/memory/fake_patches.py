"""Narrow, reversible patches that make libraries treat fake tensors as real ones during estimation.

NOTE [ Fake tensors are not tracing ]
transformers (5.x) checks ``is_tracing(tensor)``, which is true for fake tensors, in
``masking_utils.find_packed_sequence_indices``: while tracing it cannot read the position
ids, so it assumes packed sequences and the mask builder drops SDPA's ``is_causal`` path for
an explicit ``(B, 1, S, S)`` mask, which the real run never builds for ordinary positions
(the estimate would then overestimate). Inside the estimate context the function still runs
(its temporaries are counted as in the real run), and then decides as the real run does:
position ids made from host data keep their values (NOTE [ Integer tensors keep their
values ] in :mod:`batchfit.memory.shadow_values`), so the check the real run makes
(``(packed_sequence_mask[:, -1] == 0).all()``) runs on them, its temporaries counted too:
``0..S-1`` rows are not packed, packed rows (positions restarting at 0) are, and get the
block-diagonal mask the real run builds (measured: a 1,024-token row of three sequences
through the tiny model with ``sdpa`` peaks 8.9 MB higher than the unpacked guess). Position
ids whose values are not known are reported "not packed", as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.memory.shadow_values import shadow_of
from batchfit.patching import AttributePatch


def _masking_utils() -> Any:
    try:
        import transformers.masking_utils as masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return masking_utils


# NOTE [ Shared and counted ] in batchfit.patching: nested and concurrent blocks share it
_PATCH = AttributePatch(_masking_utils, "find_packed_sequence_indices", lazy=True)


@_PATCH.bind
def _find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
    """transformers' ``find_packed_sequence_indices``, deciding on fake tensors as the real run does (NOTE)."""
    result = _PATCH.call_below(position_ids)
    if result is not None and isinstance(result, FakeTensor):
        if shadow_of(result) is None:
            return None  # values unknown: assume the ordinary positions
        if bool((result[:, -1] == 0).all()):  # the real run's own check, on the kept values
            return None
    return result


@contextlib.contextmanager
def transformers_fake_patches() -> Iterator[None]:
    """Apply NOTE [ Fake tensors are not tracing ] while inside; restore on exit (also on error).

    A no-op when transformers is not installed or has no ``find_packed_sequence_indices``.
    Nested and concurrent blocks (several estimate backends, threads) share one
    installation: the first entered installs it, the last to exit puts back the module's
    own function (the same object), in whatever order the blocks exit. Code that replaced
    the attribute since keeps its replacement.
    """
    with _PATCH.active():
        yield
