"""NeMo-RL's GRPO config (``grpo.*``, ``policy.*``, ``cluster.*``) in batchfit's terms.

Mirrors NVIDIA-NeMo/RL at commit 7ea279ab (2026-08-22): ``examples/configs/grpo_math_1B.yaml`` (the
base its GRPO configs inherit: ``defaults/nemo_rl.yaml``, its keys in ``defaults/nemo_rl_schema.json``),
``nemo_rl/models/policy/lm_policy.py`` (``Policy.__init__``: the backend, the parallel sizes, dynamic
batching xor sequence packing; ``_shard_for_train`` / ``_shard_for_logprob``: which token key bounds
which pass), ``nemo_rl/distributed/batched_data_dict.py`` (``shard_by_batch_size``: the exact splits and
the token caps), ``nemo_rl/models/automodel/setup.py`` (the DTensor path: FSDP2 over fp32 master
weights with ``MixedPrecisionPolicy(param_dtype=precision, reduce_dtype=fp32)``, ``CPUOffloadPolicy``,
activation checkpointing) and ``nemo_rl/algorithms/grpo.py`` (the policy's GPUs; the reference).

Units: ``grpo.num_prompts_per_step`` counts prompts, ``grpo.num_generations_per_prompt`` samples per
prompt, ``policy.train_global_batch_size`` **samples** per optimizer step over all GPUs,
``policy.train_micro_batch_size`` and ``logprob_batch_size`` samples per GPU, the ``*_mb_tokens`` keys
tokens per GPU per micro-batch. The batch rules are exact splits (``framework="batchfit"``), which is
what ``shard_by_batch_size`` and ``make_microbatch_iterator`` assert; :func:`_rules` adds the ones the
plan does not hold (the log-prob micro-batches, the token caps against the longest sequence).
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.megatron_refusals import first_refusal, refused_sources
from batchfit.frameworks.registry import FrameworkSpec
from batchfit.frameworks.run import (
    RunConfig,
    as_bool,
    as_int,
    dtype_name,
    every_fault,
    is_positive_int,
    megatron_layout_fields,
    size_faults,
    unmodelled_warnings,
)
from batchfit.frameworks.source import flatten, framework_defaults, framework_schema
from batchfit.frameworks.your_sizes import pass_sizes
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import RolloutEngine, process_allocator_setting
from batchfit.validation import short_repr

__all__ = ["SPEC", "read", "register_resolvers", "strategy_refusal"]

COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
P = "policy."
DT = "policy.dtensor_cfg."
MG = "policy.megatron_cfg."
PACK = "policy.sequence_packing."
DYN = "policy.dynamic_batching."
GEN = "policy.generation."
BASE = "grpo_math_1B.yaml"

# NeMo-RL key -> BatchConfig field
KEYS: dict[str, str] = {
    "grpo.num_prompts_per_step": "train_batch_size",
    "grpo.num_generations_per_prompt": "n_samples_per_prompt",
    P + "train_micro_batch_size": "micro_train_batch_size_per_gpu",
    P + "logprob_batch_size": "micro_forward_batch_size_per_gpu",
    "cluster.num_nodes": "num_nodes",
    "cluster.gpus_per_node": "gpus_per_node",
}

# Keys that change memory in ways batchfit's budgets do not reproduce: a config that sets one away
# from grpo_math_1B.yaml's value gets a warning naming it. Remove a key once profile models it.
# Modelled, so not listed: dtensor_cfg.cpu_offload (offload), activation_checkpointing, precision
# (mixed precision), the parallel sizes (refused or profiled), offload_optimizer_for_logprob, the token
# and micro keys, env_vars' allocator setting.
UNMODELLED: dict[str, str] = {
    DT + "lora_cfg.enabled": "LoRA adapters (batchfit reads no NeMo-RL LoRA keys yet: the budgets are for full "
    "fine-tuning, an upper bound)",
    DT + "dp_replicate_size": "hybrid sharding (HSDP): state sharded over dp / dp_replicate_size GPUs, not all of them",
    DT + "expert_parallel_size": "expert parallelism (Automodel's MoE parallelizer)",
    DT + "custom_parallel_plan": "a custom tensor-parallel plan",
    DT + "automodel_kwargs.*": "Automodel's kernels and backends (Liger, Transformer Engine layers)",
    DT + "moe_parallelizer.*": "how Automodel wraps MoE layers into FSDP units",
    DT + "clear_cache_every_n_steps": "emptying the allocator's cache between micro-batches",
    P + "hf_config_overrides.*": "overrides of the model's Hugging Face config (batchfit profiles its config.json as "
    "it is)",
    P + "logprob_chunk_size": "log-probs in chunks along the sequence (batchfit's full head holds the whole logits: "
    "an upper bound)",
    P + "draft.enabled": "a draft (speculative) model trained beside the policy",
}


def register_resolvers() -> None:
    """NeMo-RL's OmegaConf resolvers (``${mul:a, b}`` and the others its configs use), once.

    ``nemo_rl/utils/config.py`` ``register_omegaconf_resolvers`` (7ea279ab) registers ``add``, ``mul``,
    ``div`` and ``max``; its ``grpo_math_1B.yaml`` sets ``dynamic_batching.train_mb_tokens:
    ${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}``. Called when this
    module is imported, so that :func:`batchfit.frameworks.source.resolve` can resolve them.
    """
    import inspect

    from omegaconf import OmegaConf

    # omegaconf 2.4 deprecates register_new_resolver for register_resolver (which in 2.3 is the old, deprecated one)
    modern = "replace" in inspect.signature(OmegaConf.register_resolver).parameters
    register = OmegaConf.register_resolver if modern else OmegaConf.register_new_resolver
    for name, fn in (
        ("add", lambda a, b: a + b),
        ("mul", lambda a, b: a * b),
        ("div", lambda a, b: a / b),
        ("max", lambda a, b: max(a, b)),
    ):
        if not OmegaConf.has_resolver(name):
            register(name, fn)


register_resolvers()


def read(data: dict[str, Any], given: dict[str, Any]) -> RunConfig:
    """A resolved NeMo-RL GRPO config (merged over ``grpo_math_1B.yaml``) as a :class:`RunConfig`.

    Args:
        data: the user's config merged over NeMo-RL's base config, interpolations resolved.
        given: the user's own keys (flattened).

    Raises:
        BatchConfigError: a key that is a close misspelling of one of NeMo-RL's (with the key meant),
            together with every other fault of the config.
    """
    flat = flatten(data)
    given = {key: flat.get(key, value) for key, value in given.items()}
    schema = framework_schema("nemo_rl")
    misspelt, warnings = schema.check_keys(given, ignore=BatchConfig.fields())
    faults: list[str] = []
    notes: list[str] = []
    _inheritance(given, warnings)

    megatron = as_bool(flat.get(MG + "enabled")) is True
    dtensor = as_bool(flat.get(DT + "enabled")) is True
    if megatron and dtensor:  # lm_policy.py Policy.__init__ raises
        faults.append(
            f"{MG}enabled and {DT}enabled are both true: NeMo-RL refuses two training backends (lm_policy.py "
            "Policy.__init__: 'Configure either Megatron ... or DTensor ..., not both'); set one to false"
        )
    elif not megatron and not dtensor:
        faults.append(
            f"neither {MG}enabled nor {DT}enabled is true: NeMo-RL needs a training backend (lm_policy.py "
            f"Policy.__init__); set {DT}enabled: true"
        )
    faults += size_faults(
        {k: v for k, v in flat.items() if k.startswith(("cluster.", DT, MG))},
        ("num_nodes", "gpus_per_node", "parallel_size"),
        schema.title,
        "GPUs, nodes and parallel sizes",
    )
    if megatron:
        tp, pp, cp = (as_int(flat.get(MG + k, 1)) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
        strategy = "megatron"
    else:
        tp, pp, cp = as_int(flat.get(DT + "tensor_parallel_size", 1)), 1, as_int(flat.get(DT + "context_parallel_size", 1))
        # NOTE [ DTensor tensor parallelism is refused ]: tp > 1 splits each layer's weights (DTensor TP)
        strategy = "dtensor_tp" if is_positive_int(tp) and tp > 1 else "fsdp2"

    n = as_int(flat.get("grpo.num_generations_per_prompt"))
    prompts = as_int(flat.get("grpo.num_prompts_per_step"))
    gbs = as_int(flat.get(P + "train_global_batch_size"))
    by_prompt = is_positive_int(n) and is_positive_int(gbs) and gbs % n == 0
    if not by_prompt and is_positive_int(n) and n > 1 and is_positive_int(gbs):
        notes.append(
            f"{P}train_global_batch_size={gbs} is not a multiple of grpo.num_generations_per_prompt={n}: NeMo-RL cuts a "
            "step's samples into optimizer steps by sample (shard_by_batch_size), so the plan counts samples (one per "
            "'prompt')"
        )
    packing = as_bool(flat.get(PACK + "enabled")) is True
    dynamic = as_bool(flat.get(DYN + "enabled")) is True
    if packing and dynamic:  # lm_policy.py asserts both ways
        faults.append(
            f"{PACK}enabled and {DYN}enabled are both true: NeMo-RL asserts 'Dynamic Batching is exclusive of Sequence "
            "Packing' (lm_policy.py Policy.__init__); set one to false"
        )
    if packing and not megatron and is_positive_int(cp) and cp > 1:  # automodel/setup.py raises
        faults.append(
            f"{DT}context_parallel_size={cp} with {PACK}enabled: NeMo-RL's DTensor path refuses context parallelism "
            "with sequence packing (automodel/setup.py: 'Context parallel is not supported for sequence packing'); set "
            "one of them off"
        )
    tokens_key = PACK if packing else DYN if dynamic else None
    train_tokens = as_int(flat.get(tokens_key + "train_mb_tokens")) if tokens_key else None
    forward_tokens = as_int(flat.get(tokens_key + "logprob_mb_tokens")) if tokens_key else None
    world, world_faults = _policy_gpus(flat)
    faults += world_faults
    values: dict[str, Any] = {field: as_int(flat.get(key)) for key, field in KEYS.items()}
    values.update(
        train_batch_size=prompts if by_prompt or not is_positive_int(n) else _product(prompts, n),
        n_samples_per_prompt=n if by_prompt or not is_positive_int(n) else 1,
        policy_mini_batch_size=(gbs // n if by_prompt else gbs) if is_positive_int(gbs) else gbs,
        critic_mini_batch_size=None,
        max_tokens_per_micro_batch=train_tokens,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        context_parallel=cp,
        framework="batchfit",  # exact splits: what shard_by_batch_size and make_microbatch_iterator assert
    )
    if world is not None:
        values.update(num_nodes=None, gpus_per_node=None, world_size=world)
    max_seq_len = as_int(flat.get(P + "max_total_sequence_length"))
    max_seq_len = max_seq_len if is_positive_int(max_seq_len) else None
    faults += _rules(flat, values, tokens_key, train_tokens, forward_tokens, max_seq_len, world)

    precision = dtype_name(flat.get(P + "precision"))
    mixed = {"bf16": "bf16", "fp32": "none"}.get(precision or "")
    if mixed is None:
        warnings.append(
            f"{P}precision={short_repr(flat.get(P + 'precision'))}: batchfit profiles NeMo-RL's DTensor path with "
            "bfloat16 or float32 compute only (MixedPrecisionPolicy(param_dtype=precision), automodel/setup.py); "
            "profile with bfloat16, or confirm this setting on the device (profile --confirm)"
        )
    reference = _reference(flat)
    if reference:
        notes.append(
            "reference log-probs run on the policy's own model with the reference weights swapped in "
            + (
                "(megatron/setup.py setup_reference_model_state: a host copy of the state dict), over the "
                if megatron
                else "(dtensor_policy_worker_v2.py use_reference_model: a pinned host copy of the state dict), over the "
            )
            + "log-prob micro-batches: the policy's forward pass covers them"
        )
    mcore = _megatron(flat, tp, precision) if megatron else None
    if mcore is not None:
        warnings += mcore["warnings"]
    warnings += unmodelled_warnings(given, framework_defaults("nemo_rl"), UNMODELLED, schema.title)
    engine = _engine(flat)
    prefix = (MG if megatron else DT) + "env_vars."  # a section, flattened
    env = {k[len(prefix) :]: str(v) for k, v in flat.items() if k.startswith(prefix) and v is not None}
    response = as_int(flat.get(GEN + "max_new_tokens"))
    run = RunConfig(
        vocabulary="nemo_rl",
        batch=BatchConfig(**values),
        model=flat.get(P + "model_name"),
        reference=False,  # NOTE above: the policy's forward pass covers the reference's
        max_seq_len=max_seq_len,
        max_response_len=response if is_positive_int(response) and max_seq_len and response < max_seq_len else None,
        strategy=strategy,
        offload="cpu" if not megatron and as_bool(flat.get(DT + "cpu_offload")) is True else "none",
        mixed_precision=None if mcore is not None else mixed,
        # automodel/setup.py: AutoConfig(torch_dtype=float32) "Always load in float32 for master weights"; Megatron:
        # megatron/setup.py _apply_precision_config, params_dtype from policy.precision
        dtype=mcore["dtype"] if mcore is not None else "fp32",
        reference_dtype="fp32",
        gradient_checkpointing=mcore["recompute"]
        if mcore is not None
        else as_bool(flat.get(DT + "activation_checkpointing")) is True,
        **megatron_layout_fields(mcore),
        remove_padding=packing,  # dynamic batching pads each micro-batch to its longest (rounded) sequence
        temperature=flat.get(GEN + "temperature"),
        engine=engine,
        # colocated generation: offload_before_refit moves the optimizer to the host, offload_after_refit the model
        generation_resident={},
        optimizer_offload=as_bool(flat.get(P + "offload_optimizer_for_logprob")) is True,
        # the DTensor v2 worker sets no allocator of its own (policy/utils.py get_runtime_env_for_policy_worker);
        # dtensor_cfg.env_vars reach the worker processes (lm_policy.py RayWorkerGroup(env_vars=...))
        allocator=process_allocator_setting(env) or "caching",
        faults=tuple(faults),
        warnings=tuple(warnings),
        notes=tuple(notes),
        key_names=_key_names(by_prompt, megatron),
        configured=pass_sizes(
            (tokens_key + "train_mb_tokens", train_tokens, "tokens")
            if tokens_key
            else (P + "train_micro_batch_size", values["micro_train_batch_size_per_gpu"], "sequences"),
            (tokens_key + "logprob_mb_tokens", forward_tokens, "tokens")
            if tokens_key
            else (P + "logprob_batch_size", values["micro_forward_batch_size_per_gpu"], "sequences"),
            reference=False,
            critic=False,
        ),
        source={
            "max_seq_len": P + "max_total_sequence_length",
            "world_size": "cluster.num_nodes × cluster.gpus_per_node (less the generation GPUs when not colocated)",
            "model": P + "model_name",
            "remove_padding": PACK + "enabled",
            "strategy": MG + "enabled" if megatron else DT + "enabled",
            **(refused_sources(mcore["refused"]) if mcore is not None else {}),
        },
    )
    if misspelt:
        every_fault(run, misspelt)
    return run


# NOTE [ NeMo-RL's Megatron backend ]
# nemo_rl/models/megatron/setup.py (7ea279ab) copies policy.megatron_cfg onto Megatron-Bridge's model provider:
# tensor_model_parallel_size, pipeline_model_parallel_size, sequence_parallel, context_parallel_size (which needs
# sequence packing), expert_model_parallel_size (_apply_moe_config); params_dtype from policy.precision
# (_apply_precision_config: bfloat16 → bf16 parameters); activation_checkpointing with recompute_granularity "full"
# is uniform over 1 layer (batchfit's full recompute), "selective" recomputes modules batchfit does not model. The
# DDP config's grad_reduce_in_fp32 (default false) and the optimizer's use_distributed_optimizer (default true) are
# megatron_cfg.distributed_data_parallel_config's and megatron_cfg.optimizer's. grpo_math_1B.yaml turns on
# optimizer.use_precision_aware_optimizer, Transformer Engine's FusedAdam keeping the main parameters and moments in
# the optimizer's own dtypes (optimizer.main_params_dtype, exp_avg_dtype, exp_avg_sq_dtype, main_grads_dtype: read),
# with optimizer.optimizer_cpu_offload / optimizer_offload_fraction (default 0.0) and the uneven pipeline's
# num_layers_in_first/last_pipeline_stage, all profiled (NOTE [ Megatron's optimizer offload and precision-aware
# optimizer ] in batchfit.train.megatron_step). The reference is a host copy of
# the weights swapped in (setup_reference_model_state), as on the DTensor path.

#: megatron_cfg keys batchfit's Megatron profile does not reproduce (checked against the merged config, the defaults
#: included): key → (the value batchfit profiles, what the budgets leave out).
MEGATRON_UNMODELLED: dict[str, tuple[Any, str]] = {
    MG + "distributed_data_parallel_config.grad_reduce_in_fp32": (
        True,
        "a bf16 gradient buffer, cast to fp32 at the optimizer step; batchfit's Megatron profile keeps an fp32 buffer: "
        "set it to true to run as profiled",
    ),
    MG + "use_fused_linear_logprobs": (
        False,
        "log-probs fused with the output layer in chunks (profiled with Megatron's vocab-parallel head over the "
        "whole logits: an upper bound)",
    ),
    MG + "fine_grained_activation_offloading": (False, "activations of some modules offloaded to the host"),
    MG + "fp8_cfg.enabled": (False, "FP8 GEMMs (Transformer Engine)"),
    MG + "expert_tensor_parallel_size": (1, "the experts' own tensor-parallel size"),
}

_MEGATRON_REFUSAL_WHY = {
    "lora": (
        "trains Megatron-Bridge LoRA adapters, which batchfit's Megatron profile does not model",
        f"set it to false, or train with {DT}enabled: true",
    ),
}


def _megatron(flat: dict[str, Any], tp: Any, precision: str | None) -> dict[str, Any]:
    """What ``profile`` reads of ``policy.megatron_cfg`` (NOTE [ NeMo-RL's Megatron backend ]): the layout, the
    recompute, the dtype, the warnings of what it does not model and the settings it refuses."""
    warnings = []
    for key, (modelled, what) in MEGATRON_UNMODELLED.items():
        value = flat.get(key)
        if value is not None and value != modelled:
            warnings.append(f"{key}={short_repr(value)} is not modelled: {what}")
    checkpointing = as_bool(flat.get(MG + "activation_checkpointing")) is True
    granularity = flat.get(MG + "recompute_granularity", "full")
    if checkpointing and granularity != "full":
        warnings.append(
            f"{MG}recompute_granularity={short_repr(granularity)} recomputes some modules of each layer, which batchfit "
            "does not model: profiled without recompute (more activations than the run keeps); set it to full to "
            "profile Megatron's full recompute"
        )
    refused = {}
    if as_bool(flat.get(MG + "peft.enabled")) is True:
        refused["lora"] = f"{MG}peft.enabled=True"
    ep = as_int(flat.get(MG + "expert_model_parallel_size", 1))
    precision_aware = as_bool(flat.get(MG + "optimizer.use_precision_aware_optimizer")) is True
    dtypes = {
        name: _short_dtype(flat.get(MG + "optimizer." + name))
        for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if flat.get(MG + "optimizer." + name) is not None and _short_dtype(flat.get(MG + "optimizer." + name)) != "fp32"
    }
    fraction = flat.get(MG + "optimizer.optimizer_offload_fraction")
    return {
        "first": _positive(flat.get(MG + "num_layers_in_first_pipeline_stage")),
        "last": _positive(flat.get(MG + "num_layers_in_last_pipeline_stage")),
        "offload": as_bool(flat.get(MG + "optimizer.optimizer_cpu_offload")) is True,
        "offload_fraction": float(fraction) if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) else None,
        "precision_aware": precision_aware,
        "optimizer_dtypes": dtypes if precision_aware else None,
        "sp": as_bool(flat.get(MG + "sequence_parallel")) is True and is_positive_int(tp) and tp > 1,
        "distributed_optimizer": as_bool(flat.get(MG + "optimizer.use_distributed_optimizer")) is True,
        "ep": ep if is_positive_int(ep) else 1,
        "recompute": checkpointing and granularity == "full",
        "dtype": "bf16" if precision == "bf16" else "fp32",
        "warnings": warnings,
        "refused": refused,
    }


def _positive(value: Any) -> int | None:
    value = as_int(value)
    return value if is_positive_int(value) else None


def _short_dtype(value: Any) -> Any:
    """Megatron-Bridge's optimizer dtypes (``torch.bfloat16``, ``"bf16"``, ``"float32"``) as Megatron-LM's flag names."""
    name = str(value).removeprefix("torch.")
    return {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}.get(name, name)


def _product(a: Any, b: Any) -> Any:
    return a * b if is_positive_int(a) and is_positive_int(b) else None


def _inheritance(given: dict[str, Any], warnings: list[str]) -> None:
    """NeMo-RL's ``defaults: parent.yaml`` (``load_config_with_inheritance``): batchfit merges over ``grpo_math_1B.yaml`` only."""
    parent = given.get("defaults")
    if parent is None:
        return
    parents = parent if isinstance(parent, list) else [parent]
    other = [p for p in parents if not (isinstance(p, str) and p.replace("\\", "/").rsplit("/", 1)[-1] == BASE)]
    if other:
        warnings.append(
            f"defaults={short_repr(parent)}: NeMo-RL merges the file over that parent config "
            f"(nemo_rl/utils/config.py load_config_with_inheritance), which batchfit does not read; it merges over "
            f"{BASE} at {COMMIT[:8]} instead, so the parent's own keys are missing: pass the composed config, or "
            "copy the parent's policy, grpo and cluster keys into this file"
        )


def _policy_gpus(flat: dict[str, Any]) -> tuple[int | None, list[str]]:
    """The policy's GPUs when generation has GPUs of its own (grpo.py setup), else ``None`` (the whole cluster).

    Non-colocated generation on one node takes ``policy.generation.colocated.resources.gpus_per_node`` of
    its GPUs; on several nodes ``resources.num_nodes`` whole nodes.
    """
    if as_bool(flat.get(GEN + "colocated.enabled", True)) is not False:
        return None, []
    nodes, per_node = as_int(flat.get("cluster.num_nodes")), as_int(flat.get("cluster.gpus_per_node"))
    gen_gpus = as_int(flat.get(GEN + "colocated.resources.gpus_per_node"))
    gen_nodes = as_int(flat.get(GEN + "colocated.resources.num_nodes"))
    if not (is_positive_int(nodes) and is_positive_int(per_node)):
        return None, []
    if nodes == 1:
        if not is_positive_int(gen_gpus) or gen_gpus >= per_node:
            return None, [
                f"{GEN}colocated.resources.gpus_per_node={short_repr(gen_gpus)}: with generation not colocated on one "
                f"node NeMo-RL asserts it is set and leaves the policy at least one of the {per_node} GPUs (grpo.py "
                "setup); set it between 1 and cluster.gpus_per_node - 1"
            ]
        return per_node - gen_gpus, []
    if not is_positive_int(gen_nodes) or gen_nodes >= nodes:
        return None, [
            f"{GEN}colocated.resources.num_nodes={short_repr(gen_nodes)}: with generation not colocated on "
            f"{nodes} nodes NeMo-RL asserts it is set and leaves the policy at least one node (grpo.py setup); set it "
            "between 1 and cluster.num_nodes - 1"
        ]
    return (nodes - gen_nodes) * per_node, []


def _rules(
    flat: dict[str, Any],
    values: dict[str, Any],
    tokens_key: str | None,
    train_tokens: Any,
    forward_tokens: Any,
    max_seq_len: int | None,
    world: int | None,
) -> list[str]:
    """NeMo-RL's rules that the exact-split plan does not hold.

    - Without token budgets, each DP rank's share of a step's samples is cut into log-prob
      micro-batches of ``logprob_batch_size`` (``get_logprobs`` → ``make_microbatch_iterator`` asserts
      the share is a multiple; ``_shard_for_logprob`` asserts the step splits over the DP ranks).
    - With sequence packing a sequence rounded up to ``make_sequence_length_divisible_by`` longer than
      the bin raises (``nemo_rl/data/packing/algorithms.py``: "Sequence length ... exceeds bin capacity");
      with dynamic batching one longer than the budget fails an assert (``shard_by_batch_size``). Both
      are hard caps, so the longest sequence must fit each token key.
    """
    faults: list[str] = []
    if tokens_key is None:
        n, prompts, mbs = (values.get(k) for k in ("n_samples_per_prompt", "train_batch_size", "micro_forward_batch_size_per_gpu"))
        gpus = world if world is not None else _product(values.get("num_nodes"), values.get("gpus_per_node"))
        mp = _product(_product(values.get("tensor_parallel"), values.get("pipeline_parallel")), values.get("context_parallel"))
        samples = _product(prompts, n)
        if all(is_positive_int(x) for x in (samples, gpus, mp, mbs)) and gpus % mp == 0:
            dp = gpus // mp
            if samples % dp == 0 and (samples // dp) % mbs:
                faults.append(
                    f"{P}logprob_batch_size={mbs} does not divide each data-parallel rank's {samples // dp} samples "
                    f"(grpo.num_prompts_per_step × num_generations_per_prompt = {samples} over {dp} ranks): NeMo-RL's "
                    "log-prob pass asserts it (batched_data_dict.py make_microbatch_iterator); set it to a divisor of "
                    f"{samples // dp}"
                )
        return faults
    for name, tokens in (("train_mb_tokens", train_tokens), ("logprob_mb_tokens", forward_tokens)):
        key = tokens_key + name
        if not is_positive_int(tokens):
            faults.append(f"{key}={short_repr(tokens)} must be a positive integer (tokens per GPU per micro-batch)")
            continue
        if max_seq_len is None:
            continue
        if tokens_key == PACK:
            multiple = as_int(flat.get(P + "make_sequence_length_divisible_by", 1))
            multiple = multiple if is_positive_int(multiple) else 1
            longest = -(-max_seq_len // multiple) * multiple
            how = (
                f"the longest sequence, {max_seq_len} tokens"
                + (f" rounded up to make_sequence_length_divisible_by={multiple}, {longest}" if longest != max_seq_len else "")
                + ", exceeds the bin: NeMo-RL's packer raises (data/packing/algorithms.py 'exceeds bin capacity')"
            )
        else:
            longest = max_seq_len
            how = (
                f"the longest sequence, {max_seq_len} tokens, exceeds it: NeMo-RL's dynamic batching asserts every "
                "padded sequence fits (batched_data_dict.py shard_by_batch_size)"
            )
        if tokens < longest:
            faults.append(f"{key}={tokens} is a hard cap and {how}; set it to at least {longest}")
    return faults


def _reference(flat: dict[str, Any]) -> bool:
    """GRPO computes reference log-probs when ``loss_fn.reference_policy_kl_penalty > 0`` (grpo.py: init_reference_model)."""
    kl = flat.get("loss_fn.reference_policy_kl_penalty")
    return isinstance(kl, (int, float)) and not isinstance(kl, bool) and kl > 0


def _engine(flat: dict[str, Any]) -> RolloutEngine:
    """vLLM as NeMo-RL runs it: on the policy's GPUs unless ``generation.colocated.enabled`` is false, asleep while it trains."""
    vllm = GEN + "vllm_cfg."
    colocated = as_bool(flat.get(GEN + "colocated.enabled", True)) is not False
    fraction = flat.get(vllm + "gpu_memory_utilization")
    return RolloutEngine(
        name="vllm",
        colocated=colocated,
        tensor_parallel=as_int(flat.get(vllm + "tensor_parallel_size")) or 1,
        memory_fraction=fraction if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) else None,
        sleeps=colocated,
        cuda_graphs=as_bool(flat.get(vllm + "enforce_eager")) is not True,
        own_process=True,
        keys={
            "tensor_parallel": vllm + "tensor_parallel_size",
            "memory_fraction": vllm + "gpu_memory_utilization",
            "cuda_graphs": vllm + "enforce_eager",
            "sleeps": GEN + "colocated.enabled",
        },
    )


def _key_names(by_prompt: bool, megatron: bool) -> dict[str, str]:
    """BatchConfig field → NeMo-RL's key, for the plan's messages."""
    names = {field: key for key, field in KEYS.items() if field not in ("num_nodes", "gpus_per_node")}
    parallel = (
        {
            "tensor_parallel": MG + "tensor_model_parallel_size",
            "pipeline_parallel": MG + "pipeline_model_parallel_size",
            "context_parallel": MG + "context_parallel_size",
        }
        if megatron
        else {"tensor_parallel": DT + "tensor_parallel_size", "context_parallel": DT + "context_parallel_size"}
    )
    return {
        **names,
        **parallel,
        "policy_mini_batch_size": f"{P}train_global_batch_size / grpo.num_generations_per_prompt"
        if by_prompt
        else P + "train_global_batch_size",
        "max_tokens_per_micro_batch": "policy.sequence_packing.train_mb_tokens (or dynamic_batching.train_mb_tokens)",
        "world_size": "cluster.num_nodes × cluster.gpus_per_node",
    }


# NOTE [ DTensor tensor parallelism is refused ]
# NeMo-RL's DTensor path with dtensor_cfg.tensor_parallel_size > 1 splits each layer's weights and
# activations over the TP group (Automodel's parallelizer on a (dp, cp, tp) device mesh,
# automodel/setup.py setup_distributed), which batchfit does not model, as it does not model Megatron.
# Both are refused with the approximation a flag gives (strategy_refusal); FSDP2 (tp = 1) is modelled.


def strategy_refusal(run: Any) -> str | None:
    """Why ``profile`` cannot model NeMo-RL's Megatron training (its LoRA: NOTE [ What a Megatron profile refuses ]) or
    its DTensor tensor parallelism, and the approximation a flag gives; ``None`` when it can."""
    cfg = run.batch
    if run.strategy == "megatron":
        return first_refusal(run, _MEGATRON_REFUSAL_WHY)
    if run.strategy == "dtensor_tp":
        return (
            f"the config's {DT}tensor_parallel_size={cfg.tensor_parallel} splits each layer's weights and activations "
            "over a tensor-parallel group (NeMo-RL's DTensor path, automodel/setup.py), which batchfit does not model; "
            "pass --sharding fsdp2 to profile FSDP2 over the same GPUs instead (an approximation: FSDP2 holds whole "
            f"activations that tensor parallelism splits), or set {DT}tensor_parallel_size: 1"
        )
    return None


SPEC = FrameworkSpec(
    name="nemo_rl",
    title="NeMo-RL 7ea279ab",
    display="NeMo-RL",
    markers=(
        "grpo",
        "policy.train_global_batch_size",
        "policy.train_micro_batch_size",
        "policy.dtensor_cfg",
        "policy.megatron_cfg",
        "policy.sequence_packing",
    ),
    read_config=read,
    head="full",
    reference_dtype="fp32",  # the reference is a host copy of the policy's fp32 master weights
    strategy_refusal=strategy_refusal,
    gpu_keys={"num_nodes": "cluster.num_nodes", "gpus_per_node": "cluster.gpus_per_node"},
    emit="batchfit.frameworks.nemo_rl_emit",
)
"""NeMo-RL in :mod:`batchfit.frameworks.registry`: exact splits, log-probs from the whole (fp32) logits, FSDP2 over
fp32 master weights (its DTensor path at tensor_parallel_size 1)."""
