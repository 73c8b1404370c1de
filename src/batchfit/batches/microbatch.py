"""Running a :class:`~batchfit.plan.packing.MicroBatchPlan`: sub-batches per rank, equal counts over ranks.

The tensor side of :mod:`batchfit.plan.packing`: :func:`iter_micro_batches` cuts a per-sample
batch (the mapping of :mod:`batchfit.batches.batch`) along a plan and trims each micro-batch to the
columns its members use. When each rank plans its own data,
:func:`batchfit.parallel.sync_micro_batch_count` makes every rank step the same number of times.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchfit.batches.batch import Batch, batch_size, check_micro_batch_arguments, take_rows
from batchfit.batches.layout import (
    PackedRows,
    RowAlignment,
    align_rows,
    field_roles,
    pack_rows,
    packed_model_inputs,
    padded_model_inputs,
    unpack,
    write_back,
    write_back_packed,
)
from batchfit.batches.minibatch import pad_rows
from batchfit.errors import BatchError, BudgetError, InvalidArgument
from batchfit.plan.packing import MicroBatchPlan
from batchfit.validation import check_choice, is_int

#: What :func:`iter_micro_batches` yields: padded rows, or one padding-free packed row.
LAYOUTS = ("padded", "packed")

__all__ = ["MicroBatch", "iter_micro_batches", "trim_padding"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one rank, as yielded by :func:`iter_micro_batches`.

    Attributes:
        batch: the per-sample fields of its sequences (trimmed), or one pad row.
        indices: input indices of its sequences, in row order; ``()`` for a padding micro-batch.
        position: ``k``, its place among the rank's micro-batches.
        cost: its cost in the plan, in tokens.
        alignment: how its rows were moved and trimmed (:class:`batchfit.batches.layout.RowAlignment`),
            ``None`` when not trimmed or packed.
        packed: for ``layout="packed"``, where each token of the packed row came from
            (:class:`batchfit.batches.layout.PackedRows`), else ``None``.
    """

    batch: dict[str, Any]
    indices: tuple[int, ...]
    position: int
    cost: int
    alignment: RowAlignment | None = None
    packed: PackedRows | None = None

    def unpack(self, values: Any, *, fill: Any = 0) -> Any:
        """Per-token outputs of the packed row as right-padded per-sequence rows (:func:`batchfit.batches.layout.unpack`).

        Raises:
            BatchError: not a packed micro-batch, or ``values`` of another length.
        """
        if self.packed is None:
            raise BatchError("unpack needs a packed micro-batch (iter_micro_batches(layout='packed'))")
        return unpack(values, self.packed, fill=fill)

    def model_inputs(
        self,
        *,
        input_ids_key: str = "input_ids",
        attention_mask_key: str = "attention_mask",
        position_ids_key: str = "position_ids",
    ) -> dict[str, Any]:
        """The keyword arguments to run this micro-batch through a transformers model: ``model(**mb.model_inputs())``.

        A packed row: ``input_ids``, ``position_ids`` restarting at 0 per sequence, the
        varlen kwargs transformers reads (``cu_seq_lens_q/k``, ``max_length_q/k``) and
        ``use_cache=False``, without which ``eager`` and ``sdpa`` attend across the row's
        sequences (:func:`batchfit.batches.layout.packed_model_inputs`). Padded rows:
        ``input_ids``, ``attention_mask``, ``position_ids`` (the batch's, else counted from
        the mask) and ``use_cache=False`` (:func:`batchfit.batches.layout.padded_model_inputs`).
        ``batchfit.models.attention.check_packed_attention(model, inputs)`` tells whether a
        model runs a packed row's sequences apart.

        Raises:
            BatchError: a needed field is missing.
        """
        if self.packed is not None:
            return packed_model_inputs(self.batch, input_ids_key=input_ids_key, position_ids_key=position_ids_key)
        return padded_model_inputs(
            self.batch,
            input_ids_key=input_ids_key,
            attention_mask_key=attention_mask_key,
            position_ids_key=position_ids_key,
        )

    @property
    def is_padding(self) -> bool:
        """True for a padding micro-batch: one pad row, no loss (NOTE [ Pad rows cost one token ])."""
        return not self.indices

    def write_back(self, out: Any, values: Any, *, response: bool = False) -> None:
        """Put this micro-batch's per-token outputs into the mini-batch's full-width tensor ``out``.

        ``values`` has the micro-batch's rows and its sequence columns (or, with
        ``response=True``, its response columns); each row lands at ``out[index]``, in the
        columns it came from, whatever the padding side (:func:`batchfit.batches.layout.write_back`).
        A padding micro-batch writes nothing.

        Raises:
            BatchError: a micro-batch yielded with ``trim=False`` (write ``out[indices] =
                values`` yourself), or ``values`` of another shape.
        """
        if self.is_padding:
            return
        if self.packed is not None:
            if response:
                raise BatchError(
                    "a packed micro-batch has no response columns: its response fields are per token; write them back with response=False"
                )
            write_back_packed(out, values, self.packed, self.indices)
            return
        if self.alignment is None:
            raise BatchError(
                "write_back needs a trimmed micro-batch (iter_micro_batches(trim=True)); with trim=False write out[list(mb.indices)] = values"
            )
        write_back(out, values, self.alignment, self.indices, response=response)


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


