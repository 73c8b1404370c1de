"""Per-GPU token budgets of Megatron layouts (issue 42's figures): the binding stage, the head's share, the time.

Each row profiles one layout with batchfit's Megatron probe (Megatron-core's GPTModel under fake tensors,
its own DistributedDataParallel and optimizer, sdpa attention as Transformer Engine's fused kernel keeps
it, full recomputation as the frameworks' scripts set it; NOTE [ Fused attention for Megatron budgets ])
on H100 80GB, and prints beside it:

- the weights-and-optimizer bytes of Megatron-Bridge's own formula
  (``compute_weight_and_optimizer_memory`` in ``megatron/bridge/training/utils/theoretical_memory_utils.py``),
  when ``--bridge DIR`` points at an unpacked megatron-bridge wheel (``pip download --no-deps megatron-bridge``;
  its module is loaded with its two imports stubbed: Transformer Engine does not install here);
- the value the framework's shipped script sets by hand, where one ships this layout (slime's
  ``scripts/run-llama3.1-8B.sh``, ``scripts/run-qwen3-32B.sh``; verl's
  ``examples/grpo_trainer/run_qwen2_5-7b_math_megatron.sh``).

    python benchmarks/megatron_budgets.py                 # every row (minutes: a 70B model under fake tensors)
    python benchmarks/megatron_budgets.py --only qwen3-8b  # the rows of one model
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from pathlib import Path

from batchfit.budget.model_profile import profile_model
from batchfit.memory import format_bytes
from batchfit.parallel.sharding import Sharding

# model, tp, pp, GPUs, max_seq_len, what a shipped script sets for this layout (or None)
ROWS = [
    ("llama-3.1-8b", 2, 1, 4, 2048, "slime run-llama3.1-8B.sh: --max-tokens-per-gpu 9216 (TP 2, SP, 4 GPUs)"),
    ("qwen3-8b", 2, 1, 8, 32768, None),
    ("qwen2.5-7b", 4, 2, 16, 2048, "verl run_qwen2_5-7b_math_megatron.sh: ppo_micro_batch_size_per_gpu=4 × 2,048 = "
     "8,192 tokens (TP 4, PP 2 with VPP 2, 16 GPUs)"),
    ("qwen3-32b", 8, 1, 8, 8192, "slime run-qwen3-32B.sh: --max-tokens-per-gpu 20480 (TP 8, SP, 8 GPUs; CPU-offloaded optimizer)"),
    ("qwen2.5-32b", 4, 2, 16, 8192, None),
    ("qwen2.5-32b", 4, 2, 16, 32768, None),
    ("llama-3.1-70b", 8, 2, 32, 8192, None),
    ("llama-3.1-70b", 8, 2, 32, 32768, None),
]


def bridge_weights_and_optimizer(bridge: Path, model: str, tp: int, pp: int, dp: int) -> float:
    """Megatron-Bridge's ``compute_weight_and_optimizer_memory`` for this layout (bytes), run from its own source."""
    import torch.nn.functional as F

    from batchfit.models import load_config
    from batchfit.models.megatron import transformer_config

    for name in ("megatron.bridge.training.config", "megatron.bridge.utils.vocab_utils"):
        stub = types.ModuleType(name)
        stub.ConfigContainer = object
        stub.calculate_padded_vocab_size = lambda *a, **k: None
        sys.modules.setdefault(name, stub)
    path = bridge / "megatron" / "bridge" / "training" / "utils" / "theoretical_memory_utils.py"
    spec = importlib.util.spec_from_file_location("bridge_theoretical_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    hf = load_config(model)
    cfg = transformer_config(model, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=tp > 1)
    m = types.SimpleNamespace(
        kv_channels=cfg.kv_channels, num_attention_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size,
        num_query_groups=cfg.num_query_groups, num_moe_experts=None, gated_linear_unit=cfg.gated_linear_unit,
        activation_func=F.silu if cfg.activation_func is F.silu else cfg.activation_func, num_layers=cfg.num_layers,
        ffn_hidden_size=cfg.ffn_hidden_size, share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, should_pad_vocab=False,
        vocab_size=hf.vocab_size,
    )
    config = types.SimpleNamespace(model=m, optimizer=types.SimpleNamespace(use_distributed_optimizer=True),
                                   data_parallel_size=dp)
    return module.compute_weight_and_optimizer_memory(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="profile the rows of this preset only (repeatable)")
    parser.add_argument("--bridge", type=Path, help="an unpacked megatron-bridge wheel (for its weights formula)")
    parser.add_argument("--memory", default="h100-80gb")
    args = parser.parse_args()
    print("| model | TP × PP × DP (GPUs) | max_seq_len | budget per GPU | binding stage | head's share | "
          "state per GPU (batchfit) | Megatron-Bridge weights+optimizer | shipped | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, tp, pp, gpus, seq, shipped in ROWS:
        if args.only and model not in args.only:
            continue
        dp = gpus // (tp * pp)
        sharding = Sharding("megatron", world_size=gpus, tensor_parallel=tp, pipeline_parallel=pp,
                            megatron_sequence_parallel=tp > 1, distributed_optimizer=True)
        start = time.perf_counter()
        try:
            p = profile_model(model, max_seq_len=seq, seq_lens=[seq], backend="estimate", memory_limit=args.memory,
                              sharding=sharding, gradient_checkpointing=True, cost="packed")
        except Exception as exc:  # a row that does not fit says so and the table goes on
            print(f"| {model} | {tp} × {pp} × {dp} ({gpus}) | {seq:,} | {type(exc).__name__}: {str(exc)[:120]} | | | | | | |")
            continue
        wall = time.perf_counter() - start
        budget = p.budgets["policy"]
        point = budget.points[0]  # the one probed length, max_seq_len
        breakdown = point.breakdown
        peak = point.peak_bytes
        head = breakdown.get("logprob_head", 0)
        state = sum(breakdown.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
        theirs = "" if args.bridge is None else format_bytes(int(bridge_weights_and_optimizer(args.bridge, model, tp, pp, dp)))
        stages = ", ".join(f"{s}: {format_bytes(b)}" for s, b in sorted(p.megatron.stage_peaks.items()))
        print(f"| {model} | {tp} × {pp} × {dp} ({gpus}) | {seq:,} | {p.combined.tokens:,} | "
              f"{p.megatron.binding_stage} ({stages}) | {head / peak:.1%} | {format_bytes(state)} | {theirs} | "
              f"{shipped or ''} | {wall:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
