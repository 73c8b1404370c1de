"""verl 0.9.1's keys for ``--emit verl``: the token lengths of each pass, and every setting the budgets assume.

:func:`token_keys` writes the switch and token length of each pass (:data:`VERL_KEYS`);
:func:`assumption_keys` the key of every setting the budgets were profiled with, or refuses what
verl cannot express (NOTE [ Emitted keys carry every assumption ] in
:mod:`batchfit.frameworks.assumptions`). :data:`batchfit.frameworks.verl.SPEC` names this module
(``FrameworkSpec.emit``); :mod:`batchfit.frameworks.emit` calls it through the registry.
"""

from __future__ import annotations

import math
from typing import Any

from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    allocator_comment,
    check_head,
    check_strategy,
    lora_adapter_keys,
    nodes_and_gpus,
    refuse,
)
from batchfit.frameworks.emit import REMOVE_PADDING
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile
from batchfit.frameworks.source import in_composed
from batchfit.frameworks.verl import SPEC
from batchfit.train.framework_heads import FrameworkHead

__all__ = ["VERL_KEYS", "assumption_keys", "bucketed", "override_prefix", "token_keys"]

# verl: each pass → the key that turns token-length micro-batching on, its length key, and what runs.
VERL_KEYS = (
    (
        "policy",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor update",
    ),
    (
        "policy_forward",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "old log-probs (no_grad)",
    ),
    (
        "reference",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "reference log-probs (no_grad)",
    ),
    ("critic", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", "critic update"),
    # verl 0.9.1's V1 trainer (trainer_base.py) sets the critic engine's training and inference
    # token lengths both from ppo_infer_max_token_len_per_gpu: it takes the smaller budget
    (
        "critic_forward",
        "critic.use_dynamic_bsz",
        "critic.ppo_infer_max_token_len_per_gpu",
        "values (no_grad) and, in verl's V1 trainer, the critic update too",
    ),
)


def override_prefix(path: str) -> str:
    """``""`` for a key of verl 0.9.1's composed ``ppo_trainer`` config, ``"++"`` for one it lacks.

    verl's Hydra refuses to override a key its composed config does not have (``Could not
    override 'actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype'. To append to your
    config use +``): ``FSDPEngineConfig.mixed_precision`` is a dataclass field (``None`` by default)
    that ``engine/fsdp.yaml`` leaves out. ``++`` adds it, or replaces the value a launch script
    added with ``+`` (verl's own scripts write both). The composed config is the wheel's
    ``_generated_ppo_trainer.yaml`` (:func:`~batchfit.frameworks.source.in_composed`:
    ``critic.ppo_infer_max_token_len_per_gpu`` is a field of ``CriticConfig`` that ``critic.yaml``
    leaves out).

    >>> override_prefix("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), override_prefix(
    ...     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype")
    ('', '++')
    """
    return "" if in_composed("verl", path) else "++"


def bucketed(budget: int, factor: int, bucket: int | None, longest: int = 0) -> int:
    """The per-GPU token length verl is given for a micro-batch budget of ``budget`` tokens split over ``factor`` GPUs.

    ``budget // factor`` without a bucket (NOTE [ verl multiplies by the Ulysses size ]); with verl's ``pad_to_length``
    (NOTE [ verl pads packed micro-batches to a bucket ] in :mod:`batchfit.frameworks.verl`) the largest length whose
    micro-batch, ``length × factor`` tokens, is a multiple of ``lcm(bucket, factor)`` and at most ``budget``, so that
    verl's padding never takes it past the budget. ``longest``: the longest sequence, which that micro-batch must
    still hold (verl's ``rearrange_micro_batches`` asserts ``max_token_len >= max_seq_len``).

    >>> bucketed(10_000, 1, None), bucketed(10_000, 1, 1024), bucketed(10_000, 2, 1024), bucketed(10_000, 3, 1024)
    (10000, 9216, 4608, 3072)

    Raises:
        EmitError: the budget rounded down to a bucket holds no micro-batch, or not the longest sequence.
    """
    if bucket is None:
        return budget // factor
    step = math.lcm(bucket, factor)
    if budget // step * step < max(step, longest or 0):
        raise refuse(
            "verl",
            f"a budget of {budget:,} tokens with pad_to_length_bucket={bucket}",
            f"verl pads each packed micro-batch up to a multiple of lcm(pad_to_length_bucket, {factor}) = {step:,} tokens "
            f"(transformer_impl.py _get_packed_pad_size), and no multiple within the budget holds "
            f"{'one micro-batch' if longest <= step else f'a sequence of {longest:,} tokens'}",
            f"set pad_to_length_bucket to at most {budget:,}, or pad_to_length=false",
        )
    return budget // step * step // factor


def _bucket_comment(bucket: int | None, factor: int) -> str:
    if bucket is None:
        return ""
    return (
        f"; a multiple of lcm(pad_to_length_bucket={bucket}, {factor}) tokens per micro-batch: verl pads each packed "
        "micro-batch up to the next one (pad_to_length, transformer_impl.py _get_packed_pad_size)"
    )


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """verl has a switch and a token length per pass (:data:`VERL_KEYS`), per GPU: the budget over the Ulysses size.

    NOTE [ verl multiplies by the Ulysses size ]: verl 0.9.1's actor multiplies each token length by
    ``ulysses_sequence_parallel_size`` (``verl/workers/actor/dp_actor.py``: ``max_token_len =
    ppo_max_token_len_per_gpu * self.ulysses_sequence_parallel_size`` for the update,
    ``data.meta_info["max_token_len"] * self.ulysses_sequence_parallel_size`` for log-probs; the
    critic and reward passes alike) and splits each micro-batch over the sp GPUs of its group. A
    budget of ``C`` tokens per group's micro-batch is therefore written as ``C // sp``.
    """
    del world
    sharding = profile.options["policy"].sharding
    sp = sharding.sequence_parallel
    bucket = getattr(getattr(profile, "run", None), "token_bucket", None)
    keys = [
        Key("actor_rollout_ref.actor.use_dynamic_bsz", True, "micro-batches by the token lengths below"),
        Key("actor_rollout_ref.model.use_remove_padding", True, REMOVE_PADDING.format(framework="verl")),
    ]
    if sharding.spec.model_parallel:
        return keys + _megatron_token_keys(sharding, budgets, why, bucket, max_seq_len) + _bucket_keys(bucket, "megatron.")
    if "critic" in budgets:
        keys.append(Key("critic.model.use_remove_padding", True, "the critic's micro-batches packed too"))
    for role, switch, length, what in VERL_KEYS:
        if role in budgets:
            if all(k.path != switch for k in keys):
                keys.append(Key(switch, True))
            value = (
                min(budgets[role], budgets.get("critic", budgets[role]))
                if role == "critic_forward"
                else budgets[role]
            )
            bound = "critic" if role == "critic_forward" and value == budgets.get("critic") else role
            comment = why(bound, what)
            if sp > 1:
                comment += (
                    f"; per GPU: verl multiplies it by ulysses_sequence_parallel_size={sp} (dp_actor.py), so a "
                    f"micro-batch holds {value // sp * sp:,} tokens split over {sp} GPUs"
                )
            per_gpu = bucketed(value, sp, bucket, max_seq_len)
            if sp > 1 and bucket is not None:
                comment = comment.replace(f"holds {value // sp * sp:,} tokens", f"holds {per_gpu * sp:,} tokens")
            keys.append(Key(length, per_gpu, comment + _bucket_comment(bucket, sp)))
    return keys + _bucket_keys(bucket, "fsdp_config.")


def _bucket_keys(bucket: int | None, engine: str) -> list[Key]:
    """The actor's ``pad_to_length_bucket`` the lengths are multiples of (the reference's and critic's follow it)."""
    if bucket is None:
        return []
    return [Key(f"actor_rollout_ref.actor.{engine}pad_to_length_bucket", bucket, "the bucket the lengths above are multiples of")]


def _megatron_token_keys(
    sharding: Any, budgets: dict[str, int], why: Any, bucket: int | None = None, longest: int = 0
) -> list[Key]:
    """The token lengths of verl's Megatron actor, its log-prob pass and its reference (NOTE [ verl's Megatron engine ]).

    NOTE [ verl's Megatron token lengths ]: MegatronEngine.forward_backward_batch sets ``sp_size =
    context_parallel_size`` and prepare_micro_batches packs ``max_token_len_per_gpu × sp_size`` tokens per
    micro-batch (verl/workers/engine/utils.py). A budget of a Megatron profile counts the tokens of one
    data-parallel rank's micro-batch (the binding pipeline stage's peak), which every GPU of its tensor ×
    context × pipeline group runs (tensor parallelism splits the weights and, with sequence_parallel, the
    activations; context parallelism the sequence; pipeline parallelism the layers), so each length is the
    budget over context_parallel_size.
    """
    keys = []
    cp = sharding.context_parallel
    for role, switch, length, what in VERL_KEYS:
        if role not in budgets:
            continue
        if all(k.path != switch for k in keys) and switch != "actor_rollout_ref.actor.use_dynamic_bsz":
            keys.append(Key(switch, True))
        comment = why(role, what) + (
            f"; the tokens of one micro-batch on each GPU of a tensor {sharding.tensor_parallel} × pipeline "
            f"{sharding.pipeline_parallel} group: verl multiplies it by megatron.context_parallel_size={cp} "
            "(MegatronEngine.forward_backward_batch: sp_size; prepare_micro_batches)"
            + (f", a micro-batch of {bucketed(budgets[role], cp, bucket, longest) * cp:,} tokens split over {cp} GPUs" if cp > 1 else "")
        )
        keys.append(Key(length, bucketed(budgets[role], cp, bucket, longest), comment + _bucket_comment(bucket, cp)))
    return keys


_V_MODEL = "actor_rollout_ref.model."
_V_ACTOR = "actor_rollout_ref.actor."
_V_ENGINE = _V_ACTOR + "fsdp_config."  # FSDPActorConfig.fsdp_config: the actor's FSDPEngineConfig
_V_REF_ENGINE = "actor_rollout_ref.ref.fsdp_config."
_V_CRITIC_ENGINE = "critic.fsdp."  # FSDPCriticConfig's FSDPEngineConfig
_V_SRC = "verl/workers/engine/fsdp/transformer_impl.py"
#: batchfit's strategy → verl's ``actor.strategy`` (a verl fact: its ``fsdp`` is FSDP1, ``fsdp2`` is fully_shard).
_V_STRATEGY = {"fsdp1": "fsdp", "fsdp2": "fsdp2"}


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "verl"
    s = a.sharding
    critic = "critic" in a.roles
    check_strategy(
        target,
        a,
        (*_V_MEGATRON, *_V_STRATEGY),
        "verl's engines are FSDP1 (strategy fsdp), FSDP2 (strategy fsdp2) and Megatron (strategy megatron), not DDP",
    )
    if s.spec.model_parallel:
        return _megatron_keys(run, a, same)
    if s.offload == "cpu" and _V_STRATEGY.get(s.strategy) == "fsdp":
        raise refuse(
            target,
            "--offload cpu with --sharding fsdp1",
            f"verl's FSDP1 engine turns CPU offload off for the actor and the critic ({_V_SRC} _build_fsdp_module: "
            "cpu_offload=None unless forward_only)",
            "pass --sharding fsdp2 (strategy fsdp2 reads fsdp_config.offload_policy)",
        )
    nodes, per_node = nodes_and_gpus(run, a, target)
    keys = [
        Key("trainer.nnodes", nodes, f"the {s.world_size} GPUs profiled (verl: trainer.nnodes × n_gpus_per_node)"),
        Key("trainer.n_gpus_per_node", per_node),
    ]
    name = _V_STRATEGY.get(s.strategy)
    if name is not None:
        why = f"profiled as {s.strategy} ({'FullyShardedDataParallel' if name == 'fsdp' else 'fully_shard'})"
        keys.append(Key(_V_ACTOR + "strategy", name, why))
        if critic:
            keys.append(Key("critic.strategy", name))
        after = f"{_V_SRC}: fully_shard(reshard_after_forward=), FSDP1 FULL_SHARD / SHARD_GRAD_OP"
        keys.append(Key(_V_ENGINE + "reshard_after_forward", s.reshard_after_forward, after))
        if critic:
            keys.append(Key(_V_CRITIC_ENGINE + "reshard_after_forward", s.reshard_after_forward))
        if "reference" in a.roles:
            keys.append(Key(_V_REF_ENGINE + "reshard_after_forward", s.reshard_after_forward))
        offload = s.offload == "cpu"
        keys.append(
            Key(
                _V_ENGINE + "offload_policy",
                offload,
                "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state on the host"
                if offload
                else "sharded state on the GPU",
            )
        )
        if critic:
            keys.append(Key(_V_CRITIC_ENGINE + "offload_policy", offload))
    keys += _verl_precision(a, critic)
    if a.activation_offload or run.activation_offload:
        # fsdp_workers.py: enable_activation_offloading(module, strategy, enable_gradient_checkpointing)
        on = a.activation_offload
        keys.append(
            Key(
                _V_MODEL + "enable_activation_offload",
                on,
                "each layer's saved activations (with checkpointing: its inputs) offloaded to the host, as "
                "verl/utils/activation_offload.py does"
                if on
                else "profiled with activations on the GPU",
            )
        )
        if critic:
            keys.append(Key("critic.model.enable_activation_offload", on))
    keys.append(
        Key(
            _V_MODEL + "enable_gradient_checkpointing",
            a.gradient_checkpointing,
            f"profiled {'with' if a.gradient_checkpointing else 'without'} activation checkpointing",
        )
    )
    if critic:
        keys.append(Key("critic.model.enable_gradient_checkpointing", a.gradient_checkpointing))
    for role, (rank, alpha, targets) in SPEC.lora_keys.items():
        if role in a.roles:
            keys += lora_adapter_keys(a.lora.get(role), rank, alpha, targets)
    keys += _verl_head(run, a, same)
    return keys + _verl_sequence_parallel(run, a, critic)


#: batchfit's Megatron strategy → verl's ``actor.strategy`` (its MegatronEngine, composed by ``model_engine=megatron``).
_V_MEGATRON = {"megatron": "megatron"}
_V_MCORE = _V_ACTOR + "megatron."  # McoreActorConfig.megatron: the actor's McoreEngineConfig
_V_REF_MCORE = "actor_rollout_ref.ref.megatron."
_V_MCORE_SRC = "verl/workers/engine/megatron/transformer_impl.py"


def _megatron_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """The keys of a Megatron profile: verl's McoreEngineConfig for the actor and the reference (NOTE [ verl's Megatron engine ]).

    No FSDP key (``fsdp_config.*``, ``ulysses_sequence_parallel_size``, ``enable_gradient_checkpointing``): the
    Megatron engine reads none. Refused: a critic (batchfit does not profile verl's Megatron critic), activation
    offload (verl's is its FSDP engine's), LoRA (Megatron's adapters are not modelled), a parameter dtype verl's
    Megatron engine does not train in (McoreEngineConfig.__post_init__ asserts bfloat16 or float16).
    """
    target = "verl"
    s = a.sharding
    if "critic" in a.roles:
        raise refuse(
            target,
            "a critic under --sharding megatron",
            "batchfit does not profile verl's Megatron critic (a value head on Megatron's GPTModel)",
            "profile a critic-free run (algorithm.adv_estimator=grpo), or the run with --sharding fsdp2",
        )
    if a.activation_offload:
        raise refuse(
            target,
            "--activation-offload with --sharding megatron",
            "verl offloads activations in its FSDP engine only (verl/utils/activation_offload.py)",
            "profile without --activation-offload",
        )
    if a.lora.get("policy") is not None:
        raise refuse(
            target,
            "LoRA with --sharding megatron",
            "batchfit does not model verl's Megatron LoRA (actor_rollout_ref.model.lora.*, verl/utils/megatron_peft.py)",
            "profile without LoRA, or with --sharding fsdp2 (lora_rank)",
        )
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(a.trained_dtype)
    if dtype is None:
        raise refuse(
            target,
            f"--dtype {a.trained_dtype} with --sharding megatron",
            "verl's Megatron engine keeps its parameters in bfloat16 or float16 (McoreEngineConfig.__post_init__ asserts "
            "it; the optimizer keeps fp32 copies)",
            "pass --dtype bf16",
        )
    nodes, per_node = nodes_and_gpus(run, a, target)
    sp = s.megatron_sequence_parallel
    keys = [
        Key("", False, "verl composes its Megatron actor and reference with model_engine=megatron: launch "
            "python -m verl.trainer.main_ppo model_engine=megatron ... (these keys are that composition's)"),
        Key("trainer.nnodes", nodes, f"the {s.world_size} GPUs profiled (verl: trainer.nnodes × n_gpus_per_node)"),
        Key("trainer.n_gpus_per_node", per_node),
        Key(_V_ACTOR + "strategy", "megatron", f"profiled as {s.describe()} (MegatronEngine, {_V_MCORE_SRC})"),
    ]
    layout = [
        ("tensor_model_parallel_size", s.tensor_parallel, "mpu.initialize_model_parallel (MegatronEngine._init_device_mesh)"),
        ("pipeline_model_parallel_size", s.pipeline_parallel, "1F1B over the stages, the binding stage's peak profiled"),
        ("context_parallel_size", s.context_parallel,
         f"each sequence cut over {s.context_parallel} GPUs, attention a ring, as profiled" if s.context_parallel > 1
         else "no context parallelism, as profiled"),
        ("expert_model_parallel_size", s.expert_parallel,
         f"each MoE layer's experts spread over {s.expert_parallel} GPUs, the rank receiving the most tokens profiled"
         if s.expert_parallel > 1 else "experts (if any) whole on every GPU, as profiled"),
        *([("expert_tensor_parallel_size", s.expert_tensor_parallel,
            f"each expert's matrices split over {s.expert_tensor_parallel} GPUs, as profiled")]
          if s.expert_tensor_parallel is not None else []),
        ("virtual_pipeline_model_parallel_size", s.virtual_pipeline_parallel,
         f"{s.virtual_pipeline_parallel} model chunks per stage, the interleaved 1F1B schedule, as profiled"
         if s.virtual_pipeline_parallel else "no interleaved schedule, as profiled"),
        ("sequence_parallel", sp,
         "activations outside attention split over the tensor-parallel group, as profiled" if sp
         else "activations whole on each tensor-parallel rank, as profiled"),
        ("use_distributed_optimizer", s.distributed_optimizer,
         f"optimizer state sharded over the {s.data_parallel_size} data-parallel ranks, as profiled"
         if s.distributed_optimizer else "optimizer state whole on every data-parallel rank, as profiled"),
        ("dtype", dtype, f"parameters in {a.trained_dtype} (McoreEngineConfig.dtype)"),
    ]
    keys += [Key(_V_MCORE + key, "null" if value is None else value, why) for key, value, why in layout]
    if "reference" in a.roles:
        ref_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(a.dtypes["reference"])
        if ref_dtype is None:
            raise refuse(
                target,
                f"a {a.dtypes['reference']} reference with --sharding megatron",
                "verl's Megatron reference keeps its parameters in bfloat16 or float16 (McoreEngineConfig.__post_init__)",
                "pass --dtype bf16",
            )
        keys += [
            Key(_V_REF_MCORE + "tensor_model_parallel_size", s.tensor_parallel, "the reference laid out as the actor, as profiled"),
            Key(_V_REF_MCORE + "pipeline_model_parallel_size", s.pipeline_parallel),
            Key(_V_REF_MCORE + "context_parallel_size", 1),
            Key(_V_REF_MCORE + "sequence_parallel", sp),
            Key(_V_REF_MCORE + "dtype", ref_dtype, f"the reference's parameters in {a.dtypes['reference']}"),
        ]
    recompute = a.gradient_checkpointing
    tf = _V_MCORE + "override_transformer_config."
    keys += [
        Key(
            tf + "recompute_granularity",
            "full" if recompute else "null",
            "every layer recomputed in the backward (Megatron's full recompute), as profiled"
            if recompute
            else "no recompute, as profiled (verl's Megatron engine reads recompute from here, not from "
            "enable_gradient_checkpointing)",
        ),
        Key(tf + "recompute_method", "uniform" if recompute else "null"),
        Key(tf + "recompute_num_layers", 1 if recompute else "null"),
    ]
    keys.append(Key(_V_MODEL + "lora.rank", 0, "no LoRA: every parameter trained"))
    return keys + _megatron_head(run, a, same)


def _megatron_head(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """verl's Megatron head: vocab-parallel log-probs from the logits (MegatronEngineWithLMHead._lm_head_logits_processor).

    A Megatron profile measures Megatron's vocab-parallel cross-entropy over the whole logits (whatever ``--logprobs``
    says): ``use_fused_kernels`` off is that head. The entropy keys (``megatron.entropy_from_logits_*``) and the
    algorithm's (``calculate_entropy``, ``entropy_coeff``) are the config's, never changed; what the budgets leave
    out of them is the reader's warning (:func:`batchfit.frameworks.verl._megatron_warnings`).
    """
    del run, a, same
    return [
        Key(
            _V_MODEL + "use_fused_kernels",
            False,
            "log-probs from Megatron's vocab-parallel logits (vocab_parallel_log_probs_from_logits), as profiled",
        )
    ]


def _verl_sequence_parallel(run: RunConfig, a: Assumptions, critic: bool) -> list[Key]:
    """The Ulysses size profiled (NOTE [ verl multiplies by the Ulysses size ]), when it or the config's is above 1."""
    sp = a.sharding.sequence_parallel
    if sp == 1 and (run.batch.sequence_parallel or 1) == 1:
        return []
    keys = [
        Key(
            _V_ENGINE + "ulysses_sequence_parallel_size",
            sp,
            f"each micro-batch split over {sp} GPUs (Ulysses), as profiled" if sp > 1 else "sequences unsplit, as profiled",
        ),
        # FSDPActorConfig.__post_init__: the deprecated actor key, when > 1, overrides the engine's
        Key(_V_ACTOR + "ulysses_sequence_parallel_size", sp, "the same (verl reads this one first when > 1)"),
    ]
    if critic:
        keys.append(Key(_V_CRITIC_ENGINE + "ulysses_sequence_parallel_size", sp))
    return keys


def _verl_precision(a: Assumptions, critic: bool) -> list[Key]:
    """model_dtype and mixed_precision: FSDPEngine._build_module loads in model_dtype, _build_fsdp_module casts by mixed_precision."""
    dtype = a.trained_dtype
    bf16 = a.sharding.mixed_precision == "bf16"
    param, reduce = ("bf16", "fp32") if bf16 else (dtype, dtype)
    buffer = "fp32" if bf16 else dtype
    what = (
        "bf16 compute, fp32 gradient reduction" if bf16 else f"compute and reduction in {dtype}: no mixed precision"
    )
    keys = []
    for engine in (_V_ENGINE, *([_V_CRITIC_ENGINE] if critic else [])):
        keys += [
            Key(
                engine + "model_dtype",
                dtype,
                f"parameters stored in {dtype} ({_V_SRC} _build_module)" if engine == _V_ENGINE else "",
            ),
            Key(
                engine + "mixed_precision.param_dtype",
                param,
                f"{what} ({_V_SRC} _build_fsdp_module)" if engine == _V_ENGINE else "",
            ),
            Key(engine + "mixed_precision.reduce_dtype", reduce),
            Key(engine + "mixed_precision.buffer_dtype", buffer),
        ]
    if "reference" in a.roles:
        keys.append(Key(_V_REF_ENGINE + "model_dtype", a.dtypes["reference"], "the reference's stored dtype"))
    return keys


def _verl_head(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """use_fused_kernels, or verl's own head: the engine's entropy keys (prepare_model_outputs)."""
    target = "verl"
    fix = "drop --logprobs (the config's head), or pass --logprobs verl or --logprobs fused"
    check_head(
        target,
        a,
        ("verl", "fused"),
        "verl computes log-probs with its own head (or, with use_fused_kernels, from the hidden states), which has no "
        "key for batchfit's or another framework's",
        fix,
    )
    if a.head == "fused":
        return [
            Key(
                _V_MODEL + "use_fused_kernels",
                True,
                "log-probs from the hidden states, profiled with batchfit's fused head",
            )
        ]
    head = a.head
    assert isinstance(head, FrameworkHead)  # check_head let only verl's head through
    modes = {head.entropy, head.forward_entropy} - {"none"}
    if len(modes) > 1:
        raise refuse(
            target,
            f"--logprobs with {head.entropy} entropy in the update and {head.forward_entropy} in the log-prob pass",
            "verl's engine computes both passes' entropy one way (entropy_checkpointing, "
            "entropy_from_logits_with_chunking)",
            fix,
        )
    mode = modes.pop() if modes else "full"
    keys = [
        Key(_V_MODEL + "use_fused_kernels", False, f"log-probs from the logits: {head.describe()}"),
        Key(_V_ENGINE + "entropy_checkpointing", mode == "checkpointed", f"entropy computed {mode}"),
        Key(_V_ENGINE + "entropy_from_logits_with_chunking", mode == "chunked"),
    ]
    if mode == "chunked":
        keys.append(Key(_V_ENGINE + "entropy_from_logits_chunk_size", head.entropy_chunk_size))
    in_update = head.entropy != "none"
    algorithm = (
        f"the update computes {'an' if in_update else 'no'} entropy (actor.calculate_entropy or entropy_coeff != 0), "
        f"{'in the loss' if head.entropy_in_loss else 'not in the loss'}; the old-log-prob pass "
        f"{'computes' if head.forward_entropy != 'none' else 'skips'} it; temperature {head.temperature:g}"
    )
    if same:
        own = (
            run.entropy != "none",
            run.entropy_in_loss,
            run.forward_entropy != "none",
            float(run.temperature or 1.0),
        )
        if own != (in_update, head.entropy_in_loss, head.forward_entropy != "none", head.temperature):
            raise refuse(
                target,
                f"--logprobs {head.framework}",
                f"the head profiled assumes {algorithm}, but the config's actor.calculate_entropy, entropy_coeff, "
                "algorithm.rollout_correction.bypass_mode and rollout.temperature say otherwise (settings of the "
                "algorithm, which emit does not change)",
                "drop --logprobs to profile the config's own head",
            )
    else:
        keys.append(Key("", False, f"the budgets assume verl's head where {algorithm}: keep the config's alike"))
    return keys


def allocator_keys(a: Assumptions) -> list[Key]:
    """verl turns expandable segments on in its trainer itself; the optimizer offload the forward budgets assume."""
    keys = [
        allocator_comment(
            a,
            "verl 0.9.1 switches them on in the trainer after each weight sync (verl/workers/engine_workers.py "
            "update_weights: set_expandable_segments(True)), nothing to set",
        )
    ]
    if a.optimizer_offload:
        # the actor's engine: McoreEngineConfig under Megatron, FSDPEngineConfig else (both read optimizer_offload)
        engine = _V_MCORE if a.sharding.spec.model_parallel else _V_ENGINE
        keys.append(
            Key(
                engine + "optimizer_offload",
                True,
                "the old log-probs' budget holds without the optimizer state on the GPU (BaseEngineCtx: eval_mode "
                "loads the parameters only)",
            )
        )
    return keys
