"""Gradient accumulation over micro-batches under DDP or FSDP2: sync only on the last one, sum over ranks.

NOTE [ Accumulate, then sync once ]
An optimizer step runs ``k`` micro-batches per rank. DDP all-reduces gradients in every
backward unless told not to; :func:`accumulate` runs every micro-batch but the last inside
``model.no_sync()``: a DDP rank holds the whole gradient anyway, so deferring costs no
memory and saves ``k − 1`` all-reduces. FSDP2 reduce-scatters in every backward and adds
into the rank's sharded gradient; deferring that (``set_requires_gradient_sync(False)``)
would keep every layer's *unsharded* gradient until the last backward — a full fp32 copy of
the model's gradients on every rank, about 30 GB for a 7B model, which no token budget can
afford. :func:`accumulate` therefore leaves FSDP2's sync on, as verl and SkyRL run it. In
both cases every micro-batch runs with the rank's own gradient resident, which is what the
token budget's probe holds (NOTE [ Gradients are resident between micro-batches ] in
:mod:`batchfit.train.optim`): every micro-batch of the step fits, not only the first.

Both wrappers **average** the gradients over the data-parallel ranks. The loss weights of
:func:`batchfit.batches.weights.loss_weights` make the weighted per-token losses of all ranks *sum*
to the mini-batch loss, so each rank multiplies its loss by :func:`data_parallel_size`
(:func:`batchfit.train.policy_loss` takes it as ``scale``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from batchfit.errors import BatchError
from batchfit.validation import check_int

T = TypeVar("T")

__all__ = ["accumulate", "accumulated_gradient_bytes", "data_parallel_size", "gradient_sync"]


def _is_ddp(model: torch.nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _is_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def data_parallel_size(model: torch.nn.Module) -> int:
    """The ranks ``model``'s gradients are averaged over: DDP's or FSDP1's process group, FSDP2's mesh, else 1.

    Under FSDP2 this is the size of the mesh its parameters are sharded (and, for HSDP,
    replicated) over; a model that is not wrapped gives 1.

    Example:
        >>> data_parallel_size(torch.nn.Linear(2, 2))
        1
    """
    if _is_ddp(model):
        import torch.distributed as dist

        return dist.get_world_size(model.process_group)
    if _is_fsdp(model):
        from torch.distributed.tensor import DTensor

        for param in model.parameters():
            if isinstance(param, DTensor):
                return int(param.device_mesh.size())
    if _is_fsdp1(model):  # the process group it shards over
        import torch.distributed as dist

        return dist.get_world_size(model.process_group)
    return 1


def accumulated_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the whole gradient of ``model``'s trainable parameters, in their dtypes (a sharded parameter counts its global size).

    What a rank would keep between micro-batches if FSDP2's gradient sync were deferred
    (``gradient_sync(model, False)``, which :func:`accumulate` does not do under FSDP2:
    NOTE [ Accumulate, then sync once ]).

    Example:
        >>> accumulated_gradient_bytes(torch.nn.Linear(4, 2))  # (8 + 2) fp32 values
        40
    """
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()) if p.requires_grad)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Run the forward and backward inside the block with gradient synchronisation on or off.

    ``enabled=False``: DDP's (and FSDP1's) ``no_sync()``; FSDP2's ``set_requires_gradient_sync(False)``
    (switched back on when the block exits; it keeps unsharded gradients until a synced
    backward, see NOTE [ Accumulate, then sync once ]). A model that is not wrapped is left alone.
    """
    if enabled:
        yield
        return
    if _is_ddp(model) or _is_fsdp1(model):
        with model.no_sync():
            yield
    elif _is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def accumulate(model: torch.nn.Module, micro_batches: Iterable[T], count: int) -> Iterator[T]:
    """Yield the ``count`` micro-batches of one optimizer step, each inside the right :func:`gradient_sync`.

    Run the forward and the backward of each yielded micro-batch in the loop body. Under DDP
    all but the last run without gradient synchronisation, the last with it; FSDP2 keeps
    reduce-scattering into the sharded gradient (NOTE [ Accumulate, then sync once ]).
    Every rank must iterate the same ``count`` (``plan.num_micro_batches``).

    Args:
        model: the trained model (bare, DDP or FSDP2).
        micro_batches: the rank's micro-batches, e.g. ``iter_micro_batches(batch, plan, rank)``.
        count: how many there are (``plan.num_micro_batches``).

    Yields:
        The micro-batches, in order.

    Raises:
        InvalidArgument: ``count`` is not a positive integer.
        BatchError: ``micro_batches`` holds more or fewer than ``count`` items (the gradients
            of a step that synced too early or never would be wrong).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> for x in accumulate(model, [torch.ones(2), torch.ones(2)], count=2):
        ...     model(x).sum().backward()
        >>> model.bias.grad
        tensor([2.])
    """
    count = check_int("count", count, minimum=1)
    seen = 0
    for item in micro_batches:
        if seen == count:
            raise BatchError(
                f"accumulate got more micro-batches than count={count}; pass plan.num_micro_batches of the plan being iterated"
            )
        with gradient_sync(model, seen == count - 1 or not _is_ddp(model)):
            yield item
        seen += 1
    if seen != count:
        raise BatchError(
            f"accumulate got {seen} micro-batches but count={count}: the last one, which synchronises gradients, never ran; pass plan.num_micro_batches of the plan being iterated"
        )
