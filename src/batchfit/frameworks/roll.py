"""ROLL's RLVR YAML config (``actor_train``, ``reference``, ``critic``, ``rollout_batch_size``, ...) in batchfit's terms.

Mirrors alibaba/ROLL at commit 8eb27cc2 (2026-08-19): the dataclasses of
``roll/pipeline/rlvr/rlvr_config.py`` (``RLVRConfig``, ``roll/configs/base_config.py`` ``PPOConfig``,
``roll/configs/worker_config.py`` ``WorkerConfig``: defaults and keys in ``defaults/roll.yaml`` and
``defaults/roll_schema.json``; ``examples/start_rlvr_pipeline.py`` reads the YAML with
``dacite.from_dict``, which ignores unknown keys), ``roll/pipeline/base_worker.py`` (``train_step``:
mini-batches), ``roll/utils/dynamic_batching.py`` (``dynamic_batching_shard``: micro-batches under a
token cap) and the strategies of ``roll/distributed/strategy/``. Each rule in :func:`rules` cites its code.

Units: ``rollout_batch_size`` counts prompts, each sampled ``num_return_sequences_in_group`` times;
``training_args.per_device_train_batch_size`` sequences per GPU per micro-batch and
``gradient_accumulation_steps`` micro-batches per optimizer step (``backward_batch_size`` = their
product, per data-parallel rank); ``infer_batch_size`` sequences per forward-only micro-batch;
``max_tokens_per_microbatch_in_train/infer`` a hard cap on a micro-batch's **padded** tokens
(sequences × the longest one rounded up to ``sequence_length_round_in_*``), honoured by the Megatron
strategy only at this commit (NOTE [ ROLL's token cap ]).

``megatron_train`` is profiled as :class:`~batchfit.parallel.sharding.Sharding` ``"megatron"`` with the layout its
``strategy_config`` sets (NOTE [ ROLL's Megatron strategy ]).
"""

from __future__ import annotations

import ast
import re
from typing import Any

from batchfit.frameworks.flags import FrameworkRun, Verdict
from batchfit.frameworks.megatron_refusals import first_refusal, refused_sources
from batchfit.frameworks.registry import FrameworkSpec
from batchfit.frameworks.run import (
    as_bool,
    as_int,
    dtype_name,
    every_fault,
    int_product,
    is_positive_int,
    megatron_layout_fields,
    positive_int_faults,
)
from batchfit.frameworks.source import flatten, framework_schema
from batchfit.frameworks.your_sizes import YourSize
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import ENGINES, RolloutEngine
from batchfit.validation import short_repr

__all__ = ["SPEC", "device_count", "devices", "read", "rules"]

TITLE = "ROLL 8eb27cc2"

# NOTE [ ROLL's token cap ]
# roll/utils/dynamic_batching.py dynamic_batching_shard (8eb27cc2) sorts the batch by length, deals it over the dp
# ranks, and closes a micro-batch when its sequences × its longest sequence (rounded up to sequence_length_round)
# would pass max_tokens_per_microbatch; it asserts that one sequence, rounded, fits. A hard cap on padded tokens,
# counted before a context-parallel split. make_micro_batch_iter_for_dynamic_batching, which narrows each
# micro-batch to that length, is called by megatron_strategy.py only: fsdp2_strategy.py's train_step and
# forward_step cut micro-batches by per_device_train_batch_size and infer_batch_size whatever the cap, and
# base_worker.py groups gradient_accumulation_steps of the capped micro-batches into one optimizer step.

