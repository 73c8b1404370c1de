"""A packed micro-batch of a tiny fp32 model and its training step, for the sequence-parallel tests.

- :func:`tiny_config`: a small Llama or Qwen2 (4 query heads, 2 key/value heads: at sp=4 each
  kv head is repeated, NOTE [ What Ulysses cannot split ]).
- :func:`packed_micro_batch`: three rollouts packed into one row of 25 tokens (not a multiple
  of 2 or 4: the split pads), every field a PPO step reads.
- :func:`train_step`: the loss and every parameter's gradient of one micro-batch step.
"""

from __future__ import annotations

from typing import Any

import torch

from batchfit.batches import iter_micro_batches
from batchfit.plan.packing import plan_micro_batches

PROMPTS, RESPONSES = [3, 5, 4], [4, 7, 2]  # 7 + 12 + 6 = 25 tokens


def tiny_config(kind: str = "llama") -> Any:
    """A 2-layer fp32 config of ``kind`` (``"llama"`` or ``"qwen2"``) with grouped-query attention."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=128,
    )
    if kind == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    return LlamaConfig(**common, architectures=["LlamaForCausalLM"])


def build(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32).train()


def packed_micro_batch(model: torch.nn.Module) -> Any:
    """The three rollouts as one packed micro-batch (a ``MicroBatch``), old log-probs near the model's."""
    from rollout_helpers import rollouts

    batch = rollouts(model, PROMPTS, RESPONSES, seed=3)
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    plan = plan_micro_batches(lengths, sum(lengths), cost="packed")
    (mb,) = list(iter_micro_batches(batch, plan, layout="packed"))
    return mb


def train_step(model: torch.nn.Module, mb: Any, scale: float = 1.0, **options: Any) -> tuple[float, dict[str, Any]]:
    """``micro_batch_loss(model, mb, scale=scale, **options).backward()``: the loss and each parameter's whole gradient."""
    from batchfit.train import micro_batch_loss
    from sharded_helpers import full_gradients

    loss = micro_batch_loss(model, mb, scale=scale, **options)
    loss.backward()
    return float(loss.detach()) / scale, full_gradients(model)


def sequence_parallel_worker(rank: int, sp: int, kind: str, options: dict | None = None) -> tuple[float, dict[str, Any], int]:
    """One gloo rank: the tiny model under Ulysses over groups of ``sp`` and FSDP2 over the world, one step.

    Returns the loss, the whole gradients and the tokens the decoder's first layer ran on this rank.
    """
    import torch.distributed as dist

    from batchfit.models import use_ulysses_attention
    from batchfit.parallel import sequence_parallel_group
    from sharded_helpers import fully_shard_layers

    model = build(kind)
    mb = packed_micro_batch(model)
    use_ulysses_attention(model, sequence_parallel_group(sp))
    seen: list[int] = []
    model.model.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
    fully_shard_layers(model)
    # FSDP2 averages over dp × sp ranks; the group's ranks share one loss (NOTE [ Ulysses sequence parallelism ])
    loss, grads = train_step(model, mb, scale=dist.get_world_size(), **(options or {}))
    return loss, grads, seen[0]
