"""The per-token policy loss of a micro-batch, aligned with ``loss_mask``, weighted exactly.

Fields of a micro-batch come in two widths (NOTE [ Sequence and response columns ] in
:mod:`batchfit.batches.layout`): the log-probs from :func:`batchfit.train.model_logprobs` are
sequence-wide and token-aligned (NOTE [ Token-aligned log-probs ]); ``loss_mask``,
``advantages``, ``old_log_probs`` and ``weights`` are response-wide and right-aligned with
the sequence, so they are the sequence's last columns (in a packed row every field is
per token and the widths are equal). :func:`response_columns` takes those columns; every
per-token factor of the loss is then on the same column as the token it belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from batchfit.errors import BatchError
from batchfit.validation import check_number

__all__ = ["policy_loss", "response_columns", "value_loss"]


def response_columns(values: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` columns of a sequence-wide ``[rows, W, ...]`` tensor: those of the response fields.

    Raises:
        BatchError: ``width`` is larger than ``W``.

    Example:
        >>> response_columns(torch.arange(6).view(1, 6), 2).tolist()
        [[4, 5]]
    """
    if values.ndim < 2 or width > values.shape[1]:
        raise BatchError(
            f"response fields must not be wider than the sequence, but got width {width} for values of shape {tuple(values.shape)}"
        )
    return values[:, values.shape[1] - width :]


def _field(batch: Mapping[str, Any], key: str, shape: torch.Size) -> torch.Tensor:
    value = batch.get(key)
    if not isinstance(value, torch.Tensor):
        raise BatchError(f"the micro-batch needs a tensor field {key!r}, but its fields are {sorted(batch)}")
    if value.shape != shape:
        raise BatchError(
            f"{key} must have the shape of the loss mask {tuple(shape)}, but got {tuple(value.shape)}"
        )
    return value


def _mask(batch: Mapping[str, Any], key: str) -> torch.Tensor:
    mask = batch.get(key)
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        raise BatchError(f"the micro-batch needs a 2-D tensor field {key!r}, but its fields are {sorted(batch)}")
    return mask


def policy_loss(
    logprobs: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    clip_ratio: float = 0.2,
    clip_ratio_high: float | None = None,
    scale: float = 1.0,
    loss_mask_key: str = "loss_mask",
    weights_key: str = "weights",
    advantages_key: str = "advantages",
    old_logprobs_key: str = "old_log_probs",
) -> torch.Tensor:
    """PPO/GRPO's clipped surrogate of a micro-batch, summed with exact loss weights: a scalar to ``backward()``.

    Per response token ``t`` (``loss_mask`` non-zero), with ``r = exp(logp − old_logp)``::

        loss_t = max(−A·r, −A·clip(r, 1 − clip_ratio, 1 + clip_ratio_high))

    and the result is ``scale × Σ_t weights_t · loss_t``. With ``weights`` from
    :func:`batchfit.batches.weights.loss_weights` over the mini-batch, the results of all
    micro-batches (and ranks) sum to the mini-batch's reduction of ``loss_t``; pass
    ``scale=data_parallel_size(model)`` under DDP/FSDP2, which average gradients over ranks
    (NOTE [ Accumulate, then sync once ]). Tokens outside ``loss_mask`` contribute exactly 0
    (their log-ratio is zeroed before ``exp``).

    Args:
        logprobs: ``[rows, W]`` token-aligned log-probs from :func:`batchfit.train.model_logprobs`.
        batch: the micro-batch, with ``loss_mask``, ``weights``, ``advantages`` and
            ``old_log_probs`` of one shape ``[rows, R]``, ``R ≤ W`` (right-aligned).
        clip_ratio: ``ε``, the lower clip (and the upper one unless ``clip_ratio_high``), ``≥ 0``.
        clip_ratio_high: the upper clip (DAPO's clip-higher), default ``clip_ratio``.
        scale: multiplies the sum (the data-parallel size).
        loss_mask_key, weights_key, advantages_key, old_logprobs_key: the field names.

    Returns:
        A 0-dim fp32 tensor.

    Raises:
        BatchError: a missing field, fields of different shapes, or response fields wider
            than ``logprobs``.
        InvalidArgument: a negative or non-finite ``clip_ratio`` / ``clip_ratio_high``.

    Example:
        >>> logp = torch.tensor([[0.0, -1.0, -2.0]])
        >>> batch = {"loss_mask": torch.tensor([[1, 1]]), "weights": torch.tensor([[0.5, 0.5]]),
        ...          "advantages": torch.tensor([[1.0, 1.0]]), "old_log_probs": torch.tensor([[-1.0, -2.0]])}
        >>> policy_loss(logp, batch)  # r = 1 on both tokens: −(0.5 · 1 + 0.5 · 1)
        tensor(-1.)
    """
    low = check_number("clip_ratio", clip_ratio, low=0.0)
    high = low if clip_ratio_high is None else check_number("clip_ratio_high", clip_ratio_high, low=0.0)
    mask = _mask(batch, loss_mask_key)
    weights = _field(batch, weights_key, mask.shape)
    advantages = _field(batch, advantages_key, mask.shape)
    old = _field(batch, old_logprobs_key, mask.shape)
    logp = response_columns(logprobs, mask.shape[1])
    valid = mask != 0
    log_ratio = torch.where(valid, logp - old.to(logp.dtype), 0.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high))
    per_token = torch.where(valid, per_token, 0.0)
    return (per_token * weights.to(logp.dtype)).sum() * scale


