"""Per-token log-probs and entropy from logits, chunked along the tokens.

``logits`` ``[..., V]`` stay as they are (any float dtype, never copied or upcast whole); each
chunk of ``chunk_size`` tokens is upcast to fp32 and reduced. Autograd saves a reference to the
logits, the labels and one fp32 logsumexp (and entropy) per token; backward recomputes each
chunk's softmax and writes that chunk of the gradient. Extra memory: O(chunk_size × V) fp32
temporaries plus O(N) per-token floats; the gradient of the logits (same dtype and shape as the
logits) is the only ``[N, V]`` tensor created.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from batchfit.logprobs.chunks import (
    IGNORE_INDEX,
    check_chunk_size,
    check_float_tensor,
    check_labels,
    check_temperature,
    chunk_backward,
    chunk_forward,
    chunks,
    compute_dtype,
    rows,
)


def _forward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    chunk_size: int | None,
    temperature: float,
    ignore_index: int,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """fp32 ``[N]`` (lse, logp or None, entropy or None) over the flattened tokens, chunk by chunk."""
    n = labels.numel() if labels is not None else logits[..., 0].numel()
    kw = {"device": logits.device, "dtype": compute_dtype(logits.dtype)}
    lse = torch.empty(n, **kw)
    logp = torch.empty(n, **kw) if labels is not None else None
    entropy = torch.empty(n, **kw) if want_entropy else None
    for i, j, x in chunks(rows(logits), chunk_size):
        lab = valid = None
        if labels is not None:
            valid = labels[i:j] != ignore_index
            lab = torch.where(valid, labels[i:j], torch.zeros_like(labels[i:j]))
        c_lse, c_logp, c_ent = chunk_forward(x, lab, valid, temperature, want_entropy)
        lse[i:j] = c_lse
        if logp is not None:
            logp[i:j] = c_logp
        if entropy is not None:
            entropy[i:j] = c_ent
    return lse, logp, entropy


class _LogitsLogprobs(torch.autograd.Function):
    """Autograd for :func:`logprobs_from_logits` / :func:`entropy_from_logits` (outputs flat ``[N]``)."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_size, temperature, ignore_index, want_entropy):
        lse, logp, entropy = _forward(logits, labels, chunk_size, temperature, ignore_index, want_entropy)
        # Saved: the input by reference (never written, NOTE [ No in-place writes to saved tensors ]),
        # labels and per-token fp32 vectors; no [N, V] tensor.
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.chunk_size, ctx.temperature, ctx.ignore_index = chunk_size, temperature, ignore_index
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
            return None, None, None, None, None, None
        if grad_logp is not None:
            grad_logp = torch.where(labels != ctx.ignore_index, grad_logp.to(lse.dtype), 0.0)
            safe = torch.where(labels != ctx.ignore_index, labels, 0)
        else:
            safe = None
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(lse.dtype)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        out = rows(grad)[0]  # freshly allocated, hence contiguous: one [N, V] view
        for i, j, x in chunks(rows(logits), ctx.chunk_size):
            g = chunk_backward(
                x,
                None if safe is None else safe[i:j],
                lse[i:j],
                None if entropy is None else entropy[i:j],
                None if grad_logp is None else grad_logp[i:j],
                None if grad_entropy is None else grad_entropy[i:j],
                ctx.temperature,
            )
            out[i:j].copy_(g)
            del g
        return grad, None, None, None, None, None


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the taken tokens (and the entropy) under ``softmax(logits / temperature)``.

    Computed in fp32 whatever the dtype of ``logits``, ``chunk_size`` tokens at a time, with a
    backward that recomputes each chunk's softmax instead of saving it. Works under
    ``torch.no_grad()`` with the same bounded memory.

    Args:
        logits: ``[..., V]`` float tensor (typically ``[B, S, V]``); may be non-contiguous
            (e.g. ``logits[:, :-1]``) without being copied.
        labels: integer tensor of shape ``logits.shape[:-1]``; each entry in ``[0, V)`` or
            ``ignore_index``.
        chunk_size: tokens per chunk (positive int), or ``None`` for one chunk (no chunking).
        temperature: ``T > 0``; log-probs of ``softmax(logits / T)``.
        return_entropy: also return the entropy of ``softmax(logits / T)`` per token.
        ignore_index: label value whose log-prob is 0 and which gets no gradient from it (the
            entropy is still computed there; mask it with your loss mask).

    Returns:
        ``logp`` of shape ``labels.shape`` in fp32 (fp64 for fp64 inputs), or ``(logp, entropy)``
        with ``return_entropy``.
        Both may require grad at once; the gradient of ``logits`` has their dtype and shape.

    Raises:
        InvalidArgument (a ValueError): bad ``chunk_size`` (0, negative, non-int), ``temperature``
            <= 0, non-float logits, labels of another shape or dtype, a label out of range.

    Memory: extra O(chunk_size × V) fp32 temporaries (at most two at a time) and O(N) floats;
    time O(N × V), one pass over the logits forward and one backward.

    Example:
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> labels = torch.randint(0, 11, (2, 5))
        >>> logp, ent = logprobs_from_logits(logits, labels, chunk_size=4, return_entropy=True)
        >>> (logp.sum() + 0.01 * ent.sum()).backward()
        >>> logp.shape, logits.grad.shape
        (torch.Size([2, 5]), torch.Size([2, 5, 11]))
    """
    check_float_tensor("logits", logits, min_dim=1)
    chunk_size = check_chunk_size(chunk_size)
    temperature = check_temperature(temperature)
    flat = check_labels(labels, tuple(logits.shape[:-1]), logits.shape[-1], ignore_index)
    logp, entropy = _LogitsLogprobs.apply(
        logits, flat, chunk_size, temperature, int(ignore_index), bool(return_entropy)
    )
    shape = tuple(labels.shape)
    if return_entropy:
        return logp.view(shape), entropy.view(shape)
    return logp.view(shape)


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    chunk_size: int | None = 1024,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token entropy of ``softmax(logits / temperature)``, fp32, chunked like :func:`logprobs_from_logits`.

    Args:
        logits: ``[..., V]`` float tensor.
        chunk_size: tokens per chunk (positive int), or ``None`` for no chunking.
        temperature: ``T > 0``.

    Returns:
        tensor of shape ``logits.shape[:-1]`` in fp32 (fp64 for fp64 logits); differentiable w.r.t. ``logits``
        (``dH/dz_j = -p_j (log p_j + H) / T``), also alongside :func:`logprobs_from_logits` on the
        same logits.

    Raises:
        InvalidArgument (a ValueError): bad ``chunk_size``, ``temperature`` or ``logits``.

    Example:
        >>> float(entropy_from_logits(torch.zeros(1, 4)))  # uniform over 4: log 4
        1.3862943649291992
    """
    check_float_tensor("logits", logits, min_dim=1)
    chunk_size = check_chunk_size(chunk_size)
    temperature = check_temperature(temperature)
    _, entropy = _LogitsLogprobs.apply(logits, None, chunk_size, temperature, IGNORE_INDEX, True)
    return entropy.view(tuple(logits.shape[:-1]))
