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

Units: verl counts ``train_batch_size`` and ``ppo_mini_batch_size`` in prompts (the trainer
multiplies by ``rollout.n``), micro sizes in samples per GPU, token lengths per GPU.
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.registry import FrameworkSpec
from batchfit.frameworks.run import (
    RunConfig,
    as_bool,
    as_int,
    differing_warnings,
    dtype_name,
    every_fault,
    size_faults,
    unmodelled_warnings,
)
from batchfit.frameworks.source import flatten, framework_defaults, framework_schema
from batchfit.frameworks.verl_rules import VERL
from batchfit.frameworks.your_sizes import verl_sizes
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import ENGINES, RolloutEngine
from batchfit.validation import short_repr

MODEL = "actor_rollout_ref.model."
ACTOR = "actor_rollout_ref.actor."
ENGINE = ACTOR + "fsdp_config."  # what the actor's FSDP engine reads (FSDPActorConfig.engine)
REF = "actor_rollout_ref.ref."
ROLLOUT = "actor_rollout_ref.rollout."
CRITIC = "critic."
CRITIC_ENGINE = "critic.fsdp."  # FSDPCriticConfig.engine
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
    ENGINE + "pad_to_length": "packed micro-batches padded up to a bucket of tokens",
    ACTOR + "pad_to_length": "packed micro-batches padded up to a bucket of tokens",
    CRITIC_ENGINE + "fsdp_size": _SAME,
}

# The critic's keys batchfit profiles with the actor's value (one Sharding and one checkpointing
# setting for every model of a run): a critic that differs gets a warning naming both.
CRITIC_SAME = {
    CRITIC + "strategy": ACTOR + "strategy",
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
    # FSDPActorConfig.__post_init__: the deprecated actor key, when > 1, overrides the engine's
    sp = get(ACTOR + "ulysses_sequence_parallel_size")
    # messages name the key the config set (issue 40): the actor's, when it is the one in force
    key_names = {**KEY_NAMES, "sequence_parallel": ACTOR + "ulysses_sequence_parallel_size"} if isinstance(sp, int) and sp > 1 else KEY_NAMES
    if not (isinstance(sp, int) and sp > 1):
        sp = get(ENGINE + "ulysses_sequence_parallel_size") or 1
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
    _check_token_lengths(flat, max_seq_len, dynamic, reference, critic, sp, critic_sp, faults)
    lora = _lora(flat, flat.get(ACTOR + "strategy"))
    critic_lora = _lora(flat, flat.get(CRITIC + "strategy"), model=CRITIC + "model.") if critic else None
    _check_lora(flat, faults)
    if as_bool(flat.get("trainer.use_v1")) is False:
        warnings.append(
            "trainer.use_v1=false runs verl's deprecated legacy trainer (main_ppo_v0.py), whose batch rules differ "
            "(no padding rows: train_batch_size must be a multiple of ppo_mini_batch_size); batchfit mirrors the V1 "
            "trainer: set trainer.use_v1=true, or check the plan by hand"
        )
    strategy = flat.get(ACTOR + "strategy")
    if strategy == "megatron":
        warnings.append(
            "actor_rollout_ref.actor.strategy=megatron: batchfit mirrors verl's FSDP rules; Megatron's differ "
            "(validate_config's minimal batch is megatron dp × ppo_micro_batch_size_per_gpu)"
        )
    entropy, forward_entropy, chunk = _entropy(flat, remove_padding)
    entropy_in_loss = _number(flat.get(ACTOR + "entropy_coeff")) != 0
    warnings += unmodelled_warnings(given, framework_defaults("verl"), UNMODELLED, schema.title)
    mixed_precision, dtype = _precision(flat, given, warnings)
    if critic:
        warnings += differing_warnings(flat, CRITIC_SAME, "the critic", "the actor's", schema.title)
    roles = ["policy", *(["reference"] if reference else []), *(["critic"] if critic else [])]
    resident = {
        "policy": _kept(flat, ENGINE, optimizer=True),
        "reference": _kept(flat, REF + "fsdp_config.", optimizer=False),
        "critic": _kept(flat, CRITIC_ENGINE, optimizer=True),
    }
    resident = {role: kept for role, kept in resident.items() if role in roles}
    notes: list[str] = []
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
        offload="cpu" if as_bool(flat.get(ENGINE + "offload_policy")) is True else "none",
        reshard_after_forward=_bool_or_none(flat.get(ENGINE + "reshard_after_forward")),
        mixed_precision=mixed_precision,
        dtype=dtype,
        # the reference's engine is composed from the same engine/fsdp.yaml (model_dtype: fp32) whether
        # the file sets the key (a dumped config) or leaves it to its group (ppo_trainer.yaml)
        reference_dtype=dtype_name(flat.get(REF + "fsdp_config.model_dtype")) or DEFAULT_MODEL_DTYPE,
        gradient_checkpointing=as_bool(flat.get(MODEL + "enable_gradient_checkpointing")),
        # fsdp_workers.py: enable_activation_offloading(module, strategy, enable_gradient_checkpointing)
        activation_offload=as_bool(flat.get(MODEL + "enable_activation_offload")),
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
        optimizer_offload=as_bool(flat.get(ENGINE + "optimizer_offload")) is True,
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
            "entropy": ACTOR + "calculate_entropy, entropy_coeff; " + ENGINE + "entropy_*",
            "lora": MODEL + "lora_rank, lora_alpha, target_modules, exclude_modules",
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


def _number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


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
        memory_fraction=_number(flat.get(ROLLOUT + "gpu_memory_utilization")),
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
    """engine_workers.py init_model asserts the rollout's log-prob pass batches as the actor does."""
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
    sp: Any,
    critic_sp: Any,
    faults: list[str],
) -> None:
    """rearrange_micro_batches asserts ``max_token_len_per_gpu × sp >= the longest sequence``.

    verl 0.9.1 (verl/workers/engine/utils.py prepare_micro_batches) multiplies the per-GPU
    length by the Ulysses size; the critic's engine always batches by tokens, with
    ``critic.ppo_infer_max_token_len_per_gpu`` for its update and its values
    (verl/trainer/ppo/v1/trainer_base.py).
    """
    if max_seq_len is None:
        return
    keys: list[tuple[str, Any]] = []
    if dynamic:
        keys += [(ACTOR + "ppo_max_token_len_per_gpu", sp), (ROLLOUT + "log_prob_max_token_len_per_gpu", sp)]
    if reference and as_bool(flat.get(REF + "log_prob_use_dynamic_bsz")) is True:
        keys.append((REF + "log_prob_max_token_len_per_gpu", sp))
    if critic:
        keys.append((CRITIC + "ppo_infer_max_token_len_per_gpu", critic_sp))
    for key, size in keys:
        value = as_int(flat.get(key))
        size = size if isinstance(size, int) and size > 0 else 1
        if isinstance(value, int) and value * size < max_seq_len:
            times = f" × sequence-parallel size {size} = {value * size}" if size > 1 else ""
            faults.append(
                f"{key}={value}{times} is below the longest sequence, data.max_prompt_length + "
                f"data.max_response_length = {max_seq_len}: verl 0.9.1's rearrange_micro_batches refuses it at run "
                f"time (verl/utils/seqlen_balancing.py); set it to at least {-(-max_seq_len // size)}"
            )


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
        or _number(flat.get(ACTOR + "entropy_coeff")) != 0
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
    # the model.lora.* block is Megatron's (megatron_peft.py), not read: batchfit does not model Megatron
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
