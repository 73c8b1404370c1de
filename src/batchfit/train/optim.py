"""The optimizer side of a trainer: the default optimizer, its state created up front, gradients kept allocated.

A token budget's probe and a trainer use the same three helpers, so the state a probe
measures is the state the trainer holds between micro-batches:

- :func:`default_optimizer`: AdamW with ``foreach=True`` (what PyTorch picks on CUDA) over the
  trainable parameters (a LoRA model's adapters).
- :func:`initialize_optimizer_state`: the optimizer's lazy state created now (SkyRL #1060
  profiled one step and missed it).
- :func:`allocate_gradients`: every trainable parameter's ``.grad`` allocated, as from the
  second micro-batch of an accumulation on (NOTE [ Gradients are resident between micro-batches ]).
"""

from __future__ import annotations

from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.parallel.shard import unwrap
from batchfit.parallel.shard_state import zero_state

__all__ = ["allocate_gradients", "default_optimizer", "initialize_optimizer_state"]


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazy state now, for the parameters that have none, leaving everything else as it was.

    A zero-learning-rate step on zero gradients runs over the parameters without state
    only (the others have ``grad=None`` during it, so the optimizer skips them: their
    moments and step counts are untouched); the new states' step counters are then set
    back to 0, so bias correction starts as if no step had run. Parameters and their
    gradients are unchanged (AdamW's decoupled weight decay multiplies by
    ``1 - lr * wd = 1``). Without this, the first measured step would also allocate the
    state and a single profile would miss it on later steps (SkyRL #1060). Frozen parameters
    (``requires_grad=False``: a LoRA model's base) get no state, as in training, where they
    never have a gradient.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # a frozen parameter (a LoRA base) never gets a gradient, so a trainer never creates its state
    fresh = [p for p in params if p.requires_grad and not optimizer.state.get(p)]
    if not fresh:
        return
    fresh_ids = {id(p) for p in fresh}
    saved_grads = [p.grad for p in params]
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in fresh_ids else None
        for group in optimizer.param_groups:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else group["lr"] * 0
        with torch.no_grad():
            optimizer.step()
        for p in fresh:
            state = optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].zero_()
            elif "step" in state:
                state["step"] = 0
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def allocate_gradients(model: torch.nn.Module) -> None:
    """Give every trainable parameter without one a zero ``.grad`` (a sharded one for FSDP2).

    NOTE [ Gradients are resident between micro-batches ]
    A trainer accumulates gradients over the micro-batches of an optimizer step: from the
    second micro-batch on, the whole gradient (each rank's shard under FSDP2, which
    reduce-scatters and adds into it after every backward) is on the device for the entire
    forward and backward. A step measured from ``grad=None`` misses it wherever its peak
    falls before the last gradient is created — in the forward, or early in the backward
    (9% of the peak on the tiny model). So a token budget's probe runs with the gradients
    allocated before and kept after (``zero_grad`` with ``set_to_none=False``): every
    micro-batch of an accumulation fits, the first included.
    """
    zero = zero_state(model)
    if zero is not None and zero.gradients is not None:
        return  # ZeRO-2 keeps its partition's gradients in a buffer of its own (batchfit.parallel.zero)
    for p in unwrap(model).parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def default_optimizer(parameters: Any, lr: float = 1e-6) -> torch.optim.Optimizer:
    """The optimizer every batchfit step trains with: AdamW with ``foreach=True``, over the trainable parameters.

    ``foreach`` is what PyTorch picks by default on CUDA; on the CPU (and so under the
    estimate backend's fake CPU tensors) its default is the per-parameter loop, whose
    temporaries are smaller, so it is set explicitly: an estimate predicts the CUDA step.

    Args:
        parameters: parameters (e.g. ``model.parameters()``); frozen ones
            (``requires_grad=False``, a LoRA model's base) are left out, so the state is the
            trainable parameters' only, two fp32 moments each for fp32 adapters (verl and SkyRL
            hand AdamW every parameter, which comes to the same state: a frozen parameter never
            has a gradient).
        lr: the learning rate.

    Raises:
        InvalidArgument: no parameter requires a gradient.
    """
    params = [p for p in parameters if p.requires_grad]
    if not params:
        raise InvalidArgument(
            "parameters must include at least one trainable parameter (requires_grad=True), but got none; "
            "unfreeze the model, or give it LoRA adapters"
        )
    return torch.optim.AdamW(params, lr=lr, foreach=True)