# NOTE [ ROLL's Megatron strategy ]
# megatron_strategy.py (8eb27cc2) MegatronInferStrategy.__init__ builds mcore_adapter's TrainingArguments from the
# worker's training_args updated with strategy_args.strategy_config, so each strategy_config key is a field of
# mcore_adapter/src/mcore_adapter/training_args.py: tensor_model_parallel_size, pipeline_model_parallel_size,
# context_parallel_size, virtual_pipeline_model_parallel_size, expert_model_parallel_size (None: 1),
# expert_tensor_parallel_size (None: initialize.py passes it to Megatron's initialize_model_parallel, whose default is
# the tensor-parallel size),
# sequence_parallel (False), recompute_granularity (None; "full" with recompute_method and recompute_num_layers unset
# becomes uniform over 1 layer: models/model_config.py __post_init__, i.e. every layer's input checkpointed, which is
# batchfit's full recompute), use_distributed_optimizer (False), accumulate_allreduce_grads_in_fp32 (False: a bf16
# gradient buffer, MegatronTrainStrategy.initialize's DistributedDataParallelConfig(grad_reduce_in_fp32=...)),
# optimizer_cpu_offload (False). model_config.py turns sequence_parallel off without tensor parallelism and on with
# tensor and expert parallelism both. The parameters are bf16 when model_args.dtype is bf16 (worker_config.py sets
# training_args.bf16), the optimizer's main copy fp32 (get_megatron_optimizer). Under Megatron
# model_args.disable_gradient_checkpointing is not read (model_providers.py reads it for HF models only): recompute is
# strategy_config.recompute_granularity. Log-probs: vocab_parallel_logprobs over the tensor-parallel logits
# (op_compute_log_probs); the profile runs Megatron's vocab-parallel head.

_RANGE = re.compile(r"^\s*list\(\s*range\(\s*(\d+)\s*,\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*\)\s*$")


