"""verl's vocabulary (``data.*``, ``actor_rollout_ref.*``, ``critic.*``, ``trainer.*``) in batchfit's terms.

Mirrors verl 0.9.1 and its default V1 trainer (``trainer.use_v1: true``): the generated config
``verl/trainer/config/_generated_ppo_trainer.yaml`` and the dataclasses its ``_target_``
sections build (defaults and key vocabulary, generated into ``defaults/verl.yaml`` and
``defaults/verl_schema.json`` by ``scripts/gen_framework_schemas.py``);
``verl/utils/config.py`` ``validate_config``; the actor and critic configs' checks
(``verl/workers/config/actor.py``, ``critic.py``: ``__post_init__``, ``validate``); the engine
workers that replaced ``fsdp_workers.py`` (``verl/workers/engine_workers.py``,
``verl/workers/engine/fsdp/transformer_impl.py``, ``verl/workers/engine/utils.py``,
``verl/utils/seqlen_balancing.py``) and ``verl/trainer/ppo/v1/trainer_base.py``. The batch
rules live in :mod:`batchfit.frameworks.verl_rules` (framework ``"verl"``).

A Megatron actor (``actor_rollout_ref.actor.strategy: megatron``, what ``model_engine=megatron``
composes) is read from its ``McoreEngineConfig`` (``actor.megatron.*``, ``ref.megatron.*``:
``verl/workers/config/engine.py``, ``trainer/config/engine/megatron.yaml``, the reference's
interpolations of ``_generated_ppo_megatron_trainer.yaml``) and the engine that runs it
(``verl/workers/engine/megatron/transformer_impl.py``): NOTE [ verl's Megatron engine ].

verl's repository moved to the verl-project organisation (github.com/verl-project/verl); its head at 1dda039b
(2026-08-22) was read beside 0.9.1 for the rules that cite it: the engine workers as the only ones (#6067, NOTE
[ Which verl a config is written for ]), ``pad_to_length`` (NOTE [ verl pads packed micro-batches to a bucket ]),
dynamic context parallelism (refused: ``_REFUSAL_WHY``), ``force_group_size`` (batch data, no config key:
``verl/workers/engine/utils.py`` ``prepare_micro_batches`` reads it with ``tu.get_non_tensor_data``, and no trainer
sets it). The generated config of the head has the same batch keys as 0.9.1's.

Units: verl counts ``train_batch_size`` and ``ppo_mini_batch_size`` in prompts (the trainer
multiplies by ``rollout.n``), micro sizes in samples per GPU, token lengths per GPU.
"""

from __future__ import annotations

import math
from typing import Any

from batchfit.frameworks.megatron_refusals import first_refusal, refused_sources
from batchfit.frameworks.registry import FrameworkSpec
from batchfit.frameworks.run import (
    RunConfig,
    as_bool,
    as_int,
    differing_warnings,
    dtype_name,
    every_fault,
    is_positive_int,
    size_faults,
    unmodelled_warnings,
)
from batchfit.frameworks.source import flatten, framework_defaults, framework_schema
from batchfit.frameworks.verl_rules import VERL
from batchfit.frameworks.your_sizes import verl_sizes
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import ENGINES, RolloutEngine
from batchfit.validation import as_number, short_repr

MODEL = "actor_rollout_ref.model."
ACTOR = "actor_rollout_ref.actor."
ENGINE = ACTOR + "fsdp_config."  # what the actor's FSDP engine reads (FSDPActorConfig.engine)
REF = "actor_rollout_ref.ref."
ROLLOUT = "actor_rollout_ref.rollout."
CRITIC = "critic."
CRITIC_ENGINE = "critic.fsdp."  # FSDPCriticConfig.engine
MCORE = ACTOR + "megatron."  # McoreActorConfig.megatron: the actor's McoreEngineConfig (its .engine)
REF_MCORE = REF + "megatron."
WORLD = "trainer.nnodes × trainer.n_gpus_per_node"
VLLM_MAX_LORA_RANK = 512  # verl/workers/rollout/vllm_rollout/utils.py get_vllm_max_lora_rank's fallback

# BatchConfig field -> the verl key it is read from (for messages in verl's words).
KEY_NAMES = {
    "train_batch_size": "data.train_batch_size",
    "policy_mini_batch_size": ACTOR + "ppo_mini_batch_size",
    "n_samples_per_prompt": ROLLOUT + "n",
    "micro_train_batch_size_per_gpu": ACTOR + "ppo_micro_batch_size_per_gpu",
    "micro_forward_batch_size_per_gpu": ROLLOUT + "log_prob_micro_batch_size_per_gpu",
    "max_tokens_per_micro_batch": ACTOR + "ppo_max_token_len_per_gpu",
    "update_epochs_per_batch": ACTOR + "ppo_epochs",
    "critic_mini_batch_size": "critic.ppo_mini_batch_size",
    "sequence_parallel": ENGINE + "ulysses_sequence_parallel_size",
    "world_size": WORLD,
    "critic_world_size": WORLD,
    "critic_model_parallel": CRITIC_ENGINE + "ulysses_sequence_parallel_size",
}

# Keys that change memory in ways batchfit's budgets do not reproduce: a config that sets one
# away from verl's default gets a warning naming it. Remove a key once profile models it.
# ("prefix.*" stands for every key below an open section.) Modelled, so not listed: the FSDP
# LoRA keys lora_rank, lora_alpha, target_modules (RunConfig.lora, critic_lora),
# use_remove_padding (remove_padding: the probe's cost), use_fused_kernels and the entropy keys
# calculate_entropy, entropy_coeff, entropy_from_logits_with_chunking, *_chunk_size,
# entropy_checkpointing (the entropy fields: batchfit.frameworks.run_step), the actor's offload,
# reshard_after_forward, model_dtype and mixed_precision, gradient checkpointing (read into
# RunConfig; a critic key of these that differs from the actor's is a warning of its own,
# CRITIC_SAME), the reference's model_dtype, enable_activation_offload (RunConfig.activation_offload:
# batchfit.train.activation_offload runs verl's enable_activation_offloading).
_SAME = "as for the actor"
UNMODELLED: dict[str, str] = {
    MODEL + "exclude_modules": "layers left without LoRA adapters (batchfit adapts every target module)",
    MODEL + "lora.rank": "Megatron's LoRA adapters (batchfit models the FSDP engine's lora_rank)",
    MODEL
    + "fused_kernel_options.impl_backend": "the fused kernels' implementation (measured with batchfit's "
    "fused head)",
    MODEL + "use_liger": "Liger kernels (RMSNorm, SwiGLU, RoPE) keep other activations",
    MODEL + "tiled_mlp.enabled": "the MLP computed in shards (TiledMLP)",
    MODEL
    + "override_config.*": "overrides of the model's Hugging Face config (batchfit profiles its config.json "
    "as it is)",
    ENGINE
    + "use_torch_compile": "torch.compile of the entropy (fuses its [tokens, vocab] temporaries; measured "
    "eagerly)",
    ACTOR
    + "use_torch_compile": "torch.compile of the entropy (fuses its [tokens, vocab] temporaries; measured "
    "eagerly)",
    ENGINE + "dtype": "the compute (autocast) dtype",
    CRITIC_ENGINE + "ulysses_sequence_parallel_size": "Ulysses sequence parallelism for the critic",
    ENGINE + "fsdp_size": "hybrid sharding: state sharded over fsdp_size GPUs, not all of them",
    ENGINE + "forward_prefetch": "the next unit's parameters gathered while one computes",
    ENGINE + "wrap_policy.*": "how the model is wrapped into FSDP units (batchfit wraps each decoder layer)",
    CRITIC_ENGINE + "fsdp_size": _SAME,
}

# The critic's keys batchfit profiles with the actor's value (one Sharding and one checkpointing
# setting for every model of a run): a critic that differs gets a warning naming both.
CRITIC_SAME = {
    CRITIC + "strategy": ACTOR + "strategy",
    CRITIC_ENGINE + "pad_to_length": ENGINE + "pad_to_length",
    CRITIC_ENGINE + "pad_to_length_bucket": ENGINE + "pad_to_length_bucket",
    CRITIC_ENGINE + "offload_policy": ENGINE + "offload_policy",
    CRITIC_ENGINE + "reshard_after_forward": ENGINE + "reshard_after_forward",
    CRITIC_ENGINE + "model_dtype": ENGINE + "model_dtype",
    CRITIC_ENGINE + "mixed_precision.param_dtype": ENGINE + "mixed_precision.param_dtype",
    CRITIC_ENGINE + "mixed_precision.reduce_dtype": ENGINE + "mixed_precision.reduce_dtype",
    CRITIC + "model.enable_gradient_checkpointing": MODEL + "enable_gradient_checkpointing",
    CRITIC + "model.enable_activation_offload": MODEL + "enable_activation_offload",
}
# verl/workers/config/engine.py FSDPEngineConfig.model_dtype, and the mixed precision
# FSDPEngine._build_fsdp_module uses when the config's mixed_precision leaves a dtype out
# (verl/workers/engine/fsdp/transformer_impl.py: param bf16, reduce fp32, buffer fp32).
DEFAULT_MODEL_DTYPE = "fp32"
DEFAULT_PARAM_DTYPE, DEFAULT_REDUCE_DTYPE = "bf16", "fp32"

