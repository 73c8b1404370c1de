"""What a framework config asks for: the batch layout, and the run that ``profile`` needs to measure."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from batchfit.errors import BatchConfigError
from batchfit.frameworks.your_sizes import YourSize
from batchfit.plan.config import BatchConfig, BatchPlan
from batchfit.plan.placement import RolloutEngine
from batchfit.validation import is_int, short_repr

#: How a pass computes entropy over the vocabulary (the values of :attr:`RunConfig.entropy`).
ENTROPY_MODES = ("none", "full", "chunked", "checkpointed")


@dataclass(frozen=True)
class RunConfig:
    """A SkyRL, verl or flat config read into batchfit's terms.

    Attributes:
        vocabulary: ``"flat"`` or a registered framework's name (:data:`~batchfit.frameworks.VOCABULARIES`).
        batch: the batch sizes, with ``framework`` set to the rules the plan follows.
        model: the policy model (path, hub id or preset), or ``None`` when not given.
        critic_model: the critic model, or ``None`` when the run has no critic.
        reference: the run computes reference log-probs (a KL term).
        max_seq_len: the longest sequence, prompt plus response, or ``None``.
        max_response_len: the longest response (verl ``data.max_response_length``, SkyRL
            ``generator.sampling_params.max_generate_length``, slime
            ``--rollout-max-response-len``), or ``None``; :attr:`response_fraction` is read
            from it.
        strategy: the training strategy as the config names it, or ``None``: verl
            ``fsdp`` (FSDP1, PyTorch's ``FullyShardedDataParallel``), ``fsdp2``
            (``fully_shard``) or ``megatron``; SkyRL ``fsdp`` (``fully_shard``; its
            deprecated ``fsdp2`` means the same) or ``megatron``.
        offload: the sharded parameters live on the CPU (``none`` or ``cpu``).
        reshard_after_forward: FSDP frees each layer's gathered parameters after its forward
            (verl ``actor.fsdp_config.reshard_after_forward``, SkyRL
            ``policy.fsdp_config.reshard_after_forward``), or ``None`` when not given.
        overlap_comm: DeepSpeed ZeRO-1/2's ``overlap_comm`` (two reduce buckets; OpenRLHF ``--ds.overlap_comm``).
        mixed_precision: FSDP's mixed precision as :class:`~batchfit.parallel.Sharding` names it
            (``bf16``: bf16 compute, fp32 reduction; ``none``: compute and reduction in the
            parameters' dtype), read from the policy's ``mixed_precision`` keys (verl
            ``actor.fsdp_config.mixed_precision``, SkyRL ``policy.fsdp_config.mixed_precision``),
            or ``None`` when not given.
        dtype: the dtype the trained models' parameters are stored in (verl
            ``actor.fsdp_config.model_dtype``, fp32 by default; SkyRL always ``fp32``: its policy
            and critic load in fp32 for training), or ``None`` for profile's default.
        reference_dtype: the reference model's (verl ``ref.fsdp_config.model_dtype``, fp32 by
            default; SkyRL ``trainer.bf16``), or ``None`` for profile's default (bf16).
        gradient_checkpointing: activation checkpointing, or ``None`` when not given.
        activation_offload: the layers' saved activations offloaded to the host (verl's
            ``enable_activation_offload``), or ``None`` when not given.
        logprobs_chunk_size: SkyRL's ``trainer.logprobs_chunk_size`` (tokens along the
            sequence per log-prob and entropy chunk).
        remove_padding: the trained policy's micro-batches are packed, padding removed
            (verl ``actor_rollout_ref.model.use_remove_padding``, which the actor's engine
            reads; SkyRL ``trainer.remove_microbatch_padding``, or its deprecated alias
            ``trainer.use_sample_packing``), or ``None`` for a flat config.
        critic_remove_padding: the same for the critic (verl ``critic.model.use_remove_padding``;
            SkyRL's key is common to every model), ``None`` without a critic.
        fused_kernels: the policy's log-probs (and entropy) come from the framework's fused
            kernels instead of the logits (verl ``actor_rollout_ref.model.use_fused_kernels``;
            SkyRL ``trainer.fused_lm_head_logprob``, Megatron only).
        entropy: how the policy's trained pass computes entropy over the vocabulary, one of
            :data:`ENTROPY_MODES`. verl 0.9.1 (``engine/fsdp/transformer_impl.py``
            ``prepare_model_outputs``): computed when ``actor.calculate_entropy`` or
            ``actor.entropy_coeff != 0`` (``trainer/ppo/v1/trainer_base.py`` ``_update_actor``);
            ``checkpointed`` with ``actor.fsdp_config.entropy_checkpointing``, else ``chunked``
            with ``fsdp_config.entropy_from_logits_with_chunking`` when padding is removed
            (the padded path never chunks), else ``full``; with ``fused_kernels`` the fused
            kernel returns it and these keys are not read (``full`` is reported). SkyRL 0.4.0
            (``workers/worker.py``, ``model_wrapper.py``): always ``chunked``.
        entropy_chunk_size: rows (verl ``fsdp_config.entropy_from_logits_chunk_size``) or
            tokens along the sequence (SkyRL ``logprobs_chunk_size``) per entropy chunk, or
            ``None`` when the entropy is not chunked.
        entropy_chunk_memory_mb: SkyRL's ``trainer.vocab_entropy_chunk_memory_mb`` under Megatron, the
            temporaries an entropy chunk sized from memory may hold (``vocab_entropy_chunk_size: 0``);
            ``None``: not read.
        entropy_grad: the trained pass's entropy keeps its autograd graph (verl: whenever it
            is computed, the pass runs with gradients; SkyRL: ``use_entropy_loss``).
        entropy_in_loss: the entropy is a term of the loss (verl ``actor.entropy_coeff != 0``,
            SkyRL ``trainer.algorithm.use_entropy_loss``), else a metric.
        forward_entropy: how the policy's forward-only log-prob pass computes entropy (verl:
            always, ``_compute_old_log_prob`` asks for it, in the mode the engine's keys
            choose; ``none`` when ``algorithm.rollout_correction.bypass_mode`` skips the pass.
            SkyRL: ``none``).
        temperature: the sampling temperature the logits are divided by (verl
            ``actor_rollout_ref.rollout.temperature``; SkyRL ``trainer.algorithm.temperature``,
            which defaults to ``generator.sampling_params.temperature``).
        lora: the policy's LoRA adapters, ``{"rank", "alpha", "target_modules",
            "exclude_modules"}``, or ``None`` (rank 0 or absent). verl FSDP:
            ``actor_rollout_ref.model.lora_rank``, ``lora_alpha``, ``target_modules``,
            ``exclude_modules`` (Megatron: ``actor_rollout_ref.model.lora.*``); SkyRL:
            ``trainer.policy.model.lora.rank``, ``alpha``, ``target_modules``, ``exclude_modules``.
        critic_lora: the critic's, in the same form (verl ``critic.model.lora_rank``, ...;
            SkyRL ``trainer.critic.model.lora.*``), or ``None``.
        colocated: the models (``policy``, ``critic``, ``reference``) that share the GPUs,
            so that one runs while the others' state stays on the device.
        resident: per colocated model, the state it keeps on the device while another
            model runs (``parameters``, ``optimizer_state``); what the framework offloads
            between phases is left out.
        generation_resident: per model, the state it keeps on the device while a colocated
            rollout engine generates (``parameters``, ``optimizer_state``): what the engine's
            awake share must leave room for (:func:`batchfit.budget.engine.check_awake_phase`).
        engine: the rollout engine and how it shares the trainer's GPUs
            (:class:`~batchfit.budget.engine.RolloutEngine`), or ``None`` when the config has none.
        allocator: the allocator setting the framework runs its trainer with
            (:data:`~batchfit.memory.cuda_untracked.ALLOCATORS`), or ``None`` when it does not say.
        optimizer_offload: the trained models' optimizer state leaves the device outside their
            update (verl's ``optimizer_offload``): their forward-only passes run without it.
        megatron_sequence_parallel: under ``strategy="megatron"``, Megatron's sequence parallelism
            (activations outside attention split over the tensor-parallel group: slime's
            ``--sequence-parallel``, verl's ``megatron.sequence_parallel``).
        distributed_optimizer: under ``strategy="megatron"``, the optimizer state sharded over data
            parallel (``--use-distributed-optimizer``, ``megatron.use_distributed_optimizer``).
        virtual_pipeline_parallel: under ``strategy="megatron"``, model chunks per pipeline stage
            (the interleaved schedule: verl's ``megatron.virtual_pipeline_model_parallel_size``), or
            ``None`` when the config sets none.
        expert_tensor_parallel: under Megatron, the config's ``expert_tensor_parallel_size`` (verl,
            SkyRL); ``None``: Megatron's default, the tensor-parallel size.
        first_pipeline_stage_layers, last_pipeline_stage_layers: under Megatron, the layers of the
            pipeline's first and last stage (slime's ``--decoder-first-pipeline-num-layers`` /
            ``--decoder-last-pipeline-num-layers``, Megatron's ``num_layers_in_first/last_pipeline_stage``);
            ``None``: an even split.
        optimizer_cpu_offload, optimizer_offload_fraction: under Megatron, its ``HybridDeviceOptimizer``
            (``optimizer_cpu_offload``) and the share it moves to the host (Megatron-LM's default 1.0).
        precision_aware_optimizer, optimizer_dtypes: under Megatron, its precision-aware optimizer and the
            dtypes the config sets (``{"exp_avg_dtype": "bf16", ...}``, :class:`Sharding`'s field names).
        megatron_router: under Megatron, the router settings the config sets, as ``TransformerConfig`` fields
            (slime's ``--moe-aux-loss-coeff`` …: NOTE [ Megatron's router settings ] in
            :mod:`batchfit.budget.options`); ``{}``: none, the model's own mapping.
        expert_parallel: ranks each MoE layer's experts are spread over (prime-rl's
            ``trainer.model.ep``; 1: none), as :class:`~batchfit.parallel.Sharding` reads it.
        token_bucket: the framework pads each packed micro-batch up to a multiple of this many
            tokens (verl's ``pad_to_length`` with ``pad_to_length_bucket``), or ``None``: emitted
            token lengths are rounded down to a multiple of it.
        faults: the framework's own rules that the config breaks (beyond the batch plan's).
        warnings: what the config sets that batchfit does not model or the framework would
            refuse outside its batch rules (keys not in the framework's schema, settings that
            change memory); :meth:`plan` adds them to the plan's warnings.
        notes: what reading the config assumed (a launch script's shell variables, flags not seen).
        source: batchfit's terms → the config keys they were read from (for messages).
        key_names: :class:`BatchConfig` field → the framework's key, so that the plan's
            faults and warnings name the keys the user wrote.
        configured: what the config bounds each pass's micro-batches by (a token count or a
            number of sequences, :class:`~batchfit.frameworks.your_sizes.YourSize`), put beside
            batchfit's budgets in ``--emit`` comments and ``--json``
            (:func:`~batchfit.frameworks.your_sizes.compare`).
    """

    vocabulary: str
    batch: BatchConfig
    model: str | None = None
    critic_model: str | None = None
    reference: bool = False
    max_seq_len: int | None = None
    max_response_len: int | None = None
    strategy: str | None = None
    offload: str = "none"
    reshard_after_forward: bool | None = None
    mixed_precision: str | None = None
    overlap_comm: bool = False
    dtype: str | None = None
    reference_dtype: str | None = None
    gradient_checkpointing: bool | None = None
    activation_offload: bool | None = None
    logprobs_chunk_size: int | None = None
    remove_padding: bool | None = None
    critic_remove_padding: bool | None = None
    fused_kernels: bool = False
    entropy: str = "none"
    entropy_chunk_size: int | None = None
    entropy_chunk_memory_mb: int | None = None
    entropy_grad: bool = False
    entropy_in_loss: bool = False
    forward_entropy: str = "none"
    temperature: float | None = None
    lora: dict[str, Any] | None = field(default=None, compare=False)
    critic_lora: dict[str, Any] | None = field(default=None, compare=False)
    colocated: tuple[str, ...] = ()
    resident: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)
    generation_resident: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)
    engine: RolloutEngine | None = None
    allocator: str | None = None
    optimizer_offload: bool = False
    megatron_sequence_parallel: bool = False
    distributed_optimizer: bool = False
    virtual_pipeline_parallel: int | None = None
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    first_pipeline_stage_layers: int | None = None
    last_pipeline_stage_layers: int | None = None
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    precision_aware_optimizer: bool = False
    optimizer_dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
    megatron_router: dict[str, Any] = dataclasses.field(default_factory=dict)
    token_bucket: int | None = None
    faults: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    source: dict[str, str] = field(default_factory=dict, compare=False)
    key_names: dict[str, str] = field(default_factory=dict, compare=False)
    configured: tuple[YourSize, ...] = field(default=(), compare=False)

    @property
    def response_fraction(self) -> float | None:
        """The longest sequence's share of response tokens, ``max_response_len / max_seq_len``, or ``None``.

        What a response-only head's budget assumes of a micro-batch when no share is given
        (NOTE [ A budget in two dimensions ] in :mod:`batchfit.budget.budget_search`).
        """
        if not self.max_seq_len or not self.max_response_len or self.max_response_len > self.max_seq_len:
            return None
        return self.max_response_len / self.max_seq_len

    @property
    def models(self) -> dict[str, str | None]:
        """Each model role the run has → its model (the reference is the policy's model)."""
        out: dict[str, str | None] = {"policy": self.model}
        if self.critic_model:
            out["critic"] = self.critic_model
        if self.reference:
            out["reference"] = self.model
        return out

    @property
    def world_size(self) -> int:
        """GPUs of the policy (``world_size``, or ``num_nodes × gpus_per_node``, default 1)."""
        cfg = self.batch
        if cfg.world_size is not None:
            return cfg.world_size
        return (cfg.num_nodes or 1) * (cfg.gpus_per_node or 1)

    def plan(self, *, strict: bool = False) -> BatchPlan:
        """The batch plan under the framework's rules, with the config's own faults and warnings.

        Args:
            strict: the plan's warnings (a layout the framework runs with waste) are faults;
                the config's own :attr:`warnings` (unmodelled settings, unknown keys) stay
                warnings.

        Returns:
            The :class:`BatchPlan`, its warnings in the framework's words followed by
            :attr:`warnings`.

        Raises:
            BatchConfigError: every fault at once: the framework rules the config breaks
                (:attr:`faults`) and the plan's (with ``strict``, its warnings too).
        """
        faults = list(self.faults)
        try:
            plan = self.batch.plan(strict=strict)
        except BatchConfigError as exc:
            faults.extend(self.in_own_words(f) for f in exc.faults)
            plan = None
        if faults or plan is None:
            raise BatchConfigError(_unique(faults))
        warnings = [self.in_own_words(w) for w in plan.warnings] + list(self.warnings)
        return dataclasses.replace(plan, warnings=tuple(_unique(warnings)))

    def in_own_words(self, message: str) -> str:
        """``message`` with batchfit's field names replaced by the framework's keys."""
        if not self.key_names:
            return message
        names = sorted(self.key_names, key=len, reverse=True)
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?![\w])")
        return pattern.sub(lambda m: self.key_names[m.group(1)], message)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def is_positive_int(value: Any) -> bool:
    """``value`` is an ``int`` (not a ``bool``) above 0: a count a framework's config may hold."""
    return is_int(value) and value > 0


def int_product(a: Any, b: Any) -> Any:
    """``a × b`` for two ints (a zero or negative product is left to the rules to report), else ``None``."""
    return a * b if is_int(a) and is_int(b) else None


def positive_int_faults(counts: Mapping[str, Any]) -> tuple[str, ...]:
    """One fault per count (named as the framework names it) that is not a positive integer."""
    return tuple(f"{name}={value!r} must be a positive integer" for name, value in counts.items() if not is_positive_int(value))


def megatron_layout_fields(mcore: Mapping[str, Any] | None) -> dict[str, Any]:
    """A reader's Megatron layout (its ``sp``, ``distributed_optimizer``, ``ep`` and, where the framework has
    them, ``vpp``, ``first``/``last`` stage layers, ``etp``, ``offload``/``offload_fraction``, ``precision_aware`` and
    ``optimizer_dtypes``) as :class:`RunConfig` fields; ``{}`` for a run without Megatron."""
    if mcore is None:
        return {}
    return {
        "megatron_sequence_parallel": mcore["sp"],
        "distributed_optimizer": mcore["distributed_optimizer"],
        "virtual_pipeline_parallel": mcore.get("vpp"),
        "expert_parallel": mcore["ep"],
        # where the framework carries them: Megatron's uneven first/last stages, its optimizer offload and the
        # precision-aware optimizer with its dtypes (Sharding's field names)
        **{field: mcore[key] for key, field in _MCORE_OPTIONAL.items() if mcore.get(key) is not None},
    }


#: A reader's optional Megatron keys → :class:`RunConfig` fields (:func:`megatron_layout_fields`).
_MCORE_OPTIONAL = {
    "first": "first_pipeline_stage_layers",
    "last": "last_pipeline_stage_layers",
    "etp": "expert_tensor_parallel",
    "offload": "optimizer_cpu_offload",
    "offload_fraction": "optimizer_offload_fraction",
    "precision_aware": "precision_aware_optimizer",
    "optimizer_dtypes": "optimizer_dtypes",
}


def as_int(value: Any) -> Any:
    """``"1024"`` → 1024 (CLI overrides and YAML strings); other values unchanged.

    The one place a config's or a flag's string becomes an integer: only an optional ``-`` and
    ASCII digits (``_`` between digits, as Python writes ``1_024``) convert; anything else
    (``"--5"``, ``"1e3"``, ``"٣"``) and a string of more digits than any count has
    (:data:`batchfit.fileio.MAX_INT_DIGITS`; Python refuses to convert 4,300) stays a string,
    for the plan to refuse by name.

    >>> as_int("1_024"), as_int(" -3 "), as_int("--5"), as_int(7)
    (1024, -3, '--5', 7)
    """
    from batchfit.fileio import MAX_INT_DIGITS

    if isinstance(value, str):
        text = value.strip()
        if _INTEGER.fullmatch(text) and sum(c.isdigit() for c in text) <= MAX_INT_DIGITS:
            return int(text)
    return value


_INTEGER = re.compile(r"-?[0-9]+(?:_[0-9]+)*")


def size_faults(flat: Mapping[str, Any], suffixes: tuple[str, ...], title: str, what: str) -> list[str]:
    """A fault per key of ``flat`` ending in one of ``suffixes`` whose value is set but not an integer >= 1.

    GPU counts and parallel sizes divide or multiply into the world size: ``0`` divides by
    zero, and two negative factors would multiply into a plausible count.

    Args:
        flat: the resolved config, flattened.
        suffixes: the key endings that hold a size (``"_num_nodes"``, ``"ulysses_sequence_parallel_size"``).
        title: the framework and version, e.g. ``"verl 0.9.1"``.
        what: what the size counts, for the message (``"GPUs, nodes and parallel sizes"``).
    """
    faults = []
    for key, value in flat.items():
        if not key.endswith(suffixes) or value is None:
            continue
        number = as_int(value)
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            faults.append(
                f"{key}={short_repr(value)} must be an integer >= 1 ({what} count from 1 in {title}); set it to 1 "
                "or more"
            )
    return faults


_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
}


def dtype_name(value: Any) -> str | None:
    """A config's dtype as ``"fp32"``, ``"bf16"`` or ``"fp16"`` (verl's and SkyRL's ``PrecisionType`` spellings,
    ``torch.`` prefix allowed); ``None`` for ``None`` or anything else.

    >>> dtype_name("bfloat16"), dtype_name("torch.float32"), dtype_name(None)
    ('bf16', 'fp32', None)
    """
    if not isinstance(value, str):
        return None
    return _DTYPE_NAMES.get(value.strip().lower().removeprefix("torch."))


def differing_warnings(
    flat: Mapping[str, Any], pairs: Mapping[str, str], who: str, whose: str, title: str
) -> list[str]:
    """One warning per key of another model whose value differs from the policy's key it pairs with.

    batchfit profiles every model of a run with one sharding, precision and checkpointing
    setting, the policy's; a critic or reference configured otherwise is not what was profiled.

    Args:
        flat: the resolved config, flattened (defaults merged).
        pairs: the other model's key → the policy's key.
        who: the other model, for the message (``"the critic"``).
        whose: the policy's, for the message (``"the actor's"``).
        title: the framework and version (``"verl 0.9.1"``).
    """
    out = []
    for key, policy_key in pairs.items():
        mine, theirs = flat.get(key), flat.get(policy_key)
        if as_bool(mine) == as_bool(theirs) or (dtype_name(mine) is not None and dtype_name(mine) == dtype_name(theirs)):
            continue
        out.append(
            f"{key}={short_repr(mine)} differs from {whose} {policy_key}={short_repr(theirs)}: batchfit profiles "
            f"{who} with {whose} setting ({title}); set them alike, or confirm {who}'s on the device (profile --confirm)"
        )
    return out


def as_bool(value: Any) -> Any:
    """``"true"``/``"false"`` (and yes/no/1/0) → bool; other values unchanged."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.strip().lower() in ("true", "yes", "1")
    return value


def _unique(messages: list[str]) -> list[str]:
    """``messages`` without repeats, in order (two rules can word one fault alike)."""
    return list(dict.fromkeys(messages))


def unmodelled_warnings(
    given: Mapping[str, Any], defaults: Mapping[str, Any], unmodelled: Mapping[str, str], title: str
) -> list[str]:
    """One warning per memory-affecting key the user's file sets away from the framework's default.

    Args:
        given: the user's own keys (flattened, resolved), not the defaults merged under them.
        defaults: the framework's defaults (flattened, resolved).
        unmodelled: key → what it changes in memory, for the keys batchfit's probe does not
            reproduce (the framework modules' ``UNMODELLED`` tables); ``"section.*"`` stands
            for every key below an open section.
        title: the framework and version (``"verl 0.9.1"``), for the message.

    Returns:
        Messages naming the key, its value, the default and what the budgets leave out.
    """
    out = []
    for pattern, what in unmodelled.items():
        if pattern.endswith(".*"):
            keys = [k for k in given if k.startswith(pattern[:-1])]
        else:
            keys = [pattern] if pattern in given else []
        for key in keys:
            if given[key] == defaults.get(key):
                continue
            out.append(
                f"{key}={short_repr(given[key])} (the {title} default is {defaults.get(key)!r}) changes memory in a way "
                f"batchfit's budgets do not model: {what}; profile with the default, or confirm this setting on "
                "the device (profile --confirm)"
            )
    return out


def every_fault(run: RunConfig, first: list[str]) -> NoReturn:
    """Raise ``first`` (faults of the config's keys) with every other fault of ``run``: its own and its plan's.

    Raises:
        BatchConfigError: always.
    """
    faults = list(first)
    try:
        run.plan()
    except BatchConfigError as exc:
        faults.extend(exc.faults)
    raise BatchConfigError(_unique(faults))
