"""The longest row of a whole dataset, read from every row's length, and what was read to find it.

A batch-size search sizes its trials from one row repeated; that row must be the longest the run
will ever batch, or the size found is too large for the batches that come later.

# NOTE [ Every row's length, not a sample ]
Sizing from the longest of the first rows (or the first batch) is wrong whenever the long rows
come later: a dataset whose first 1,024 rows hold at most 128 tokens and the rest 512 was sized
at 10 rows against a 1 GiB target, and its real micro-batches peaked at 2.31 GB (issue 40). So
every row's length is read, by the cheapest exact route:

1. a ``datasets.Dataset`` without a custom transform whose ``input_name`` column is a list
   column: the lengths of that Arrow column, read in batches of :data:`ARROW_BATCH_ROWS` rows
   (``Dataset.iter`` under ``with_format("arrow")``, which follows ``select``/``shuffle``
   indices; ``pyarrow.compute.list_value_length`` counts without decoding a token);
2. else a ``datasets.Dataset`` with a ``length_column`` (the column the ``Trainer``'s
   ``group_by_length`` reads, ``TrainingArguments.length_column_name``, transformers 5.24
   ``Trainer._get_train_sampler``): that column, as the ``Trainer`` trusts it;
3. else a pass over every row, ``len(row[input_name])``, as transformers'
   ``LengthGroupedSampler`` computes lengths when it has no column (``trainer_pt_utils.py``).

A row without ``input_name`` (a tensor, a tuple of tensors) counts by its first tensor's first
dimension. :class:`LongestRow` says which route ran and over how many rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidArgument

__all__ = ["ARROW_BATCH_ROWS", "LongestRow", "longest_row", "row_length"]

#: Rows per Arrow batch when the lengths are read from a ``datasets.Dataset``'s column.
ARROW_BATCH_ROWS = 65_536


@dataclass(frozen=True)
class LongestRow:
    """The longest row of a dataset (NOTE [ Every row's length, not a sample ]).

    Attributes:
        index: its position in the dataset (the first of the longest, when several tie).
        length: its length in tokens (``0``: the rows have no length this module reads).
        rows: how many rows' lengths were read (all of them).
        shortest: the shortest length read.
        source: how the lengths were read, in words.

    Properties:
        varies: ``True`` when the rows do not all have the same length.
    """

    index: int
    length: int
    rows: int
    shortest: int
    source: str

    @property
    def varies(self) -> bool:
        return self.shortest != self.length

    def describe(self) -> str:
        """One line for a log or a report, e.g. ``row 1,536 of 2,048 is the longest: 512 tokens (shortest 128; ...)``."""
        if self.length == 0:
            return (
                f"none of the {self.rows:,} rows has a length ({self.source}): row 0 stands for all; pass "
                "make_batch(batch_size) to size your longest batch"
            )
        return (
            f"row {self.index:,} of {self.rows:,} is the longest: {self.length:,} tokens "
            f"(shortest {self.shortest:,}; {self.source})"
        )


def row_length(row: Any, input_name: str = "input_ids") -> int:
    """A row's length: ``len(row[input_name])`` for a mapping, else its first tensor's (or sequence's) first dimension; 0 if none."""
    if isinstance(row, Mapping):
        return _length(row.get(input_name))
    if isinstance(row, (tuple, list)) and row and not isinstance(row[0], (int, float)):
        return row_length(row[0], input_name)
    return _length(row)


def _length(value: Any) -> int:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 0
    if isinstance(value, (str, bytes)) or value is None:
        return 0
    try:
        return len(value)
    except TypeError:
        return 0


def longest_row(rows: Any, *, input_name: str = "input_ids", length_column: str | None = "length", name: str = "rows") -> LongestRow:
    """The longest of every row of ``rows`` (NOTE [ Every row's length, not a sample ]).

    Args:
        rows: a ``datasets.Dataset``, a ``torch.utils.data.Dataset`` with ``len``, or a sequence of rows.
        input_name: the key holding a row's tokens (the ``Trainer``'s ``model_input_name``).
        length_column: a ``datasets.Dataset`` column holding each row's length, read when
            ``input_name`` is not an Arrow list column (``None``: never).
        name: the argument's name, for errors.

    Returns:
        :class:`LongestRow`.

    Raises:
        InvalidArgument: ``rows`` has no ``len()`` or is empty.

    Example:
        >>> longest_row([{"input_ids": [1, 2]}] * 3 + [{"input_ids": [1, 2, 3, 4]}]).describe()
        'row 3 of 4 is the longest: 4 tokens (shortest 2; a pass over the input_ids of every row)'
    """
    try:
        count = len(rows)
    except TypeError:
        raise InvalidArgument(
            f"{name} must be an indexable dataset (len() and [i]), but got {type(rows).__name__}; pass a datasets.Dataset or a list of rows, or make_batch(batch_size)"
        ) from None
    if count == 0:
        raise InvalidArgument(f"{name} is empty (len={count}); pass the rows the Trainer will use, or make_batch(batch_size)")
    columns = _arrow_columns(rows)
    if columns is not None and input_name in columns:
        found = _from_arrow(rows, input_name, f"the lengths of the {input_name} list column of every row (Arrow)")
        if found is not None:
            return found
    if columns is not None and length_column is not None and length_column in columns:
        found = _from_arrow(rows, length_column, f"the {length_column!r} column (the Trainer's length_column_name)")
        if found is not None:
            return found
    what = input_name if isinstance(rows[0], Mapping) else "first dimension"
    return _from_lengths((row_length(rows[i], input_name) for i in range(count)), f"a pass over the {what} of every row")


def _arrow_columns(rows: Any) -> list[str] | None:
    """The columns of a ``datasets.Dataset`` read straight from Arrow (``None``: not one, or a custom transform)."""
    if not hasattr(rows, "with_format") or not hasattr(rows, "column_names") or not hasattr(rows, "iter"):
        return None
    if (getattr(rows, "format", None) or {}).get("type") == "custom":  # with_transform: rows are made on access
        return None
    return list(rows.column_names)


def _from_arrow(rows: Any, column: str, source: str) -> LongestRow | None:
    """Every row's length from an Arrow list column (its lengths) or integer column (the values); ``None``: neither."""
    import pyarrow as pa
    import pyarrow.compute as pc

    start, best, best_at, shortest = 0, -1, 0, None
    for batch in rows.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS):
        values = batch[column]
        kind = values.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            values = pc.list_value_length(values)
        elif not pa.types.is_integer(kind):
            return None
        lengths = values.to_pylist()
        for offset, length in enumerate(lengths):
            length = int(length or 0)  # a null list counts 0
            if length > best:
                best, best_at = length, start + offset
            shortest = length if shortest is None else min(shortest, length)
        start += len(lengths)
    return LongestRow(index=best_at, length=max(best, 0), rows=start, shortest=shortest or 0, source=source)


def _from_lengths(lengths: Any, source: str) -> LongestRow:
    best, best_at, shortest, count = -1, 0, None, 0
    for i, length in enumerate(lengths):
        if length > best:
            best, best_at = length, i
        shortest = length if shortest is None else min(shortest, length)
        count += 1
    return LongestRow(index=best_at, length=max(best, 0), rows=count, shortest=shortest or 0, source=source)

