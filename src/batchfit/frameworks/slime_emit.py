"""slime 624b824a's flags for ``--emit slime``: its one token flag, and every setting the budgets assume.

:func:`token_keys` writes ``--max-tokens-per-gpu`` (the smallest budget: every pass runs the
training micro-batches); :func:`assumption_keys` the flag of every setting the budgets were
profiled with, or refuses what slime cannot express (NOTE [ Emitted keys carry every assumption
] in :mod:`batchfit.frameworks.assumptions`). :data:`batchfit.frameworks.slime.SPEC` names this
module (``FrameworkSpec.emit``); :mod:`batchfit.frameworks.emit` calls it through the registry.
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    allocator_comment,
    check_head,
    check_strategy,
    nodes_and_gpus,
    refuse,
    switch_keys,
)
from batchfit.frameworks.emit import cost_note, smallest_budget
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile
from batchfit.train.megatron_heads import MegatronHeads

__all__ = ["assumption_keys", "token_keys"]


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """slime (624b824a): one token flag for every pass; log-probs and values run the training micro-batches.

    ``build_dp_schedule`` cuts each step into micro-batches of at most ``--max-tokens-per-gpu``
    (× context-parallel size); ``compute_log_prob`` (old, reference) and the critic's values reuse
    that schedule, so the flag takes the smallest budget. ``--log-probs-max-tokens-per-gpu`` is
    parsed but not read at that commit, so it is not emitted.
    """
    del max_seq_len, world
    sharding = profile.options["policy"].sharding
    sp = sharding.context_parallel * sharding.sequence_parallel  # one of them is 1: Megatron's CP, or the FSDP approximation's
    binding = smallest_budget(budgets, tuple(budgets))
    keys = [
        Key("--use-dynamic-batch-size", True, "micro-batches by the token count below (build_dp_schedule)")
    ]
    if binding is not None:
        comment = why(
            binding, f"every pass (slime runs log-probs and values over the training micro-batches), set by {binding}"
        )
        if sp > 1:  # a micro-batch holds max_tokens_per_gpu × context_parallel_size tokens (module docstring of slime)
            comment += (
                f"; per GPU: slime multiplies it by --context-parallel-size {sp}, a micro-batch of "
                f"{budgets[binding] // sp * sp:,} tokens split over {sp} GPUs"
            )
        keys.append(Key("--max-tokens-per-gpu", budgets[binding] // sp, comment))
    keys.append(Key("", False, f"the budget counts {cost_note(profile, 'slime')}"))
    return keys


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """The flags of the Megatron layout, GPUs and recomputation the budgets were profiled with (slime 624b824a).

    Raises:
        EmitError: a sharding other than ``megatron``, CPU offload, another precision than bf16,
            LoRA, or another head than the whole logits'.
    """
    target = "slime"
    s = a.sharding
    check_strategy(
        target,
        a,
        ("megatron",),
        "slime trains with Megatron-LM only (--train-backend megatron); profile its layout with --sharding megatron "
        "--tensor-parallel N --pipeline-parallel N",
    )
    if a.trained_dtype != "bfloat16" and a.trained_dtype not in ("bf16",):
        raise refuse(
            target,
            f"--dtype {a.trained_dtype}",
            "slime trains bf16 with Megatron (set_default_megatron_args: bf16 parameters unless --fp16)",
            "pass --dtype bf16",
        )
    if a.lora.get("policy") is not None:
        raise refuse(target, f"--lora-rank {a.lora['policy'].rank}", "slime at 624b824a has no LoRA flags", "pass --lora-rank 0")
    nodes, per_node = nodes_and_gpus(run, a, target)
    keys = [
        Key("--actor-num-nodes", nodes, f"the {s.world_size} GPUs profiled (the critic shares them)"),
        Key("--actor-num-gpus-per-node", per_node),
        Key(
            "--tensor-model-parallel-size",
            s.tensor_parallel,
            f"Megatron's layout as profiled: tensor {s.tensor_parallel} × pipeline {s.pipeline_parallel} × data "
            f"{s.data_parallel_size}",
        ),
        Key("--pipeline-model-parallel-size", s.pipeline_parallel),
        *(
            [Key("--num-virtual-stages-per-pipeline-rank", s.virtual_pipeline_parallel,
                 f"{s.virtual_pipeline_parallel} model chunks per pipeline rank, the interleaved 1F1B schedule, as profiled")]
            if s.virtual_pipeline_parallel
            else []
        ),
        *(  # Megatron-LM's uneven pipeline: written only when the profile sized the first or last stage
            [Key(flag, layers, f"the {end} pipeline stage's {layers} decoder layers, the middle stages splitting the rest, as profiled")
             for flag, end, layers in (
                 ("--decoder-first-pipeline-num-layers", "first", s.first_pipeline_stage_layers),
                 ("--decoder-last-pipeline-num-layers", "last", s.last_pipeline_stage_layers),
             ) if layers is not None]
        ),
        Key(
            "--context-parallel-size",
            s.context_parallel,
            f"each sequence cut over {s.context_parallel} GPUs, attention a ring, as profiled" if s.context_parallel > 1
            else "no context parallelism, as profiled",
        ),
        *(  # Megatron-LM's default is 1: written only when the profile spread the experts
            [Key("--expert-model-parallel-size", s.expert_parallel,
                 f"each MoE layer's experts spread over {s.expert_parallel} GPUs, the rank receiving the most tokens profiled")]
            if s.expert_parallel > 1
            else []
        ),
        *(
            [Key("--expert-tensor-parallel-size", s.expert_tensor_parallel,
                 f"each expert's matrices split over {s.expert_tensor_parallel} GPUs, as profiled")]
            if s.expert_tensor_parallel is not None
            else []
        ),
    ]
    if s.megatron_sequence_parallel:
        keys.append(Key("--sequence-parallel", True, "activations outside attention split over the tensor-parallel group"))
    elif s.tensor_parallel > 1 and run.megatron_sequence_parallel:
        raise refuse(
            target,
            "--no-megatron-sequence-parallel",
            "the command passes --sequence-parallel and slime has no flag to turn it off",
            "drop --no-megatron-sequence-parallel, or remove --sequence-parallel from the command",
        )
    keys.append(Key("", False, "slime always trains with Megatron's distributed optimizer (set_default_megatron_args)"))
    if s.precision_aware_optimizer:  # Megatron-LM's precision-aware optimizer, its dtypes where not fp32
        keys.append(Key("--use-precision-aware-optimizer", True, "Megatron's precision-aware optimizer, as profiled"))
        keys += [
            Key(f"--{name.replace('_', '-')}", getattr(s, name), f"{name} as profiled")
            for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
            if getattr(s, name) != "fp32"
        ]
    if s.optimizer_cpu_offload:  # Megatron's HybridDeviceOptimizer: the profiled share of the state on the host
        keys.append(Key("--optimizer-cpu-offload", True, "the optimizer state on the host, as profiled"))
        if s.optimizer_offload_fraction != 1.0:
            keys.append(Key("--optimizer-offload-fraction", s.optimizer_offload_fraction, "the share offloaded, as profiled"))
    on = a.gradient_checkpointing
    if on:
        # Megatron's TransformerConfig needs a method with full recompute; uniform over 1 layer checkpoints every
        # layer's input, as batchfit does (slime's scripts/run-qwen3-4B.sh passes these three)
        keys += [
            Key("--recompute-granularity", "full", "every layer's input checkpointed (Megatron's full recompute)"),
            Key("--recompute-method", "uniform"),
            Key("--recompute-num-layers", 1),
        ]
    else:
        keys += switch_keys(
            target,
            run,
            same,
            "--recompute-granularity full",
            False,
            bool(run.gradient_checkpointing),
            "--gradient-checkpointing",
            "",
        )
    check_head(
        target,
        a,
        ("slime",),
        "slime computes log-probs and entropy with its own vocab-parallel head over the whole logits "
        "(_VocabParallelLogProbEntropy) and has no flag for another head",
        "drop --logprobs",
    )
    return keys + head_keys(a)


def head_keys(a: Assumptions) -> list[Key]:
    """slime's head as profiled (frameworks.run_step.megatron_heads): its chunk, the rollout entropy, the entropy's graph.

    ``--log-probs-chunk-size`` and ``--use-rollout-entropy`` are given as profiled; ``--entropy-coef`` is
    the algorithm's, so a comment says what a change of it from 0 (or to 0) does to the budget. A
    profile that ran Megatron's own cross-entropy (a config of another framework) emits none.
    """
    heads = a.head
    if not isinstance(heads, MegatronHeads):
        return []
    update, forward = heads.update, heads.old_log_probs
    chunk = update.chunk_size
    keys = [
        Key(
            "--log-probs-chunk-size",
            -1 if chunk is None else chunk,
            "log-probs and entropy over the whole micro-batch at once, as profiled" if chunk is None
            else f"log-probs and entropy {chunk:,} tokens at a time, as profiled",
        )
    ]
    keys.append(
        Key("--use-rollout-entropy", True, "the old and reference log-probs compute the entropy too, as profiled")
        if forward.entropy
        else Key("", False, "profiled without --use-rollout-entropy: leave it out of the command")
    )
    keys.append(
        Key(
            "",
            False,
            "the update's entropy keeps its graph through the backward (--entropy-coef is not 0), as profiled"
            if update.entropy_grad
            else "the update's entropy is a metric (--entropy-coef 0), as profiled: a non-zero --entropy-coef keeps its "
            "graph and needs a new profile",
        )
    )
    return keys


def allocator_keys(a: Assumptions) -> list[Key]:
    """slime's train actors get expandable segments only with ``SLIME_ENABLE_EXPANDABLE_SEGMENTS=1`` (torch_accelerator.py)."""
    how = (
        "slime turns them on only with SLIME_ENABLE_EXPANDABLE_SEGMENTS=1 in the train actors' environment "
        "(--train-env-vars '{\"SLIME_ENABLE_EXPANDABLE_SEGMENTS\": \"1\"}')"
        if a.allocator == "expandable_segments"
        else "slime's default (SLIME_ENABLE_EXPANDABLE_SEGMENTS unset)"
    )
    return [allocator_comment(a, how)]
