"""Rollout batches for the training-step tests: prompt (left-padded) | response (right-padded) rows.

The layout SkyRL and verl give a trainer (DESIGN.md): each row is its prompt, left-padded to the
widest prompt, then its response, right-padded to the widest response; response-width fields
(``loss_mask``, ``advantages``, ``old_log_probs``) are right-aligned with the sequence.

- :func:`prompt_response_rows`: the token ids, the attention mask and a response loss mask,
  optionally with holes (tool outputs the loss does not read).
- :func:`rollouts`: rows with every field a PPO/GRPO step and a value loss read, old log-probs
  near the model's own (tests/test_long_sequence.py, test_long_sequence_forward.py, test_split_chunk.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchfit.batches.weights import loss_weights
from batchfit.train import model_logprobs, response_columns


def prompt_response_rows(
    prompts: Sequence[int] | torch.Tensor,
    responses: Sequence[int] | torch.Tensor,
    generator: torch.Generator,
    *,
    keep: float | None = None,
    vocab: int = 64,
    widths: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[n, P + R]``, ``loss_mask`` ``[n, R]`` (float) over the responses.

    ``P``, ``R`` are ``widths``, else the longest prompt and response. With ``keep``, each response
    token stays in the loss mask with that probability (the first one always): holes. Draws from
    ``generator``, in this order: the holes (with ``keep`` only), then the token ids in ``[1, vocab)``.
    """
    prompt, response = torch.as_tensor(prompts), torch.as_tensor(responses)
    p, r = widths if widths is not None else (int(prompt.max()), int(response.max()))
    cols = torch.arange(p + r)
    mask = ((cols >= p - prompt[:, None]) & (cols < p + response[:, None])).long()
    in_response = mask[:, p:].float()
    loss_mask = in_response * (torch.rand(in_response.shape, generator=generator) < keep) if keep else in_response
    loss_mask[:, 0] = in_response[:, 0]  # at least one loss token per row
    return {
        "input_ids": torch.randint(1, vocab, (len(prompt), p + r), generator=generator) * mask,
        "attention_mask": mask,
        "loss_mask": loss_mask,
    }


def rollouts(model: torch.nn.Module, prompts, responses, seed: int = 0) -> dict:
    """Prompt (left-padded) | response (right-padded) rows, a loss mask with holes, old log-probs near the model's.

    Old log-probs are the model's own plus noise, so the ratios sit around 1 and some clip:
    the gradient is neither zero (the first response token's ratio is 1) nor unclipped everywhere.
    """
    g = torch.Generator().manual_seed(seed)
    rows = prompt_response_rows(prompts, responses, g, keep=0.75)
    loss_mask = rows.pop("loss_mask")
    n, r = loss_mask.shape
    batch = rows
    with torch.no_grad():
        logp = response_columns(model_logprobs(model, batch), r)
    batch.update(
        loss_mask=loss_mask,
        advantages=torch.randn(n, r, generator=g) * loss_mask,
        # exact at each row's first response token (ratio 1: never clipped), noisy after it
        old_log_probs=(logp + 0.2 * torch.randn(logp.shape, generator=g) * (torch.arange(r) > 0)) * loss_mask,
        returns=torch.randn(n, r, generator=g) * loss_mask,
        old_values=torch.randn(n, r, generator=g) * loss_mask,
        weights=loss_weights(loss_mask, reduction="token_mean"),
    )
    return batch