# NOTE [ verl's Megatron engine ]
# verl 0.9.1 trains a Megatron actor with MegatronEngine (verl/workers/engine/megatron/transformer_impl.py), built
# from the McoreEngineConfig under actor_rollout_ref.actor.megatron (the reference's under ref.megatron):
# - mpu.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size,
#   expert_model_parallel_size, ...) in _init_device_mesh: data parallel is the rest of the GPUs, dp = world /
#   (tp · pp · cp) (validate_config's megatron_dp), and the trainer pads and splits each step over that dp.
# - sequence_parallel (Megatron's: the activations outside attention split over the TP group) and
#   use_distributed_optimizer (the optimizer state sharded over dp) go into the TransformerConfig and the DDP /
#   optimizer configs (_build_tf_config, _build_megatron_module, _build_optimizer); McoreEngineConfig.__post_init__
#   turns sequence_parallel off at tensor_model_parallel_size 1.
# - the token lengths: forward_backward_batch sets sp_size = context_parallel_size and prepare_micro_batches
#   (verl/workers/engine/utils.py) packs max_token_len = max_token_len_per_gpu × sp_size tokens per micro-batch, the
#   actor's from ppo_max_token_len_per_gpu, its log-prob pass's from rollout.log_prob_max_token_len_per_gpu and the
#   reference's from ref.log_prob_max_token_len_per_gpu (engine_workers.py init_model). A micro-batch runs whole on
#   every GPU of its tensor × pipeline group (TP splits the weights and, with SP, the activations; PP the layers).
# - recompute comes from override_transformer_config (recompute_granularity, recompute_method,
#   recompute_num_layers); HFModelConfig.enable_gradient_checkpointing is read by the FSDP engine only.
# - the parameters are in McoreEngineConfig.dtype (bfloat16 or float16; __post_init__ asserts it).
# batchfit's defaults are ppo_trainer.yaml's FSDP composition, which has no megatron sections: MCORE_DEFAULTS are
# engine/megatron.yaml's values, and REF_FROM_ACTOR the reference keys _generated_ppo_megatron_trainer.yaml
# interpolates from the actor's (${oc.select:actor_rollout_ref.actor.megatron.<key>, ...}).
MCORE_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,  # null: Megatron's default, the tensor-parallel size
    "virtual_pipeline_model_parallel_size": None,
    "sequence_parallel": True,
    "use_distributed_optimizer": True,
    "param_offload": False,
    "optimizer_offload": False,
    "dtype": "bfloat16",
    "use_megatron_fsdp": False,
    "dynamic_context_parallel": False,
    "max_seqlen_per_dp_cp_rank": None,
    "pad_to_length": False,
    "pad_to_length_bucket": 512,  # McoreEngineConfig (verl/workers/config/engine.py)
    "override_transformer_config.recompute_granularity": None,
    "override_transformer_config.recompute_method": None,
    "override_transformer_config.recompute_num_layers": None,
}
REF_FROM_ACTOR = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "param_offload",
    "pad_to_length",  # _generated_ppo_megatron_trainer.yaml: ${oc.select:actor_rollout_ref.actor.megatron.pad_to_length,False}
    "pad_to_length_bucket",
)
# megatron_actor.yaml: the engine's entropy keys interpolate the actor's (${oc.select:actor_rollout_ref.actor.<key>})
MCORE_ENTROPY = ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size")
# Megatron keys that change memory in ways batchfit's Megatron profile does not reproduce (beside UNMODELLED, which
# holds the FSDP engine's); judged against MCORE_DEFAULTS.
MCORE_UNMODELLED: dict[str, str] = {
    MCORE + "use_megatron_fsdp": "Megatron-FSDP (parameters sharded ZeRO-3 style over data parallel)",
    MCORE + "override_ddp_config.*": "Megatron DDP's buffers as overridden (bucket sizes, gradient dtype)",
    MCORE + "override_mcore_model_config.*": "overrides of Megatron's model config",
    MCORE + "qat.enable": "quantisation-aware training",
}
# What the actor's key names in messages under Megatron (the plan's dp is Megatron's: world / (tp · pp · cp)).
MCORE_KEY_NAMES = {
    "tensor_parallel": MCORE + "tensor_model_parallel_size",
    "pipeline_parallel": MCORE + "pipeline_model_parallel_size",
    "context_parallel": MCORE + "context_parallel_size",
    "expert_parallel": MCORE + "expert_model_parallel_size",
}


