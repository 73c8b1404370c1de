"""OpenRLHF 0.11.2's flags for ``--emit openrlhf``: its two token flags, and every setting the budgets assume.

:func:`token_keys` writes ``--train.max_tokens_per_gpu`` (the updates) and
``--rollout.max_tokens_per_gpu`` (the experience passes); :func:`assumption_keys` the flag of
every setting the budgets were profiled with, or refuses what OpenRLHF cannot express (NOTE [
Emitted keys carry every assumption ] in :mod:`batchfit.frameworks.assumptions`).
:data:`batchfit.frameworks.openrlhf.SPEC` names this module (``FrameworkSpec.emit``);
:mod:`batchfit.frameworks.emit` calls it through the registry.
"""

from __future__ import annotations

import shlex
from typing import Any

from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    allocator_comment,
    check_head,
    check_precision,
    check_strategy,
    lora_value,
    nodes_and_gpus,
    refuse,
    ring_keys,
    switch_keys,
)
from batchfit.frameworks.emit import cost_note, smallest_budget
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile
from batchfit.models.lora import LoraSpec

__all__ = ["assumption_keys", "token_keys"]


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """OpenRLHF 0.11.2: one token flag for the actor and critic updates, one for the experience passes.

    ``--train.max_tokens_per_gpu`` bounds the training micro-batches of the actor and the critic
    (replay_buffer.setup_dynamic_batch); ``--rollout.max_tokens_per_gpu`` the forward passes that
    make experience: old log-probs, reference log-probs, values (experience_maker). Both count
    tokens per GPU: with ring attention OpenRLHF packs ``max_tokens_per_gpu × --ds.ring_attn_size ×
    --ds.tensor_parallel_size`` tokens into a micro-batch split over that group
    (``utils/seqlen_balancing.py`` ``get_minimum_num_micro_batch_size``, called with
    ``train_max_tokens_per_gpu`` and ``rollout_max_tokens_per_gpu``), so a budget ``C`` of the group
    is written as ``C // sp``.
    """
    del max_seq_len, world
    options = profile.options.get("policy") or next(iter(profile.options.values()), None)
    sp = 1 if options is None else options.sharding.sequence_parallel

    def per_gpu(role: str, comment: str) -> tuple[int, str]:
        if sp == 1:
            return budgets[role], comment
        return budgets[role] // sp, (
            f"{comment}; per GPU: OpenRLHF multiplies it by --ds.ring_attn_size {sp} (seqlen_balancing.py), "
            f"a micro-batch of {budgets[role] // sp * sp:,} tokens split over {sp} GPUs"
        )

    trained = smallest_budget(budgets, ("policy", "critic"))
    forward = smallest_budget(budgets, ("policy_forward", "reference", "critic_forward"))
    values = getattr(profile.run, "values", {})
    keys = [
        Key(
            "--train.dynamic_batch_enable",
            True,
            "micro-batches by the token counts below (replay_buffer.setup_dynamic_batch, experience_maker)",
        ),
        Key(
            "--ds.packing_samples",
            True,
            "train_ppo_ray turns it on with dynamic batches anyway; it needs vLLM (--vllm.num_engines > 0)"
            + ("" if values.get("vllm.num_engines") else ", which this command does not set"),
        ),
    ]
    if trained is not None:
        what = (
            "actor and critic updates (one flag): the smaller budget"
            if "critic" in budgets
            else "actor update"
        )
        keys.append(Key("--train.max_tokens_per_gpu", *per_gpu(trained, why(trained, f"{what}, set by {trained}"))))
    if forward is not None:
        passes = [p for p in ("policy_forward", "reference", "critic_forward") if p in budgets]
        keys.append(
            Key(
                "--rollout.max_tokens_per_gpu",
                *per_gpu(forward, why(forward, f"experience passes ({', '.join(passes)}; no_grad), set by {forward}")),
            )
        )
    keys.append(
        Key(
            "",
            False,
            f"the budgets count {cost_note(profile, 'OpenRLHF')}; OpenRLHF's caps are soft: it balances samples "
            "into the first-fit count of micro-batches, and rounds the experience passes' count down to a multiple "
            "of the actor ranks, so a micro-batch can hold more than its cap (the safety margin absorbs a little)",
        )
    )
    return keys


