"""Step-wise GRPO batch: prompt-aligned mini-batches, DP padding and exact loss weights.

Each prompt has a different number of sequences (one per turn of each trajectory). The
optimizer-step count depends only on the prompt count; each mini-batch is padded for data
parallelism with cheap rows, and the loss weights make every rank's micro-batches add up to
the mini-batch's token mean.

Run: python examples/step_wise_minibatches.py
"""

from __future__ import annotations

import torch

from batchfit.batches.minibatch import (
    mini_batch_boundaries,
    pad_for_data_parallel,
    slice_batch,
    split_for_data_parallel,
)
from batchfit.batches.weights import loss_weights

torch.manual_seed(0)
prompts, dp_size, prompts_per_mini_batch, width = 8, 4, 4, 12
turns = torch.randint(1, 6, (prompts,)).tolist()  # sequences per prompt
uids = [p for p, t in enumerate(turns) for _ in range(t)]
lengths = torch.randint(2, width + 1, (len(uids),))
batch = {
    "input_ids": torch.randint(0, 100, (len(uids), width)),
    "attention_mask": (torch.arange(width) < lengths[:, None]).long(),
    "loss_mask": (torch.arange(width) < lengths[:, None]).float(),
    "uid": uids,
}

bounds = mini_batch_boundaries(batch["uid"], prompts_per_mini_batch)
print(f"{prompts} prompts with {turns} sequences -> {len(bounds)} optimizer steps: {bounds}")
for step, (start, end) in enumerate(bounds):
    mini = slice_batch(batch, start, end)
    mini["weights"] = loss_weights(mini["loss_mask"], reduction="token_mean")
    padded, n_pad = pad_for_data_parallel(mini, dp_size)
    shards = split_for_data_parallel(padded, dp_size)
    per_token_loss = [torch.rand(s["loss_mask"].shape) for s in shards]  # stand-in for the model's loss
    total = sum((loss * s["weights"]).sum() for loss, s in zip(per_token_loss, shards))
    whole = torch.cat(per_token_loss)[: end - start]
    reference = (whole * mini["loss_mask"]).sum() / mini["loss_mask"].sum()
    print(
        f"step {step}: {end - start} sequences + {n_pad} pad rows over {dp_size} ranks; "
        f"sum of rank losses {total:.6f} == mini-batch token mean {reference:.6f}"
    )
