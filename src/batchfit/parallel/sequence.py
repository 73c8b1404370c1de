"""Ulysses sequence parallelism's collectives: the group, the all-to-alls around attention, the gather of outputs.

NOTE [ Ulysses sequence parallelism ]
A packed row of ``T`` tokens is cut into ``sp`` equal runs of columns, one per rank of a
sequence-parallel group (:mod:`batchfit.parallel.sequence_split`). Outside attention every
operation is per token, so each rank runs its ``T / sp`` tokens through the decoder alone.
Attention needs the whole sequence: around it an all-to-all (:func:`seq_to_heads`) swaps the
split of the sequence for a split of the heads (each rank then holds ``heads / sp`` heads of
all ``T`` tokens), attention runs, and the reverse all-to-all (:func:`heads_to_seq`) swaps
back (DeepSpeed-Ulysses, arXiv 2309.14509; verl ``verl/utils/ulysses.py``
``gather_seq_scatter_heads`` / ``gather_heads_scatter_seq``). Per-token outputs (log-probs)
are gathered back to the whole row with :func:`gather_sequence`.

Both are ``torch.distributed`` collectives inside ``torch.autograd.Function``: the backward of
an all-to-all is the reverse all-to-all, the backward of the gather keeps this rank's columns
of the gradient. So when every rank of a group computes the same loss from the gathered
outputs, the gradients summed over the group's ranks are the unsplit sequence's gradient:
a data-parallel average over the whole world (FSDP2 over ``dp × sp`` ranks) needs the loss
scaled by the world size, not the data-parallel size (verl's ``Gather`` multiplies the
gradient by ``sp`` for the same reason: ``grad_scaler`` in ``gather_outputs_and_unpad``).

The collectives run on any backend with ``all_to_all_single`` and ``all_gather``: NCCL, gloo
(real CPU ranks) and PyTorch's fake process group (the estimate backend, where the tracker
counts their buffers as it counts any tensor).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from batchfit.errors import InvalidArgument
from batchfit.validation import check_positive_int

__all__ = [
    "gather_sequence",
    "group_rank",
    "group_size",
    "heads_to_seq",
    "seq_to_heads",
    "sequence_parallel_group",
]


def sequence_parallel_group(size: int) -> Any:
    """This rank's sequence-parallel group: ``size`` consecutive ranks of the default group.

    The world is a ``(dp, sp)`` grid with ``sp`` the inner dimension, as verl's
    ``init_device_mesh(..., mesh_shape=(dp, sp), mesh_dim_names=["dp", "sp"])`` lays it out: ranks
    ``k·sp … k·sp + sp − 1`` split one sequence. Every rank must call this (``new_group`` is
    collective); it makes every group and returns its own.

    Args:
        size: ranks per group (``sp``); 1 returns ``None`` (no group: nothing is split).

    Returns:
        A process group of ``size`` ranks, or ``None`` for ``size=1``.

    Raises:
        InvalidArgument: ``size`` is not a positive int, there is no process group while
            ``size > 1``, or ``size`` does not divide the world size.
    """
    check_positive_int("sequence_parallel", size)
    if size == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument(
            f"sequence_parallel={size} splits a sequence over {size} ranks and needs a process group: launch with "
            f"torchrun --nproc-per-node {size} (or a multiple), or estimate inside "
            f"batchfit.parallel.simulated_world({size})"
        )
    world = dist.get_world_size()
    if world % size:
        raise InvalidArgument(
            f"sequence_parallel must divide the world size {world} (world = data-parallel × sequence-parallel ranks), "
            f"but got sequence_parallel={size}; use a divisor of {world}"
        )
    from batchfit.parallel.distributed import is_simulated, search_timeout

    rank = dist.get_rank()
    timeout = None if is_simulated() else search_timeout()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)), timeout=timeout)
        if start <= rank < start + size:
            mine = group
    return mine


def group_size(group: Any) -> int:
    """Ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This rank's place in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Send chunk ``j`` of ``x`` along ``scatter_dim`` to rank ``j``; concatenate what comes back along ``gather_dim`` in rank order."""
    size = dist.get_world_size(group)
    moved = x.movedim(scatter_dim, 0)
    parts = moved.reshape(size, moved.shape[0] // size, *moved.shape[1:]).contiguous()
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=group)
    # [size, x's dims with the scattered one cut]: then the senders' pieces side by side along gather_dim
    out = out.movedim(1, scatter_dim + 1).movedim(0, gather_dim)
    return out.flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _check_divisible(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] % size:
        raise InvalidArgument(
            f"{what}={x.shape[dim]} must be divisible by the sequence-parallel size {size} "
            f"(Ulysses gives each rank an equal share), but got shape {tuple(x.shape)}"
        )


def seq_to_heads(x: torch.Tensor, group: Any, *, seq_dim: int = 2, head_dim: int = 1) -> torch.Tensor:
    """All-to-all from this rank's tokens of every head to every token of this rank's heads (autograd-aware).

    ``x`` is ``[..., heads, T / sp, ...]`` (transformers' ``[batch, heads, tokens, dim]`` by
    default); the result is ``[..., heads / sp, T, ...]``: rank ``r`` gets heads
    ``r·heads/sp … (r+1)·heads/sp − 1``, tokens in rank order. ``group=None`` returns ``x``.

    Raises:
        InvalidArgument: the head count is not divisible by the group's size.
    """
    size = group_size(group)
    if size == 1:
        return x
    _check_divisible(x, head_dim, size, "heads")
    return _AllToAll.apply(x, group, head_dim, seq_dim)


def heads_to_seq(x: torch.Tensor, group: Any, *, seq_dim: int = 1, head_dim: int = 2) -> torch.Tensor:
    """The reverse of :func:`seq_to_heads`: this rank's heads of every token back to every head of its tokens.

    ``x`` is ``[..., T, heads / sp, ...]`` (transformers' attention output ``[batch, tokens,
    heads, dim]`` by default); the result is ``[..., T / sp, heads, ...]``.

    Raises:
        InvalidArgument: the token count is not divisible by the group's size.
    """
    size = group_size(group)
    if size == 1:
        return x
    _check_divisible(x, seq_dim, size, "tokens")
    return _AllToAll.apply(x, group, seq_dim, head_dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.size, ctx.rank = group, dim, size, dist.get_rank(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group: Any, *, dim: int = 1) -> torch.Tensor:
    """Every rank's equal share of a row along ``dim``, concatenated in rank order (autograd-aware).

    The backward keeps this rank's columns of the gradient (NOTE [ Ulysses sequence
    parallelism ]: scale the loss by the world size under FSDP2/DDP). ``group=None`` returns ``x``.
    """
    if group_size(group) == 1:
        return x
    return _Gather.apply(x, group, dim)
