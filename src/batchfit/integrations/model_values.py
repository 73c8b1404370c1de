"""The values of a model's parameters and buffers, put back after a search that trained it.

# NOTE [ A search leaves the weights as it found them ]
A batch-size search runs real training steps (forward, backward, the optimizer's step), so the
parameters move and normalisation statistics are updated; AutoBatch's probes keep memory as it
was but not values (NOTE [ Probes are isolated ] in :mod:`batchfit.memory.isolation`). The
integrations then hand the model to a trainer that must start from the weights the user gave
it, so they copy every tensor of ``state_dict()`` to the CPU before the search (outside every
measurement, and off the device being measured) and load it back afterwards, whatever happened.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def values_kept(model: torch.nn.Module) -> Iterator[None]:
    """Run the body, then put ``model``'s parameters and buffers back to their values before it.

    The copy lives on the CPU (host memory, never the measured device). Gradients are dropped
    afterwards (``grad = None``), as a trainer starts without them.

    Raises:
        whatever the body raises, after the values are back.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> before = lin.weight.detach().clone()
        >>> with values_kept(lin):
        ...     _ = lin.weight.data.add_(1.0)
        >>> torch.equal(lin.weight, before)
        True
    """
    saved = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    try:
        yield
    finally:
        with torch.no_grad():
            model.load_state_dict(saved)
        for p in model.parameters():
            p.grad = None
