"""AReaL's YAML config (``actor.*``, ``ref.*``, ``critic.*``, ``gconfig.*``, ``train_dataset.*``) in batchfit's terms.

Mirrors inclusionAI/AReaL at commit 4aef98d8 (2026-05-21): the dataclasses of
``areal/api/cli_args.py`` (``GRPOConfig`` and what it nests: defaults and key vocabulary in
``defaults/areal.yaml`` and ``defaults/areal_schema.json``, generated as docs/frameworks_areal.md
says), ``areal/api/alloc_mode.py`` (the per-engine ``backend`` strings), ``areal/trainer/rl_trainer.py``
(which passes run), ``areal/trainer/ppo/actor.py`` (``_ppo_update``: the mini-batches),
``areal/infra/controller/train_controller.py`` (``_dispatch_tensors``: the data-parallel split) and
``areal/utils/data.py`` / ``areal/utils/seqpack.py`` (``split_padded_tensor_dict_into_mb_list``,
``ffd_allocate``, ``pad_mb_list``: the micro-batches). Each rule in :func:`rules` cites its code.

Units: ``train_dataset.batch_size`` counts prompts per step, each sampled ``gconfig.n_samples``
times; ``actor.ppo_n_minibatches`` is a **count** of mini-batches (one optimizer step each), cut
from each data-parallel rank's share balanced by tokens, not along prompt boundaries;
``actor.mb_spec.max_tokens_per_mb`` is a hard cap on the valid tokens of one packed micro-batch
(before a Ulysses split), ``n_mbs`` the least number of micro-batches, ``n_mbs_divisor`` what that
number is rounded up to a multiple of, ``granularity`` how many adjacent sequences stay together.
The batch rules are the run's (:class:`~batchfit.frameworks.flags.FrameworkRun`), as OpenRLHF's
and slime's, over batchfit's exact splits.
"""

from __future__ import annotations

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
    unmodelled_warnings,
)
from batchfit.frameworks.source import flatten, framework_defaults, framework_schema
from batchfit.frameworks.your_sizes import YourSize
from batchfit.plan.config import BatchConfig
from batchfit.plan.placement import ENGINES, RolloutEngine
from batchfit.validation import short_repr

__all__ = ["SPEC", "Backend", "parse_backend", "read", "rules"]

TITLE = "AReaL 4aef98d8"
#: ``areal/utils/data.py`` ``N_TOKENS_PER_PAGE``: ``pad_mb_list`` pads each packed micro-batch up to a multiple of it.
PAGE_TOKENS = 256
#: ``areal/utils/data.py`` ``DEFAULT_MAX_TOKENS_PER_MB``: the cap ``split_padded_tensor_dict_into_mb_list`` uses when none is set.
NO_CAP = 10**12

# Keys that change memory in ways batchfit's budgets do not reproduce (a warning when set away from
# AReaL's default). Modelled, so not listed: mb_spec, gradient_checkpointing, dtype, grad_reduce_dtype,
# fsdp.offload_params, use_lora/lora_rank/lora_alpha/target_modules, backend.
UNMODELLED: dict[str, str] = {
    "actor.enable_tree_training": "tree attention over shared prefixes (flex attention; batchfit packs rows)",
    "actor.fsdp.per_layer_optim_step": "the optimizer state streamed from the host layer by layer",
    "actor.fsdp.wrap_policy.*": "how the model is wrapped into FSDP units (batchfit wraps each decoder layer)",
    "actor.attn_impl": "another attention kernel than flash_attention_2 (batchfit runs sdpa on packed rows)",
    "actor.pad_to_maximum": "each micro-batch padded to max_tokens_per_mb (the budget then holds the padding)",
}


class Backend:
    """One engine's ``backend`` string (``areal/api/alloc_mode.py`` ``ModelAllocation.from_str``): ``fsdp:d4c2``.

    Attributes:
        name: ``fsdp``, ``megatron``, ``archon`` (training), ``sglang``, ``vllm`` (inference), or the text as given.
        sizes: dimension letter (``d`` data, ``t`` tensor, ``p`` pipeline, ``c`` context, ``e`` expert) → size.
        fault: why the string does not parse, or ``""``.
    """

    def __init__(self, name: str, sizes: dict[str, int], fault: str = ""):
        self.name, self.sizes, self.fault = name, sizes, fault

    def size(self, letter: str) -> int:
        return self.sizes.get(letter, 1)

    @property
    def world(self) -> int:
        """``ParallelStrategy.world_size``: d × t × p × c (experts redistribute, they add no GPUs)."""
        return self.size("d") * self.size("t") * self.size("p") * self.size("c")


