"""``batchfit.integrations.model_values``: a search that trains the model leaves its weights as they were."""

from __future__ import annotations

import pytest
import torch

from batchfit.integrations.model_values import values_kept


def test_parameters_and_buffers_come_back_even_when_the_body_raises():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="stopped"), values_kept(model):
        model(torch.randn(4, 3)).sum().backward()  # updates the running statistics, makes gradients
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        raise RuntimeError("stopped")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
