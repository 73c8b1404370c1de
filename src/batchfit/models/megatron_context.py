"""Megatron's context parallelism: ring attention over the context-parallel group, as Transformer Engine runs it.

NOTE [ Context parallelism as Megatron runs it ]
Under context parallelism (``context_parallel_size = c``) Megatron cuts every sequence into
``2c`` chunks and gives rank ``r`` of the context-parallel group chunks ``r`` and ``2c - 1 - r``
(``get_batch_on_this_cp_rank`` in Megatron-LM's ``megatron/training/utils.py``; the RoPE table
sliced the same way, ``get_pos_emb_on_this_cp_rank`` in megatron-core's
``models/common/embeddings/rope_utils.py``), so each rank's causal work is the same. Every layer
but attention runs on the rank's ``s / c`` tokens as without context parallelism; attention is
Transformer Engine's (``TEDotProductAttention``), whose default exchange (``cp_comm_type="p2p"``,
megatron-core's ``TransformerConfig``) is ``AttnFuncWithCPAndKVP2P`` in
``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``: the key and
value chunks go round the group in a ring, ``c`` steps, each step's fused attention of the local
queries against the chunks held now merged into the output by its log-sum-exp; the backward goes
round the ring again, recomputing each step from the saved output and log-sum-exp, the
key/value gradients travelling with their chunks back to their owner.

Transformer Engine does not run on a CPU, so :func:`ring_attention` is that algorithm written
with PyTorch's own fused attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, what ``scaled_dot_product_attention`` runs on a CPU; under fake tensors the
shapes of the same kernel) and ``torch.distributed``'s point-to-point operations over
Megatron's context-parallel group. At step ``i`` rank ``r`` holds the chunks of rank
``src = (r - i) mod c``, and by the load balancing:

- ``i = 0``: its own chunks, causal over both (the later chunk sees all of the earlier one);
- ``src < r``: every local query sees the first received chunk (``src``) and none of the second;
- ``src > r``: only the second local chunk's queries see anything, both received chunks whole.

What each layer keeps for the backward is what Transformer Engine keeps: the local query, key
and value, the output and a float32 log-sum-exp per query and head, ``O(s / c)``. What a step
holds beside them: the ring's buffers (key and value stacked into one contiguous tensor, as
Transformer Engine's ``p2p_comm_buffers``, one in flight beside the one in use),
each step's block output and log-sum-exp, and the output accumulated in float32 before its
cast (Transformer Engine corrects the output in the query's dtype, so this is on the safe side
by one float32 output per layer's attention, a transient). Not modelled: dropout inside
attention (refused: every preset has none), Transformer Engine's other exchanges (``a2a``,
``all_gather``, ``a2a+p2p``), packed (THD) rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _exchange(buffer: torch.Tensor, send_to: int, receive_from: int, group: Any) -> tuple[torch.Tensor, list[Any]]:
    """Post the ring's send of ``buffer`` to ``send_to`` and the receive of its like from ``receive_from``: the
    buffer that will hold it and the works to wait on (:func:`_wait`)."""
    received = torch.empty_like(buffer)
    ops = [dist.P2POp(dist.isend, buffer, send_to, group), dist.P2POp(dist.irecv, received, receive_from, group)]
    return received, dist.batch_isend_irecv(ops)


def _ring(group: Any) -> tuple[int, int, int, int]:
    """This rank's place in ``group``'s ring: (size, rank in the group, the global rank it sends to, the one it receives from)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    return size, rank, ranks[(rank + 1) % size], ranks[(rank - 1) % size]


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _blocks(step: int, rank: int, size: int, chunk: int) -> tuple[slice, slice, bool] | None:
    """The local queries and the held keys a ring step attends, and whether causally (NOTE [ Context parallelism as Megatron runs it ])."""
    everything = slice(None)
    if step == 0:
        return everything, everything, True
    src = (rank - step) % size
    if src < rank:
        return everything, slice(0, chunk), False
    return slice(chunk, None), everything, False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, group: Any) -> torch.Tensor:
        size, rank, send_to, receive_from = _ring(group)
        chunk = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        held = torch.stack((k, v))  # the ring's buffer: key and value in one contiguous tensor, as Transformer Engine's
        for step in range(size):
            works: list[Any] = []
            if step + 1 < size:
                incoming, works = _exchange(held, send_to, receive_from, group)
            queries, keys, causal = _blocks(step, rank, size, chunk)
            block_out, block_lse = _FLASH(
                q[:, :, queries], held[0][:, :, keys], held[1][:, :, keys], 0.0, causal, scale=scale
            )
            merged = torch.logaddexp(lse[:, :, queries], block_lse)
            out[:, :, queries] = out[:, :, queries] * torch.exp(lse[:, :, queries] - merged).unsqueeze(-1) + (
                block_out * torch.exp(block_lse - merged).unsqueeze(-1)
            )
            lse[:, :, queries] = merged
            del block_out, block_lse, merged
            _wait(works)
            if works:
                held = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        size, rank, send_to, receive_from = _ring(group)
        chunk = q.shape[2] // 2
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        held = torch.stack((k, v))
        dkv = torch.zeros(held.shape, dtype=torch.float32, device=k.device)
        for step in range(size):
            works: list[Any] = []
            if step + 1 < size:
                incoming, works = _exchange(held, send_to, receive_from, group)
            queries, keys, causal = _blocks(step, rank, size, chunk)
            gq, gk, gv = _FLASH_BACKWARD(
                grad_out[:, :, queries],
                q[:, :, queries],
                held[0][:, :, keys],
                held[1][:, :, keys],
                out[:, :, queries],
                lse[:, :, queries],
                0.0,
                causal,
                scale=ctx.scale,
            )
            dq[:, :, queries] += gq
            dkv[0][:, :, keys] += gk
            dkv[1][:, :, keys] += gv
            del gq, gk, gv
            _wait(works)
            # the key/value gradients travel on with their chunks: after the last step, home
            dkv, dkv_works = _exchange(dkv, send_to, receive_from, group)
            _wait(dkv_works)
            if works:
                held = incoming
        dkv = dkv.to(k.dtype)
        return dq.to(q.dtype), dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, group: Any) -> torch.Tensor:
    """Causal attention of this rank's two load-balanced chunks against the whole sequence over ``group`` (NOTE [ Context parallelism as Megatron runs it ]).

    ``q`` is ``[b, heads, s_local, d]``, ``k`` and ``v`` ``[b, groups, s_local, d]`` (grouped
    key/value heads dividing the query heads), ``s_local`` even: this rank's chunks ``r`` and
    ``2c - 1 - r`` of ``c`` ranks' sequence, in that order. Returns ``[b, heads, s_local, d]``,
    differentiable in ``q``, ``k`` and ``v``; every rank of ``group`` calls it in lockstep.
    """
    return _RingAttention.apply(q, k, v, float(scale), group)


__all__ = ["ring_attention"]
