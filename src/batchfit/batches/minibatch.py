"""Prompt-aligned mini-batches and data-parallel padding.

In step-wise training a prompt yields a variable number of sequences (one per turn of each
trajectory), so a mini-batch is cut at prompt boundaries, never by a fixed sample count:
the optimizer-step count then depends only on the number of prompts. A mini-batch's sample
count is rarely a multiple of ``dp_size``; :func:`pad_for_data_parallel` appends the fewest
cheap pad rows that make it one.

Batches are the per-sample mappings of :mod:`batchfit.batches.batch`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from batchfit.batches.batch import Batch, batch_size, is_per_sample, slice_batch
from batchfit.errors import BatchError, InvalidArgument
from batchfit.validation import (
    MAX_RANKS,
    check_bool,
    check_int,
    check_key,
    check_mapping,
    check_positive_int,
    describe,
)

__all__ = [
    "PAD",
    "mini_batch_boundaries",
    "pad_for_data_parallel",
    "pad_rows",
    "prompt_boundaries",
    "slice_batch",
    "split_for_data_parallel",
]


class _PadMarker:
    """The value list fields hold in pad rows (``batchfit.batches.minibatch.PAD``)."""

    _instance: _PadMarker | None = None

    def __new__(cls) -> _PadMarker:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "PAD"

    def __reduce__(self) -> str:  # pickles (e.g. to other ranks) as the same singleton
        return "PAD"


PAD = _PadMarker()
"""Marker placed in list fields of pad rows; test with ``value is PAD``."""


def _as_list(uids: Any) -> list[Any]:
    """Uids as a list of hashable values; a clear error for anything else."""
    if isinstance(uids, (torch.Tensor, np.ndarray)):
        if uids.ndim != 1:
            raise InvalidArgument(
                f"uids must be one-dimensional (one prompt id per sequence), but got shape {tuple(uids.shape)}"
            )
        return uids.tolist()
    if (
        uids is None
        or isinstance(uids, (str, bytes, Mapping, set, frozenset))
        or not hasattr(uids, "__iter__")
    ):
        raise InvalidArgument(
            f"uids must be a sequence of prompt ids (an ordered list, tuple, 1-D tensor or array), but got "
            f"uids={describe(uids)}"
        )
    out = list(uids)
    for i, uid in enumerate(out):
        if isinstance(uid, (torch.Tensor, np.ndarray, np.generic)):
            # Tensors hash by identity: two equal tensor elements would be two prompts.
            if uid.ndim != 0:
                raise InvalidArgument(
                    f"uids must hold one prompt id per sequence, but uids[{i}] is an array of shape "
                    f"{tuple(uid.shape)}; pass a 1-D tensor or a list of scalars"
                )
            uid = out[i] = uid.item()
        try:
            hash(uid)
        except TypeError:
            raise InvalidArgument(
                f"uids must be hashable prompt ids (str, int), but got uids[{i}]={describe(uid)}"
            ) from None
        if isinstance(uid, float) and uid != uid:
            raise InvalidArgument(f"uids must not be NaN, but got uids[{i}]=nan")
    return out


def prompt_boundaries(uids: Sequence[Any]) -> list[tuple[int, int]]:
    """One ``(start, end)`` per prompt, in order; the sequences of a prompt must be contiguous.

    Args:
        uids: the prompt id of each sequence (list, tuple, numpy array or 1-D tensor).

    Returns:
        ``[(start, end), ...]`` covering ``range(len(uids))`` without gaps; ``[]`` for no uids.

    Raises:
        BatchError: a uid reappears after another uid (names the uid, where its run ended and
            where it reappears).

    Example:
        >>> prompt_boundaries(["a", "a", "b", "c", "c", "c"])
        [(0, 2), (2, 3), (3, 6)]
    """
    values = _as_list(uids)
    bounds: list[tuple[int, int]] = []
    seen: dict[Any, int] = {}
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            uid = values[start]
            if uid in seen:
                raise BatchError(
                    f"sequences of a prompt must be contiguous, but uid={uid!r} reappears at index {start} "
                    f"after its run ended at index {seen[uid]}; sort or group the batch by uid first"
                )
            seen[uid] = i
            bounds.append((start, i))
            start = i
    return bounds


def mini_batch_boundaries(
    uids: Sequence[Any], prompts_per_mini_batch: int, *, allow_partial: bool = False
) -> list[tuple[int, int]]:
    """Cut sequences into mini-batches of exactly ``prompts_per_mini_batch`` prompts each.

    A prompt is never split. With a uniform number of sequences per prompt this equals
    slicing by ``prompts_per_mini_batch × n_samples_per_prompt`` sequences.

    Args:
        uids: the prompt id of each sequence, prompts contiguous.
        prompts_per_mini_batch: prompts per mini-batch (``policy_mini_batch_size``).
        allow_partial: accept a prompt count that is not a multiple; the last mini-batch is smaller.

    Returns:
        ``[(start, end), ...]`` sequence ranges, one per mini-batch.

    Raises:
        InvalidArgument: ``prompts_per_mini_batch`` is not a positive integer.
        BatchError: uids are not contiguous, or the prompt count is not a multiple of
            ``prompts_per_mini_batch`` and ``allow_partial`` is false.

    Example:
        >>> mini_batch_boundaries([0, 0, 1, 2, 2, 2, 3], 2)
        [(0, 3), (3, 7)]
    """
    check_positive_int("prompts_per_mini_batch", prompts_per_mini_batch)
    allow_partial = check_bool("allow_partial", allow_partial)
    prompts = prompt_boundaries(uids)
    if len(prompts) % prompts_per_mini_batch and not allow_partial:
        k = prompts_per_mini_batch
        raise BatchError(
            f"{len(prompts)} prompts do not split into mini-batches of prompts_per_mini_batch={k}: "
            f"use {len(prompts) // k * k or k} or {(len(prompts) // k + 1) * k} prompts, a divisor of "
            f"{len(prompts)} as prompts_per_mini_batch, or allow_partial=True"
        )
    return [
        (prompts[i][0], prompts[min(i + prompts_per_mini_batch, len(prompts)) - 1][1])
        for i in range(0, len(prompts), prompts_per_mini_batch)
    ]


# NOTE [ Pad rows cost one token ]
# A pad row must be harmless (it carries no loss) and cheap (it costs compute). Copying a
# real row (SkyRL's stage_chunks copied row 0) costs a full-length forward/backward per pad
# row. A batchfit pad row is all zeros except one valid token in the attention mask, so a
# padded micro-batch trimmed to its longest member stays short, and the loss mask is 0 so
# the row adds nothing to any loss or gradient. Padding micro-batches in batchfit.plan.packing
# are made of such rows.


MAX_PAD_ROWS = MAX_RANKS
"""Most pad rows :func:`pad_rows` makes at once (data-parallel padding needs fewer than ``dp_size``)."""


def _full(key: str, shape: tuple[int, ...], fill: Any, like: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """``shape`` filled with ``fill`` in ``like``'s dtype (and device); a clear error for a fill it cannot hold."""
    value = fill.item() if isinstance(fill, (torch.Tensor, np.ndarray, np.generic)) and fill.ndim == 0 else fill
    if isinstance(like, torch.Tensor):
        floating = like.dtype.is_floating_point or like.dtype.is_complex
    else:
        floating = like.dtype.kind in "fc"
    ok = isinstance(value, (bool, numbers.Number)) and (
        floating or isinstance(value, (bool, numbers.Integral)) or (isinstance(value, float) and value.is_integer())
    )
    if ok:
        try:
            if isinstance(like, torch.Tensor):
                return torch.full(shape, value, dtype=like.dtype, device=like.device)
            return np.full(shape, value, dtype=like.dtype)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            pass
    raise InvalidArgument(
        f"pad_values[{key!r}] must be a number that the field's dtype {like.dtype} holds, but got {describe(fill)}"
    )


