"""prime-rl's ``rl`` config (a TOML file: top-level ``seq_len``, ``[deployment]``, ``[trainer.model]``, ``[orchestrator]``) in batchfit's terms.

Mirrors PrimeIntellect-ai/prime-rl at commit 559b4477 (2026-08-21): the pydantic configs of
``packages/prime-rl-configs/src/prime_rl/configs/`` (``rl.py`` ``RLConfig``: the shared ``seq_len`` and
``model``, the deployment's GPUs, ``auto_setup_deployment``; ``trainer.py`` ``ModelConfig``;
``orchestrator.py`` ``OrchestratorConfig.resolve_batching``), ``utils/validation.py``
``validate_shared_seq_len`` and the packer (``src/prime_rl/trainer/batch.py`` ``prepare_batch``,
``src/prime_rl/orchestrator/packing.py``). The defaults batchfit merges a file over
(``defaults/prime_rl.yaml``) are those classes' field defaults for the keys it reads.

NOTE [ prime-rl's micro-batch is one packed row ]
The orchestrator packs each step's samples (each truncated to ``orchestrator.seq_len``) into micro-batches
of shape ``[1, seq_len]`` (``prepare_batch``: "the number of samples is not fixed per micro batch"), one
list per trainer data-parallel rank (``num_train_workers`` = train GPUs // ``trainer.model.cp``), each padded
to a multiple of ``cp``. So ``seq_len`` is both the longest sample and the token budget of a micro-batch, a
hard cap (longer samples are truncated); under context parallelism a micro-batch of ``seq_len`` tokens is
split over the ``cp`` GPUs of its group. The trainer runs only the update: the old log-probs come from the
inference server (``inference_logprobs``), and there is no reference model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchfit.frameworks.registry import FrameworkSpec
from batchfit.frameworks.run import (
    RunConfig,
    as_bool,
    as_int,
    every_fault,
    is_positive_int,
    size_faults,
    unmodelled_warnings,
)
from batchfit.frameworks.source import flatten, framework_defaults, framework_schema
from batchfit.frameworks.your_sizes import pass_sizes
from batchfit.plan.config import BatchConfig
from batchfit.validation import short_repr

__all__ = ["SPEC", "read", "read_toml"]

COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
TM = "trainer.model."
OR = "orchestrator."
DEP = "deployment."

UNMODELLED: dict[str, str] = {
    TM + "dp_replicate": "hybrid sharding: weights replicated over dp_replicate groups, sharded within each",
    TM + "lora.*": "LoRA adapters (batchfit reads no prime-rl LoRA keys yet: the budgets are for full fine-tuning, an "
    "upper bound)",
    TM + "ac.mode": "selective activation checkpointing (batchfit checkpoints every layer's input)",
    TM + "ac.freq": "checkpointing every freq-th layer only (batchfit checkpoints every layer)",
    TM + "reduce_dtype": "bf16 gradient reductions (batchfit reduces in fp32, as prime-rl's default)",
    TM + "full_offload": "the optimizer in backward on the CPU (fp32 masters, moments and gradients in host RAM)",
    TM + "quantization.*": "fp8 / mxfp8 training",
    TM + "impl": "the model implementation (batchfit builds transformers' model, prime-rl's custom one where it has it)",
}


def read_toml(path: str | Path) -> dict[str, Any]:
    """The mapping in a prime-rl TOML file (the standard library's ``tomllib``, Python 3.11+).

    Raises:
        BatchConfigError: the file cannot be read, is not UTF-8 or does not parse (with tomllib's message).
    """
    import tomllib

    from batchfit.errors import BatchConfigError, InvalidArgument
    from batchfit.fileio import read_text

    what = f"config file {str(path)!r}"
    try:
        text = read_text(Path(path), what)
    except InvalidArgument as exc:
        raise BatchConfigError([str(exc)]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BatchConfigError([f"{what} is not TOML: {exc}; pass a prime-rl rl.toml"]) from None


def read(data: dict[str, Any], given: dict[str, Any]) -> RunConfig:
    """A resolved prime-rl ``rl`` config (its field defaults merged under it) as a :class:`RunConfig`.

    Raises:
        BatchConfigError: a key that is a close misspelling of one of prime-rl's, with every other fault.
    """
    flat = flatten(data)
    given = {key: flat.get(key, value) for key, value in given.items()}
    schema = framework_schema("prime_rl")
    misspelt, warnings = schema.check_keys(given, ignore=BatchConfig.fields())
    faults: list[str] = []
    notes: list[str] = []

    # rl.py RLConfig.seq_len: propagates to trainer.model.seq_len and orchestrator.seq_len where not set explicitly
    shared = as_int(flat.get("seq_len"))
    trainer_len = as_int(given.get(TM + "seq_len", shared if shared is not None else flat.get(TM + "seq_len")))
    packed_len = as_int(given.get(OR + "seq_len", shared if shared is not None else flat.get(OR + "seq_len")))
    faults += size_faults(
        {"seq_len": shared, TM + "seq_len": trainer_len, OR + "seq_len": packed_len},
        ("seq_len",),
        schema.title,
        "lengths",
    )
    if is_positive_int(trainer_len) and is_positive_int(packed_len) and trainer_len < packed_len:
        faults.append(  # utils/validation.py validate_shared_seq_len
            f"{TM}seq_len={trainer_len} is below {OR}seq_len={packed_len}: prime-rl refuses it "
            "(validate_shared_seq_len: the trainer must handle the orchestrator's packed rows); set the shared seq_len"
        )
    cp = as_int(flat.get(TM + "cp", 1))
    style = flat.get(TM + "cp_style", "ring")
    world, world_faults = _train_gpus(flat)
    faults += world_faults
    faults += size_faults({TM + "cp": cp}, ("cp",), schema.title, "parallel sizes")
    if is_positive_int(cp) and is_positive_int(world) and world % cp:
        faults.append(
            f"{TM}cp={cp} does not divide the trainer's {world} GPUs: prime-rl runs world // cp data-parallel ranks "
            f"(rl.py auto_setup_deployment); use a cp that divides {world}"
        )

    batch_size, token_batch = as_int(flat.get(OR + "batch_size")), as_int(flat.get(OR + "token_batch_size"))
    group = as_int(flat.get(OR + "group_size", 1))
    if batch_size is not None and token_batch is not None:  # orchestrator.py resolve_batching
        faults.append(
            f"{OR}batch_size={batch_size} and {OR}token_batch_size={token_batch} are both set: prime-rl refuses it "
            "('Set exactly one of batch_size or token_batch_size', OrchestratorConfig.resolve_batching); drop one"
        )
    if batch_size is None and token_batch is None:
        batch_size = 128  # resolve_batching's default
    if is_positive_int(batch_size) and is_positive_int(group) and batch_size % group:
        faults.append(
            f"{OR}batch_size={batch_size} is not a multiple of {OR}group_size={group}: prime-rl refuses it ('Batch "
            "size must be divisible by the number of samples per problem', resolve_batching); use a multiple of "
            f"{group}"
        )
    prompts = batch_size // group if is_positive_int(batch_size) and is_positive_int(group) else None
    if token_batch is not None:
        notes.append(
            f"{OR}token_batch_size={token_batch}: a step trains on that many tokens, however many samples they are, "
            "so batchfit's plan has no sample count (the budgets do not depend on it)"
        )
    ulysses = style == "ulysses"
    values: dict[str, Any] = {
        "train_batch_size": prompts,
        "policy_mini_batch_size": prompts,  # one optimizer step per training step (rl/train.py)
        "n_samples_per_prompt": group,
        "micro_train_batch_size_per_gpu": 1,
        "micro_forward_batch_size_per_gpu": 1,
        "max_tokens_per_micro_batch": packed_len,  # NOTE [ prime-rl's micro-batch is one packed row ]
        "world_size": world,
        "sequence_parallel": cp if ulysses else 1,
        "context_parallel": 1 if ulysses else cp,
        "framework": "batchfit",
    }
    ac = flat.get(TM + "ac")
    ac_on = ac is not False and not (isinstance(ac, str) and ac.lower() in ("none", "null", "false"))
    offload_acts = flat.get(TM + "ac_offloading")
    if offload_acts is not False and ac_on:
        notes.append(
            "prime-rl offloads the checkpointed activations to the host by default (trainer.model.ac_offloading, "
            "max_inflight_activations at a time); the budgets keep them on the GPU: an upper bound"
        )
    if as_bool(flat.get(TM + "optim_cpu_offload")) is not False:
        notes.append(
            "prime-rl keeps the optimizer state on the host by default (trainer.model.optim_cpu_offload); the budgets "
            "keep it on the GPU: an upper bound"
        )
    ep, ep_faults, ep_notes = _expert_parallel(flat, world)  # NOTE [ prime-rl's expert parallelism ]
    faults += ep_faults
    notes += ep_notes
    head = flat.get(TM + "fused_lm_head_token_chunk_size", 8192)
    fused = head != "disabled"
    if fused:
        notes.append(
            f"prime-rl's fused LM head computes log-probs from the hidden states in chunks of {head} tokens "
            f"({TM}fused_lm_head_token_chunk_size)"
        )
    warnings += unmodelled_warnings(given, framework_defaults("prime_rl"), UNMODELLED, schema.title)
    optimization = flat.get(TM + "optimization_dtype", "float32")
    run = RunConfig(
        vocabulary="prime_rl",
        batch=BatchConfig(**values),
        model=flat.get("model.name") or flat.get(TM + "name"),
        max_seq_len=packed_len if is_positive_int(packed_len) else None,
        strategy="fsdp2",
        offload="cpu" if as_bool(flat.get(TM + "fsdp_cpu_offload")) is True else "none",
        reshard_after_forward=as_bool(flat.get(TM + "reshard_after_forward", True)) is not False,
        mixed_precision="bf16",  # bf16 compute, reduce_dtype float32 by default
        dtype="bf16" if optimization == "bfloat16" else "fp32",
        gradient_checkpointing=ac_on,
        remove_padding=True,  # packed rows (prepare_batch)
        fused_kernels=fused,
        # src/prime_rl/utils/process.py DEFAULT_TRAINER_ENV_VARS: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
        allocator="expandable_segments",
        expert_parallel=ep,
        faults=tuple(faults),
        warnings=tuple(warnings),
        notes=tuple(notes),
        key_names={
            "train_batch_size": f"{OR}batch_size / {OR}group_size",
            "policy_mini_batch_size": f"{OR}batch_size / {OR}group_size",
            "n_samples_per_prompt": OR + "group_size",
            "max_tokens_per_micro_batch": "seq_len (orchestrator.seq_len)",
            "world_size": "the trainer's GPUs (deployment.num_train_gpus, or num_train_nodes × gpus_per_node)",
            "context_parallel": TM + "cp",
            "sequence_parallel": TM + "cp (cp_style ulysses)",
            "expert_parallel": TM + "ep",
        },
        configured=pass_sizes(("seq_len", packed_len, "tokens"), ("seq_len", None, "tokens"), reference=False, critic=False, per_gpu=False),
        source={
            "max_seq_len": "seq_len (orchestrator.seq_len: longer samples are truncated)",
            "world_size": "deployment.num_train_gpus (single_node) or num_train_nodes × gpus_per_node",
            "model": "model.name (or trainer.model.name)",
            "deployment": str(flat.get(DEP + "type", "single_node")),
        },
    )
    if misspelt:
        every_fault(run, misspelt)
    return run


# NOTE [ prime-rl's expert parallelism ]
# prime-rl trains MoE models with PyTorch-native expert parallelism under FSDP2, torchtitan's pattern
# (src/prime_rl/trainer/distributed/expert_parallel.py, model.py's experts on parallel_dims.get_mesh("ep")), which is
# batchfit's Sharding(expert_parallel=N) (NOTE [ Expert parallelism the torchtitan way ] in
# batchfit.parallel.expert_parallel). trainer.model.ep (configs/trainer.py ModelConfig, default "auto") resolves in
# src/prime_rl/trainer/parallel_dims.py resolve_ep: an integer is kept; "auto" is 1 when impl is neither "custom"
# nor "auto", 1 for a model that is not MoE (_is_moe_model: its HF config has num_experts or n_routed_experts), else
# min(world_size // dp_replicate, 8). ParallelDims._validate asserts ep % cp == 0 and (dp_shard * cp) % ep == 0 (EP
# borrows the cp ranks and some of dp_shard); ep != 1 with impl "hf" is refused (ep_only_with_custom_impl).


def _expert_parallel(flat: dict[str, Any], world: Any) -> tuple[int, list[str], list[str]]:
    """``trainer.model.ep`` resolved as prime-rl resolves it (NOTE [ prime-rl's expert parallelism ]): (size, faults, notes)."""
    ep, impl = flat.get(TM + "ep", "auto"), flat.get(TM + "impl", "auto")
    if ep != "auto":
        size = as_int(ep)
        if not is_positive_int(size):
            return 1, [f"{TM}ep={short_repr(ep)} must be a positive integer or \"auto\" (ModelConfig.ep)"], []
        if size > 1 and impl not in ("custom", "auto"):
            return 1, [
                f"{TM}ep={size} with {TM}impl={short_repr(impl)}: prime-rl refuses it ('EP is only supported with the "
                "custom implementation or auto mode', ep_only_with_custom_impl); set impl to custom or auto, or ep = 1"
            ], []
        if size > 1 and is_positive_int(world) and world % size:
            return 1, [
                f"{TM}ep={size} does not divide the trainer's {world} GPUs: prime-rl asserts (dp_shard * cp) % ep == 0 "
                "(ParallelDims._validate); use a divisor of the GPUs"
            ], []
        return size, [], []
    if impl not in ("custom", "auto"):
        return 1, [], [f"{TM}ep = \"auto\" with impl={short_repr(impl)}: prime-rl resolves it to 1 (resolve_ep)"]
    model = flat.get("model.name") or flat.get(TM + "name")
    moe = _has_routed_experts(model)
    if moe is None:
        return 1, [], [
            f"{TM}ep = \"auto\": the model's config ({short_repr(model)}) could not be read to tell a MoE from a dense "
            "model, so the budgets are for ep = 1; set ep in the config to profile expert parallelism"
        ]
    replicate = as_int(flat.get(TM + "dp_replicate", 1))
    if not moe:
        return 1, [], [f"{TM}ep = \"auto\": prime-rl resolves it to 1 for {short_repr(model)}, not a MoE (resolve_ep)"]
    if not is_positive_int(world) or not is_positive_int(replicate):
        return 1, [], []  # the GPU counts' own faults are reported
    size = min(world // replicate, 8)
    return size, [], [
        f"{TM}ep = \"auto\": prime-rl resolves it to min({world} GPUs // dp_replicate {replicate}, 8) = {size} for this "
        "MoE (resolve_ep); the budgets are for expert parallelism over that many GPUs"
    ]


def _has_routed_experts(model: Any) -> bool | None:
    """prime-rl's ``_is_moe_model``: the HF config has ``num_experts`` or ``n_routed_experts``; ``None`` if unreadable."""
    if not isinstance(model, str) or not model:
        return None
    from batchfit.errors import BatchfitError
    from batchfit.models import load_config

    try:
        config = load_config(model)
    except (BatchfitError, OSError):
        return None
    return hasattr(config, "num_experts") or hasattr(config, "n_routed_experts")


def _train_gpus(flat: dict[str, Any]) -> tuple[Any, list[str]]:
    """The trainer's GPUs: ``deployment.num_train_gpus`` on one node, ``num_train_nodes × gpus_per_node`` on several (rl.py)."""
    kind = flat.get(DEP + "type", "single_node")
    per_node = as_int(flat.get(DEP + "gpus_per_node", 8))
    if kind == "multi_node":
        nodes = as_int(flat.get(DEP + "num_train_nodes"))
        if not is_positive_int(nodes) or not is_positive_int(per_node):
            return None, [
                f"{DEP}num_train_nodes={short_repr(nodes)} (with {DEP}gpus_per_node={short_repr(per_node)}): a multi_node "
                "deployment needs both as positive integers (MultiNodeDeploymentConfig)"
            ]
        return nodes * per_node, []
    train, infer = as_int(flat.get(DEP + "num_train_gpus", 1)), as_int(flat.get(DEP + "num_infer_gpus", 1))
    if not all(is_positive_int(x) for x in (train, infer, per_node)):
        return None, [
            f"{DEP}num_train_gpus={short_repr(train)}, num_infer_gpus={short_repr(infer)}, gpus_per_node="
            f"{short_repr(per_node)} must be positive integers (SingleNodeDeploymentConfig)"
        ]
    if train + infer > per_node:  # SingleNodeDeploymentConfig.validate_gpu_count
        return train, [
            f"{DEP}num_train_gpus={train} + num_infer_gpus={infer} exceed {DEP}gpus_per_node={per_node}: prime-rl refuses "
            "it (SingleNodeDeploymentConfig.validate_gpu_count); lower one of them"
        ]
    return train, []


SPEC = FrameworkSpec(
    name="prime_rl",
    title="prime-rl 559b4477",
    display="prime-rl",
    markers=("orchestrator", "deployment", "trainer.model.seq_len", "trainer.model.cp", "trainer.optim"),
    read_config=read,
    head="full",
    reference_dtype="bf16",
    gpu_keys={"world_size": "deployment.num_train_gpus"},
    emit="batchfit.frameworks.prime_rl_emit",
)
"""prime-rl in :mod:`batchfit.frameworks.registry`: FSDP2, one packed row of ``seq_len`` tokens per micro-batch."""