def _check_planned_lengths(batch: Batch, plan: MicroBatchPlan, attention_mask_key: str) -> None:
    """The plan's lengths must be this batch's valid-token counts, row for row.

    A plan made for other lengths would be under-filled (longer) or break the cap (shorter);
    lengths longer than the tensors are wide cannot belong to this batch at all.
    """
    mask = batch.get(attention_mask_key) if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or not plan.num_sequences:
        return
    valid = mask.detach().ne(0).sum(-1).cpu().numpy()
    differ = np.flatnonzero(valid != plan.lengths)
    if differ.size:
        i = int(differ[0])
        wide = f" (the tensors are {mask.shape[1]} wide)" if plan.lengths[i] > mask.shape[1] else ""
        raise BatchError(
            f"the plan was made for lengths[{i}]={int(plan.lengths[i])} but row {i} of the batch has "
            f"{int(valid[i])} valid tokens in {attention_mask_key!r}{wide} ({differ.size} rows differ); "
            f"plan with this batch's lengths ({attention_mask_key}.sum(-1))"
        )


def iter_micro_batches(
    batch: Batch,
    plan: MicroBatchPlan,
    rank: int = 0,
    *,
    trim: bool = True,
    attention_mask_key: str = "attention_mask",
    loss_mask_key: str = "loss_mask",
    pad_values: Mapping[str, Any] | None = None,
    token_fields: Sequence[str] | None = None,
    response_fields: Sequence[str] | None = None,
    layout: str = "padded",
) -> Iterator[MicroBatch]:
    """Yield the micro-batches of ``rank`` in plan order, padding micro-batches included.

    A real micro-batch holds the rows ``plan.ranks[rank][k]`` of every per-sample field
    (metadata is dropped), aligned and trimmed by :func:`batchfit.batches.layout.align_rows`:
    sequence-width fields to the longest member's length, response-width fields (the
    SkyRL/verl prompt | response layout) to the columns that belong to the kept sequence
    columns, still right-aligned with it (NOTE [ Sequence and response columns ]). For a
    ``cost="padded"`` plan every yielded tensor is then ``rows × width ≤`` its planned cost
    ``≤`` the budget, whatever the padding layout; this is checked.
    A padding micro-batch is one pad row from :func:`batchfit.batches.minibatch.pad_rows` (loss mask
    0, one valid token; NOTE [ Pad rows cost one token ]), laid out like a real one (the
    same fields, response fields one column wide): run it like any other so every rank
    steps the same number of times; with :func:`batchfit.batches.weights.loss_weights` its weights
    are 0, so it adds nothing to the loss or the gradient. ``MicroBatch.write_back`` puts
    per-token outputs (old log-probs, values) back into full-width tensors.

    Per-sequence outputs of the real micro-batches, concatenated in the order yielded,
    go back to input order with ``plan.restore_order(outputs, rank=rank)`` (or gather all
    ranks' and use ``rank=None``); ``MicroBatch.indices`` gives the rows of each.

    Args:
        batch: the whole mini-batch as per-sample fields, one row per planned sequence.
        plan: from :func:`batchfit.plan.packing.plan_micro_batches` (planned on this batch's lengths).
        rank: this process' data-parallel rank in the plan.
        trim: align and trim (set False to keep full-width tensors, unchecked).
        attention_mask_key: the field that marks valid tokens (for trimming and pad rows).
        loss_mask_key: the field set to 0 in pad rows.
        pad_values: fill values per field for pad rows and for columns vacated when rows
            move (see :func:`batchfit.batches.minibatch.pad_rows`); default 0.
        token_fields, response_fields: name the sequence-width and response-width fields
            where guessing by width and name is ambiguous (:func:`batchfit.batches.layout.field_roles`).
        layout: ``"padded"`` (rows, as above) or ``"packed"``: one padding-free row per
            micro-batch, the valid tokens of its sequences concatenated in ``indices`` order
            (token and response fields ``[1, T]`` with ``T ≤`` the planned cost,
            ``position_ids`` made restarting at 0 per sequence (the batch's own are
            checked, not copied: NOTE [ Packed position ids ]), ``cu_seq_lens`` and
            ``max_length``; no attention mask). Run it with ``model(**mb.model_inputs())``
            (``use_cache=False`` and the varlen kwargs: each sequence attends only to
            itself). ``MicroBatch.unpack`` and ``write_back`` map per-token outputs back.

    Yields:
        :class:`MicroBatch`, ``plan.num_micro_batches`` of them.

    Raises:
        BatchError: the batch's row count differs from the plan's sequence count, its
            fields disagree on the row count, or a named field is missing or misshapen;
            with ``layout="packed"``, ``position_ids`` that do not count up by one over a
            row's valid tokens.
        BudgetError: a padded micro-batch would be larger than planned (the plan's lengths
            are not the rows' valid-token spans, e.g. a mask with holes).
        InvalidArgument: ``rank`` is not in ``[0, plan.dp_size)``.
    """
    check_micro_batch_arguments(
        batch,
        plan,
        rank,
        trim=trim,
        attention_mask_key=attention_mask_key,
        loss_mask_key=loss_mask_key,
        pad_values=pad_values,
        token_fields=token_fields,
        response_fields=response_fields,
    )
    if not is_int(rank) or not 0 <= rank < plan.dp_size:
        raise InvalidArgument(f"rank must be an integer in [0, {plan.dp_size}), but got rank={rank!r}")
    n = batch_size(batch)
    if n != plan.num_sequences:
        raise BatchError(
            f"batch has {n} rows but the plan was made for {plan.num_sequences} sequences; plan with "
            "the lengths of this batch (e.g. attention_mask.sum(-1))"
        )
    layout = check_choice("layout", layout, LAYOUTS)
    _check_planned_lengths(batch, plan, attention_mask_key)
    roles = None
    if trim or layout == "packed":
        roles = field_roles(
            batch,
            attention_mask_key=attention_mask_key,
            token_fields=token_fields,
            response_fields=response_fields,
        )
    for k, (indices, cost) in enumerate(zip(plan.ranks[rank], plan.costs[rank])):
        if indices:
            rows = take_rows(batch, indices)
        else:
            rows = pad_rows(
                batch,
                1,
                loss_mask_key=loss_mask_key,
                pad_values=pad_values,
                attention_mask_key=attention_mask_key,
            )
        alignment = packed = None
        if layout == "packed":
            if roles is None:
                raise BatchError(
                    f"layout='packed' needs a 2-D {attention_mask_key!r} field marking valid tokens, but the batch has none; pass attention_mask_key"
                )
            rows, packed = pack_rows(
                rows, roles, attention_mask_key=attention_mask_key, pad_values=pad_values, indices=indices
            )
            total = int(packed.offsets[-1])
            if total > cost:
                raise BudgetError(
                    f"micro-batch {k} of rank {rank} would pack {total} tokens, above its planned cost {cost}; plan with the rows' valid-token counts ({attention_mask_key}.sum(-1))"
                )
        elif roles is not None:
            rows, alignment = align_rows(
                rows, roles, attention_mask_key=attention_mask_key, pad_values=pad_values
            )
            tokens = len(indices or (0,)) * alignment.width
            if plan.cost == "padded" and tokens > cost:
                raise BudgetError(
                    f"micro-batch {k} of rank {rank} would run {len(indices or (0,))} rows × {alignment.width} columns = {tokens} tokens, above its planned cost {cost}; plan with the rows' valid-token counts ({attention_mask_key}.sum(-1)) and keep each row's valid tokens contiguous"
                )
        elif trim:
            rows = trim_padding(rows, attention_mask_key=attention_mask_key)
        yield MicroBatch(
            batch=rows, indices=indices, position=k, cost=cost, alignment=alignment, packed=packed
        )
