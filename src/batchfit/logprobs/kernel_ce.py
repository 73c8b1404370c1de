"""Log-probs the way flash-attention's Triton cross-entropy makes them: its outputs, and its gradient in place.

NOTE [ A fused kernel's memory is its outputs ]
verl and SkyRL compute log-probs with ``logprobs_from_logits`` (verl
``verl/utils/torch_functional.py``, SkyRL ``skyrl/backends/skyrl_train/utils/torch_utils.py``),
which on CUDA calls flash-attention's ``cross_entropy_loss(logits, labels,
inplace_backward=...)`` when flash-attn is installed. Its Triton kernels read the logits
block by block in on-chip memory. What they allocate on the device
(``flash_attn/ops/triton/cross_entropy.py``, ``CrossEntropyLoss``):

- forward: three fp32 ``[n]`` tensors, the losses, the z-losses and the log-sum-exp it
  saves for backward (with the logits and labels);
- backward: the logits' gradient, written into the logits' own storage with
  ``inplace_backward=True`` (the frameworks pass it unless entropy also reads the logits),
  else into a new tensor like them.

:func:`kernel_logprobs` makes exactly these allocations through three custom operators
(``batchfit::kernel_ce_forward``, ``batchfit::kernel_ce_backward`` and its in-place
``batchfit::kernel_ce_backward_``). On the CPU their kernels compute the same values in
fp32 row blocks inside the operator, where no dispatch mode (and so no memory tracker) sees
the temporaries, as no allocator sees a Triton kernel's blocks; under ``FakeTensorMode``
their fake implementations allocate the same outputs. The estimate and cpu backends count
the same bytes, and they are the bytes the GPU kernel takes.
"""

from __future__ import annotations

import torch

from batchfit.logprobs.chunks import IGNORE_INDEX

__all__ = ["kernel_logprobs"]

# Rows per block of the CPU kernels (their temporaries are inside the operator, untracked).
_ROWS = 256


@torch.library.custom_op("batchfit::kernel_ce_forward", mutates_args=())
def _forward(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Losses ``lse − logits[label]`` (0 where ignored), z-losses (0) and the log-sum-exp, fp32 ``[n]``."""
    n = logits.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    for start in range(0, n, _ROWS):
        block = logits[start : start + _ROWS].float()
        block_lse = torch.logsumexp(block, dim=-1)
        label = labels[start : start + _ROWS]
        ignored = label == ignore_index
        picked = block.gather(-1, label.masked_fill(ignored, 0)[:, None])[:, 0]
        lse[start : start + _ROWS] = block_lse
        losses[start : start + _ROWS] = torch.where(ignored, 0.0, block_lse - picked)
    return losses, torch.zeros(n, dtype=torch.float32, device=logits.device), lse


@_forward.register_fake
def _(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = logits.shape[0]
    return tuple(logits.new_empty(n, dtype=torch.float32) for _ in range(3))  # type: ignore[return-value]


def _gradient_into(
    out: torch.Tensor,
    grad_losses: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
) -> None:
    """``out = grad · (softmax(logits) − onehot(label))`` per row (0 where ignored), block by block."""
    for start in range(0, logits.shape[0], _ROWS):
        stop = start + _ROWS
        label = labels[start:stop]
        ignored = label == ignore_index
        probs = torch.exp(logits[start:stop].float() - lse[start:stop, None])
        probs.scatter_add_(-1, label.masked_fill(ignored, 0)[:, None], torch.full_like(probs[:, :1], -1.0))
        scale = torch.where(ignored, 0.0, grad_losses[start:stop].float())
        out[start:stop] = (probs * scale[:, None]).to(out.dtype)


@torch.library.custom_op("batchfit::kernel_ce_backward", mutates_args=())
def _backward(
    grad_losses: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """The logits' gradient in a new tensor like them."""
    out = torch.empty_like(logits)
    _gradient_into(out, grad_losses, logits, lse, labels, ignore_index)
    return out


@_backward.register_fake
def _(
    grad_losses: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    return torch.empty_like(logits)


@torch.library.custom_op("batchfit::kernel_ce_backward_", mutates_args=("logits",))
def _backward_inplace(
    grad_losses: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
) -> None:
    """The logits' gradient written over the logits."""
    _gradient_into(logits, grad_losses, logits, lse, labels, ignore_index)


@_backward_inplace.register_fake
def _(
    grad_losses: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
) -> None:
    return None


class _KernelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index, inplace_backward):  # type: ignore[override]
        losses, z_losses, lse = torch.ops.batchfit.kernel_ce_forward(logits, labels, ignore_index)
        ctx.save_for_backward(logits, lse, labels)
        ctx.mark_non_differentiable(z_losses)
        ctx.ignore_index, ctx.inplace_backward = ignore_index, inplace_backward
        return losses, z_losses

    @staticmethod
    def backward(ctx, grad_losses, grad_z_losses):  # type: ignore[override]
        del grad_z_losses  # the z-losses are for logging only
        logits, lse, labels = ctx.saved_tensors
        if ctx.inplace_backward:
            torch.ops.batchfit.kernel_ce_backward_(grad_losses, logits, lse, labels, ctx.ignore_index)
            return logits, None, None, None
        return (
            torch.ops.batchfit.kernel_ce_backward(grad_losses, logits, lse, labels, ctx.ignore_index),
            None,
            None,
            None,
        )


def kernel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    inplace_backward: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token log-probs of ``labels``, with the allocations of flash-attention's cross-entropy kernel.

    NOTE [ A fused kernel's memory is its outputs ]: the values are those of ``log_softmax``
    in fp32; the memory is the kernel's (three fp32 ``[n]`` outputs, the gradient in place).

    Args:
        logits: ``[..., V]`` in any float dtype, contiguous in the last dimension.
        labels: integer labels of ``logits.shape[:-1]``; ``ignore_index`` gives 0.
        inplace_backward: the backward overwrites ``logits`` with their gradient (the logits
            must then not be read by anything else's backward, e.g. an entropy).
        ignore_index: the label of tokens without a log-prob.

    Returns:
        fp32 log-probs of ``labels``' shape (``-losses``, as the frameworks negate them).

    Raises:
        ValueError: ``labels`` is not of ``logits.shape[:-1]``.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0]])
        >>> kernel_logprobs(logits, torch.tensor([1]))
        tensor([-0.6931])
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels must have the logits' shape without the vocabulary, {tuple(logits.shape[:-1])}, but got {tuple(labels.shape)}"
        )
    batch = logits.shape[:-1]
    losses, _ = _KernelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index, inplace_backward
    )
    return (-losses).view(batch)
