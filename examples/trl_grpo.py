"""TRL's GRPOTrainer sized by batchfit, trained on a CPU: every micro-batch's peak within its limit.

    python examples/trl_grpo.py
    torchrun --standalone --nproc-per-node 2 examples/trl_grpo.py     # 2 gloo ranks, DDP
    python examples/trl_grpo.py --logprobs full --memory 6MiB          # probed with another head: TRL overshoots

Needs TRL (``pip install -c constraints-cpu.txt -e '.[trl]'`` in batchfit's checkout). A tiny Llama and a character tokenizer are built
here (nothing is downloaded). batchfit measures the policy's token budget with its ``cpu``
backend (real steps under its tracker) at a memory limit, :func:`batchfit.integrations.trl.grpo_config`
turns it into TRL's ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and
``steps_per_generation``, and a real ``GRPOTrainer.train()`` runs a few steps while batchfit's
tracker measures each micro-batch (forward and backward, after TRL's generation). Rank 0 prints
one JSON line: the sizes, the limit and every measured peak.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from batchfit.budget import profile_model
from batchfit.integrations.trl import grpo_config
from batchfit.parallel import Sharding
from batchfit.parallel.process_exit import exit_after_collectives
from batchfit.train.measure import PeakTracker

MAX_PROMPT_LENGTH = 8  # the prompts below are at most 8 characters, one token each
MAX_COMPLETION_LENGTH = 24
NUM_GENERATIONS = 4
GENERATION_BATCH_SIZE = 32  # sequences generated at once over all ranks: 8 prompts × 4 completions
MEMORY_LIMIT = "40MiB"  # per rank: TRL's head holds 32768 fp32 columns per token, so a few rows of 32 tokens fit
PROMPTS = ["abc", "hello", "xy z", "the cat", "grpo", "a b c", "tokens", "budget"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, built locally (TRL accepts any fast tokenizer with a pad token)."""
    chars = "abcdefghijklmnopqrstuvwxyz "
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def count_a(completions: list[str], **_: Any) -> list[float]:
    """A reward: how many ``a`` a completion has."""
    return [float(c.count("a")) for c in completions]


class MeasuredGRPOTrainer(GRPOTrainer):
    """TRL's trainer, each micro-batch's forward and backward measured by batchfit's tracker.

    TRL generates inside ``training_step`` (``_prepare_inputs``, once per generation batch);
    that happens first, outside the measurement, and the measured step gets the prepared
    micro-batch. The model, the optimizer (its state exists from the first optimizer step on)
    and the gradients accumulated so far are registered as held memory; the rollout batch as
    host memory.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.micro_batch_peaks: list[int] = []
        self.micro_batch_rows: list[int] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = self._prepare_inputs(inputs)  # TRL's generation and split, outside the measured step
        self._prepare_inputs = lambda prepared: prepared  # Trainer.training_step prepares again: a no-op now
        try:
            with PeakTracker(model, self.optimizer, host=inputs) as tracker:
                loss = super().training_step(model, inputs, num_items_in_batch)
                self.micro_batch_peaks.append(tracker.take())
        finally:
            del self._prepare_inputs
        self.micro_batch_rows.append(int(inputs["completion_ids"].shape[0]))
        return loss


def main(output_dir: str, max_steps: int = 3, logprobs: str = "trl", memory: str = MEMORY_LIMIT) -> dict[str, Any]:
    """Profile, size, train; the result as plain values (the same on every rank but the peaks).

    ``logprobs`` is the head the budget is probed with (TRL's own by default), ``memory`` the limit per rank.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # the budget is measured on the real ranks, before TRL builds anything
    tokenizer = char_tokenizer()
    model = tiny_llama(len(tokenizer))
    checkpointing = GRPOConfig.gradient_checkpointing  # TRL's default (True): the probe runs it too
    profile = profile_model(
        model,
        max_seq_len=MAX_PROMPT_LENGTH + MAX_COMPLETION_LENGTH,
        backend="cpu",
        memory_limit=memory,
        dtype="fp32",
        gradient_checkpointing=checkpointing,
        logprobs=logprobs,  # TRL's own log-prob kernel in the probe (its 32768-column buffer binds here)
        sharding=Sharding("ddp", world_size=world) if world > 1 else Sharding(),
    )
    args = grpo_config(
        profile,
        model=model,  # the generation phase's KV cache is counted from its config
        max_prompt_length=MAX_PROMPT_LENGTH,
        generation_batch_size=GENERATION_BATCH_SIZE,
        output_dir=output_dir,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        max_steps=max_steps,
        bf16=False,  # fp32, as profiled
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    trainer = MeasuredGRPOTrainer(
        model=model,
        reward_funcs=count_a,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
        processing_class=tokenizer,
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
        "steps_per_generation": args.steps_per_generation,
        "generation_batch_size": args.generation_batch_size,
        "optimizer_steps": trainer.state.global_step,
        "model_wrapper": type(trainer.model_wrapped).__name__,
        "micro_batch_rows": trainer.micro_batch_rows,
        "micro_batch_peaks": trainer.micro_batch_peaks,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (3)")
    parser.add_argument("--logprobs", default="trl", help="the head the budget is probed with (trl)")
    parser.add_argument("--memory", default=MEMORY_LIMIT, help=f"memory limit per rank ({MEMORY_LIMIT})")
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchfit-trl-") as folder:
        result = main(folder, max_steps=cli.steps, logprobs=cli.logprobs, memory=cli.memory)
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
