"""A sequence longer than the token budget, trained in chunks with the gradient of the whole sequence.

NOTE [ Over-long sequences run in chunks ]
A micro-batch holding one sequence of ``L`` tokens, more than the budget ``C``, runs in ``n``
passes of at most ``C`` tokens, one after another, each attending to the keys and values
(KV) of the tokens before it (:func:`split_loss_backward`):

1. **Fill.** Every chunk but the last runs under ``torch.no_grad()`` with a
   ``DynamicCache``: only the KV of the sequence is kept (and ``logits_to_keep=1``, no
   ``[C, V]`` logits).
2. **Back to front.** Chunk ``j`` (tokens ``[s, e)``) runs again, with gradients, on a cache
   whose keys and values for ``[0, s)`` are *leaves* (detached views of step 1's KV that
   require grad). Its loss is :func:`batchfit.train.micro_batch_loss` of a micro-batch of
   its own tokens, so every head (``fused``, ``full``, ``only_loss_tokens``, the
   frameworks') and the value loss run as for any micro-batch. One backward runs from that
   loss *and* from the chunk's own KV outputs (``[s, e)``, every layer) with the gradient
   the later chunks sent to those positions; the leaves' gradients are added to the slots
   of ``[0, s)``. Chunks run last to first, so when chunk ``j`` runs, the slots of its
   positions hold everything the later chunks' losses owe them.

The losses are sums of per-token terms (:func:`batchfit.train.policy_loss`), and each token's
log-prob belongs to exactly one chunk, so the chunks' losses sum to the unsplit loss and the
parameters' gradients (accumulated in ``.grad`` chunk by chunk) to its gradient: equal to
fp32 rounding (1e-5 on tiny Llama/Qwen2, ``tests/test_long_sequence.py``).

Labels. Column ``c``'s log-prob comes from the hidden state of ``c - 1`` (NOTE
[ Token-aligned log-probs ]), so the last token of chunk ``j`` predicts the first token of
chunk ``j + 1``. Every pass but the last therefore runs one more token, the next chunk's
first, which is only a label there (its own log-prob and KV are the next chunk's): a chunk
but the last owns at most ``C - 1`` tokens and each pass runs at most ``C``
(:func:`batchfit.plan.packing.split_chunks`). The passes run ``L + n - 1`` tokens with
gradients and ``Σ`` of all but the last chunk without: ``n − 1`` extra chunk forwards
(``plan.split_extra_forwards``).

Memory. One chunk's activations (what the budget's probe measured at ``C`` tokens), plus
the whole sequence's KV three times: step 1's KV, the slots of its gradient, and the
``[0, e)`` keys and values each layer's attention holds for its backward (the cache
concatenates past and new; the unsplit sequence holds these too); and with ``eager`` or
``sdpa`` attention one ``[chunk, past + chunk]`` float mask (:func:`_chunk_mask`;
flash-attention needs none). Measured on the cpu backend (``docs/packing.md``): a
2,048-token sequence split at 1,024 peaks 54 MiB above an unsplit 1,024-token micro-batch
(209.6 MiB) on a 27 MiB model. Under gradient
checkpointing the decoder layers keep the cache (a checkpointed layer replays its forward
in the backward; the cache here returns past + new without changing, so the replay reads
what the forward read).

Where it cannot be exact, :func:`split_loss_backward` raises :class:`~batchfit.errors.BudgetError`
naming the sequence and the smallest budget that holds it unsplit (its length):

- a cache layer that is not a plain full-attention ``DynamicLayer`` (sliding windows,
  chunked or hybrid attention, linear attention): such a cache drops or transforms past KV;
- a model whose forward takes no KV cache (``cache``, ``past_key_values`` before transformers 5.24);
- a DDP or FSDP2 model without the plan (``micro_batch_backward(..., plan=plan)``): the ranks
  could not agree on the passes (NOTE [ Split passes in lockstep ]); an FSDP1 model (untested).

NOTE [ Split passes in lockstep ]
Under DDP each forward may broadcast buffers and each synchronising backward all-reduces;
under FSDP2 each forward all-gathers and each backward all-gathers and reduce-scatters. So
every rank must run as many passes, of the same kinds, at each position of the plan. The plan
is the same on every rank: :func:`micro_batch_backward` reads from it the most chunks ``n`` of
any rank's micro-batch at this position (no collective) and every rank runs ``n − 1`` forwards
without gradients and then ``n`` forwards with a backward, padding its own schedule with
one-token passes of zero loss (every parameter in the graph, so DDP finds every gradient
ready). Under DDP, in a synchronising micro-batch only the last pass all-reduces; the others
run in ``no_sync()``, so the gradient is all-reduced once, as for any micro-batch. Under FSDP2
every pass reduce-scatters into the sharded gradient, as every micro-batch does (NOTE
[ Accumulate, then sync once ]). The KV roots' gradient enters a layer below its output, but the
layer's keys feed its own attention, whose gradient comes through the layer's output, so
autograd runs FSDP2's pre-backward gather of the layer before it reaches the projections.

Dropout draws differently in the fill pass and the gradient pass; with dropout on, the
gradient is that of one draw per pass, not of the unsplit sequence's draw.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from batchfit.batches.microbatch import MicroBatch
from batchfit.errors import BatchError, BudgetError
from batchfit.plan.packing import MicroBatchPlan, split_chunks
from batchfit.train.micro_batch_step import micro_batch_loss
from batchfit.train.model_outputs import _fields
from batchfit.validation import check_int

__all__ = ["micro_batch_backward", "split_loss_backward", "split_outputs", "split_refusal"]

#: Fields of a micro-batch that say where its tokens are (the chunks make their own).
_LAYOUT_FIELDS = ("input_ids", "attention_mask", "position_ids", "cu_seq_lens", "max_length")

#: Per-token fields zeroed at a chunk's first token (its log-prob belongs to the chunk before).
_LOSS_FIELDS = ("loss_mask", "weights")


def micro_batch_backward(
    model: torch.nn.Module,
    batch: Any,
    *,
    chunk_tokens: int | None = None,
    plan: MicroBatchPlan | None = None,
    **loss_options: Any,
) -> torch.Tensor:
    """Run one micro-batch's loss and its backward; a lone sequence longer than ``chunk_tokens`` runs in chunks.

    The trainer's hook for plans made with ``oversize="split"``: ``micro_batch_loss(...).backward()``
    for every micro-batch, except one that holds a single sequence of more than
    ``chunk_tokens`` tokens, which runs :func:`split_loss_backward` (NOTE [ Over-long sequences
    run in chunks ]) with the same gradient. Under DDP every rank runs the same passes at
    each position of the plan (NOTE [ Split passes in lockstep ]): pass ``plan``.

    Args:
        model: the trained model: bare, or DDP or FSDP2 with ``plan``; FSDP1 when nothing is split.
        batch: a :class:`~batchfit.batches.MicroBatch` (or its ``.batch`` mapping).
        chunk_tokens: the most tokens one pass may run; default the ``plan``'s
            ``split_tokens`` (or ``token_budget``); ``None`` without a plan never splits.
        plan: the :class:`~batchfit.plan.packing.MicroBatchPlan` ``batch`` comes from: under DDP
            and FSDP2 the passes of every rank's micro-batch at ``batch.position`` are read
            from it; under FSDP1 every rank raises when any rank's micro-batch there would split.
        **loss_options: passed to :func:`batchfit.train.micro_batch_loss` (``head``,
            ``scale``, ``critic``, ``clip_ratio``, ...).

    Returns:
        The micro-batch's loss, detached (0-dim fp32).

    Raises:
        BudgetError: the micro-batch must be split but cannot be exactly (:func:`split_refusal`).
        BatchError, InvalidArgument: as :func:`batchfit.train.micro_batch_loss`; ``plan`` under DDP
            with a ``batch`` that is not a :class:`~batchfit.batches.MicroBatch` of it.

    Example:
        >>> for mb in accumulate(model, iter_micro_batches(mini, plan), plan.num_micro_batches):  # doctest: +SKIP
        ...     micro_batch_backward(model, mb, plan=plan, scale=dp)
    """
    if chunk_tokens is None and plan is not None:
        chunk_tokens = plan.split_tokens or plan.token_budget
    if chunk_tokens is None:
        return _whole(model, batch, loss_options)
    chunk_tokens = check_int("chunk_tokens", chunk_tokens, minimum=1)
    # a plan splits the sequences over its budget, in passes of chunk_tokens (≤ the budget)
    over = max(chunk_tokens, plan.token_budget) if plan is not None else chunk_tokens
    own = _own_chunks(batch, chunk_tokens, over)
    passes = own
    if plan is not None and _is_sharded(model):
        most, index, length = _most_chunks(plan, batch, chunk_tokens, over)
        refusal = split_refusal(model, length, index, lockstep=True) if most > 1 else None
        if refusal is not None:  # on every rank, not only the one that splits: none is left waiting
            raise refusal
        passes = max(own, most)
    if own > 1:
        return _split(model, batch, chunk_tokens, passes, plan is not None, loss_options)
    if passes == 1:
        return _whole(model, batch, loss_options)
    # NOTE [ Split passes in lockstep ]: another rank splits at this position
    sync = _syncs(model)
    with torch.no_grad():
        for _ in range(passes - 1):
            _dummy_pass(model)
    with _pass_sync(model, sync, last=False):
        loss = _whole(model, batch, loss_options)
    for j in range(passes - 1):
        with _pass_sync(model, sync, last=j == passes - 2):
            _dummy_pass(model).backward()
    return loss


def _whole(model: torch.nn.Module, batch: Any, loss_options: Mapping[str, Any]) -> torch.Tensor:
    loss = micro_batch_loss(model, batch, **loss_options)
    loss.backward()
    return loss.detach()


def _own_chunks(batch: Any, chunk_tokens: int, over: int | None = None) -> int:
    """Chunks this micro-batch runs in: 1 unless it holds one sequence longer than ``over`` (default ``chunk_tokens``)."""
    fields = _fields(batch)
    ids, mask = fields.get("input_ids"), fields.get("attention_mask")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1:
        return 1
    length = int((mask != 0).sum()) if isinstance(mask, torch.Tensor) else ids.shape[1]
    over = chunk_tokens if over is None else over
    return len(split_chunks(length, chunk_tokens)) if length > max(over, 1) else 1


def _most_chunks(plan: MicroBatchPlan, batch: Any, chunk_tokens: int, over: int) -> tuple[int, int | None, int]:
    """The most chunks any rank's micro-batch at ``batch``'s position runs in, with that sequence's index and length.

    Read from the plan, the same on every rank: no collective. ``(1, None, 0)`` when none splits.
    """
    if not isinstance(batch, MicroBatch) or not 0 <= batch.position < plan.num_micro_batches:
        where = f" at position {batch.position}" if isinstance(batch, MicroBatch) else ""
        raise BatchError(
            "micro_batch_backward(plan=...) of a sharded model needs a MicroBatch of that plan "
            f"(iter_micro_batches(batch, plan, rank)), but got a {type(batch).__name__}{where}"
        )
    most: tuple[int, int | None, int] = (1, None, 0)
    for rank in plan.ranks:
        indices = rank[batch.position]
        if len(indices) == 1 and int(plan.lengths[indices[0]]) > over:
            length = int(plan.lengths[indices[0]])
            chunks = len(split_chunks(length, chunk_tokens, index=indices[0]))
            if chunks > most[0]:
                most = (chunks, indices[0], length)
    return most


def split_refusal(
    model: torch.nn.Module, length: int, index: int | None = None, *, lockstep: bool = False
) -> BudgetError | None:
    """Why a sequence of ``length`` tokens cannot run in chunks under ``model`` with the unsplit gradient, or ``None``.

    The one-line :class:`~batchfit.errors.BudgetError` names the sequence (``index`` in the
    mini-batch), its length, the reason and the smallest budget that holds it unsplit (NOTE
    [ Over-long sequences run in chunks ]); returned, not raised, so a runner can check a
    plan's split sequences before the step. ``lockstep``: the ranks run the same passes (a DDP
    model is then accepted, NOTE [ Split passes in lockstep ]).
    """
    reason = _why_not_exact(model, lockstep)
    if reason is None:
        return None
    name = f"sequence {index}" if index is not None else "the sequence"
    return BudgetError(
        f"{name} has {length} tokens, more than one pass may run, and cannot run in chunks with its exact "
        f"gradient: {reason}; raise the token budget to at least {length}, truncate or drop the sequence"
    )


def _why_not_exact(model: torch.nn.Module, lockstep: bool) -> str | None:
    from batchfit.parallel.fsdp1 import is_fsdp1
    from batchfit.parallel.shard import is_fsdp, unwrap

    if is_fsdp1(model) or (is_fsdp(model) and not lockstep):
        return (
            f"the model is sharded ({type(model).__name__}): each chunk is a collective round and ranks "
            "would run different numbers of them"
            + ("" if is_fsdp1(model) else "; pass micro_batch_backward(..., plan=plan)")
        )
    if _is_ddp(model) and not lockstep:
        return (
            "the model is DistributedDataParallel and no plan was given: each chunk is a collective round "
            "and ranks would run different numbers of them; pass micro_batch_backward(..., plan=plan)"
        )
    inner = unwrap(model)
    if _cache_kwarg(inner) is None:
        return f"{type(inner).__name__}.forward takes no cache (past_key_values) argument (no KV cache)"
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        layers = DynamicCache(config=inner.config).layers
    except (
        AttributeError,
        KeyError,
        TypeError,
        ValueError,
    ) as exc:  # a config transformers makes no cache for
        first = (str(exc).splitlines() or [""])[0][:120]
        return (
            f"transformers makes no DynamicCache for {type(inner).__name__} ({type(exc).__name__}: {first})"
        )
    odd = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if odd:
        return (
            f"its cache has {', '.join(odd)} layers (sliding-window, chunked, hybrid or linear attention "
            "drop or transform past keys and values), only full-attention DynamicLayer ones run exactly"
        )
    return None


def split_loss_backward(
    model: torch.nn.Module,
    batch: Any,
    chunk_tokens: int,
    **loss_options: Any,
) -> torch.Tensor:
    """The loss of a micro-batch holding one sequence, run in chunks of at most ``chunk_tokens`` tokens, and its backward.

    NOTE [ Over-long sequences run in chunks ]: the parameters' ``.grad`` gain what
    ``micro_batch_loss(model, batch, **loss_options).backward()`` would add (fp32 rounding
    apart); peak memory is one chunk's activations plus three copies of the sequence's KV.

    Args:
        model: a transformers causal LM (or value model), bare or PEFT; its cache must be
            full-attention ``DynamicLayer`` s.
        batch: a :class:`~batchfit.batches.MicroBatch` of one sequence, a padded row (valid
            tokens one span; response fields right-aligned) or a packed row, or its mapping.
        chunk_tokens: the most tokens a pass runs (the plan's ``token_budget``), at least 2.
        **loss_options: passed to :func:`batchfit.train.micro_batch_loss`.

    Returns:
        The loss, detached (0-dim fp32); the backward has run.

    Raises:
        BudgetError: the split cannot be exact for ``model`` (:func:`split_refusal`), or
            ``chunk_tokens < 2`` for a sequence longer than it (one line, naming the sequence).
        BatchError: more than one sequence, or a padded row whose valid tokens have holes.
    """
    return _split(model, batch, chunk_tokens, None, False, loss_options)


def _split(
    model: torch.nn.Module,
    batch: Any,
    chunk_tokens: int,
    passes: int | None,
    lockstep: bool,
    loss_options: Mapping[str, Any],
) -> torch.Tensor:
    """:func:`split_loss_backward`, padded to ``passes`` chunks with empty passes (NOTE [ Split passes in lockstep ])."""
    from transformers.cache_utils import DynamicCache

    index = batch.indices[0] if isinstance(batch, MicroBatch) and batch.indices else None
    fields, ids = _sequence(batch)
    length = ids.shape[1]
    refusal = split_refusal(model, length, index, lockstep=lockstep)
    if refusal is not None:
        raise refusal
    chunks = split_chunks(length, chunk_tokens, index=index)
    if len(chunks) == 1:
        return _whole(model, batch, loss_options)
    extra = max(0, (passes or 0) - len(chunks))
    sync = _syncs(model)
    per_token = _per_token_fields(fields, batch)
    config = _inner(model).config
    with _layers_keep_cache(model):
        fill = DynamicCache(config=config)
        with torch.no_grad():
            for start, end in chunks[:-1]:
                with _runs_on_cache(model, fill, start):
                    model(input_ids=ids[:, start:end], **_small_logits(model))
            for _ in range(extra):
                _dummy_pass(model)
        keys = [layer.keys for layer in fill.layers]
        values = [layer.values for layer in fill.layers]
        del fill
        key_grads = [torch.zeros_like(k) for k in keys]
        value_grads = [torch.zeros_like(v) for v in values]
        total = torch.zeros((), dtype=torch.float32, device=ids.device)
        for j in range(len(chunks) - 1, -1, -1):
            start, end = chunks[j]
            stop = min(end + 1, length)  # the next chunk's first token, as a label
            cache, leaves = _past_as_leaves(config, keys, values, start)
            chunk = {k: v[:, start:stop] for k, v in per_token.items()}
            chunk["input_ids"] = ids[:, start:stop]
            chunk["attention_mask"] = torch.ones_like(chunk["input_ids"])
            for key in _LOSS_FIELDS:
                if key in chunk:
                    chunk[key] = torch.cat([torch.zeros_like(chunk[key][:, :1]), chunk[key][:, 1:]], 1)
            with _pass_sync(model, sync, last=j == 0 and not extra):
                with _runs_on_cache(model, cache, start):
                    loss = micro_batch_loss(model, chunk, **loss_options)
                roots, grads = [loss], [torch.ones_like(loss)]
                if j < len(chunks) - 1:
                    for layer, k_grad, v_grad in zip(cache.layers, key_grads, value_grads):
                        own_keys, own_values = layer.output
                        roots += [own_keys[..., start:end, :], own_values[..., start:end, :]]
                        grads += [k_grad[..., start:end, :], v_grad[..., start:end, :]]
                pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
                if pairs:
                    torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
            for (k_leaf, v_leaf), k_grad, v_grad in zip(leaves, key_grads, value_grads):
                if k_leaf.grad is not None:
                    k_grad[..., :start, :] += k_leaf.grad
                if v_leaf.grad is not None:
                    v_grad[..., :start, :] += v_leaf.grad
            total += loss.detach().float()
            del cache, leaves, loss, roots, grads, pairs
    for j in range(extra):
        with _pass_sync(model, sync, last=j == extra - 1):
            _dummy_pass(model).backward()
    return total


def split_outputs(
    model: torch.nn.Module, batch: Any, chunk_tokens: int, *, over: int | None = None, **output_options: Any
) -> torch.Tensor:
    """Token-aligned outputs of a micro-batch, a lone sequence longer than ``chunk_tokens`` run in chunks; no gradients.

    What :func:`batchfit.train.micro_batch_outputs` returns (log-probs, or values with
    ``critic=True``), for the forward-only passes (old and reference log-probs, values) of a
    plan made with ``oversize="split"``: a micro-batch that holds one sequence of more than
    ``chunk_tokens`` tokens runs front to back in the chunks of
    :func:`batchfit.plan.packing.split_chunks`, each on a cache of the tokens before it (NOTE
    [ Over-long sequences run in chunks ]; the label token each pass also runs leaves the
    cache again); any other micro-batch runs whole. Run it under ``torch.no_grad()``.

    Args:
        model: as :func:`batchfit.train.micro_batch_outputs`; bare when a micro-batch splits.
        batch: a :class:`~batchfit.batches.MicroBatch` or its mapping.
        chunk_tokens: the most tokens a pass runs (the forward plan's ``split_tokens``).
        over: a lone sequence longer than this splits (the plan's ``token_budget``); default
            ``chunk_tokens``.
        **output_options: passed to :func:`batchfit.train.micro_batch_outputs`.

    Returns:
        ``[rows, W]`` fp32 at the batch's columns, equal to the unsplit outputs (fp32 rounding apart).

    Raises:
        BudgetError: as :func:`split_loss_backward` (a sharded model is refused when a
            micro-batch splits).
        BatchError, InvalidArgument: as :func:`batchfit.train.micro_batch_outputs`.
    """
    from transformers.cache_utils import DynamicCache

    from batchfit.train.micro_batch_step import micro_batch_outputs

    chunk_tokens = check_int("chunk_tokens", chunk_tokens, minimum=1)
    if _own_chunks(batch, chunk_tokens, over) == 1:
        return micro_batch_outputs(model, batch, **output_options)
    index = batch.indices[0] if isinstance(batch, MicroBatch) and batch.indices else None
    fields, ids = _sequence(batch)
    length = ids.shape[1]
    refusal = split_refusal(model, length, index)
    if refusal is not None:
        raise refusal
    per_token = _per_token_fields(fields, batch)
    out = torch.zeros(1, length, dtype=torch.float32, device=ids.device)
    cache = DynamicCache(config=_inner(model).config)
    with _layers_keep_cache(model):
        for start, end in split_chunks(length, chunk_tokens, index=index):
            stop = min(end + 1, length)  # the next chunk's first token, as a label
            chunk = {k: v[:, start:stop] for k, v in per_token.items()}
            chunk["input_ids"] = ids[:, start:stop]
            chunk["attention_mask"] = torch.ones_like(chunk["input_ids"])
            with _runs_on_cache(model, cache, start):
                values = micro_batch_outputs(model, chunk, **output_options)
            out[:, start + 1 : stop] = values[:, 1:].float()
            if stop > end:
                cache.crop(end - stop)  # the label token's KV belong to the next chunk
    mask = fields.get("attention_mask")
    if not isinstance(mask, torch.Tensor):
        return out
    first = int((mask[0] != 0).nonzero()[0])
    return torch.nn.functional.pad(out, (first, mask.shape[1] - first - length))


def _is_ddp(model: torch.nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _is_sharded(model: torch.nn.Module) -> bool:
    """DDP, FSDP1 or FSDP2: a model whose passes are collective rounds."""
    from batchfit.parallel.fsdp1 import is_fsdp1
    from batchfit.parallel.shard import is_fsdp

    return _is_ddp(model) or is_fsdp(model) or is_fsdp1(model)


def _syncs(model: torch.nn.Module) -> bool:
    """Whether this micro-batch's backward synchronises DDP's gradients (outside ``no_sync()``)."""
    return _is_ddp(model) and bool(getattr(model, "require_backward_grad_sync", True))


@contextlib.contextmanager
def _pass_sync(model: torch.nn.Module, sync: bool, *, last: bool) -> Iterator[None]:
    """One pass of a split micro-batch: DDP all-reduces only in the last pass of a synchronising micro-batch.

    NOTE [ Split passes in lockstep ]: every rank ends with the same pass, so the ranks run the
    same all-reduce; the earlier passes accumulate locally (``no_sync()``), as
    :func:`batchfit.train.accumulate` runs the micro-batches before the last.
    """
    if sync and not last:
        with model.no_sync():
            yield
    else:
        yield


def _dummy_pass(model: torch.nn.Module) -> torch.Tensor:
    """A pass of one token with a zero loss: the forward's (and, with gradients, the backward's) collectives, no gradient.

    NOTE [ Split passes in lockstep ]. Every parameter is in its graph (the loss is ``0 ×`` the
    sum of the outputs), so a synchronising DDP backward finds every gradient ready.
    """
    device = next(model.parameters()).device
    out = model(input_ids=torch.ones(1, 1, dtype=torch.long, device=device), use_cache=False)
    return out.logits.float().sum() * 0.0


def _sequence(batch: Any) -> tuple[Mapping[str, Any], torch.Tensor]:
    """The micro-batch's fields and its one sequence's valid tokens ``[1, L]``.

    Raises:
        BatchError: not one row, more than one packed sequence, or a padded row with holes.
    """
    fields = _fields(batch)
    ids = fields.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise BatchError(
            f"a micro-batch runs in chunks only when it holds one sequence (input_ids [1, L]), but got {shape}; "
            "plan with oversize='split', which puts each over-long sequence alone"
        )
    mask = fields.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        valid = (mask[0] != 0).nonzero().flatten()
        if valid.numel() == 0:
            raise BatchError("the micro-batch's row has no valid token in attention_mask")
        first, last = int(valid[0]), int(valid[-1]) + 1
        if last - first != valid.numel():
            raise BatchError(
                f"a row runs in chunks only when its valid tokens are one span, but attention_mask has "
                f"{valid.numel()} valid tokens over columns {first}..{last - 1}; run it with layout='packed'"
            )
        return fields, ids[:, first:last]
    cu = fields.get("cu_seq_lens")
    if isinstance(cu, torch.Tensor) and cu.numel() > 2:
        raise BatchError(
            f"a packed micro-batch runs in chunks only when it holds one sequence, but it packs {cu.numel() - 1}; "
            "plan with oversize='split', which puts each over-long sequence alone"
        )
    return fields, ids


def _per_token_fields(fields: Mapping[str, Any], batch: Any) -> dict[str, torch.Tensor]:
    """The row's loss fields, one column per valid token (response-width fields right-aligned with the sequence)."""
    ids = fields["input_ids"]
    width = ids.shape[1]
    mask = fields.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        valid = (mask[0] != 0).nonzero().flatten()
        first, last = int(valid[0]), int(valid[-1]) + 1
    else:
        first, last = 0, width
    out = {}
    for key, value in fields.items():
        if (
            key in _LAYOUT_FIELDS
            or not isinstance(value, torch.Tensor)
            or value.ndim < 2
            or value.shape[0] != 1
        ):
            continue
        if value.shape[1] > width:
            raise BatchError(
                f"{key} is {value.shape[1]} columns wide, wider than the sequence ({width}); response fields "
                "are right-aligned with the sequence (NOTE [ Sequence and response columns ])"
            )
        pad = [0, 0] * (value.ndim - 2) + [width - value.shape[1], 0]
        out[key] = torch.nn.functional.pad(value, pad)[:, first:last]
    return out


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    from batchfit.parallel.shard import unwrap

    return unwrap(model)


def _small_logits(model: torch.nn.Module) -> dict[str, Any]:
    """``logits_to_keep=1`` where the model takes it: the fill passes need the KV only."""
    params = inspect.signature(type(_inner(model)).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _past_as_leaves(
    config: Any, keys: list[torch.Tensor], values: list[torch.Tensor], start: int
) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A cache whose past (``[0, start)``, every layer) is leaves that collect its gradient."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    leaves = [
        (
            k[..., :start, :].detach().requires_grad_(start > 0),
            v[..., :start, :].detach().requires_grad_(start > 0),
        )
        for k, v in zip(keys, values)
    ]
    cache.layers = [_fixed_past(k, v) for k, v in leaves]
    return cache, leaves


@functools.cache
def _fixed_past_layer() -> type:
    from transformers.cache_utils import DynamicLayer

    class FixedPast(DynamicLayer):
        """A full-attention cache layer whose past never changes: ``update`` returns past + new.

        ``output`` keeps the first pass's ``(keys, values)`` (past and the chunk's own KV),
        the roots of the chunk's KV gradient. A replay (gradient checkpointing) reads the
        same past and leaves ``output`` alone.
        """

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values
            self.output: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out = (torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2))
            if self.output is None:
                self.output = out
            return out

    return FixedPast


def _fixed_past(keys: torch.Tensor, values: torch.Tensor) -> Any:
    """A ``FixedPast`` cache layer (the class is made on first use: transformers is imported only here)."""
    return _fixed_past_layer()(keys, values)


@contextlib.contextmanager
def _runs_on_cache(model: torch.nn.Module, cache: Any, start: int) -> Iterator[None]:
    """Inside the block, ``model(...)`` runs its tokens at positions ``start ..`` after ``cache``'s past.

    The model's ``forward`` is replaced on the instance for the block (its hooks and wrappers
    still run): the cache, ``use_cache=True``, the positions and the mask (:func:`_chunk_mask`).
    """
    if _is_ddp(model):  # DDP's own forward (its hooks and collectives) runs; the module inside gets the cache
        model = model.module
    from batchfit.parallel.shard import unwrap

    inner = unwrap(model)
    name = _cache_kwarg(inner) or "past_key_values"
    implementation = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    dtype = next(inner.parameters()).dtype
    had = "forward" in model.__dict__
    saved = model.__dict__.get("forward")
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        count = ids.shape[1]
        kwargs.update(
            {name: cache},
            use_cache=True,
            position_ids=torch.arange(start, start + count, device=ids.device)[None],
            attention_mask=_chunk_mask(implementation, start, count, dtype, ids.device),
        )
        return original(*args, **kwargs)

    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            model.forward = saved  # type: ignore[method-assign]
        else:
            del model.forward


def _cache_kwarg(model: torch.nn.Module) -> str | None:
    """The name ``model.forward`` takes its KV cache by: ``cache`` (transformers ≥ 5.24), ``past_key_values``, or ``None``."""
    params = inspect.signature(type(model).forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def _chunk_mask(
    implementation: str | None, start: int, count: int, dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """The attention mask of a chunk of ``count`` tokens after ``start`` past ones.

    The chunk's queries see the whole past and the chunk causally. ``eager`` and ``sdpa``
    (and batchfit's varlen attention, which runs sdpa when given a mask) get a ready 4-D
    float mask ``[1, 1, count, start + count]``, made once and read by every layer: given a
    2-D mask, transformers makes a boolean 4-D one and the CPU's sdpa keeps a float copy of it
    per layer for the backward (measured: 8 MiB per layer at 1,024 × 2,048). Other
    implementations (flash-attention: causal from the chunk's offset, no mask) and the first
    chunk (no past: causal, no mask) get the all-ones 2-D mask.
    """
    from batchfit.models.attention import VARLEN

    if start == 0 or implementation not in ("sdpa", "eager", VARLEN):
        return torch.ones(1, start + count, dtype=torch.long, device=device)
    rows = torch.arange(count, device=device)[:, None] + start
    hidden = torch.arange(start + count, device=device)[None, :] > rows
    return torch.zeros(1, 1, count, start + count, dtype=dtype, device=device).masked_fill(
        hidden, torch.finfo(dtype).min
    )


@contextlib.contextmanager
def _layers_keep_cache(model: torch.nn.Module) -> Iterator[None]:
    """Checkpointed decoder layers keep the cache inside the block (transformers drops it otherwise).

    ``GradientCheckpointingLayer`` drops ``past_key_values`` unless ``_can_checkpoint_with_cache``:
    a replay would update a cache twice. The fill passes run without gradients (no replay)
    and the gradient passes' cache does not change on update (:class:`FixedPast`), so the
    replay reads what the forward read. Restored on exit.
    """
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: layers keep their cache
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    saved = [
        (m, "_can_checkpoint_with_cache" in m.__dict__, m.__dict__.get("_can_checkpoint_with_cache"))
        for m in layers
    ]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m, had, value in saved:
            if had:
                m._can_checkpoint_with_cache = value
            else:
                del m._can_checkpoint_with_cache
