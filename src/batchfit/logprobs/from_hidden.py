"""Per-token log-probs and entropy straight from hidden states, never building ``[N, V]`` logits.

For each chunk of ``chunk_size`` tokens the forward projects ``x = hidden_chunk @ weight.T + bias``
in the dtype of the inputs (as the model's ``lm_head`` would), upcasts to fp32, and reduces it to
the chunk's log-probs, entropies and logsumexps. Backward recomputes the chunk's logits, forms
their fp32 gradient ``g`` and turns it into ``grad_hidden_chunk = g @ weight`` (in the input
dtype). The weight and bias gradients are sums over all tokens, kept in fp32:

- fp32 (and fp64) weights: in the same pass, ``grad_weight += g.T @ hidden_chunk`` and
  ``grad_bias += g.sum(0)`` into fp32 buffers that are the gradients themselves;
- bf16/fp16 weights: a second pass over blocks of vocabulary rows, so that no ``V × H`` fp32
  buffer exists (NOTE [ Weight gradient by vocabulary blocks ]).

Extra memory: O(chunk_size × V) fp32 temporaries, O(N) per-token floats, O(V) for the bias
gradient and, for low-precision weights, a ``[block, H]`` fp32 accumulator no larger than one
``[chunk, V]`` fp32 chunk. Nothing grows with sequence length except the per-token vectors and
the gradient of ``hidden`` itself.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.function import once_differentiable

from batchfit.errors import InvalidArgument
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
    gather_tokens,
    position_index,
    rows,
    scatter_tokens,
)

# NOTE [ Weight gradient by vocabulary blocks ]
# The weight gradient sums over every token, so a single pass over token chunks must accumulate
# all of it at once: in fp32 (for fp32-accurate sums) that is a V x H x 4 B buffer. For fp32 (and
# fp64) weights that buffer *is* the gradient, so the single pass costs nothing extra. For bf16 and
# fp16 weights it is extra memory (512 MiB at V 32k x H 4096, 2 GiB at V 128k) that dominates the
# O(chunk x V) temporaries. Backward then runs two passes instead: pass 1 over token chunks makes
# grad_hidden; pass 2 over blocks of `vocab_block_rows` vocabulary rows recomputes each
# [chunk, block] logits tile, rebuilds its gradient from the saved per-token logsumexp/entropy
# (chunk_backward with column_offset) and sums grad_weight[block] (and grad_bias[block]) over the
# token chunks in a [block, H] fp32 buffer, written once in the weight's dtype. Each entry is the
# same fp32 sum over tokens as in the single pass, so the gradients stay fp32-accurate. Cost: one
# more N x V x H GEMM (five instead of four) and the softmax recomputed twice, for
# O(chunk x V + block x H) extra memory. Pass 1 is skipped when hidden needs no gradient.

MIN_BLOCK_ROWS = 256


def weight_grad_by_blocks(dtype: torch.dtype) -> bool:
    """True when backward sums the weight gradient by vocabulary blocks (two passes): low-precision weights.

    See NOTE [ Weight gradient by vocabulary blocks ]. fp32 and fp64 weights keep the single pass,
    whose fp32 accumulator is the gradient itself.
    """
    return compute_dtype(dtype) != dtype


def vocab_block_rows(chunk_tokens: int, vocab: int, hidden: int) -> int:
    """Vocabulary rows per block of the two-pass weight gradient, in ``[1, vocab]``.

    ``chunk_tokens × vocab // (hidden + 2 × chunk_tokens)`` rows: the ``[block, hidden]`` fp32
    accumulator and a tile's two fp32 ``[chunk, block]`` temporaries together hold no more floats
    than one fp32 ``[chunk, vocab]`` chunk, so pass 2 stays within pass 1's footprint. At least
    :data:`MIN_BLOCK_ROWS` (256) rows, so tiles stay large enough for efficient GEMMs.

    Example: chunk 1024, vocab 32768, hidden 4096 -> 1024 * 32768 // (4096 + 2048) = 5461 rows
    (an 85 MiB accumulator and 2 x 21 MiB tiles; one [1024, 32768] fp32 chunk is 128 MiB).
    """
    return max(1, min(vocab, max(MIN_BLOCK_ROWS, chunk_tokens * vocab // max(hidden + 2 * chunk_tokens, 1))))


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast would run a GEMM in on ``device_type``, or ``None`` when it is off."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off on ``device_type`` (a no-op where autocast does not exist, e.g. ``meta``)."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _project(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cast: torch.dtype | None = None
) -> torch.Tensor:
    """The chunk's logits ``h @ weight.T (+ bias)``, ``[c, V]``, in the compute dtype (fp32 for bf16/fp16).

    NOTE [ Logits accumulate in fp32 ]
    A bf16 GEMM rounds its output to bf16: logits of magnitude 10 lose about 0.03, which is
    the error of the log-probs RL needs to compare (old vs new policy). Low-precision inputs
    are therefore projected block by block of vocabulary rows (:func:`vocab_block_rows`
    rows): the chunk and one block of the weight are upcast to fp32 and multiplied in fp32
    into the fp32 result, so no fp32 copy of the whole weight exists and no logit is
    rounded. fp32 and fp64 inputs take one GEMM.

    NOTE [ Autocast is replayed, not inherited ]
    Under ``torch.autocast`` the inputs of the GEMM are what autocast would feed it:
    ``cast`` (the autocast dtype) rounds the chunk and each weight block, which are then
    multiplied in fp32 as above. The forward records ``cast`` and the backward, which
    autograd runs with autocast off, passes the same one, so the logits it recomputes are
    the logits the forward ran (recomputing them in fp32 put the gradient 1.8% off).
    """

    def exact(t: torch.Tensor) -> torch.Tensor:
        return t if cast is None or cast == t.dtype else t.to(cast)

    out = compute_dtype(h.dtype if cast is None else cast)
    if cast is None and out == h.dtype and out == weight.dtype:
        return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    rows, vocab = h.shape[0], weight.shape[0]
    x = torch.empty(rows, vocab, dtype=out, device=h.device)
    hf = exact(h).to(out)
    block = vocab_block_rows(rows, vocab, h.shape[1])
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        tile = hf @ exact(weight[v0:v1]).to(out).t()
        if bias is not None:
            tile += exact(bias[v0:v1]).to(out)
        x[:, v0:v1] = tile
        del tile
    return x


class _HiddenLogprobs(torch.autograd.Function):
    """Autograd for :func:`logprobs_from_hidden` (outputs flat ``[N]``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size, temperature, ignore_index, want_entropy):
        n = labels.numel()
        device_type = hidden.device.type
        cast = _autocast_dtype(device_type)  # NOTE [ Autocast is replayed, not inherited ]
        kw = {"device": hidden.device, "dtype": compute_dtype(hidden.dtype if cast is None else cast)}
        lse, logp = torch.empty(n, **kw), torch.empty(n, **kw)
        entropy = torch.empty(n, **kw) if want_entropy else None
        valid_all = labels != ignore_index
        safe_all = torch.where(valid_all, labels, 0)
        with _without_autocast(device_type):
            for i, j, h in chunks(rows(hidden), chunk_size):
                x = _project(h, weight, bias, cast)
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
        ctx.cast = cast
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        with _without_autocast(ctx.saved_tensors[0].device.type):
            return _HiddenLogprobs._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
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

        def grad_tile(h, i, j, w, b, column_offset=None):
            """fp32 gradient of the logits of tokens [i, j) and the vocabulary rows of ``w``."""
            x = _project(h, w, b, ctx.cast)
            return chunk_backward(
                x,
                None if safe is None else safe[i:j],
                lse[i:j],
                None if entropy is None else entropy[i:j],
                None if grad_logp is None else grad_logp[i:j],
                None if grad_entropy is None else grad_entropy[i:j],
                ctx.temperature,
                own=True,
                column_offset=column_offset,
            )

        # NOTE [ Weight gradient by vocabulary blocks ]
        blocked = need_w and weight_grad_by_blocks(weight.dtype)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        out_h = rows(grad_h)[0] if need_h else None
        acc_w = (
            torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
            if need_w and not blocked
            else None
        )
        acc_b = (
            torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device)
            if need_b and not blocked
            else None
        )
        # pass 1, over token chunks: grad_hidden, and the weight/bias gradients unless blocked
        if need_h or acc_w is not None or acc_b is not None:
            for i, j, h in chunks(rows(hidden), ctx.chunk_size):
                g = grad_tile(h, i, j, weight, bias)
                if need_h:
                    g_low = g if g.dtype == weight.dtype else g.to(weight.dtype)
                    torch.mm(g_low, weight, out=out_h[i:j])  # hidden and weight share one dtype
                    del g_low
                if acc_w is not None:
                    acc_w.addmm_(g.t(), h.to(g.dtype))
                if acc_b is not None:
                    acc_b.add_(g.sum(dim=0))
                del g
        grad_w = None if acc_w is None else acc_w.to(weight.dtype)
        grad_b = None if acc_b is None else acc_b.to(bias.dtype)
        if blocked:
            # pass 2, over vocabulary blocks: each block's rows of grad_weight (and grad_bias)
            # accumulated over all token chunks in a block-sized fp32 buffer
            vocab, width = weight.shape
            tokens = labels.numel() if ctx.chunk_size is None else min(ctx.chunk_size, labels.numel())
            block = vocab_block_rows(tokens, vocab, width)
            grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            grad_b = torch.empty(vocab, dtype=bias.dtype, device=bias.device) if need_b else None
            acc_w = torch.empty(block, width, dtype=lse.dtype, device=weight.device)
            acc_b = torch.empty(block, dtype=lse.dtype, device=weight.device) if need_b else None
            for v0 in range(0, vocab, block):
                v1 = min(v0 + block, vocab)
                a_w = acc_w[: v1 - v0].zero_()
                a_b = None if acc_b is None else acc_b[: v1 - v0].zero_()
                b_blk = None if bias is None else bias[v0:v1]
                for i, j, h in chunks(rows(hidden), ctx.chunk_size):
                    g = grad_tile(h, i, j, weight[v0:v1], b_blk, column_offset=v0)
                    a_w.addmm_(g.t(), h.to(g.dtype))
                    if a_b is not None:
                        a_b.add_(g.sum(dim=0))
                    del g
                grad_w[v0:v1].copy_(a_w)
                if a_b is not None:
                    grad_b[v0:v1].copy_(a_b)
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
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (and entropy) of ``softmax((hidden @ weight.T + bias) / temperature)`` without full logits.

    Each chunk's logits are projected in the inputs' dtype (exactly what ``lm_head(hidden)``
    gives), then upcast to fp32 for the reduction; backward recomputes them chunk by chunk and
    produces gradients for ``hidden``, ``weight`` and ``bias`` in their own dtypes (weight and
    bias gradients summed in fp32; for bf16/fp16 weights by blocks of vocabulary rows, see
    NOTE [ Weight gradient by vocabulary blocks ]). Works under ``torch.no_grad()``.

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
        positions: optional mask of the labels' shape (bool, int or float, e.g. a loss mask):
            only the tokens where it is non-zero run through the head; the others get 0 (log-prob
            and entropy) and no gradient (NOTE [ Only the positions the loss reads ] in
            :mod:`batchfit.logprobs.chunks`). Memory and time then scale with the selected
            tokens. Reads the mask (one device sync); not on fake tensors.

    Returns:
        ``logp`` of shape ``labels.shape`` in fp32 (fp64 for fp64 inputs), or ``(logp, entropy)``
        with ``return_entropy``.

    Raises:
        InvalidArgument (a ValueError): bad ``chunk_size`` or ``temperature``; ``weight`` not
            ``[V, H]`` with ``H = hidden.shape[-1]``; ``bias`` not ``[V]``; dtypes that differ;
            labels of another shape or dtype, or out of range; ``positions`` not a tensor of the
            labels' shape, or fake.

    Memory: peak extra O(chunk_size × V) (two or three ``[chunk, V]`` temporaries) plus O(N)
    floats, independent of sequence length. For bf16/fp16 weights backward adds a
    ``[block, H]`` fp32 accumulator with ``block = max(256, chunk × V // (H + 2 × chunk))``
    rows (above the 256-row floor, fewer floats than one ``[chunk, V]`` fp32 chunk), never a
    ``V × H`` fp32 one.
    Time: fp32/fp64 weights, four ``N × V × H`` GEMMs instead of three (backward recomputes the
    projection once); bf16/fp16 weights, five (backward projects once per pass); plus O(N × V)
    elementwise work (twice in backward for bf16/fp16).

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
    shape = tuple(labels.shape)
    index = None
    if positions is not None:  # NOTE [ Only the positions the loss reads ]
        index = position_index(positions, shape)
        hidden, flat = gather_tokens(hidden, index), flat.index_select(0, index)
    logp, entropy = _HiddenLogprobs.apply(
        hidden, weight, bias, flat, chunk_size, temperature, int(ignore_index), bool(return_entropy)
    )
    if index is not None:
        count = labels.numel()
        logp = scatter_tokens(logp, index, count)
        entropy = None if entropy is None else scatter_tokens(entropy, index, count)
    if return_entropy:
        return logp.view(shape), entropy.view(shape)
    return logp.view(shape)