_DIMS = re.compile(r"([dtpce])(\d+)")


def parse_backend(key: str, value: Any) -> Backend:
    """``value`` of ``key`` as a :class:`Backend`; a string without a backend prefix or with an unknown
    dimension is a fault (AReaL: "An explicit backend prefix is always required", ``_LLMParallelParser``)."""
    if not isinstance(value, str) or ":" not in value:
        return Backend(
            str(value),
            {},
            f"{key}={short_repr(value)} needs a backend prefix and dimensions, such as 'fsdp:d8' ({TITLE} "
            "ModelAllocation.from_str requires one); write it so",
        )
    name, _, dims = value.strip().partition(":")
    if dims.startswith("("):  # megatron:(attn:...|ffn:...): MoE hybrid parallelism, Megatron and Archon only
        return Backend(name, {}, "" if name in ("megatron", "archon") else f"{key}={value!r}: hybrid dimensions are for megatron or archon")
    if _DIMS.sub("", dims) or not dims:
        return Backend(
            name,
            {},
            f"{key}={value!r}: dimensions are letters d, t, p, c, e each followed by a size, such as 'fsdp:d4c2' "
            f"({TITLE} alloc_mode.py); fix it",
        )
    sizes = {letter: int(n) for letter, n in _DIMS.findall(dims)}
    if any(n < 1 for n in sizes.values()):
        return Backend(name, sizes, f"{key}={value!r}: every size must be 1 or more")
    if name == "fsdp" and (sizes.get("p", 1) > 1 or sizes.get("e", 1) > 1):
        # ModelAllocation.__post_init__
        return Backend(name, sizes, f"{key}={value!r}: the FSDP backend only supports data/tensor/context parallelism ({TITLE} ModelAllocation raises)")
    return Backend(name, sizes)


def _engine_value(flat: dict[str, Any], role: str, key: str) -> Any:
    """``<role>.<key>``: the role's value, else the dataclass default (AReaL builds ``ref`` and ``critic`` from
    ``PPOActorConfig``/``PPOCriticConfig`` when the YAML gives the section; their shared fields' defaults are the actor's)."""
    value = flat.get(f"{role}.{key}")
    if value is None and f"{role}.{key}" not in flat:
        value = framework_defaults("areal").get(f"actor.{key}")
    return as_int(value)


def _mb_spec(flat: dict[str, Any], role: str) -> dict[str, Any]:
    return {k: _engine_value(flat, role, f"mb_spec.{k}") for k in ("n_mbs", "max_tokens_per_mb", "granularity", "n_mbs_divisor")}


