"""SkyRL's vocabulary (``trainer.*``, ``trainer.placement.*``, ``generator.*``) in batchfit's terms.

Mirrors SkyRL 0.4.0: the config dataclasses of ``skyrl/train/config/config.py`` (defaults
and key vocabulary, generated into ``defaults/skyrl.yaml`` and ``defaults/skyrl_schema.json``
by ``scripts/gen_framework_schemas.py``), ``skyrl/train/utils/utils.py`` (``validate_cfg``,
``validate_batch_sizes``: the batch rules live in :mod:`batchfit.frameworks.skyrl_rules`,
framework ``"skyrl"``), ``TrainerConfig.__post_init__`` and ``trainer.py`` (``build_models``,
``_remove_tail_data``).

Under ``trainer.strategy: megatron`` the policy and the reference are read from their
``megatron_config`` (``MegatronConfig``) as ``MegatronWorker`` builds them
(``skyrl/backends/skyrl_train/workers/megatron/megatron_worker.py``,
``distributed/megatron/optimizer.py``): NOTE [ SkyRL's Megatron worker ].
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
from batchfit.frameworks.skyrl_rules import SKYRL
from batchfit.frameworks.source import flatten, framework_defaults, framework_schema
from batchfit.frameworks.your_sizes import pass_sizes
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import ENGINES, RolloutEngine
from batchfit.validation import short_repr

T = "trainer."
PLACEMENT = "trainer.placement."
MEGATRON = "trainer.policy.megatron_config."

# SkyRL key -> BatchConfig field (the megatron sizes only under trainer.strategy=megatron).
KEYS: dict[str, str] = {
    T + "train_batch_size": "train_batch_size",
    T + "policy_mini_batch_size": "policy_mini_batch_size",
    T + "critic_mini_batch_size": "critic_mini_batch_size",
    T + "micro_train_batch_size_per_gpu": "micro_train_batch_size_per_gpu",
    T + "micro_forward_batch_size_per_gpu": "micro_forward_batch_size_per_gpu",
    T + "update_epochs_per_batch": "update_epochs_per_batch",
    PLACEMENT + "policy_num_nodes": "num_nodes",
    PLACEMENT + "policy_num_gpus_per_node": "gpus_per_node",
    T + "policy.sequence_parallel_size": "sequence_parallel",
    "generator.n_samples_per_prompt": "n_samples_per_prompt",
}
MEGATRON_KEYS = {
    MEGATRON + "tensor_model_parallel_size": "tensor_parallel",
    MEGATRON + "pipeline_model_parallel_size": "pipeline_parallel",
    MEGATRON + "context_parallel_size": "context_parallel",
}
TOKEN_KEY = T + "max_tokens_per_microbatch"
STEP_WISE_KEY = "generator.step_wise_trajectories"
REMOVE_PADDING_KEY = T + "remove_microbatch_padding"
REMOVE_PADDING_ALIAS = T + "use_sample_packing"  # deprecated; from_cli_overrides renames it
LORA = T + "policy.model.lora."
ENGINE_PREFIX = "generator.inference_engine."
EXPANDABLE_KEY = T + "use_expandable_segments"

# Keys that change memory in ways batchfit's budgets do not reproduce: a config that sets one
# away from SkyRL's default gets a warning naming it. Remove a key once profile models it.
# ("prefix.*" stands for every key below an open section.) Modelled, so not listed: LoRA's rank,
# alpha and targets (RunConfig.lora, critic_lora), trainer.remove_microbatch_padding and its
# alias (remove_padding: the probe's cost), trainer.logprobs_chunk_size and
# trainer.algorithm.use_entropy_loss (the entropy fields: batchfit.frameworks.run_step), the
# gradient checkpointing, cpu_offload, reshard_after_forward (a bool) and mixed_precision of the
# policy, trainer.bf16 (the reference's dtype) (read into RunConfig; a critic's or reference's
# key of these that differs from the policy's is a warning of its own, OTHERS_SAME).
_SAME_FOR_CRITIC = "the critic's, as the policy's"
UNMODELLED: dict[str, str] = {
    LORA + "exclude_modules": "layers left without LoRA adapters (batchfit adapts every target module)",
    T + "critic.model.lora.exclude_modules": "the critic's layers left without LoRA adapters",
    T
    + "flash_attn": "False runs attention without flash-attention (SDPA or eager kernels keep other buffers)",
    T + "gradient_checkpointing_use_reentrant": "reentrant activation checkpointing (batchfit checkpoints "
    "non-reentrantly)",
    T + "critic.sequence_parallel_size": "Ulysses sequence parallelism for the critic",
    T + "ref.sequence_parallel_size": "Ulysses sequence parallelism for the reference",
    T + "policy.fsdp_config.fsdp_size": "hybrid sharding: state sharded over fsdp_size GPUs, not all of them",
    T + "policy.fsdp_config.wrap_policy.*": "how the model is wrapped into FSDP units (batchfit wraps each "
    "decoder layer)",
    T + "policy.model_config_kwargs.*": "overrides of the model's Hugging Face config (batchfit profiles its "
    "config.json as it is)",
    T
    + "policy.use_torch_compile": "torch.compile of the entropy computation (fuses its temporaries; measured "
    "eagerly)",
    T + "critic.fsdp_config.fsdp_size": _SAME_FOR_CRITIC,
    T + "critic.model_config_kwargs.*": _SAME_FOR_CRITIC,
}

POLICY_FSDP = T + "policy.fsdp_config."
# The critic's and reference's keys batchfit profiles with the policy's value (one Sharding for
# every model of a run): one that differs gets a warning naming both.
OTHERS_SAME = {
    "critic": {
        T + "critic.fsdp_config.cpu_offload": POLICY_FSDP + "cpu_offload",
        T + "critic.fsdp_config.reshard_after_forward": POLICY_FSDP + "reshard_after_forward",
        T + "critic.fsdp_config.mixed_precision.param_dtype": POLICY_FSDP + "mixed_precision.param_dtype",
        T + "critic.fsdp_config.mixed_precision.reduce_dtype": POLICY_FSDP + "mixed_precision.reduce_dtype",
    },
    "reference": {
        T + "ref.fsdp_config.cpu_offload": POLICY_FSDP + "cpu_offload",
        T + "ref.fsdp_config.reshard_after_forward": POLICY_FSDP + "reshard_after_forward",
    },
}
# NOTE [ SkyRL's Megatron worker ]
# SkyRL 0.4.0 trains a Megatron policy with MegatronWorker (skyrl/backends/skyrl_train/workers/megatron/
# megatron_worker.py): its provider takes tensor_model_parallel_size, pipeline_model_parallel_size,
# context_parallel_size and expert_model_parallel_size from megatron_config, and sets
# `provider.sequence_parallel = tensor_model_parallel_size > 1` (Megatron's sequence parallelism has no key: on
# whenever TP is, MegatronConfig's docstring says the same). The distributed optimizer is always on
# (distributed/megatron/optimizer.py init_megatron_optim_config: "use_distributed_optimizer": True, which
# megatron_config.optimizer_config_kwargs may override; the DDP wrapper's default_ddp_config likewise). The
# parameters are bf16 when trainer.bf16 (provide_distributed_model(bf16=self.cfg.bf16)), the optimizer's fp32.
# trainer.gradient_checkpointing keeps transformer_config_kwargs' recompute (full, uniform, 1 layer by default:
# DEFAULT_TRANSFORMER_CONFIG_KWARGS) or clears it (recompute_* = None). Micro-batches: trainer.max_tokens_per_microbatch
# through the same TokenBasedBatchIterator as FSDP (attention_mask.sum per micro-batch, per data-parallel rank),
# each micro-batch padded with one-token dummy rows to the mini-batch's largest count (Megatron's schedule needs
# one micro-batch size). validate_batch_sizes' dp is world / (pp · cp · tp).
MEGATRON_REF = T + "ref.megatron_config."
RECOMPUTE = "transformer_config_kwargs."
# megatron_config keys batchfit's Megatron profile does not reproduce (judged against SkyRL's defaults).
MEGATRON_UNMODELLED: dict[str, str] = {
    MEGATRON
    + RECOMPUTE
    + "virtual_pipeline_model_parallel_size": "the interleaved 1F1B schedule (virtual pipeline stages keep more "
    "micro-batches in flight on the first stage)",
    MEGATRON + "ddp_config.grad_reduce_in_fp32": "the gradient buffer's dtype (fp32 by default)",
    MEGATRON + "fp8": "FP8 GEMMs (Transformer Engine)",
    MEGATRON + "fp8_param": "FP8 parameters",
}

# skyrl/backends/skyrl_train/workers/fsdp/fsdp_worker.py: the policy loads with
# HFModelWrapper(bf16=policy.inference_only_init), false when it trains, and the critic with
# bf16=False: trained models store fp32 parameters; the reference loads with bf16=trainer.bf16.
TRAINED_DTYPE = "fp32"


def read(data: dict[str, Any], given: dict[str, Any]) -> RunConfig:
    """A resolved SkyRL config (defaults merged) as a :class:`RunConfig`.

    Args:
        data: the user's config merged over SkyRL's defaults, interpolations resolved.
        given: the user's own keys (flattened), to tell what the file says from what SkyRL
            defaults (their values are read from ``data``).

    Raises:
        BatchConfigError: a key that is a close misspelling of one of SkyRL's (with the key
            meant), together with every other fault of the config.
    """
    flat = flatten(data)
    given = {key: flat.get(key, value) for key, value in given.items()}
    schema = framework_schema("skyrl")
    # the deprecated alias is renamed by from_cli_overrides before the dataclasses see it
    checked = {key: value for key, value in given.items() if key != REMOVE_PADDING_ALIAS}
    misspelt, warnings = schema.check_keys(checked, ignore=BatchConfig.fields())
    faults: list[str] = []

    strategy = flat.get(T + "strategy")
    if strategy == "fsdp2":  # validate_cfg: renamed to fsdp (a DeprecationWarning)
        strategy = "fsdp"
    megatron = strategy == "megatron"
    keys = {**KEYS, **MEGATRON_KEYS} if megatron else KEYS
    values: dict[str, Any] = {field: as_int(flat.get(key)) for key, field in keys.items()}
    if megatron:
        values["sequence_parallel"] = 1  # validate_batch_sizes: dp = world // (pp · cp · tp) for Megatron
    tokens = as_int(flat.get(TOKEN_KEY))
    values["max_tokens_per_micro_batch"] = (
        None if tokens is None or (isinstance(tokens, int) and tokens <= 0) else tokens
    )
    values["step_wise"] = as_bool(flat.get(STEP_WISE_KEY, False))

    critic_model = flat.get(T + "critic.model.path") or None
    if not critic_model:
        values["critic_mini_batch_size"] = None  # SkyRL: no critic model, no critic
    else:
        values["critic_world_size"] = _gpus(flat, "critic")
        faults += size_faults(
            {k: v for k, v in flat.items() if k.startswith(PLACEMENT + "critic_")},
            ("_num_nodes", "_num_gpus_per_node"),
            schema.title,
            "nodes and GPUs",
        )
        values["critic_model_parallel"] = as_int(flat.get(T + "critic.sequence_parallel_size", 1))
        _check_colocated_critic(flat, values, faults)
    algorithm = T + "algorithm."
    kl_loss = as_bool(flat.get(algorithm + "use_kl_loss")) is True
    kl_reward = as_bool(flat.get(algorithm + "use_kl_in_reward")) is True
    reference = kl_loss or kl_reward
    if reference:
        # validate_batch_sizes: the reference's dp size joins the lcm rule
        values["reference_world_size"] = _gpus(flat, "ref")
        faults += size_faults(
            {k: v for k, v in flat.items() if k.startswith(PLACEMENT + "ref_")},
            ("_num_nodes", "_num_gpus_per_node"),
            schema.title,
            "nodes and GPUs",
        )
        values["reference_model_parallel"] = _reference_model_parallel(flat, megatron)
    _validate_cfg(flat, given, values, critic_model, kl_loss, kl_reward, megatron, faults)
    faults += _entropy_chunk_faults(flat)

    prompt = as_int(flat.get("generator.max_input_length") or flat.get(T + "max_prompt_length"))
    response = as_int(flat.get("generator.sampling_params.max_generate_length"))
    max_seq_len = prompt + response if isinstance(prompt, int) and isinstance(response, int) else None
    # FSDP2's CPUOffloadPolicy; Megatron has none (its optimizer offload is a warning of MEGATRON_UNMODELLED)
    offload = "cpu" if not megatron and as_bool(flat.get(T + "policy.fsdp_config.cpu_offload")) is True else "none"
    colocated, resident = _placement(flat, bool(critic_model), reference, offload)
    chunk = as_int(flat.get(T + "logprobs_chunk_size"))
    remove_padding = as_bool(flat.get(REMOVE_PADDING_KEY))
    if REMOVE_PADDING_ALIAS in given and REMOVE_PADDING_KEY not in given:
        remove_padding = as_bool(given[REMOVE_PADDING_ALIAS])  # from_cli_overrides renames the alias
    entropy_loss = as_bool(flat.get(algorithm + "use_entropy_loss")) is True
    entropy, entropy_chunk = _entropy(flat, megatron, chunk)
    temperature = flat.get(algorithm + "temperature")
    if temperature is None:  # SkyRLTrainConfig.__post_init__ copies the sampling temperature
        temperature = flat.get("generator.sampling_params.temperature")
    defaults = framework_defaults("skyrl")
    defaults = {**defaults, REMOVE_PADDING_ALIAS: defaults.get(REMOVE_PADDING_KEY)}
    warnings += unmodelled_warnings(given, defaults, UNMODELLED, schema.title)
    refused: dict[str, str] = {}
    checkpointing = as_bool(flat.get(T + "gradient_checkpointing"))
    if megatron:
        warnings += unmodelled_warnings(given, defaults, MEGATRON_UNMODELLED, schema.title)
        warnings += _megatron_warnings(flat, reference, schema.title)
        refused = _megatron_refusals(flat, values)
        faults += _megatron_faults(flat, reference)
        checkpointing = _recompute(flat, checkpointing, warnings)
    reshard = None if megatron else as_bool(flat.get(POLICY_FSDP + "reshard_after_forward"))
    if not megatron and not isinstance(reshard, bool):
        warnings.append(
            f"{POLICY_FSDP}reshard_after_forward={short_repr(reshard)} reshards to a smaller group than every GPU, which "
            "batchfit's budgets do not model (True or False only); profile with True or False, or confirm this "
            "setting on the device (profile --confirm)"
        )
    mixed_precision = None if megatron else _precision(flat, given, warnings)
    used = {"critic": bool(critic_model), "reference": reference}
    for role, pairs in OTHERS_SAME.items():
        if used[role]:
            warnings += differing_warnings(flat, pairs, f"the {role}", "the policy's", schema.title)
    run = RunConfig(
        vocabulary="skyrl",
        batch=BatchConfig(**values, framework="skyrl"),
        model=flat.get(T + "policy.model.path"),
        critic_model=critic_model,
        reference=reference,
        max_seq_len=max_seq_len,
        max_response_len=response if isinstance(response, int) else None,
        strategy=strategy,
        offload=offload,
        reshard_after_forward=reshard if isinstance(reshard, bool) else None,
        mixed_precision=mixed_precision,
        # NOTE [ SkyRL's Megatron worker ]: bf16 parameters (trainer.bf16) under Megatron, fp32 under FSDP
        dtype=("fp32" if as_bool(flat.get(T + "bf16")) is False else "bf16") if megatron else TRAINED_DTYPE,
        reference_dtype="fp32" if as_bool(flat.get(T + "bf16")) is False else "bf16",
        gradient_checkpointing=checkpointing,
        megatron_sequence_parallel=megatron and _is_above_one(values.get("tensor_parallel")),
        distributed_optimizer=megatron
        and as_bool(flat.get(MEGATRON + "optimizer_config_kwargs.use_distributed_optimizer", True)) is not False,
        # NOTE [ SkyRL's Megatron worker ]: the provider's expert_model_parallel_size (NOTE [ The Megatron probe's
        # worst rank ] in batchfit.budget.megatron_probe)
        expert_parallel=_expert_parallel(flat) if megatron else 1,
        # the provider's expert_tensor_parallel_size (null: Megatron's default, the tensor-parallel size)
        expert_tensor_parallel=_expert_tensor_parallel(flat) if megatron else None,
        # the provider's uneven pipeline and Megatron's optimizer offload / precision-aware optimizer (OptimizerConfig
        # through optimizer_config_kwargs; NOTE [ Megatron's optimizer offload and precision-aware optimizer ])
        **(_megatron_optimizer_fields(flat) if megatron else {}),
        # the provider's router (NOTE [ SkyRL's Megatron router ])
        megatron_router=_megatron_router(flat) if megatron else {},
        logprobs_chunk_size=chunk,
        remove_padding=remove_padding if isinstance(remove_padding, bool) else None,
        critic_remove_padding=(remove_padding if isinstance(remove_padding, bool) else None)
        if critic_model
        else None,
        fused_kernels=as_bool(flat.get(T + "fused_lm_head_logprob")) is True,
        entropy=entropy,
        entropy_chunk_size=entropy_chunk,
        entropy_chunk_memory_mb=as_int(flat.get(ENTROPY_MEMORY_KEY)) if megatron else None,
        entropy_grad=entropy_loss,
        entropy_in_loss=entropy_loss,
        forward_entropy="none",  # worker.py _forward_micro_batch: log-probs only
        temperature=temperature,
        lora=_lora(flat, LORA),
        critic_lora=_lora(flat, T + "critic.model.lora.") if critic_model else None,
        colocated=colocated,
        resident=resident,
        generation_resident=_generation_resident(flat, bool(critic_model), offload),
        engine=_engine(flat, _lora(flat, LORA)),
        # FSDPWorker.init_model ends with expandable segments on (workers/worker.py, PR #1768), unless turned off
        allocator="caching" if as_bool(flat.get(EXPANDABLE_KEY)) is False else "expandable_segments",
        faults=tuple(faults),
        warnings=tuple(warnings),
        notes=tuple(version_notes(given)),
        key_names=_key_names(megatron),
        # the sizes the config sets, put beside batchfit's budgets (your_sizes.compare); SkyRL's one token key
        # bounds every pass and counts the micro-batch before its sequence-parallel split
        configured=pass_sizes(
            (TOKEN_KEY, values["max_tokens_per_micro_batch"], "tokens")
            if values["max_tokens_per_micro_batch"]
            else (T + "micro_train_batch_size_per_gpu", values.get("micro_train_batch_size_per_gpu"), "sequences"),
            (TOKEN_KEY, values["max_tokens_per_micro_batch"], "tokens")
            if values["max_tokens_per_micro_batch"]
            else (T + "micro_forward_batch_size_per_gpu", values.get("micro_forward_batch_size_per_gpu"), "sequences"),
            reference=bool(reference),
            critic=bool(critic_model),
            per_gpu=False,
        ),
        source={
            "max_seq_len": "generator.max_input_length + generator.sampling_params.max_generate_length",
            "world_size": "trainer.placement.policy_num_nodes × policy_num_gpus_per_node",
            "model": "trainer.policy.model.path",
            "remove_padding": REMOVE_PADDING_KEY,
            "entropy": "trainer.logprobs_chunk_size (SkyRL always chunks the entropy)",
            "lora": LORA + "*",
            **(
                {
                    "gradient_checkpointing": T + "gradient_checkpointing, " + MEGATRON + RECOMPUTE + "recompute_*",
                    "megatron_sequence_parallel": MEGATRON + "tensor_model_parallel_size > 1 (megatron_worker.py)",
                    "distributed_optimizer": MEGATRON + "optimizer_config_kwargs.use_distributed_optimizer",
                }
                if megatron
                else {}
            ),
            # NOTE [ What a SkyRL Megatron profile refuses ]: "refused:<setting>" → the config's key=value
            **refused_sources(refused),
        },
    )
    if misspelt:
        every_fault(run, misspelt)
    return run


def _precision(flat: dict[str, Any], given: dict[str, Any], warnings: list[str]) -> str | None:
    """The policy's mixed precision in :class:`~batchfit.parallel.Sharding`'s terms, ``None`` when not given.

    SkyRL 0.4.0 ``FSDPStrategy._fsdp_init_model`` (``distributed/fsdp_strategy.py``) wraps with
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` from ``fsdp_config.mixed_precision``
    (``MixedPrecisionConfig``: bf16 / fp32 by default; ``None`` is the same). On fp32 parameters
    (:data:`TRAINED_DTYPE`) bf16 / fp32 is batchfit's ``bf16``, fp32 / fp32 its ``none``.
    """
    keys = [POLICY_FSDP + "mixed_precision.param_dtype", POLICY_FSDP + "mixed_precision.reduce_dtype"]
    if not any(k in given for k in keys):
        return None
    param = dtype_name(flat.get(keys[0])) or "bf16"
    reduce = dtype_name(flat.get(keys[1])) or "fp32"
    if (param, reduce) == ("bf16", "fp32"):
        return "bf16"
    if param == reduce == TRAINED_DTYPE:
        return "none"
    warnings.append(
        f"{POLICY_FSDP}mixed_precision param_dtype={param}, reduce_dtype={reduce}: batchfit models FSDP mixed precision "
        "as param bf16 with reduce fp32, or none (fp32, the parameters' dtype); the budgets keep its default (bf16 "
        "compute, fp32 reduce)"
    )
    return None


def _gpus(flat: dict[str, Any], role: str) -> Any:
    """``<role>_num_nodes × <role>_num_gpus_per_node`` of ``trainer.placement``."""
    nodes, per_node = (
        as_int(flat.get(f"{PLACEMENT}{role}_num_nodes", 1)),
        as_int(flat.get(f"{PLACEMENT}{role}_num_gpus_per_node", 1)),
    )
    if isinstance(nodes, int) and isinstance(per_node, int) and nodes > 0 and per_node > 0:
        return nodes * per_node
    if isinstance(nodes, int) and nodes < 1:
        return nodes  # -1 × -8 is not 8 GPUs: the invalid factor, for the plan to name
    if isinstance(per_node, int) and per_node < 1:
        return per_node
    return nodes if not isinstance(nodes, int) else per_node  # the invalid one, for the plan to name


def _reference_model_parallel(flat: dict[str, Any], megatron: bool) -> Any:
    """validate_batch_sizes: ``ref_world // ref.sequence_parallel_size`` (Megatron: ``// (pp · cp · tp)``)."""
    if not megatron:
        return as_int(flat.get(T + "ref.sequence_parallel_size", 1))
    sizes = [
        as_int(flat.get(f"{T}ref.megatron_config.{k}", 1))
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    ]
    return math.prod(sizes) if all(isinstance(s, int) for s in sizes) else sizes[0]


def _validate_cfg(
    flat: dict[str, Any],
    given: dict[str, Any],
    values: dict[str, Any],
    critic_model: Any,
    kl_loss: bool,
    kl_reward: bool,
    megatron: bool,
    faults: list[str],
) -> None:
    """The parts of validate_cfg (and the config's own checks) that decide which models run and how."""
    estimator = flat.get(T + "algorithm.advantage_estimator")
    if values["step_wise"] is True and estimator in ("gae", "reinforce++"):
        faults.append(
            f"{STEP_WISE_KEY}=true does not work with trainer.algorithm.advantage_estimator={estimator} "
            "(SkyRL 0.4.0 validate_cfg refuses it: step-wise training broadcasts one advantage per trajectory); "
            "use grpo or rloo, or set generator.step_wise_trajectories=false"
        )
    if estimator == "gae" and not critic_model:
        faults.append(
            "trainer.algorithm.advantage_estimator=gae needs a critic, but trainer.critic.model.path is not set "
            "(SkyRL 0.4.0 validate_cfg asserts it): set trainer.critic.model.path, or use grpo"
        )
    if kl_loss and kl_reward:
        faults.append(
            "trainer.algorithm.use_kl_loss=true and use_kl_in_reward=true are both set (SkyRL 0.4.0 validate_cfg "
            "asserts they are mutually exclusive): keep one"
        )
    if megatron and critic_model:
        faults.append(
            f"trainer.strategy=megatron trains no critic, but trainer.critic.model.path={short_repr(critic_model)} is set "
            "(SkyRL 0.4.0 validate_megatron_cfg asserts it): remove the critic path, or use trainer.strategy=fsdp"
        )
    chunk = flat.get(T + "logprobs_chunk_size")
    if chunk is None and not megatron:
        faults.append(
            "trainer.logprobs_chunk_size=None (no chunking) needs trainer.strategy=megatron (SkyRL 0.4.0 "
            "TrainerConfig.__post_init__ raises): set a positive chunk size such as 1024"
        )
    elif chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        faults.append(
            f"trainer.logprobs_chunk_size={short_repr(chunk)} must be a positive integer or None (SkyRL 0.4.0 "
            "TrainerConfig.__post_init__ raises): set it to a positive chunk size such as 1024"
        )
    if as_bool(flat.get(T + "fused_lm_head_logprob")) is True and not megatron:
        faults.append(
            "trainer.fused_lm_head_logprob=true needs trainer.strategy=megatron (SkyRL 0.4.0 "
            "TrainerConfig.__post_init__ raises): set it to false, or train with megatron"
        )
    if REMOVE_PADDING_ALIAS in given and REMOVE_PADDING_KEY in given:
        faults.append(
            f"both {REMOVE_PADDING_ALIAS}={short_repr(given[REMOVE_PADDING_ALIAS])} (deprecated) and {REMOVE_PADDING_KEY}="
            f"{short_repr(given[REMOVE_PADDING_KEY])} are set (SkyRL 0.4.0 SkyRLTrainConfig.from_cli_overrides refuses "
            f"both): keep only {REMOVE_PADDING_KEY}"
        )


def _is_above_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def _megatron_faults(flat: dict[str, Any], reference: bool) -> list[str]:
    """validate_megatron_cfg's refusals of what SkyRL 0.4.0 does not run under Megatron (beyond the critic's)."""
    faults = []
    backend = flat.get(ENGINE_PREFIX + "backend")
    if backend not in (None, "vllm"):
        faults.append(
            f"{ENGINE_PREFIX}backend={short_repr(backend)} with trainer.strategy=megatron: SkyRL 0.4.0 validate_megatron_cfg "
            "asserts 'only vllm is supported for with megatron'; set it to vllm"
        )
    for role, name in (("policy", "policy"), *((("ref", "ref"),) if reference else ())):
        key = f"{T}{name}.sequence_parallel_size"
        sp = as_int(flat.get(key, 1))
        if sp != 1:
            faults.append(
                f"{key}={short_repr(sp)} with trainer.strategy=megatron: SkyRL 0.4.0 validate_megatron_cfg asserts ulysses "
                f"style sequence parallel is not supported for megatron; set it to 1 (Megatron's sequence parallelism "
                f"comes with {T}{role}.megatron_config.tensor_model_parallel_size > 1)"
            )
    return faults


# NOTE [ What a SkyRL Megatron profile refuses ]
# As NOTE [ What a Megatron profile refuses ] in batchfit.frameworks.verl: `batchfit plan` keeps answering (SkyRL
# runs it) while `profile` refuses, through SPEC.strategy_refusal (megatron_refusal), what batchfit's Megatron
# profile does not model: Megatron LoRA (megatron_config.lora_config with a rank). MoE expert parallelism is
# profiled (expert_model_parallel_size: NOTE [ The Megatron probe's worst rank ] in batchfit.budget.megatron_probe). A critic under Megatron is SkyRL's own refusal (validate_megatron_cfg), a fault of the config. Context
# parallelism is profiled (NOTE [ Context parallelism as Megatron runs it ] in batchfit.models.megatron_context).
_REFUSAL_WHY = {
    "lora": (
        "trains Megatron LoRA adapters (megatron-bridge's peft, megatron_config.lora_config), which batchfit's Megatron "
        "profile does not model",
        "set it to 0, or train LoRA with trainer.strategy=fsdp",
    ),
}


def _megatron_refusals(flat: dict[str, Any], values: dict[str, Any]) -> dict[str, str]:
    """What a Megatron run sets that ``profile`` refuses (NOTE [ What a SkyRL Megatron profile refuses ]): setting → key=value."""
    out = {}
    lora = _lora(flat, LORA)
    if lora is not None:
        out["lora"] = f"{LORA}rank={lora['rank']}"
    return out


def _megatron_optimizer_fields(flat: dict[str, Any]) -> dict[str, Any]:
    """The policy's ``transformer_config_kwargs.num_layers_in_first/last_pipeline_stage`` and ``optimizer_config_kwargs``'
    ``optimizer_cpu_offload``, ``optimizer_offload_fraction`` (SkyRL's default 0.0), ``use_precision_aware_optimizer`` and
    its dtypes, as :class:`RunConfig` fields (those set)."""
    out: dict[str, Any] = {}
    for key, field_name in (("num_layers_in_first_pipeline_stage", "first_pipeline_stage_layers"),
                            ("num_layers_in_last_pipeline_stage", "last_pipeline_stage_layers")):
        layers = as_int(flat.get(MEGATRON + RECOMPUTE + key))
        if is_positive_int(layers):
            out[field_name] = layers
    opt = MEGATRON + "optimizer_config_kwargs."
    if as_bool(flat.get(opt + "optimizer_cpu_offload")) is True:
        fraction = flat.get(opt + "optimizer_offload_fraction", 0.0)
        out["optimizer_cpu_offload"] = True
        out["optimizer_offload_fraction"] = float(fraction) if isinstance(fraction, (int, float)) else fraction
    if as_bool(flat.get(opt + "use_precision_aware_optimizer")) is True:
        out["precision_aware_optimizer"] = True
        out["optimizer_dtypes"] = {
            name: dtype_name(flat[opt + name]) or flat[opt + name]
            for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
            if flat.get(opt + name) is not None
        }
    return out


# NOTE [ SkyRL's Megatron router ]
# megatron_worker.py (MegatronWorker's provider) sets moe_router_load_balancing_type, moe_aux_loss_coeff and
# moe_router_dtype from megatron_config (SkyRL's defaults: none, 0.0, fp32), then applies transformer_config_kwargs
# over them ("can override the above"), where moe_z_loss_coeff may be set too. The profile carries them as
# ProfileOptions.megatron_router (NOTE [ Megatron's router settings ] in batchfit.budget.options): by SkyRL's
# defaults its router logits are fp32, which mbridge's mapping alone leaves in bf16.
ROUTER_KEYS = {
    "moe_router_load_balancing_type": MEGATRON + "moe_router_load_balancing_type",
    "moe_aux_loss_coeff": MEGATRON + "moe_aux_loss_coeff",
    "moe_router_dtype": MEGATRON + "moe_router_dtype",
}


def _megatron_router(flat: dict[str, Any]) -> dict[str, Any]:
    """The policy's router as its provider gets it (NOTE [ SkyRL's Megatron router ]), ``TransformerConfig`` fields
    (unchecked: :func:`megatron_refusal` refuses what the profile does not model)."""
    from batchfit.budget.options import MEGATRON_ROUTER_FIELDS

    out = {field: flat[key] for field, key in ROUTER_KEYS.items() if key in flat}
    out.update({f: flat[MEGATRON + RECOMPUTE + f] for f in MEGATRON_ROUTER_FIELDS if MEGATRON + RECOMPUTE + f in flat})
    return out


def _expert_tensor_parallel(flat: dict[str, Any]) -> int | None:
    """The policy's ``megatron_config.expert_tensor_parallel_size``, ``None`` when unset (Megatron's default)."""
    etp = as_int(flat.get(MEGATRON + "expert_tensor_parallel_size"))
    return etp if isinstance(etp, int) and not isinstance(etp, bool) and etp >= 1 else None


def _expert_parallel(flat: dict[str, Any]) -> int:
    """The policy's ``megatron_config.expert_model_parallel_size`` (1 when it is not an integer above 1)."""
    ep = as_int(flat.get(MEGATRON + "expert_model_parallel_size", 1))
    return ep if _is_above_one(ep) else 1


def megatron_refusal(run: RunConfig) -> str | None:
    """Why ``profile`` cannot model a SkyRL Megatron run, naming the key, its value and the fix; ``None`` when it can.

    NOTE [ What a SkyRL Megatron profile refuses ]; ``None`` for every other strategy (FSDP is judged by the CLI).
    """
    return first_refusal(run, _REFUSAL_WHY) or _router_refusal(run)


def _router_refusal(run: RunConfig) -> str | None:
    """The router setting the Megatron profile does not model (NOTE [ SkyRL's Megatron router ]), in one line naming its
    key (megatron_config's; the z-loss transformer_config_kwargs'), its value and the fix; ``None``: all modelled."""
    from batchfit.budget.options import check_megatron_router
    from batchfit.errors import InvalidArgument

    if run.strategy != "megatron":
        return None
    names = {**ROUTER_KEYS, "moe_z_loss_coeff": MEGATRON + RECOMPUTE + "moe_z_loss_coeff"}
    try:
        check_megatron_router("megatron_router", run.megatron_router, names=names)
    except InvalidArgument as exc:
        return f"the config's {exc}"
    return None


# NOTE [ SkyRL's entropy chunks sized from memory ]
# SkyRL's Megatron update computes the entropy over the [b, s, V/tp] logits in sequence chunks
# (skyrl/backends/skyrl_train/distributed/megatron/model_utils.py vocab_parallel_entropy, a9564572, SkyRL #1890).
# trainer.vocab_entropy_chunk_size says how many tokens a chunk holds: None, no chunks; a positive n, n tokens (no
# chunks when n >= s); 0 (the default), derived by _resolve_vocab_entropy_chunk_size from
# trainer.vocab_entropy_chunk_memory_mb (default 512): bytes_per_token = b × V/tp × the logits' element size × 4 (its
# peak_factor), chunk = the largest power of two <= max(1, min(s, memory_mb MiB // bytes_per_token)), no chunks when
# that is s or more. config.py (SkyRLTrainConfig, l. 1487-1491) holds the defaults and __post_init__ refuses a
# negative size and a memory of 0 or less. The Megatron profile runs SkyRL's head with the config's two values
# (RunConfig.entropy_chunk_size, entropy_chunk_memory_mb: batchfit.frameworks.run_step.megatron_heads, the chunk
# resolved in batchfit.train.megatron_heads as SkyRL resolves it), and --emit skyrl writes them as profiled
# (skyrl_emit._megatron_head). The fused head (fused_lm_head_logprob) chunks its entropy by logprobs_chunk_size.
ENTROPY_CHUNK_KEY = T + "vocab_entropy_chunk_size"
ENTROPY_MEMORY_KEY = T + "vocab_entropy_chunk_memory_mb"
ENTROPY_CHUNK_DEFAULTS = {ENTROPY_CHUNK_KEY: 0, ENTROPY_MEMORY_KEY: 512}
ENTROPY_PEAK_FACTOR = 4  # model_utils.py _resolve_vocab_entropy_chunk_size(peak_factor=4)


def entropy_chunk_tokens(memory_mb: int, vocab_shard: int, seq_len: int, rows: int = 1, element_size: int = 4) -> int | None:
    """The tokens of one entropy chunk SkyRL derives at ``vocab_entropy_chunk_size: 0``; ``None``: not chunked.

    NOTE [ SkyRL's entropy chunks sized from memory ]. ``vocab_shard`` is ``V / tp`` (the logits' last dimension on
    one rank), ``seq_len`` the logits' sequence length, ``rows`` their leading size, ``element_size`` the bytes of a
    logit (4: batchfit's Megatron heads take an fp32 copy).

    >>> entropy_chunk_tokens(512, 151_936 // 2, 8192)  # 512 MiB // (75,968 × 4 B × 4) = 441 -> 256
    256
    >>> entropy_chunk_tokens(512, 151_936 // 2, 256) is None  # min(256, 441) = 256 tokens: one chunk
    True
    """
    per_token = rows * vocab_shard * element_size * ENTROPY_PEAK_FACTOR
    chunk = max(1, min(seq_len, memory_mb * 1024 * 1024 // per_token))
    chunk = 1 << (chunk.bit_length() - 1)
    return chunk if chunk < seq_len else None


# NOTE [ Which SkyRL a config is written for ]
# SkyRL renamed and added budget keys after skyrl_train-v0.4.0 (2026-02-13; the skyrl 0.4.0 wheel batchfit's defaults
# come from has them all): trainer.max_tokens_per_microbatch (#1477, eda11272, 2026-06-12), trainer.use_sample_packing
# renamed trainer.remove_microbatch_padding (#1738, 8cd5f165, 2026-06-01; from_cli_overrides still maps the old name,
# with a DeprecationWarning), trainer.use_expandable_segments (#1768, 4e7fa48f, 2026-06-12),
# trainer.vocab_entropy_chunk_memory_mb (#1890, d5bbe8ce, 2026-07-21). A config's keys tell which side of each it was
# written on; --emit skyrl writes the new names (SkyRL at a9564572, 2026-08-21, reads them as the wheel does), and the
# note says which SkyRL that needs.
SINCE: dict[str, str] = {  # key -> the SkyRL PR (commit) that added it
    TOKEN_KEY: "#1477 (eda11272)",
    REMOVE_PADDING_KEY: "#1738 (8cd5f165)",
    EXPANDABLE_KEY: "#1768 (4e7fa48f)",
    T + "vocab_entropy_chunk_memory_mb": "#1890 (d5bbe8ce)",
}


def version_notes(given: dict[str, Any]) -> list[str]:
    """Which SkyRL the config's keys are written for, and which SkyRL the emitted keys need (NOTE [ Which SkyRL a
    config is written for ]); empty when the keys say nothing older than batchfit's SkyRL.

    >>> version_notes({"trainer.use_sample_packing": True})[0][:80]
    'trainer.use_sample_packing is the name SkyRL #1738 renamed trainer.remove_microb'
    """
    if REMOVE_PADDING_ALIAS not in given:
        return []
    newer = [key for key in SINCE if key in given and key != REMOVE_PADDING_KEY]
    written = (
        f"mixes it with keys of a later SkyRL ({', '.join(newer)})"
        if newer
        else "is written for a SkyRL before #1738 (8cd5f165, 2026-06-01)"
    )
    needs = ", ".join(f"{key} {since}" for key, since in SINCE.items())
    return [
        f"{REMOVE_PADDING_ALIAS} is the name SkyRL #1738 renamed {REMOVE_PADDING_KEY}: the config {written}; batchfit "
        f"reads it as {REMOVE_PADDING_KEY} (SkyRLTrainConfig.from_cli_overrides maps it, with a DeprecationWarning), "
        f"and --emit skyrl writes the keys of SkyRL 0.4.0 (read alike at a9564572), which an older SkyRL lacks: {needs}"
    ]


def _entropy_chunk_faults(flat: dict[str, Any]) -> list[str]:
    """TrainerConfig.__post_init__'s refusals of the entropy chunk keys (config.py l. 1544-1560, SkyRL a9564572)."""
    out = []
    size, memory = as_int(flat.get(ENTROPY_CHUNK_KEY)), as_int(flat.get(ENTROPY_MEMORY_KEY))
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        out.append(
            f"{ENTROPY_CHUNK_KEY}={short_repr(size)}: SkyRL's TrainerConfig refuses it (a non-negative integer or None); "
            "set it to 0 (chunks sized from vocab_entropy_chunk_memory_mb), a token count, or null (no chunks)"
        )
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        out.append(
            f"{ENTROPY_MEMORY_KEY}={short_repr(memory)}: SkyRL's TrainerConfig refuses it (a positive integer, MiB); "
            "set it to 512, SkyRL's default"
        )
    return out


def _megatron_warnings(flat: dict[str, Any], reference: bool, title: str) -> list[str]:
    """The reference laid out unlike the policy (batchfit profiles every model with the policy's layout).

    An entropy loss is modelled: the Megatron profile runs SkyRL's head with the entropy's graph under
    ``use_entropy_loss`` (:func:`batchfit.budget.megatron_profile.megatron_head`, ``RunConfig.entropy_grad``).
    """
    out: list[str] = []
    if not reference:
        return out
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        mine, theirs = as_int(flat.get(MEGATRON_REF + key, 1)), as_int(flat.get(MEGATRON + key, 1))
        if mine != theirs:
            out.append(
                f"{MEGATRON_REF}{key}={short_repr(mine)} differs from the policy's {MEGATRON}{key}={short_repr(theirs)}: "
                f"batchfit profiles the reference with the policy's layout ({title}); set them alike, or confirm the "
                "reference's on the device (profile --confirm)"
            )
    return out


def _recompute(flat: dict[str, Any], checkpointing: Any, warnings: list[str]) -> Any:
    """Megatron's recompute as batchfit's checkpointing (NOTE [ SkyRL's Megatron worker ]).

    ``trainer.gradient_checkpointing: false`` clears ``recompute_granularity``, ``recompute_method`` and
    ``recompute_num_layers`` (megatron_worker.py); true keeps ``transformer_config_kwargs``' (full, uniform, 1 by
    default): every layer checkpointed. Selective recompute is profiled as none (an upper bound), full recompute over
    chunks of several layers or of some layers as every layer, each with a warning.
    """
    if checkpointing is not True:
        return checkpointing
    key = MEGATRON + RECOMPUTE
    granularity = flat.get(key + "recompute_granularity")
    method, layers = flat.get(key + "recompute_method"), as_int(flat.get(key + "recompute_num_layers"))
    if granularity == "full" and method == "uniform" and layers in (1, None):
        return True
    if granularity == "full":
        warnings.append(
            f"{key}recompute_granularity=full with recompute_method={short_repr(method)}, recompute_num_layers="
            f"{short_repr(layers)}: batchfit checkpoints every layer (uniform, 1 layer), which keeps less than chunks of "
            "several layers or a few checkpointed layers; set recompute_method=uniform and recompute_num_layers=1, or "
            "confirm this setting on the device (profile --confirm)"
        )
        return True
    warnings.append(
        f"{key}recompute_granularity={short_repr(granularity)} with trainer.gradient_checkpointing=true: batchfit models "
        "full recompute of every layer or none; the budgets are for none (an upper bound of selective recompute); set "
        "it to full, or confirm this setting on the device (profile --confirm)"
    )
    return False


def _check_colocated_critic(flat: dict[str, Any], values: dict[str, Any], faults: list[str]) -> None:
    """trainer.build_models asserts the critic has the policy's GPUs under colocate_all."""
    if as_bool(flat.get(PLACEMENT + "colocate_all")) is not True:
        return
    critic = values["critic_world_size"]
    nodes, per_node = values.get("num_nodes") or 1, values.get("gpus_per_node") or 1
    if not all(isinstance(v, int) and v > 0 for v in (critic, nodes, per_node)):
        return  # a size that is not a count is a fault of its own
    if critic != nodes * per_node:
        faults.append(
            f"trainer.placement.colocate_all=true needs the critic on the policy's GPUs, but the critic has "
            f"critic_num_nodes × critic_num_gpus_per_node = {critic} and the policy {nodes * per_node} (SkyRL 0.4.0 "
            "trainer.py build_models asserts num_policy_gpus == num_critic_gpus): set "
            "trainer.placement.critic_num_nodes/critic_num_gpus_per_node to the policy's, or colocate_all=false"
        )


def _entropy(flat: dict[str, Any], megatron: bool, chunk: Any) -> tuple[str, int | None]:
    """How the policy's trained pass computes entropy (worker.py: compute_entropy=True, always).

    FSDP: ``chunked_entropy_from_logits`` in chunks of ``logprobs_chunk_size`` tokens
    (``model_wrapper.py``). Megatron: ``vocab_entropy_chunk_size`` (``None`` = no chunking,
    ``0`` = sized automatically, reported as an unknown chunk size).
    """
    if not megatron:
        return "chunked", chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else None
    size = as_int(flat.get(T + "vocab_entropy_chunk_size"))
    if size is None:
        return "full", None
    return "chunked", size if isinstance(size, int) and size > 0 else None


def _lora(flat: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    """A model's LoRA (``<model>.lora.*``, SkyRLLoraConfig), ``None`` at rank 0."""
    rank = as_int(flat.get(prefix + "rank", 0))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return None
    return {
        "rank": rank,
        "alpha": flat.get(prefix + "alpha"),
        "target_modules": flat.get(prefix + "target_modules"),
        "exclude_modules": flat.get(prefix + "exclude_modules"),
    }


def _placement(
    flat: dict[str, Any], critic: bool, reference: bool, offload: str
) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """Which models share GPUs, and what each keeps there while another runs.

    ``colocate_all``: every model shares the GPUs with the inference engines, and SkyRL
    offloads each model to the host when it is not running (nothing stays resident).
    ``colocate_policy_ref`` (without it): the reference shares the policy's GPUs, both kept.
    """
    roles = ["policy", *(["critic"] if critic else []), *(["reference"] if reference else [])]
    if as_bool(flat.get(PLACEMENT + "colocate_all")) is True:
        return tuple(roles), {}
    if reference and as_bool(flat.get(PLACEMENT + "colocate_policy_ref", True)) is True:
        kept = () if offload == "cpu" else ("parameters", "optimizer_state")
        return ("policy", "reference"), {"policy": kept, "reference": ("parameters",)}
    return (), {}


def _engine(flat: dict[str, Any], lora: dict[str, Any] | None) -> RolloutEngine:
    """The inference engines as SkyRL 0.4.0 runs them: on the trainer's GPUs under ``colocate_all``, asleep while it trains.

    ``inference_servers/utils.py``: ``enable_sleep_mode = colocate_all or offload_kv_for_weight_sync``;
    ``remote_inference_client.py``: ``sleep(level=2)``, level 1 when only LoRA adapters are synced;
    each engine rank is a Ray actor (a process of its own).
    """
    colocated = as_bool(flat.get(PLACEMENT + "colocate_all")) is True
    name = flat.get(ENGINE_PREFIX + "backend")
    keys = {
        "tensor_parallel": ENGINE_PREFIX + "tensor_parallel_size",
        "memory_fraction": ENGINE_PREFIX + "gpu_memory_utilization",
        "max_num_seqs": ENGINE_PREFIX + "max_num_seqs",
        "cuda_graphs": ENGINE_PREFIX + "enforce_eager",
        "offload": "keep trainer.policy.optimizer_config.offload_after_step=true (the optimizer state leaves the "
        "GPUs while the engines generate)",
    }
    return RolloutEngine(
        name=name if name in ENGINES else "vllm",
        colocated=colocated,
        tensor_parallel=as_int(flat.get(ENGINE_PREFIX + "tensor_parallel_size")) or 1,
        memory_fraction=flat.get(ENGINE_PREFIX + "gpu_memory_utilization"),
        sleeps=colocated or as_bool(flat.get(ENGINE_PREFIX + "offload_kv_for_weight_sync")) is True,
        sleep_level=1 if lora else 2,
        cuda_graphs=as_bool(flat.get(ENGINE_PREFIX + "enforce_eager")) is not True,
        max_num_seqs=as_int(flat.get(ENGINE_PREFIX + "max_num_seqs")),
        own_process=True,
        keys=keys,
    )


def _generation_resident(flat: dict[str, Any], critic: bool, offload: str) -> dict[str, tuple[str, ...]]:
    """What the trained models keep on the GPUs while colocated engines generate.

    ``worker_dispatch.py`` (SkyRL 0.4.0): before the engines wake, each model is offloaded
    (``offload_model=True``) and its optimizer state too when ``optimizer_config.offload_after_step``
    (the default); with ``fsdp_config.cpu_offload`` FSDP2 keeps everything on the host.
    """
    if as_bool(flat.get(PLACEMENT + "colocate_all")) is not True or offload == "cpu":
        return {}
    out = {}
    for role, prefix in (("policy", T + "policy."), *((("critic", T + "critic."),) if critic else ())):
        if as_bool(flat.get(prefix + "optimizer_config.offload_after_step")) is False:
            out[role] = ("optimizer_state",)
    return out


def _key_names(megatron: bool) -> dict[str, str]:
    """BatchConfig field → SkyRL's key, for the plan's messages."""
    keys = {**KEYS, **MEGATRON_KEYS} if megatron else KEYS
    names = {field: key for key, field in keys.items() if field not in ("num_nodes", "gpus_per_node")}
    if megatron:
        names.pop("sequence_parallel", None)
    return {
        **names,
        "max_tokens_per_micro_batch": TOKEN_KEY,
        "step_wise": STEP_WISE_KEY,
        "world_size": "trainer.placement.policy_num_nodes × policy_num_gpus_per_node",
        "critic_world_size": "trainer.placement.critic_num_nodes × critic_num_gpus_per_node",
        "critic_model_parallel": "trainer.critic.sequence_parallel_size",
        "reference_world_size": "trainer.placement.ref_num_nodes × ref_num_gpus_per_node",
        "reference_model_parallel": (
            "the reference's tp × pp × cp (trainer.ref.megatron_config)"
            if megatron
            else T + "ref.sequence_parallel_size"
        ),
    }


SPEC = FrameworkSpec(
    name="skyrl",
    title="SkyRL 0.4.0",
    display="SkyRL",
    markers=(
        "generator",
        "trainer.policy_mini_batch_size",
        "trainer.train_batch_size",
        "trainer.placement",
        "trainer.micro_train_batch_size_per_gpu",
        "trainer.policy",
    ),
    lora_keys={  # train/config/config.py SkyRLLoraConfig
        "policy": (
            "trainer.policy.model.lora.rank",
            "trainer.policy.model.lora.alpha",
            "trainer.policy.model.lora.target_modules",
        ),
        "critic": (
            "trainer.critic.model.lora.rank",
            "trainer.critic.model.lora.alpha",
            "trainer.critic.model.lora.target_modules",
        ),
    },
    read_config=read,
    batch_rules=SKYRL,
    strategy_refusal=megatron_refusal,
    head="skyrl",
    gpu_keys={
        "num_nodes": "trainer.placement.policy_num_nodes",
        "gpus_per_node": "trainer.placement.policy_num_gpus_per_node",
    },
    emit_needs_plan=True,
    emit="batchfit.frameworks.skyrl_emit",
)
"""SkyRL in :mod:`batchfit.frameworks.registry` (its reference loads in bf16: ``trainer.bf16: true``)."""
