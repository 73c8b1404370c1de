"""Batch plans: validate and explain train / mini / micro batch sizes and the data-parallel layout.

:class:`BatchConfig` holds the user's numbers (SkyRL's names and units);
:meth:`BatchConfig.plan` checks every rule at once and returns a frozen :class:`BatchPlan`,
or raises one :class:`~batchfit.errors.BatchConfigError` listing every fault with a fix.

Units: ``train_batch_size`` and the ``*_mini_batch_size`` fields count **prompts**; the
``micro_*_per_gpu`` fields count **samples** (sequences); ``max_tokens_per_micro_batch``
counts tokens. One rule set per framework serves policy and critic: a
:class:`~batchfit.plan.rules.BatchRules` object, found by :attr:`BatchConfig.framework`
(:func:`~batchfit.plan.rules.batch_rules`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from batchfit.errors import BatchConfigError, InvalidArgument
from batchfit.plan import rules
from batchfit.plan.arith import divisors, multiples_near, nearest, or_list
from batchfit.plan.render import plan_tree_text
from batchfit.validation import MAX_COUNT, check_bool, closest, is_int, short_repr


@dataclass(frozen=True)
class BatchConfig:
    """A batch-size configuration, as a trainer such as SkyRL takes it.

    Nothing is checked at construction; :meth:`plan` checks everything and reports every
    fault at once.

    Attributes:
        train_batch_size: prompts per training step.
        policy_mini_batch_size: prompts per policy optimizer step.
        n_samples_per_prompt: trajectories generated per prompt.
        critic_mini_batch_size: prompts per critic optimizer step; ``None`` = no critic.
        micro_train_batch_size_per_gpu: samples per forward/backward on one GPU.
        micro_forward_batch_size_per_gpu: samples per forward-only pass (log-probs, values).
        max_tokens_per_micro_batch: token budget per micro-batch; when set, micro-batches
            are bounded by tokens and the ``micro_*`` sample sizes are not used.
        update_epochs_per_batch: passes over the training batch per step.
        world_size: total GPUs; ``None`` = ``num_nodes × gpus_per_node`` (default 1).
        num_nodes, gpus_per_node: the alternative way to give ``world_size``.
        tensor_parallel, pipeline_parallel, context_parallel, sequence_parallel: model
            parallel sizes; ``dp_size = world_size / (tp · pp · cp · sp)``.
        step_wise: each trajectory yields one sequence per turn, so sample counts vary.
        critic_world_size: GPUs of the critic when it is placed apart from the policy
            (SkyRL's ``critic_num_nodes × critic_num_gpus_per_node``); ``None`` = the policy's.
        critic_model_parallel: the critic's model-parallel size, its GPUs per data-parallel
            rank (SkyRL's ``trainer.critic.sequence_parallel_size``, verl's
            ``critic.fsdp.ulysses_sequence_parallel_size``); ``None`` = the policy's
            ``tp · pp · cp · sp``.
        reference_world_size: GPUs of a reference model with a data-parallel size of its own
            that the step must split over (SkyRL's ``ref_num_nodes × ref_num_gpus_per_node``);
            ``None`` = no such reference.
        reference_model_parallel: the reference's model-parallel size (SkyRL's
            ``trainer.ref.sequence_parallel_size``); ``None`` = the policy's.
        framework: whose rules the plan follows, a name of
            :func:`~batchfit.plan.rules.framework_names`: ``"batchfit"`` (exact splits),
            ``"skyrl"`` (SkyRL 0.4.0) or ``"verl"`` (verl 0.9.1, its V1 trainer): what that
            framework runs, even with waste, is a warning; what it refuses is a fault (each
            rule cites the framework's code it mirrors).
    """

    train_batch_size: int
    policy_mini_batch_size: int
    n_samples_per_prompt: int = 1
    critic_mini_batch_size: int | None = None
    micro_train_batch_size_per_gpu: int = 1
    micro_forward_batch_size_per_gpu: int = 1
    max_tokens_per_micro_batch: int | None = None
    update_epochs_per_batch: int = 1
    world_size: int | None = None
    num_nodes: int | None = None
    gpus_per_node: int | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    sequence_parallel: int = 1
    step_wise: bool = False
    critic_world_size: int | None = None
    critic_model_parallel: int | None = None
    reference_world_size: int | None = None
    reference_model_parallel: int | None = None
    framework: str = "batchfit"

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """Names of the configuration fields, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> BatchConfig:
        """A copy with ``changes`` applied (values are checked by :meth:`plan`).

        Raises:
            InvalidArgument: a name that is not a field (with the closest field).
        """
        unknown = [name for name in changes if name not in self.fields()]
        if unknown:
            hint = closest(unknown[0], self.fields())
            raise InvalidArgument(
                f"BatchConfig has no field {unknown[0]!r}"
                + (f"; did you mean {hint!r}?" if hint else f"; fields: {', '.join(self.fields())}")
            )
        return dataclasses.replace(self, **changes)

    def plan(self, *, strict: bool = False) -> BatchPlan:
        """Check every rule and derive the plan.

        ``strict=True`` turns the plan's warnings (a layout the framework runs but wastes,
        such as padding rows) into faults.

        Returns:
            A frozen :class:`BatchPlan`.

        Raises:
            BatchConfigError: one error listing every fault; each names the fields, their
                values, the rule broken and the nearest valid values.
        """
        return _build_plan(self, strict=check_bool("strict", strict))

    def to_dict(self) -> dict[str, Any]:
        """The fields as a flat ``dict``."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RolePlan:
    """The mini- and micro-batch layout of one trained model (``policy`` or ``critic``).

    Sample counts are ``None`` in step-wise training, where they vary from step to step.
    """

    role: str
    mini_batch_size: int
    mini_batches_per_epoch: int
    optimizer_steps_per_step: int
    samples_per_mini_batch: int | None
    samples_per_mini_batch_per_gpu: int | None
    micro_batch_size_per_gpu: int | None
    gradient_accumulation_steps: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchPlan:
    """A validated batch layout. Build with :meth:`BatchConfig.plan`.

    Identities (non-step-wise): ``samples_per_step = train_batch_size × n_samples_per_prompt``;
    ``samples_per_mini_batch = mini × n``; ``samples_per_mini_batch_per_gpu × dp_size =
    samples_per_mini_batch``; ``gradient_accumulation_steps × micro_train_batch_size_per_gpu =
    samples_per_mini_batch_per_gpu``; always ``optimizer_steps_per_step = train / mini × epochs``.
    """

    config: BatchConfig
    world_size: int
    dp_size: int
    model_parallel_size: int
    trajectories_per_step: int
    samples_per_step: int | None
    samples_per_step_per_gpu: int | None
    forward_micro_batches_per_gpu: int | None
    micro_batching: str
    policy: RolePlan
    critic: RolePlan | None
    notes: tuple[str, ...] = field(default=())
    warnings: tuple[str, ...] = field(default=())

    # The policy's numbers are the plan's headline numbers.
    @property
    def mini_batches_per_epoch(self) -> int:
        return self.policy.mini_batches_per_epoch

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.policy.optimizer_steps_per_step

    @property
    def samples_per_mini_batch(self) -> int | None:
        return self.policy.samples_per_mini_batch

    @property
    def samples_per_mini_batch_per_gpu(self) -> int | None:
        return self.policy.samples_per_mini_batch_per_gpu

    @property
    def gradient_accumulation_steps(self) -> int | None:
        return self.policy.gradient_accumulation_steps

    @property
    def roles(self) -> tuple[RolePlan, ...]:
        return (self.policy,) if self.critic is None else (self.policy, self.critic)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready ``dict``: the config, the derived numbers and the notes."""
        return {
            "config": self.config.to_dict(),
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "model_parallel_size": self.model_parallel_size,
            "trajectories_per_step": self.trajectories_per_step,
            "samples_per_step": self.samples_per_step,
            "samples_per_step_per_gpu": self.samples_per_step_per_gpu,
            "forward_micro_batches_per_gpu": self.forward_micro_batches_per_gpu,
            "micro_batching": self.micro_batching,
            "policy": self.policy.to_dict(),
            "critic": None if self.critic is None else self.critic.to_dict(),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
        }

    def __str__(self) -> str:
        return plan_tree_text(self)


# --------------------------------------------------------------------------- rules

_INT_FIELDS = (
    "train_batch_size",
    "policy_mini_batch_size",
    "n_samples_per_prompt",
    "micro_train_batch_size_per_gpu",
    "micro_forward_batch_size_per_gpu",
    "update_epochs_per_batch",
    "tensor_parallel",
    "pipeline_parallel",
    "context_parallel",
    "sequence_parallel",
)
_OPTIONAL_INT_FIELDS = (
    "critic_mini_batch_size",
    "critic_world_size",
    "critic_model_parallel",
    "reference_world_size",
    "reference_model_parallel",
    "max_tokens_per_micro_batch",
    "world_size",
    "num_nodes",
    "gpus_per_node",
)


def _type_faults(cfg: BatchConfig) -> tuple[list[str], set[str]]:
    """Faults of single fields, and the names of the invalid fields."""
    faults, bad = [], set()
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(cfg, name)
        if value is None and name in _OPTIONAL_INT_FIELDS:
            continue
        if not is_int(value) or value < 1:
            what = "an integer >= 1" + (" or None" if name in _OPTIONAL_INT_FIELDS else "")
            kind = "" if is_int(value) else f", not a {type(value).__name__}"
            faults.append(f"{name}={short_repr(value)} must be {what}{kind}")
            bad.add(name)
        elif value > MAX_COUNT:
            faults.append(f"{name}={short_repr(value)} must be at most {MAX_COUNT:,} (2**62); is it a typo?")
            bad.add(name)
    if not isinstance(cfg.step_wise, bool):
        faults.append(f"step_wise={short_repr(cfg.step_wise)} must be true or false")
        bad.add("step_wise")
    names = rules.framework_names()
    if not isinstance(cfg.framework, str) or cfg.framework not in names:
        hint = closest(cfg.framework, names) if isinstance(cfg.framework, str) else None
        faults.append(
            f"framework={short_repr(cfg.framework)} must be one of {', '.join(names)}"
            + (f"; did you mean {hint!r}?" if hint else "")
        )
        bad.add("framework")
    return faults, bad


def _world_size(cfg: BatchConfig, faults: list[str]) -> int | None:
    by_nodes = None
    if cfg.gpus_per_node is not None:
        by_nodes = (cfg.num_nodes or 1) * cfg.gpus_per_node
    elif cfg.num_nodes is not None and cfg.world_size is None:
        faults.append(
            f"num_nodes={cfg.num_nodes} is set without gpus_per_node: set gpus_per_node "
            "(world_size = num_nodes × gpus_per_node) or set world_size directly"
        )
        return None
    if cfg.world_size is not None and by_nodes is not None and by_nodes != cfg.world_size:
        faults.append(
            f"world_size={cfg.world_size} disagrees with num_nodes × gpus_per_node = "
            f"{cfg.num_nodes or 1} × {cfg.gpus_per_node} = {by_nodes}: set world_size={by_nodes} "
            "or drop one of the two"
        )
        return None
    if cfg.world_size is not None:
        return cfg.world_size
    return by_nodes if by_nodes is not None else 1


def _dp_size(cfg: BatchConfig, world: int, faults: list[str], mesh: str) -> int | None:
    names = ("tensor_parallel", "pipeline_parallel", "context_parallel", "sequence_parallel")
    mp = math.prod(getattr(cfg, name) for name in names)
    if world % mp == 0:
        return world // mp
    below, above = (world // mp) * mp, (world // mp + 1) * mp
    world_fix = or_list([w for w in (below, above) if w > 0])
    parts = " × ".join(f"{name}={getattr(cfg, name)}" for name in names if getattr(cfg, name) > 1)
    parts = parts if "×" not in parts else f"{parts} = {mp}"
    faults.append(
        f"world_size={world} is not a multiple of the model-parallel size, {parts} (dp_size would be "
        f"{world / mp:.4g}{mesh}): set world_size to {world_fix}, or model-parallel sizes "
        f"whose product divides {world} (one of {or_list(nearest(divisors(world), mp, 3))})"
    )
    return None


def _model_dp(
    cfg: BatchConfig, role: str, dp: int | None, bad: frozenset[str], faults: list[str], mesh: str
) -> int | None:
    """The data-parallel size of the critic or the reference, from its own GPUs and model-parallel size.

    The critic without ``critic_world_size`` shares the policy's ``dp``; a reference without
    ``reference_world_size`` has none of its own (``None``).
    """
    world_field, mp_field = f"{role}_world_size", f"{role}_model_parallel"
    world, own_mp = getattr(cfg, world_field), getattr(cfg, mp_field)
    if bad & {world_field, mp_field} or dp is None:
        return None
    parallel = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel, cfg.sequence_parallel)
    if bad & {"tensor_parallel", "pipeline_parallel", "context_parallel", "sequence_parallel"}:
        return None
    mp = own_mp if own_mp is not None else math.prod(parallel)
    if world is None:
        if role == "reference":
            return None
        world = dp * math.prod(parallel)
    if world % mp:
        what = mp_field if own_mp is not None else "the policy's model-parallel size"
        faults.append(
            f"{world_field}={world} is not a multiple of {what} = {mp} (the {role}'s dp_size would be "
            f"{world / mp:.4g}{mesh}): set {world_field} to a multiple of {mp} "
            f"({or_list(multiples_near(mp, world))})"
        )
        return None
    return world // mp


def _python_ints(cfg: BatchConfig) -> BatchConfig:
    """``cfg`` with integer-like values (numpy, torch scalars) as Python ints: exact arithmetic, JSON-ready."""
    changes = {
        name: int(value)
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS
        if is_int(value := getattr(cfg, name)) and type(value) is not int
    }
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _build_plan(cfg: BatchConfig, strict: bool = False) -> BatchPlan:
    cfg = _python_ints(cfg)
    faults, invalid = _type_faults(cfg)
    bad = frozenset(invalid)
    if "framework" in bad:  # the other rules still run (batchfit's), on a framework they can compare
        cfg = dataclasses.replace(cfg, framework="batchfit")
    own = rules.batch_rules(cfg.framework)
    warnings: list[str] = []
    # every relationship among valid fields is checked, even when another field is invalid
    world = None if bad & {"world_size", "num_nodes", "gpus_per_node"} else _world_size(cfg, faults)
    parallel = {"tensor_parallel", "pipeline_parallel", "context_parallel", "sequence_parallel"}
    dp = _dp_size(cfg, world, faults, own.mesh) if world is not None and not bad & parallel else None
    has_critic = cfg.critic_mini_batch_size is not None
    critic_dp = _model_dp(cfg, "critic", dp, bad, faults, own.mesh) if has_critic else None
    reference_dp = _model_dp(cfg, "reference", dp, bad, faults, own.mesh)
    padded = own.padded_samples(cfg, dp, bad)
    policy = rules.role_layout(own, "policy", cfg, dp, bad, faults, warnings, padded)
    critic = (
        rules.role_layout(own, "critic", cfg, critic_dp, bad, faults, warnings, padded) if has_critic else None
    )
    dps = {"policy": dp, "critic": critic_dp, "reference": reference_dp}
    dps = {role: size for role, size in dps.items() if size is not None}
    complete = dp is not None and (critic_dp is not None or not has_critic)
    if world is not None and complete and "framework" not in bad:
        rules.step_rules(own, cfg, world, dps, bad, faults, warnings, padded)
    if strict:
        faults.extend(f"{w} (a warning; --strict makes it a fault)" for w in warnings)
    if faults or world is None or dp is None or policy is None or (has_critic and critic is None):
        raise BatchConfigError(faults)

    tokens = cfg.max_tokens_per_micro_batch is not None
    trajectories = cfg.train_batch_size * cfg.n_samples_per_prompt
    notes = []
    if cfg.step_wise:
        notes.append(
            "step-wise: each trajectory yields one sequence per turn, so sample counts per step, "
            "mini-batch and GPU vary; sample-level divisibility is not checked. Cut mini-batches "
            "at prompt boundaries (batchfit.batches.minibatch.mini_batch_boundaries) and pad each for data "
            "parallelism (pad_for_data_parallel); the optimizer-step count does not depend on turns."
            + own.step_wise_note
        )
        samples = per_gpu_step = forward = None
    else:
        samples = trajectories
        if padded is not None:  # the framework's padding rows (verl's)
            per_gpu_step = padded // dp
        elif policy.samples % dp:  # SkyRL's padded mini-batches
            per_gpu_step = policy.steps_per_epoch * policy.per_gpu
        else:
            per_gpu_step = samples // dp
        forward = None if tokens else -(-per_gpu_step // cfg.micro_forward_batch_size_per_gpu)
    if tokens:
        notes.append(
            f"micro-batches are bounded by max_tokens_per_micro_batch={cfg.max_tokens_per_micro_batch} "
            "tokens (batchfit.plan.packing.plan_micro_batches); micro_*_batch_size_per_gpu are not used."
        )
    if own.critic_note and has_critic and not tokens:
        notes.append(own.critic_note)
    return BatchPlan(
        config=cfg,
        world_size=world,
        dp_size=dp,
        model_parallel_size=world // dp,
        trajectories_per_step=trajectories,
        samples_per_step=samples,
        samples_per_step_per_gpu=per_gpu_step,
        forward_micro_batches_per_gpu=forward,
        micro_batching="tokens" if tokens else "samples",
        policy=_role(policy, "policy", cfg),
        critic=None if critic is None else _role(critic, "critic", cfg),
        notes=tuple(notes),
        warnings=tuple(warnings),
    )


def _role(layout: rules.RoleLayout, role: str, cfg: BatchConfig) -> RolePlan:
    return RolePlan(
        role=role,
        mini_batch_size=getattr(cfg, rules.ROLE_FIELDS[role]),
        mini_batches_per_epoch=layout.steps_per_epoch,
        optimizer_steps_per_step=layout.steps_per_epoch * cfg.update_epochs_per_batch,
        samples_per_mini_batch=layout.samples,
        samples_per_mini_batch_per_gpu=layout.per_gpu,
        micro_batch_size_per_gpu=layout.micro,
        gradient_accumulation_steps=layout.accumulation,
    )
