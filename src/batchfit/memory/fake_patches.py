"""Narrow, reversible patches that make libraries treat fake tensors as real ones during estimation.

NOTE [ Fake tensors are not tracing ]
transformers (5.x) checks ``is_tracing(tensor)``, which is true for fake tensors, in
``masking_utils.find_packed_sequence_indices``: while tracing it cannot read the position
ids, so it assumes packed sequences and the mask builder drops SDPA's ``is_causal`` path for
an explicit ``(B, 1, S, S)`` mask, which the real run never builds (the estimate would then
overestimate). Inside the estimate context the function still runs (its temporaries are
counted as in the real run) but reports "not packed" for fake position ids, as the real
run does for the ordinary ``0..S-1`` positions the step functions use. Packed position ids
(several sequences in one row) are therefore estimated as unpacked.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

_lock = threading.Lock()


@contextlib.contextmanager
def transformers_fake_patches() -> Iterator[None]:
    """Apply NOTE [ Fake tensors are not tracing ] while inside; restore on exit (also on error).

    A no-op when transformers is not installed or has no ``find_packed_sequence_indices``.
    """
    try:
        import transformers.masking_utils as masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # pragma: no cover - other transformers versions
        yield
        return

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        result = original(position_ids)
        if result is not None and isinstance(position_ids, FakeTensor):
            return None
        return result

    with _lock:
        masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        with _lock:
            masking_utils.find_packed_sequence_indices = original
