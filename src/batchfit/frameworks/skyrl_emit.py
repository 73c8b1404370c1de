"""SkyRL 0.4.0's keys for ``--emit skyrl``: its one token key and micro sizes, and every setting the budgets assume.

:func:`token_keys` writes ``trainer.max_tokens_per_microbatch`` (the smallest budget: one key
for every pass) and the sample-based micro sizes SkyRL still validates (:func:`skyrl_plan`);
:func:`assumption_keys` the key of every setting the budgets were profiled with, or refuses what
SkyRL cannot express (NOTE [ Emitted keys carry every assumption ] in
:mod:`batchfit.frameworks.assumptions`). :data:`batchfit.frameworks.skyrl.SPEC` names this module
(``FrameworkSpec.emit``); :mod:`batchfit.frameworks.emit` calls it through the registry.
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    check_head,
    check_strategy,
    lora_adapter_keys,
    nodes_and_gpus,
    refuse,
)
from batchfit.frameworks.emit import REMOVE_PADDING
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile
from batchfit.frameworks.skyrl import ENTROPY_CHUNK_DEFAULTS, ENTROPY_CHUNK_KEY, ENTROPY_MEMORY_KEY, SPEC
from batchfit.train.framework_heads import FrameworkHead
from batchfit.train.megatron_heads import MegatronHeads

__all__ = ["assumption_keys", "skyrl_plan", "token_keys"]


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """SkyRL has one token key for every pass, and micro sizes validate_batch_sizes checks (over the profiled GPUs)."""
    trained = min(budgets[r] for r in ("policy", "critic") if r in budgets)
    forward = min(budgets[r] for r in ("policy_forward", "critic_forward", "reference") if r in budgets)
    binding = min(budgets, key=budgets.get)
    sharding = profile.options["policy"].sharding
    sp = sharding.sequence_parallel
    if sharding.context_parallel > 1:  # Megatron's: the same count before the split (megatron_worker._forward_logprobs)
        sp, sp_name = sharding.context_parallel, "context_parallel_size"
    else:
        sp_name = "sequence_parallel_size"
    # SkyRL counts a micro-batch's valid tokens before the sequence-parallel split (worker_utils.py
    # TokenBasedBatchIterator: attention_mask.sum over the micro-batch; the model wrapper then slices
    # it over sequence_parallel_size): the group's budget as it is, not per GPU
    split = f"; SkyRL counts the micro-batch before splitting it over {sp_name}={sp}" if sp > 1 else ""
    # NOTE [ SkyRL's soft cap ]: TokenBasedBatchIterator packs with the "balanced" packer, whose capacity is
    # soft (skyrl/train/dataset/bin_packing.py, Balanced, a9564572, 2026-08-21; SkyRL #1477): a sequence longer
    # than the cap gets a micro-batch of its own, over it, instead of an error. A budget always holds one
    # sequence of max_seq_len, so only a sequence longer than that would run over it.
    soft = (
        f"; SkyRL treats it as a soft cap (its balanced packer gives a longer sequence a micro-batch of its own, over "
        f"the cap): it holds for sequences up to max_seq_len={max_seq_len:,}, which one micro-batch always fits"
    )
    keys = [
        Key(
            "trainer.max_tokens_per_microbatch",
            min(trained, forward),
            why(binding, f"every pass (SkyRL uses one key): the smallest budget, set by {binding}") + split + soft,
        ),
        Key("trainer.remove_microbatch_padding", True, REMOVE_PADDING.format(framework="SkyRL")),
    ]
    plan = skyrl_plan(_profiled_layout(profile), world)
    if plan.samples_per_mini_batch_per_gpu is not None:
        # the micro sizes SkyRL validates even with the token key: divisors of the per-GPU mini-batch
        per_gpu = min(r.samples_per_mini_batch_per_gpu for r in plan.roles)
        micro = _largest_divisor_at_most(per_gpu, max(trained // max_seq_len, 1))
        keys.append(
            Key(
                "trainer.micro_train_batch_size_per_gpu",
                micro,
                f"sample-based fallback: {micro} sequences of {max_seq_len:,} tokens fit, and {micro} divides {per_gpu}",
            )
        )
    keys.append(
        Key(
            "trainer.micro_forward_batch_size_per_gpu",
            max(forward // max_seq_len, 1),
            f"sample-based fallback: forward passes of {max_seq_len:,}-token sequences",
        )
    )
    return keys


def _profiled_layout(profile: RunProfile) -> Any:
    """The profiled run with the batch laid out as the profile's sharding lays it out (Megatron's tp × pp, else none).

    validate_batch_sizes divides the GPUs by the Megatron sizes the emitted keys set (dp = world / (pp · cp · tp)), so
    the micro sizes are derived from that dp, whatever layout the config had.
    """
    run, sharding = profile.run, profile.options["policy"].sharding
    if not sharding.spec.model_parallel:
        return run
    batch = run.batch
    model = sharding.tensor_parallel * sharding.pipeline_parallel
    return run.replace(
        batch=batch.replace(
            tensor_parallel=sharding.tensor_parallel,
            pipeline_parallel=sharding.pipeline_parallel,
            context_parallel=1,
            sequence_parallel=1,
            reference_model_parallel=None if batch.reference_model_parallel is None else model,
        )
    )


def skyrl_plan(run: Any, world: int) -> Any:
    """The batch plan SkyRL's micro sizes are derived from: ``run``'s sizes over ``world`` GPUs, sample micro-batches.

    Raises:
        BatchConfigError: the plan's faults in the config's own key names.
    """
    from batchfit.errors import BatchConfigError

    batch = run.batch
    nodes = batch.num_nodes if isinstance(batch.num_nodes, int) and batch.num_nodes > 0 else 1
    if world != run.world_size and world % nodes == 0:
        batch = batch.replace(world_size=None, num_nodes=nodes, gpus_per_node=world // nodes)
    try:
        return batch.replace(max_tokens_per_micro_batch=None, micro_train_batch_size_per_gpu=1).plan()
    except BatchConfigError as exc:
        raise BatchConfigError([run.in_own_words(f) for f in exc.faults]) from None


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


_S_PLACEMENT = "trainer.placement."
_S_FSDP = {"policy": "trainer.policy.fsdp_config.", "critic": "trainer.critic.fsdp_config.", "reference": "trainer.ref.fsdp_config."}
_S_STRATEGY = "skyrl/backends/skyrl_train/distributed/fsdp_strategy.py _fsdp_init_model"


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "skyrl"
    s = a.sharding
    check_strategy(
        target,
        a,
        (*_S_MEGATRON, "fsdp2"),
        "SkyRL trains with fully_shard (FSDP2: trainer.strategy fsdp, fsdp_strategy.py apply_fsdp2) or Megatron "
        "(trainer.strategy megatron)",
    )
    if s.spec.model_parallel:
        return _megatron_keys(run, a, same)
    if a.trained_dtype != "fp32":
        raise refuse(
            target,
            f"--dtype {a.trained_dtype}",
            "SkyRL loads the policy and the critic it trains in fp32 (skyrl/backends/skyrl_train/workers/fsdp/"
            "fsdp_worker.py: HFModelWrapper(bf16=policy.inference_only_init), critic bf16=False)",
            "pass --dtype fp32",
        )
    nodes, per_node = nodes_and_gpus(run, a, target)
    keys = [
        Key(_S_PLACEMENT + "policy_num_nodes", nodes, f"the {s.world_size} GPUs profiled, for every model"),
        Key(_S_PLACEMENT + "policy_num_gpus_per_node", per_node),
    ]
    for role, name in (("critic", "critic"), ("reference", "ref")):
        if role in a.roles:
            keys += [
                Key(_S_PLACEMENT + f"{name}_num_nodes", nodes),
                Key(_S_PLACEMENT + f"{name}_num_gpus_per_node", per_node),
            ]
    keys.append(Key("trainer.strategy", "fsdp", "fully_shard (FSDP2) over the GPUs, as profiled"))
    sp = s.sequence_parallel
    if sp > 1 or (run.batch.sequence_parallel or 1) > 1:
        for role, name in (("policy", "policy"), ("critic", "critic"), ("reference", "ref")):
            if role in a.roles:
                keys.append(
                    Key(f"trainer.{name}.sequence_parallel_size", sp, "Ulysses split of each micro-batch, as profiled" if role == "policy" else "")
                )
    bf16 = s.mixed_precision == "bf16"
    for role in a.roles:
        prefix = _S_FSDP[role]
        policy = role == "policy"
        keys.append(
            Key(
                prefix + "cpu_offload",
                s.offload == "cpu",
                f"FSDP2's CPUOffloadPolicy ({_S_STRATEGY})" if policy else "",
            )
        )
        keys.append(Key(prefix + "reshard_after_forward", s.reshard_after_forward))
        if role != "reference":
            param, reduce = ("bf16", "fp32") if bf16 else ("fp32", "fp32")
            keys += [
                Key(
                    prefix + "mixed_precision.param_dtype",
                    param,
                    f"MixedPrecisionPolicy(param_dtype, reduce_dtype) ({_S_STRATEGY})" if policy else "",
                ),
                Key(prefix + "mixed_precision.reduce_dtype", reduce),
            ]
    if "reference" in a.roles:
        ref = a.dtypes["reference"]
        if ref not in ("bf16", "fp32"):
            raise refuse(target, f"--dtype {ref}", "SkyRL loads its reference in bf16 or fp32 (trainer.bf16)", "pass --dtype fp32")
        keys.append(
            Key("trainer.bf16", ref == "bf16", f"the reference loads in {ref} (fsdp_worker.py: HFModelWrapper(bf16=trainer.bf16))")
        )
    keys.append(
        Key(
            "trainer.gradient_checkpointing",
            a.gradient_checkpointing,
            f"every model {'with' if a.gradient_checkpointing else 'without'} activation checkpointing (fsdp_worker.py)",
        )
    )
    for role, (rank, alpha, targets) in SPEC.lora_keys.items():
        if role in a.roles:
            keys += lora_adapter_keys(a.lora.get(role), rank, alpha, targets)
    keys += _skyrl_head(run, a, same)
    return keys


#: batchfit's Megatron strategy → SkyRL's ``trainer.strategy`` (MegatronWorker).
_S_MEGATRON = {"megatron": "megatron"}
_S_MCORE = {"policy": "trainer.policy.megatron_config.", "reference": "trainer.ref.megatron_config."}
_S_WORKER = "skyrl/backends/skyrl_train/workers/megatron/megatron_worker.py"


def _megatron_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """The keys of a Megatron profile: SkyRL's megatron_config for the policy and the reference (NOTE [ SkyRL's Megatron
    worker ] in :mod:`batchfit.frameworks.skyrl`).

    No FSDP key (``fsdp_config.*``, ``sequence_parallel_size``: validate_megatron_cfg asserts it is 1). Refused: a
    critic (SkyRL trains none under Megatron), Megatron's sequence parallelism other than SkyRL's (on exactly when
    tensor parallelism is: ``provider.sequence_parallel = tensor_model_parallel_size > 1``), no distributed optimizer
    (SkyRL's DDP wrapper always lays its buffers out for one), LoRA (not modelled), activation offload.
    """
    target = "skyrl"
    s = a.sharding
    if "critic" in a.roles:
        raise refuse(
            target,
            "a critic under --sharding megatron",
            "SkyRL trains no critic with Megatron (validate_megatron_cfg: 'only GRPO training is currently supported for "
            "megatron')",
            "profile a critic-free run, or the run with --sharding fsdp2",
        )
    if s.megatron_sequence_parallel != (s.tensor_parallel > 1):
        raise refuse(
            target,
            f"--sharding megatron {'with' if s.megatron_sequence_parallel else 'without'} --megatron-sequence-parallel at "
            f"--tensor-parallel {s.tensor_parallel}",
            f"SkyRL turns Megatron's sequence parallelism on exactly when tensor_model_parallel_size > 1 ({_S_WORKER}: "
            "provider.sequence_parallel), with no key",
            "pass --megatron-sequence-parallel (SkyRL runs it whenever --tensor-parallel is above 1)",
        )
    if not s.distributed_optimizer:
        raise refuse(
            target,
            "--sharding megatron without the distributed optimizer",
            f"SkyRL's Megatron DDP wrapper always lays its buffers out for the distributed optimizer ({_S_WORKER}: "
            "default_ddp_config.use_distributed_optimizer = True) and its optimizer config turns it on "
            "(distributed/megatron/optimizer.py)",
            "pass --distributed-optimizer",
        )
    if a.lora.get("policy") is not None:
        raise refuse(
            target,
            "LoRA with --sharding megatron",
            "batchfit does not model SkyRL's Megatron LoRA (megatron_config.lora_config)",
            "profile without LoRA, or with --sharding fsdp2",
        )
    if a.trained_dtype not in ("bf16", "fp32"):
        raise refuse(target, f"--dtype {a.trained_dtype}", "SkyRL's Megatron worker keeps bf16 or fp32 parameters (trainer.bf16)", "pass --dtype bf16")
    ref = a.dtypes.get("reference", a.trained_dtype)
    if ref != a.trained_dtype:
        raise refuse(
            target,
            f"a {ref} reference beside a {a.trained_dtype} policy under --sharding megatron",
            "SkyRL's Megatron workers load every model in one dtype (trainer.bf16)",
            f"pass --dtype {a.trained_dtype}",
        )
    nodes, per_node = nodes_and_gpus(run, a, target)
    keys = [
        Key(_S_PLACEMENT + "policy_num_nodes", nodes, f"the {s.world_size} GPUs profiled, for every model"),
        Key(_S_PLACEMENT + "policy_num_gpus_per_node", per_node),
    ]
    if "reference" in a.roles:
        keys += [Key(_S_PLACEMENT + "ref_num_nodes", nodes), Key(_S_PLACEMENT + "ref_num_gpus_per_node", per_node)]
    keys.append(Key("trainer.strategy", "megatron", f"profiled as {s.describe()} (MegatronWorker, {_S_WORKER})"))
    sp = "with" if s.megatron_sequence_parallel else "without"
    for role in ("policy", "reference"):
        if role not in a.roles:
            continue
        prefix, policy = _S_MCORE[role], role == "policy"
        keys += [
            Key(
                prefix + "tensor_model_parallel_size",
                s.tensor_parallel,
                f"{sp} Megatron's sequence parallelism, which SkyRL ties to it (provider.sequence_parallel = tp > 1)"
                if policy
                else "the reference laid out as the policy, as profiled",
            ),
            Key(prefix + "pipeline_model_parallel_size", s.pipeline_parallel, "1F1B over the stages, the binding stage's peak profiled" if policy else ""),
            Key(
                prefix + "context_parallel_size",
                s.context_parallel,
                (f"each sequence cut over {s.context_parallel} GPUs, attention a ring, as profiled" if s.context_parallel > 1
                 else "no context parallelism, as profiled") if policy else "",
            ),
            Key(
                prefix + "expert_model_parallel_size",
                s.expert_parallel,
                (f"each MoE layer's experts spread over {s.expert_parallel} GPUs, the rank receiving the most tokens "
                 "profiled" if s.expert_parallel > 1 else "experts (if any) whole on every GPU, as profiled") if policy else "",
            ),
            *(
                [Key(prefix + "expert_tensor_parallel_size", s.expert_tensor_parallel,
                     f"each expert's matrices split over {s.expert_tensor_parallel} GPUs, as profiled" if policy else "")]
                if s.expert_tensor_parallel is not None else []
            ),
        ]
    keys.append(
        Key(
            _S_MCORE["policy"] + "optimizer_config_kwargs.use_distributed_optimizer",
            True,
            f"optimizer state sharded over the {s.data_parallel_size} data-parallel ranks, as profiled "
            "(init_megatron_optim_config's default)",
        )
    )
    keys.append(
        Key(
            "trainer.bf16",
            a.trained_dtype == "bf16",
            f"every model's parameters in {a.trained_dtype} ({_S_WORKER}: provide_distributed_model(bf16=trainer.bf16))",
        )
    )
    recompute = a.gradient_checkpointing
    keys.append(
        Key(
            "trainer.gradient_checkpointing",
            recompute,
            "Megatron's full recompute of every layer, as profiled" if recompute else "no recompute, as profiled "
            f"({_S_WORKER} clears transformer_config_kwargs' recompute_*)",
        )
    )
    if recompute:
        tf = _S_MCORE["policy"] + "transformer_config_kwargs."
        keys += [
            Key(tf + "recompute_granularity", "full", "every layer recomputed (SkyRL's default kwargs, as profiled)"),
            Key(tf + "recompute_method", "uniform"),
            Key(tf + "recompute_num_layers", 1),
        ]
    keys.append(Key("trainer.policy.model.lora.rank", 0, "no LoRA: every parameter trained"))
    return keys + _megatron_head(run, a, same)


def _megatron_head(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """SkyRL's Megatron head: vocab-parallel log-probs from the logits (megatron_model_wrapper.py), the update's entropy
    in chunks sized from memory.

    A profile of ``fused_lm_head_logprob`` (NOTE [ SkyRL's fused LM head ] in :mod:`batchfit.train.megatron_heads`)
    writes it on, with its chunk. Otherwise a Megatron profile runs SkyRL's own head on the ``[b, s, V/tp]`` logits
    (``fused_lm_head_logprob`` off), with the
    entropy chunks the config sets (``vocab_entropy_chunk_size``, ``vocab_entropy_chunk_memory_mb``; NOTE [ SkyRL's
    entropy chunks sized from memory ] in :mod:`batchfit.frameworks.skyrl`): both are written as profiled. The algorithm's settings are never changed.
    """
    del run, same
    tp = a.sharding.tensor_parallel
    heads = a.head
    if isinstance(heads, MegatronHeads) and heads.update.fused:  # NOTE [ SkyRL's fused LM head ]
        return [
            Key(
                "trainer.fused_lm_head_logprob",
                True,
                "log-probs from the hidden states, the output layer folded into each chunk: no [tokens, V/tp] logits "
                "(FusedLinearChunkedDistributedLogprob, model_utils.py, SkyRL a9564572), as profiled",
            ),
            Key(
                "trainer.logprobs_chunk_size",
                heads.update.chunk_size,
                "tokens per fused chunk, as profiled" if heads.update.chunk_size else "one chunk, as profiled",
            ),
        ]
    return [
        Key(
            "trainer.fused_lm_head_logprob",
            False,
            "log-probs from Megatron's vocab-parallel logits (megatron_model_wrapper.py), as profiled with SkyRL's "
            "head",
        ),
        *_entropy_chunk_keys(heads.update if isinstance(heads, MegatronHeads) else None, tp),
    ]


def _entropy_chunk_keys(update: Any, tp: int) -> list[Key]:
    """The update's entropy chunks as profiled (SkyRL's defaults when the profile carried no SkyRL heads)."""
    size = ENTROPY_CHUNK_DEFAULTS[ENTROPY_CHUNK_KEY] if update is None else update.entropy_chunk_size
    memory = ENTROPY_CHUNK_DEFAULTS[ENTROPY_MEMORY_KEY] if update is None else update.entropy_chunk_memory_mb
    if size is None:
        return [Key(ENTROPY_CHUNK_KEY, None, "the update's entropy over the whole micro-batch at once, as profiled")]
    if size:
        return [Key(ENTROPY_CHUNK_KEY, size, f"the update's entropy {size:,} tokens at a time, as profiled")]
    return [
        Key(
            ENTROPY_CHUNK_KEY,
            0,
            "the update's entropy chunks sized from the memory below, as profiled: SkyRL takes the largest power of "
            f"two <= {memory} MiB / (rows x V/{tp} x 4 B x 4) tokens per chunk (model_utils.py "
            "_resolve_vocab_entropy_chunk_size, SkyRL a9564572)",
        ),
        Key(ENTROPY_MEMORY_KEY, memory, "MiB of temporaries per entropy chunk"),
    ]


def _skyrl_head(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """SkyRL's head (model_wrapper.py): log-probs and an entropy chunked by logprobs_chunk_size tokens."""
    target = "skyrl"
    why = (
        "SkyRL's FSDP workers compute log-probs with its own head and chunked entropy (model_wrapper.py; "
        "fused_lm_head_logprob needs trainer.strategy megatron, TrainerConfig.__post_init__)"
    )
    fix = "drop --logprobs (the config's head), or pass --logprobs skyrl"
    check_head(target, a, ("skyrl",), why, fix)
    head = a.head
    assert isinstance(head, FrameworkHead)
    if head.entropy != "chunked" or head.forward_entropy != "none":
        raise refuse(target, f"--logprobs skyrl with {head.entropy} entropy", why, fix)
    keys = [
        Key(
            "trainer.logprobs_chunk_size",
            head.entropy_chunk_size,
            f"the entropy in chunks of {head.entropy_chunk_size:,} tokens: {head.describe()}",
        )
    ]
    algorithm = (
        f"the entropy {'is' if head.entropy_in_loss else 'is not'} in the loss (trainer.algorithm.use_entropy_loss), "
        f"temperature {head.temperature:g}"
    )
    if same:
        own = (run.entropy_grad, run.entropy_in_loss, float(run.temperature or 1.0))
        if own != (head.entropy_grad, head.entropy_in_loss, head.temperature):
            raise refuse(
                target,
                "--logprobs skyrl",
                f"the head profiled assumes {algorithm}, but the config's trainer.algorithm.use_entropy_loss and "
                "temperature say otherwise (settings of the algorithm, which emit does not change)",
                "drop --logprobs to profile the config's own head",
            )
    else:
        keys.append(Key("", False, f"the budgets assume SkyRL's head where {algorithm}: keep the config's alike"))
    return keys


def allocator_keys(a: Assumptions) -> list[Key]:
    """``trainer.use_expandable_segments``: SkyRL's trainer switches expandable segments on after init (PR #1768)."""
    on = a.allocator == "expandable_segments"
    return [
        Key(
            "trainer.use_expandable_segments",
            on,
            ("expandable segments, as profiled" if on else "the caching allocator's default segments, as profiled")
            + " (workers/worker.py: torch._C._accelerator_setAllocatorSettings after init_model)",
        )
    ]
