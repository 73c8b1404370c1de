"""The estimate's tracker fed by its fake mode counts what the tracker on the mode stack counts (NOTE [ The estimate's tracker is fed by its fake mode ])."""

from __future__ import annotations

import pytest
import torch

from batchfit.memory import labels
from batchfit.memory.estimate import EstimateBackend
from batchfit.memory.observed_fake import ObservedFakeTensorMode, ObservingTracker
from batchfit.memory.tracker import MemoryLimitExceeded, MemoryTracker


def _figures(tracker):
    return (
        tracker.peak_bytes,
        tracker.current_bytes,
        tracker.peak_breakdown,
        tracker.phase_peaks,
        tracker.phase_breakdowns,
    )


def _step(model, opt, n):
    """A training step with phases, a region, a boolean-mask index (shadow values) and an optimizer step."""
    x = torch.randn(n, 16)
    mask = torch.arange(n).to("cpu", copy=True) % 2 == 0
    with labels.phase(labels.FORWARD):
        h = torch.relu(model[0](x))[mask]
        loss = model[1](h).square().mean()
    with labels.phase(labels.BACKWARD):
        loss.backward()
    del loss, h
    with labels.phase(labels.OPTIMIZER), labels.region("optimizer_step"):
        opt.step()
        opt.zero_grad(set_to_none=False)


@pytest.fixture
def built():
    backend = EstimateBackend(round_to=512)
    with backend.context():
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 8))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        _step(model, opt, 4)  # the optimizer's state, the fake cache warm
    return backend, model, opt


@pytest.mark.parametrize("n", [6, 40])
def test_fed_tracker_counts_what_the_mode_tracker_counts(built, n):
    backend, model, opt = built
    assert isinstance(backend.fake_mode, ObservedFakeTensorMode)
    results = []
    for make in (
        lambda: MemoryTracker(round_to=512),
        lambda: ObservingTracker(backend.fake_mode, round_to=512),
    ):
        with backend.context():
            tracker = make()
            with tracker:
                tracker.register(model, opt)
                _step(model, opt, n)
        results.append(_figures(tracker))
    assert results[0] == results[1]
    assert results[0][0] > 0 and set(results[0][3]) >= {labels.FORWARD, labels.BACKWARD, labels.OPTIMIZER}
    assert backend.fake_mode.observers == []


def test_fed_tracker_reentered_counts_once_and_leaves(built):
    backend = built[0]
    with backend.context():
        tracker = ObservingTracker(backend.fake_mode)
        with tracker:
            with tracker:
                assert backend.fake_mode.observers == [tracker]
                y = torch.empty(1000, dtype=torch.uint8)
            assert backend.fake_mode.observers == [tracker]
        assert backend.fake_mode.observers == []
        torch.empty(5000, dtype=torch.uint8)  # not seen: exited
    assert tracker.peak_bytes == 1000 and y.untyped_storage().nbytes() == 1000


def test_fed_tracker_aborts_at_its_limit(built):
    backend, _, _ = built
    held = []
    with backend.context(), pytest.raises(MemoryLimitExceeded) as info, ObservingTracker(backend.fake_mode, limit_bytes=4096):
        held.append(torch.empty(1024, dtype=torch.uint8))
        held.append(torch.empty(8192, dtype=torch.uint8))
    assert (info.value.reached, info.value.limit) == (1024 + 8192, 4096)
    assert backend.fake_mode.observers == []


def test_estimate_backend_measures_with_the_fed_tracker(built):
    backend, model, opt = built
    seen = []
    original = ObservingTracker._observe

    def counting(self, *args):
        seen.append(args[0])
        return original(self, *args)

    ObservingTracker._observe = counting
    try:
        measured = backend.measure(lambda: _step(model, opt, 8), register=(model, opt))
    finally:
        ObservingTracker._observe = original
    assert seen and measured.peak_bytes > 0
