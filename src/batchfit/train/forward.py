"""Forward-only log-probs of a whole batch (old or reference policy), micro-batched under a forward budget.

The old-policy (and reference) log-probs of every sequence are needed before the
optimizer steps of a training step. :func:`forward_logprobs` runs them under
``torch.no_grad()`` along a plan made with the forward-only budget (the ``reference``
role of :func:`batchfit.budget.model_profile.profile_model`, several times the training
budget), each rank its share, and sums the ranks' results so that every rank holds the
log-probs of every row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from batchfit.batches.microbatch import MicroBatch, iter_micro_batches
from batchfit.errors import InvalidArgument
from batchfit.parallel.collective_device import all_reduce_
from batchfit.parallel.distributed import is_distributed
from batchfit.plan.packing import MicroBatchPlan
from batchfit.train.long_sequence import split_outputs, split_refusal
from batchfit.train.micro_batch_step import micro_batch_outputs
from batchfit.train.model_outputs import span_starts

__all__ = ["forward_logprobs", "forward_values"]


def forward_logprobs(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    plan: MicroBatchPlan,
    rank: int = 0,
    *,
    layout: str = "padded",
    head: str = "fused",
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    only_loss_tokens: bool = False,
    group: Any = None,
    out: torch.Tensor | None = None,
    **iter_options: Any,
) -> torch.Tensor:
    """Token-aligned log-probs of every row of ``batch`` under ``model``, without gradients.

    Each micro-batch runs :func:`batchfit.train.micro_batch_outputs` (what the budget of the
    forward-only roles measures, NOTE [ One micro-batch step ]).

    Every rank of the plan runs its micro-batches (padding ones included, so FSDP2 ranks
    stay in lockstep) through :func:`batchfit.train.model_logprobs`, writes them back at
    their rows and columns, and the ranks' results are summed (one all-reduce of
    ``[N, W]`` floats; each row is written by one rank only, the others add zeros).

    Args:
        model: the policy (or reference) model, bare, DDP or FSDP2.
        batch: per-sample fields with ``input_ids`` and ``attention_mask`` ``[N, W]`` (and
            ``position_ids`` if any); only these are cut into micro-batches.
        plan: from :func:`batchfit.plan.packing.plan_micro_batches` over ``batch``'s lengths,
            with the forward-only budget and ``dp_size`` = the data-parallel ranks.
        rank: this process' data-parallel rank.
        layout: ``"padded"`` or ``"packed"`` (:func:`batchfit.batches.microbatch.iter_micro_batches`).
        head, chunk_size, temperature: as :func:`batchfit.train.model_logprobs`.
        only_loss_tokens: run the head only on the tokens of ``batch["loss_mask"]`` (NOTE
            [ Response-only head ]); the other columns of the result are 0. The loss mask is
            cut into micro-batches with the tokens.
        group: the data-parallel process group (``None`` = the default group).
        out: a float ``[N, W]`` tensor to write into (zeroed first), e.g. one kept in host
            memory (each micro-batch's values are copied to its device and dtype, and the
            ranks' sum runs on the group's device and is copied back: NOTE [ Collectives
            run on the group's device ]); default a new fp32 one on ``input_ids``' device.
        **iter_options: passed to :func:`batchfit.batches.microbatch.iter_micro_batches` (``trim=False``
            runs full-width rows).

    Only ``input_ids``, ``attention_mask`` and ``position_ids`` (and ``loss_mask`` with
    ``only_loss_tokens``) are cut into micro-batches;
    ``position_ids`` are left out when every row's valid tokens are one span (each sequence
    then has positions ``0 .. length − 1``, which the model makes itself).

    Returns:
        ``out``, or a new ``[N, W]`` fp32 tensor on ``input_ids``' device; column ``c`` is the log-prob of the token
        in column ``c`` (0 where it has no previous token). The response-wide field is
        ``batchfit.train.response_columns(result, R)``.

    Raises:
        InvalidArgument: ``plan.dp_size > 1`` without a process group of that size (the
            other ranks' rows would stay 0).
        BatchError, BudgetError: as :func:`batchfit.batches.microbatch.iter_micro_batches`;
            ``BudgetError`` on every rank when a plan made with ``oversize="split"`` splits a
            sequence of a DDP/FSDP model (a lone rank's chunks are no collective rounds of the
            others) or of a model that cannot run in chunks exactly
            (:func:`batchfit.train.long_sequence.split_refusal`).

    A plan made with ``oversize="split"`` runs each over-long sequence in chunks of at most
    ``plan.split_tokens`` tokens on one KV cache (:func:`batchfit.train.long_sequence.split_outputs`).
    """
    run = _outputs(
        model, plan, head=head, chunk_size=chunk_size, temperature=temperature, only_loss_tokens=only_loss_tokens
    )
    extra = ("loss_mask",) if only_loss_tokens else ()
    return _forward(batch, plan, rank, run, layout, group, out, iter_options, extra)


def _outputs(model: torch.nn.Module, plan: MicroBatchPlan, **options: Any) -> Callable[[MicroBatch], torch.Tensor]:
    """What runs one micro-batch of ``plan``: its outputs, over-long sequences in chunks (NOTE [ Over-long sequences run in chunks ])."""
    _check_splits(model, plan)
    if plan.split:
        return lambda mb: split_outputs(model, mb, plan.split_tokens or plan.token_budget, over=plan.token_budget, **options)
    return lambda mb: micro_batch_outputs(model, mb, **options)


def _check_splits(model: torch.nn.Module, plan: MicroBatchPlan) -> None:
    """Refuse, on every rank alike (the plan is the same on each), a split a forward pass cannot run exactly.

    A forward-only pass splits front to back on one rank's own cache; under DDP or FSDP its
    chunks would be collective rounds the other ranks do not run.

    Raises:
        BudgetError: naming the first split sequence and the budget that holds it.
    """
    for index, _chunks in plan.split:
        refusal = split_refusal(model, int(plan.lengths[index]), index)
        if refusal is not None:
            raise refusal


def forward_values(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    plan: MicroBatchPlan,
    rank: int = 0,
    *,
    layout: str = "padded",
    group: Any = None,
    out: torch.Tensor | None = None,
    **iter_options: Any,
) -> torch.Tensor:
    """Token-aligned values of every row of ``batch`` under a critic ``model``, without gradients.

    As :func:`forward_logprobs`, with :func:`batchfit.train.model_values` for each
    micro-batch (``micro_batch_outputs(..., critic=True)``).
    """
    return _forward(batch, plan, rank, _outputs(model, plan, critic=True), layout, group, out, iter_options)


def _forward(
    batch: Mapping[str, Any],
    plan: MicroBatchPlan,
    rank: int,
    run: Callable[[MicroBatch], torch.Tensor],
    layout: str,
    group: Any,
    out: torch.Tensor | None,
    iter_options: Mapping[str, Any],
    extra_keys: tuple[str, ...] = (),
) -> torch.Tensor:
    import torch.distributed as dist

    if plan.dp_size > 1 and (not is_distributed(group) or dist.get_world_size(group) != plan.dp_size):
        size = dist.get_world_size(group) if is_distributed(group) else 1
        raise InvalidArgument(
            f"plan.dp_size={plan.dp_size} needs a process group of {plan.dp_size} ranks to gather every row, but got {size}; plan with dp_size={size}"
        )
    ids = batch["input_ids"]
    # the forward needs the tokens and where they are; the other fields' rows are not copied
    keys = ["input_ids", "attention_mask", *extra_keys]
    if "position_ids" in batch and span_starts(batch.get("attention_mask")) is None:
        keys.append("position_ids")  # rows with holes: the positions matter
    inputs = {k: batch[k] for k in keys if k in batch}
    if out is None:
        out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    elif tuple(out.shape) != tuple(ids.shape) or not out.is_floating_point():
        raise InvalidArgument(
            f"out must be a float tensor of input_ids' shape {tuple(ids.shape)}, but got {out.dtype} of shape {tuple(out.shape)}"
        )
    else:
        out.zero_()
    with torch.no_grad():
        for mb in iter_micro_batches(inputs, plan, rank, layout=layout, **iter_options):
            values = run(mb)
            if mb.alignment is None and mb.packed is None:  # trim=False: full-width rows
                if mb.indices:
                    out[list(mb.indices)] = values.to(out.device, out.dtype)
            else:
                mb.write_back(out, values)
    if plan.dp_size > 1:
        all_reduce_(out, dist.ReduceOp.SUM, group)  # NOTE [ Collectives run on the group's device ]
    return out
