"""TRL's GRPO with batchfit's token-budget micro-batches: packed, no padding, TRL's own loss and gradient (CPU).

    python examples/trl_grpo_packed.py
    torchrun --standalone --nproc-per-node 2 examples/trl_grpo_packed.py

Needs TRL (``pip install -c constraints-cpu.txt -e '.[trl]'`` in batchfit's checkout). The same tiny Llama, tokenizer and reward as
``examples/trl_grpo.py``; the policy's budget is measured *packed* (the sum of a micro-batch's
tokens) with TRL's own head, ``token_budget_grpo_config`` gives TRL one micro-batch per optimizer
step, and :class:`~batchfit.integrations.trl_packed.TokenBudgetGRPOTrainer` runs each step's rows
as packed micro-batches under the budget. batchfit's tracker measures every packed micro-batch's
forward and backward; rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl import GRPOConfig
from trl_grpo import (
    GENERATION_BATCH_SIZE,
    MAX_COMPLETION_LENGTH,
    MAX_PROMPT_LENGTH,
    MEMORY_LIMIT,
    NUM_GENERATIONS,
    PROMPTS,
    char_tokenizer,
    count_a,
    tiny_llama,
)

from batchfit.budget import profile_model
from batchfit.integrations.trl import token_budget_grpo_config
from batchfit.integrations.trl_packed import TokenBudgetGRPOTrainer
from batchfit.parallel import Sharding
from batchfit.parallel.process_exit import exit_after_collectives
from batchfit.train.measure import PeakTracker


class MeasuredTokenBudgetTrainer(TokenBudgetGRPOTrainer):
    """Each packed micro-batch's forward and backward measured by batchfit's tracker."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.micro_batch_peaks: list[int] = []

    def _micro_batch_backward(self, model, mb, *, sync):
        with PeakTracker(model, self.optimizer, host=mb.batch) as tracker:
            super()._micro_batch_backward(model, mb, sync=sync)
            self.micro_batch_peaks.append(tracker.take())


def main(output_dir: str, max_steps: int = 3) -> dict[str, Any]:
    """Profile (packed), configure, train; the result as plain values."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer))
    profile = profile_model(
        model,
        max_seq_len=MAX_PROMPT_LENGTH + MAX_COMPLETION_LENGTH,
        backend="cpu",
        memory_limit=MEMORY_LIMIT,
        dtype="fp32",
        gradient_checkpointing=GRPOConfig.gradient_checkpointing,
        logprobs="trl",
        cost="packed",  # a micro-batch costs the sum of its sequences' tokens: no padding
        sharding=Sharding("ddp", world_size=world) if world > 1 else Sharding(),
    )
    args = token_budget_grpo_config(
        generation_batch_size=GENERATION_BATCH_SIZE,
        output_dir=output_dir,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        max_steps=max_steps,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = MeasuredTokenBudgetTrainer(
        model=model,
        reward_funcs=count_a,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
        token_budget=profile,
    )
    trainer.train()
    budget = profile.combined
    return {
        "rank": args.process_index,
        "world_size": args.world_size,
        "token_budget": budget.tokens,
        "limit_bytes": budget.limit_bytes,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "optimizer_steps": trainer.state.global_step,
        "model_wrapper": type(trainer.model_wrapped).__name__,
        "micro_batches": trainer.micro_batches,
        "micro_batch_peaks": trainer.micro_batch_peaks,
    }


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="batchfit-trl-") as folder:
        result = main(folder, max_steps=int(sys.argv[1]) if len(sys.argv) > 1 else 3)  # optimizer steps
    joined = dist.is_initialized()
    if joined:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
    else:
        gathered = [result]
    if result["rank"] == 0:
        print(json.dumps({"ranks": gathered}))
    if joined:  # gloo's worker may still be letting go of the gather: exit without finalizing
        exit_after_collectives(0)  # (NOTE [ A collective's worker outlives the interpreter ])
