"""Per-sample batches: a mapping of field name to tensor (sample dimension first) or list.

This is the container every batchfit function that touches data works with (the
``TensorDict``/``DataProto`` of other frameworks, reduced to a plain ``dict``). Every
field holds one entry per sample; values that are neither tensors nor lists/tuples
(scalars, strings, ``None``) are *metadata* of the whole batch and are dropped from any
slice, so nothing describing other samples leaks into a sub-batch.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from batchfit.errors import BatchError, InvalidArgument
from batchfit.plan.packing import MicroBatchPlan
from batchfit.validation import (
    check_bool,
    check_int,
    check_int_sequence,
    check_key,
    check_keys,
    check_mapping,
    describe,
    short_repr,
)

Batch = Mapping[str, Any]


def is_per_sample(value: Any) -> bool:
    """True if ``value`` holds one entry per sample: a tensor/array with a dimension, a list or a tuple."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim >= 1
    return isinstance(value, (list, tuple))


def batch_size(batch: Batch) -> int:
    """Number of samples in ``batch``.

    Raises:
        BatchError: the batch has no per-sample field, or its fields disagree on the
            sample count (each field and its count are named).
    """
    if not isinstance(batch, Mapping):
        raise BatchError(
            f"batch must be a mapping of per-sample fields (e.g. {{'input_ids': tensor, 'attention_mask': tensor}}), but got a {type(batch).__name__}"
        )
    sizes = {key: len(value) for key, value in batch.items() if is_per_sample(value)}
    if not sizes:
        raise BatchError(
            f"batch has no per-sample field (tensors or lists), but got keys {short_repr(sorted(map(str, batch)))}; "
            "add at least one field with one entry per sample"
        )
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}={n}" for k, n in sizes.items())
        raise BatchError(f"batch fields must have the same number of samples, but got {listed}")
    return next(iter(sizes.values()))


def slice_batch(batch: Batch, start: int, end: int) -> dict[str, Any]:
    """Samples ``start:end`` of every per-sample field; metadata is dropped.

    Tensors are sliced as views (no copy); lists and tuples keep their type.

    Raises:
        BatchError: fields disagree on the sample count, or ``0 <= start <= end <= size``
            does not hold.
    """
    n = batch_size(batch)
    start, end = check_int("start", start), check_int("end", end)
    if not (0 <= start <= end <= n):
        raise BatchError(f"slice must satisfy 0 <= start <= end <= {n}, but got start={start}, end={end}")
    return {k: v[start:end] for k, v in batch.items() if is_per_sample(v)}


def take_rows(batch: Batch, indices: Sequence[int] | torch.Tensor | np.ndarray) -> dict[str, Any]:
    """The samples at ``indices`` (in that order) of every per-sample field; metadata is dropped.

    Raises:
        BatchError: fields disagree on the sample count, or an index is out of range.
    """
    n = batch_size(batch)
    idx = check_int_sequence("indices", indices)
    bad = [i for i in idx if not 0 <= i < n]
    if bad:
        raise BatchError(f"indices must be in [0, {n}), but got {bad[:5]!r}")
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if not is_per_sample(value):
            continue
        if isinstance(value, torch.Tensor):
            out[key] = value[torch.as_tensor(idx, dtype=torch.long, device=value.device)]
        elif isinstance(value, np.ndarray):
            out[key] = value[np.asarray(idx, dtype=np.int64)]
        else:
            out[key] = type(value)(value[i] for i in idx)
    return out


def concat_batches(batches: Sequence[Batch]) -> dict[str, Any]:
    """Concatenate per-sample fields of ``batches`` along the sample dimension.

    Raises:
        BatchError: the batches do not have the same per-sample keys.
    """
    if not isinstance(batches, (list, tuple)):
        raise BatchError(f"batches must be a list of batches (mappings of per-sample fields), but got {describe(batches)}")
    if not batches:
        return {}
    for i, b in enumerate(batches):
        if not isinstance(b, Mapping):
            raise BatchError(f"batches[{i}] must be a mapping of per-sample fields, but got {describe(b)}")
    keys = [k for k, v in batches[0].items() if is_per_sample(v)]
    for b in batches[1:]:
        other = [k for k, v in b.items() if is_per_sample(v)]
        if set(other) != set(keys):
            raise BatchError(
                f"batches to concatenate must have the same fields, but got {short_repr(keys)} and {short_repr(other)}"
            )
    out: dict[str, Any] = {}
    for key in keys:
        parts = [b[key] for b in batches]
        kinds = {torch.Tensor if isinstance(p, torch.Tensor) else np.ndarray if isinstance(p, np.ndarray) else list for p in parts}
        try:
            if kinds == {torch.Tensor}:
                out[key] = torch.cat(parts, dim=0)
            elif kinds == {np.ndarray}:
                out[key] = np.concatenate(parts, axis=0)
            elif kinds == {list}:
                out[key] = type(parts[0])(x for p in parts for x in p)
            else:
                raise TypeError("tensors, arrays and lists mixed")
        except (TypeError, ValueError, RuntimeError) as exc:
            raise BatchError(
                f"field {key!r} does not concatenate over the batches ({' '.join(str(exc).split())[:120]}); "
                "give it the same kind (tensor, array or list), dtype and trailing shape in every batch"
            ) from exc
    return out


def check_micro_batch_arguments(
    batch: Any,
    plan: Any,
    rank: Any,
    *,
    trim: Any,
    attention_mask_key: Any,
    loss_mask_key: Any,
    pad_values: Any,
    token_fields: Any,
    response_fields: Any,
) -> None:
    """The argument checks of :func:`batchfit.batches.microbatch.iter_micro_batches`, one place.

    Raises:
        InvalidArgument: ``plan`` is not a :class:`~batchfit.plan.packing.MicroBatchPlan`, ``rank``
            is not in ``[0, plan.dp_size)``, ``trim`` is not a bool, a key is not a ``str``,
            ``pad_values`` not a mapping, or a field list not a list of ``str``.
        BatchError: ``batch`` is not a mapping whose per-sample fields agree.
    """
    if not isinstance(plan, MicroBatchPlan):
        raise InvalidArgument(
            f"plan must be a MicroBatchPlan (from batchfit.plan_micro_batches), but got plan={describe(plan)}"
        )
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < plan.dp_size:
        raise InvalidArgument(f"rank must be an integer in [0, {plan.dp_size}), but got rank={describe(rank)}")
    check_bool("trim", trim)
    check_key("attention_mask_key", attention_mask_key)
    check_key("loss_mask_key", loss_mask_key)
    check_mapping("pad_values", pad_values)
    check_keys("token_fields", token_fields)
    check_keys("response_fields", response_fields)
    batch_size(batch)
