"""AReaL 4aef98d8's keys for ``--emit areal``: each engine's ``mb_spec.max_tokens_per_mb``, and every setting the budgets assume.

:func:`token_keys` writes ``actor.mb_spec.max_tokens_per_mb`` (the actor's update and its recomputed
log-probs both split by it), ``ref.mb_spec.max_tokens_per_mb`` and ``critic.mb_spec.max_tokens_per_mb``;
:func:`assumption_keys` the key of every setting the budgets were profiled with, or refuses what AReaL
cannot express (NOTE [ Emitted keys carry every assumption ] in :mod:`batchfit.frameworks.assumptions`).
:data:`batchfit.frameworks.areal.SPEC` names this module (``FrameworkSpec.emit``).
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.areal import PAGE_TOKENS
from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    allocator_comment,
    check_head,
    check_strategy,
    refuse,
)
from batchfit.frameworks.emit import smallest_budget
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile

__all__ = ["allocator_keys", "assumption_keys", "token_keys"]

# NOTE [ AReaL's token cap ]
# areal/utils/seqpack.py ffd_allocate (4aef98d8) packs a split's sequences into micro-batches whose valid tokens
# (the attention mask's sum, data.py split_padded_tensor_dict_into_mb_list) stay at or below max_tokens_per_mb, and
# raises RuntimeError on one sequence longer than it: a hard cap, per micro-batch, counted before the Ulysses split
# (fsdp_engine.py slices the packed row over the context-parallel group afterwards). data.py pad_mb_list then pads the
# packed row up to a multiple of N_TOKENS_PER_PAGE = 256, so the emitted cap is the budget rounded down to a multiple of
# 256: the padded row stays within the budget.
_CAP = "a hard cap (seqpack.ffd_allocate packs each split at or below it and raises on a longer sequence)"


def _cap(tokens: int) -> int:
    """The budget rounded down to a multiple of 256 (NOTE [ AReaL's token cap ]), at least 256."""
    return max(tokens // PAGE_TOKENS * PAGE_TOKENS, PAGE_TOKENS)


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """One ``mb_spec.max_tokens_per_mb`` per engine AReaL runs (NOTE [ AReaL's token cap ]).

    The actor's key bounds its update (``train_batch``) and its recomputed log-probs (``compute_logp``,
    ``forward_batch``): the smaller budget of the two. The reference's and critic's their own engines'.
    """
    del world
    sp = profile.options["policy"].sharding.sequence_parallel
    split = f"; counted before the Ulysses split over actor.backend's c{sp}" if sp > 1 else ""
    keys: list[Key] = []
    for engine, roles, what in (
        ("actor", ("policy", "policy_forward"), "the actor's update and recomputed log-probs"),
        ("ref", ("reference",), "the reference's log-probs"),
        ("critic", ("critic", "critic_forward"), "the critic's values and update"),
    ):
        binding = smallest_budget(budgets, roles)
        if binding is None:
            continue
        cap = _cap(budgets[binding])
        comment = why(binding, f"{what}, set by {binding}") + f"; {_CAP}, rounded down to a multiple of {PAGE_TOKENS} " \
            "(data.py pad_mb_list pads each packed micro-batch to one)" + split
        if cap < max_seq_len:
            comment += (
                f"; below the longest sequence ({max_seq_len:,} tokens): AReaL raises on a longer one (its OOM guide: "
                "not below train_dataset.max_length + gconfig.max_new_tokens), so shorten the sequences or add GPUs"
            )
        keys.append(Key(f"{engine}.mb_spec.max_tokens_per_mb", cap, comment))
        keys.append(Key(f"{engine}.mb_spec.n_mbs", 1, "the least micro-batch count: the cap decides the rest"))
    return keys


_PARALLEL = "fsdp_utils/parallel.py parallelize_model"


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """The keys of every setting the budgets were profiled with, in AReaL's terms."""
    del same
    target = "areal"
    s = a.sharding
    check_strategy(target, a, ("fsdp2", "megatron"), "AReaL trains with its FSDP engine (fully_shard: " + _PARALLEL
                   + " apply_fsdp2) or its Megatron engine (actor.backend megatron:…)")  # fmt: skip
    if s.strategy == "megatron":
        return _megatron_keys(a)
    if not s.reshard_after_forward:
        raise refuse(
            target, "--no-reshard-after-forward", f"AReaL always reshards after forward ({_PARALLEL})", "drop it"
        )
    dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(a.trained_dtype)
    if dtype is None:
        raise refuse(target, f"--dtype {a.trained_dtype}", "AReaL loads its models in actor.dtype", "pass --dtype bf16")
    if s.distributed and s.mixed_precision not in ("bf16", "none"):
        raise refuse(target, f"--mixed-precision {s.mixed_precision}", "AReaL's MixedPrecisionPolicy computes in actor.dtype", "pass --mixed-precision bf16")
    reduce = "float32" if s.mixed_precision == "bf16" else dtype
    if a.lora.get("critic") is not None:
        raise refuse(target, "a critic LoRA", "AReaL's use_lora is the actor's (cli_args.py TrainEngineConfig)", "profile the critic without LoRA")
    sp = s.sequence_parallel
    dp = s.world_size // sp
    backend = f"fsdp:d{dp}" + (f"c{sp}" if sp > 1 else "")
    keys = [
        Key("actor.backend", backend, f"the {s.world_size} GPUs profiled for the actor (alloc_mode.py: d × c)"),
        Key("actor.dtype", dtype, "parameters loaded in it, FSDP2 computes in it (fsdp_engine.py, " + _PARALLEL + ")"),
        Key("actor.grad_reduce_dtype", reduce, "FSDP2's reduce dtype (MixedPrecisionPolicy.reduce_dtype)"),
        Key("actor.gradient_checkpointing", bool(a.gradient_checkpointing), "every decoder layer checkpointed" if a.gradient_checkpointing else "no checkpointing"),
        Key("actor.fsdp.offload_params", s.offload == "cpu", "CPUOffloadPolicy (fsdp_engine.py)"),
    ]
    if "reference" in a.roles:
        keys.append(Key("ref.dtype", {"bf16": "bfloat16", "fp32": "float32"}.get(a.dtypes.get("reference", "bf16"), "bfloat16"), "the reference's parameters"))
    lora = a.lora.get("policy")
    if lora is None:
        keys.append(Key("actor.use_lora", False, "every parameter trained"))
    else:
        keys += [
            Key("actor.use_lora", True, f"{lora.describe()}: adapters on a frozen base"),
            Key("actor.lora_rank", lora.rank),
            Key("actor.lora_alpha", int(lora.alpha) if lora.alpha == int(lora.alpha) else lora.alpha),
        ]
        if not isinstance(lora.targets, str):
            keys.append(Key("actor.target_modules", tuple(lora.targets)))
    check_head(
        target,
        a,
        ("full",),
        "AReaL computes log-probs from the whole logits (gather_logprobs: fp32 log_softmax per 1024-token chunk, profiled "
        "with batchfit's full head, an upper bound) and has no key for another head",
        "drop --logprobs (full is AReaL's)",
    )
    keys.append(Key("", False, "AReaL packs every micro-batch into one row (fsdp_engine.py _prepare_mb_list): the budgets are packed rows"))
    return keys


def _megatron_keys(a: Assumptions) -> list[Key]:
    """The Megatron engine's keys as profiled (NOTE [ AReaL's Megatron backend ] in :mod:`batchfit.frameworks.areal`).

    Raises:
        EmitError: a critic, LoRA, activation offload, a dtype other than bf16, Megatron's sequence parallelism set
            apart from tensor parallelism (AReaL ties them), another head.
    """
    target = "areal"
    s = a.sharding
    for flag, value, why in (
        ("a critic under --sharding megatron", "critic" in a.roles, "batchfit does not profile AReaL's Megatron critic"),
        ("--lora-rank with --sharding megatron", a.lora.get("policy") is not None, "batchfit does not model Megatron LoRA"),
        ("--activation-offload with --sharding megatron", a.activation_offload, "AReaL's Megatron engine has no key for it"),
        (f"--dtype {a.trained_dtype} with --sharding megatron", a.trained_dtype != "bf16", "batchfit writes AReaL's Megatron run in bf16"),
        ("Megatron sequence parallelism apart from tensor parallelism", s.megatron_sequence_parallel != (s.tensor_parallel > 1),
         "AReaL turns it on exactly when t > 1 (megatron_engine.py _make_parallel_strategy)"),
    ):  # fmt: skip
        if value:
            raise refuse(target, flag, why, "profile without it")
    dims = f"d{s.data_parallel_size}" + "".join(
        f"{letter}{n}" for letter, n in (("t", s.tensor_parallel), ("p", s.pipeline_parallel), ("c", s.context_parallel), ("e", s.expert_parallel)) if n > 1
    )  # fmt: skip
    recompute = a.gradient_checkpointing
    m = "actor.megatron."
    keys = [
        Key("actor.backend", f"megatron:{dims}", f"profiled as {s.describe()} (alloc_mode.py: d × t × p × c, e)"),
        Key("actor.dtype", "bfloat16", "bf16 parameters (mbridge), fp32 main copy in the optimizer, as profiled"),
        Key(m + "virtual_pipeline_parallel_size", s.virtual_pipeline_parallel or 1,
            "the interleaved schedule, as profiled" if s.virtual_pipeline_parallel else "no interleaved schedule, as profiled"),
        Key(m + "ddp.use_distributed_optimizer", s.distributed_optimizer,
            f"optimizer state sharded over the {s.data_parallel_size} data-parallel ranks, as profiled"
            if s.distributed_optimizer else "optimizer state whole on every data-parallel rank, as profiled"),
        Key(m + "ddp.grad_reduce_in_fp32", True, "an fp32 gradient buffer, as profiled"),
        Key(m + "use_precision_aware_optimizer", s.precision_aware_optimizer,
            "Megatron's precision-aware optimizer, as profiled" if s.precision_aware_optimizer
            else "the standard optimizer (fp32 main copy and moments), as profiled"),
        *[Key(m + name, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(getattr(s, name), getattr(s, name)),
              f"{name} as profiled")
          for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
          if s.precision_aware_optimizer and getattr(s, name) != "fp32"],
        Key("actor.gradient_checkpointing", bool(recompute), "every layer's input recomputed (Megatron's full recompute)" if recompute else "no recompute"),
        *([Key(m + "recompute_granularity", "full"), Key(m + "recompute_method", "uniform"), Key(m + "recompute_num_layers", 1)] if recompute else []),
        Key("actor.use_lora", False, "every parameter trained"),
    ]  # fmt: skip
    if "reference" in a.roles:
        keys.append(Key("ref.backend", f"megatron:{dims}", "the reference laid out as the actor, as profiled"))
    return keys


def allocator_keys(a: Assumptions) -> list[Key]:
    """AReaL's workers keep PyTorch's allocator default (nothing at 4aef98d8 calls get_custom_env_vars)."""
    how = (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the actor's scheduling_spec env_vars"
        if a.allocator == "expandable_segments"
        else "AReaL's default"
    )
    return [allocator_comment(a, how)]
