"""NOTE [ torch's fake dispatch cache is bounded ]: the estimate empties torch's process-wide fake dispatch cache past
its bound, and an emptied cache changes no measurement."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from batchfit.memory import estimate, get_backend
from batchfit.memory.estimate import bound_fake_cache


def _peak(backend, x, w) -> int:
    return backend.measure(lambda: torch.nn.functional.linear(x, w).relu().sum().backward(), register=(x, w)).peak_bytes


def test_the_fake_dispatch_cache_is_emptied_past_its_bound_and_no_measurement_changes(monkeypatch):
    backend = get_backend("estimate", reserve_bytes=0)
    with backend.context():
        x = torch.randn(64, 32, requires_grad=True)
        w = torch.randn(48, 32, requires_grad=True)
    warm = _peak(backend, x, w)
    assert len(FakeTensorMode.cache) > 0 and _peak(backend, x, w) == warm  # served from the cache
    assert bound_fake_cache(10**9) is False and len(FakeTensorMode.cache) > 0
    assert bound_fake_cache(0) is True and len(FakeTensorMode.cache) == 0
    assert _peak(backend, x, w) == warm  # an emptied cache gives the same peak to the byte
    # each trial bounds it first: past the bound, what is left is that one trial's entries
    one_trial = len(FakeTensorMode.cache)
    with backend.context():
        torch.randn(7, 5) @ torch.randn(5, 3)  # entries of another shape
    assert len(FakeTensorMode.cache) > one_trial
    monkeypatch.setattr(estimate, "FAKE_CACHE_ENTRIES", one_trial)
    assert _peak(backend, x, w) == warm and len(FakeTensorMode.cache) == one_trial
