"""A tiny causal LM and its data: tests/test_microbatch.py and its 2-rank gloo workers, and every test file
that needs a tiny model (:func:`tiny_lm`, :func:`tiny_config`).

Importable by spawned processes (torch.multiprocessing pickles ``ddp_worker`` by reference,
and the children inherit ``sys.path``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from batchfit.batches.microbatch import iter_micro_batches
from batchfit.batches.weights import loss_weights
from batchfit.parallel.distributed import sync_micro_batch_count
from batchfit.plan.packing import plan_micro_batches

SEQ_LEN = 16
PROMPT_LEN = 2


def tiny_model() -> torch.nn.Module:
    """A 2-layer Llama in float64 with eager attention, the same weights on every call."""
    return tiny_lm("llama", "eager").double()


def tiny_config(kind: str = "llama", **overrides):
    """The config of :func:`tiny_lm`: 2 layers, hidden 32, 4 heads over 2 KV heads, vocabulary 64; ``overrides`` on top."""
    from transformers import Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind]
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return config_cls(**{**sizes, **overrides})


def tiny_lm(kind: str = "llama", attn: str = "sdpa") -> torch.nn.Module:
    """A 2-layer Llama or Qwen2 in float32 (grouped-query attention), the same weights on every call."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = tiny_config(kind)
    config._attn_implementation = attn
    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[kind](config)


def make_batch(num_sequences: int = 8, seed: int = 1, reduction: str = "token_mean") -> dict:
    """Right-padded random sequences of 3..SEQ_LEN tokens; loss on all tokens after the prompt.

    ``weights`` are :func:`loss_weights` of the loss mask over the whole mini-batch, aligned
    with the token each position predicts (column t weighs -log p(x_t | x_<t)).
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, SEQ_LEN + 1, (num_sequences,), generator=g)
    columns = torch.arange(SEQ_LEN)
    attention_mask = (columns[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(1, 64, (num_sequences, SEQ_LEN), generator=g) * attention_mask
    loss_mask = attention_mask * (columns[None, :] >= PROMPT_LEN)
    weights = loss_weights(loss_mask, reduction=reduction, dtype=torch.float64)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "weights": weights,
    }


def weighted_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """``Σ per_token_loss × weights`` with per_token_loss = -log p(token) from the logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    per_token = -logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (per_token * batch["weights"][:, 1:]).sum()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Largest ``‖got − expected‖ / ‖expected‖`` over the parameters (keys must match)."""
    assert got.keys() == expected.keys()
    return max(float((got[n] - expected[n]).norm() / expected[n].norm()) for n in expected)


def whole_batch_grads(batch: dict) -> dict[str, torch.Tensor]:
    model = tiny_model()
    weighted_loss(model, batch).backward()
    return grads(model)


def ddp_worker(
    rank: int, world_size: int, init_file: str, out_dir: str, costs: tuple[str, ...], budget: int
) -> None:
    """One rank: for each cost, run its share of the plan under DDP; save gradients and a count check."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        batch = make_batch()
        result: dict = {}
        for cost in costs:
            model = torch.nn.parallel.DistributedDataParallel(tiny_model())
            plan = plan_micro_batches(batch["attention_mask"].sum(-1), budget, dp_size=world_size, cost=cost)
            micro_batches = list(iter_micro_batches(batch, plan, rank))
            for mb in micro_batches:
                last = mb.position == plan.num_micro_batches - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    # DDP averages gradients over ranks: × world_size turns the average into the sum
                    (weighted_loss(model, mb.batch) * world_size).backward()
            result[cost] = {"grads": grads(model.module), "steps": len(micro_batches)}
        # per-rank planning: rank r has 2·(r+1) sequences of one full budget each
        synced = sync_micro_batch_count(plan_micro_batches([budget] * (2 * (rank + 1)), budget))
        result["synced"] = synced.num_micro_batches
        result["padding"] = synced.num_padding_micro_batches
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def fewest_groups(n: int, fits) -> int:
    """Fewest groups of ``range(n)`` each satisfying ``fits(group)``, by trying every set partition (tiny ``n`` only)."""
    import functools

    @functools.cache
    def best(remaining: frozenset) -> int:
        if not remaining:
            return 0
        first = min(remaining)
        rest = sorted(remaining - {first})
        result = n + 1
        for mask in range(1 << len(rest)):
            group = [first] + [rest[b] for b in range(len(rest)) if mask >> b & 1]
            if fits(group):
                result = min(result, 1 + best(remaining - set(group)))
        return result

    return best(frozenset(range(n)))
