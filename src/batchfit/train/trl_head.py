"""TRL's log-prob head (``logprobs="trl"``): TRL's own chunked kernel inside the model's output head.

NOTE [ TRL's head ]
TRL 1.16's ``GRPOTrainer`` (and RLOO, DPO, KTO, SFT) patches the model with
``trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))``; its
``_get_per_token_logps_and_entropies`` then calls ``model(input_ids, attention_mask,
labels=labels, fused_lm_head=True)`` with the prompt's labels set to -100. The patched forward
(``_fused_forward``) runs the backbone, takes ``last_hidden_state[:, :-1]`` and the labels
``[:, 1:]``, and calls ``trl.kernels.ChunkedLogProbFunction`` with a vocabulary chunk of
``_CHUNKED_LOGPROB_CHUNK_SIZE`` (32768). The kernel allocates a projection buffer of
``min(N, TOKEN_CHUNK_SIZE=4096) × 32768`` in the compute dtype whatever the vocabulary (so a
small-vocabulary model pays for 32768 columns), in the forward and again in the backward,
plus fp32 ``[N]`` statistics and, in the backward, fp32 gradient accumulators of the hidden
states and the head's weight. Without Triton (the CPU) every position is scored
(``hidden.reshape(-1, H)``) and the tiles are folded with torch ops (fp32 ``[n, V]``
temporaries); with Triton (CUDA) only the positions with a label (``hidden_states[mask]``),
folded in the kernel. :func:`trl_logprobs_from_hidden` runs that kernel, imported from TRL, on the
same operands in the same order as the CPU path: what the cpu backend measures is what TRL
allocates on a CPU; for a CUDA device the estimate is an upper bound (Triton scores only the
completion tokens and holds no ``[n, V]`` temporaries beside the buffer).
"""

from __future__ import annotations

from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.logprobs import IGNORE_INDEX

__all__ = ["TRL_VOCAB_CHUNK", "trl_kernel", "trl_logprobs_from_hidden"]

#: TRL's ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (``trl/trainer/utils.py``): vocabulary columns per tile.
TRL_VOCAB_CHUNK = 32768


def trl_kernel() -> Any:
    """TRL's ``ChunkedLogProbFunction`` (``trl.kernels``).

    Raises:
        InvalidArgument: TRL is not installed (the message names the extra).
    """
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError as exc:
        raise InvalidArgument(
            "logprobs='trl' runs TRL's own log-prob kernel, but TRL is not installed; pip install -e '.[trl]' in batchfit's checkout "
            "or pick another head (logprobs='fused')"
        ) from exc
    return ChunkedLogProbFunction


def trl_logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = True,
) -> torch.Tensor:
    """TRL's log-probs (and entropy) of ``labels`` from the last hidden states, as TRL's fused head computes them.

    NOTE [ TRL's head ]. ``labels`` are the next-token labels per column (column ``c`` holds
    the label the hidden state of ``c`` predicts, ``IGNORE_INDEX`` where none, as
    :func:`batchfit.train.model_outputs.next_token_labels`).

    Returns:
        ``[rows, T]`` fp32 log-probs, or ``[rows, T, 2]`` with the entropy last (GRPO always
        asks for it); 0 in the last column and where the label is ignored.

    Raises:
        InvalidArgument: TRL is not installed.
    """
    kernel = trl_kernel()
    outputs = ("log_probs", "entropy") if return_entropy else ("log_probs",)
    # _fused_forward: hidden[:, :-1] with labels[:, 1:]; batchfit's labels are already shifted
    target = labels[:, :-1]
    states = hidden[:, :-1]
    mask = target != IGNORE_INDEX
    per_token = kernel.apply(
        states.reshape(-1, states.size(-1)),  # TRL's path without Triton: every position
        weight,
        bias,
        target.clamp(min=0).reshape(-1),
        temperature,
        TRL_VOCAB_CHUNK,
        None,
        1.0,
        outputs,
    )
    kept = [x.view(mask.shape).masked_fill(~mask, 0) for x in per_token if x is not None]
    out = torch.stack(kept, dim=-1) if return_entropy else kept[0]
    return torch.nn.functional.pad(out, (0, 0, 0, 1) if return_entropy else (0, 1))  # the last column predicts nothing
