"""Running a :class:`~batchfit.packing.MicroBatchPlan`: sub-batches per rank, equal counts over ranks.

The tensor side of :mod:`batchfit.packing`: :func:`iter_micro_batches` cuts a per-sample
batch (the mapping of :mod:`batchfit.batch`) along a plan and trims each micro-batch to the
columns its members use; :func:`sync_micro_batch_count` makes every rank step the same
number of times when each rank planned its own data.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchfit.batch import Batch, batch_size, take_rows
from batchfit.distributed import all_reduce_max
from batchfit.errors import BatchError, InvalidArgument
from batchfit.minibatch import pad_rows
from batchfit.packing import MicroBatchPlan
from batchfit.validation import is_int

__all__ = ["MicroBatch", "iter_micro_batches", "sync_micro_batch_count", "trim_padding"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one rank, as yielded by :func:`iter_micro_batches`.

    Attributes:
        batch: the per-sample fields of its sequences (trimmed), or one pad row.
        indices: input indices of its sequences, in row order; ``()`` for a padding micro-batch.
        position: ``k``, its place among the rank's micro-batches.
        cost: its cost in the plan, in tokens.
    """

    batch: dict[str, Any]
    indices: tuple[int, ...]
    position: int
    cost: int

    @property
    def is_padding(self) -> bool:
        """True for a padding micro-batch: one pad row, no loss (NOTE [ Pad rows cost one token ])."""
        return not self.indices


def trim_padding(batch: Batch, *, attention_mask_key: str = "attention_mask") -> dict[str, Any]:
    """Drop the leading and trailing columns in which no row has a valid token.

    Every tensor/array field whose second dimension equals the attention mask's width is
    cut to the same columns, so left padding (valid tokens on the right) and right padding
    are both handled. Other fields are kept as they are; a batch without a 2-D
    ``attention_mask_key`` field, or with no valid token, is returned unchanged.

    Args:
        batch: per-sample fields (tensors/arrays with the sample dimension first, or lists).
        attention_mask_key: the field whose non-zero entries mark valid tokens.

    Returns:
        A new dict; tensors are sliced as views (no copy).

    Example:
        >>> b = {"attention_mask": torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])}
        >>> trim_padding(b)["attention_mask"].tolist()
        [[1, 1], [1, 0]]
    """
    out = dict(batch)
    mask = batch.get(attention_mask_key)
    if not isinstance(mask, (torch.Tensor, np.ndarray)) or mask.ndim != 2 or mask.shape[0] == 0:
        return out
    width = mask.shape[1]
    used = (mask != 0).any(0)
    columns = (used.nonzero()[0] if isinstance(used, np.ndarray) else used.nonzero().flatten()).tolist()
    if not columns or (columns[0] == 0 and columns[-1] == width - 1):
        return out
    start, end = columns[0], columns[-1] + 1
    for key, value in batch.items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim >= 2 and value.shape[1] == width:
            out[key] = value[:, start:end]
    return out


def iter_micro_batches(
    batch: Batch,
    plan: MicroBatchPlan,
    rank: int = 0,
    *,
    trim: bool = True,
    attention_mask_key: str = "attention_mask",
    loss_mask_key: str = "loss_mask",
    pad_values: Mapping[str, Any] | None = None,
) -> Iterator[MicroBatch]:
    """Yield the micro-batches of ``rank`` in plan order, padding micro-batches included.

    A real micro-batch holds the rows ``plan.ranks[rank][k]`` of every per-sample field
    (metadata is dropped), trimmed with :func:`trim_padding` to the columns its members use.
    A padding micro-batch is one pad row from :func:`batchfit.minibatch.pad_rows` (loss mask
    0, one valid token; NOTE [ Pad rows cost one token ]): run it like any other so every
    rank steps the same number of times; with :func:`batchfit.loss.loss_weights` its weights
    are 0, so it adds nothing to the loss or the gradient.

    Per-sequence outputs of the real micro-batches, concatenated in the order yielded,
    go back to input order with ``plan.restore_order(outputs, rank=rank)`` (or gather all
    ranks' and use ``rank=None``); ``MicroBatch.indices`` gives the rows of each.

    Args:
        batch: the whole mini-batch as per-sample fields, one row per planned sequence.
        plan: from :func:`batchfit.packing.plan_micro_batches` (planned on this batch's lengths).
        rank: this process' data-parallel rank in the plan.
        trim: trim padded columns (set False to keep full-width tensors).
        attention_mask_key: the field that marks valid tokens (for trimming and pad rows).
        loss_mask_key: the field set to 0 in pad rows.
        pad_values: fill values per field for pad rows (see :func:`batchfit.minibatch.pad_rows`).

    Yields:
        :class:`MicroBatch`, ``plan.num_micro_batches`` of them.

    Raises:
        BatchError: the batch's row count differs from the plan's sequence count, or its
            fields disagree on the row count.
        InvalidArgument: ``rank`` is not in ``[0, plan.dp_size)``.
    """
    if not is_int(rank) or not 0 <= rank < plan.dp_size:
        raise InvalidArgument(f"rank must be an integer in [0, {plan.dp_size}), but got rank={rank!r}")
    n = batch_size(batch)
    if n != plan.num_sequences:
        raise BatchError(
            f"batch has {n} rows but the plan was made for {plan.num_sequences} sequences; plan with "
            "the lengths of this batch (e.g. attention_mask.sum(-1))"
        )
    for k, (indices, cost) in enumerate(zip(plan.ranks[rank], plan.costs[rank])):
        if indices:
            rows = take_rows(batch, indices)
        else:
            rows = pad_rows(batch, 1, loss_mask_key=loss_mask_key, pad_values=pad_values)
        if trim:
            rows = trim_padding(rows, attention_mask_key=attention_mask_key)
        yield MicroBatch(batch=rows, indices=indices, position=k, cost=cost)


def sync_micro_batch_count(plan: MicroBatchPlan, group: Any = None) -> MicroBatchPlan:
    """Pad ``plan`` to the largest micro-batch count over the ranks of ``group``.

    For callers that plan per rank (each rank its own data): FSDP and DDP ranks must run
    the same number of forward/backward passes or they deadlock (SkyRL #1060). One MAX
    all-reduce of the count; the ranks short of it get padding micro-batches. A plan made
    with ``dp_size > 1`` over the whole mini-batch is already equal on every rank and needs
    no call. Every rank of ``group`` must call this (it is a collective).

    Args:
        plan: this rank's plan.
        group: a ``torch.distributed`` process group; ``None`` = the default group.

    Returns:
        ``plan`` itself without an initialised process group (or when nothing is missing),
        else ``plan.pad_to(max count)``.
    """
    return plan.pad_to(all_reduce_max(plan.num_micro_batches, group))