def read(data: dict[str, Any], given: dict[str, Any]) -> RunConfig:
    """A resolved verl config (defaults merged) as a :class:`RunConfig`.

    Args:
        data: the user's config merged over verl's defaults, interpolations resolved.
        given: the user's own keys (flattened); their values are read from ``data``.

    Raises:
        BatchConfigError: a key that is a close misspelling of one of verl's (with the key
            meant), together with every other fault of the config.
    """
    flat = flatten(data)
    given = {key: flat.get(key, value) for key, value in given.items()}
    schema = framework_schema("verl")
    misspelt, warnings = schema.check_keys(given, ignore=BatchConfig.fields())
    faults: list[str] = []

    def get(key: str) -> Any:
        return as_int(flat.get(key))

    n = get(ROLLOUT + "n")
    nnodes, per_node = get("trainer.nnodes"), get("trainer.n_gpus_per_node")
    world = nnodes * per_node if isinstance(nnodes, int) and isinstance(per_node, int) else None
    strategy = flat.get(ACTOR + "strategy")
    megatron = strategy == "megatron"
    # NOTE [ verl's Megatron engine ]: the actor's McoreEngineConfig, and the reference's (defaulting to the actor's)
    mcore = _mcore(flat, MCORE) if megatron else {}
    ref_mcore = _mcore(flat, REF_MCORE, mcore) if megatron else {}
    # FSDPActorConfig.__post_init__: the deprecated actor key, when > 1, overrides the engine's
    sp = get(ACTOR + "ulysses_sequence_parallel_size")
    # messages name the key the config set (issue 40): the actor's, when it is the one in force
    key_names = {**KEY_NAMES, "sequence_parallel": ACTOR + "ulysses_sequence_parallel_size"} if isinstance(sp, int) and sp > 1 else KEY_NAMES
    if not (isinstance(sp, int) and sp > 1):
        sp = get(ENGINE + "ulysses_sequence_parallel_size") or 1
    if megatron:  # McoreActorConfig has no Ulysses size: Megatron's parallel sizes name the plan's model parallelism
        sp = 1
        key_names = {k: v for k, v in KEY_NAMES.items() if k not in ("sequence_parallel", "critic_model_parallel")}
        key_names.update(MCORE_KEY_NAMES)
    dynamic = as_bool(flat.get(ACTOR + "use_dynamic_bsz")) is True
    prompt, response = get("data.max_prompt_length"), get("data.max_response_length")
    max_seq_len = prompt + response if isinstance(prompt, int) and isinstance(response, int) else None
    remove_padding = as_bool(flat.get(MODEL + "use_remove_padding"))
    reference = (
        as_bool(flat.get(ACTOR + "use_kl_loss")) is True
        or as_bool(flat.get("algorithm.use_kl_in_reward")) is True
    )
    critic = _uses_critic(flat)

    micro = _micro_size(
        flat, ACTOR, "ppo_micro_batch_size", "actor", dynamic, engine_reads=True, faults=faults
    )
    forward = _micro_size(
        flat, ROLLOUT, "log_prob_micro_batch_size", "rollout", dynamic, engine_reads=True, faults=faults
    )
    if reference:
        ref_dynamic = as_bool(flat.get(REF + "log_prob_use_dynamic_bsz")) is True
        _micro_size(
            flat,
            REF,
            "log_prob_micro_batch_size",
            "ref",
            dynamic,
            engine_reads=not ref_dynamic,
            faults=faults,
        )
    _check_dynamic(flat, dynamic, faults)
    if not megatron:
        _check_sequence_parallel(flat, sp, remove_padding, "actor", faults)
    used = {k: v for k, v in flat.items() if critic or not k.startswith(CRITIC)}  # an unused critic is not read
    faults += size_faults(used, ("ulysses_sequence_parallel_size",), schema.title, "sequence-parallel sizes")
    values: dict[str, Any] = {
        "train_batch_size": get("data.train_batch_size"),
        "policy_mini_batch_size": get(ACTOR + "ppo_mini_batch_size"),
        "n_samples_per_prompt": n,
        "max_tokens_per_micro_batch": get(ACTOR + "ppo_max_token_len_per_gpu") if dynamic else None,
        "update_epochs_per_batch": get(ACTOR + "ppo_epochs"),
        "num_nodes": nnodes,
        "gpus_per_node": per_node,
        "sequence_parallel": sp,
    }
    if megatron:
        values.update(_megatron_sizes(mcore))
        faults += size_faults(
            {MCORE + k: v for k, v in mcore.items()} | {REF_MCORE + k: v for k, v in ref_mcore.items()},
            ("_model_parallel_size", "context_parallel_size"),
            schema.title,
            "Megatron's parallel sizes",
        )
    if micro is not None:
        values["micro_train_batch_size_per_gpu"] = micro
    if forward is not None:
        values["micro_forward_batch_size_per_gpu"] = forward
    critic_sp = get(CRITIC_ENGINE + "ulysses_sequence_parallel_size") or 1
    if critic:
        values["critic_mini_batch_size"] = get(CRITIC + "ppo_mini_batch_size")
        values["critic_world_size"] = world  # the critic shares the global resource pool
        values["critic_model_parallel"] = critic_sp
        _check_critic(flat, values, world, faults)
        _check_sequence_parallel(
            flat, critic_sp, as_bool(flat.get(CRITIC + "model.use_remove_padding")), "critic", faults
        )
    # the factor verl multiplies each per-GPU token length by: the Ulysses size (FSDP), context parallelism (Megatron)
    factor = (as_int(mcore["context_parallel_size"]), "context_parallel_size") if megatron else (sp, "sequence-parallel size")
    _check_token_lengths(flat, max_seq_len, dynamic, reference, critic, factor, (critic_sp, "sequence-parallel size"), faults)
    lora = _lora(flat, strategy)
    critic_lora = _lora(flat, flat.get(CRITIC + "strategy"), model=CRITIC + "model.") if critic else None
    _check_lora(flat, faults)
    if as_bool(flat.get("trainer.use_v1")) is False:
        warnings.append(
            "trainer.use_v1=false runs verl's deprecated legacy trainer (main_ppo_v0.py), whose batch rules differ "
            "(no padding rows: train_batch_size must be a multiple of ppo_mini_batch_size); batchfit mirrors the V1 "
            "trainer: set trainer.use_v1=true, or check the plan by hand"
        )
    refused: dict[str, str] = {}
    if megatron:
        _check_megatron_batch(values, world, dynamic, micro, faults)
        refused = _megatron_refusals(flat, mcore, critic, lora)
        faults += _dynamic_cp_faults(mcore)
        warnings += _megatron_warnings(flat, given, mcore, ref_mcore, reference, schema.title)
        entropy, forward_entropy, chunk = _megatron_entropy(flat, mcore)
        mixed_precision, dtype = None, dtype_name(mcore["dtype"])
        checkpointing = _recompute(mcore, warnings)
    else:
        entropy, forward_entropy, chunk = _entropy(flat, remove_padding)
        warnings += unmodelled_warnings(given, framework_defaults("verl"), UNMODELLED, schema.title)
        mixed_precision, dtype = _precision(flat, given, warnings)
        checkpointing = as_bool(flat.get(MODEL + "enable_gradient_checkpointing"))
    entropy_in_loss = as_number(flat.get(ACTOR + "entropy_coeff")) != 0
    if critic:
        warnings += differing_warnings(flat, CRITIC_SAME, "the critic", "the actor's", schema.title)
    roles = ["policy", *(["reference"] if reference else []), *(["critic"] if critic else [])]
    resident = {
        "policy": _kept(mcore, "", optimizer=True) if megatron else _kept(flat, ENGINE, optimizer=True),
        "reference": _kept(ref_mcore, "", optimizer=False) if megatron else _kept(flat, REF + "fsdp_config.", optimizer=False),
        "critic": _kept(flat, CRITIC_ENGINE, optimizer=True),
    }
    resident = {role: kept for role, kept in resident.items() if role in roles}
    notes: list[str] = version_notes(given)
    token_bucket = _token_bucket(flat, mcore, ref_mcore, remove_padding, reference, warnings, faults)
    run = RunConfig(
        vocabulary="verl",
        batch=BatchConfig(**values, framework="verl"),
        model=flat.get(MODEL + "path"),
        critic_model=flat.get(CRITIC + "model.path") if critic else None,
        reference=reference,
        max_seq_len=max_seq_len,
        max_response_len=response if isinstance(response, int) else None,
        strategy=strategy,
        # engine_workers: offload_policy is FSDP2's CPUOffloadPolicy (the sharded state lives on the
        # host); param_offload / optimizer_offload move state to the host between phases only.
        # Megatron's param_offload / optimizer_offload move state to the host between phases only (resident)
        offload="cpu" if not megatron and as_bool(flat.get(ENGINE + "offload_policy")) is True else "none",
        reshard_after_forward=None if megatron else _bool_or_none(flat.get(ENGINE + "reshard_after_forward")),
        mixed_precision=mixed_precision,
        dtype=dtype,
        # the reference's engine is composed from the same engine/fsdp.yaml (model_dtype: fp32) whether
        # the file sets the key (a dumped config) or leaves it to its group (ppo_trainer.yaml); Megatron's
        # from engine/megatron.yaml (dtype: bfloat16)
        reference_dtype=dtype_name(ref_mcore["dtype"])
        if megatron
        else dtype_name(flat.get(REF + "fsdp_config.model_dtype")) or DEFAULT_MODEL_DTYPE,
        gradient_checkpointing=checkpointing,
        # fsdp_workers.py: enable_activation_offloading(module, strategy, enable_gradient_checkpointing), FSDP only
        activation_offload=None if megatron else as_bool(flat.get(MODEL + "enable_activation_offload")),
        megatron_sequence_parallel=megatron and _megatron_sequence_parallel(mcore),
        distributed_optimizer=megatron and as_bool(mcore["use_distributed_optimizer"]) is True,
        virtual_pipeline_parallel=as_int(mcore["virtual_pipeline_model_parallel_size"]) if megatron else None,
        # NOTE [ Megatron's mixture of experts on CPU ranks ] in batchfit.models.moe_megatron: verl's
        # mpu.initialize_model_parallel(expert_model_parallel_size=...) (MegatronEngine._init_device_mesh)
        expert_parallel=_expert_parallel(mcore) if megatron else 1,
        # McoreEngineConfig.expert_tensor_parallel_size (null: Megatron's default, the tensor-parallel size)
        expert_tensor_parallel=_positive_or_none(mcore["expert_tensor_parallel_size"]) if megatron else None,
        # the router fields override_transformer_config sets (NOTE [ verl's Megatron router ])
        megatron_router=_megatron_router(flat) if megatron else {},
        # the actor's Megatron optimizer: precision-aware with its dtypes, CPU offload (NOTE [ verl's Megatron optimizer ])
        **(_megatron_optimizer(flat, warnings) if megatron else {}),
        remove_padding=remove_padding if isinstance(remove_padding, bool) else None,
        critic_remove_padding=as_bool(flat.get(CRITIC + "model.use_remove_padding")) if critic else None,
        fused_kernels=as_bool(flat.get(MODEL + "use_fused_kernels")) is True,
        entropy=entropy,
        entropy_chunk_size=chunk,
        entropy_grad=entropy != "none",  # the update runs with gradients: a computed entropy keeps its graph
        entropy_in_loss=entropy_in_loss,
        forward_entropy=forward_entropy,
        temperature=flat.get(ROLLOUT + "temperature"),
        lora=lora,
        critic_lora=critic_lora,
        # actor, rollout and reference share one worker; the critic shares the global pool
        colocated=tuple(roles) if len(roles) > 1 else (),
        resident=resident,
        # the hybrid engine: the rollout generates on the actor's GPUs, whose models keep what they do not offload
        generation_resident=resident,
        engine=_engine(flat, lora, notes),
        # engine_workers.update_weights turns expandable segments on for the trainer after each weight sync
        # (set_expandable_segments(True), verl/workers/engine_workers.py): the log-prob and update passes run with them
        allocator="expandable_segments",
        # BaseEngineCtx._context_switch: eval_mode (compute_log_prob) loads the parameters only, train_mode the optimizer
        optimizer_offload=as_bool(mcore["optimizer_offload"] if megatron else flat.get(ENGINE + "optimizer_offload")) is True,
        token_bucket=token_bucket,
        notes=tuple(notes),
        faults=tuple(faults),
        warnings=tuple(warnings),
        key_names=key_names,
        # issue 40 item 9: the sizes the config sets, put beside batchfit's budgets (your_sizes.compare)
        configured=verl_sizes(flat, reference=reference, critic=critic),
        source={
            "max_seq_len": "data.max_prompt_length + data.max_response_length",
            "world_size": WORLD,
            "model": MODEL + "path",
            "remove_padding": MODEL + "use_remove_padding",
            "fused_kernels": MODEL + "use_fused_kernels",
            "entropy": ACTOR + "calculate_entropy, entropy_coeff; " + (MCORE if megatron else ENGINE) + "entropy_*",
            "lora": MODEL + ("lora.*" if megatron else "lora_rank, lora_alpha, target_modules, exclude_modules"),
            **(
                {
                    "gradient_checkpointing": MCORE + "override_transformer_config.recompute_*",
                    "tensor_parallel": MCORE + "tensor_model_parallel_size",
                    "pipeline_parallel": MCORE + "pipeline_model_parallel_size",
                    "virtual_pipeline_parallel": MCORE + "virtual_pipeline_model_parallel_size",
                    "megatron_sequence_parallel": MCORE + "sequence_parallel",
                    "distributed_optimizer": MCORE + "use_distributed_optimizer",
                }
                if megatron
                else {}
            ),
            # NOTE [ What a Megatron profile refuses ]: "refused:<setting>" → the key=value it was read from
            **refused_sources(refused),
        },
    )
    if misspelt:
        every_fault(run, misspelt)
    return run


