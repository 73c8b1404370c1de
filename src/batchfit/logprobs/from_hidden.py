"""Per-token log-probs and entropy straight from hidden states, never building ``[N, V]`` logits.

For each chunk of ``chunk_size`` tokens the forward projects ``x = hidden_chunk @ weight.T + bias``
in the dtype of the inputs (as the model's ``lm_head`` would), upcasts to fp32, and reduces it to
the chunk's log-probs, entropies and logsumexps. Backward recomputes the chunk's logits, forms
their fp32 gradient ``g`` and turns it into
``grad_hidden_chunk = g @ weight`` (in the input dtype), ``grad_weight += g.T @ hidden_chunk`` and
``grad_bias += g.sum(0)`` (both accumulated in fp32, cast to the parameter dtype at the end).

Extra memory: O(chunk_size × V) fp32 temporaries, O(N) per-token floats, and in backward the fp32
accumulators of the weight and bias gradients (``V × H`` and ``V`` floats; these *are* the weight
gradient when the weight is fp32). Nothing grows with sequence length except the per-token vectors
and the gradient of ``hidden`` itself.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from batchfit.errors import InvalidArgument
from batchfit.logprobs._common import (
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


def _project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The chunk's logits ``h @ weight.T (+ bias)`` in the inputs' dtype, ``[c, V]``."""
    if bias is None:
        return h @ weight.t()
    return torch.addmm(bias, h, weight.t())