_O_DS = "openrlhf/utils/deepspeed/deepspeed.py"


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "openrlhf"
    s = a.sharding
    check_strategy(
        target,
        a,
        ("zero1", "zero2", "fsdp2"),
        "OpenRLHF trains with DeepSpeed ZeRO: stages 1 and 2 batchfit profiles as zero1 and zero2, stage 3 as FSDP2 "
        "(--ds.zero_stage 3); it has no DDP or FSDP1",
    )
    ring = ring_keys(run, a, "--ds.ring_attn_size", "OpenRLHF's ring attention")
    zero = s.spec.zero_stage > 0
    if not s.reshard_after_forward:
        raise refuse(
            target,
            "--no-reshard-after-forward",
            "ZeRO-3 gathers each layer's parameters again for backward, and ZeRO-2 keeps whole parameters on every "
            "GPU, which batchfit models as --sharding zero2",
            "drop --no-reshard-after-forward, or profile --sharding zero2 --dtype bf16",
        )
    if s.offload == "cpu":
        raise refuse(
            target,
            "--offload cpu",
            f"OpenRLHF never offloads the parameters of a model it trains ({_O_DS}: get_train_ds_config(offload=False)); "
            "--ds.adam_offload moves the optimizer state only",
            "profile with --offload none",
        )
    if zero:  # ZeRO-1/2: bf16 parameters, the fp32 master weights in the partitioned optimizer state
        if a.trained_dtype != "bf16":
            raise refuse(
                target,
                f"--dtype {a.trained_dtype}",
                f"OpenRLHF's DeepSpeed ZeRO-{s.spec.zero_stage} trains bf16 parameters (--ds.param_dtype bf16) with fp32 "
                "master weights in the optimizer's partition",
                "pass --dtype bf16",
            )
    else:
        check_precision(
            target,
            a,
            "OpenRLHF trains with DeepSpeed in bf16 or fp16 (--ds.param_dtype) with fp32 master weights, which batchfit "
            "models as fp32 parameters with bf16 compute (fsdp2, --mixed-precision bf16 --dtype fp32)",
        )
    nodes, per_node = nodes_and_gpus(run, a, target)
    keys = [
        Key("--actor.num_nodes", nodes, f"the {s.world_size} GPUs profiled, for every model"),
        Key("--actor.num_gpus_per_node", per_node),
    ]
    for role, name in (("critic", "critic"), ("reference", "ref")):
        if role in a.roles:
            keys += [Key(f"--{name}.num_nodes", nodes), Key(f"--{name}.num_gpus_per_node", per_node)]
    if zero:
        stage = s.spec.zero_stage
        what = "optimizer state and gradients" if stage == 2 else "optimizer state"
        keys.append(Key("--ds.zero_stage", stage, f"ZeRO-{stage}: parameters replicated, {what} partitioned"))
        keys.append(Key("--ds.param_dtype", "bf16", "bf16 parameters, fp32 master weights in each partition"))
        if s.overlap_comm:
            keys.append(Key("--ds.overlap_comm", True, "two reduce buckets, as profiled"))
    else:
        keys.append(Key("--ds.zero_stage", 3, "ZeRO-3, profiled as FSDP2 over the same GPUs"))
        keys.append(
            Key(
                "--ds.param_dtype",
                "bf16",
                "bf16 compute over fp32 master weights, profiled as fp32 parameters with bf16 mixed precision",
            )
        )
    if "reference" in a.roles and a.dtypes["reference"] != "bf16":
        raise refuse(
            target,
            f"--dtype {a.dtypes['reference']}",
            "OpenRLHF loads its reference in --ds.param_dtype (bf16, openrlhf/trainer/ray/launcher.py)",
            "drop --dtype",
        )
    keys += switch_keys(
        target,
        run,
        same,
        "--actor.gradient_checkpointing_enable",
        a.gradient_checkpointing,
        bool(run.gradient_checkpointing),
        "--gradient-checkpointing",
        "activation checkpointing of the actor and the critic (ppo_actor.py, ppo_critic.py read this one flag)",
    )
    policy, critic = a.lora.get("policy"), a.lora.get("critic")
    if "critic" in a.roles and policy != critic:
        raise refuse(
            target,
            f"LoRA {_lora_text(policy)} for the policy and {_lora_text(critic)} for the critic",
            "OpenRLHF's --ds.lora.* adapt the actor and the critic alike (ppo_actor.py, ppo_critic.py)",
            "give both the same adapters (--lora-rank with a config whose critic has them too)",
        )
    if policy is not None and policy.alpha != int(policy.alpha):
        raise refuse(target, f"--lora-alpha {policy.alpha:g}", "--ds.lora.alpha takes an integer", "pass an integer --lora-alpha")
    keys.append(
        Key(
            "--ds.lora.rank",
            0 if policy is None else policy.rank,
            f"{_lora_text(policy)} for the actor and the critic (ppo_actor.py, ppo_critic.py)",
        )
    )
    if policy is not None:
        keys.append(Key("--ds.lora.alpha", int(policy.alpha)))
        keys += _openrlhf_targets(run, policy, same)
    check_head(
        target,
        a,
        ("full",),
        "OpenRLHF computes log-probs from the whole logits (profiled with batchfit's full head) and has no flag for "
        "another head",
        "drop --logprobs (full is OpenRLHF's)",
    )
    return keys + ring


def _openrlhf_targets(run: RunConfig, spec: LoraSpec, same: bool) -> list[Key]:
    """``--ds.lora.target_modules`` (``nargs="*"``): module names; all-linear only as the flag's default.

    Given on the command line the flag is a list, and PEFT expands ``all-linear`` only from a
    string (``peft/tuners/tuners_utils.py`` ``_maybe_include_all_linear_layers``): the default
    ``"all-linear"`` must stay the default.
    """
    if not isinstance(spec.targets, str):
        return [Key("--ds.lora.target_modules", lora_value(spec))]
    given = getattr(run, "values", {}).get("ds.lora.target_modules", "all-linear")
    if same and given != "all-linear":
        raise refuse(
            "openrlhf",
            "--lora-targets all-linear",
            f"the launch command gives --ds.lora.target_modules {shlex.join(map(str, given))}, and all-linear is "
            "only its default (given as a flag it is a list, which PEFT reads as a module name)",
            "remove --ds.lora.target_modules from the command, or pass --lora-targets with module names",
        )
    return [Key("", False, "LoRA on every linear layer: --ds.lora.target_modules left at its default, all-linear")]


def _lora_text(spec: LoraSpec | None) -> str:
    return "no LoRA" if spec is None else spec.describe()


def allocator_keys(a: Assumptions) -> list[Key]:
    """OpenRLHF 0.11.2 sets no allocator setting: the launch's environment decides."""
    how = (
        "OpenRLHF sets none, so export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before `ray start` (or pass it "
        "in ray job submit --runtime-env-json's env_vars)"
        if a.allocator == "expandable_segments"
        else "what OpenRLHF runs unless the launch exports PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (then "
        "profile with --allocator expandable_segments)"
    )
    return [allocator_comment(a, how)]
