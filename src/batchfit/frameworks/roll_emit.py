"""ROLL 8eb27cc2's keys for ``--emit roll``: each worker's dynamic-batching caps, and every setting the budgets assume.

:func:`token_keys` writes ``use_dynamic_batching_in_train/infer`` and ``max_tokens_per_microbatch_in_train/infer``
for ``actor_train`` (its update and old log-probs), ``reference`` and ``critic``; :func:`assumption_keys` the keys of
the settings the budgets were profiled with, or refuses what ROLL cannot express (NOTE [ Emitted keys carry every
assumption ] in :mod:`batchfit.frameworks.assumptions`). :data:`batchfit.frameworks.roll.SPEC` names this module.
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    allocator_comment,
    check_head,
    check_strategy,
    refuse,
)
from batchfit.frameworks.emit import smallest_budget
from batchfit.frameworks.run import RunConfig, is_positive_int
from batchfit.frameworks.run_profile import RunProfile

__all__ = ["allocator_keys", "assumption_keys", "token_keys"]

_CAP = (
    "a hard cap on padded tokens: sequences × the longest rounded up to sequence_length_round (dynamic_batching_shard; "
    "a packed budget of as many tokens bounds it), honoured by megatron strategies (NOTE [ ROLL's token cap ])"
)
_CONFIG = "actor_train.strategy_args.strategy_config."
_REF_CONFIG = "reference.strategy_args.strategy_config."


def _round(profile: RunProfile, role: str, phase: str) -> int:
    """The config's ``sequence_length_round_in_<phase>`` of ``role`` (the cap is rounded down to a multiple of it)."""
    workers = getattr(profile.run, "values", {}).get("workers", {})
    value = workers.get(role, {}).get(f"{phase}_round")
    return value if is_positive_int(value) else 1


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """Each worker's switch and cap per phase, the cap its pass's budget rounded down to its ``sequence_length_round``."""
    del world
    keys: list[Key] = []
    for role, phase, passes, what in (
        ("actor_train", "train", ("policy",), "the actor's update"),
        ("actor_train", "infer", ("policy_forward",), "the actor's old log-probs"),
        ("reference", "infer", ("reference",), "the reference's log-probs"),
        ("critic", "train", ("critic",), "the critic's update"),
        ("critic", "infer", ("critic_forward",), "the critic's values"),
    ):
        binding = smallest_budget(budgets, passes)
        if binding is None:
            continue
        rounding = _round(profile, role, phase)
        cap = max(budgets[binding] // rounding * rounding, rounding)
        comment = why(binding, f"{what}, set by {binding}") + f"; {_CAP}; rounded down to sequence_length_round_in_{phase}={rounding}"
        if cap < max_seq_len:
            comment += f"; below the longest sequence ({max_seq_len:,} tokens): ROLL asserts one fits, so shorten them or add GPUs"
        keys += [
            Key(f"{role}.use_dynamic_batching_in_{phase}", True, "micro-batches under the token cap below"),
            Key(f"{role}.max_tokens_per_microbatch_in_{phase}", cap, comment),
        ]
    return keys


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """The settings ROLL can carry: Megatron's layout and recompute (megatron_train), or FSDP2's checkpointing
    (fsdp2_train, or a Megatron config profiled as FSDP2); no offload, no LoRA."""
    del same
    target = "roll"
    check_strategy(target, a, ("fsdp2", "megatron"), "ROLL trains with fsdp2_train (fully_shard) or megatron_train")
    if a.sharding.offload == "cpu":
        raise refuse(target, "--offload cpu", "batchfit does not write ROLL's strategy_config.offload_policy", "profile with --offload none")
    if a.lora.get("policy") is not None or a.lora.get("critic") is not None:
        raise refuse(target, "--lora-rank", "batchfit does not write ROLL's LoRA keys", "pass --lora-rank 0")
    if a.sharding.strategy == "megatron":
        return _megatron_keys(a)
    check_head(target, a, ("full",), "ROLL computes log-probs from the whole logits (profiled with batchfit's full head)", "drop --logprobs")
    keys = [
        Key(
            "actor_train.model_args.disable_gradient_checkpointing",
            not a.gradient_checkpointing,
            "every decoder layer checkpointed" if a.gradient_checkpointing else "no activation checkpointing",
        ),
        Key("", False, f"profiled as FSDP2 over {a.sharding.world_size} GPUs of actor_train.device_mapping"
            + ("; the config's Megatron layout is approximated by it" if run.strategy == "megatron" else "")),
    ]
    return keys


def _megatron_keys(a: Assumptions) -> list[Key]:
    """megatron_train's strategy_config as profiled (NOTE [ ROLL's Megatron strategy ]): the layout, the distributed
    optimizer, the fp32 gradient buffer, the recompute; the reference laid out as the actor.

    Raises:
        EmitError: a critic (batchfit does not profile ROLL's Megatron critic), activation offload, a dtype other than
            bf16.
    """
    target = "roll"
    s = a.sharding
    if "critic" in a.roles:
        raise refuse(target, "a critic under --sharding megatron",
                     "batchfit does not profile ROLL's Megatron critic", "profile a critic-free run (adv_estimator: reinforce)")  # fmt: skip
    if a.activation_offload:
        raise refuse(target, "--activation-offload with --sharding megatron",
                     "batchfit does not write ROLL's Megatron activation offload", "profile without --activation-offload")  # fmt: skip
    if a.trained_dtype != "bf16":
        raise refuse(target, f"--dtype {a.trained_dtype} with --sharding megatron",
                     "batchfit writes ROLL's Megatron run in bf16 (model_args.dtype: bf16)", "pass --dtype bf16")  # fmt: skip
    recompute = a.gradient_checkpointing
    keys = [
        Key("actor_train.strategy_args.strategy_name", "megatron_train", f"profiled as {s.describe()}"),
        Key("actor_train.model_args.dtype", "bf16", "bf16 parameters, fp32 main copy in the optimizer, as profiled"),
        Key(_CONFIG + "tensor_model_parallel_size", s.tensor_parallel,
            f"Megatron's layout as profiled: tensor {s.tensor_parallel} × pipeline {s.pipeline_parallel} × context "
            f"{s.context_parallel} × data {s.data_parallel_size}"),
        Key(_CONFIG + "pipeline_model_parallel_size", s.pipeline_parallel),
        Key(_CONFIG + "virtual_pipeline_model_parallel_size", s.virtual_pipeline_parallel or "null",
            f"{s.virtual_pipeline_parallel} model chunks per stage, the interleaved schedule, as profiled"
            if s.virtual_pipeline_parallel else "no interleaved schedule, as profiled"),
        Key(_CONFIG + "context_parallel_size", s.context_parallel),
        Key(_CONFIG + "expert_model_parallel_size", s.expert_parallel),
        Key(_CONFIG + "sequence_parallel", s.megatron_sequence_parallel,
            "activations outside attention split over the tensor-parallel group, as profiled"
            if s.megatron_sequence_parallel else "activations whole on each tensor-parallel rank, as profiled"),
        Key(_CONFIG + "use_distributed_optimizer", s.distributed_optimizer,
            f"optimizer state sharded over the {s.data_parallel_size} data-parallel ranks, as profiled"
            if s.distributed_optimizer else "optimizer state whole on every data-parallel rank, as profiled"),
        Key(_CONFIG + "accumulate_allreduce_grads_in_fp32", True, "an fp32 gradient buffer, as profiled (ROLL's default is bf16)"),
        Key(_CONFIG + "recompute_granularity", "full" if recompute else "null",
            "every layer's input checkpointed (uniform over 1 layer: mcore_adapter model_config.py), as profiled"
            if recompute else "no recompute, as profiled"),
    ]
    if "reference" in a.roles:
        keys += [
            Key("reference.strategy_args.strategy_name", "megatron_infer", "the reference laid out as the actor, as profiled"),
            Key(_REF_CONFIG + "tensor_model_parallel_size", s.tensor_parallel),
            Key(_REF_CONFIG + "pipeline_model_parallel_size", s.pipeline_parallel),
            Key(_REF_CONFIG + "context_parallel_size", s.context_parallel),
            Key(_REF_CONFIG + "expert_model_parallel_size", s.expert_parallel),
        ]
    return keys


def allocator_keys(a: Assumptions) -> list[Key]:
    """ROLL leaves the allocator to the environment (``system_envs``)."""
    return [allocator_comment(a, "set PYTORCH_CUDA_ALLOC_CONF in the config's system_envs")]