def _precision(flat: dict[str, Any], given: dict[str, Any], warnings: list[str]) -> tuple[str | None, str | None]:
    """The actor's mixed precision and parameter dtype in :class:`~batchfit.parallel.Sharding`'s terms.

    verl 0.9.1 loads the actor in ``fsdp_config.model_dtype`` (default fp32,
    ``FSDPEngine._build_module``) and wraps it with ``MixedPrecisionPolicy(param_dtype,
    reduce_dtype)`` from ``fsdp_config.mixed_precision`` (default bf16 / fp32,
    ``_build_fsdp_module``; FSDP1's ``MixedPrecision`` the same). batchfit's ``bf16`` is
    param bf16 with reduce fp32; ``none`` is both in the parameters' dtype (a policy that casts
    nothing). ``(None, dtype)`` when no mixed-precision key is given; another combination is a
    warning naming it, and profile's default is kept.
    """
    dtype = dtype_name(flat.get(ENGINE + "model_dtype")) or DEFAULT_MODEL_DTYPE
    if dtype not in ("fp32", "bf16"):
        warnings.append(
            f"{ENGINE}model_dtype={flat.get(ENGINE + 'model_dtype')!r}: batchfit stores parameters in fp32 or bf16; the "
            "budgets keep profile's default dtype"
        )
        return None, None
    keys = [ENGINE + "mixed_precision.param_dtype", ENGINE + "mixed_precision.reduce_dtype"]
    if not any(k in given for k in keys):
        return None, dtype
    param = dtype_name(flat.get(keys[0])) or DEFAULT_PARAM_DTYPE
    reduce = dtype_name(flat.get(keys[1])) or DEFAULT_REDUCE_DTYPE
    if (param, reduce) == ("bf16", "fp32"):
        return "bf16", dtype
    if param == reduce == dtype:
        return "none", dtype
    warnings.append(
        f"{ENGINE}model_dtype={dtype}, mixed_precision.param_dtype={param}, reduce_dtype={reduce}: batchfit models "
        "FSDP mixed precision as param bf16 with reduce fp32, or none (both in the parameters' dtype, fp32 or bf16); "
        "the budgets keep its default (bf16 compute, fp32 reduce)"
    )
    return None, None


def _bool_or_none(value: Any) -> bool | None:
    value = as_bool(value)
    return value if isinstance(value, bool) else None


def _kept(flat: dict[str, Any], prefix: str, *, optimizer: bool) -> tuple[str, ...]:
    """The state a model keeps on its GPUs while a colocated one runs (not offloaded)."""
    kept = [] if as_bool(flat.get(prefix + "param_offload")) is True else ["parameters"]
    if optimizer and as_bool(flat.get(prefix + "optimizer_offload")) is not True:
        kept.append("optimizer_state")
    return tuple(kept)


def _engine(flat: dict[str, Any], lora: dict[str, Any] | None, notes: list[str]) -> RolloutEngine:
    """The rollout engine as verl 0.9.1 runs it: on the actor's GPUs (its hybrid mode), asleep between generations.

    ``verl/workers/rollout/llm_server.py``: with a trainer, every vLLM or SGLang replica is
    ``init_hybrid`` (the trainer's GPUs). ``vllm_async_server.py``: the engine runs in processes of
    its own (``distributed_executor_backend="mp"``) with ``enable_sleep_mode``; ``sleep()`` frees
    it only with ``free_cache_engine``, at level 2 (1 for LoRA adapters, ``_resolve_sleep_level``);
    ``enforce_eager`` captures no graphs, ``cudagraph_capture_sizes`` replaces vLLM's list.
    SGLang (``async_sglang_server.py``) releases ``kv_cache`` and ``weights``: its graph pool stays.
    """
    name = flat.get(ROLLOUT + "name")
    if name not in ENGINES:
        notes.append(
            f"{ROLLOUT}name={short_repr(name)}: the budgets take off what a sleeping vLLM engine keeps (verl requires "
            "vllm or sglang there)"
        )
        name = "vllm"
    sleeps = as_bool(flat.get(ROLLOUT + "free_cache_engine")) is not False and (
        as_bool(flat.get(ROLLOUT + "enable_sleep_mode")) is not False
    )
    sizes = flat.get(ROLLOUT + "cudagraph_capture_sizes")
    keys = {
        "tensor_parallel": ROLLOUT + "tensor_model_parallel_size",
        "memory_fraction": ROLLOUT + "gpu_memory_utilization",
        "capture_sizes": ROLLOUT + "cudagraph_capture_sizes",
        "max_num_seqs": ROLLOUT + "max_num_seqs",
        "sleeps": ROLLOUT + "free_cache_engine",
        "cuda_graphs": ROLLOUT + "enforce_eager",
        "offload": f"set {ENGINE}param_offload=true and optimizer_offload=true (the actor's state leaves the GPUs "
        "while the engine generates)",
    }
    return RolloutEngine(
        name=name,
        colocated=True,
        tensor_parallel=as_int(flat.get(ROLLOUT + "tensor_model_parallel_size")) or 1,
        memory_fraction=as_number(flat.get(ROLLOUT + "gpu_memory_utilization")),
        sleeps=sleeps,
        sleep_level=(1 if lora else 2) if name == "vllm" else None,
        cuda_graphs=as_bool(flat.get(ROLLOUT + "enforce_eager")) is not True,
        capture_sizes=tuple(as_int(x) for x in sizes) if isinstance(sizes, (list, tuple)) else sizes,
        max_num_seqs=as_int(flat.get(ROLLOUT + "max_num_seqs")),
        releases_graphs=False,
        own_process=True,
        keys=keys,
    )


def _uses_critic(flat: dict[str, Any]) -> bool:
    """verl trainer/ppo/utils.py ``need_critic``: ``critic.enable`` if set, else GAE advantages."""
    enable = as_bool(flat.get("critic.enable"))
    if enable is not None:
        return enable is True
    return flat.get("algorithm.adv_estimator") == "gae"


def _micro_size(
    flat: dict[str, Any],
    prefix: str,
    name: str,
    section: str,
    dynamic: bool,
    *,
    engine_reads: bool,
    faults: list[str],
) -> int | None:
    """The per-GPU micro size ``<name>_per_gpu`` of a section, and verl's checks on it.

    Without the actor's dynamic batch sizes verl needs exactly one of ``<name>`` and
    ``<name>_per_gpu`` (``ActorConfig.__post_init__`` for the actor, ``validate_config``'s
    ``check_mutually_exclusive`` for the rollout and the reference). The engine workers then
    read only ``<name>_per_gpu`` (``engine_workers.py`` ``init_model`` asserts it is set for the
    actor and the rollout; the reference's engine fails on ``None`` at its first micro-batch),
    so the deprecated global size alone is refused too.
    """
    per_gpu, global_ = as_int(flat.get(prefix + name + "_per_gpu")), as_int(flat.get(prefix + name))
    key, per_gpu_key = prefix + name, prefix + name + "_per_gpu"
    if dynamic:
        return per_gpu
    who = "ActorConfig.__post_init__" if section == "actor" else "validate_config (check_mutually_exclusive)"
    if per_gpu is None and global_ is None:
        faults.append(
            f"[{section}] neither {per_gpu_key} nor {key} is set, and actor_rollout_ref.actor.use_dynamic_bsz is "
            f"false: verl 0.9.1 refuses the config at start-up ({who}); set {per_gpu_key} (samples per "
            "forward/backward on one GPU), or use_dynamic_bsz=true with a token length"
        )
        return None
    if per_gpu is not None and global_ is not None:
        faults.append(
            f"[{section}] both {key}={global_} (deprecated) and {per_gpu_key}={per_gpu} are set: verl 0.9.1 refuses "
            f"the config at start-up ({who}); remove {key}"
        )
        return per_gpu
    if per_gpu is None and engine_reads:
        faults.append(
            f"[{section}] only the deprecated {key}={global_} is set: verl 0.9.1's engine workers read only "
            f"{per_gpu_key} (verl/workers/engine_workers.py init_model) and fail without it; set {per_gpu_key} "
            f"instead (samples per GPU, not per step)"
        )
    return per_gpu


