"""NeMo-RL 7ea279ab's keys for ``--emit nemo_rl``: its sequence-packing token keys, and every setting the budgets assume.

:func:`token_keys` writes ``policy.sequence_packing.train_mb_tokens`` (the policy update) and
``logprob_mb_tokens`` (the previous- and reference-policy log-probs), with packing on and dynamic
batching off; :func:`assumption_keys` the key of every setting the budgets were profiled with, or
refuses what NeMo-RL's DTensor path cannot express (NOTE [ Emitted keys carry every assumption ] in
:mod:`batchfit.frameworks.assumptions`). :data:`batchfit.frameworks.nemo_rl.SPEC` names this module.
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
)
from batchfit.frameworks.emit import smallest_budget
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile

__all__ = ["allocator_keys", "assumption_keys", "token_keys"]

_PACK = "policy.sequence_packing."
_DT = "policy.dtensor_cfg."
# NOTE [ NeMo-RL's packed micro-batch ]
# nemo_rl/distributed/batched_data_dict.py shard_by_batch_size (7ea279ab): with sequence packing each step's
# samples (each optimizer step's, for the update) are packed by data/packing/algorithms.py into bins of at most
# max_tokens_per_microbatch tokens (train_mb_tokens for the update, _shard_for_train; logprob_mb_tokens for the
# log-prob passes, _shard_for_logprob), the bin count a multiple of the data-parallel size, bins dealt to the ranks
# round-robin: one bin is one GPU's micro-batch. A bin's tokens are the sum of its sequences' lengths, each rounded
# up to make_sequence_length_divisible_by; a sequence longer than the bin raises ValueError: a hard cap per GPU.
_CAP = (
    "a hard cap per GPU on a micro-batch's packed tokens (each sequence rounded up to "
    "make_sequence_length_divisible_by; the packer raises for a longer sequence, data/packing/algorithms.py)"
)


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """NeMo-RL: one token key for the update, one for the log-prob passes (old and reference), sequence packing on.

    NOTE [ NeMo-RL's packed micro-batch ].
    """
    del world
    keys = [
        Key(
            _PACK + "enabled",
            True,
            "pack sequences into micro-batches by the token counts below (batched_data_dict.py shard_by_batch_size)",
        ),
        Key(
            "policy.dynamic_batching.enabled",
            False,
            "exclusive of sequence packing (lm_policy.py asserts it); its budget counts padded rows",
        ),
    ]
    trained = smallest_budget(budgets, ("policy",))
    forward = smallest_budget(budgets, ("policy_forward", "reference"))
    if trained is not None:
        keys.append(
            Key(_PACK + "train_mb_tokens", budgets[trained], why(trained, f"the policy update (_shard_for_train): {_CAP}"))
        )
    if forward is not None:
        keys.append(
            Key(
                _PACK + "logprob_mb_tokens",
                budgets[forward],
                why(forward, f"the previous- and reference-policy log-probs (_shard_for_logprob): {_CAP}"),
            )
        )
    short = [k for k in keys if k.path.endswith("_mb_tokens") and isinstance(k.value, int) and k.value < max_seq_len]
    for key in short:
        keys.append(
            Key(
                "",
                False,
                f"{key.path}={key.value:,} is below the longest sequence ({max_seq_len:,} tokens): NeMo-RL's packer "
                "raises for a sequence longer than the bin; shorten policy.max_total_sequence_length or give each GPU "
                "more memory",
            )
        )
    return keys


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """The DTensor path's keys for every profiled setting (``automodel/setup.py`` at 7ea279ab), or an EmitError."""
    del same
    target = "nemo_rl"
    s = a.sharding
    check_strategy(
        target,
        a,
        ("fsdp2", "megatron"),
        "NeMo-RL trains with its DTensor path (FSDP2: nemo_rl/models/automodel/setup.py setup_distributed) or its "
        "Megatron backend (policy.megatron_cfg)",
    )
    if "critic" in a.roles:
        raise refuse(
            target,
            "a critic",
            "batchfit reads NeMo-RL's GRPO config, which trains no value model",
            "profile without the critic (--roles policy,policy_forward)",
        )
    if s.strategy == "megatron":
        return _megatron_keys(run, a)
    if s.sequence_parallel > 1:
        raise refuse(
            target,
            f"--sequence-parallel {s.sequence_parallel}",
            "NeMo-RL's DTensor path splits sequences by context parallelism only, which it refuses beside sequence "
            "packing (automodel/setup.py), and the emitted keys pack",
            "profile without --sequence-parallel",
        )
    if not s.reshard_after_forward:
        raise refuse(
            target,
            "--no-reshard-after-forward",
            "NeMo-RL's DTensor config has no key for FSDP2's reshard_after_forward (Automodel's parallelizer sets it)",
            "drop --no-reshard-after-forward",
        )
    if a.trained_dtype != "fp32":
        raise refuse(
            target,
            f"--dtype {a.trained_dtype}",
            "NeMo-RL loads the policy's master weights in fp32 (automodel/setup.py: 'Always load in float32 for "
            "master weights')",
            "pass --dtype fp32",
        )
    precision = {"bf16": "bfloat16", "none": "float32"}.get(str(s.mixed_precision))
    if precision is None:
        raise refuse(
            target,
            f"--mixed-precision {s.mixed_precision}",
            "NeMo-RL computes in policy.precision over fp32 master weights (MixedPrecisionPolicy(param_dtype=precision, "
            "reduce_dtype=fp32), automodel/setup.py)",
            "profile with --mixed-precision bf16",
        )
    if a.lora.get("policy") is not None:
        raise refuse(
            target,
            f"--lora-rank {a.lora['policy'].rank}",
            "batchfit does not write NeMo-RL's LoRA keys (policy.dtensor_cfg.lora_cfg) yet",
            "pass --lora-rank 0",
        )
    check_head(
        target,
        a,
        ("full",),
        "NeMo-RL's DTensor path takes log-probs from the whole logits, in fp32 (MixedPrecisionPolicy output_dtype=fp32), "
        "as batchfit's full head does",
        "drop --logprobs (full is NeMo-RL's)",
    )
    nodes, per_node = nodes_and_gpus(run, a, target)
    engine = run.engine if run.vocabulary == target else None
    if engine is not None and not engine.colocated:
        gpus = [
            Key(
                "",
                False,
                f"the policy was profiled on {s.world_size} GPUs: keep cluster.* and policy.generation.colocated."
                "resources so that the policy keeps that many (grpo.py setup gives generation its own GPUs)",
            )
        ]
    else:
        gpus = [
            Key("cluster.num_nodes", nodes, f"the {s.world_size} GPUs profiled (generation colocated on them)"),
            Key("cluster.gpus_per_node", per_node),
        ]
    return [
        *gpus,
        Key(_DT + "enabled", True, "the DTensor (FSDP2) path, as profiled"),
        Key(_DT + "_v2", True, "DTensorPolicyWorkerV2 (Automodel), the path read at 7ea279ab"),
        Key("policy.megatron_cfg.enabled", False),
        Key(_DT + "tensor_parallel_size", 1, "FSDP2 only: batchfit does not model DTensor tensor parallelism"),
        Key(_DT + "context_parallel_size", 1, "context parallelism is refused beside sequence packing (automodel/setup.py)"),
        Key(_DT + "cpu_offload", s.offload == "cpu", "FSDP2's CPUOffloadPolicy (automodel/setup.py setup_distributed)"),
        Key(
            _DT + "activation_checkpointing",
            a.gradient_checkpointing,
            f"every decoder layer {'with' if a.gradient_checkpointing else 'without'} activation checkpointing "
            "(FSDP2Config(activation_checkpointing))",
        ),
        Key("policy.precision", precision, f"{precision} compute over fp32 master weights, fp32 gradient reduction"),
        Key(
            "policy.offload_optimizer_for_logprob",
            a.optimizer_offload,
            "the optimizer state "
            + ("leaves" if a.optimizer_offload else "stays on")
            + " the GPUs during the log-prob passes, as profiled",
        ),
    ]


_MG = "policy.megatron_cfg."


def _megatron_keys(run: RunConfig, a: Assumptions) -> list[Key]:
    """``policy.megatron_cfg`` as profiled (NOTE [ NeMo-RL's Megatron backend ] in :mod:`batchfit.frameworks.nemo_rl`).

    Raises:
        EmitError: context or expert parallelism, virtual pipeline stages, LoRA, activation offload, a dtype other
            than bf16 or fp32, another head than Megatron's.
    """
    target = "nemo_rl"
    s = a.sharding
    for flag, value, why in (
        (f"--context-parallel {s.context_parallel}", s.context_parallel > 1,
         "batchfit has not checked how NeMo-RL's packed bins meet Megatron's context-parallel split"),
        (f"--expert-parallel {s.expert_parallel}", s.expert_parallel > 1,
         "batchfit does not write NeMo-RL's MoE keys (expert_model_parallel_size beside expert_tensor_parallel_size)"),
        (f"--virtual-pipeline-parallel {s.virtual_pipeline_parallel}", bool(s.virtual_pipeline_parallel),
         "policy.megatron_cfg has no virtual-pipeline key at 7ea279ab"),
        ("--lora-rank", a.lora.get("policy") is not None, "batchfit does not write NeMo-RL's Megatron LoRA (peft)"),
        ("--activation-offload", a.activation_offload, "batchfit does not write NeMo-RL's Megatron activation offload"),
    ):  # fmt: skip
        if value:
            raise refuse(target, flag, why, f"profile without {flag.split()[0]}")
    precision = {"bf16": "bfloat16", "fp32": "float32"}.get(a.trained_dtype)
    if precision is None:
        raise refuse(target, f"--dtype {a.trained_dtype}", "batchfit writes NeMo-RL's Megatron run in bf16 or fp32",
                     "pass --dtype bf16")  # fmt: skip
    nodes, per_node = nodes_and_gpus(run, a, target)
    engine = run.engine if run.vocabulary == target else None
    gpus = (
        [Key("", False, f"the policy was profiled on {s.world_size} GPUs: keep cluster.* and policy.generation.colocated."
             "resources so that the policy keeps that many (grpo.py setup gives generation its own GPUs)")]
        if engine is not None and not engine.colocated
        else [Key("cluster.num_nodes", nodes, f"the {s.world_size} GPUs profiled (generation colocated on them)"),
              Key("cluster.gpus_per_node", per_node)]
    )  # fmt: skip
    recompute = a.gradient_checkpointing
    return [
        *gpus,
        Key(_MG + "enabled", True, f"the Megatron backend, profiled as {s.describe()} (nemo_rl/models/megatron/setup.py)"),
        Key(_DT + "enabled", False),
        Key(_MG + "tensor_model_parallel_size", s.tensor_parallel,
            f"Megatron's layout as profiled: tensor {s.tensor_parallel} × pipeline {s.pipeline_parallel} × data "
            f"{s.data_parallel_size}"),
        Key(_MG + "pipeline_model_parallel_size", s.pipeline_parallel),
        Key(_MG + "context_parallel_size", 1),
        Key(_MG + "expert_model_parallel_size", 1),
        Key(_MG + "sequence_parallel", s.megatron_sequence_parallel,
            "activations outside attention split over the tensor-parallel group, as profiled"
            if s.megatron_sequence_parallel else "activations whole on each tensor-parallel rank, as profiled"),
        Key(_MG + "optimizer.use_distributed_optimizer", s.distributed_optimizer,
            f"optimizer state sharded over the {s.data_parallel_size} data-parallel ranks, as profiled"
            if s.distributed_optimizer else "optimizer state whole on every data-parallel rank, as profiled"),
        Key(_MG + "optimizer.use_precision_aware_optimizer", s.precision_aware_optimizer,
            "Megatron's precision-aware optimizer (FusedAdam's main parameters and moments in their dtypes), as profiled"
            if s.precision_aware_optimizer else "the standard distributed optimizer (fp32 main shards and moments), as profiled"),
        *[Key(_MG + "optimizer." + name, getattr(s, name), f"{name} as profiled")
          for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
          if s.precision_aware_optimizer and getattr(s, name) != "fp32"],
        *([Key(_MG + "optimizer.optimizer_cpu_offload", True, "Megatron's HybridDeviceOptimizer, as profiled"),
           Key(_MG + "optimizer.optimizer_offload_fraction", s.optimizer_offload_fraction, "the share on the host, as profiled")]
          if s.optimizer_cpu_offload else []),
        Key(_MG + "distributed_data_parallel_config.grad_reduce_in_fp32", True, "an fp32 gradient buffer, as profiled"),
        Key(_MG + "activation_checkpointing", recompute,
            "every layer's input checkpointed (recompute full, uniform over 1 layer: megatron/setup.py), as profiled"
            if recompute else "no recompute, as profiled"),
        *([Key(_MG + "recompute_granularity", "full")] if recompute else []),
        Key(_MG + "use_fused_linear_logprobs", False, "log-probs from the vocab-parallel logits, the head profiled"),
        Key("policy.precision", precision, f"{precision} parameters (megatron/setup.py _apply_precision_config)"),
        Key(
            "policy.offload_optimizer_for_logprob",
            a.optimizer_offload,
            "the optimizer state "
            + ("leaves" if a.optimizer_offload else "stays on")
            + " the GPUs during the log-prob passes, as profiled",
        ),
    ]


def allocator_keys(a: Assumptions) -> list[Key]:
    """NeMo-RL's DTensor workers set no allocator of their own; ``dtensor_cfg.env_vars`` reach the worker processes."""
    if a.allocator == "expandable_segments":
        return [
            Key(
                _DT + "env_vars.PYTORCH_CUDA_ALLOC_CONF",
                "expandable_segments:True",
                "expandable segments, as profiled (lm_policy.py passes dtensor_cfg.env_vars to the workers; beside "
                "colocated vLLM's CuMemAllocator they may be unavailable, NeMo-RL #2319)",
            )
        ]
    return [allocator_comment(a, "NeMo-RL's default (its DTensor workers set no PYTORCH_CUDA_ALLOC_CONF)")]
