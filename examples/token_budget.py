"""Find the token budget of a policy and a critic with the library API (no GPU needed).

    python examples/token_budget.py

Estimates the tiny preset for an 8 GiB device (fake tensors: nothing is allocated), prints
each role's budget and the one both can share, and uses it to size micro-batches.
"""

from batchfit.budget import TokenBudget, find_token_budget
from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.memory import format_bytes, get_backend
from batchfit.models import build_causal_lm

backend = get_backend("estimate", memory_limit="8GiB")  # less the untracked reserve (CUDA context, cuBLAS workspaces)
budgets = []
for role in ("policy", "critic"):
    model = build_causal_lm("tiny", backend=backend, dtype="bf16", value_head=role == "critic")
    step = causal_lm_step(model, backend=backend)  # forward + backward + AdamW step
    budget = find_token_budget(step, max_seq_len=2048, safety_margin=0.9, progress=False, role=role)
    budgets.append(budget)
    print(
        f"{role}: C = {budget.tokens:,} tokens in {budget.probes} probes, limit {format_bytes(budget.limit_bytes)}"
    )
    for p in budget.points:
        print(f"  seq {p.seq_len:5d}: {p.max_batch_size:5d} sequences fit, peak {format_bytes(p.peak_bytes)}")

shared = TokenBudget.min(*budgets)
print(f"shared budget: {shared.tokens:,} tokens (set by {shared.binding_role})")
print(f"sequences of 700 tokens per micro-batch: {shared.max_batch_size(700)}")
print(f"does a micro-batch of 16 × 2048 fit? {shared.fits(16, 2048)}")