def _check_dynamic(flat: dict[str, Any], dynamic: bool, faults: list[str]) -> None:
    """engine_workers.py init_model asserts the rollout's log-prob pass batches as the actor does (verl 0.9.1, and
    l. 615 at verl-project/verl 1dda039b, where the engine workers are the only ones: #6067)."""
    rollout = as_bool(flat.get(ROLLOUT + "log_prob_use_dynamic_bsz")) is True
    if rollout != dynamic:
        faults.append(
            f"actor_rollout_ref.actor.use_dynamic_bsz={dynamic} but {ROLLOUT}log_prob_use_dynamic_bsz={rollout}: "
            "verl 0.9.1 asserts they are equal (verl/workers/engine_workers.py init_model); set both to the same"
        )


def _check_sequence_parallel(
    flat: dict[str, Any], sp: Any, remove_padding: Any, role: str, faults: list[str]
) -> None:
    """FSDPActorConfig.validate and FSDPEngine.__init__: Ulysses needs padding removed."""
    if isinstance(sp, int) and sp > 1 and remove_padding is not True:
        key = MODEL + "use_remove_padding" if role == "actor" else CRITIC + "model.use_remove_padding"
        size = ENGINE if role == "actor" else CRITIC_ENGINE
        faults.append(
            f"{size}ulysses_sequence_parallel_size={sp} needs {key}=true, but it is {short_repr(remove_padding)}: verl 0.9.1 "
            "refuses it at start-up (verl/workers/engine/fsdp/transformer_impl.py FSDPEngine.__init__); set "
            f"{key}=true or the sequence-parallel size to 1"
        )


def _check_critic(flat: dict[str, Any], values: dict[str, Any], world: int | None, faults: list[str]) -> None:
    """CriticConfig.__post_init__ / FSDPCriticConfig.validate (without critic.use_dynamic_bsz).

    The critic's micro sizes are checked at start-up even though its engine batches by
    tokens at run time (trainer_base.py).
    """
    if as_bool(flat.get(CRITIC + "use_dynamic_bsz")) is True:
        return
    per_gpu, global_ = (
        as_int(flat.get(CRITIC + "ppo_micro_batch_size_per_gpu")),
        as_int(flat.get(CRITIC + "ppo_micro_batch_size")),
    )
    per_gpu_key, key = CRITIC + "ppo_micro_batch_size_per_gpu", CRITIC + "ppo_micro_batch_size"
    if per_gpu is None and global_ is None:
        faults.append(
            f"[critic] neither {per_gpu_key} nor {key} is set, and critic.use_dynamic_bsz is false: verl 0.9.1 "
            f"refuses the config at start-up (CriticConfig.__post_init__); set {per_gpu_key}, or "
            "critic.use_dynamic_bsz=true"
        )
        return
    if per_gpu is not None and global_ is not None:
        faults.append(
            f"[critic] both {key}={global_} (deprecated) and {per_gpu_key}={per_gpu} are set (verl's critic.yaml "
            f"copies the first into the second when only it is given): verl 0.9.1 refuses the config at start-up "
            f"(CriticConfig.__post_init__); set {per_gpu_key} alone"
        )
    if isinstance(global_, int) and global_ > 0:
        mini = values.get("critic_mini_batch_size")
        if isinstance(mini, int) and mini % global_:
            faults.append(
                f"critic.ppo_mini_batch_size={mini} is not a multiple of {key}={global_}: verl 0.9.1 refuses it "
                f"(CriticConfig.__post_init__); set {per_gpu_key} instead"
            )
        sp = as_int(flat.get(CRITIC + "ulysses_sequence_parallel_size")) or 1
        if isinstance(world, int) and isinstance(sp, int) and global_ * sp < world:
            faults.append(
                f"{key}={global_} × critic.ulysses_sequence_parallel_size={sp} is below the {world} GPUs: verl 0.9.1 "
                f"refuses it (FSDPCriticConfig.validate); set {per_gpu_key} instead"
            )


def _check_token_lengths(
    flat: dict[str, Any],
    max_seq_len: int | None,
    dynamic: bool,
    reference: bool,
    critic: bool,
    factor: tuple[Any, str],
    critic_factor: tuple[Any, str],
    faults: list[str],
) -> None:
    """rearrange_micro_batches asserts ``max_token_len_per_gpu × factor >= the longest sequence``.

    verl 0.9.1 (verl/workers/engine/utils.py prepare_micro_batches) multiplies the per-GPU
    length by the ``sp_size`` its engine sets: the Ulysses size (FSDP), ``context_parallel_size``
    (Megatron: NOTE [ verl's Megatron engine ]). ``factor``, ``critic_factor``: (size, its name).
    The critic's engine always batches by tokens, with ``critic.ppo_infer_max_token_len_per_gpu``
    for its update and its values (verl/trainer/ppo/v1/trainer_base.py).
    """
    if max_seq_len is None:
        return
    keys: list[tuple[str, tuple[Any, str]]] = []
    if dynamic:
        keys += [(ACTOR + "ppo_max_token_len_per_gpu", factor), (ROLLOUT + "log_prob_max_token_len_per_gpu", factor)]
    if reference and as_bool(flat.get(REF + "log_prob_use_dynamic_bsz")) is True:
        keys.append((REF + "log_prob_max_token_len_per_gpu", factor))
    if critic:
        keys.append((CRITIC + "ppo_infer_max_token_len_per_gpu", critic_factor))
    for key, (size, name) in keys:
        value = as_int(flat.get(key))
        size = size if isinstance(size, int) and size > 0 else 1
        if isinstance(value, int) and value * size < max_seq_len:
            times = f" × {name} {size} = {value * size}" if size > 1 else ""
            faults.append(
                f"{key}={value}{times} is below the longest sequence, data.max_prompt_length + "
                f"data.max_response_length = {max_seq_len}: verl 0.9.1's rearrange_micro_batches refuses it at run "
                f"time (verl/utils/seqlen_balancing.py); set it to at least {-(-max_seq_len // size)}"
            )


def _mcore(flat: dict[str, Any], prefix: str, actor: dict[str, Any] | None = None) -> dict[str, Any]:
    """A model's McoreEngineConfig under ``prefix`` as ``model_engine=megatron`` composes it (NOTE [ verl's Megatron engine ]).

    Each key of :data:`MCORE_DEFAULTS` (and :data:`MCORE_ENTROPY`) is the config's value, else, for the
    reference (``actor`` given), the actor's where ``_generated_ppo_megatron_trainer.yaml`` interpolates it
    (:data:`REF_FROM_ACTOR`), else engine/megatron.yaml's default; the actor's entropy keys default to
    ``actor.entropy_from_logits_*`` (megatron_actor.yaml).
    """
    out = {}
    for key, default in MCORE_DEFAULTS.items():
        if prefix + key in flat:
            out[key] = flat[prefix + key]
        elif actor is not None and key in REF_FROM_ACTOR:
            out[key] = actor[key]
        else:
            out[key] = default
    for key in MCORE_ENTROPY:
        out[key] = flat.get(prefix + key, flat.get(prefix.removesuffix("megatron.") + key))
    return out


def _megatron_sizes(mcore: dict[str, Any]) -> dict[str, Any]:
    """The plan's model parallelism: tensor × pipeline × context (dp = world / their product), no Ulysses axis."""
    return {
        "tensor_parallel": as_int(mcore["tensor_model_parallel_size"]),
        "pipeline_parallel": as_int(mcore["pipeline_model_parallel_size"]),
        "context_parallel": as_int(mcore["context_parallel_size"]),
        "sequence_parallel": 1,
    }


def _megatron_sequence_parallel(mcore: dict[str, Any]) -> bool:
    """McoreEngineConfig.__post_init__: ``sequence_parallel``, turned off at ``tensor_model_parallel_size`` 1."""
    tp = as_int(mcore["tensor_model_parallel_size"])
    return as_bool(mcore["sequence_parallel"]) is True and isinstance(tp, int) and tp > 1