def pad_rows(
    batch: Batch,
    n: int,
    *,
    loss_mask_key: str = "loss_mask",
    pad_values: Mapping[str, Any] | None = None,
    attention_mask_key: str = "attention_mask",
) -> dict[str, Any]:
    """``n`` pad rows shaped like the per-sample fields of ``batch`` (see NOTE [ Pad rows cost one token ]).

    Tensor fields get zeros, except ``attention_mask_key`` which gets a single valid token at
    the position where the batch's rows have theirs first (left or right padding both kept),
    and ``loss_mask_key`` which is 0. List fields get :data:`PAD`. ``pad_values`` overrides the
    fill value per key (a scalar for tensors, any object for lists).

    Raises:
        BatchError: the batch's fields disagree on the sample count.
        InvalidArgument: ``n`` is negative.
    """
    n = check_int("n", n, minimum=0, maximum=MAX_PAD_ROWS)
    loss_mask_key = check_key("loss_mask_key", loss_mask_key)
    attention_mask_key = check_key("attention_mask_key", attention_mask_key)
    overrides = check_mapping("pad_values", pad_values)
    size = batch_size(batch)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if not is_per_sample(value):
            continue
        # None = the default for the field's type (zeros, one attention token, PAD)
        fill = overrides.get(key, 0 if key == loss_mask_key else None)
        if isinstance(value, (torch.Tensor, np.ndarray)):
            shape = (n, *value.shape[1:])
            rows = _full(key, shape, fill if fill is not None else 0, value)
            if key == attention_mask_key and fill is None and value.ndim >= 2 and n and all(value.shape[1:]):
                rows[(slice(None), *([0] * (value.ndim - 1)))] = 1
                if size and value.ndim == 2 and (value[:, -1] != 0).all() and (value[:, 0] == 0).any():
                    # left-padded batch: keep the valid token on the right, where real rows keep theirs
                    rows[:, 0] = 0
                    rows[:, -1] = 1
            out[key] = rows
        else:
            marker = PAD if fill is None else fill
            out[key] = type(value)([marker] * n)
    return out


