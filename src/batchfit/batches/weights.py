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
from batchfit.validation import check_choice, check_positive_int

REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean")


def _segment_ids(bounds: Sequence[tuple[int, int]], n: int, name: str) -> torch.Tensor:
    """Row → segment index for contiguous ``bounds`` that must tile ``range(n)`` exactly."""
    ids = torch.empty(n, dtype=torch.long)
    expected = 0
    for k, (start, end) in enumerate(bounds):
        if start != expected or end <= start:
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

    Returns:
        A tensor shaped like ``loss_mask``, on its device.

    Raises:
        InvalidArgument: unknown reduction, a mask that is not 2-D, a bad ``max_seq_len`` or
            ``dtype``, or ``prompt_mean`` without ``prompt_boundaries``.
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
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise InvalidArgument(f"loss_mask must be a 2-D tensor [num_sequences, seq_len], but got {shape}")
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
        norm = width if max_seq_len is None else check_positive_int("max_seq_len", max_seq_len)
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
    return (mask * row_scale[:, None]).to(device=device, dtype=out_dtype)