def _check_megatron_batch(
    values: dict[str, Any], world: int | None, dynamic: bool, micro: int | None, faults: list[str]
) -> None:
    """validate_config without use_dynamic_bsz under Megatron: ``train_batch_size × n % (megatron_dp × micro) == 0``.

    ``megatron_dp = n_gpus // (tp · pp · cp)`` (verl/utils/config.py; its divisibility is the plan's mesh
    rule). The FSDP rule (``% n_gpus``) is not verl's here (:func:`batchfit.frameworks.verl_rules.verl_step`
    skips it under model parallelism); at tp · pp · cp = 1 it is, and a fault of its own.
    """
    train, n = values.get("train_batch_size"), values.get("n_samples_per_prompt")
    sizes = [values.get(k) for k in ("tensor_parallel", "pipeline_parallel", "context_parallel")]
    if dynamic or not all(is_positive_int(v) for v in (train, n, world, micro, *sizes)):
        return
    model = math.prod(sizes)
    if world % model:
        return  # the plan's mesh rule names it
    dp = world // model
    minimal = dp * micro
    if train * n % minimal == 0 or (model == 1 and train * n % world):
        return
    step = minimal // math.gcd(n, minimal)
    faults.append(
        f"data.train_batch_size × actor_rollout_ref.rollout.n = {train} × {n} = {train * n} is not divisible by the "
        f"Megatron minimal batch, dp {dp} × {ACTOR}ppo_micro_batch_size_per_gpu {micro} = {minimal} (verl 0.9.1 "
        f"validate_config asserts it without use_dynamic_bsz; dp = {world} GPUs / (tp · pp · cp) = {world} / {model}); "
        f"set data.train_batch_size to a multiple of {step}"
    )


# NOTE [ Which verl a config is written for ]
# verl #6067 (044bbba2, 2026-04-20, first in v0.8.0) deleted the legacy workers (verl/workers/fsdp_workers.py,
# megatron_workers.py) and with them trainer.use_legacy_worker_impl ("auto", "enable", "disable"): only the engine
# workers (engine_workers.py) remain, in verl 0.9.1 and at verl-project/verl 1dda039b alike. A config that sets the
# key is written for a verl before 0.8.0; batchfit reads it as the engine workers run it and --emit verl writes their
# keys (verl 0.9.1's; the head reads them alike). trainer.use_v1=false (the legacy trainer, main_ppo_v0.py, still at
# the head with a deprecation warning) is a warning of its own; the deprecated global micro-batch sizes
# (ppo_micro_batch_size, log_prob_micro_batch_size) are faults (_micro_size).
LEGACY_WORKER_KEY = "trainer.use_legacy_worker_impl"


def version_notes(given: dict[str, Any]) -> list[str]:
    """Which verl the config's keys are written for, and which the emitted keys are (NOTE [ Which verl a config is
    written for ]); empty when the keys say nothing older than verl 0.9.1."""
    if LEGACY_WORKER_KEY not in given:
        return []
    value = given[LEGACY_WORKER_KEY]
    legacy = " and runs the legacy workers, whose micro-batching batchfit does not mirror" if value == "enable" else ""
    return [
        f"{LEGACY_WORKER_KEY}={short_repr(value)} is a key of verl before 0.8.0: #6067 (044bbba2, 2026-04-20) deleted it "
        f"with the legacy workers, so the config is written for an older verl{legacy}; batchfit reads it as verl 0.9.1's "
        "engine workers (engine_workers.py, the only workers at verl-project/verl 1dda039b too) run it, and --emit verl "
        "writes their keys: drop the key for verl 0.9.1"
    ]


# NOTE [ What a Megatron profile refuses ]
# batchfit profiles verl's Megatron actor and reference (batchfit.budget.megatron_probe); a setting it cannot model
# keeps `batchfit plan` answering (verl runs it) but stops `profile`: the reader records it in RunConfig.source as
# "refused:<setting>" → the config's key=value, and SPEC.strategy_refusal (megatron_refusal) turns the first into a
# one-line refusal naming the key, its value and the fix. Refused: a critic (verl's Megatron critic, a value head
# on a GPTModel, is not probed) and Megatron's LoRA (megatron_peft.py adapters on Megatron's linear layers). MoE
# expert parallelism is profiled (expert_model_parallel_size: NOTE [ The Megatron probe's worst rank ] in
# batchfit.budget.megatron_probe). Context parallelism is profiled (NOTE [ Context
# parallelism as Megatron runs it ] in batchfit.models.megatron_context); dynamic_context_parallel is not: NOTE [ verl's
# dynamic context parallelism ].
_REFUSAL_WHY = {
    "critic": (
        "trains a critic beside the Megatron actor (model_engine=megatron composes verl's Megatron critic, a value "
        "head on Megatron's GPTModel), which batchfit's Megatron profile does not model",
        "use a critic-free estimator (algorithm.adv_estimator=grpo), or train with actor_rollout_ref.actor.strategy="
        "fsdp2",
    ),
    "lora": (
        "trains Megatron LoRA adapters (verl/utils/megatron_peft.py), which batchfit's Megatron profile does not model",
        "set it to 0, or train LoRA with actor_rollout_ref.actor.strategy=fsdp2 (lora_rank)",
    ),
    "dynamic_context_parallel": (
        "lets Megatron-Core's DefaultDynamicCPScheduler (Megatron-LM #5154) give each sequence its own context-"
        "parallel group, ceil(length / max_seqlen_per_dp_cp_rank) of the DP x CP ranks, with data parallelism 1 "
        "(verl/utils/dynamic_cp_scheduler.py, megatron/transformer_impl.py get_data_parallel_size; verl-project/verl "
        "1dda039b, #6555): batchfit's Megatron profile runs one fixed context-parallel size, and a rank's micro-batch "
        "under the scheduler is not one it can name",
        "set it to false and a fixed actor_rollout_ref.actor.megatron.context_parallel_size, which batchfit profiles "
        "(--emit verl then writes each length per GPU)",
    ),
}


def _megatron_refusals(
    flat: dict[str, Any], mcore: dict[str, Any], critic: bool, lora: dict[str, Any] | None
) -> dict[str, str]:
    """What a Megatron run sets that ``profile`` refuses (NOTE [ What a Megatron profile refuses ]): setting → key=value."""
    out = {}
    if critic:  # need_critic: critic.enable, else GAE advantages
        enable = as_bool(flat.get("critic.enable"))
        out["critic"] = "critic.enable=True" if enable is True else (
            f"algorithm.adv_estimator={short_repr(flat.get('algorithm.adv_estimator'))}"
        )
    if lora is not None:
        out["lora"] = f"{MODEL}lora.rank={lora['rank']}"
    if as_bool(mcore["dynamic_context_parallel"]) is True:
        cap = mcore["max_seqlen_per_dp_cp_rank"]
        out["dynamic_context_parallel"] = f"{MCORE}dynamic_context_parallel=True" + (
            f" (max_seqlen_per_dp_cp_rank={short_repr(cap)})" if cap is not None else ""
        )
    return out


def _dynamic_cp_faults(mcore: dict[str, Any]) -> list[str]:
    """McoreEngineConfig.__post_init__'s and _check_dcp_unsupported_features' refusals of dynamic context parallelism
    (verl/workers/config/engine.py l. 229, megatron/transformer_impl.py, verl-project/verl 1dda039b)."""
    if as_bool(mcore["dynamic_context_parallel"]) is not True:
        return []
    out = []
    cap = as_int(mcore["max_seqlen_per_dp_cp_rank"])
    if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
        out.append(
            f"{MCORE}dynamic_context_parallel=True with max_seqlen_per_dp_cp_rank={short_repr(cap)}: verl refuses it "
            "('max_seqlen_per_dp_cp_rank must be a positive integer when dynamic_context_parallel is enabled', "
            "McoreEngineConfig); set it to the tokens one DP x CP rank may hold"
        )
    if as_bool(mcore["pad_to_length"]) is True:
        out.append(
            f"{MCORE}dynamic_context_parallel=True with pad_to_length=True: verl raises 'dynamic_context_parallel does "
            "not support pad_to_length' (_check_dcp_unsupported_features); set one of them to false"
        )
    return out


