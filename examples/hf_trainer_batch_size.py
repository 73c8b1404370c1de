"""Size a Hugging Face Trainer's per-device batch sizes from memory, the same on every rank, then train.

    python examples/hf_trainer_batch_size.py                          # one process
    torchrun --nproc_per_node 2 examples/hf_trainer_batch_size.py     # 2 gloo ranks on a CPU
    torchrun --nproc_per_node 2 examples/hf_trainer_batch_size.py --memory 24MiB,32MiB   # ranks differ

A tiny Llama built from a config (random weights, nothing downloaded), rows of token ids with
labels, the Trainer's default collator. ``batchfit.integrations.hf_trainer.find_trainer_batch_sizes``
runs the Trainer's own kind of step at candidate sizes on the ``cpu`` backend (the live-tensor
tracker, against ``--memory``; use ``backend="cuda"`` on a GPU) and returns a copy of the
``TrainingArguments`` with ``per_device_train_batch_size`` and ``per_device_eval_batch_size`` set.
Each rank prints one line: ``rank R: per_device_train_batch_size=T per_device_eval_batch_size=E``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from batchfit.integrations.hf_trainer import find_trainer_batch_sizes

SEQ = 64


def rows(n: int, vocab: int) -> list[dict[str, list[int]]]:
    """``n`` rows of ``SEQ`` random token ids; the labels are the ids (the model shifts them)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, SEQ), generator=g).tolist()
    return [{"input_ids": r, "attention_mask": [1] * SEQ, "labels": r} for r in ids]


def build() -> tuple[LlamaForCausalLM, list[dict[str, list[int]]]]:
    """A tiny Llama from a config (random weights) and 64 rows for it."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config), rows(64, config.vocab_size)


def training_arguments(output_dir: str, steps: int) -> TrainingArguments:
    return TrainingArguments(output_dir=output_dir, use_cpu=True, max_steps=steps, learning_rate=1e-3, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


def size(model: LlamaForCausalLM, args: TrainingArguments, data: list, memory: str, fraction: float = 0.8):
    """Every rank calls it before building the Trainer: the train and eval sizes, the same on every rank."""
    return find_trainer_batch_sizes(model, args, data, include_eval=True, backend="cpu", memory_limit=memory,
                                    target_memory_fraction=fraction)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="32MiB", help="device memory, or one value per rank (comma-separated)")
    parser.add_argument("--fraction", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps the Trainer runs afterwards")
    flags = parser.parse_args()
    torch.set_num_threads(1)  # tiny model, shared cores: intra-op threads only contend
    model, data = build()
    rank = int(os.environ.get("RANK", "0"))
    memory = flags.memory.split(",")
    with tempfile.TemporaryDirectory() as out:
        sized = size(model, training_arguments(out, flags.steps), data, memory[rank % len(memory)], flags.fraction)
        trainer = Trainer(model=model, args=sized.args, train_dataset=data, eval_dataset=data[:16])
        trainer.train()
        loss = trainer.evaluate()["eval_loss"]
        sys.stdout.write(f"rank {rank}: per_device_train_batch_size={sized.args.per_device_train_batch_size} "
                         f"per_device_eval_batch_size={sized.args.per_device_eval_batch_size} "
                         f"peak={sized.train.peak_bytes} target={sized.train.target_bytes} "
                         f"trials={len(sized.train.trials)} trained_steps={trainer.state.global_step} "
                         f"eval_loss={loss:.3f}\n")  # one write: the ranks share the pipe
        sys.stdout.flush()


if __name__ == "__main__":
    main()
