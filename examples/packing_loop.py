"""A training loop with token-budget micro-batches and exact loss weights (runs on a CPU).

    python examples/packing_loop.py

Each mini-batch is planned under a token budget, run micro-batch by micro-batch, and the
gradient equals the one of the whole mini-batch because the loss weights are computed once
over the mini-batch (batchfit.batches.weights). Under DDP/FSDP, pass ``dp_size`` and this process'
``rank``, scale the loss by ``dp_size`` (DDP averages over ranks) and wrap all but the last
backward in ``model.no_sync()``: every rank runs the same number of micro-batches.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from batchfit.batches.microbatch import iter_micro_batches
from batchfit.batches.weights import loss_weights
from batchfit.plan.packing import plan_micro_batches

TOKEN_BUDGET = 256  # e.g. from batchfit's budget search; cost = rows × longest row ("padded")
DP_SIZE, RANK = 1, 0  # torch.distributed.get_world_size() / get_rank() under DDP


def rollouts(num_sequences: int, max_len: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Right-padded sequences: a 4-token prompt and a response of random length."""
    lengths = torch.randint(8, max_len + 1, (num_sequences,), generator=generator)
    columns = torch.arange(max_len)
    attention_mask = (columns < lengths[:, None]).long()
    return {
        "input_ids": torch.randint(1, 128, (num_sequences, max_len), generator=generator) * attention_mask,
        "attention_mask": attention_mask,
        "loss_mask": attention_mask * (columns >= 4),  # loss on response tokens only
    }


def per_token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """-log p(token t | tokens < t), aligned with column t (column 0 gets no loss)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(nll, (1, 0))


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = rollouts(num_sequences=32, max_len=64, generator=generator)
        # one weight per token over the whole mini-batch: any split gives the same gradient
        batch["weights"] = loss_weights(batch["loss_mask"], reduction="token_mean")
        plan = plan_micro_batches(batch["attention_mask"].sum(-1), TOKEN_BUDGET, dp_size=DP_SIZE)
        total = 0.0
        for mb in iter_micro_batches(batch, plan, RANK):  # trimmed to each micro-batch's longest row
            loss = (per_token_loss(model, mb.batch) * mb.batch["weights"]).sum() * DP_SIZE
            loss.backward()  # under DDP: `with model.no_sync()` unless mb is the last one
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        print(
            f"step {step}: loss {total:.4f}  micro-batches {plan.num_micro_batches} "
            f"(lower bound {plan.lower_bound})  utilization {plan.utilization:.2f}  "
            f"padding tokens {plan.padding_tokens}"
        )


if __name__ == "__main__":
    main()