def read(data: dict[str, Any], given: dict[str, Any]) -> FrameworkRun:
    """A resolved AReaL config (its dataclass defaults merged, interpolations resolved) as a :class:`FrameworkRun`.

    Args:
        data: the user's config merged over ``defaults/areal.yaml``, interpolations resolved.
        given: the user's own keys (flattened).

    Raises:
        BatchConfigError: a close misspelling of one of AReaL's keys (OmegaConf's structured merge refuses any
            unknown key at start-up), a backend string that does not parse, with every other fault of the config.
    """
    flat = flatten(data)
    given = {key: flat.get(key, value) for key, value in given.items()}
    schema = framework_schema("areal")
    misspelt, warnings = schema.check_keys(given, ignore=BatchConfig.fields())
    faults: list[str] = []
    notes: list[str] = []

    actor = parse_backend("actor.backend", flat.get("actor.backend"))
    faults += [actor.fault] if actor.fault else []
    has_critic = isinstance(data.get("critic"), dict)
    has_ref = isinstance(data.get("ref"), dict)
    kl = flat.get("actor.kl_ctl")
    # rl_trainer.py: `if config.actor.kl_ctl > 0 and config.ref is not None:` creates the reference engine
    reference = has_ref and isinstance(kl, (int, float)) and kl > 0
    if has_ref and not reference:
        notes.append(
            f"ref is configured but actor.kl_ctl={short_repr(kl)}: AReaL loads no reference model (rl_trainer.py creates "
            "it only when kl_ctl > 0), so no reference pass is profiled"
        )
    critic_model = (flat.get("critic.path") or flat.get("actor.path")) if has_critic else None

    strategy = actor.name
    if actor.name == "fsdp" and actor.size("t") > 1:
        strategy = "fsdp+tp"  # FSDP2 over dp × cp with DTensor tensor parallelism: not modelled (strategy_refusal)
    sp = actor.size("c") if actor.name == "fsdp" else 1

    n = as_int(flat.get("gconfig.n_samples"))
    prompts = as_int(flat.get("train_dataset.batch_size"))
    minibatches = as_int(flat.get("actor.ppo_n_minibatches"))
    spec = _mb_spec(flat, "actor")
    cap = spec["max_tokens_per_mb"]
    samples = int_product(prompts, n)
    dp = actor.world // (actor.size("t") * actor.size("p") * actor.size("c")) if not actor.fault else None
    per_rank = samples // dp if is_positive_int(samples) and is_positive_int(dp) and samples % dp == 0 else None
    # NOTE [ AReaL's mini-batches are a count per rank ]: _ppo_update cuts each rank's share into ppo_n_minibatches
    # mini-batches balanced by tokens; where the share does not divide by the count they are unequal, which batchfit's
    # exact splits cannot hold, so the plan checks the step as one mini-batch (rules warns)
    unequal = is_positive_int(per_rank) and is_positive_int(minibatches) and per_rank >= minibatches and per_rank % minibatches != 0
    by_prompt = not unequal and is_positive_int(prompts) and is_positive_int(minibatches) and prompts % minibatches == 0
    if by_prompt or not is_positive_int(samples):
        train, mini, per = prompts, (prompts // minibatches if by_prompt else None), n
    else:
        # AReaL cuts by sequence (each rank's share, balanced by tokens): the plan counts sequences, one per "prompt"
        train, per = samples, 1
        mini = samples if unequal else (samples // minibatches if is_positive_int(minibatches) and samples % minibatches == 0 else None)
        if not unequal:
            notes.append(
                f"train_dataset.batch_size={prompts} is not a multiple of actor.ppo_n_minibatches={minibatches}: AReaL cuts "
                "mini-batches by sequence, balanced by tokens (actor.py _ppo_update), so the plan counts sequences"
            )
    critic_minis = _engine_value(flat, "critic", "ppo_n_minibatches") if has_critic else None
    batch = BatchConfig(
        train_batch_size=train,
        policy_mini_batch_size=mini,
        n_samples_per_prompt=per,
        critic_mini_batch_size=(train // critic_minis if is_positive_int(train) and is_positive_int(critic_minis) and train % critic_minis == 0 else mini)
        if has_critic
        else None,
        max_tokens_per_micro_batch=cap if is_positive_int(cap) else None,
        world_size=actor.world if not actor.fault else None,
        tensor_parallel=actor.size("t"),
        pipeline_parallel=actor.size("p"),
        context_parallel=actor.size("c") if actor.name != "fsdp" else 1,
        sequence_parallel=sp,
        framework="batchfit",  # exact splits; AReaL's own rules are the run's (rules)
    )
    prompt_len = as_int(flat.get("train_dataset.max_length"))
    response = as_int(flat.get("gconfig.max_new_tokens"))
    max_seq_len = prompt_len + response if is_positive_int(prompt_len) and is_positive_int(response) else None
    if max_seq_len is None:
        notes.append(
            "train_dataset.max_length is not set, so the longest sequence is unknown (the OOM guide's max_tokens_per_mb "
            "floor is train_dataset.max_length + gconfig.max_new_tokens); pass --max-seq-len to profile"
        )
    warnings += unmodelled_warnings(given, framework_defaults("areal"), UNMODELLED, TITLE)
    optimizer = flat.get("actor.optimizer.type")
    if optimizer not in (None, "adam"):  # fsdp_engine.py _create_optimizer: adam is torch.optim.AdamW
        warnings.append(
            f"actor.optimizer.type={short_repr(optimizer)} changes memory in a way batchfit's budgets do not model: "
            "adam_bf16 keeps bf16 moments and sgd none, where batchfit profiles AdamW (the budgets are then conservative); "
            "profile with adam, or confirm this setting on the device (profile --confirm)"
        )
    mcore = _megatron(flat, actor, has_critic, reference) if actor.name == "megatron" and not actor.fault else None
    if mcore is not None:
        warnings += mcore["warnings"]
        faults += mcore["faults"]
    precision = "bf16" if dtype_name(flat.get("actor.grad_reduce_dtype")) == "fp32" else "none"
    offload = "cpu" if as_bool(flat.get("actor.fsdp.offload_params")) is True else "none"
    colocated, resident = _placement(flat, reference, offload)
    run = FrameworkRun(
        vocabulary="areal",
        batch=batch,
        model=flat.get("actor.path") or None,
        critic_model=critic_model,
        reference=reference,
        max_seq_len=max_seq_len,
        max_response_len=response if is_positive_int(response) else None,
        strategy=strategy,
        offload=offload,
        # fsdp_utils/parallel.py parallelize_model: reshard_after_forward=True, MixedPrecisionPolicy(param_dtype=dtype,
        # reduce_dtype=grad_reduce_dtype) over parameters loaded in actor.dtype (fsdp_engine.py _create_llm_actor_or_critic)
        reshard_after_forward=True,
        mixed_precision=None if mcore is not None else precision,
        dtype=dtype_name(flat.get("actor.dtype")),
        reference_dtype=dtype_name(_engine_value(flat, "ref", "dtype")) if reference else None,
        gradient_checkpointing=mcore["recompute"] if mcore is not None else as_bool(flat.get("actor.gradient_checkpointing")) is True,
        **megatron_layout_fields(mcore),
        remove_padding=True,  # fsdp_engine.py _prepare_mb_list: every micro-batch is one packed row (pack_tensor_dict)
        critic_remove_padding=True if has_critic else None,
        temperature=flat.get("actor.temperature"),
        lora=_lora(flat),
        colocated=colocated,
        resident=resident,
        generation_resident={},  # colocated with the rollout, rl_trainer.py offloads the actor (_should_offload_actor)
        engine=_engine(flat),
        faults=tuple(faults),
        warnings=tuple(warnings),
        notes=tuple(notes),
        key_names=_key_names(by_prompt),
        source={
            "max_seq_len": "train_dataset.max_length + gconfig.max_new_tokens",
            "world_size": "actor.backend (d × t × p × c)",
            "model": "actor.path",
            "strategy": "actor.backend",
            **(refused_sources(mcore["refused"]) if mcore is not None else {}),
        },
        rules=rules,
        values={
            "n_samples": n,
            "prompts": prompts,
            "ppo_n_minibatches": minibatches,
            "unequal": unequal,
            "critic_ppo_n_minibatches": critic_minis,
            "mb_spec": {"actor": spec, **({"ref": _mb_spec(flat, "ref")} if reference else {}), **({"critic": _mb_spec(flat, "critic")} if has_critic else {})},
            "pad_to_maximum": as_bool(flat.get("actor.pad_to_maximum")) is True,
        },
        configured=_configured(flat, reference, has_critic),
    )
    if misspelt:
        every_fault(run, misspelt)
    return run


def rules(run: FrameworkRun) -> Verdict:
    """AReaL's batch rules on ``run`` (its batch after overrides, its mb_spec per engine)."""
    v, cfg = run.values, run.batch
    samples = int_product(cfg.train_batch_size, cfg.n_samples_per_prompt)
    counts = {
        "train_dataset.batch_size × gconfig.n_samples": samples,
        "actor.ppo_n_minibatches": v.get("ppo_n_minibatches"),
    }
    for role, spec in v.get("mb_spec", {}).items():
        counts.update({f"{role}.mb_spec.{k}": spec[k] for k in ("n_mbs", "granularity", "n_mbs_divisor")})
    if not is_positive_int(run.world_size):
        counts["actor.backend (d × t × p × c)"] = run.world_size
    faults = list(positive_int_faults(counts))
    if faults:
        return Verdict(faults=tuple(faults))
    warnings: list[str] = []
    notes: list[str] = []
    dp = run.world_size // (cfg.tensor_parallel * cfg.pipeline_parallel * cfg.context_parallel * cfg.sequence_parallel)
    minibatches = v["ppo_n_minibatches"]
    if not v.get("unequal") and is_positive_int(cfg.policy_mini_batch_size) and cfg.train_batch_size % cfg.policy_mini_batch_size == 0:
        minibatches = cfg.train_batch_size // cfg.policy_mini_batch_size  # the count after overrides (--policy-mini-batch-size)
    if samples < dp or samples % dp:
        # train_controller.py _dispatch_tensors → seqpack.balanced_greedy_partition(K=dp_size) raises ValueError
        # ("The length of nums must be divisible by K")
        faults.append(
            f"train_dataset.batch_size × gconfig.n_samples = {samples} sequences do not split evenly over the {dp} "
            f"data-parallel ranks of actor.backend (AReaL's balanced_greedy_partition raises ValueError); use a multiple of {dp}"
        )
        return Verdict(faults=tuple(faults))
    per_rank = samples // dp
    if per_rank < minibatches:
        # actor.py _ppo_update: split_padded_tensor_dict_into_mb_list(MicroBatchSpec(n_mbs=ppo_n_minibatches)) →
        # ffd_allocate raises RuntimeError("Number of values ... is smaller than min_groups ...")
        faults.append(
            f"each data-parallel rank holds {per_rank} sequences, fewer than actor.ppo_n_minibatches={minibatches} "
            f"(AReaL's ffd_allocate raises RuntimeError); set actor.ppo_n_minibatches to {per_rank} or fewer"
        )
    if v.get("unequal"):
        warnings.append(
            f"each rank's {per_rank} sequences do not divide into actor.ppo_n_minibatches={minibatches}: AReaL runs "
            f"unequal mini-batches ({per_rank // minibatches} or {-(-per_rank // minibatches)} sequences per rank, balanced "
            "by tokens), which batchfit's exact splits cannot hold, so the plan checks the step as one mini-batch (its "
            f"micro-batches have the same cap); use a divisor of {per_rank} for equal optimizer steps"
        )
    notes.append(
        f"AReaL cuts each rank's {per_rank} sequences into actor.ppo_n_minibatches={minibatches} mini-batches balanced "
        "by tokens, not along prompt boundaries, one optimizer step each (actor.py _ppo_update); the plan's mini-batches "
        "are batchfit's exact split of the same count"
    )
    longest = run.max_seq_len
    for role, spec in v.get("mb_spec", {}).items():
        cap = cfg.max_tokens_per_micro_batch if role == "actor" else spec["max_tokens_per_mb"]
        least = max(spec["n_mbs"], spec["n_mbs_divisor"]) * spec["granularity"]
        # the forward passes split the rank's whole share; the actor's update each mini-batch (≈ per_rank / minibatches)
        share = per_rank // minibatches if role == "actor" else per_rank
        if share < least:
            faults.append(
                f"{role}.mb_spec asks for at least {least} sequences per micro-batch split (max(n_mbs, n_mbs_divisor) × "
                f"granularity) but a split holds about {share} (AReaL's ffd_allocate raises RuntimeError); lower n_mbs"
            )
        if spec["granularity"] > 1 and share % spec["granularity"]:
            # split_padded_tensor_dict_into_mb_list: RuntimeError("Batch size ... cannot divide granularity ...")
            faults.append(
                f"{role}.mb_spec.granularity={spec['granularity']} does not divide the {share} sequences of a split "
                "(AReaL raises RuntimeError); use a divisor"
            )
        if cap is None:
            warnings.append(
                f"{role}.mb_spec.max_tokens_per_mb is not set: AReaL cuts each split into n_mbs={spec['n_mbs']} "
                "micro-batches whatever their tokens (DEFAULT_MAX_TOKENS_PER_MB = 1e12), which no memory bound holds; "
                "set it (batchfit profile --emit areal writes it)"
            )
            continue
        if not is_positive_int(cap):
            faults.append(f"{role}.mb_spec.max_tokens_per_mb={short_repr(cap)} must be a positive integer or null")
            continue
        if is_positive_int(longest) and cap < longest:
            # seqpack.ffd_allocate: RuntimeError("Values ... is larger than capacity ..."); handling_oom.md: "Cannot be
            # set below max_length + max_new_tokens"
            faults.append(
                f"{role}.mb_spec.max_tokens_per_mb={cap} is below the longest sequence, train_dataset.max_length + "
                f"gconfig.max_new_tokens = {longest} tokens: AReaL's ffd_allocate raises RuntimeError on a longer sequence "
                f"(a hard cap; its OOM guide says it cannot be set below that); set it to {longest} or more"
            )
        if cap % PAGE_TOKENS:
            notes.append(
                f"{role}.mb_spec.max_tokens_per_mb={cap} is not a multiple of {PAGE_TOKENS}: AReaL pads each packed "
                f"micro-batch up to a multiple of {PAGE_TOKENS} tokens (data.py pad_mb_list), so one can run "
                f"{-(-cap // PAGE_TOKENS) * PAGE_TOKENS} tokens"
            )
    return Verdict(tuple(faults), tuple(warnings), tuple(notes))


def _placement(flat: dict[str, Any], reference: bool, offload: str) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """The reference shares the actor's GPUs under ``ref.scheduling_strategy: {type: colocation, target: actor}``
    (the example configs'), both kept there unless ``ref.offload`` (rl_trainer.py ``_should_offload_ref``)."""
    if not reference:
        return (), {}
    if flat.get("ref.scheduling_strategy.type") != "colocation" or flat.get("ref.scheduling_strategy.target") != "actor":
        return (), {}
    kept = () if offload == "cpu" else ("parameters", "optimizer_state")
    ref_kept = () if as_bool(flat.get("ref.offload")) is True else ("parameters",)
    return ("policy", "reference"), {"policy": kept, "reference": ref_kept}


def _engine(flat: dict[str, Any]) -> RolloutEngine:
    """The rollout servers (``rollout.backend``): on the actor's GPUs only under colocation scheduling
    (rl_trainer.py ``_is_actor_rollout_colocated``), where AReaL offloads the engine while the actor trains."""
    backend = parse_backend("rollout.backend", flat.get("rollout.backend"))
    name = backend.name if backend.name in ENGINES else "sglang"
    colocated = (
        flat.get("rollout.scheduling_strategy.type") == "colocation" and flat.get("rollout.scheduling_strategy.target") == "actor"
    ) or (flat.get("actor.scheduling_strategy.type") == "colocation" and flat.get("actor.scheduling_strategy.target") == "rollout")
    fraction = flat.get("sglang.mem_fraction_static") if name == "sglang" else flat.get("vllm.gpu_memory_utilization")
    return RolloutEngine(
        name=name,
        colocated=colocated,
        tensor_parallel=backend.size("t") * backend.size("p"),
        memory_fraction=fraction,
        sleeps=colocated,
        own_process=True,
        keys={
            "tensor_parallel": "rollout.backend",
            "memory_fraction": "sglang.mem_fraction_static" if name == "sglang" else "vllm.gpu_memory_utilization",
        },
    )


def _lora(flat: dict[str, Any]) -> dict[str, Any] | None:
    """The actor's LoRA (``use_lora``, ``lora_rank``, ``lora_alpha``, ``target_modules``), ``None`` without."""
    if as_bool(flat.get("actor.use_lora")) is not True:
        return None
    return {
        "rank": as_int(flat.get("actor.lora_rank")),
        "alpha": flat.get("actor.lora_alpha"),
        "target_modules": flat.get("actor.target_modules") or "all-linear",
        "exclude_modules": None,
    }


def _configured(flat: dict[str, Any], reference: bool, critic: bool) -> tuple[YourSize, ...]:
    """What each engine's mb_spec bounds its passes by (the actor's update and recomputed log-probs share the actor's)."""
    out = []
    roles = [("policy", "actor"), ("policy_forward", "actor")]
    roles += [("reference", "ref")] if reference else []
    roles += [("critic", "critic"), ("critic_forward", "critic")] if critic else []
    for role, engine in roles:
        cap = _engine_value(flat, engine, "mb_spec.max_tokens_per_mb")
        if is_positive_int(cap):
            # counted before the Ulysses split (fsdp_engine.py slices the packed row over the sp group afterwards)
            out.append(YourSize(role, f"{engine}.mb_spec.max_tokens_per_mb", cap, "tokens", per_gpu=False))
    return tuple(out)


def _key_names(by_prompt: bool) -> dict[str, str]:
    return {
        "train_batch_size": "train_dataset.batch_size" if by_prompt else "train_dataset.batch_size × gconfig.n_samples",
        "n_samples_per_prompt": "gconfig.n_samples",
        "policy_mini_batch_size": "train_dataset.batch_size / actor.ppo_n_minibatches"
        if by_prompt
        else "(train_dataset.batch_size × gconfig.n_samples) / actor.ppo_n_minibatches",
        "critic_mini_batch_size": "train_dataset.batch_size / critic.ppo_n_minibatches",
        "max_tokens_per_micro_batch": "actor.mb_spec.max_tokens_per_mb",
        "world_size": "actor.backend (d × t × p × c)",
        "sequence_parallel": "actor.backend's c (Ulysses)",
        "tensor_parallel": "actor.backend's t",
        "pipeline_parallel": "actor.backend's p",
        "context_parallel": "actor.backend's c",
    }


# NOTE [ AReaL's Megatron backend ]
# actor.backend "megatron:d…t…p…c…e…" trains with areal/engine/megatron_engine.py (4aef98d8): mbridge builds the model
# in actor.dtype, with Megatron's sequence parallelism whenever tensor parallelism is on
# (_make_parallel_strategy: use_sequence_parallel=tensor_parallel_size > 1), actor.megatron.virtual_pipeline_parallel_size
# model chunks per stage (1: none), and under actor.gradient_checkpointing the recompute of actor.megatron (full,
# uniform, 1 layer by default: batchfit's full recompute). Megatron's DDP and optimizer take actor.megatron.ddp
# (grad_reduce_in_fp32 and use_distributed_optimizer both true by default; LoRA turns the distributed optimizer off)
# and use_precision_aware_optimizer (false; adam_bf16 turns it on: _normalize_adam_bf16_config). cli_args.py
# MegatronEngineConfig and DistributedDataParallelConfig hold the defaults. Profiled as Sharding("megatron").

#: actor.megatron keys batchfit's Megatron profile does not reproduce: key → (the value profiled, what is left out).
_MEGATRON_UNMODELLED: dict[str, tuple[Any, str]] = {
    "actor.megatron.ddp.grad_reduce_in_fp32": (True, "a bf16 gradient buffer (batchfit's Megatron profile keeps it fp32)"),
    "actor.megatron.use_torch_fsdp2": (False, "Megatron's torch FSDP2 wrapper"),
    "actor.megatron.use_custom_fsdp": (False, "Megatron's custom FSDP"),
    "actor.megatron.recompute_modules": (None, "selective recompute's modules"),
}


def _megatron(flat: dict[str, Any], actor: Backend, critic: bool, reference: bool) -> dict[str, Any]:
    """What ``profile`` reads of the actor's Megatron engine (NOTE [ AReaL's Megatron backend ]): the layout, the
    recompute, the warnings and faults of what it does not model, and the settings it refuses."""
    m = "actor.megatron."
    warnings: list[str] = []
    faults: list[str] = []
    refused: dict[str, str] = {}
    if not actor.sizes:
        faults.append(
            f"actor.backend={short_repr(flat.get('actor.backend'))}: hybrid (attn|ffn) Megatron layouts are not modelled "
            "by batchfit; write the backend as megatron:d…t…p…c…e…"
        )
    for key, (modelled, what) in _MEGATRON_UNMODELLED.items():
        value = flat.get(key)
        if value is not None and value != modelled:
            warnings.append(f"{key}={short_repr(value)} is not modelled: {what}; {TITLE}'s default is {short_repr(modelled)}")
    # use_precision_aware_optimizer and its dtypes (cli_args.py MegatronEngineConfig, "float32" by default), read;
    # adam_bf16 turns it on with bf16 moments (megatron_engine.py _normalize_adam_bf16_config)
    adam_bf16 = flat.get("actor.optimizer.type") == "adam_bf16"
    precision_aware = adam_bf16 or as_bool(flat.get(m + "use_precision_aware_optimizer")) is True
    dtypes = {
        name: dtype_name(flat.get(m + name)) or flat.get(m + name)
        for name in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        if flat.get(m + name) is not None
    }
    if adam_bf16:
        dtypes.update(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    checkpointing = as_bool(flat.get("actor.gradient_checkpointing")) is True
    recompute = (flat.get(m + "recompute_granularity"), flat.get(m + "recompute_method"), as_int(flat.get(m + "recompute_num_layers")))
    full = recompute == ("full", "uniform", 1)
    if checkpointing and not full:
        warnings.append(
            f"actor.megatron recompute {recompute} is not batchfit's full recompute (full, uniform, 1 layer): profiled "
            "without recompute (more activations than the run keeps)"
        )
    if as_bool(flat.get("actor.use_lora")) is True:
        refused["lora"] = "actor.use_lora=True"
    if critic:
        refused["critic"] = "critic (a section)"
    if reference and flat.get("ref.backend") not in (None, flat.get("actor.backend")):
        warnings.append(
            f"ref.backend={short_repr(flat.get('ref.backend'))} differs from actor.backend: batchfit profiles the "
            "reference laid out as the actor"
        )
    vpp = as_int(flat.get(m + "virtual_pipeline_parallel_size"))
    return {
        "sp": actor.size("t") > 1,
        "distributed_optimizer": as_bool(flat.get(m + "ddp.use_distributed_optimizer")) is not False,
        "vpp": vpp if is_positive_int(vpp) and vpp > 1 else None,
        "ep": actor.size("e"),
        "precision_aware": precision_aware,
        "optimizer_dtypes": {k: v for k, v in dtypes.items() if v != "fp32"} if precision_aware else None,
        "recompute": checkpointing and full,
        "warnings": warnings,
        "faults": faults,
        "refused": refused,
    }


_REFUSAL_WHY = {
    "lora": ("trains Megatron LoRA adapters, which batchfit's Megatron profile does not model", "set it to false, or train LoRA with actor.backend fsdp:…"),
    "critic": ("trains a critic beside the Megatron actor, which batchfit's Megatron profile does not model", "profile a critic-free run, or the run with --sharding fsdp2"),
}


def strategy_refusal(run: Any) -> str | None:
    """Why ``profile`` cannot model AReaL's Archon backend, or FSDP with tensor parallelism, and the flag that
    approximates it, or what it does not model of a Megatron run (LoRA, a critic: NOTE [ What a Megatron profile
    refuses ]); ``None`` for FSDP over data and context (Ulysses) parallelism, and for a modelled Megatron run."""
    if run.strategy == "fsdp":
        return None
    if run.strategy == "megatron":
        return first_refusal(run, _REFUSAL_WHY)
    cfg = run.batch
    what = {
        "fsdp+tp": f"FSDP2 with DTensor tensor parallelism (t={cfg.tensor_parallel})",
        "megatron": f"Megatron-core (tensor {cfg.tensor_parallel} × pipeline {cfg.pipeline_parallel} × context {cfg.context_parallel})",
        "archon": f"Archon, AReaL's torchtitan-style engine (tensor {cfg.tensor_parallel} × pipeline {cfg.pipeline_parallel} × context {cfg.context_parallel})",
    }.get(run.strategy, f"the {run.strategy!r} backend")
    return (
        f"actor.backend trains with {what}, which batchfit does not model; pass --sharding fsdp2 to profile FSDP2 over the "
        "same GPUs instead (an approximation: FSDP2 shards parameters and gradients that tensor and pipeline parallelism "
        "split per group, and holds whole activations that tensor parallelism splits)"
    )


SPEC = FrameworkSpec(
    name="areal",
    title=TITLE,
    display="AReaL",
    markers=("actor.mb_spec", "actor.ppo_n_minibatches", "gconfig", "actor.backend"),
    read_config=read,
    strategy_refusal=strategy_refusal,
    # areal/utils/functional/vocab_parallel.py gather_logprobs(_entropy): log_softmax of logits.float() per 1024-token
    # chunk (compiled); batchfit's full head (fp32 log_softmax of the whole micro-batch) bounds it from above
    head="full",
    reference_dtype="bf16",  # TrainEngineConfig.dtype: bfloat16
    emit="batchfit.frameworks.areal_emit",
)
"""AReaL in :mod:`batchfit.frameworks.registry`: its rules apply at ``FrameworkRun.plan``; the whole logits' log-probs."""