def devices(value: Any) -> tuple[int, ...] | None:
    """The GPU ids of a ``device_mapping`` (``worker_config.py`` evals the string: ``"list(range(0,8))"`` or a list;
    batchfit reads those two forms and never evaluates anything), ``None`` for anything else."""
    if isinstance(value, str):
        match = _RANGE.match(value)
        if match:
            start, stop, step = int(match.group(1)), int(match.group(2)), int(match.group(3) or 1)
            return tuple(range(start, stop, step)) if step > 0 else None
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return None
    if isinstance(value, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        return tuple(value)
    return None


def device_count(value: Any) -> int | None:
    """How many GPUs a ``device_mapping`` names (:func:`devices`), ``None`` when it cannot be read."""
    found = devices(value)
    return None if found is None else len(found)


def _engine(flat: dict[str, Any]) -> RolloutEngine:
    """``actor_infer``'s vLLM or SGLang engines: on the trainer's GPUs where the two device_mappings overlap (the
    examples' layout); rlvr_pipeline.py offloads them after each generation (``actor_infer.offload_states()``, vLLM's
    sleep at ``strategy_config.sleep_level``, 1 by default: vllm_strategy.py) and the actor before it."""
    name = flat.get("actor_infer.strategy_args.strategy_name")
    config = "actor_infer.strategy_args.strategy_config."
    train, infer = devices(flat.get("actor_train.device_mapping")), devices(flat.get("actor_infer.device_mapping"))
    colocated = bool(train and infer and set(train) & set(infer))
    fraction = flat.get(config + ("gpu_memory_utilization" if name == "vllm" else "mem_fraction_static"))
    return RolloutEngine(
        name=name if name in ENGINES else "vllm",
        colocated=colocated,
        tensor_parallel=as_int(flat.get("actor_infer.num_gpus_per_worker")) or 1,
        memory_fraction=fraction,
        sleeps=True,
        sleep_level=as_int(flat.get(config + "sleep_level")) or 1 if name == "vllm" else None,
        own_process=True,
        keys={
            "tensor_parallel": "actor_infer.num_gpus_per_worker",
            "memory_fraction": config + ("gpu_memory_utilization" if name == "vllm" else "mem_fraction_static"),
        },
    )


def _worker(flat: dict[str, Any], role: str) -> dict[str, Any]:
    """What batchfit reads of one worker section (``WorkerConfig``)."""
    w = f"{role}."
    strategy = flat.get(w + "strategy_args.strategy_name")
    config = w + "strategy_args.strategy_config."
    return {
        "strategy": strategy,
        "gpus": device_count(flat.get(w + "device_mapping")),
        "per_worker": as_int(flat.get(w + "num_gpus_per_worker", 1)),
        "tp": as_int(flat.get(config + "tensor_model_parallel_size", 1)),
        "pp": as_int(flat.get(config + "pipeline_model_parallel_size", 1)),
        "cp": as_int(flat.get(config + "context_parallel_size", 1)),
        "ulysses": as_int(flat.get(w + "model_args.ulysses_size") or 1),
        "micro": as_int(flat.get(w + "training_args.per_device_train_batch_size")),
        "ga": as_int(flat.get(w + "training_args.gradient_accumulation_steps")),
        "infer": as_int(flat.get(w + "infer_batch_size")),
        "dynamic_train": as_bool(flat.get(w + "use_dynamic_batching_in_train")) is True,
        "train_cap": as_int(flat.get(w + "max_tokens_per_microbatch_in_train")),
        "train_round": as_int(flat.get(w + "sequence_length_round_in_train")),
        "dynamic_infer": as_bool(flat.get(w + "use_dynamic_batching_in_infer")) is True,
        "infer_cap": as_int(flat.get(w + "max_tokens_per_microbatch_in_infer")),
        "infer_round": as_int(flat.get(w + "sequence_length_round_in_infer")),
        "checkpointing": as_bool(flat.get(w + "model_args.disable_gradient_checkpointing")) is not True,
        "vpp": as_int(flat.get(config + "virtual_pipeline_model_parallel_size")),
        "ep": as_int(flat.get(config + "expert_model_parallel_size") or 1),
        # mcore_adapter training_args.py: None, passed to initialize_model_parallel (Megatron's default: the TP size)
        "etp": as_int(flat.get(config + "expert_tensor_parallel_size")),
        "megatron_sp": as_bool(flat.get(config + "sequence_parallel")) is True,
        "distributed_optimizer": as_bool(flat.get(config + "use_distributed_optimizer")) is True,
        "recompute": flat.get(config + "recompute_granularity"),
    }


#: strategy_config keys of megatron_train batchfit's Megatron profile does not reproduce: key → (ROLL's default, what
#: the budgets leave out). mcore_adapter/src/mcore_adapter/training_args.py (8eb27cc2) for the defaults.
_MEGATRON_UNMODELLED: dict[str, tuple[Any, str]] = {
    "recompute_method": (None, "a recompute method other than uniform (batchfit's full recompute checkpoints every layer)"),
    "recompute_num_layers": (None, "recompute over more than 1 layer per unit (batchfit's full recompute checkpoints every layer)"),
    "recompute_modules": (None, "selective recompute's modules"),
    "optimizer_cpu_offload": (False, "the optimizer state offloaded to the host (counted on the GPU: budgets lower than the run needs)"),
    "optimizer_offload_fraction": (0.0, "part of the optimizer state on the host (counted on the GPU)"),
    "fp8": (None, "FP8 GEMMs (Transformer Engine)"),
}


def _megatron(flat: dict[str, Any], actor: dict[str, Any], workers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What ``profile`` reads of ``actor_train``'s Megatron strategy (NOTE [ ROLL's Megatron strategy ]): the layout,
    the recompute, the warnings and faults of what it does not model, and the settings it refuses."""
    config = "actor_train.strategy_args.strategy_config."
    warnings: list[str] = []
    faults: list[str] = []
    refused: dict[str, str] = {}
    tp, ep = actor["tp"], actor["ep"]
    sp = actor["megatron_sp"]
    if is_positive_int(tp) and tp > 1 and is_positive_int(ep) and ep > 1:
        sp = True  # model_config.py: expert and tensor parallelism need sequence parallelism
    sp = sp and is_positive_int(tp) and tp > 1  # model_config.py: off without tensor parallelism
    vpp = actor["vpp"]
    if vpp is not None and not is_positive_int(vpp):
        faults.append(f"{config}virtual_pipeline_model_parallel_size={short_repr(vpp)} must be a positive integer")
    if flat.get(config + "pipeline_model_parallel_layout") is not None:
        faults.append(
            f"{config}pipeline_model_parallel_layout={short_repr(flat.get(config + 'pipeline_model_parallel_layout'))} "
            "lays layers out unevenly over the pipeline, which batchfit does not model (its stages hold equal layers); "
            "use virtual_pipeline_model_parallel_size, or profile without it"
        )
    recompute = actor["recompute"]
    if recompute not in (None, "full"):
        warnings.append(
            f"{config}recompute_granularity={short_repr(recompute)} recomputes parts of each layer, which batchfit does "
            "not model: profiled without recompute (more activations than the run keeps: the budgets are conservative); "
            "set it to full to profile Megatron's full recompute"
        )
    for key, (default, what) in _MEGATRON_UNMODELLED.items():
        value = flat.get(config + key)
        if value is not None and value != default:
            warnings.append(
                f"{config}{key}={short_repr(value)} is not modelled ({what}); ROLL's default is {short_repr(default)}"
            )
    if as_bool(flat.get(config + "accumulate_allreduce_grads_in_fp32")) is not True:
        warnings.append(
            f"{config}accumulate_allreduce_grads_in_fp32 is false (ROLL's default): Megatron keeps a bf16 gradient "
            "buffer and casts it to fp32 at the optimizer step, where batchfit's Megatron profile keeps an fp32 buffer "
            "(grad_reduce_in_fp32); the budgets are for the run with it set true (--emit roll writes it)"
        )
    if flat.get("actor_train.model_args.lora_target") is not None:
        refused["lora"] = f"actor_train.model_args.lora_target={short_repr(flat.get('actor_train.model_args.lora_target'))}"
    if "critic" in workers:
        refused["critic"] = f"adv_estimator={short_repr(flat.get('adv_estimator'))}"
    ref = workers.get("reference")
    if ref is not None:
        layout = ("tp", "pp", "cp")
        if not (isinstance(ref["strategy"], str) and "megatron" in ref["strategy"]) or any(
            ref[k] != actor[k] for k in layout
        ):
            warnings.append(
                f"reference.strategy_args ({ref['strategy']}, tensor {ref['tp']} × pipeline {ref['pp']} × context "
                f"{ref['cp']}) differs from actor_train's Megatron layout: batchfit profiles the reference laid out as "
                "the actor"
            )
    return {
        "sp": sp,
        "vpp": vpp if is_positive_int(vpp) and vpp > 1 else None,
        "ep": ep if is_positive_int(ep) else 1,
        "etp": actor["etp"] if is_positive_int(actor["etp"]) else None,
        "distributed_optimizer": actor["distributed_optimizer"],
        "recompute": recompute == "full",
        "warnings": warnings,
        "faults": faults,
        "refused": refused,
    }


def read(data: dict[str, Any], given: dict[str, Any]) -> FrameworkRun:
    """A resolved ROLL RLVR config (its dataclass defaults merged, interpolations resolved) as a :class:`FrameworkRun`.

    Raises:
        BatchConfigError: a close misspelling of one of ROLL's keys (dacite would drop it silently), with every other
            fault of the config.
    """
    flat = flatten(data)
    given = {key: flat.get(key, value) for key, value in given.items()}
    misspelt, warnings = framework_schema("roll").check_keys(given, ignore=(*BatchConfig.fields(), "hydra"))
    faults: list[str] = []
    notes: list[str] = []
    actor = _worker(flat, "actor_train")
    name = actor["strategy"]
    megatron = isinstance(name, str) and "megatron" in name
    # fsdp2_train is fully_shard: ROLL's "fsdp" (FrameworkSpec.fsdp = fsdp2 profiles it so)
    strategy = "megatron" if megatron else ("fsdp" if name in ("fsdp2_train", "fsdp2_infer") else str(name))
    if actor["gpus"] is None:
        faults.append(
            f"actor_train.device_mapping={short_repr(flat.get('actor_train.device_mapping'))} is not a list of GPUs or "
            "'list(range(a, b))' (worker_config.py evals it); write it so"
        )
    world = actor["gpus"] // actor["per_worker"] if actor["gpus"] and is_positive_int(actor["per_worker"]) else None
    tp, pp, cp = (actor["tp"], actor["pp"], actor["cp"]) if megatron else (1, 1, 1)
    sp = actor["ulysses"] if strategy == "fsdp" else 1
    dp = world // (tp * pp * cp * sp) if is_positive_int(world) and all(map(is_positive_int, (tp, pp, cp, sp))) else None
    n = as_int(flat.get("num_return_sequences_in_group"))
    prompts = as_int(flat.get("rollout_batch_size"))
    backward = int_product(actor["micro"], actor["ga"])  # base_worker.py: backward_batch_size, per dp rank
    mini_samples = int_product(backward, dp)
    by_prompt = is_positive_int(mini_samples) and is_positive_int(n) and mini_samples % n == 0
    samples = int_product(prompts, n)
    critic = flat.get("adv_estimator") == "gae"  # rlvr_pipeline.py: critic.compute_values only under gae
    reference = bool(
        as_bool(flat.get("enable_reference")) is True
        or as_bool(flat.get("use_kl_loss")) is True
        or (isinstance(flat.get("init_kl_coef"), (int, float)) and flat.get("init_kl_coef") > 0)
    )  # base_config.py PPOConfig.__post_init__: use_kl_loss or init_kl_coef > 0 → enable_reference
    if not megatron and (actor["dynamic_train"] or actor["dynamic_infer"]):
        warnings.append(
            f"actor_train.strategy_args.strategy_name={name}: ROLL's dynamic batching cuts micro-batches by the token "
            "cap under megatron strategies only; fsdp2_strategy.py runs per_device_train_batch_size and "
            "infer_batch_size sequences per micro-batch whatever the cap (NOTE [ ROLL's token cap ] in "
            "batchfit.frameworks.roll)"
        )
    batch = BatchConfig(
        train_batch_size=prompts if by_prompt else samples,
        policy_mini_batch_size=(mini_samples // n if by_prompt else mini_samples) if is_positive_int(mini_samples) else None,
        n_samples_per_prompt=n if by_prompt else 1,
        critic_mini_batch_size=None,
        micro_train_batch_size_per_gpu=actor["micro"],
        micro_forward_batch_size_per_gpu=actor["infer"],
        max_tokens_per_micro_batch=actor["train_cap"] if actor["dynamic_train"] and is_positive_int(actor["train_cap"]) else None,
        update_epochs_per_batch=as_int(flat.get("ppo_epochs")),
        world_size=world,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        context_parallel=cp,
        sequence_parallel=sp,
        framework="batchfit",
    )
    max_seq_len = as_int(flat.get("sequence_length"))
    prompt_len, response = as_int(flat.get("prompt_length")), as_int(flat.get("response_length"))
    if not is_positive_int(max_seq_len) and is_positive_int(prompt_len) and is_positive_int(response):
        max_seq_len = prompt_len + response  # PPOConfig.__post_init__
    workers = {"actor_train": actor, **({"reference": _worker(flat, "reference")} if reference else {})}
    if critic:
        workers["critic"] = _worker(flat, "critic")
    mcore = _megatron(flat, actor, workers) if megatron else None
    if mcore is not None:
        warnings += mcore["warnings"]
        faults += mcore["faults"]
        notes.append(
            f"{TITLE}'s {name} computes log-probs from the tensor-parallel logits (vocab_parallel_logprobs); profiled "
            "with Megatron's vocab-parallel head"
        )
    else:
        notes.append(
            f"{TITLE} computes log-probs from the whole logits; profiled with batchfit's full head (fp32 log_softmax)"
        )
    run = FrameworkRun(
        vocabulary="roll",
        batch=batch,
        model=flat.get("actor_train.model_args.model_name_or_path") or flat.get("pretrain") or None,
        critic_model=(flat.get("critic.model_args.model_name_or_path") or flat.get("pretrain")) if critic else None,
        reference=reference,
        max_seq_len=max_seq_len if is_positive_int(max_seq_len) else None,
        max_response_len=response if is_positive_int(response) else None,
        strategy=strategy,
        gradient_checkpointing=mcore["recompute"] if mcore is not None else actor["checkpointing"],
        # worker_config.py: model_args.dtype bf16 sets training_args.bf16, Megatron's params_dtype (megatron_strategy.py)
        dtype=dtype_name(flat.get("actor_train.model_args.dtype")) if mcore is not None else None,
        **megatron_layout_fields(mcore),
        remove_padding=True,  # the cap bounds padded tokens; a packed budget of as many tokens bounds it (emit)
        critic_remove_padding=True if critic else None,
        engine=_engine(flat),
        generation_resident={},  # rlvr_pipeline.py offloads actor_train before the engines generate
        # base_worker.py compute_log_probs loads the model parameters only (state_offload_manger(load_kwargs={"include":
        # [model_params]}), which offloads the other states: utils/context_managers.py): the log-prob passes run
        # without the optimizer state
        optimizer_offload=True,
        faults=tuple(faults),
        warnings=tuple(warnings),
        notes=tuple(notes),
        key_names=_key_names(by_prompt),
        source={
            "max_seq_len": "sequence_length (or prompt_length + response_length)",
            "world_size": "actor_train.device_mapping",
            "model": "pretrain",
            "strategy": "actor_train.strategy_args.strategy_name",
            **(refused_sources(mcore["refused"]) if mcore is not None else {}),
        },
        rules=rules,
        values={"workers": workers, "dp": dp, "n": n, "prompts": prompts, "strategy_name": name},
        configured=_configured(workers),
    )
    if misspelt:
        every_fault(run, misspelt)
    return run


def rules(run: FrameworkRun) -> Verdict:
    """ROLL's batch rules on ``run``."""
    v, cfg = run.values, run.batch
    actor = v["workers"]["actor_train"]
    samples = int_product(cfg.train_batch_size, cfg.n_samples_per_prompt)
    counts = {
        "rollout_batch_size × num_return_sequences_in_group": samples,
        "actor_train.training_args.per_device_train_batch_size": cfg.micro_train_batch_size_per_gpu,
        "actor_train.training_args.gradient_accumulation_steps": actor["ga"],
        "actor_train.infer_batch_size": cfg.micro_forward_batch_size_per_gpu,
        "ppo_epochs": cfg.update_epochs_per_batch,
        "actor_train.device_mapping GPUs": run.world_size,
    }
    faults = list(positive_int_faults(counts))
    if faults:
        return Verdict(faults=tuple(faults))
    warnings: list[str] = []
    notes: list[str] = []
    dp = run.world_size // (cfg.tensor_parallel * cfg.pipeline_parallel * cfg.context_parallel * cfg.sequence_parallel)
    if samples % dp:
        # DataProto.chunk over the dp ranks (cluster dispatch) and config_utils.validate_megatron_batch_size
        faults.append(
            f"rollout_batch_size × num_return_sequences_in_group = {samples} sequences do not split over the {dp} "
            f"data-parallel ranks of actor_train ({TITLE} chunks the batch by dp rank); use a multiple of {dp}"
        )
    longest = run.max_seq_len
    for role, w in v["workers"].items():
        for phase in ("train", "infer"):
            if not w[f"dynamic_{phase}"]:
                continue
            cap, rounding = w[f"{phase}_cap"], w[f"{phase}_round"]
            key = f"{role}.max_tokens_per_microbatch_in_{phase}"
            if not is_positive_int(cap):
                faults.append(f"{role}.use_dynamic_batching_in_{phase}=true needs {key} set to a positive token count")
                continue
            if is_positive_int(longest) and is_positive_int(rounding) and -(-longest // rounding) * rounding > cap:
                # dynamic_batching_shard: assert max_seqlen_this_shard_indice <= max_tokens_per_microbatch
                faults.append(
                    f"{key}={cap} is below the longest sequence, {longest} tokens rounded up to "
                    f"sequence_length_round_in_{phase}={rounding}: ROLL's dynamic_batching_shard asserts one fits; "
                    f"set it to {-(-longest // rounding) * rounding} or more"
                )
    if actor["dynamic_train"]:
        notes.append(
            "with use_dynamic_batching_in_train an optimizer step is gradient_accumulation_steps capped micro-batches "
            "(base_worker.py make_mini_batch_iter_for_dynamic_batching), so the number of steps varies with the lengths"
        )
    return Verdict(tuple(faults), tuple(warnings), tuple(notes))


def _configured(workers: dict[str, dict[str, Any]]) -> tuple[YourSize, ...]:
    """What each worker's keys bound its passes by: the token cap when its dynamic batching is on, else sequences."""
    out = []
    rows = {"actor_train": (("policy", "train"), ("policy_forward", "infer")), "reference": (("reference", "infer"),),
            "critic": (("critic", "train"), ("critic_forward", "infer"))}  # fmt: skip
    for role, w in workers.items():
        for pass_, phase in rows[role]:
            if w[f"dynamic_{phase}"] and is_positive_int(w[f"{phase}_cap"]):
                out.append(YourSize(pass_, f"{role}.max_tokens_per_microbatch_in_{phase}", w[f"{phase}_cap"], "tokens", per_gpu=False))
            else:
                key, value = (
                    (f"{role}.training_args.per_device_train_batch_size", w["micro"])
                    if phase == "train"
                    else (f"{role}.infer_batch_size", w["infer"])
                )
                if is_positive_int(value):
                    out.append(YourSize(pass_, key, value, "sequences"))
    return tuple(out)


def _key_names(by_prompt: bool) -> dict[str, str]:
    mini = "actor_train per_device_train_batch_size × gradient_accumulation_steps × dp"
    return {
        "train_batch_size": "rollout_batch_size" if by_prompt else "rollout_batch_size × num_return_sequences_in_group",
        "n_samples_per_prompt": "num_return_sequences_in_group",
        "policy_mini_batch_size": f"{mini} / num_return_sequences_in_group" if by_prompt else mini,
        "micro_train_batch_size_per_gpu": "actor_train.training_args.per_device_train_batch_size",
        "micro_forward_batch_size_per_gpu": "actor_train.infer_batch_size",
        "max_tokens_per_micro_batch": "actor_train.max_tokens_per_microbatch_in_train",
        "update_epochs_per_batch": "ppo_epochs",
        "world_size": "actor_train.device_mapping",
        "tensor_parallel": "actor_train.strategy_args.strategy_config.tensor_model_parallel_size",
        "pipeline_parallel": "actor_train.strategy_args.strategy_config.pipeline_model_parallel_size",
        "context_parallel": "actor_train.strategy_args.strategy_config.context_parallel_size",
        "sequence_parallel": "actor_train.model_args.ulysses_size",
    }


_REFUSAL_WHY = {
    "lora": (
        "trains LoRA adapters on Megatron (mcore_adapter's LoRA layers), which batchfit's Megatron profile does not model",
        "drop it, or train LoRA with actor_train.strategy_args.strategy_name=fsdp2_train",
    ),
    "critic": (
        "trains a critic (rlvr_pipeline.py: gae) beside the Megatron actor, which batchfit's Megatron profile does not "
        "model",
        "use a critic-free estimator (adv_estimator: reinforce or grpo), or train with fsdp2_train",
    ),
}


def strategy_refusal(run: Any) -> str | None:
    """Why ``profile`` cannot model a ROLL Megatron run (LoRA, a critic: NOTE [ What a Megatron profile refuses ]),
    naming the key, its value and the fix; ``None`` when it can, and for fsdp2_train."""
    return first_refusal(run, _REFUSAL_WHY)


SPEC = FrameworkSpec(
    name="roll",
    title=TITLE,
    display="ROLL",
    markers=("actor_train", "actor_infer", "rollout_batch_size", "num_return_sequences_in_group"),
    read_config=read,
    strategy_refusal=strategy_refusal,
    head="full",
    emit="batchfit.frameworks.roll_emit",
)
"""ROLL in :mod:`batchfit.frameworks.registry`: its rules apply at ``FrameworkRun.plan``; the whole logits' log-probs."""
