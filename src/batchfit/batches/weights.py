"""Exact loss weights: any split of a mini-batch into micro-batches and ranks gives its gradient.

A loss reduction such as a token mean divides by a count over the **whole mini-batch**. A
micro-batch that divides by its own count (or averages micro-batch means) weights tokens
differently from the whole mini-batch whenever micro-batches differ in size, which biases
the gradient (SkyRL #1060). :func:`loss_weights` returns one weight per token, computed once
over the mini-batch, such that for every mini-batch

    (per_token_loss * weights)[mini-batch rows].sum() == reduction(per_token_loss over the mini-batch)

Summing ``(per_token_loss * weights)[micro].sum()`` over the micro-batches of any split
therefore gives the same value and the same gradient.

With DDP or FSDP, which **average** gradients over the ``dp_size`` ranks, multiply each
rank's summed weighted loss by ``dp_size`` (or use a SUM all-reduce) so that the average
over ranks equals the sum over the mini-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchfit.errors import BatchError, InvalidArgument
from batchfit.validation import check_choice, check_count, check_ranges, describe

REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")


def _segment_ids(bounds: Sequence[tuple[int, int]], n: int, name: str) -> torch.Tensor:
    """Row → segment index for contiguous ``bounds`` that must tile ``range(n)`` exactly."""
    ids = torch.empty(n, dtype=torch.long)
    expected = 0
    for k, (start, end) in enumerate(check_ranges(name, bounds)):
        if start != expected or end <= start or end > n:
            raise BatchError(
                f"{name} must tile the {n} rows contiguously with non-empty ranges, but range {k} is "
                f"({start}, {end}) where start {expected} was expected"
            )
        ids[start:end] = k
        expected = end
    if expected != n:
        raise BatchError(f"{name} must cover all {n} rows, but they end at row {expected}")
    return ids


def _per_segment(values: torch.Tensor, seg: torch.Tensor, count: int) -> torch.Tensor:
    return torch.zeros(count, dtype=values.dtype).index_add_(0, seg, values)


def _safe_inverse(x: torch.Tensor) -> torch.Tensor:
    """1/x where x > 0, and 0 where x == 0 (a group with nothing to average contributes nothing)."""
    return torch.where(x > 0, 1.0 / torch.where(x > 0, x, torch.ones_like(x)), torch.zeros_like(x))


def loss_weights(
    loss_mask: torch.Tensor,
    *,
    reduction: str,
    mini_batch_boundaries: Sequence[tuple[int, int]] | None = None,
    prompt_boundaries: Sequence[tuple[int, int]] | None = None,
    max_seq_len: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token weights that make micro-batched losses equal the mini-batch reduction.

    Reductions, for each mini-batch (``l`` the per-token loss, ``m`` the mask):

    - ``token_mean``: ``Σ l·m / Σ m`` over all tokens of the mini-batch.
    - ``sequence_mean``: the mean over sequences of each sequence's token mean.
    - ``seq_mean_token_sum_norm``: the mean over sequences of ``Σ_t l·m / max_seq_len``
      (Dr. GRPO's constant normaliser).
    - ``prompt_mean``: the mean over prompts of each prompt's token mean (needs
      ``prompt_boundaries``).

    Sequences (and prompts) with no loss token are not counted in a mean, so data-parallel
    pad rows (``loss_mask`` 0) never change a loss. A mini-batch with no loss token gets
    weight 0 everywhere.

    Args:
        loss_mask: ``[num_sequences, seq_len]``; bool, integer or float (float values act as
            token weights).
        reduction: one of :data:`REDUCTIONS`.
        mini_batch_boundaries: ``(start, end)`` row ranges tiling the rows, one per mini-batch
            (e.g. from :func:`batchfit.batches.minibatch.mini_batch_boundaries`); ``None`` = one
            mini-batch of all rows.
        prompt_boundaries: ``(start, end)`` row ranges, one per prompt, each inside one
            mini-batch (from :func:`batchfit.batches.minibatch.prompt_boundaries`).
        max_seq_len: the normaliser of ``seq_mean_token_sum_norm``; default the mask width.
            Pass the generation length limit so the normaliser does not depend on padding.
        dtype: floating dtype of the result; default the mask's dtype if it is float32 or
            float64, else float32 (counts and scales are always computed in float64: a
            float16 count overflows at 65,536 tokens and bf16 rounds counts above 256).
            float16 weights keep each mini-batch's sum within float16's epsilon, subnormal
            weights included (NOTE [ Float16 weights keep their sums ]).

    Returns:
        A tensor shaped like ``loss_mask``, on its device.

    Raises:
        InvalidArgument: unknown reduction, a mask that is not a 2-D real tensor or holds NaN
            or inf, a bad ``max_seq_len`` or ``dtype``, boundaries that are not ``(start, end)``
            integer pairs, weights that overflow ``dtype``, or ``prompt_mean`` without
            ``prompt_boundaries``.
        BatchError: boundaries that do not tile the rows (``[]`` for a non-empty mask
            included), or a prompt straddling two mini-batches.

    Example:
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> loss_weights(mask, reduction="token_mean")
        tensor([[0.3333, 0.3333, 0.0000],
                [0.3333, 0.0000, 0.0000]])
    """
    check_choice("reduction", reduction, REDUCTIONS)
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.ndim != 2:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else describe(loss_mask)
        raise InvalidArgument(f"loss_mask must be a 2-D tensor [num_sequences, seq_len], but got {shape}")
    if loss_mask.dtype.is_complex:
        raise InvalidArgument(
            f"loss_mask must be bool, integer or real floating, but got dtype {loss_mask.dtype}; pass its real part"
        )
    _check_finite(loss_mask)
    if max_seq_len is not None:
        max_seq_len = check_count("max_seq_len", max_seq_len)
    if mini_batch_boundaries is not None:
        mini_batch_boundaries = check_ranges("mini_batch_boundaries", mini_batch_boundaries)
    if prompt_boundaries is not None:
        prompt_boundaries = check_ranges("prompt_boundaries", prompt_boundaries)
    if dtype is None:
        dtype = loss_mask.dtype if loss_mask.dtype in (torch.float32, torch.float64) else torch.float32
    elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgument(
            f"dtype must be a floating torch.dtype such as torch.float32, but got dtype={dtype!r}; pass None for float32"
        )
    out_dtype = dtype
    dtype = torch.float64  # counts and scales (NOTE in the docstring: float16 counts overflow)
    n, width = loss_mask.shape
    device = loss_mask.device
    mask = loss_mask.detach().to(device="cpu", dtype=dtype)
    if mini_batch_boundaries is not None and len(mini_batch_boundaries) == 0 and n:
        raise BatchError(
            f"mini_batch_boundaries must tile the {n} rows, but got []; pass None for one mini-batch of all rows"
        )
    if mini_batch_boundaries is None:
        mini_batch_boundaries = [(0, n)] if n else []
    mb = _segment_ids(mini_batch_boundaries, n, "mini_batch_boundaries")
    n_mb = int(mb.max()) + 1 if n else 0
    tokens = mask.sum(dim=1)  # loss tokens per sequence
    has_tokens = (tokens != 0).to(dtype)

    if reduction == "token_mean":
        row_scale = _safe_inverse(_per_segment(tokens, mb, n_mb))[mb]
    elif reduction == "sequence_mean":
        sequences = _per_segment(has_tokens, mb, n_mb)
        row_scale = _safe_inverse(tokens) * _safe_inverse(sequences)[mb]
    elif reduction == "seq_mean_token_sum_norm":
        norm = width if max_seq_len is None else max_seq_len
        sequences = _per_segment(has_tokens, mb, n_mb)
        row_scale = _safe_inverse(sequences)[mb] / norm
    else:  # prompt_mean
        if prompt_boundaries is None:
            raise InvalidArgument(
                "reduction='prompt_mean' needs prompt_boundaries; pass "
                "batchfit.batches.minibatch.prompt_boundaries(uids)"
            )
        pr = _segment_ids(prompt_boundaries, n, "prompt_boundaries")
        n_pr = int(pr.max()) + 1 if n else 0
        for k, (start, end) in enumerate(prompt_boundaries):
            if mb[start] != mb[end - 1]:
                raise BatchError(
                    f"prompt {k} (rows {start}..{end - 1}) straddles two mini-batches; cut mini-batches "
                    "at prompt boundaries (batchfit.batches.minibatch.mini_batch_boundaries)"
                )
        prompt_tokens = _per_segment(tokens, pr, n_pr)
        prompt_mb = torch.zeros(n_pr, dtype=torch.long).index_copy_(0, pr, mb)
        prompts = _per_segment((prompt_tokens != 0).to(dtype), prompt_mb, n_mb)
        row_scale = _safe_inverse(prompt_tokens)[pr] * _safe_inverse(prompts)[mb]
    weights = mask * row_scale[:, None]
    if not bool(torch.isfinite(weights).all()):
        raise InvalidArgument(
            f"loss_mask's values are too large to normalise in float64 (largest {float(mask.abs().max()):.3g}, "
            f"total {float(mask.abs().sum()):.3g}); pass a 0/1 mask, or token weights of a sensible scale"
        )
    return _cast_keeping_sums(weights, out_dtype).to(device=device)


