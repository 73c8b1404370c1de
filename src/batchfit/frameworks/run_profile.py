"""Profile the run a framework config describes: every model role, and each forward-only pass.

:func:`profile_run` turns a :class:`~batchfit.frameworks.run.RunConfig` into the calls of
:func:`batchfit.budget.model_profile.profile_model` that its run makes: the policy's training step
and its old-log-prob pass, the critic's training step and value pass, the reference's
log-prob pass. Models that share GPUs (the config's ``colocated``) are profiled with the
state the others keep on the device (``resident``) taken off the usable memory, and every pass
with what the config's rollout engine keeps on the GPUs while it sleeps
(:func:`batchfit.budget.engine.engine_reserve`); a config whose engine, awake, cannot start
beside what the trainer keeps on the GPUs while it generates is refused first
(:func:`batchfit.budget.engine.check_awake_phase`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchfit.budget.engine import (
    AwakePhase,
    EngineReserve,
    check_awake_phase,
    engine_reserve,
    given_engine_reserve,
)
from batchfit.budget.model_profile import (
    ModelProfile,
    default_dtype,
    one_world,
    profile_model,
    resident_state_bytes,
)
from batchfit.budget.options import ProfileOptions
from batchfit.budget.token_budget import TokenBudget
from batchfit.errors import InvalidArgument
from batchfit.frameworks.lora_keys import as_lora_spec
from batchfit.frameworks.registry import framework_of
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.your_sizes import compare
from batchfit.train.framework_heads import FrameworkHead

# Model role -> the profile roles its model runs (trained step first, then its forward pass).
PASSES = {
    "policy": ("policy", "policy_forward"),
    "critic": ("critic", "critic_forward"),
    "reference": ("reference",),
}
# A frozen reference is loaded in bf16 (verl fsdp_workers: float32 only for the actor).
REFERENCE_DTYPE = "bf16"


@dataclass(frozen=True)
class RunProfile:
    """The budgets of every pass a framework run makes.

    Attributes:
        run: the config profiled.
        profiles: model role → its :class:`ModelProfile` (the roles of :data:`PASSES`).
        resident: model role → bytes per rank it keeps on the device while a colocated
            model runs.
        notes: how the profile departs from the config's roles (a reference computed by the
            LoRA policy itself), one sentence each.
        options: model role → the options it was profiled with (:func:`role_options`): what
            its budgets assume, which :func:`batchfit.frameworks.emit.emit_keys` writes as keys.
        engine: what the rollout engine keeps on each GPU while the trainer steps (taken off
            every pass's usable memory), ``None`` when the config has no engine and none was given.
        awake: one GPU while a colocated vLLM engine generates (what it takes, what the trainer
            keeps beside it, what is left), ``None`` when not checked (no such engine, a given
            ``engine_reserve``, or the device's own memory).
    """

    run: RunConfig
    profiles: dict[str, ModelProfile]
    resident: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    options: dict[str, ProfileOptions] = field(default_factory=dict, compare=False)
    engine: EngineReserve | None = None
    awake: AwakePhase | None = None

    @property
    def budgets(self) -> dict[str, TokenBudget]:
        """Every pass → its budget (``policy``, ``policy_forward``, ``critic``, ...)."""
        return {role: b for profile in self.profiles.values() for role, b in profile.budgets.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the vocabulary, what was read, each model's profile, the resident bytes, the config's own sizes.

        Each pass's budget appears once, in its model's profile:
        ``profiles.<model>.budgets.<role>`` (``profiles.policy.budgets.policy_forward.tokens``
        is the old log-probs' budget), its breakdown beside it (NOTE [ One name per figure ]
        in :mod:`batchfit.budget.model_profile`).
        """
        run = self.run
        return {
            "vocabulary": run.vocabulary,
            "models": run.models,
            "max_seq_len": run.max_seq_len,
            "colocated": list(run.colocated),
            "resident_bytes": self.resident,
            "engine": None if self.engine is None else self.engine.to_dict(),
            "awake": None if self.awake is None else self.awake.to_dict(),
            "allocator": run.allocator,
            "profiles": {name: p.to_dict() for name, p in self.profiles.items()},
            # the sizes the config sets beside batchfit's budgets, one per pass (your_sizes.compare)
            "yours": [c.to_dict() for c in compare(self)],
            "notes": list(self.notes),
        }


def profile_run(run: RunConfig, options: ProfileOptions) -> RunProfile:
    """Profile every pass of ``run`` (its models from ``run.models``) with ``options``.

    LoRA: the policy's adapters are ``options.lora`` when set (the command line's), else the
    config's (``run.lora``); the critic's are the config's own (``run.critic_lora``), as verl and
    SkyRL configure them per model. verl computes the reference log-probs with the LoRA actor,
    adapters disabled (``ref_in_actor``): no reference model is profiled then, its passes are
    the policy's forward ones (``policy_forward``), and :attr:`RunProfile.notes` says so.

    Args:
        run: from :func:`batchfit.frameworks.read_run_config`; ``run.models`` must name
            each model (override with ``run.replace(model=...)``).
        options: as for :func:`batchfit.budget.profile_model` (``dtype`` is the trained
            models'; the reference is profiled in bf16 unless it is given). With
            ``response_only`` and no ``response_fraction``, the share is the config's
            (:attr:`~batchfit.frameworks.run.RunConfig.response_fraction`).

    Returns:
        A :class:`RunProfile`.

    Raises:
        InvalidArgument: a model role without a model.
        DoesNotFitError: a pass does not fit one sequence of ``options.max_seq_len``.
    """
    by_role, notes = _passes(run, options)
    kept: dict[tuple[str, tuple[str, ...]], int] = {}  # (role, kinds) → bytes: each measured once

    def state(role: str, kinds: tuple[str, ...]) -> int:
        if (role, kinds) not in kept:
            kept[role, kinds] = resident_state_bytes(run.models[role], PASSES[role][0], by_role[role], kinds=kinds)
        return kept[role, kinds]

    # NOTE [ One simulated world per run ] (batchfit.budget.model_profile): a model's state is read off
    # the step its own profile then searches, each model built once
    with one_world():
        resident = {
            role: state(role, run.resident[role]) for role in by_role if role in run.colocated and run.resident.get(role)
        }
        engine = _engine(run, options)
        # a given engine_reserve replaces the engine's model, awake and asleep
        awake = _check_generation(run, options, by_role, state) if options.engine_reserve is None else None
        profiles = {}
        for role, role_opts in by_role.items():
            others = sum(b for other, b in resident.items() if other != role)
            profiles[role] = profile_model(
                run.models[role], role_opts, roles=PASSES[role], resident_bytes=others, engine=engine
            )
    return RunProfile(
        run=run, profiles=profiles, resident=resident, notes=tuple(notes), options=by_role, engine=engine, awake=awake
    )


def _engine(run: RunConfig, options: ProfileOptions) -> EngineReserve | None:
    """What the run's engine keeps on each GPU while the trainer steps: ``options.engine_reserve`` when given, else the model's."""
    from batchfit.models import load_config

    if options.engine_reserve is not None:
        return given_engine_reserve(options.engine_reserve)
    if run.engine is None:
        return None
    device = options.memory_bytes
    return engine_reserve(run.engine, load_config(run.models["policy"]), device_bytes=device)


def _check_generation(
    run: RunConfig, options: ProfileOptions, by_role: dict[str, ProfileOptions], state: Any
) -> AwakePhase | None:
    """One GPU while the run's engine generates; refuse a run whose engine cannot start beside what its models keep there."""
    from batchfit.memory import backend_class, untracked_memory

    engine = run.engine
    if engine is None or not engine.colocated or options.memory_limit is None:
        return None
    device = options.memory_bytes
    trainer = sum(state(role, kinds) for role, kinds in run.generation_resident.items() if role in by_role and kinds)
    world = options.sharding.world_size if options.sharding.distributed else 1
    if options.reserve_bytes is not None:
        untracked = options.reserve_bytes  # bytes (NOTE [ Validated once ] in batchfit.budget.options)
    elif backend_class(options.backend).simulated:
        untracked = untracked_memory(str(options.memory_limit), world_size=world, total_bytes=device).reserve_bytes
    else:
        untracked = 0
    return check_awake_phase(
        engine,
        device_bytes=device,
        trainer_bytes=trainer,
        untracked_bytes=untracked,
        fix=engine.keys.get("offload", "offload the trainer's state while the engine generates"),
    )


def role_options(run: RunConfig, options: ProfileOptions) -> dict[str, ProfileOptions]:
    """The options :func:`profile_run` profiles each model role of ``run`` with (what the budgets assume).

    Each model role the run profiles (a verl reference computed by the LoRA actor is not one)
    → ``options`` with that role's LoRA, its parameter dtype (never ``None``: the command
    line's, else the config's, else profile's default) and head.

    Raises:
        InvalidArgument: a model role without a model; a bad LoRA in the config.
    """
    return _passes(run, options)[0]


def _passes(run: RunConfig, options: ProfileOptions) -> tuple[dict[str, ProfileOptions], list[str]]:
    """Each model role → its options, and the notes on how the profile departs from the config's roles."""
    options = with_run_fraction(run, options)
    models = dict(run.models)
    for role, model in models.items():
        if not model:
            raise InvalidArgument(
                f"the config names no {role} model; pass --model PRESET|DIR (a preset, or a directory with config.json)"
            )
    adapters = {
        "policy": options.lora if options.lora is not None else as_lora_spec(run.lora, "run.lora"),
        "critic": as_lora_spec(run.critic_lora, "run.critic_lora"),
    }
    notes: list[str] = []
    for role, key in (("policy", "lora"), ("critic", "critic_lora")):
        given = None if role == "policy" and options.lora is not None else getattr(run, key)
        excluded = given.get("exclude_modules") if isinstance(given, Mapping) else None
        if excluded and adapters[role] is not None:
            notes.append(
                f"{role}: LoRA exclude_modules={excluded!r} is not modelled: those modules are adapted too (a "
                "slightly smaller, safe budget)"
            )
    policy_lora = adapters["policy"]
    spec = framework_of(run.vocabulary)
    in_actor = None if spec is None else spec.lora_reference
    if in_actor is not None and "reference" in models and policy_lora is not None and policy_lora.enabled:
        del models["reference"]
        notes.append(in_actor)
    return {role: _for_role(role, options, adapters, run) for role in models}, notes


def with_run_fraction(run: RunConfig, options: ProfileOptions) -> ProfileOptions:
    """``options`` with the config's response share when a response-only head is profiled without one.

    The share is :attr:`RunConfig.response_fraction` (the longest response over the longest
    sequence); ``options`` is returned as it is when it sets one, or computes every token.
    """
    if options.response_only and options.response_fraction is None and run.response_fraction is not None:
        return options.replace(response_fraction=run.response_fraction)
    return options


def _for_role(role: str, options: ProfileOptions, adapters: dict[str, Any], run: RunConfig) -> ProfileOptions:
    """The options of one model role: its own LoRA (none for the reference), its dtype; the reference's head.

    The dtype is ``options.dtype`` when given (the command line's, for every model), else the
    config's (:attr:`RunConfig.dtype` for trained models, :attr:`RunConfig.reference_dtype` for the
    reference), else the default: fp32 master weights under bf16 mixed precision (bf16 without),
    and bf16 for a frozen reference (verl fsdp_workers: fp32 only for the actor). A reference's
    log-prob pass computes no entropy (verl ``_compute_ref_log_prob``).
    """
    options = options.replace(lora=adapters.get(role))
    if role == "reference" and isinstance(options.logprobs, FrameworkHead):
        # verl's and SkyRL's reference log-prob passes compute no entropy
        options = options.replace(logprobs=options.logprobs.replace(forward_entropy="none"))
    if options.dtype is not None:
        return options
    if role == "reference":
        return options.replace(dtype=run.reference_dtype or REFERENCE_DTYPE)
    return options.replace(dtype=run.dtype or default_dtype(options.sharding))