# NOTE [ verl pads packed micro-batches to a bucket ]
# With pad_to_length on and padding removed, verl rounds each packed micro-batch up to a multiple of
# pad_to_length_bucket tokens, on the whole packed sequence before the sequence-parallel split: the FSDP engine
# (actor.pad_to_length, forwarded to fsdp_config.pad_to_length; FSDPEngineConfig.pad_to_length_bucket 1024) in
# verl/workers/engine/fsdp/transformer_impl.py _get_packed_pad_size (ceildiv(n, bucket) × bucket), then ulysses_pad to a
# multiple of ulysses_sequence_parallel_size; the Megatron engine (megatron.pad_to_length, McoreEngineConfig
# pad_to_length_bucket 512, the reference's interpolated from the actor's) in verl/models/mcore/util.py
# preprocess_thd_engine, to a multiple of lcm(bucket, context_parallel_size) (verl-project/verl 1dda039b; the same code
# in verl 0.9.1). The pad tokens run a full forward (engine.py: "they still cost a full forward pass"). A micro-batch
# packed to at most L = max_token_len_per_gpu × factor tokens (factor: the Ulysses or context-parallel size) then runs
# at most L tokens exactly when L is a multiple of lcm(bucket, factor): --emit verl rounds each length down to one
# (verl_emit.bucketed); RunConfig.token_bucket carries the bucket. The reference and the critic pad as the actor does
# (batchfit emits one bucket): one that differs is a warning.
def _token_bucket(
    flat: dict[str, Any],
    mcore: dict[str, Any],
    ref_mcore: dict[str, Any],
    remove_padding: Any,
    reference: bool,
    warnings: list[str],
    faults: list[str],
) -> int | None:
    """The tokens verl pads each packed micro-batch to a multiple of (NOTE [ verl pads packed micro-batches to a bucket ]),
    ``None`` when it pads none."""
    if mcore:
        on, bucket, key = as_bool(mcore["pad_to_length"]), as_int(mcore["pad_to_length_bucket"]), MCORE
        ref_on = as_bool(ref_mcore["pad_to_length"]) if reference else on
        ref_key = REF_MCORE
    else:
        on, bucket, key = as_bool(flat.get(ENGINE + "pad_to_length")), as_int(flat.get(ENGINE + "pad_to_length_bucket")), ENGINE
        ref_on = as_bool(flat.get(REF + "fsdp_config.pad_to_length")) if reference else on
        ref_key = REF + "fsdp_config."
    if ref_on != on:
        warnings.append(
            f"{ref_key}pad_to_length={short_repr(ref_on)} differs from the actor's {key}pad_to_length={short_repr(on)}: "
            "--emit verl rounds every token length to the actor's bucket; set them alike"
        )
    if on is not True or remove_padding is not True:
        return None
    if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket <= 0:
        faults.append(
            f"{key}pad_to_length_bucket={short_repr(bucket)}: verl pads packed micro-batches to a multiple of it and "
            "refuses one that is not a positive integer (verl/models/mcore/util.py); set a positive token count"
        )
        return None
    return bucket


def _positive_or_none(value: Any) -> int | None:
    """A size the config sets as a positive integer, else ``None`` (the default; a bad value is the config's fault)."""
    value = as_int(value)
    return value if is_positive_int(value) else None


def _expert_parallel(mcore: dict[str, Any]) -> int:
    """The actor's ``expert_model_parallel_size`` (1 when it is not a positive integer: the config's faults name it)."""
    ep = as_int(mcore["expert_model_parallel_size"])
    return ep if is_positive_int(ep) else 1


def megatron_refusal(run: RunConfig) -> str | None:
    """Why ``profile`` cannot model a verl Megatron run, naming the key, its value and the fix; ``None`` when it can.

    NOTE [ What a Megatron profile refuses ]; ``None`` for every other strategy (FSDP is judged by the CLI).
    """
    return first_refusal(run, _REFUSAL_WHY) or _router_refusal(run)


