"""OpenRLHF's launch command (``python -m openrlhf.cli.train_ppo_ray --flag value …``) in batchfit's terms.

Mirrors OpenRLHF 0.11.2 (the wheel's ``openrlhf/cli/train_ppo_ray.py`` and the code below it):
the flags and their defaults come from ``defaults/openrlhf_flags.json``, extracted from that
file's parser; each rule in :func:`rules` cites the code it mirrors.

Units: ``--rollout.batch_size`` counts prompts, ``--train.batch_size`` counts **samples** per
optimizer step over all GPUs (DeepSpeed's ``train_batch_size``), ``--train.micro_batch_size``
and ``--rollout.micro_batch_size`` samples per GPU, ``--train.max_tokens_per_gpu`` and
``--rollout.max_tokens_per_gpu`` tokens per GPU (packed rows: dynamic batching turns
``--ds.packing_samples`` on).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from batchfit.frameworks.flags import Command, FrameworkRun, Verdict, flag_spec, parse_command
from batchfit.frameworks.openrlhf_renames import translate
from batchfit.frameworks.registry import FrameworkSpec
from batchfit.frameworks.run import int_product, is_positive_int, positive_int_faults
from batchfit.frameworks.your_sizes import pass_sizes
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import RolloutEngine, process_allocator_setting

# The trainer's dest names batchfit reads (an unresolved shell value for one is a fault).
READ = frozenset(
    {
        "actor.model_name_or_path",
        "critic.model_name_or_path",
        "reward.model_name_or_path",
        "reward.remote_url",
        "train.agent_func_path",
        "actor.num_nodes",
        "actor.num_gpus_per_node",
        "critic.num_nodes",
        "critic.num_gpus_per_node",
        "ref.num_nodes",
        "ref.num_gpus_per_node",
        "rollout.batch_size",
        "rollout.n_samples_per_prompt",
        "rollout.micro_batch_size",
        "rollout.max_tokens_per_gpu",
        "train.batch_size",
        "train.micro_batch_size",
        "train.max_epochs",
        "train.dynamic_batch_enable",
        "train.max_tokens_per_gpu",
        "data.max_len",
        "ds.zero_stage",
        "ds.ring_attn_size",
        "ds.tensor_parallel_size",
        "algo.advantage.estimator",
        "algo.kl.init_coef",
        "vllm.num_engines",
        "vllm.tensor_parallel_size",
        "vllm.gpu_memory_utilization",
        "vllm.enable_sleep",
        "vllm.enforce_eager",
        "train.colocate_all",
        "ds.enable_sleep",
        "ds.packing_samples",
        "ds.lora.rank",
        "ds.lora.alpha",
    }
)
# BatchConfig field -> the flag it is read from (messages of the batch plan in OpenRLHF's words).
KEY_NAMES = {
    "train_batch_size": "--rollout.batch_size",
    "n_samples_per_prompt": "--rollout.n_samples_per_prompt",
    "micro_train_batch_size_per_gpu": "--train.micro_batch_size",
    "micro_forward_batch_size_per_gpu": "--rollout.micro_batch_size",
    "max_tokens_per_micro_batch": "--train.max_tokens_per_gpu",
    "update_epochs_per_batch": "--train.max_epochs",
    "tensor_parallel": "--ds.tensor_parallel_size",
    "context_parallel": "--ds.ring_attn_size",
}
# Estimators that subtract a per-prompt baseline: train_ppo_ray asserts n_samples_per_prompt > 1.
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")


def read(command: Command) -> FrameworkRun:
    """The launch command as a :class:`FrameworkRun` (OpenRLHF's rules apply at ``plan()``).

    Raises:
        BatchConfigError: what OpenRLHF's parser refuses (an unknown flag, with the closest;
            a bad value), or an unresolved shell value of a flag batchfit reads.
    """
    spec = flag_spec("openrlhf")
    # NOTE [ Old OpenRLHF flags are translated ]: a pre-0.11 script is read under 0.11.2's names
    translated = translate(command, known=frozenset(spec.by_flag), read=READ)
    command = dataclasses.replace(translated.command, notes=(*command.notes, *translated.notes))
    parsed = parse_command(command, spec, read=READ)
    v = parsed.values
    n, rollout, train = v["rollout.n_samples_per_prompt"], v["rollout.batch_size"], v["train.batch_size"]
    dynamic = bool(v["train.dynamic_batch_enable"])
    notes = [*command.notes, *parsed.notes]
    # train.batch_size counts samples; batchfit's mini-batch counts prompts when it can
    by_prompt = is_positive_int(n) and is_positive_int(train) and train % n == 0
    if not by_prompt and is_positive_int(n) and n > 1:
        notes.append(
            f"--train.batch_size={train} is not a multiple of --rollout.n_samples_per_prompt={n}: OpenRLHF shuffles "
            "samples into optimizer steps regardless of their prompt, so the plan counts samples (one per 'prompt')"
        )
    critic = _critic_model(v)
    reference = _number(v["algo.kl.init_coef"]) > 0  # train_ppo_ray: a reference model when init_coef > 0
    roles = ["policy", *(["critic"] if critic else []), *(["reference"] if reference else [])]
    batch = BatchConfig(
        train_batch_size=rollout if by_prompt else int_product(rollout, n),
        policy_mini_batch_size=train // n if by_prompt else train,
        n_samples_per_prompt=n if by_prompt else 1,
        critic_mini_batch_size=(train // n if by_prompt else train) if critic else None,
        micro_train_batch_size_per_gpu=v["train.micro_batch_size"],
        micro_forward_batch_size_per_gpu=v["rollout.micro_batch_size"],
        max_tokens_per_micro_batch=v["train.max_tokens_per_gpu"] if dynamic else None,
        update_epochs_per_batch=v["train.max_epochs"],
        num_nodes=v["actor.num_nodes"],
        gpus_per_node=v["actor.num_gpus_per_node"],
        tensor_parallel=v["ds.tensor_parallel_size"],
        context_parallel=v["ds.ring_attn_size"],
        critic_world_size=int_product(v["critic.num_nodes"], v["critic.num_gpus_per_node"]) if critic else None,
        framework="batchfit",  # exact splits: what DeepSpeed asserts (see rules)
    )
    colocated, resident = _placement(v, roles)
    # ppo_actor / ppo_critic: both models take --ds.lora.* (rank 0 = full fine-tuning); the reference none
    lora = (
        {
            "rank": v["ds.lora.rank"],
            "alpha": v["ds.lora.alpha"],
            "target_modules": v["ds.lora.target_modules"],
        }
        if is_positive_int(v.get("ds.lora.rank"))
        else None
    )
    stage = v["ds.zero_stage"]
    if stage == 3 and (int_product(v["actor.num_nodes"], v["actor.num_gpus_per_node"]) or 1) > 1:
        notes.append(
            "DeepSpeed ZeRO-3 (--ds.zero_stage 3) is profiled as FSDP2, which shards the same state over the "
            "same ranks; DeepSpeed keeps a bf16 shard of the parameters beside its fp32 master shard (2 bytes per "
            "parameter / dp more) and fills reduce buckets of its own size"
        )
    if stage in (1, 2):
        notes.append(
            f"DeepSpeed ZeRO-{stage} (--ds.zero_stage {stage}) is profiled as batchfit's zero{stage}: DeepSpeed 0.19.8's "
            "flat bf16 parameters replicated, fp32 master weights and AdamW's moments partitioned"
            + (", gradients partitioned" if stage == 2 else "")
            + ", its reduce bucket of 500M elements (get_train_ds_config's reduce_bucket_size 'auto' keeps DeepSpeed's "
            "default)"
            + ("; --ds.overlap_comm doubles it" if v.get("ds.overlap_comm") else "")
        )
    if v.get("ds.adam_offload"):
        notes.append(
            "--ds.adam_offload keeps the optimizer state on the host; batchfit counts it on the GPU (the budgets "
            "are lower than OpenRLHF needs)"
        )
    if v.get("reward.model_name_or_path") and not v.get("reward.remote_url"):
        notes.append(
            f"the reward model {v['reward.model_name_or_path']} runs on its own GPUs (--reward.num_gpus_per_node); "
            "batchfit profiles the actor, critic and reference only"
        )
    return FrameworkRun(
        vocabulary="openrlhf",
        batch=batch,
        model=v["actor.model_name_or_path"],
        critic_model=critic,
        reference=reference,
        max_seq_len=v["data.max_len"],
        strategy=_STAGES.get(stage, f"deepspeed-zero{stage}"),
        offload="none",
        overlap_comm=bool(v.get("ds.overlap_comm")) and stage in (1, 2),
        gradient_checkpointing=bool(v.get("actor.gradient_checkpointing_enable")),
        # train_ppo_ray turns --ds.packing_samples on with dynamic batches: one padding-free row per micro-batch
        remove_padding=bool(v.get("ds.packing_samples")) or dynamic,
        lora=lora,
        critic_lora=lora if critic else None,
        colocated=colocated,
        resident=resident,
        generation_resident=_generation_resident(v, roles),
        engine=_engine(v),
        # OpenRLHF sets no allocator setting (no PYTORCH_CUDA_ALLOC_CONF in the package): what the launch gives
        allocator=process_allocator_setting(command.environment) or None,
        key_names={
            **KEY_NAMES,
            "policy_mini_batch_size": "--train.batch_size / --rollout.n_samples_per_prompt"
            if by_prompt
            else "--train.batch_size",
        },
        source={
            "max_seq_len": "--data.max_len",
            "world_size": "--actor.num_nodes × --actor.num_gpus_per_node",
            "model": "--actor.model_name_or_path",
            "strategy": "--ds.zero_stage",
        },
        rules=rules,
        values=v,
        notes=tuple(notes),
        # the sizes the command sets, put beside batchfit's budgets (your_sizes.compare)
        configured=pass_sizes(
            ("--train.max_tokens_per_gpu", v["train.max_tokens_per_gpu"], "tokens")
            if dynamic
            else ("--train.micro_batch_size", v["train.micro_batch_size"], "sequences"),
            # --rollout.max_tokens_per_gpu defaults to the train one (train_ppo_ray)
            ("--rollout.max_tokens_per_gpu", v.get("rollout.max_tokens_per_gpu") or v["train.max_tokens_per_gpu"], "tokens")
            if dynamic
            else ("--rollout.micro_batch_size", v["rollout.micro_batch_size"], "sequences"),
            reference=reference,
            critic=bool(critic),
        ),
    )


def rules(run: FrameworkRun) -> Verdict:
    """OpenRLHF 0.11.2's batch rules on ``run`` (its batch after overrides, its other flags).

    Faults are what OpenRLHF refuses (an assertion), what makes its ranks disagree, or what
    it runs while silently training on other samples than asked; warnings are what it runs
    with a budget exceeded.
    """
    v, cfg = run.values, run.batch
    faults: list[str] = []
    warnings: list[str] = []
    notes: list[str] = []
    ints = {
        "--rollout.batch_size × --rollout.n_samples_per_prompt": int_product(
            cfg.train_batch_size, cfg.n_samples_per_prompt
        ),
        "--train.batch_size": int_product(cfg.policy_mini_batch_size, cfg.n_samples_per_prompt),
        "--train.micro_batch_size": cfg.micro_train_batch_size_per_gpu,
        "--rollout.micro_batch_size": cfg.micro_forward_batch_size_per_gpu,
        "--train.max_epochs": cfg.update_epochs_per_batch,
        "--actor.num_nodes": cfg.num_nodes,
        "--actor.num_gpus_per_node": cfg.gpus_per_node,
        "--ds.ring_attn_size": cfg.context_parallel,
        "--ds.tensor_parallel_size": cfg.tensor_parallel,
    }
    if faults := list(positive_int_faults(ints)):
        return Verdict(faults=tuple(faults))
    samples, train = ints["--rollout.batch_size × --rollout.n_samples_per_prompt"], ints["--train.batch_size"]
    micro, rollout_micro = cfg.micro_train_batch_size_per_gpu, cfg.micro_forward_batch_size_per_gpu
    mp = cfg.context_parallel * cfg.tensor_parallel
    dynamic = cfg.max_tokens_per_micro_batch is not None
    estimator = v.get("algo.advantage.estimator")
    if estimator in GROUP_ESTIMATORS and v.get("rollout.n_samples_per_prompt") == 1:
        # train_ppo_ray: these estimators "require n_samples_per_prompt > 1"
        faults.append(
            f"--algo.advantage.estimator {estimator} subtracts a per-prompt baseline and OpenRLHF asserts "
            "--rollout.n_samples_per_prompt > 1 (train_ppo_ray.py); set it to 2 or more"
        )
    if estimator == "gae" and not run.critic_model:
        # train_ppo_ray: critic path = reward path .split(",")[0] -> AttributeError on None
        faults.append(
            "--algo.advantage.estimator gae trains a critic, initialised from --critic.model_name_or_path, else the "
            "first --reward.model_name_or_path; set one of them (or use grpo-style estimators: group_norm, rloo)"
        )
    if dynamic and not is_positive_int(v.get("vllm.num_engines")):
        # train_ppo_ray: dynamic batching sets ds.packing_samples, then asserts vllm.num_engines > 0
        faults.append(
            "--train.dynamic_batch_enable turns on --ds.packing_samples, which OpenRLHF allows only with vLLM "
            "(train_ppo_ray.py asserts --vllm.num_engines > 0); set --vllm.num_engines"
        )
    world = run.world_size
    groups = [("actor", world)]
    if cfg.critic_world_size is not None:
        groups.append(("critic", cfg.critic_world_size))
    if run.reference and (v.get("train.colocate_actor_ref") or v.get("train.colocate_all")):
        ref = int_product(v.get("ref.num_nodes"), v.get("ref.num_gpus_per_node"))
        if ref != world:
            # train_ppo_ray: colocated actor and reference need the same num_nodes and num_gpus_per_node
            faults.append(
                f"the reference shares the actor's GPUs (--train.colocate_actor_ref / colocate_all) but has "
                f"--ref.num_nodes × --ref.num_gpus_per_node = {ref} against the actor's {world} (train_ppo_ray.py "
                "asserts they match); set --ref.num_nodes and --ref.num_gpus_per_node to the actor's"
            )
    if samples < train:
        faults.append(
            f"a rollout of --rollout.batch_size × --rollout.n_samples_per_prompt = {samples} samples is smaller than "
            f"--train.batch_size={train}: no optimizer step completes (ppo_trainer / replay_buffer count "
            f"{samples} // {train} = 0 steps); set --train.batch_size to a divisor of {samples}"
        )
    elif samples % train:
        # dynamic: replay_buffer.setup_dynamic_batch floors the step count (the rest is not trained);
        # otherwise DeepSpeed's accumulation window runs over into the next rollout
        fate = "are never trained" if dynamic else "accumulate into the next rollout's first optimizer step"
        faults.append(
            f"--rollout.batch_size × --rollout.n_samples_per_prompt = {samples} samples are not a multiple of "
            f"--train.batch_size={train}: the last {samples % train} {fate}; set --train.batch_size to "
            f"{_divisor_near(samples, train)} (a divisor of {samples}) or --rollout.batch_size so the product is a "
            f"multiple of {train}"
        )
    for role, gpus in groups:
        if gpus % mp:
            faults.append(
                f"the {role}'s {gpus} GPUs do not split into --ds.ring_attn_size × --ds.tensor_parallel_size = {mp} "
                "(DeepSpeedStrategy.setup_distributed builds a (dp, ring, tp) mesh); use a multiple of it"
            )
            continue
        dp = gpus // mp
        if not dynamic:
            # train_ppo_ray asserts n × rollout.batch_size // rollout.micro_batch_size >= dp
            batches = samples // rollout_micro
            if role == "actor" and batches < dp:
                faults.append(
                    f"{samples} samples in micro-batches of --rollout.micro_batch_size={rollout_micro} make {batches}, "
                    f"fewer than the {dp} actor ranks (train_ppo_ray.py asserts at least one each); lower "
                    "--rollout.micro_batch_size or raise --rollout.batch_size"
                )
            elif samples % rollout_micro or batches % dp:
                # launcher.async_run_method_batch hands each rank ⌈batches / dp⌉ experience batches in turn
                faults.append(
                    f"the {role}'s {dp} ranks receive unequal shares of the rollout: {samples} samples in "
                    f"{-(-samples // rollout_micro)} experience batches of up to --rollout.micro_batch_size={rollout_micro}, "
                    f"dealt out ⌈{-(-samples // rollout_micro)} / {dp}⌉ at a time (launcher.async_run_method_batch), so "
                    "ranks run different numbers of micro-batches; make --rollout.batch_size × --rollout.n_samples_per_prompt "
                    f"/ --rollout.micro_batch_size a whole multiple of {dp}"
                )
            # DeepSpeed asserts train_batch_size == micro_batch_per_gpu × gradient_acc_step × world_size, with
            # train_batch_size = --train.batch_size × ring × tp (utils/deepspeed/deepspeed.py get_ds_train_config)
            if train % (micro * dp):
                faults.append(
                    f"--train.batch_size={train} is not a multiple of --train.micro_batch_size × the {role}'s data-parallel "
                    f"size = {micro} × {dp} = {micro * dp}: DeepSpeed refuses it (train_batch_size == micro_batch_per_gpu "
                    f"× gradient_acc_step × world_size); set --train.batch_size to a multiple of {micro * dp}"
                    + (
                        f" or --train.micro_batch_size to a divisor of {train // dp}"
                        if train % dp == 0
                        else ""
                    )
                )
        elif train % dp:
            # replay_buffer.setup_dynamic_batch: local_train_batch_size = train.batch_size // dp_size
            faults.append(
                f"--train.batch_size={train} does not split over the {role}'s {dp} data-parallel ranks: OpenRLHF "
                f"takes {train // dp} per rank (replay_buffer.setup_dynamic_batch), {train // dp * dp} per optimizer "
                f"step; set --train.batch_size to a multiple of {dp}"
            )
    if dynamic:
        longest = run.max_seq_len
        budgets = {"--train.max_tokens_per_gpu": cfg.max_tokens_per_micro_batch}
        budgets["--rollout.max_tokens_per_gpu"] = (
            v.get("rollout.max_tokens_per_gpu") or cfg.max_tokens_per_micro_batch
        )
        for flag, tokens in budgets.items():
            if is_positive_int(tokens) and is_positive_int(longest) and tokens < longest:
                # seqlen_balancing.get_minimum_num_micro_batch_size opens a bin for a longer sequence
                warnings.append(
                    f"{flag}={tokens} is below --data.max_len={longest}: OpenRLHF runs a longer sequence alone in a "
                    f"micro-batch of up to {longest} tokens, above the budget (get_minimum_num_micro_batch_size); set "
                    f"{flag} to at least {longest}"
                )
        notes.append(
            "OpenRLHF's token caps are soft: it counts micro-batches by first fit under the cap, then balances "
            "the samples into that many partitions (get_seqlen_balanced_partitions), which can exceed the cap; "
            "for the experience passes it also rounds the count down to a multiple of the actor ranks "
            "(experience_maker.split_rollout_samples)"
        )
    return Verdict(tuple(faults), tuple(warnings), tuple(notes))


def _critic_model(v: dict[str, Any]) -> str | None:
    """train_ppo_ray: a critic only for gae; its path, else the first reward model's, else (remote reward) the actor's."""
    if v.get("algo.advantage.estimator") != "gae":
        return None
    if v.get("critic.model_name_or_path"):
        return v["critic.model_name_or_path"]
    remote = v.get("reward.remote_url") or v.get("train.agent_func_path")
    if not remote:
        reward = v.get("reward.model_name_or_path")
        return reward.split(",")[0] if isinstance(reward, str) and reward else None
    return v.get("actor.model_name_or_path")


def _placement(v: dict[str, Any], roles: list[str]) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """Which models share GPUs and what each keeps there while another runs.

    ``--train.colocate_all`` puts every model on the actor's GPUs; ``--ds.enable_sleep`` then
    offloads a model's state while another runs (nothing stays). ``--train.colocate_actor_ref``
    puts the reference on the actor's GPUs, both kept. ``--ref.offload`` keeps the reference's
    parameters on the host, ``--ds.adam_offload`` the optimizer state.
    """
    optimizer = () if v.get("ds.adam_offload") else ("optimizer_state",)
    kept = {
        "policy": ("parameters", *optimizer),
        "critic": ("parameters", *optimizer),
        "reference": () if v.get("ref.offload") else ("parameters",),
    }
    if v.get("train.colocate_all"):
        return tuple(roles), {} if v.get("ds.enable_sleep") else {r: kept[r] for r in roles}
    if "reference" in roles and v.get("train.colocate_actor_ref"):
        return ("policy", "reference"), {"policy": kept["policy"], "reference": kept["reference"]}
    return (), {}


def _engine(v: dict[str, Any]) -> RolloutEngine | None:
    """The vLLM engines as OpenRLHF 0.11.2 runs them (``trainer/ray/vllm_engine.py``), or ``None`` without engines.

    On the actor's GPUs with ``--train.colocate_all`` (a share of the placement group each), else
    on GPUs of their own; ``--vllm.enable_sleep`` (forced off without ``colocate_all``) sleeps them at
    level 1 between generations (``RolloutRayActor.sleep(level=1)``); each rank a Ray actor.
    """
    if not is_positive_int(v.get("vllm.num_engines")):
        return None
    colocated = bool(v.get("train.colocate_all"))
    keys = {
        "tensor_parallel": "--vllm.tensor_parallel_size",
        "memory_fraction": "--vllm.gpu_memory_utilization",
        "sleeps": "--vllm.enable_sleep",
        "cuda_graphs": "--vllm.enforce_eager",
        "offload": "add --ds.enable_sleep (the actor's optimizer state and fp32 weights leave the GPUs while the "
        "engines generate)",
    }
    return RolloutEngine(
        name="vllm",
        colocated=colocated,
        tensor_parallel=v.get("vllm.tensor_parallel_size") or 1,
        memory_fraction=v.get("vllm.gpu_memory_utilization"),
        sleeps=colocated and bool(v.get("vllm.enable_sleep")),
        sleep_level=1,
        cuda_graphs=not v.get("vllm.enforce_eager"),
        own_process=True,
        keys=keys,
    )


def _generation_resident(v: dict[str, Any], roles: list[str]) -> dict[str, tuple[str, ...]]:
    """What the models keep on the actor's GPUs while colocated engines generate (``--train.colocate_all``).

    ``--ds.enable_sleep`` offloads the optimizer state, gradients and fp32 master weights but keeps
    the bf16 parameters (``deepspeed_utils.py`` ``offload_deepspeed_states``: ``lp_params`` stays);
    without it every model keeps its state.
    """
    if not v.get("train.colocate_all"):
        return {}
    optimizer = () if v.get("ds.adam_offload") or v.get("ds.enable_sleep") else ("optimizer_state",)
    kept = {
        "policy": ("parameters", *optimizer),
        "critic": ("parameters", *optimizer),
        "reference": () if v.get("ref.offload") else ("parameters",),
    }
    return {role: kept[role] for role in roles}


#: --ds.zero_stage → the Sharding strategy that models it (stage 3 as FSDP2, which shards the same state).
_STAGES = {1: "zero1", 2: "zero2", 3: "fsdp2"}


def strategy_refusal(run: Any) -> str | None:
    """Why ``profile`` cannot model OpenRLHF's DeepSpeed stage, with the flags that can; ``None`` for ZeRO-1, 2 and 3."""
    if run.strategy in _STAGES.values():
        return None
    stage = run.strategy.removeprefix("deepspeed-zero")
    return (
        f"OpenRLHF trains with DeepSpeed ZeRO stage {stage} (--ds.zero_stage {stage}), whose bf16 optimizer batchfit "
        "does not model; use --ds.zero_stage 2 (OpenRLHF's default, profiled as zero2) or 1 (zero1), or 3 "
        "(profiled as FSDP2)"
    )


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _divisor_near(n: int, target: int) -> int:
    """The divisor of ``n`` (≥ 1) closest to ``target``, the smaller on a tie.

    O(√n): the divisors come in pairs ``(i, n // i)`` with ``i ≤ √n``.

    >>> _divisor_near(12, 5), _divisor_near(35, 6)
    (4, 5)
    """
    best = 1
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            for d in (i, n // i):
                if (abs(d - target), d) < (abs(best - target), best):
                    best = d
    return best


SPEC = FrameworkSpec(
    name="openrlhf",
    title="OpenRLHF 0.11.2",
    display="OpenRLHF",
    launchers=("openrlhf.cli.train_ppo_ray", "train_ppo_ray.py"),
    markers=("--rollout.batch_size", "--train.batch_size"),
    read_command=read,
    strategy_refusal=strategy_refusal,
    emit="batchfit.frameworks.openrlhf_emit",
)
"""OpenRLHF in :mod:`batchfit.frameworks.registry`: its rules apply at ``FrameworkRun.plan``; the whole logits' log-probs;
a bf16 reference (``--ds.param_dtype bf16``, ``launcher.py``)."""