def _check_finite(loss_mask: torch.Tensor) -> None:
    """NaN or inf in a float mask would poison every weight of its mini-batch silently."""
    if not loss_mask.dtype.is_floating_point:
        return
    bad = ~torch.isfinite(loss_mask.detach())
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise InvalidArgument(
            f"loss_mask must be finite, but loss_mask[{row}, {col}]={float(loss_mask[row, col])} "
            f"({int(bad.sum())} non-finite entries); a NaN would make every other weight of its mini-batch 0. "
            "Fix the mask (e.g. torch.nan_to_num) before computing weights"
        )


# NOTE [ Float16 weights keep their sums ]
# 1/N for N > 16,384 tokens is a float16 subnormal, on a fixed grid of 2**-24: cast one by
# one, every weight of a token mean rounds the same way and the mini-batch sums to 1 ± N·2**-25
# (1.36e-3 measured at 700k tokens, 1.4× float16's epsilon; 0 or 2 further out). Below 2**-13
# float16 holds every multiple of 2**-24 exactly, so those weights are rounded cumulatively:
# weight i becomes round(prefix_i) − round(prefix_{i−1}) on that grid (row-major, so each row
# and each mini-batch is a contiguous run). Every prefix sum -- each mini-batch's, each row's --
# then stays within 2**-24 of the exact one, and a weight moves by less than one grid step.
# Larger weights are cast as usual (relative error ≤ 2**-11 each). The sum of each mini-batch
# is therefore its float64 sum within 2**-11 relative + 2**-24, inside float16's epsilon
# (2**-10). bfloat16 has no such grid problem: its exponent range reaches 1e-38, so its weights
# are within 2**-9 relative each, inside its epsilon (2**-7).
_F16_GRID = 2.0**-24
_F16_FINE = 2.0**-13


def _cast_keeping_sums(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weights`` (float64) cast to ``dtype``; float16 keeps its sums (NOTE [ Float16 weights keep their sums ])."""
    out = weights.to(dtype)
    if not bool(torch.isfinite(out).all()):
        raise InvalidArgument(
            f"loss weights up to {float(weights.abs().max()):.3g} overflow dtype={dtype}; pass dtype=torch.float32 "
            "or smaller token weights in loss_mask"
        )
    if dtype != torch.float16 or not weights.numel():
        return out
    flat = weights.reshape(-1)
    fine = flat.abs() < _F16_FINE
    steps = torch.round(torch.cumsum(torch.where(fine, flat, torch.zeros_like(flat)) / _F16_GRID, 0))
    steps = torch.diff(steps, prepend=steps.new_zeros(1))
    return torch.where(fine, (steps * _F16_GRID).to(dtype), out.reshape(-1)).reshape(weights.shape)
