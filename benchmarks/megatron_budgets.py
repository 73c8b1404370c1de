"""Per-GPU token budgets of Megatron layouts (issue 42's figures): the binding stage, the head's share, the time.

Each row profiles one layout with batchfit's Megatron probe (Megatron-core's GPTModel under fake tensors,
its own DistributedDataParallel and optimizer, sdpa attention as Transformer Engine's fused kernel keeps
it, full recomputation as the frameworks' scripts set it; NOTE [ Fused attention for Megatron budgets ])
on H100 80GB, and prints beside it:

- the weights-and-optimizer bytes of Megatron-Bridge's own formula
  (``compute_weight_and_optimizer_memory`` in ``megatron/bridge/training/utils/theoretical_memory_utils.py``),
  when ``--bridge DIR`` points at an unpacked megatron-bridge wheel (``pip download --no-deps megatron-bridge``;
  its module is loaded with its two imports stubbed: Transformer Engine does not install here);
- the weights-and-optimizer and activation bytes of Megatron-LM's own formula
  (``megatron/training/theoretical_memory_usage.py``: ``compute_weight_and_optimizer_memory``,
  ``report_theoretical_memory``, ``compute_activation_memory``), when ``--megatron-lm FILE`` points at that file
  (``git show <commit>:megatron/training/theoretical_memory_usage.py`` from Megatron-LM; it is in no wheel). It is
  loaded standalone, its one relative import (``.utils``: ``is_hybrid_model``, ``print_rank_0``) stubbed, and fed an
  ``args`` namespace set as Megatron-LM's arguments would be for the row (:func:`megatron_lm_args`);
  ``--per-layer`` prints one layer's activations beside its formula instead (NOTE [ Megatron-LM's formula beside
  the probe ]);
- the value the framework's shipped script sets by hand, where one ships this layout (slime's
  ``scripts/run-llama3.1-8B.sh``, ``scripts/run-qwen3-32B.sh``; verl's
  ``examples/grpo_trainer/run_qwen2_5-7b_math_megatron.sh``).

    python benchmarks/megatron_budgets.py                 # every row (minutes: a 70B model under fake tensors)
    python benchmarks/megatron_budgets.py --only qwen3-8b  # the rows of one model
    python benchmarks/megatron_budgets.py --megatron-lm /tmp/mlm/theoretical_memory_usage.py --per-layer

NOTE [ Megatron-LM's formula beside the probe ]
Megatron-LM's ``report_theoretical_memory`` picks its activation formula from the arguments: with
``--sequence-parallel`` and ``--recompute-granularity selective`` it runs ``compute_activation_memory``
(Korthikanti et al.'s ``sbh·34/t`` row generalised to ``sbh(18 + 4f/h)/t`` per layer, the first stage's
``pp`` micro-batches in flight, an interleaving factor, the head only at ``pp == 1``); with anything else,
full recompute included, ``compute_activation_memory_without_sp`` (``sbh(10 + 24/t)`` per layer, the
logits at 2 bytes, times 1.05). Neither models full recompute, which these rows run (what slime's and
verl's scripts set): the probe keeps each layer's input, ``2sbh/t`` under SP, exactly Korthikanti's
full-recompute row, where the formula Megatron-LM reports counts ``sbh(10 + 24/t)``. Neither counts the
fp32 ``[s, b, V/t]`` logits and cross-entropy temporaries of a last stage at ``pp > 1``. Under the
selective branch's own assumptions (no recompute, no ``[s, s]`` scores: sdpa, or the local attention under
``recompute_granularity="selective"``), ``--per-layer`` measures one layer as the difference of two depths
and runs Megatron-LM's function at ``L + 1`` and ``L`` layers for its own per-layer term: its ``4f/h``
MLP term is GeLU's (an ``f``-wide fc1 output and the GeLU output), where a SwiGLU MLP's fc1 is ``2f``
wide and saves its output, the SiLU output and their product.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import sys
import time
import types
import warnings
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


def load_megatron_lm(path: Path) -> types.ModuleType:
    """Megatron-LM's ``theoretical_memory_usage.py`` loaded from ``path`` as it is, its ``.utils`` import stubbed."""
    package = "megatron_lm_training"
    if package not in sys.modules:
        pkg = types.ModuleType(package)
        pkg.__path__ = []  # a package, so the file's ``from .utils import ...`` resolves
        utils = types.ModuleType(f"{package}.utils")
        utils.is_hybrid_model = lambda args: args.hybrid_layer_pattern is not None  # Megatron-LM's own test
        utils.print_rank_0 = lambda message: None
        sys.modules[package], sys.modules[f"{package}.utils"] = pkg, utils
    spec = importlib.util.spec_from_file_location(f"{package}.theoretical_memory_usage", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_lm_args(model: str, tp: int, pp: int, gpus: int, seq: int, micro_batch_size: int, *,
                     recompute: str | None = "full", num_layers: int | None = None) -> types.SimpleNamespace:
    """The ``args`` Megatron-LM's arguments give for this row: the model as mbridge converts it, the layout, the micro-batch.

    The model fields are read from the ``TransformerConfig`` batchfit builds (mbridge's conversion of the
    Hugging Face config); ``padded_vocab_size`` is the vocabulary as built (no padding, as verl calls mbridge;
    Megatron-LM's ``--make-vocab-size-divisible-by 128`` would pad it to a multiple of ``128 × tp``). The layout
    is the rows': SP over TP, the distributed optimizer, ``--recompute-granularity full``.
    """
    from batchfit.models import load_config
    from batchfit.models.megatron import transformer_config

    hf = load_config(model)
    cfg = transformer_config(model, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=tp > 1)
    return types.SimpleNamespace(
        num_layers=cfg.num_layers if num_layers is None else num_layers, hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        swiglu=bool(cfg.gated_linear_unit), normalization=cfg.normalization, add_bias_linear=cfg.add_bias_linear,
        untie_embeddings_and_output_weights=not hf.tie_word_embeddings, padded_vocab_size=hf.vocab_size,
        multi_latent_attention=False, num_experts=None, moe_layer_freq=1, moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None, moe_router_topk=2, moe_latent_size=None, mtp_num_layers=None,
        hybrid_layer_pattern=None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        expert_tensor_parallel_size=tp, expert_model_parallel_size=1, world_size=gpus,
        data_parallel_size=gpus // (tp * pp), use_distributed_optimizer=True, sequence_parallel=tp > 1,
        recompute_granularity=recompute, seq_length=seq, micro_batch_size=micro_batch_size,
    )


def megatron_lm_figures(module: types.ModuleType, args: types.SimpleNamespace, num_microbatches: int) -> dict[str, float]:
    """Bytes by Megatron-LM's functions: weights+optimizer, the activations ``report_theoretical_memory`` reports, the SP+selective ones."""
    mb = module.NUM_BYTES_IN_MEGABYTE
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its own line; the table is this script's output
        weights, reported, _ = module.report_theoretical_memory(args, num_microbatches=num_microbatches)
    return {
        "weights_and_optimizer": weights * mb,
        "activations_reported": reported * mb,
        "activations_selective_sp": module.compute_activation_memory(args, num_microbatches=num_microbatches),
    }


def per_layer_rows(module: types.ModuleType, model: str, tp: int, seq: int) -> list[str]:
    """One layer's activations per rank: the probe (3 layers minus 2) beside Megatron-LM's functions (``L + 1`` minus ``L``)."""
    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")  # Megatron-core's CPU warnings (Transformer Engine and Apex missing)
    full = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    cases = [("none, sdpa (fused)", "sdpa", {}), ("selective, local attention", "local", {"recompute_granularity": "selective"}),
             ("full, sdpa", "sdpa", full)]
    lm = {}
    for name, fn in (("selective_sp", module.compute_activation_memory), ("without_sp", module.compute_activation_memory_without_sp)):
        two = [fn(megatron_lm_args(model, tp, 1, tp, seq, 1, num_layers=n), num_microbatches=1) for n in (2, 3)]
        lm[name] = two[1] - two[0]
    out = []
    for label, attention, overrides in cases:
        got = {}
        for layers in (2, 3):
            step = MegatronStep(model, tensor_parallel=tp, sequence_parallel=tp > 1, dtype=torch.bfloat16, attention=attention,
                                backend=get_backend("estimate", reserve_bytes=0, round_to=1), num_layers=layers, **overrides)
            m = step.measure([seq])
            at = m.phase_breakdowns.get("forward:head") or m.breakdown
            got[layers] = sum(at.get(c, 0) for c in ("activations", "gathered_parameters", "communication"))
        probe = got[3] - got[2]
        out.append(f"| {model} | TP {tp}, SP | {seq:,} × 1 | {label} | {probe:,} | {lm['selective_sp']:,.0f} "
                   f"({probe / lm['selective_sp']:.2f}×) | {lm['without_sp']:,.0f} ({probe / lm['without_sp']:.2f}×) |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="profile the rows of this preset only (repeatable)")
    parser.add_argument("--bridge", type=Path, help="an unpacked megatron-bridge wheel (for its weights formula)")
    parser.add_argument("--megatron-lm", type=Path, help="Megatron-LM's megatron/training/theoretical_memory_usage.py")
    parser.add_argument("--per-layer", action="store_true", help="one layer's activations beside Megatron-LM's formula (needs --megatron-lm)")
    parser.add_argument("--memory", default="h100-80gb")
    args = parser.parse_args()
    lm = None if args.megatron_lm is None else load_megatron_lm(args.megatron_lm)
    if args.per_layer:
        if lm is None:
            parser.error("--per-layer needs --megatron-lm FILE")
        print("| model | layout | s × b | recompute, attention | probe (B per rank) | Megatron-LM SP+selective | "
              "Megatron-LM without SP |")
        print("|---|---|---|---|---|---|---|")
        for model, tp, seq in (("qwen3-8b", 2, 2048), ("llama-3.1-8b", 2, 2048)):
            if not args.only or model in args.only:
                print("\n".join(per_layer_rows(lm, model, tp, seq)), flush=True)
        return
    print("| model | TP × PP × DP (GPUs) | max_seq_len | budget per GPU | binding stage | head's share | "
          "state per GPU (batchfit) | Megatron-Bridge weights+optimizer | Megatron-LM weights+optimizer | "
          "peak − state (batchfit) | Megatron-LM activations: reported (full recompute) / SP+selective | shipped | wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
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
            print(f"| {model} | {tp} × {pp} × {dp} ({gpus}) | {seq:,} | {type(exc).__name__}: {str(exc)[:120]} | | | | | | | | | |")
            continue
        wall = time.perf_counter() - start
        budget = p.budgets["policy"]
        point = budget.points[0]  # the one probed length, max_seq_len
        breakdown = point.breakdown
        peak = point.peak_bytes
        head = breakdown.get("logprob_head", 0)
        state = sum(breakdown.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
        theirs = "" if args.bridge is None else format_bytes(int(bridge_weights_and_optimizer(args.bridge, model, tp, pp, dp)))
        mlm = act = ""
        if lm is not None:  # at the budget's micro-batch: its rows of max_seq_len, pp micro-batches in flight as the probe runs
            got = megatron_lm_figures(lm, megatron_lm_args(model, tp, pp, gpus, seq, max(1, p.combined.tokens // seq)), pp)
            mlm = format_bytes(int(got["weights_and_optimizer"]))
            act = f"{format_bytes(int(got['activations_reported']))} / {format_bytes(int(got['activations_selective_sp']))}"
        stages = ", ".join(f"{s}: {format_bytes(b)}" for s, b in sorted(p.megatron.stage_peaks.items()))
        print(f"| {model} | {tp} × {pp} × {dp} ({gpus}) | {seq:,} | {p.combined.tokens:,} | "
              f"{p.megatron.binding_stage} ({stages}) | {head / peak:.1%} | {format_bytes(state)} | {theirs} | {mlm} | "
              f"{format_bytes(peak - state)} | {act} | {shipped or ''} | {wall:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
