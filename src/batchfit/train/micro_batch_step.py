"""One micro-batch of an RL training step: what a trainer runs, and what a token budget's probe measures.

:func:`micro_batch_loss` is the forward of a trained micro-batch: log-probs through the
model's own forward (:func:`batchfit.train.model_logprobs`) and PPO/GRPO's clipped surrogate
(:func:`batchfit.train.policy_loss`), or a critic's values (:func:`batchfit.train.model_values`)
and the value loss (:func:`batchfit.train.value_loss`). :func:`micro_batch_outputs` is the
forward-only pass (old or reference log-probs, values) of one micro-batch; run it under
``torch.no_grad()``. A trainer's loop calls them; the budget's probe calls the same two
functions on a synthetic micro-batch of the shape it measures (NOTE [ One micro-batch step ]
in :mod:`batchfit.budget.causal_lm_probe`), so a budget holds what the trainer runs.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from batchfit.train.framework_heads import FrameworkHead, as_framework_head
from batchfit.train.loss import policy_loss, response_columns, value_loss
from batchfit.train.model_outputs import _fields, model_logprobs, model_values

#: The entropy bonus's coefficient when a framework's loss has one (its size changes no memory).
ENTROPY_COEFF = 1e-3

__all__ = ["micro_batch_loss", "micro_batch_outputs"]


def micro_batch_outputs(
    model: torch.nn.Module,
    batch: Any,
    *,
    critic: bool = False,
    head: str | FrameworkHead = "fused",
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    only_loss_tokens: bool = False,
) -> torch.Tensor:
    """The per-token outputs of one micro-batch: token-aligned log-probs, or values for a critic.

    Args:
        model: the policy (a causal LM) or, with ``critic=True``, a value-head model; bare,
            DDP or FSDP2.
        batch: a :class:`~batchfit.batches.MicroBatch` or its ``.batch`` mapping.
        critic: values (:func:`batchfit.train.model_values`) instead of log-probs.
        head, chunk_size, temperature, only_loss_tokens: as :func:`batchfit.train.model_logprobs`
            (ignored for a critic); ``only_loss_tokens`` runs the head only where the batch's
            ``loss_mask`` is non-zero (NOTE [ Response-only head ]).

    Returns:
        ``[rows, T]`` fp32, token-aligned (NOTE [ Token-aligned log-probs ]).

    Raises:
        BatchError, InvalidArgument: as :func:`batchfit.train.model_logprobs` /
            :func:`batchfit.train.model_values`.
    """
    if critic:
        return model_values(model, batch)
    return cast(
        torch.Tensor,
        model_logprobs(
            model, batch, head=head, chunk_size=chunk_size, temperature=temperature, only_loss_tokens=only_loss_tokens
        ),
    )


def micro_batch_loss(
    model: torch.nn.Module,
    batch: Any,
    *,
    critic: bool = False,
    head: str | FrameworkHead = "fused",
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    clip_ratio: float = 0.2,
    clip_ratio_high: float | None = None,
    value_clip: float | None = None,
    scale: float = 1.0,
    only_loss_tokens: bool = False,
) -> torch.Tensor:
    """The loss of one trained micro-batch, weighted exactly: ``micro_batch_loss(...).backward()``.

    Policy: :func:`batchfit.train.policy_loss` of :func:`batchfit.train.model_logprobs`;
    critic: :func:`batchfit.train.value_loss` of :func:`batchfit.train.model_values`.

    Args:
        model: the trained model, bare, DDP or FSDP2.
        batch: a :class:`~batchfit.batches.MicroBatch` or its ``.batch`` mapping, with the
            loss's response-wide fields (``loss_mask``, ``weights`` and ``advantages`` /
            ``old_log_probs``, or ``returns`` (and ``old_values`` with ``value_clip``)).
        critic: the value loss of a value-head model instead of the policy loss.
        head, chunk_size, temperature: as :func:`batchfit.train.model_logprobs`.
        only_loss_tokens: the head runs only on the loss tokens (NOTE [ Response-only head ]):
            the same loss and gradients, with the head's memory and time scaling with the
            response tokens.
        clip_ratio, clip_ratio_high: as :func:`batchfit.train.policy_loss`.
        value_clip: ``clip`` of :func:`batchfit.train.value_loss`.
        scale: the data-parallel size under DDP/FSDP2 (NOTE [ Accumulate, then sync once ]).

    Returns:
        A 0-dim fp32 tensor.

    Raises:
        BatchError, InvalidArgument: as the functions above.
    """
    fields = _fields(batch)
    framework = None if critic else as_framework_head(head)
    if framework is not None:
        return _framework_loss(model, batch, fields, framework, clip_ratio, clip_ratio_high, scale, only_loss_tokens)
    outputs = micro_batch_outputs(
        model,
        batch,
        critic=critic,
        head=head,
        chunk_size=chunk_size,
        temperature=temperature,
        only_loss_tokens=only_loss_tokens,
    )
    if critic:
        return value_loss(outputs, fields, clip=value_clip, scale=scale)
    return policy_loss(outputs, fields, clip_ratio=clip_ratio, clip_ratio_high=clip_ratio_high, scale=scale)


def _framework_loss(
    model: torch.nn.Module,
    batch: Any,
    fields: Any,
    head: FrameworkHead,
    clip_ratio: float,
    clip_ratio_high: float | None,
    scale: float,
    only_loss_tokens: bool = False,
) -> torch.Tensor:
    """The policy loss with a framework's head: its entropy a loss term, or a metric held with the loss.

    NOTE [ The framework's head, not ours ] in :mod:`batchfit.train.framework_heads`: an entropy
    with gradients that is only a metric keeps its graph while the framework holds it, which is
    until the micro-batch's backward is done; it rides on the loss (``loss.held_entropy``),
    which the caller drops after ``backward()``.
    """
    logp, entropy = model_logprobs(model, batch, head=head, return_entropy=True, only_loss_tokens=only_loss_tokens)
    loss = policy_loss(logp, fields, clip_ratio=clip_ratio, clip_ratio_high=clip_ratio_high, scale=scale)
    if entropy is None:
        return loss
    if head.entropy_in_loss:
        weights = fields["weights"]
        bonus = (response_columns(entropy, weights.shape[1]).float() * weights.to(torch.float32)).sum()
        return loss - ENTROPY_COEFF * scale * bonus
    loss.held_entropy = entropy  # type: ignore[attr-defined]
    return loss