# NOTE [ verl's Megatron optimizer ]
# verl/utils/megatron/optimizer.py init_megatron_optim_config (verl 0.9.1) builds megatron-core's OptimizerConfig from
# the actor's optim config: under bf16, use_precision_aware_optimizer (default False) with main_grads_dtype,
# exp_avg_dtype and exp_avg_sq_dtype (default fp32; the master parameters stay fp32), then every key of
# optim.override_optimizer_config over the result (verl's large MoE examples set optimizer_cpu_offload,
# optimizer_offload_fraction and use_precision_aware_optimizer there: run_deepseek_v3_671b_megatron.sh). The profile
# models Megatron's CPU offload with the precision-aware optimizer, as Megatron-LM asserts it; megatron-core alone lets
# verl offload without it (its fp32 main shards then stay on the GPU), which is profiled with the state on the GPU and
# a warning (budgets lower than the run allows). megatron-core's offload fraction defaults to 0.0.
OPTIM = ACTOR + "optim."
OPTIMIZER_OVERRIDES = OPTIM + "override_optimizer_config."
OPTIMIZER_DTYPES = ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def _megatron_optimizer(flat: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """The actor's precision-aware optimizer, its dtypes and its CPU offload as :class:`RunConfig` fields (those on),
    as verl builds megatron-core's ``OptimizerConfig`` (NOTE [ verl's Megatron optimizer ])."""

    def value(key: str, default: Any = None) -> Any:
        return flat[OPTIMIZER_OVERRIDES + key] if OPTIMIZER_OVERRIDES + key in flat else flat.get(OPTIM + key, default)

    out: dict[str, Any] = {}
    precision_aware = as_bool(value("use_precision_aware_optimizer", False)) is True
    if precision_aware:
        # the dtypes verl reads under the precision-aware optimizer; main_params_dtype only from the overrides
        names = {name: value(name) if name != "main_params_dtype" else flat.get(OPTIMIZER_OVERRIDES + name) for name in OPTIMIZER_DTYPES}
        dtypes = {name: dtype_name(v) or v for name, v in names.items() if v is not None}
        out["precision_aware_optimizer"] = True
        out["optimizer_dtypes"] = {name: v for name, v in dtypes.items() if v != "fp32"}
    if as_bool(flat.get(OPTIMIZER_OVERRIDES + "optimizer_cpu_offload")) is True:
        fraction = as_number(flat.get(OPTIMIZER_OVERRIDES + "optimizer_offload_fraction", 0.0))
        if precision_aware:
            out["optimizer_cpu_offload"] = True
            out["optimizer_offload_fraction"] = fraction
        else:
            warnings.append(
                f"{OPTIMIZER_OVERRIDES}optimizer_cpu_offload=True without use_precision_aware_optimizer is not modelled "
                "(megatron-core keeps the fp32 main shards on the GPU beside the offloaded moments): profiled with the "
                f"optimizer state on the GPU (budgets lower than the run allows); set {OPTIMIZER_OVERRIDES}"
                "use_precision_aware_optimizer=True to profile the offload"
            )
    return out


# NOTE [ verl's Megatron router ]
# verl's Megatron engine builds the TransformerConfig as mbridge maps the model and applies the actor's
# megatron.override_transformer_config over it (bridge.set_extra_args(**override_transformer_config)), so the router
# fields set there (moe_router_load_balancing_type, moe_aux_loss_coeff, moe_router_dtype, moe_z_loss_coeff) are the
# run's; those not set keep mbridge's (no load balancing, "default None for RL"). The profile carries them as
# ProfileOptions.megatron_router (NOTE [ Megatron's router settings ] in batchfit.budget.options).
ROUTER_OVERRIDES = MCORE + "override_transformer_config."


def _megatron_router(flat: dict[str, Any]) -> dict[str, Any]:
    """The actor's router fields its ``override_transformer_config`` sets (NOTE [ verl's Megatron router ]), unchecked
    (:func:`megatron_refusal` refuses what the profile does not model)."""
    from batchfit.budget.options import MEGATRON_ROUTER_FIELDS

    return {field: flat[ROUTER_OVERRIDES + field] for field in MEGATRON_ROUTER_FIELDS if ROUTER_OVERRIDES + field in flat}


def _router_refusal(run: RunConfig) -> str | None:
    """The router setting the Megatron profile does not model, in one line naming its key, value and fix; ``None``: all
    modelled (NOTE [ verl's Megatron router ])."""
    from batchfit.budget.options import MEGATRON_ROUTER_FIELDS, check_megatron_router
    from batchfit.errors import InvalidArgument

    if run.strategy != "megatron":
        return None
    try:
        check_megatron_router("megatron_router", run.megatron_router, names={f: ROUTER_OVERRIDES + f for f in MEGATRON_ROUTER_FIELDS})
    except InvalidArgument as exc:
        return f"the config's {exc}"
    return None


def _megatron_warnings(
    flat: dict[str, Any],
    given: dict[str, Any],
    mcore: dict[str, Any],
    ref_mcore: dict[str, Any],
    reference: bool,
    title: str,
) -> list[str]:
    """What a Megatron run sets that the budgets do not reproduce (warnings; the refusals are :func:`megatron_refusal`'s)."""
    defaults = {**framework_defaults("verl"), **{MCORE + k: v for k, v in MCORE_DEFAULTS.items()}}
    out = unmodelled_warnings(given, defaults, MCORE_UNMODELLED, title)
    for key, unread, what in (
        (ACTOR + "ulysses_sequence_parallel_size", 1, "McoreActorConfig has no Ulysses size"),
        (MODEL + "enable_activation_offload", False, "verl's activation offload is its FSDP engine's"),
    ):
        value = as_bool(as_int(given.get(key, unread)))
        if key in given and (value != unread or type(value) is not type(unread)):
            out.append(
                f"{key}={short_repr(given[key])} is not read under actor_rollout_ref.actor.strategy=megatron ({what}): "
                "the budgets are without it; remove it"
            )
    if reference:
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            if as_int(ref_mcore[key]) != as_int(mcore[key]):
                out.append(
                    f"{REF_MCORE}{key}={short_repr(ref_mcore[key])} differs from the actor's {MCORE}{key}="
                    f"{short_repr(mcore[key])}: batchfit profiles the reference with the actor's layout ({title}); set "
                    "them alike, or confirm the reference's on the device (profile --confirm)"
                )
    if as_bool(flat.get(MODEL + "use_fused_kernels")) is True:
        out.append(
            f"{MODEL}use_fused_kernels=True: verl's Megatron engine takes log-probs from the hidden states "
            "(_maybe_enable_fused_kernels); batchfit's Megatron profile computes them from the vocab-parallel logits, "
            "an upper bound"
        )
    return out


def _megatron_entropy(flat: dict[str, Any], mcore: dict[str, Any]) -> tuple[str, str, int | None]:
    """How verl's Megatron actor computes entropy: (trained pass, forward-only pass, chunk rows).

    ``MegatronEngineWithLMHead._lm_head_logits_processor``: ``vocab_parallel_entropy_with_chunking`` in chunks of
    ``entropy_from_logits_chunk_size`` rows with ``entropy_from_logits_with_chunking`` (padding or not), else
    ``vocab_parallel_entropy`` (full); no entropy checkpointing. When each pass computes it is the FSDP engine's
    rule (:func:`_entropy`: the trainer asks for it).
    """
    chunked = as_bool(mcore["entropy_from_logits_with_chunking"]) is True
    mode = "chunked" if chunked else "full"
    in_update = (
        as_bool(flat.get(ACTOR + "calculate_entropy")) is True or as_number(flat.get(ACTOR + "entropy_coeff")) != 0
    )
    bypass = as_bool(flat.get("algorithm.rollout_correction.bypass_mode")) is True
    chunk = as_int(mcore["entropy_from_logits_chunk_size"]) if chunked else None
    return (mode if in_update else "none"), ("none" if bypass else mode), chunk


def _recompute(mcore: dict[str, Any], warnings: list[str]) -> bool:
    """Megatron's recompute as batchfit's checkpointing: ``full`` / ``uniform`` / 1 layer is every layer checkpointed.

    ``override_transformer_config.recompute_granularity`` (null: none, verl's default), ``recompute_method``,
    ``recompute_num_layers`` go into Megatron's TransformerConfig (MegatronEngine._build_tf_config). Selective
    recompute, or full recompute over chunks of several layers or of some layers only, is profiled as none (an
    upper bound) or as every layer (a lower bound), with a warning.
    """
    key = MCORE + "override_transformer_config."
    granularity = mcore["override_transformer_config.recompute_granularity"]
    method = mcore["override_transformer_config.recompute_method"]
    layers = as_int(mcore["override_transformer_config.recompute_num_layers"])
    if granularity is None:
        return False
    if granularity == "full" and method == "uniform" and layers in (1, None):
        return True
    if granularity == "full":
        warnings.append(
            f"{key}recompute_granularity=full with recompute_method={short_repr(method)}, recompute_num_layers="
            f"{short_repr(layers)}: batchfit checkpoints every layer (uniform, 1 layer), which keeps less than "
            "chunks of several layers or a few checkpointed layers; set recompute_method=uniform and "
            "recompute_num_layers=1, or confirm this setting on the device (profile --confirm)"
        )
        return True
    warnings.append(
        f"{key}recompute_granularity={short_repr(granularity)}: batchfit models full recompute of every layer or none; "
        "the budgets are for none (an upper bound of selective recompute); set it to full or null, or confirm this "
        "setting on the device (profile --confirm)"
    )
    return False


def _lora(flat: dict[str, Any], strategy: Any, model: str = MODEL) -> dict[str, Any] | None:
    """A model's LoRA: HFModelConfig's ``lora_rank``/``lora_alpha``/``target_modules`` (FSDP),
    or its ``lora`` block (Megatron); ``None`` at rank 0. ``model``: the model section."""
    if strategy == "megatron":
        block = model + "lora."
        rank, alpha, targets, exclude = (
            flat.get(block + k) for k in ("rank", "alpha", "target_modules", "exclude_modules")
        )
    else:
        rank, alpha, targets, exclude = (
            flat.get(model + k) for k in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules")
        )
    rank = as_int(rank)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return None
    return {"rank": rank, "alpha": alpha, "target_modules": targets, "exclude_modules": exclude}


def _check_lora(flat: dict[str, Any], faults: list[str]) -> None:
    """validate_config: a LoRA rank above vLLM's largest (get_vllm_max_lora_rank) is refused."""
    rank = as_int(flat.get(MODEL + "lora.rank", 0))
    if not (isinstance(rank, int) and rank > 0):
        rank = as_int(flat.get(MODEL + "lora_rank", 0))
    if as_bool(flat.get(MODEL + "lora.merge")) is True:
        rank = 0
    if flat.get(ROLLOUT + "name") == "vllm" and isinstance(rank, int) and rank > VLLM_MAX_LORA_RANK:
        faults.append(
            f"actor_rollout_ref.model.lora_rank={rank} exceeds vLLM's largest LoRA rank, {VLLM_MAX_LORA_RANK}: verl "
            "0.9.1 refuses it at start-up (validate_config, get_vllm_max_lora_rank); set lora_rank to at most "
            f"{VLLM_MAX_LORA_RANK}"
        )


def _entropy(flat: dict[str, Any], remove_padding: Any) -> tuple[str, str, int | None]:
    """How the actor computes entropy: (trained pass, forward-only pass, chunk rows).

    verl 0.9.1 ``prepare_model_outputs`` (engine/fsdp/transformer_impl.py): checkpointed with
    the engine's ``entropy_checkpointing``; chunked with ``entropy_from_logits_with_chunking``,
    only on the remove-padding path; else full. The update computes it when
    ``calculate_entropy`` or ``entropy_coeff != 0`` (trainer_base.py ``_update_actor``), the
    old-log-prob pass always (``_compute_old_log_prob``) unless the rollout's log-probs are
    used instead (``algorithm.rollout_correction.bypass_mode``). With ``use_fused_kernels``
    the fused kernel returns it (``full`` is reported; the mode keys are not read).
    """
    if as_bool(flat.get(MODEL + "use_fused_kernels")) is True:
        mode = "full"
    elif as_bool(flat.get(ENGINE + "entropy_checkpointing")) is True:
        mode = "checkpointed"
    elif as_bool(flat.get(ENGINE + "entropy_from_logits_with_chunking")) is True and remove_padding is True:
        mode = "chunked"
    else:
        mode = "full"
    in_update = (
        as_bool(flat.get(ACTOR + "calculate_entropy")) is True
        or as_number(flat.get(ACTOR + "entropy_coeff")) != 0
    )
    bypass = as_bool(flat.get("algorithm.rollout_correction.bypass_mode")) is True
    chunk = as_int(flat.get(ENGINE + "entropy_from_logits_chunk_size")) if mode == "chunked" else None
    return (mode if in_update else "none"), ("none" if bypass else mode), chunk


SPEC = FrameworkSpec(
    name="verl",
    title="verl 0.9.1",
    markers=(
        "actor_rollout_ref",
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "critic.ppo_mini_batch_size",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
    ),
    # a recipe's shell script launches one of these with Hydra overrides (python3 -m verl.trainer.main_ppo
    # key=value ...), read as the config they compose (batchfit.frameworks.hydra_overrides); verl-recipe's
    # DAPO trainer composes its own config over ppo_trainer's
    launchers=("verl.trainer.main_ppo", "recipe.dapo.main_dapo"),
    # workers/config/model.py HFModelConfig, the FSDP engine's LoRA (CriticConfig has the same keys);
    # the model.lora.* block is Megatron's (megatron_peft.py): read, and refused under Megatron (megatron_refusal)
    lora_keys={
        "policy": (
            "actor_rollout_ref.model.lora_rank",
            "actor_rollout_ref.model.lora_alpha",
            "actor_rollout_ref.model.target_modules",
        ),
        "critic": ("critic.model.lora_rank", "critic.model.lora_alpha", "critic.model.target_modules"),
    },
    read_config=read,
    batch_rules=VERL,
    strategy_refusal=megatron_refusal,
    head="verl",
    reference_dtype="fp32",
    fsdp="fsdp1",
    gpu_keys={"num_nodes": "trainer.nnodes", "gpus_per_node": "trainer.n_gpus_per_node"},
    # verl ray_trainer: ref_in_actor when lora_rank > 0
    lora_reference=(
        "verl computes the reference log-probs with the LoRA actor, adapters disabled (ref_in_actor): "
        "no reference model is loaded, and those passes are the actor's forward ones (policy_forward)"
    ),
    compiled_entropy=(
        "verl compiles its entropy (use_torch_compile), which fuses its tokens × vocabulary temporaries away: "
        "run eagerly, an upper bound"
    ),
    emit="batchfit.frameworks.verl_emit",
)
"""verl in :mod:`batchfit.frameworks.registry` (its reference loads in fp32: ``engine/fsdp.yaml`` ``model_dtype``)."""