def value_loss(
    values: torch.Tensor,
    batch: Mapping[str, Any],
    *,
    clip: float | None = None,
    scale: float = 1.0,
    loss_mask_key: str = "loss_mask",
    weights_key: str = "weights",
    returns_key: str = "returns",
    old_values_key: str = "old_values",
) -> torch.Tensor:
    """PPO's value loss of a micro-batch, summed with exact loss weights: a scalar to ``backward()``.

    Per response token ``t`` (``loss_mask`` non-zero), with returns ``R`` and values ``v``::

        loss_t = ½ (v − R)²                                         (clip=None)
        loss_t = ½ max((v − R)², (old + clamp(v − old, −clip, clip) − R)²)

    and the result is ``scale × Σ_t weights_t · loss_t`` (see :func:`policy_loss` for the
    weights and ``scale``). Tokens outside ``loss_mask`` contribute exactly 0.

    Args:
        values: ``[rows, W]`` token-aligned values from :func:`batchfit.train.model_values`.
        batch: the micro-batch, with ``loss_mask``, ``weights``, ``returns`` (and with
            ``clip``, ``old_values``) of one shape ``[rows, R]``, ``R ≤ W`` (right-aligned).
        clip: PPO's value clip ``ε_v ≥ 0``, or ``None`` for the plain squared error.
        scale: multiplies the sum (the data-parallel size).
        loss_mask_key, weights_key, returns_key, old_values_key: the field names.

    Returns:
        A 0-dim fp32 tensor.

    Raises:
        BatchError: a missing field, fields of different shapes, or response fields wider
            than ``values``.
        InvalidArgument: a negative or non-finite ``clip``.

    Example:
        >>> values = torch.tensor([[0.0, 1.0, 3.0]])
        >>> batch = {"loss_mask": torch.tensor([[1, 1]]), "weights": torch.tensor([[0.5, 0.5]]),
        ...          "returns": torch.tensor([[2.0, 2.0]])}
        >>> value_loss(values, batch)  # ½ (0.5 · 1 + 0.5 · 1)
        tensor(0.5000)
    """
    mask = _mask(batch, loss_mask_key)
    weights = _field(batch, weights_key, mask.shape)
    returns = _field(batch, returns_key, mask.shape)
    v = response_columns(values, mask.shape[1])
    valid = mask != 0
    target = returns.to(v.dtype)
    error = (v - target).square()
    if clip is not None:
        clip = check_number("clip", clip, low=0.0)
        old = _field(batch, old_values_key, mask.shape).to(v.dtype)
        clipped = old + (v - old).clamp(-clip, clip)
        error = torch.maximum(error, (clipped - target).square())
    per_token = torch.where(valid, 0.5 * error, 0.0)
    return (per_token * weights.to(v.dtype)).sum() * scale

