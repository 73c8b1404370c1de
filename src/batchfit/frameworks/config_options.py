"""A framework config's profile: :func:`run_profile_options` turns a :class:`RunConfig` into :class:`ProfileOptions`.

A caller (the command line) says which settings it chose (a :class:`~batchfit.budget.choices.Choices`);
the config sets the rest as its framework runs them (the sharding its training strategy means, the
offload, FSDP's options, checkpointing, the framework's own log-prob head and micro-batch cost); the caller's defaults fill what neither sets. Every fact about how a
framework's config reads as a profile lives here: which sharding models a training strategy
(:func:`sharding_strategy`), the keys its GPU counts come from (its spec's ``gpu_keys``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchfit.budget.choices import Choices
from batchfit.budget.options import ProfileOptions
from batchfit.errors import KEYWORDS, BatchConfigError, InvalidArgument, Phrase, Setting, Vocabulary
from batchfit.frameworks.registry import framework_of, get_framework
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import with_run_fraction
from batchfit.parallel.sharding import FSDP_STRATEGIES, MODEL_PARALLEL_STRATEGIES, STRATEGIES, ZERO_STRATEGIES
from batchfit.validation import check_choice, is_int, short_repr

__all__ = [
    "RunOptions",
    "as_data_parallel",
    "check_emit_plan",
    "check_run_settings",
    "modelled_strategy",
    "run_profile_options",
    "sharding_strategy",
]

@dataclass(frozen=True)
class RunOptions:
    """What :func:`run_profile_options` makes of a config.

    Attributes:
        run: the config as profiled: a warning added when the choices' ``max_seq_len`` is
            below its own, the reference dtype of an ``emit`` target that loads it otherwise.
        options: the options to profile it with (:func:`batchfit.frameworks.run_profile.profile_run`).
        notes: how the profile models the framework's step, one sentence each, to show
            beside the result.
    """

    run: RunConfig
    options: ProfileOptions
    notes: tuple[str, ...] = ()


def run_profile_options(
    run: RunConfig,
    chosen: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    *,
    emit: str | None = None,
    vocabulary: Vocabulary | None = None,
) -> RunOptions:
    """The options to profile ``run`` with: the caller's choices, the config's settings for the rest, then ``defaults``.

    From the config: ``max_seq_len``, ``world_size``, the sharding its training strategy
    means (:func:`sharding_strategy`), ``offload``, FSDP's mixed precision and resharding,
    gradient checkpointing, the framework step's head and cost
    (:func:`~batchfit.frameworks.run_step.framework_step`). With ``emit`` (a target of
    :data:`batchfit.frameworks.emit.TARGETS`), the head and reference dtype of that
    framework when it is not the config's, and packed rows: every target counts a
    micro-batch's valid tokens.

    Args:
        run: from :func:`batchfit.frameworks.read_run_config`.
        chosen: what the caller set; a framework config never overrides it.
        defaults: what neither the caller nor the config sets (``None``: the library's).
        emit: the framework whose keys will be written, or ``None``.
        vocabulary: how messages name settings (NOTE [ Messages in the caller's vocabulary ]).

    Returns:
        A :class:`RunOptions`: the run, its options and the notes to show.

    Raises:
        InvalidArgument: a GPU count or strategy of the wrong kind in the config, a training
            strategy batchfit does not model, ``cost="padded"`` with ``emit``, or a bad value.
        BatchConfigError: with ``emit="skyrl"``, the batch plan its micro sizes come from breaks.
    """
    from batchfit.frameworks.emit import TARGETS, target_head, target_reference_dtype
    from batchfit.frameworks.run_step import default_megatron_heads, framework_step, megatron_heads
    from batchfit.train.framework_heads import FrameworkHead
    from batchfit.train.megatron_heads import MegatronHeads

    say = KEYWORDS if vocabulary is None else vocabulary
    chosen = Choices(**chosen)
    if emit is not None:
        check_choice(say.say(Setting("emit")), emit, TARGETS)
    check_run_settings(run, say)
    if emit is not None and get_framework(emit).emit_needs_plan:
        check_emit_plan(run)
    if chosen.max_seq_len is not None and run.max_seq_len and chosen.max_seq_len < run.max_seq_len:
        # budgets for shorter sequences than the config's own: its plan refuses them as they are
        warning = Phrase(
            Setting("max_seq_len"),
            f" {chosen.max_seq_len:,} is below the config's longest sequence ({run.max_seq_len:,} tokens, prompt and "
            "response): the budgets hold sequences up to the former, so the config's plan refuses them as they are; "
            "drop ",
            Setting("max_seq_len"),
            ", or lower the config's prompt and response lengths",
        )
        run = run.replace(warnings=(*run.warnings, warning.say(say)))
    strategy = chosen.strategy if chosen.strategy is not None else sharding_strategy(run, say)
    megatron = str(strategy).lower() in MODEL_PARALLEL_STRATEGIES
    retrained = None
    config_megatron = (run.strategy or "").lower() in MODEL_PARALLEL_STRATEGIES
    if chosen.strategy is not None and (not modelled_strategy(run) or (config_megatron and not megatron)):
        # NOTE [ An unmodelled strategy profiled as another ]: the run the budgets are for has dp over every GPU
        run, retrained = as_data_parallel(run, str(chosen.strategy), chosen.sequence_parallel)
    ring = run.batch.context_parallel or 1
    # under Megatron the config's context parallelism is profiled (NOTE [ Context parallelism as Megatron runs it ])
    if ring > 1 and not megatron and chosen.sequence_parallel is None:
        # NOTE [ Ring attention is refused ] in batchfit.frameworks.profile_request: OpenRLHF's --ds.ring_attn_size,
        # Megatron's context parallelism (slime)
        key = (run.key_names or {}).get("context_parallel", "context_parallel")
        raise InvalidArgument(
            Phrase(
                f"the config's {key}={ring} splits each sequence with ring attention, which batchfit does not model "
                "(PyTorch's context_parallel runs no CPU sdpa and no packed rows); pass ",
                Setting("sequence_parallel", ring),
                " to profile it as Ulysses sequence parallelism (the same tokens per GPU)",
            ).say(say)
        )
    fsdp = str(strategy).lower() in FSDP_STRATEGIES  # FSDP's options (mixed precision, resharding), as the config sets them
    # the head and layout of the framework's own micro-batch; under Megatron the probe runs Megatron's own
    # (GPTModel's vocab-parallel cross-entropy over packed rows: batchfit.budget.megatron_profile)
    step = None if megatron else framework_step(run)
    notes = list(step.notes) if step is not None else []
    if retrained is not None:
        notes.insert(0, retrained)
    logprobs = chosen.logprobs
    if emit is not None and emit != run.vocabulary and logprobs is None:
        # the head the emitted run computes log-probs with (under Megatron slime's own, pass by pass)
        logprobs = (default_megatron_heads(emit) if megatron else None) or target_head(emit)
        run = run.replace(reference_dtype=target_reference_dtype(emit))  # and the reference it loads
        notes = [*([retrained] if retrained else []), f"the budgets' probe runs {emit}'s log-prob head, the one the emitted run uses"]
    if step is not None and logprobs is None:
        logprobs = step.head
    if megatron and logprobs is None and emit in (None, run.vocabulary):
        # the framework's own head on Megatron's logits (NOTE [ Framework heads under Megatron ]): slime's pass by
        # pass, verl's and SkyRL's from their FrameworkHead
        head = megatron_heads(run) or getattr(framework_step(run), "head", None)
        logprobs = head if isinstance(head, (FrameworkHead, MegatronHeads)) else None
    config_cost = step.cost if step is not None else ("packed" if run.remove_padding or megatron else "padded")
    cost = chosen.cost
    if emit is not None:  # every framework counts a micro-batch's tokens
        if cost == "padded":
            raise InvalidArgument(
                Phrase(
                    Setting("emit", emit),
                    f" writes token budgets {emit} counts in valid tokens, which bound packed rows only (the emitted "
                    "keys turn padding removal on): drop ",
                    Setting("cost", "padded"),
                ).say(say)
            )
        if config_cost == "padded":
            notes.append(
                "the config keeps each micro-batch's padding, which no token budget bounds: the keys below turn "
                "padding removal on, and the budgets are for packed rows"
            )
        cost = "packed"
    elif cost is None and (step is not None or config_cost == "packed"):
        cost = config_cost  # OpenRLHF (--ds.packing_samples, on with dynamic batches) and slime pack rows
    from_config = Choices(
        max_seq_len=run.max_seq_len,
        world_size=run.world_size,
        strategy=strategy,
        offload=run.offload,
        mixed_precision=run.mixed_precision if fsdp else None,
        reshard_after_forward=False if fsdp and run.reshard_after_forward is False else None,
        overlap_comm=True if strategy in ZERO_STRATEGIES and run.overlap_comm else None,  # DeepSpeed's two buckets
        gradient_checkpointing=None if run.gradient_checkpointing is None else bool(run.gradient_checkpointing),
        activation_offload=None if run.activation_offload is None else bool(run.activation_offload),
        logprobs=logprobs,
        cost=cost,
        # verl's ulysses_sequence_parallel_size, SkyRL's policy.sequence_parallel_size (the RunConfig's)
        sequence_parallel=run.batch.sequence_parallel if fsdp and run.batch.sequence_parallel > 1 else None,
        allocator=run.allocator,
        # what the config's own framework does between its passes; another target's run keeps the state
        optimizer_offload=True if run.optimizer_offload and emit in (None, run.vocabulary) else None,
        expert_parallel=run.expert_parallel if run.expert_parallel > 1 else None,  # prime-rl's trainer.model.ep
        **(_megatron_layout(run) if megatron and modelled_strategy(run) else {}),
        # the config's Megatron router settings (slime's --moe-* flags); given, the caller's replace them
        megatron_router=(run.megatron_router or None) if megatron and modelled_strategy(run) else None,
    )
    filled = Choices(**chosen).or_(from_config).or_(defaults or {})
    return RunOptions(run=run, options=with_run_fraction(run, filled.options(vocabulary)), notes=tuple(notes))


def _megatron_layout(run: RunConfig) -> dict[str, Any]:
    """The Megatron layout a config trains with, as :class:`Sharding`'s fields (tensor, pipeline, virtual stages, SP,
    distributed optimizer)."""
    batch = run.batch
    return {
        "tensor_parallel": batch.tensor_parallel or 1,
        "pipeline_parallel": batch.pipeline_parallel or 1,
        "context_parallel": batch.context_parallel or 1,
        "virtual_pipeline_parallel": run.virtual_pipeline_parallel,
        "megatron_sequence_parallel": bool(run.megatron_sequence_parallel),
        "distributed_optimizer": bool(run.distributed_optimizer),
        # the config's expert_tensor_parallel_size; None: Megatron's default (= tensor_parallel)
        **({} if run.expert_tensor_parallel is None else {"expert_tensor_parallel": run.expert_tensor_parallel}),
        # Megatron's num_layers_in_first/last_pipeline_stage (uneven stages); None: an even split
        **{k: getattr(run, k) for k in ("first_pipeline_stage_layers", "last_pipeline_stage_layers") if getattr(run, k) is not None},
        # Megatron's HybridDeviceOptimizer and precision-aware optimizer (their dtypes as the config sets them)
        **({"optimizer_cpu_offload": True, "optimizer_offload_fraction": run.optimizer_offload_fraction}
           if run.optimizer_cpu_offload else {}),
        **({"precision_aware_optimizer": True, **run.optimizer_dtypes} if run.precision_aware_optimizer else {}),
    }


def check_run_settings(run: RunConfig, vocabulary: Vocabulary | None = None) -> None:
    """The config's values a profile reads (GPUs, strategy) must be of their kind, checked before they are used.

    ``plan`` judges a config's batch sizes; ``profile`` needs fewer keys but needs them right:
    a GPU count of ``"x"`` or a strategy of ``-1`` is named here with its key, not met as a
    TypeError later.

    Raises:
        InvalidArgument: a node or GPU count that is set but not an integer >= 1, or a strategy
            that is not a name (one line each, naming the config's key).
    """
    batch = run.batch
    spec = framework_of(run.vocabulary)
    names = {**(spec.gpu_keys if spec is not None else {}), **(run.key_names or {})}
    for name, value in (("world_size", batch.world_size), ("num_nodes", batch.num_nodes), ("gpus_per_node", batch.gpus_per_node)):
        if value is not None and not (is_int(value) and value >= 1):
            key = names.get(name, name)
            raise InvalidArgument(
                f"the config's {key}={short_repr(value)} must be an integer >= 1 (GPUs and nodes count from 1); "
                "fix it in the config"
            )
    if run.strategy is not None and not isinstance(run.strategy, str):
        raise InvalidArgument(
            Phrase(
                f"the config's training strategy={short_repr(run.strategy)} must be a name (fsdp, fsdp2, megatron, "
                "...); fix it in the config, or pass ",
                Setting("sharding", {"strategy": "fsdp2"}),
            ).say(vocabulary)
        )


def check_emit_plan(run: RunConfig) -> None:
    """The batch plan SkyRL's emitted keys derive their micro sizes from must hold, checked before any probe.

    Raises:
        BatchConfigError: the plan's faults in the config's own key names (e.g. ``update_epochs_per_batch:
            null``), now rather than after minutes of probing.
    """
    try:
        run.batch.replace(max_tokens_per_micro_batch=None, micro_train_batch_size_per_gpu=1).plan()
    except BatchConfigError as exc:
        raise BatchConfigError([run.in_own_words(f) for f in exc.faults]) from None


def sharding_strategy(run: RunConfig, vocabulary: Vocabulary | None = None) -> str:
    """The sharding that models the config's training strategy: verl's ``fsdp`` is FSDP1, SkyRL's ``fsdp`` FSDP2.

    Raises:
        InvalidArgument: a strategy batchfit does not model (OpenRLHF's DeepSpeed stages below 3,
            slime's Megatron: the framework's own hint), naming the sharding to profile it as instead.
    """
    from batchfit.frameworks import strategy_refusal

    fsdp2 = Setting("sharding", {"strategy": "fsdp2"})
    strategy = (run.strategy or "fsdp").lower()
    if strategy in ("fsdp", "fsdp2"):
        # one GPU too: the framework still wraps the model (fp32 master weights, bf16 compute)
        spec = framework_of(run.vocabulary)
        if strategy == "fsdp" and spec is not None and spec.fsdp == "fsdp1":  # FullyShardedDataParallel
            if "fsdp1" in STRATEGIES:
                return "fsdp1"
            raise InvalidArgument(
                Phrase(
                    "the config trains with verl's strategy=fsdp (FSDP1, FullyShardedDataParallel), which batchfit "
                    "does not model: set actor_rollout_ref.actor.strategy=fsdp2, or pass ",
                    fsdp2,
                    " to profile it as FSDP2",
                ).say(vocabulary)
            )
        return "fsdp2"
    if strategy in ZERO_STRATEGIES:  # DeepSpeed ZeRO-1/2, as a framework reader names them
        return strategy
    if strategy in MODEL_PARALLEL_STRATEGIES:  # Megatron, as verl, SkyRL and slime name it
        # what the framework's reader found its Megatron profile cannot model (verl's and SkyRL's megatron_refusal:
        # context parallelism, expert parallelism, a Megatron critic, Megatron LoRA), one line naming key, value, fix
        refusal = strategy_refusal(run)
        if refusal is not None:
            raise InvalidArgument(refusal)
        return strategy
    refusal = strategy_refusal(run)  # OpenRLHF's DeepSpeed stages, slime's Megatron: the framework's own hint
    if refusal is not None:
        raise InvalidArgument(refusal)
    raise InvalidArgument(
        Phrase(
            f"the config trains with strategy={run.strategy!r}{_model_parallel_words(run)}, which batchfit does not "
            "model (tensor and pipeline parallelism split each layer's weights and activations, which no FSDP2 profile "
            "bounds either way); `batchfit plan` checks its batch sizes as it runs, and ",
            fsdp2,
            f" profiles another run instead, FSDP2 with data parallelism over all {_gpus_words(run)} (its budgets and "
            "emitted keys are for that run)",
        ).say(vocabulary)
    )


def modelled_strategy(run: RunConfig) -> bool:
    """Whether :func:`sharding_strategy` models the config's training strategy as it runs (FSDP, DeepSpeed ZeRO), or
    the framework's own refusal names the approximation (OpenRLHF's stage 0, slime's Megatron).

    ``False`` for the rest (verl's and SkyRL's Megatron): profiling such a run with a chosen sharding profiles another
    run (:func:`as_data_parallel`).
    """
    from batchfit.frameworks import strategy_refusal

    strategy = (run.strategy or "fsdp").lower()
    return strategy in ("fsdp", "fsdp2", *ZERO_STRATEGIES, *MODEL_PARALLEL_STRATEGIES) or strategy_refusal(run) is not None


# NOTE [ An unmodelled strategy profiled as another ]
# A config that trains with Megatron (tensor × pipeline × context parallel, data parallel over the rest) profiled with
# a chosen sharding (--sharding fsdp2) is profiled as the run that sharding trains: data parallel over every GPU. Its
# batch plan must be that run's too, or the emitted micro sizes (SkyRL's micro_train_batch_size_per_gpu divides the
# per-GPU mini-batch) come from Megatron's dp beside `strategy: fsdp` over all the GPUs, and the framework refuses
# them (SkyRL 0.4.0 validate_batch_sizes: dp = world // sequence_parallel_size under fsdp). FSDP2's budget is neither
# an upper nor a lower bound of Megatron's: FSDP2 shards the weights over every GPU where Megatron splits them over
# tp × pp, and keeps whole activations that tensor parallelism splits.


def as_data_parallel(run: RunConfig, strategy: str, sequence_parallel: int | None = None) -> tuple[RunConfig, str]:
    """``run`` as ``strategy`` trains it (data parallel over every GPU), and the note that says so.

    The batch's tensor, pipeline and context sizes become 1 (the reference's model-parallel size too), its
    sequence-parallel size ``sequence_parallel`` (default 1): NOTE [ An unmodelled strategy profiled as another ].
    """
    batch = run.batch
    sp = sequence_parallel or 1
    changed = batch.replace(
        tensor_parallel=1,
        pipeline_parallel=1,
        context_parallel=1,
        sequence_parallel=sp,
        reference_model_parallel=None if batch.reference_model_parallel is None else 1,
    )
    note = (
        f"the config's strategy={run.strategy}{_model_parallel_words(run)} is profiled as {strategy} with data "
        f"parallelism over all {_gpus_words(run)}{f' (sequence parallel {sp})' if sp > 1 else ''}, as asked: the "
        f"budgets and any emitted keys are for that run, not {run.strategy}'s (neither an upper nor a lower bound of "
        "it); its batch plan is that run's too"
    )
    # Megatron's bf16 parameters are not the other strategy's: its own default dtype applies (fp32 under FSDP2's mixed precision)
    dtype = None if (run.strategy or "").lower() in MODEL_PARALLEL_STRATEGIES else run.dtype
    return run.replace(batch=changed, dtype=dtype), note


def _model_parallel_words(run: RunConfig) -> str:
    """`` (tensor 2 × pipeline 2 × context 1: dp 2 of 8 GPUs)`` where the config splits the model, else ``""``."""
    b = run.batch
    sizes = (b.tensor_parallel, b.pipeline_parallel, b.context_parallel)
    if not all(is_int(x) and x >= 1 for x in sizes) or sizes == (1, 1, 1):
        return ""
    words = f" (tensor {sizes[0]} × pipeline {sizes[1]} × context {sizes[2]}"
    world = run.world_size
    if is_int(world) and world % (sizes[0] * sizes[1] * sizes[2]) == 0:
        words += f": dp {world // (sizes[0] * sizes[1] * sizes[2])} of {world} GPUs"
    return words + ")"


def _gpus_words(run: RunConfig) -> str:
    world = run.world_size
    return f"{world} GPUs" if is_int(world) else "its GPUs"
