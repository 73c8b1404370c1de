"""slime's launch command (``python3 train.py --flag value …``) in batchfit's terms.

Mirrors THUDM/slime at commit 624b824a (``slime/utils/arguments.py``: the flags in
``defaults/slime_flags.json`` and ``slime_validate_args``; ``slime/utils/dp_schedule.py``
``build_dp_schedule``, which cuts each rollout into optimizer steps and micro-batches) and the
Megatron-LM checks slime runs (``megatron/training/arguments.py`` ``validate_args``,
``megatron/core/num_microbatches_calculator.py``), each rule in :func:`rules` citing its code.

Units: ``--rollout-batch-size`` counts prompts, ``--global-batch-size`` **samples** per optimizer
step over all GPUs, ``--micro-batch-size`` samples per GPU, ``--max-tokens-per-gpu`` tokens per
GPU (packed rows; a micro-batch holds up to ``max_tokens_per_gpu × context_parallel_size``
tokens, each GPU of the context-parallel group a slice). slime trains with Megatron only;
it ignores flags it does not know (Megatron parses with ``ignore_unknown_args=True``). Its Megatron
layout (tensor, pipeline, sequence parallel; the distributed optimizer slime always turns on) is
profiled as :class:`~batchfit.parallel.sharding.Sharding` ``"megatron"``.
"""

from __future__ import annotations

import difflib
from typing import Any

from batchfit.frameworks.flags import Command, FrameworkRun, Verdict, flag_spec, parse_command
from batchfit.frameworks.registry import FrameworkSpec
from batchfit.frameworks.run import as_int, int_product, is_positive_int, positive_int_faults
from batchfit.frameworks.your_sizes import pass_sizes
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import RolloutEngine, process_allocator_setting