def pad_for_data_parallel(
    batch: Batch,
    dp_size: int,
    *,
    loss_mask_key: str = "loss_mask",
    pad_values: Mapping[str, Any] | None = None,
    attention_mask_key: str = "attention_mask",
) -> tuple[dict[str, Any], int]:
    """Append the fewest pad rows that make the sample count a multiple of ``dp_size``.

    Correct for any size, including a batch smaller than ``dp_size`` (1 sample, dp 8 → 7 pad
    rows). Pad rows are cheap and carry no loss (NOTE [ Pad rows cost one token ]); every
    field keeps the same sample count. Metadata (non per-sample values) is kept unchanged.

    Args:
        batch: per-sample fields (tensors with the sample dimension first, or lists).
        dp_size: data-parallel ranks.
        loss_mask_key: the field set to 0 in pad rows (absent is fine).
        pad_values: fill value per key, overriding the defaults of :func:`pad_rows`.
        attention_mask_key: the field that gets the pad rows' one valid token.

    Returns:
        ``(padded_batch, n_pad)`` with ``n_pad = (-size) mod dp_size``.

    Raises:
        InvalidArgument: ``dp_size`` is not a positive integer.
        BatchError: the batch's fields disagree on the sample count.
    """
    check_int("dp_size", dp_size, minimum=1, maximum=MAX_RANKS)
    size = batch_size(batch)
    n_pad = (-size) % dp_size
    out = dict(batch)
    if n_pad:
        rows = pad_rows(
            batch,
            n_pad,
            loss_mask_key=loss_mask_key,
            pad_values=pad_values,
            attention_mask_key=attention_mask_key,
        )
        for key, value in rows.items():
            original = batch[key]
            if isinstance(original, torch.Tensor):
                out[key] = torch.cat([original, value], dim=0)
            elif isinstance(original, np.ndarray):
                out[key] = np.concatenate([original, value], axis=0)
            else:
                out[key] = type(original)([*original, *value])
    return out, n_pad


def split_for_data_parallel(batch: Batch, dp_size: int) -> list[dict[str, Any]]:
    """Split ``batch`` into ``dp_size`` equal contiguous shards, one per rank.

    Pad first with :func:`pad_for_data_parallel` if the size is not a multiple.

    Raises:
        InvalidArgument: ``dp_size`` is not a positive integer.
        BatchError: the sample count is not a multiple of ``dp_size`` (names both and the fix).
    """
    check_int("dp_size", dp_size, minimum=1, maximum=MAX_RANKS)
    size = batch_size(batch)
    if size % dp_size:
        raise BatchError(
            f"batch of {size} samples does not split over dp_size={dp_size}; pad it first with "
            f"pad_for_data_parallel (adds {(-size) % dp_size} pad rows)"
        )
    share = size // dp_size
    return [slice_batch(batch, r * share, (r + 1) * share) for r in range(dp_size)]
