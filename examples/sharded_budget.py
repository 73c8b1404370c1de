"""Per-rank token budgets of a sharded 7B policy and its reference model, without a GPU.

    python examples/sharded_budget.py            # about a minute on 2 CPU cores

Qwen2.5-7B at 8192 tokens on 8 × h100-80gb: PyTorch's FSDP2 (``fully_shard`` per layer and
root, fp32 master weights, bf16 compute) runs on 8 simulated ranks and fake tensors. Prints
each role's budget, the per-rank breakdown at the budget's peak, and how the budget moves with
the number of ranks and with fused log-probs.
"""

from batchfit import Sharding, profile_model
from batchfit.memory import format_bytes

for world, logprobs in ((8, "full"), (16, "full"), (8, "fused")):
    profile = profile_model(
        "qwen2.5-7b",
        max_seq_len=8192,
        backend="estimate",
        memory_limit="h100-80gb",
        sharding=Sharding("fsdp2", world_size=world),
        gradient_checkpointing=True,
        logprobs=logprobs,
        roles="policy,reference",
    )
    print(f"\nfsdp2 over {world} ranks, {logprobs} log-probs:")
    for role, budget in profile.budgets.items():
        print(f"  {role:9s} C = {budget.tokens:7,} tokens per rank")
    policy = profile.budgets["policy"]
    for category, nbytes in policy.breakdown.items():
        print(f"    policy {category:20s} {format_bytes(nbytes):>12s}")
