"""The split of a packed micro-batch over a sequence-parallel group, and the gather of its per-token outputs.

NOTE [ A packed row split over a group ]
Every rank of a sequence-parallel group holds the same packed micro-batch (one row of ``T``
tokens, several sequences, ``position_ids`` restarting at 0, ``cu_seq_lens``). The row is
padded to ``T' = ⌈T / sp⌉ · sp`` columns and rank ``r`` keeps columns ``r·T'/sp …
(r+1)·T'/sp − 1`` of every per-token field, so ``input_ids``, ``position_ids``, labels, the
loss mask and every other per-token field are cut at the same columns. The padding is a
sequence of its own: ``input_ids`` 0, ``position_ids`` ``0 … pad − 1``, labels
:data:`IGNORE_INDEX`, every other per-token field 0 (no loss weight), as verl's
``ulysses_pad`` pads. ``cu_seq_lens`` and ``max_length`` stay the whole row's (with the
padding's sequence added): attention, after its all-to-all, runs on every token of the row and
reads the sequences' boundaries there (NOTE [ Ulysses sequence parallelism ] in
:mod:`batchfit.parallel.sequence`). Labels must be made on the whole row *before* the split
(the label of a rank's last column is the first token of the next rank's columns), as verl rolls
``input_ids`` before slicing. :func:`gather_packed` puts per-token outputs back: every rank's
columns in rank order, the padding dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.errors import BatchError, InvalidArgument
from batchfit.parallel.sequence import gather_sequence, group_rank, group_size
from batchfit.validation import check_positive_int

#: The label of a column with no next token; equals :data:`batchfit.logprobs.IGNORE_INDEX` (a test holds it).
IGNORE_INDEX = -100

#: Fields that stay the whole row's (attention reads them after the all-to-all).
ROW_FIELDS = ("cu_seq_lens", "max_length")

__all__ = ["IGNORE_INDEX", "SequenceShard", "gather_packed", "sequence_shard", "split_packed"]


@dataclass(frozen=True)
class SequenceShard:
    """One rank's columns of a packed row split over ``size`` ranks (NOTE [ A packed row split over a group ]).

    Attributes:
        length: tokens of the row before padding (``T``).
        size: ranks in the group (``sp``).
        rank: this rank's place in the group.
    """

    length: int
    size: int
    rank: int

    @property
    def padded(self) -> int:
        """The row's columns after padding: ``T`` rounded up to a multiple of ``size``."""
        return -(-self.length // self.size) * self.size

    @property
    def pad(self) -> int:
        """Columns of padding at the end of the row."""
        return self.padded - self.length

    @property
    def local(self) -> int:
        """Columns each rank holds."""
        return self.padded // self.size

    @property
    def columns(self) -> slice:
        """This rank's columns of the padded row."""
        return slice(self.rank * self.local, (self.rank + 1) * self.local)


def sequence_shard(length: int, size: int, rank: int) -> SequenceShard:
    """The :class:`SequenceShard` of rank ``rank`` of ``size`` for a row of ``length`` tokens.

    Raises:
        InvalidArgument: ``size`` not a positive int, ``rank`` outside ``0 … size − 1``, or a
            negative ``length``.
    """
    check_positive_int("sequence_parallel", size)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise InvalidArgument(f"length must be a non-negative int (tokens of the packed row), but got length={length!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise InvalidArgument(f"rank must be in 0 … {size - 1} (the group's ranks), but got rank={rank!r}")
    return SequenceShard(length, size, rank)


def _row_length(fields: Mapping[str, Any], input_ids_key: str) -> int:
    ids = fields.get(input_ids_key)
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise BatchError(
            f"sequence parallelism splits one packed row: {input_ids_key} must be [1, T], but got {shape}; "
            "make the micro-batch with iter_micro_batches(layout='packed')"
        )
    if fields.get("attention_mask") is not None:
        raise BatchError(
            "sequence parallelism splits one packed row without an attention mask, but the micro-batch has "
            "attention_mask; make it with iter_micro_batches(layout='packed')"
        )
    return int(ids.shape[1])


def split_packed(
    fields: Mapping[str, Any],
    shard: SequenceShard | Any,
    *,
    input_ids_key: str = "input_ids",
    position_ids_key: str = "position_ids",
    pad_values: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's share of a packed micro-batch (NOTE [ A packed row split over a group ]).

    Args:
        fields: one packed row: ``input_ids`` ``[1, T]``, ``position_ids`` ``[1, T]``, optional
            ``cu_seq_lens`` (int, ``[n + 1]``) and ``max_length``, any other per-token tensors
            ``[1, T, ...]`` (labels, loss mask, advantages, old log-probs …); other entries are
            kept as they are.
        shard: a :class:`SequenceShard` for this row (``sequence_shard(T, sp, rank)``), or a
            process group (``None``: no split), whose size and this rank's place are used.
        input_ids_key, position_ids_key: the field names.
        pad_values: the padding's value per field (default: ``labels`` :data:`IGNORE_INDEX`,
            every other per-token field 0; ``position_ids`` always count ``0 … pad − 1``).

    Returns:
        The fields with every per-token tensor cut to this rank's ``T'/sp`` columns, and
        ``cu_seq_lens`` / ``max_length`` of the whole padded row.

    Raises:
        BatchError: not one packed row (``input_ids`` not ``[1, T]``, an attention mask), or a
            ``shard`` made for another length.
    """
    length = _row_length(fields, input_ids_key)
    if not isinstance(shard, SequenceShard):
        shard = sequence_shard(length, group_size(shard), group_rank(shard))
    if shard.length != length:
        raise BatchError(
            f"the shard was made for a row of {shard.length} tokens, but {input_ids_key} has {length}; "
            f"make it with sequence_shard({length}, {shard.size}, {shard.rank})"
        )
    fills = {"labels": IGNORE_INDEX, **dict(pad_values or {})}
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (1, length):
            if shard.pad:
                if key == position_ids_key:
                    tail = torch.arange(shard.pad, dtype=value.dtype, device=value.device)
                    tail = tail.reshape(1, shard.pad, *([1] * (value.ndim - 2))).expand(1, shard.pad, *value.shape[2:])
                else:
                    tail = value.new_full((1, shard.pad, *value.shape[2:]), fills.get(key, 0))
                value = torch.cat([value, tail], dim=1)
            out[key] = value[:, shard.columns]
        else:
            out[key] = value
    cu = fields.get("cu_seq_lens")
    if shard.pad and isinstance(cu, torch.Tensor):
        out["cu_seq_lens"] = torch.cat([cu, cu.new_full((1,), shard.padded)])
        if isinstance(fields.get("max_length"), int):
            out["max_length"] = max(fields["max_length"], shard.pad)
    return out


def gather_packed(values: torch.Tensor, shard: SequenceShard, group: Any, *, dim: int = 1) -> torch.Tensor:
    """Per-token outputs of every rank's columns, back at the whole row's columns (the padding dropped).

    ``values`` holds this rank's ``shard.local`` columns along ``dim`` (``[1, T'/sp, ...]``);
    the result holds ``shard.length`` (``[1, T, ...]``). Autograd-aware: the backward keeps
    this rank's columns of the gradient (NOTE [ Ulysses sequence parallelism ] in
    :mod:`batchfit.parallel.sequence`).

    Raises:
        BatchError: ``values`` does not hold ``shard.local`` columns along ``dim``, or the group's
            size is not ``shard.size``.
    """
    if values.shape[dim] != shard.local or group_size(group) != shard.size:
        raise BatchError(
            f"gather_packed needs this rank's {shard.local} columns along dim {dim} from a group of {shard.size}, "
            f"but got shape {tuple(values.shape)} from a group of {group_size(group)}"
        )
    whole = gather_sequence(values, group, dim=dim)
    return whole.narrow(dim, 0, shard.length)