class _HiddenLogprobs(torch.autograd.Function):
    """Autograd for :func:`logprobs_from_hidden` (outputs flat ``[N]``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, temperature, ignore_index, want_entropy):
        n = labels.numel()
        kw = {"device": hidden.device, "dtype": compute_dtype(hidden.dtype)}
        lse, logp = torch.empty(n, **kw), torch.empty(n, **kw)
        entropy = torch.empty(n, **kw) if want_entropy else None
        valid_all = labels != ignore_index
        safe_all = torch.where(valid_all, labels, 0)
        for i, j, h in chunks(rows(hidden), chunk_size):
            x = _project(h, weight, bias)
            c_lse, c_logp, c_ent = chunk_forward(
                x, safe_all[i:j], valid_all[i:j], temperature, want_entropy, own=True
            )
            del x
            lse[i:j], logp[i:j] = c_lse, c_logp
            if entropy is not None:
                entropy[i:j] = c_ent
        # Inputs saved by reference and only read (NOTE [ No in-place writes to saved tensors ]).
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.chunk_size, ctx.temperature, ctx.ignore_index = chunk_size, temperature, ignore_index
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 5
        if not (need_h or need_w or need_b) or (grad_logp is None and grad_entropy is None):
            return None, None, None, *none
        valid = labels != ctx.ignore_index
        safe = torch.where(valid, labels, 0) if grad_logp is not None else None
        if grad_logp is not None:
            grad_logp = torch.where(valid, grad_logp.to(lse.dtype), 0.0)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(lse.dtype)

        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        out_h = rows(grad_h)[0] if need_h else None
        acc_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        acc_b = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) if need_b else None
        for i, j, h in chunks(rows(hidden), ctx.chunk_size):
            x = _project(h, weight, bias)
            g = chunk_backward(
                x,
                None if safe is None else safe[i:j],
                lse[i:j],
                None if entropy is None else entropy[i:j],
                None if grad_logp is None else grad_logp[i:j],
                None if grad_entropy is None else grad_entropy[i:j],
                ctx.temperature,
                own=True,
            )
            del x
            if need_h:
                g_low = g if g.dtype == weight.dtype else g.to(weight.dtype)
                torch.mm(g_low, weight, out=out_h[i:j])  # hidden and weight share one dtype
                del g_low
            if need_w:
                acc_w.addmm_(g.t(), h.to(g.dtype))
            if need_b:
                acc_b.add_(g.sum(dim=0))
            del g
        grad_w = None if acc_w is None else acc_w.to(weight.dtype)
        grad_b = None if acc_b is None else acc_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, *none


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (and entropy) of ``softmax((hidden @ weight.T + bias) / temperature)`` without full logits.

    Each chunk's logits are projected in the inputs' dtype (exactly what ``lm_head(hidden)``
    gives), then upcast to fp32 for the reduction; backward recomputes them chunk by chunk and
    produces gradients for ``hidden``, ``weight`` and ``bias`` in their own dtypes (weight and
    bias gradients accumulated in fp32). Works under ``torch.no_grad()``.

    Args:
        hidden: ``[..., H]`` float tensor (typically ``[B, S, H]``, the last hidden states); may be
            non-contiguous (e.g. ``hidden[:, :-1]``).
        weight: ``[V, H]`` output projection (the ``lm_head`` weight), same dtype as ``hidden``.
        labels: integer tensor of shape ``hidden.shape[:-1]``; each entry in ``[0, V)`` or
            ``ignore_index``.
        bias: optional ``[V]`` bias, same dtype.
        chunk_size: tokens per chunk (positive int), or ``None`` for one chunk.
        temperature: ``T > 0``.
        return_entropy: also return the per-token entropy.
        ignore_index: label value whose log-prob is 0 and which gets no gradient from it.

    Returns:
        ``logp`` of shape ``labels.shape`` in fp32 (fp64 for fp64 inputs), or ``(logp, entropy)``
        with ``return_entropy``.

    Raises:
        InvalidArgument (a ValueError): bad ``chunk_size`` or ``temperature``; ``weight`` not
            ``[V, H]`` with ``H = hidden.shape[-1]``; ``bias`` not ``[V]``; dtypes that differ;
            labels of another shape or dtype, or out of range.

    Memory: peak extra O(chunk_size × V) (two or three ``[chunk, V]`` temporaries) plus O(N)
    floats, independent of sequence length; plus, for low-precision weights, the fp32
    ``V × H`` weight-gradient accumulator in backward (for fp32 weights it is the gradient).
    Time: four ``N × V × H`` GEMMs instead of three (backward recomputes the projection once),
    plus O(N × V) elementwise work.

    Example:
        >>> hidden = torch.randn(2, 6, 8, requires_grad=True)
        >>> weight = torch.randn(32, 8, requires_grad=True)
        >>> labels = torch.randint(0, 32, (2, 6))
        >>> logprobs_from_hidden(hidden, weight, labels, chunk_size=5).sum().backward()
        >>> hidden.grad.shape, weight.grad.shape
        (torch.Size([2, 6, 8]), torch.Size([32, 8]))
    """
    check_float_tensor("hidden", hidden, min_dim=1)
    check_float_tensor("weight", weight, min_dim=2)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InvalidArgument(
            f"weight must have shape [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"but got weight.shape={tuple(weight.shape)} and hidden.shape={tuple(hidden.shape)}"
        )
    vocab = weight.shape[0]
    if bias is not None:
        check_float_tensor("bias", bias, min_dim=1)
        if tuple(bias.shape) != (vocab,):
            raise InvalidArgument(
                f"bias must have shape [V] = ({vocab},) like weight.shape[0], but got bias.shape={tuple(bias.shape)}"
            )
    dtypes = {
        "hidden": hidden.dtype,
        "weight": weight.dtype,
        **({"bias": bias.dtype} if bias is not None else {}),
    }
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{k}.dtype={v}" for k, v in dtypes.items())
        raise InvalidArgument(
            f"hidden, weight and bias must share one dtype, but got {listed}; cast them alike"
        )
    chunk_size = check_chunk_size(chunk_size)
    temperature = check_temperature(temperature)
    flat = check_labels(labels, tuple(hidden.shape[:-1]), vocab, ignore_index)
    logp, entropy = _HiddenLogprobs.apply(
        hidden, weight, bias, flat, chunk_size, temperature, int(ignore_index), bool(return_entropy)
    )
    shape = tuple(labels.shape)
    if return_entropy:
        return logp.view(shape), entropy.view(shape)
    return logp.view(shape)