# Megatron-LM flags slime reads (Megatron's parser, not slime's file): ModelParallelConfig's
# tensor/pipeline/context_parallel_size, TrainingConfig.decrease_batch_size_if_needed,
# TransformerConfig.recompute_granularity and sequence_parallel, DistributedDataParallelConfig's
# use_distributed_optimizer, OptimizerConfig's optimizer_cpu_offload, optimizer_offload_fraction, use_precision_aware_optimizer
# and its main_params/main_grads/exp_avg/exp_avg_sq dtypes (flags are the fields with dashes), the
# uneven first/last pipeline stages (--decoder-first/last-pipeline-num-layers, d98e8a64 arguments.py l. 3095: Megatron's
# TransformerConfig.num_layers_in_first/last_pipeline_stage), --expert-tensor-parallel-size, and the
# virtual pipeline stages validate_args derives (--num-layers, --num-layers-per-virtual-pipeline-stage,
# --num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout: _virtual_stages), and the MoE router's
# --moe-router-load-balancing-type and --moe-aux-loss-coeff (d98e8a64 arguments.py l. 3532-3537: nargs '+', Megatron-LM's
# choices and defaults) and --moe-router-dtype, --moe-z-loss-coeff (TransformerConfig's fields, their flags made by
# ArgumentGroupFactory: the Literal's choices, default None): NOTE [ Megatron's router settings ] in batchfit.budget.options.
_MANY = ("moe_router_load_balancing_type", "moe_aux_loss_coeff")  # Megatron-LM's nargs '+' (a list combines types)
MEGATRON_FLAGS: tuple[dict[str, Any], ...] = tuple(
    {"flags": [flag], "dest": dest, "action": action, "type": kind, "nargs": "+" if dest in _MANY else None, "const": None,
     "default": default, "choices": choices, "required": False}
    for flag, dest, action, kind, default, choices in (
        ("--tensor-model-parallel-size", "tensor_model_parallel_size", "_StoreAction", "int", 1, None),
        ("--pipeline-model-parallel-size", "pipeline_model_parallel_size", "_StoreAction", "int", 1, None),
        ("--context-parallel-size", "context_parallel_size", "_StoreAction", "int", 1, None),
        ("--expert-model-parallel-size", "expert_model_parallel_size", "_StoreAction", "int", 1, None),
        ("--expert-tensor-parallel-size", "expert_tensor_parallel_size", "_StoreAction", "int", None, None),
        ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers", "_StoreAction", "int", None, None),
        ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers", "_StoreAction", "int", None, None),
        ("--decrease-batch-size-if-needed", "decrease_batch_size_if_needed", "_StoreTrueAction", None, False, None),
        ("--recompute-granularity", "recompute_granularity", "_StoreAction", "str", None, ["full", "selective"]),
        ("--sequence-parallel", "sequence_parallel", "_StoreTrueAction", None, False, None),
        ("--use-distributed-optimizer", "use_distributed_optimizer", "_StoreTrueAction", None, False, None),
        ("--optimizer-cpu-offload", "optimizer_cpu_offload", "_StoreTrueAction", None, False, None),
        ("--optimizer-offload-fraction", "optimizer_offload_fraction", "_StoreAction", "float", 1.0, None),
        ("--use-precision-aware-optimizer", "use_precision_aware_optimizer", "_StoreTrueAction", None, False, None),
        ("--main-params-dtype", "main_params_dtype", "_StoreAction", "str", "fp32", ["fp32", "fp16"]),
        ("--main-grads-dtype", "main_grads_dtype", "_StoreAction", "str", "fp32", ["fp32", "bf16"]),
        ("--exp-avg-dtype", "exp_avg_dtype", "_StoreAction", "str", "fp32", ["fp32", "fp16", "bf16", "fp8"]),
        ("--exp-avg-sq-dtype", "exp_avg_sq_dtype", "_StoreAction", "str", "fp32", ["fp32", "fp16", "bf16", "fp8"]),
        ("--num-layers", "num_layers", "_StoreAction", "int", None, None),
        ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage", "_StoreAction", "int", None, None),
        ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank", "_StoreAction", "int", None, None),
        ("--pipeline-model-parallel-layout", "pipeline_model_parallel_layout", "_StoreAction", "str", None, None),
        ("--moe-router-load-balancing-type", "moe_router_load_balancing_type", "_StoreAction", "str", "aux_loss",
         ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"]),
        ("--moe-aux-loss-coeff", "moe_aux_loss_coeff", "_StoreAction", "float", 0.0, None),
        ("--moe-router-dtype", "moe_router_dtype", "_StoreAction", "str", None, ["fp32", "fp64"]),
        ("--moe-z-loss-coeff", "moe_z_loss_coeff", "_StoreAction", "float", None, None),
    )
)  # fmt: skip
#: Megatron-LM's router flags → their TransformerConfig fields (NOTE [ Megatron's router settings ])
ROUTER_FLAGS = {
    "moe_router_load_balancing_type": "--moe-router-load-balancing-type",
    "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
    "moe_router_dtype": "--moe-router-dtype",
    "moe_z_loss_coeff": "--moe-z-loss-coeff",
}
READ = frozenset(
    {
        "hf_checkpoint",
        "actor_num_nodes",
        "actor_num_gpus_per_node",
        "rollout_batch_size",
        "n_samples_per_prompt",
        "global_batch_size",
        "num_steps_per_rollout",
        "micro_batch_size",
        "use_dynamic_batch_size",
        "max_tokens_per_gpu",
        "rollout_max_context_len",
        "rollout_max_prompt_len",
        "rollout_max_response_len",
        "advantage_estimator",
        "kl_coef",
        "use_kl_loss",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        "decrease_batch_size_if_needed",
        "recompute_granularity",
        "sequence_parallel",
        "use_distributed_optimizer",
        "optimizer_cpu_offload",
        "optimizer_offload_fraction",
        "use_precision_aware_optimizer",
        "main_params_dtype",
        "main_grads_dtype",
        "exp_avg_dtype",
        "exp_avg_sq_dtype",
        "log_probs_chunk_size",
        "entropy_coef",
        "use_rollout_entropy",
        "num_layers",
        "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank",
        "pipeline_model_parallel_layout",
        *ROUTER_FLAGS,
    }
)
KEY_NAMES = {
    "train_batch_size": "--rollout-batch-size",
    "n_samples_per_prompt": "--n-samples-per-prompt",
    "micro_train_batch_size_per_gpu": "--micro-batch-size",
    "max_tokens_per_micro_batch": "--max-tokens-per-gpu",
    "tensor_parallel": "--tensor-model-parallel-size",
    "pipeline_parallel": "--pipeline-model-parallel-size",
    "context_parallel": "--context-parallel-size",
}
_BATCH_WORDS = ("batch", "tokens-per", "n-samples", "num-gpus", "num-nodes", "parallel-size", "steps-per")


def read(command: Command) -> FrameworkRun:
    """The launch command as a :class:`FrameworkRun` (slime's rules apply at ``plan()``).

    Raises:
        BatchConfigError: what slime's parser refuses (a bad value, no ``--rollout-batch-size``),
            a misspelt batch flag (slime ignores unknown flags, so it would be dropped
            silently), or an unresolved shell value of a flag batchfit reads.
    """
    from batchfit.errors import BatchConfigError

    spec = flag_spec("slime")
    parsed = parse_command(command, spec, read=READ, extra=MEGATRON_FLAGS, ignore_unknown=True)
    misspelt = _misspelt(parsed.unknown, [*spec.by_flag, *(f["flags"][0] for f in MEGATRON_FLAGS)])
    if misspelt:
        raise BatchConfigError(misspelt)
    v = parsed.values
    n, rollout = v["n_samples_per_prompt"], v["rollout_batch_size"]
    world = int_product(v["actor_num_nodes"], v["actor_num_gpus_per_node"])
    tp, pp, cp = (
        v["tensor_model_parallel_size"],
        v["pipeline_model_parallel_size"],
        v["context_parallel_size"],
    )
    dp = world // (tp * pp * cp) if is_positive_int(world) and all(map(is_positive_int, (tp, pp, cp))) else None
    gbs, derived = _global_batch_size(v, dp)
    vpp, vpp_fault = _virtual_stages(v)
    notes = [*command.notes, *parsed.notes]
    if derived:
        notes.append(derived)
    by_prompt = is_positive_int(n) and is_positive_int(gbs) and gbs % n == 0
    if not by_prompt and is_positive_int(n) and n > 1 and is_positive_int(gbs):
        notes.append(
            f"--global-batch-size={gbs} is not a multiple of --n-samples-per-prompt={n}: slime cuts a rollout into "
            "optimizer steps by sample, so the plan counts samples (one per 'prompt')"
        )
    dynamic = bool(v["use_dynamic_batch_size"])
    critic = v.get("advantage_estimator") == "ppo"  # slime_validate_args: use_critic
    if v.get("log_probs_max_tokens_per_gpu") is not None:
        notes.append(
            "--log-probs-max-tokens-per-gpu is parsed but not read at this slime commit: log-probs run the "
            "training micro-batches (build_dp_schedule)"
        )
    mini = (gbs // n if by_prompt else gbs) if is_positive_int(gbs) else None
    batch = BatchConfig(
        train_batch_size=rollout if by_prompt else int_product(rollout, n),
        policy_mini_batch_size=mini,
        n_samples_per_prompt=n if by_prompt else 1,
        critic_mini_batch_size=mini if critic else None,
        micro_train_batch_size_per_gpu=v["micro_batch_size"],
        micro_forward_batch_size_per_gpu=v["micro_batch_size"],
        max_tokens_per_micro_batch=v["max_tokens_per_gpu"] if dynamic else None,
        num_nodes=v["actor_num_nodes"],
        gpus_per_node=v["actor_num_gpus_per_node"],
        tensor_parallel=tp,
        pipeline_parallel=pp,
        context_parallel=cp,
        framework="batchfit",  # exact splits: what Megatron's calculator asserts (see rules)
    )
    if v.get("kl_coef") or v.get("use_kl_loss"):
        notes.append(
            "reference log-probs run on the actor's own model with the reference weights swapped in "
            "(actor.train_actor, _switch_model('ref')), over the same micro-batches: the policy's forward pass "
            "covers them"
        )
    return FrameworkRun(
        vocabulary="slime",
        batch=batch,
        model=v["hf_checkpoint"],
        # slime's critic is a second Megatron model on the actor's GPUs, loaded from the same checkpoint
        critic_model=v["hf_checkpoint"] if critic else None,
        reference=False,
        max_seq_len=_max_seq_len(v),
        max_response_len=v["rollout_max_response_len"] if is_positive_int(v.get("rollout_max_response_len")) else None,
        strategy="megatron",
        # Megatron-LM's --sequence-parallel, off without tensor parallelism (arguments.py)
        megatron_sequence_parallel=bool(v.get("sequence_parallel")) and tp != 1,
        # set_default_megatron_args (slime/backends/megatron_utils/arguments.py): "always use zero optimizer"
        distributed_optimizer=True,
        virtual_pipeline_parallel=vpp,
        # Megatron-LM's --expert-model-parallel-size (NOTE [ The Megatron probe's worst rank ] in batchfit.budget.megatron_probe)
        expert_parallel=v["expert_model_parallel_size"] if is_positive_int(v.get("expert_model_parallel_size")) else 1,
        # Megatron-LM's --expert-tensor-parallel-size (None: Megatron's default, the tensor-parallel size)
        expert_tensor_parallel=_positive_or_none(v.get("expert_tensor_parallel_size")),
        # Megatron-LM's uneven pipeline (TransformerConfig.num_layers_in_first/last_pipeline_stage): the middle
        # stages split the rest; checked against the model's layers when the profile builds it
        first_pipeline_stage_layers=_positive_or_none(v.get("decoder_first_pipeline_num_layers")),
        last_pipeline_stage_layers=_positive_or_none(v.get("decoder_last_pipeline_num_layers")),
        # Megatron-LM's --optimizer-cpu-offload (HybridDeviceOptimizer, --optimizer-offload-fraction of the state on the
        # host) and --use-precision-aware-optimizer with its dtypes (arguments.py l. 2922, 3667-3683; defaults fp32)
        optimizer_cpu_offload=bool(v.get("optimizer_cpu_offload")),
        optimizer_offload_fraction=v["optimizer_offload_fraction"],
        precision_aware_optimizer=bool(v.get("use_precision_aware_optimizer")),
        # Megatron-LM's router flags the command sets, as TransformerConfig fields (slime builds its config from
        # Megatron's arguments: core_transformer_config_from_args); what it refuses, strategy_refusal names
        megatron_router=_router(v, parsed.given),
        optimizer_dtypes={k: v[k] for k in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype") if v[k] != "fp32"},
        faults=tuple(f for f in (vpp_fault, *_layer_count_faults(v)) if f),
        gradient_checkpointing=v.get("recompute_granularity") == "full",
        remove_padding=True,  # megatron_utils validate_args: "always use varlen" (packed THD micro-batches)
        # the head of each pass (frameworks.run_step.megatron_heads): loss.py get_log_probs_and_entropy chunks by
        # --log-probs-chunk-size (-1: one chunk), the update's entropy keeps its graph when --entropy-coef != 0,
        # the forward passes compute one under --use-rollout-entropy (model.py forward_only)
        logprobs_chunk_size=v["log_probs_chunk_size"] if is_positive_int(v.get("log_probs_chunk_size")) else None,
        entropy="full",
        entropy_grad=bool(v.get("entropy_coef")),
        entropy_in_loss=bool(v.get("entropy_coef")),
        forward_entropy="full" if v.get("use_rollout_entropy") else "none",
        # with a critic slime offloads the idle model (use_critic forces offload_train)
        colocated=("policy", "critic") if critic else (),
        resident={},
        # --colocate: the train actor pauses all its memory under torch_memory_saver while SGLang generates
        generation_resident={},
        engine=_engine(v, command),
        allocator=_allocator(v, command),
        key_names={
            **KEY_NAMES,
            "policy_mini_batch_size": "--global-batch-size / --n-samples-per-prompt"
            if by_prompt
            else "--global-batch-size",
        },
        source={
            "max_seq_len": "--rollout-max-context-len (or --rollout-max-prompt-len + --rollout-max-response-len)",
            "world_size": "--actor-num-nodes × --actor-num-gpus-per-node",
            "model": "--hf-checkpoint",
            "strategy": "--train-backend megatron",
            "megatron_router": ", ".join(ROUTER_FLAGS.values()),
        },
        rules=rules,
        values={**v, "global_batch_size": gbs},
        notes=tuple(notes),
        # the sizes the command sets, put beside batchfit's budgets (your_sizes.compare): one for every pass
        configured=pass_sizes(
            *[("--max-tokens-per-gpu", v["max_tokens_per_gpu"], "tokens")] * 2
            if dynamic
            else [("--micro-batch-size", v["micro_batch_size"], "sequences")] * 2,
            reference=False,
            critic=critic,
        ),
    )


def _virtual_stages(v: dict[str, Any]) -> tuple[int | None, str]:
    """Model chunks per pipeline rank, as Megatron-LM's ``validate_args`` derives them (d98e8a64, arguments.py l. 927–979),
    and the fault that keeps batchfit from knowing them (``""`` when none).

    ``--num-virtual-stages-per-pipeline-rank`` is the count; ``--num-layers-per-virtual-pipeline-stage`` gives
    ``num_layers / pp / it``; 1 means none. ``--pipeline-model-parallel-layout`` (an uneven layout) is not
    modelled, and neither is a per-stage layer count without ``--num-layers`` in the command.
    """
    pp, per_rank, per_stage = (
        v.get("pipeline_model_parallel_size"),
        v.get("num_virtual_stages_per_pipeline_rank"),
        v.get("num_layers_per_virtual_pipeline_stage"),
    )
    if v.get("pipeline_model_parallel_layout") is not None:
        return None, (
            f"--pipeline-model-parallel-layout={v['pipeline_model_parallel_layout']!r} lays layers out unevenly over the "
            "pipeline, which batchfit does not model (its stages hold equal layers); use "
            "--num-virtual-stages-per-pipeline-rank N, or profile without it"
        )
    if is_positive_int(per_rank):
        return (per_rank if per_rank > 1 else None), ""
    if per_stage is None:
        return None, ""
    layers = v.get("num_layers")
    if not (is_positive_int(layers) and is_positive_int(pp) and is_positive_int(per_stage)):
        return None, (
            f"--num-layers-per-virtual-pipeline-stage={per_stage} needs the model's --num-layers in the command to count "
            "the virtual stages (Megatron's validate_args: num_layers / pipeline size / it); pass "
            "--num-virtual-stages-per-pipeline-rank N instead, or resolve MODEL_ARGS"
        )
    if layers % pp or (layers // pp) % per_stage:
        return None, (
            f"--num-layers={layers} over --pipeline-model-parallel-size={pp} is not a multiple of "
            f"--num-layers-per-virtual-pipeline-stage={per_stage} (Megatron's validate_args asserts it)"
        )
    chunks = layers // pp // per_stage
    return (chunks if chunks > 1 else None), ""


def _router(v: dict[str, Any], given: frozenset[str]) -> dict[str, Any]:
    """The router's ``TransformerConfig`` fields the command sets (NOTE [ Megatron's router settings ] in
    :mod:`batchfit.budget.options`), unchecked (:func:`strategy_refusal` checks them).

    Megatron-LM's ``validate_args`` makes a one-element list of ``--moe-router-load-balancing-type`` or
    ``--moe-aux-loss-coeff`` its element (d98e8a64 l. 1661-1664). Either flag given sets both fields, the other at
    Megatron-LM's default (``aux_loss``, 0.0): slime's model is Megatron-LM's arguments, where the model's mapping
    (mbridge's, which the probe builds) has no load balancing and the Hugging Face config's coefficient. The dtype
    and the z-loss are set only when given.
    """
    out: dict[str, Any] = {}
    for dest in ROUTER_FLAGS:
        value = v.get(dest)
        out[dest] = value[0] if isinstance(value, list) and len(value) == 1 else tuple(value) if isinstance(value, list) else value
    balancing = {"moe_router_load_balancing_type", "moe_aux_loss_coeff"}
    chosen = {*(balancing if balancing & given else set()), *({"moe_router_dtype", "moe_z_loss_coeff"} & given)}
    return {dest: out[dest] for dest in ROUTER_FLAGS if dest in chosen}


def strategy_refusal(run: Any) -> str | None:
    """What slime's command sets of Megatron's router that batchfit's Megatron profile does not model (a load
    balancing type, a coefficient), in one line naming the flag, its value and the fix; ``None``: everything modelled."""
    from batchfit.budget.options import check_megatron_router
    from batchfit.errors import InvalidArgument

    try:
        check_megatron_router("megatron_router", run.megatron_router, names=ROUTER_FLAGS)
    except InvalidArgument as exc:
        return f"{exc} (or drop it from the command to profile without it)"
    return None


def _positive_or_none(value: Any) -> int | None:
    return value if is_positive_int(value) else None


def _layer_count_faults(v: dict[str, Any]) -> tuple[str, ...]:
    """What Megatron-LM refuses of the per-stage sizes before any build: ``TransformerConfig.__post_init__``'s
    "must be larger than 0" for the uneven stages, and a non-positive ``--expert-tensor-parallel-size``."""
    out = []
    for flag, dest in (
        ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
        ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
        ("--expert-tensor-parallel-size", "expert_tensor_parallel_size"),
    ):
        value = v.get(dest)
        if value is not None and not is_positive_int(value):
            out.append(f"{flag}={value!r} must be a positive integer (Megatron-LM refuses it); pass a positive count or drop it")
    return tuple(out)


def _global_batch_size(v: dict[str, Any], dp: int | None) -> tuple[int | None, str]:
    """slime_validate_args derives it from --num-steps-per-rollout; Megatron's validate_args defaults it to mbs × dp."""
    gbs, steps = v.get("global_batch_size"), v.get("num_steps_per_rollout")
    if (
        is_positive_int(steps)
        and is_positive_int(v.get("rollout_batch_size"))
        and is_positive_int(v.get("n_samples_per_prompt"))
    ):
        derived = v["rollout_batch_size"] * v["n_samples_per_prompt"] // steps
        if gbs is None:
            return (
                derived,
                f"--global-batch-size = --rollout-batch-size × --n-samples-per-prompt // --num-steps-per-rollout = {derived} (slime_validate_args)",
            )
        return gbs, ""
    if gbs is None and is_positive_int(v.get("micro_batch_size")) and dp is not None:
        derived = v["micro_batch_size"] * dp
        return derived, (
            f"--global-batch-size is not set: Megatron uses --micro-batch-size × data-parallel size = {derived} "
            "(validate_args), so each rollout trains in many small optimizer steps"
        )
    return gbs, ""


def rules(run: FrameworkRun) -> Verdict:
    """slime's (and Megatron's) batch rules on ``run`` (its batch after overrides, its other flags)."""
    v, cfg = run.values, run.batch
    faults: list[str] = []
    warnings: list[str] = []
    notes: list[str] = []
    samples = int_product(cfg.train_batch_size, cfg.n_samples_per_prompt)
    gbs = int_product(cfg.policy_mini_batch_size, cfg.n_samples_per_prompt)
    ints = {
        "--rollout-batch-size × --n-samples-per-prompt": samples,
        "--global-batch-size": gbs,
        "--micro-batch-size": cfg.micro_train_batch_size_per_gpu,
        "--actor-num-nodes": cfg.num_nodes,
        "--actor-num-gpus-per-node": cfg.gpus_per_node,
        "--tensor-model-parallel-size": cfg.tensor_parallel,
        "--pipeline-model-parallel-size": cfg.pipeline_parallel,
        "--context-parallel-size": cfg.context_parallel,
    }
    if faults := list(positive_int_faults(ints)):
        return Verdict(faults=tuple(faults))
    steps, given = v.get("num_steps_per_rollout"), v.get("global_batch_size")
    if is_positive_int(steps) and given is not None and given != samples // steps:
        # slime_validate_args asserts global_batch_size == rollout_batch_size * n // num_steps_per_rollout
        faults.append(
            f"--global-batch-size={given} disagrees with --rollout-batch-size × --n-samples-per-prompt // "
            f"--num-steps-per-rollout = {samples} // {steps} = {samples // steps} (slime_validate_args asserts they "
            "match); drop one of the two"
        )
    micro, mp = (
        cfg.micro_train_batch_size_per_gpu,
        cfg.tensor_parallel * cfg.pipeline_parallel * cfg.context_parallel,
    )
    world = run.world_size
    dynamic = bool(v.get("use_dynamic_batch_size")) or cfg.max_tokens_per_micro_batch is not None
    if world % mp:
        # megatron validate_args: world size divisible by tp × pp × cp
        faults.append(
            f"--actor-num-nodes × --actor-num-gpus-per-node = {world} GPUs are not divisible by tensor × pipeline × "
            f"context parallel = {mp} (Megatron validate_args asserts it); use a multiple of {mp} GPUs"
        )
        return Verdict(faults=tuple(faults))
    dp = world // mp
    if samples < gbs:
        # build_dp_schedule: num_steps = num_rollouts // global_batch_size, asserted >= 1
        faults.append(
            f"a rollout of {samples} samples is smaller than --global-batch-size={gbs}: slime asserts at least one "
            f"optimizer step per rollout (build_dp_schedule); set --global-batch-size to a divisor of {samples}"
        )
    elif samples % gbs:
        # build_dp_schedule: "trailing rollouts whose samples don't fit are dropped"
        faults.append(
            f"--rollout-batch-size × --n-samples-per-prompt = {samples} samples are not a multiple of "
            f"--global-batch-size={gbs}: slime drops the last {samples % gbs} of every rollout (build_dp_schedule); "
            f"set --global-batch-size to a divisor of {samples}"
        )
    decrease = bool(v.get("decrease_batch_size_if_needed"))
    if gbs % (micro * dp):
        if not decrease:
            # num_microbatches_calculator: global batch size divisible by micro batch size × data parallel size;
            # slime initialises it even with dynamic batch sizes (initialize.py)
            faults.append(
                f"--global-batch-size={gbs} is not divisible by --micro-batch-size × data-parallel size = {micro} × {dp} "
                f"= {micro * dp} (dp = {world} GPUs / tp·pp·cp {mp}): Megatron's microbatch calculator asserts it, "
                f"with dynamic batch sizes too; set --global-batch-size to a multiple of {micro * dp}"
            )
        elif not dynamic and -(-gbs // micro) % dp:
            # build_dp_schedule (static): the step's micro-batch count must be a multiple of dp
            faults.append(
                f"--global-batch-size={gbs} in micro-batches of --micro-batch-size={micro} makes {-(-gbs // micro)}, not "
                f"a multiple of the {dp} data-parallel ranks (build_dp_schedule asserts it); set --global-batch-size "
                f"to a multiple of {micro * dp}"
            )
        else:
            warnings.append(
                f"--global-batch-size={gbs} is not divisible by --micro-batch-size × dp = {micro * dp}: with "
                "--decrease-batch-size-if-needed Megatron's calculator rounds it down for its own count (slime "
                "schedules the full step itself)"
            )
    if gbs < dp:
        faults.append(
            f"--global-batch-size={gbs} samples are fewer than the {dp} data-parallel ranks (build_dp_schedule "
            "asserts at least one sample per rank)"
        )
    if dynamic:
        tokens, longest = cfg.max_tokens_per_micro_batch, run.max_seq_len
        if not is_positive_int(tokens):
            # slime_validate_args: "max_tokens_per_gpu must be set when use_dynamic_batch_size is set"
            faults.append(
                "--use-dynamic-batch-size needs --max-tokens-per-gpu (slime_validate_args asserts it)"
            )
        elif is_positive_int(longest) and tokens * cfg.context_parallel < longest:
            # dp_schedule: a sample above max_tokens_per_gpu × cp lands alone in its own micro-batch
            warnings.append(
                f"--max-tokens-per-gpu={tokens} × --context-parallel-size={cfg.context_parallel} is below the longest "
                f"sequence, {longest} tokens: slime runs a longer sample alone in a micro-batch above the budget "
                "(build_dp_schedule)"
            )
        if v.get("balance_by_flops"):
            warnings.append(
                "--balance-by-flops partitions micro-batches by estimated FLOPs, which may exceed --max-tokens-per-gpu "
                "(slime's own help text); drop it to keep the token cap"
            )
    return Verdict(tuple(faults), tuple(warnings), tuple(notes))


def _engine(v: dict[str, Any], command: Command) -> RolloutEngine:
    """The SGLang engines as slime runs them (``slime/backends/sglang_utils/sglang_engine.py``).

    On the trainer's GPUs with ``--colocate``; ``--offload-rollout`` (on under ``--colocate``) releases
    every memory tag, the CUDA-graph pool included (``release_memory_occupation()`` without tags);
    each engine a server process of its own. Its own flags pass through as ``--sglang-*``.
    """
    sglang = _sglang_flags(command.args)
    colocated = bool(v.get("colocate"))
    offload = v.get("offload_rollout")
    sleeps = bool(v.get("offload") or offload or (offload is None and colocated))
    sizes = sglang.get("--sglang-cuda-graph-bs")
    largest = sglang.get("--sglang-cuda-graph-max-bs-decode", sglang.get("--sglang-cuda-graph-max-bs"))
    if sizes is None and largest:
        sizes = [as_int(largest[0])]
    fraction = sglang.get("--sglang-mem-fraction-static")
    return RolloutEngine(
        name="sglang",
        colocated=colocated,
        tensor_parallel=v.get("rollout_num_gpus_per_engine") or 1,
        memory_fraction=_float(fraction[0]) if fraction else None,
        sleeps=sleeps,
        cuda_graphs="--sglang-disable-cuda-graph" not in sglang,
        capture_sizes=None if sizes is None else tuple(as_int(x) for x in sizes),
        releases_graphs=True,
        own_process=True,
        keys={
            "tensor_parallel": "--rollout-num-gpus-per-engine",
            "memory_fraction": "--sglang-mem-fraction-static",
            "capture_sizes": "--sglang-cuda-graph-bs",
            "sleeps": "--offload-rollout",
        },
    )


def _allocator(v: dict[str, Any], command: Command) -> str:
    """The train actors' allocator: expandable segments only when asked (``SLIME_ENABLE_EXPANDABLE_SEGMENTS=1``,
    ``slime/utils/accelerator/torch_accelerator.py``, or ``PYTORCH_CUDA_ALLOC_CONF`` in ``--train-env-vars``)."""
    env = {**command.environment, **(v.get("train_env_vars") if isinstance(v.get("train_env_vars"), dict) else {})}
    if str(env.get("SLIME_ENABLE_EXPANDABLE_SEGMENTS", "0")) == "1":
        return "expandable_segments"
    return process_allocator_setting(env) or "caching"


def _sglang_flags(args: tuple[str, ...]) -> dict[str, list[str]]:
    """slime's ``--sglang-*`` pass-through flags (SGLang's own, registered at run time) → their values."""
    out: dict[str, list[str]] = {}
    flag = None
    for word in args:
        if word.startswith("--"):
            flag, _, value = word.partition("=")
            flag = flag if flag.startswith("--sglang-") else None
            if flag is not None:
                out[flag] = [value] if value else []
        elif flag is not None:
            out[flag].append(word)
    return out


def _float(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _max_seq_len(v: dict[str, Any]) -> int | None:
    if is_positive_int(v.get("rollout_max_context_len")):
        return v["rollout_max_context_len"]
    prompt, response = v.get("rollout_max_prompt_len"), v.get("rollout_max_response_len")
    return prompt + response if is_positive_int(prompt) and is_positive_int(response) else None


def _misspelt(unknown: tuple[str, ...], known: list[str]) -> list[str]:
    """Unknown flags that nearly spell a batch flag: slime would ignore them (Megatron's ignore_unknown_args)."""
    faults = []
    batchy = [k for k in known if any(w in k for w in _BATCH_WORDS)]
    for word in unknown:
        if not word.startswith("--") or word.startswith("--sglang-"):
            continue
        flag = word.split("=", 1)[0]
        near = difflib.get_close_matches(flag, batchy, n=1, cutoff=0.85)
        if near:
            faults.append(
                f"unknown flag {flag}; did you mean {near[0]}? slime ignores flags it does not know (Megatron parses "
                "with ignore_unknown_args), so this one would be dropped silently"
            )
    return faults


SPEC = FrameworkSpec(
    name="slime",
    title="slime 624b824a",
    launchers=("train.py", "train_async.py"),
    markers=("--rollout-batch-size", "--global-batch-size"),
    read_command=read,
    strategy_refusal=strategy_refusal,
    emit="batchfit.frameworks.slime_emit",
)
"""slime in :mod:`batchfit.frameworks.registry`: its rules apply at ``FrameworkRun.plan``; the whole logits' log-probs;
a bf16 reference."""
