"""Profile a model trained with Megatron-core: the ``megatron`` strategy's own probe (:attr:`StrategySpec.profile`).

:func:`profile_model` under ``Sharding("megatron", ...)`` comes here: each role's budget is
searched on :class:`~batchfit.budget.megatron_probe.MegatronStep` (Megatron-core's ``GPTModel``,
its schedule and its vocab-parallel cross-entropy, the binding pipeline stage measured), and the
answer is the same :class:`~batchfit.budget.model_profile.ModelProfile` every other strategy gives,
so reports, ``--json`` and the frameworks' emitted keys read it as they read any profile.

NOTE [ A Megatron profile's roles ]
Each role's pass is measured on its own :class:`MegatronStep` and gets its own budget, searched
as the training one (the binding stage, the two shallow copies per stage extrapolated):

- ``policy``: one training step (forward, backward, Megatron's optimizer step);
- ``policy_forward`` (old log-probs): the forward-only pass (NOTE [ Forward-only Megatron
  probes ]) with the policy's DDP buffers and Megatron's optimizer state resident, as between
  its updates (``optimizer="resident"``), or DDP's buffers alone under ``optimizer_offload``
  (verl's ``megatron.optimizer_offload`` moves the optimizer state to the host outside
  ``update_actor``: ``optimizer="offloaded"``);
- ``reference``: the forward-only pass of a model that holds its parameters only (verl's
  reference engine is built ``forward_only`` without DDP or an optimizer: ``optimizer="none"``).

A forward pass under ``no_grad`` keeps no activations between layers or micro-batches, so with the
same head its budget is at least the training step's (tiny, TP 2 × PP 2: ``tests/test_megatron_profile.py``);
each role runs the head its framework runs (:func:`megatron_head`, NOTE [ Framework heads under
Megatron ]), and verl's old log-probs compute an entropy over a clone of the fp32 logits, which
can put that pass below the update. A framework that takes one token cap for every pass takes
the smallest (``combined``).
:attr:`ModelProfile.megatron` describes the trained role's step (the first role's when none is
trained). A critic is refused: Megatron's value model (verl's ``megatron_critic``) is not built
here, and SkyRL trains none under Megatron.

NOTE [ Megatron budgets bound packed micro-batches ]
Megatron-core's local layer spec has no packed (THD) attention, so :class:`MegatronStep` measures
padded rows (NOTE [ Megatron micro-batches are padded rows ]). A search with ``cost="packed"``
therefore measures ``T`` tokens split into sequences of ``max_seq_len`` and a remainder as that
many full rows: its budget is a whole number of longest sequences, and any packing of that many
tokens into sequences no longer than ``max_seq_len`` holds no more (linear layers hold the same
tokens; fused attention holds O(s) per sequence). The frameworks' Megatron token caps (slime's
``--max-tokens-per-gpu``, verl's ``ppo_max_token_len_per_gpu``) count packed tokens, so this is the
budget they take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from batchfit.budget.budget_search import find_token_budget
from batchfit.budget.engine import EngineReserve, given_engine_reserve
from batchfit.budget.megatron_layout import MegatronLayout, check_layout, stage_layers, uneven
from batchfit.budget.model_profile import (
    ROLES,
    ModelProfile,
    check_roles,
    forward_role,
    model_name,
    take_resident,
)
from batchfit.budget.options import ProfileOptions
from batchfit.budget.token_budget import TokenBudget
from batchfit.errors import DoesNotFitError, InvalidArgument, Phrase, Setting
from batchfit.parallel.sharding import Sharding
from batchfit.validation import check_choice, check_int

#: What a Megatron profile calls its head: Megatron's vocab-parallel cross-entropy over ``[T, V/TP]`` fp32 logits.
HEAD = "megatron"


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Megatron-core's and mbridge's own warnings silenced inside (Transformer Engine and Apex missing, CUDA settings):
    true of every CPU run, and not the user's to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(megatron|mbridge)(\.|$)")
        # torch's own deprecation of the collectives Megatron's buffers call (reduce_scatter_tensor, all_gather_into_tensor)
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        yield


def profile_model(
    model: Any,
    options: ProfileOptions,
    *,
    roles: Sequence[str],
    resident_bytes: int = 0,
    engine: EngineReserve | None = None,
) -> ModelProfile:
    """The :class:`~batchfit.budget.model_profile.ModelProfile` of ``model`` trained with Megatron as ``options.sharding`` lays it out.

    Args:
        model: a preset name, a directory with ``config.json``, a hub id or a ``PretrainedConfig``
            (a model object is not taken: Megatron builds its own ``GPTModel``).
        options: the profile's options; ``options.sharding`` is a ``megatron`` :class:`Sharding`.
        roles: the roles to profile (:data:`~batchfit.budget.model_profile.ROLES`; no critic:
            NOTE [ A Megatron profile's roles ]).
        resident_bytes, engine: as for :func:`~batchfit.budget.model_profile.profile_model`.

    Raises:
        InvalidArgument: a critic role, a model object, LoRA, activation offload, a response-only
            head, or a world the layout does not divide.
        DoesNotFitError: one sequence of ``max_seq_len`` does not fit the binding stage.
    """
    with quiet_megatron():
        return _profile(model, options, roles=roles, resident_bytes=resident_bytes, engine=engine)


def _profile(
    model: Any, options: ProfileOptions, *, roles: Sequence[str], resident_bytes: int, engine: EngineReserve | None
) -> ModelProfile:
    from batchfit.memory import get_backend
    from batchfit.models import load_config, parse_dtype

    chosen = check_roles(roles)
    _check_modelled(model, options, chosen)
    plan = options.sharding
    dtype = parse_dtype("bf16" if options.dtype is None else options.dtype)
    config = load_config(model)
    check_layout(config, plan, options.caller_vocabulary)  # before any build
    _check_chunks(int(config.num_hidden_layers), plan, options)
    moe = megatron_moe_summary(config, plan)
    be = get_backend(options.backend, memory_limit=options.memory_limit, reserve_bytes=options.reserve_bytes)
    resident_bytes = check_int("resident_bytes", resident_bytes, minimum=0)
    if options.engine_reserve is not None:
        engine = given_engine_reserve(options.engine_reserve)
    # NOTE [ A Megatron profile's roles ]: each pass searched on its own step, a trained role first; the steps
    # are made before the resident bytes are taken (each sets the backend's default reserve for the layout's world)
    order = sorted(chosen, key=forward_role)
    steps = {role: budget_step(config, plan, be, dtype, options, role=role) for role in order}
    if resident_bytes or (engine is not None and engine.bytes):
        take_resident(be, resident_bytes, engine)
    budgets: dict[str, TokenBudget] = {}
    for role, step in steps.items():
        try:
            budgets[role] = find_token_budget(
                step,
                max_seq_len=options.max_seq_len,
                safety_margin=options.safety_margin,
                seq_lens=options.seq_lens or [options.max_seq_len],
                cost=options.cost,
                progress=options.progress,
                role=role,
            )
        except DoesNotFitError as exc:
            stage = "" if plan.pipeline_parallel == 1 else f" (pipeline stage {step.binding_stage} binds)"
            experts = "" if moe is None else f"{moe.short()}; "
            raise exc.replace(Phrase(f"{experts}{role}{stage}: ", *exc.message.parts)) from None
    budgets = {role: budgets[role] for role in chosen}
    if moe is not None and options.compare_routing:  # the binding role again with balanced routing, beside it
        moe = dataclasses.replace(moe, balanced_tokens=_balanced_tokens(config, plan, be, dtype, options, budgets))
    step = steps[order[0]]  # the trained role's (the first role's when none is trained)
    stage_peaks = budget_stage_peaks(step, budgets[order[0]])
    return ModelProfile(
        model=model_name(model),
        dtype=str(dtype).removeprefix("torch."),
        compute_dtype=str(dtype).removeprefix("torch."),
        gradient_checkpointing=options.gradient_checkpointing,
        logprobs=HEAD,
        backend=be.name,
        memory_limit=be.memory_limit,
        reserve_bytes=int(be.reserve_bytes or 0) - resident_bytes - (0 if engine is None else engine.bytes),
        resident_bytes=resident_bytes,
        engine=engine,
        allocator=str(options.allocator),
        safety_margin=float(options.safety_margin),
        budgets=budgets,
        combined=TokenBudget.min(*budgets.values()),
        sharding=plan,
        moe=moe,
        depth=int(config.num_hidden_layers),
        measured_depths=_measured_depths(step, plan),
        untracked=be.untracked,
        megatron=MegatronLayout(
            stage_peaks=stage_peaks,
            binding_stage=max(stage_peaks, key=lambda stage: (stage_peaks[stage], -stage)) if stage_peaks else None,
            micro_batches=step.micro_batches,
            attention=ATTENTION,
            recompute=step.overrides.get("recompute_granularity"),
            heads={role: head.describe() for role in chosen if not (head := megatron_head(options, role)).is_default},
            virtual_stages=plan.virtual_pipeline_parallel if (plan.virtual_pipeline_parallel or 1) > 1 else None,
            stage_layers=dict(enumerate(stage_layers(int(config.num_hidden_layers), plan))) if uneven(plan) else {},
            # NOTE [ Megatron's router settings ] in batchfit.budget.options: a dense model has no router to set
            router=dict(options.megatron_router or {}) if moe is not None else {},
        ),
    )


def _balanced_tokens(
    config: Any, plan: Sharding, backend: Any, dtype: Any, options: ProfileOptions, budgets: dict[str, TokenBudget]
) -> int | None:
    """The binding role's budget at ``max_seq_len`` with every router balanced (``--compare-routing``), to set beside
    the worst case's; ``None`` when one sequence does not fit even so."""
    role = TokenBudget.min(*budgets.values()).binding_role or next(iter(budgets))
    step = budget_step(config, plan, backend, dtype, options, role=role, routing="balanced")
    try:
        return find_token_budget(
            step, max_seq_len=options.max_seq_len, safety_margin=options.safety_margin, seq_lens=[options.max_seq_len],
            cost=options.cost, progress=options.progress, role=role,
        ).tokens  # fmt: skip
    except DoesNotFitError:
        return None


def megatron_moe_summary(config: Any, plan: Sharding) -> Any:
    """A mixture of experts as the Megatron probe runs it, for the report; ``None`` for a dense model.

    Megatron-core's ``SequentialMLP`` experts (Transformer Engine's grouped GEMM, ``TEGroupedMLP``, needs CUDA),
    every router fixed to the worst case (NOTE [ The Megatron probe's worst rank ] in
    :mod:`batchfit.budget.megatron_probe`): the report states what the receiving rank holds.
    """

    from batchfit.models.moe import moe_summary

    moe = moe_summary(config, None, plan.expert_parallel)
    if moe is None:
        return None
    return dataclasses.replace(
        moe, implementation="SequentialMLP", default_implementation="TEGroupedMLP", runs_in="Megatron-core", routing="skewed"
    )


def budget_stage_peaks(step: Any, budget: TokenBudget) -> dict[int, int]:
    """Each pipeline stage's peak at ``budget``'s binding point: the largest micro-batch that fits at the length that
    sets the budget, as ``step`` measured it (``step.peaks_by_shape``); the last measurement's when that one was not
    measured by this step (a budget combined from other searches)."""
    point = min(budget.points, key=lambda p: p.tokens, default=None)
    found = None if point is None else step.peaks_by_shape.get((point.seq_len, point.tokens))
    return dict(step.stage_peaks if found is None else found)


#: The core attention a profile measures (NOTE [ Fused attention for Megatron budgets ]).
ATTENTION = "sdpa"
#: Megatron's full recomputation of every layer, what ``gradient_checkpointing`` means under Megatron: slime's
#: ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``, verl's
#: ``megatron.override_transformer_config.recompute_*`` and SkyRL's ``transformer_config_kwargs`` defaults.
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def role_pass(role: str, options: ProfileOptions) -> dict[str, Any]:
    """What ``role``'s :class:`~batchfit.budget.megatron_probe.MegatronStep` measures (NOTE [ A Megatron profile's roles ]):
    ``{}`` for a training step with Megatron's own head, else ``forward_only`` and what stays resident, and the
    framework's head (:func:`megatron_head`) when it is not Megatron's own."""
    check_choice("role", role, ROLES)
    head = megatron_head(options, role)
    out: dict[str, Any] = {} if head.is_default else {"head": head}
    if not forward_role(role):
        return out
    if role == "reference":
        return {**out, "forward_only": True, "optimizer": "none"}
    return {**out, "forward_only": True, "optimizer": "offloaded" if options.optimizer_offload else "resident"}


def megatron_head(options: ProfileOptions, role: str) -> Any:
    """The head ``role``'s pass runs on the last stage's logits (NOTE [ Framework heads under Megatron ]).

    ``options.logprobs`` a :class:`~batchfit.train.megatron_heads.MegatronHeads`: its head for ``role``.
    A verl or SkyRL :class:`~batchfit.train.framework_heads.FrameworkHead` (read from
    the framework's config): that framework's Megatron head, with the entropy its config computes in
    each pass (verl: the update's ``entropy``, the old log-probs' ``forward_entropy``, chunked in
    ``entropy_chunk_size`` rows; SkyRL: an entropy in the update, with its graph under
    ``use_entropy_loss``, and log-probs in chunks of 1,024 tokens); the reference computes none.
    Anything else: Megatron's own cross-entropy.

    Raises:
        InvalidArgument: verl's chunked entropy in the update (its backward fails in verl 0.9.1: the
            chunks' in-place gradient changes a tensor autograd saved).
    """
    from batchfit.train.framework_heads import FrameworkHead
    from batchfit.train.megatron_heads import MegatronHead, MegatronHeads

    head = options.logprobs
    if isinstance(head, MegatronHeads):  # each pass's head as the framework's config selects it (slime)
        return head.for_role(role)
    if not isinstance(head, FrameworkHead):
        return MegatronHead()
    trained = not forward_role(role)
    if head.framework == "skyrl":
        return MegatronHead("skyrl", entropy=trained, entropy_grad=trained and head.entropy_grad, chunk_size=1024, entropy_chunk_size=0)
    mode = "none" if role == "reference" else head.entropy if trained else head.forward_entropy
    if trained and mode == "chunked":
        raise InvalidArgument(
            "verl's chunked entropy (entropy_from_logits_with_chunking) in the Megatron update is not modelled: its "
            "backward (vocab_parallel_entropy_with_chunking) changes a saved tensor in place and fails under autograd; "
            "turn entropy_from_logits_with_chunking off, or the update's entropy (entropy_coeff=0, calculate_entropy=False)"
        )
    on = mode != "none"
    return MegatronHead("verl", entropy=on, entropy_grad=on, chunk_size=head.entropy_chunk_size if mode == "chunked" else None)


def budget_step(
    config: Any,
    plan: Sharding,
    backend: Any,
    dtype: Any,
    options: ProfileOptions,
    *,
    role: str = "policy",
    routing: str = "skewed",
) -> Any:
    """The step a Megatron profile searches for ``role``: :func:`megatron_step` at the model's depth, or two shallow
    copies of it extrapolated stage by stage (NOTE [ Megatron stages are affine in their depth ]); a mixture of
    experts' routers fixed to ``routing`` (NOTE [ The Megatron probe's worst rank ])."""
    from batchfit.budget.megatron_depth import (
        DepthExtrapolatedMegatronStep,
        dense_first_copy,
        dense_first_layers,
        extrapolates,
    )

    layers = int(config.num_hidden_layers)
    probe = {**role_pass(role, options), **({} if routing == "skewed" else {"routing": routing})}
    chunks = model_chunks(plan)
    # each stage's own layers (per model chunk): uneven stages are extrapolated each to its own depth from even copies
    per_stage = stage_layers(layers, plan) if uneven(plan) else (layers // chunks,) * plan.pipeline_parallel
    if not extrapolates(backend, layers, chunks, options.depth_extrapolation, per_stage=per_stage if uneven(plan) else None):
        return megatron_step(config, plan, backend, dtype, options, **probe)
    dense = dense_first_layers(config, plan, per_stage)  # NOTE [ Dense first layers in the shallow copies ]
    if dense:
        pp = plan.pipeline_parallel
        return DepthExtrapolatedMegatronStep(
            lambda n: megatron_step(config, plan, backend, dtype, options, **dense_first_copy(dense, n, pp), **probe),
            chunks,
            (per_stage[0] - dense, *per_stage[1:]),
            backend,
        )
    return DepthExtrapolatedMegatronStep(
        lambda n: megatron_step(config, plan, backend, dtype, options, num_layers=n, **probe),
        chunks,
        per_stage,
        backend,
    )


def model_chunks(plan: Sharding) -> int:
    """The model chunks along the pipeline: ``pipeline_parallel × virtual_pipeline_parallel`` (NOTE [ Megatron stages are
    affine in their depth ]: every chunk holds the same layers)."""
    return plan.pipeline_parallel * (plan.virtual_pipeline_parallel or 1)


def megatron_step(
    config: Any, plan: Sharding, backend: Any, dtype: Any, options: ProfileOptions, **overrides: Any
) -> Any:
    """The :class:`~batchfit.budget.megatron_probe.MegatronStep` of ``plan``'s layout (one data-parallel rank's);
    ``overrides`` are its ``forward_only`` and ``optimizer`` (:func:`role_pass`) and ``TransformerConfig`` fields
    (``num_layers``), over ``options.megatron_router``'s (NOTE [ Megatron's router settings ] in
    :mod:`batchfit.budget.options`)."""
    from batchfit.budget.megatron_probe import MegatronStep

    if options.megatron_router:  # the router's TransformerConfig fields the config or the caller set
        overrides = {**options.megatron_router, **overrides}
    if options.gradient_checkpointing:
        overrides = {**FULL_RECOMPUTE, **overrides}
    if "num_layers" not in overrides:  # the model's own depth: its uneven stages (a shallow copy's are even)
        overrides = {**uneven_stage_fields(plan), **overrides}
    data = {}
    # Megatron's DDP and distributed optimizer shard over the data- and context-parallel ranks together
    # (parallel_state.get_data_parallel_group(with_context_parallel=True)); over one rank the state is whole either way
    if plan.data_parallel_size * plan.context_parallel > 1:
        data = {"data_parallel": plan.data_parallel_size, "distributed_optimizer": plan.distributed_optimizer}
    data.update(optimizer_layout(plan))
    return MegatronStep(
        config,
        tensor_parallel=plan.tensor_parallel,
        pipeline_parallel=plan.pipeline_parallel,
        context_parallel=plan.context_parallel,
        expert_parallel=plan.expert_parallel,  # NOTE [ The Megatron probe's worst rank ]
        expert_tensor_parallel=plan.expert_tensor_parallel,  # None: Megatron's default, the tensor-parallel size
        virtual_pipeline=plan.virtual_pipeline_parallel,
        sequence_parallel=plan.megatron_sequence_parallel,
        backend=backend,
        dtype=dtype,
        attention=ATTENTION,
        **data,
        **overrides,
    )


def optimizer_layout(plan: Sharding) -> dict[str, Any]:
    """``plan``'s precision-aware optimizer and CPU offload as :class:`~batchfit.budget.megatron_probe.MegatronStep`'s
    ``precision`` and ``offload_fraction`` (NOTE [ Megatron's optimizer offload and precision-aware optimizer ] in
    :mod:`batchfit.train.megatron_step`); ``{}`` when neither is on."""
    if not plan.precision_aware_optimizer:
        return {}
    from batchfit.train.megatron_step import OptimizerPrecision

    precision = OptimizerPrecision(
        main_params=plan.main_params_dtype, main_grads=plan.main_grads_dtype, exp_avg=plan.exp_avg_dtype,
        exp_avg_sq=plan.exp_avg_sq_dtype,
    )  # fmt: skip
    return {"precision": precision, "offload_fraction": plan.optimizer_offload_fraction if plan.optimizer_cpu_offload else 0.0}


def uneven_stage_fields(plan: Sharding) -> dict[str, int]:
    """``plan``'s uneven first and last pipeline stages as Megatron's ``TransformerConfig`` fields
    (``num_layers_in_first_pipeline_stage``, ``num_layers_in_last_pipeline_stage``), those set; ``{}`` for an even split."""
    out = {}
    if plan.first_pipeline_stage_layers is not None:
        out["num_layers_in_first_pipeline_stage"] = plan.first_pipeline_stage_layers
    if plan.last_pipeline_stage_layers is not None:
        out["num_layers_in_last_pipeline_stage"] = plan.last_pipeline_stage_layers
    return out


def _measured_depths(step: Any, plan: Sharding) -> tuple[int, int] | None:
    from batchfit.budget.megatron_depth import STAGE_DEPTHS, DepthExtrapolatedMegatronStep

    if not isinstance(step, DepthExtrapolatedMegatronStep):
        return None
    # each copy's own depth: k layers per model chunk, and any dense first layers it keeps
    k1, k2 = (int(step.steps[k].overrides.get("num_layers", k * model_chunks(plan))) for k in STAGE_DEPTHS)
    return (k1, k2)


def resident_state_bytes(model: Any, role: str, options: ProfileOptions, *, kinds: Sequence[str]) -> int:
    """Bytes per rank ``role``'s Megatron model keeps on the device between its steps (the binding stage's).

    Measured as :func:`~batchfit.budget.model_profile.resident_state_bytes` measures it: the model
    (and its optimizer, for a trained role) built as its step builds it, its registered state
    measured without a step, the ``kinds`` categories summed.
    """


    check_choice("role", role, ROLES)
    with quiet_megatron():
        return _state_bytes(model, role, options, kinds)


def _state_bytes(model: Any, role: str, options: ProfileOptions, kinds: Sequence[str]) -> int:
    import torch

    from batchfit.memory import get_backend
    from batchfit.models import load_config, parse_dtype
    from batchfit.models.megatron import (
        build_gpt_chunks,
        megatron_cpu_patches,
        model_parallel,
        simulated_rank,
    )
    from batchfit.train.megatron_step import megatron_optimizer

    plan = options.sharding
    dtype = parse_dtype("bf16" if options.dtype is None else options.dtype)
    be = get_backend(options.backend, memory_limit=options.memory_limit, reserve_bytes=0)
    if not be.simulated:
        raise InvalidArgument(
            f"the state a colocated Megatron model keeps is measured on the estimate backend, but got backend={be.name!r}; "
            "profile the run with --backend estimate"
        )
    config = load_config(model)
    step = megatron_step(config, plan, be, dtype, options)
    most = 0
    for stage in range(plan.pipeline_parallel):  # the stage that keeps the most binds
        with simulated_rank(step.world_size, step.stage_first_rank(stage)), contextlib.ExitStack() as inside:
            inside.enter_context(
                model_parallel(
                    plan.tensor_parallel, plan.pipeline_parallel, plan.virtual_pipeline_parallel,
                    context_parallel=plan.context_parallel, expert_parallel=plan.expert_parallel,
                    expert_tensor_parallel=step.expert_tensor_parallel,
                )
            )
            inside.enter_context(megatron_cpu_patches())
            with be.context():
                chunks = build_gpt_chunks(
                    config, tensor_parallel=plan.tensor_parallel, pipeline_parallel=plan.pipeline_parallel,
                    virtual_pipeline=plan.virtual_pipeline_parallel, sequence_parallel=plan.megatron_sequence_parallel,
                    context_parallel=plan.context_parallel, dtype=dtype, initialise=False, gpt_args=step.gpt_args,
                    expert_parallel=plan.expert_parallel, expert_tensor_parallel=step.expert_tensor_parallel,
                    **uneven_stage_fields(plan),
                )
                net = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
                state: tuple[Any, ...] = (net,)
                categories: tuple[Any, ...] = (None,)
                if not forward_role(role):
                    # Megatron's DDP and optimizer (NOTE [ The Megatron step's optimizer ]): the fp32 grad buffer,
                    # main parameters and moments are registered with their categories, not as one object
                    training = megatron_optimizer(
                        chunks, mixed_precision=step.main_params_fp32, distributed=step.distributed_optimizer,
                        precision=step.precision, offload_fraction=step.offload_fraction,
                    )
                    objects, cats = training.registered()
                    state, categories = (net, *objects), (None, *cats)
            measured = be.measure(lambda: None, register=state, categories=categories)
        most = max(most, int(sum(measured.breakdown.get(kind, 0) for kind in kinds)))
    return most


def _check_chunks(layers: int, plan: Sharding, options: ProfileOptions) -> None:
    """Virtual stages give every model chunk as many layers (NOTE [ Virtual pipeline stages ]): ``pp × vp`` divides them.
    Uneven first or last stages beside virtual stages are not modelled (the depth law per chunk assumes equal chunks)."""
    vp = plan.virtual_pipeline_parallel
    if vp is not None and uneven(plan):
        raise InvalidArgument(
            Phrase(
                Setting("virtual_pipeline_parallel", vp),
                " beside uneven pipeline stages (",
                Setting("last_pipeline_stage_layers" if plan.first_pipeline_stage_layers is None else "first_pipeline_stage_layers"),
                ") is not modelled; profile without virtual stages, or with an even split",
            ).say(options.caller_vocabulary)
        )
    if vp is None or layers % model_chunks(plan) == 0:
        return
    fits = [n for n in range(2, layers // plan.pipeline_parallel + 1) if layers % (plan.pipeline_parallel * n) == 0]
    raise InvalidArgument(
        Phrase(
            Setting("virtual_pipeline_parallel", vp),
            " × ",
            Setting("pipeline_parallel", plan.pipeline_parallel),
            f" = {model_chunks(plan)} model chunks must divide the model's {layers} layers (Megatron gives every chunk "
            f"as many); use one of {', '.join(map(str, fits))}" if fits else
            f" = {model_chunks(plan)} model chunks must divide the model's {layers} layers (Megatron gives every chunk "
            "as many); leave it unset",
        ).say(options.caller_vocabulary)
    )


def _check_modelled(model: Any, options: ProfileOptions, roles: Sequence[str]) -> None:
    say = options.caller_vocabulary
    if "critic" in roles or "critic_forward" in roles:
        raise InvalidArgument(
            Phrase(
                "a critic trained with Megatron is not modelled (verl's megatron critic is not built here; SkyRL trains "
                "none under Megatron); profile ",
                Setting("roles", "policy,reference"),
                ", or the critic with ",
                Setting("sharding", {"strategy": "fsdp2"}),
            ).say(say)
        )
    import torch

    if isinstance(model, torch.nn.Module):
        raise InvalidArgument(
            "a Megatron profile builds Megatron-core's own GPTModel from a config: pass the model's preset, directory "
            "or hub id (its config), not a model object"
        )
    for name, on in (
        ("lora_rank", options.lora is not None and options.lora.enabled),
        ("activation_offload", options.activation_offload),
        ("response_only", options.response_only),
    ):
        if on:
            raise InvalidArgument(
                Phrase(
                    Setting(name), " is not modelled under Megatron; drop it, or profile with ",
                    Setting("sharding", {"strategy": "fsdp2"}),
                ).say(say)
            )


__all__ = [
    "ATTENTION",
    "FULL_RECOMPUTE",
    "HEAD",
    "budget_step",
    "megatron_step",
    "profile_model",
    "resident_state_bytes",
    "role_pass",
]
