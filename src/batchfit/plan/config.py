"""Batch plans: validate and explain train / mini / micro batch sizes and the data-parallel layout.

:class:`BatchConfig` holds the user's numbers (SkyRL's names and units);
:meth:`BatchConfig.plan` checks every rule at once and returns a frozen :class:`BatchPlan`,
or raises one :class:`~batchfit.errors.BatchConfigError` listing every fault with a fix.

Units: ``train_batch_size`` and the ``*_mini_batch_size`` fields count **prompts**; the
``micro_*_per_gpu`` fields count **samples** (sequences); ``max_tokens_per_micro_batch``
counts tokens. One rule set serves policy and critic (:func:`_role_plan`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from batchfit.errors import BatchConfigError
from batchfit.plan.render import plan_tree_text
from batchfit.validation import closest, is_int

FRAMEWORKS = ("batchfit", "skyrl", "verl")
"""Whose batch rules a plan follows (:attr:`BatchConfig.framework`)."""


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
        framework: whose rules the plan follows, one of :data:`FRAMEWORKS`: ``"batchfit"``
            (exact splits), ``"skyrl"`` or ``"verl"`` (what that framework runs, even with
            waste, is a warning; what it refuses or silently changes is a fault).
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
    framework: str = "batchfit"

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """Names of the configuration fields, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes: Any) -> BatchConfig:
        """A copy with ``changes`` applied (nothing is checked until :meth:`plan`)."""
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
        return _build_plan(self, strict=strict)

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
    "max_tokens_per_micro_batch",
    "world_size",
    "num_nodes",
    "gpus_per_node",
)
_ROLE_FIELDS = {"policy": "policy_mini_batch_size", "critic": "critic_mini_batch_size"}


# Trial division stops here: fixes need some divisors, not all, and time must not grow with n.
_DIVISOR_SEARCH_LIMIT = 100_000


def _divisors(n: int) -> list[int]:
    """Divisors of ``n``, increasing: all of them up to ``n = _DIVISOR_SEARCH_LIMIT²`` (10¹⁰);
    above, those up to the limit and their co-divisors (O(limit) time, for a suggested fix)."""
    small, large = [], []
    for i in range(1, min(math.isqrt(n), _DIVISOR_SEARCH_LIMIT) + 1):
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
    return small + large[::-1]


def _nearest(candidates: Iterable[int], value: int, k: int = 2) -> list[int]:
    """The ``k`` candidates closest to ``value`` (ties to the smaller), in increasing order."""
    return sorted(sorted(set(candidates), key=lambda c: (abs(c - value), c))[:k])


def _or_list(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def _type_faults(cfg: BatchConfig) -> tuple[list[str], set[str]]:
    """Faults of single fields, and the names of the invalid fields."""
    faults, bad = [], set()
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(cfg, name)
        if value is None and name in _OPTIONAL_INT_FIELDS:
            continue
        if not is_int(value) or value < 1:
            what = "an integer >= 1" + (" or None" if name in _OPTIONAL_INT_FIELDS else "")
            faults.append(f"{name}={value!r} must be {what}")
            bad.add(name)
    if not isinstance(cfg.step_wise, bool):
        faults.append(f"step_wise={cfg.step_wise!r} must be true or false")
        bad.add("step_wise")
    if cfg.framework not in FRAMEWORKS:
        hint = closest(str(cfg.framework), FRAMEWORKS)
        faults.append(
            f"framework={cfg.framework!r} must be one of {', '.join(FRAMEWORKS)}"
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


def _dp_size(cfg: BatchConfig, world: int, faults: list[str]) -> int | None:
    parts = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel, cfg.sequence_parallel)
    mp = math.prod(parts)
    if world % mp == 0:
        return world // mp
    below, above = (world // mp) * mp, (world // mp + 1) * mp
    world_fix = _or_list([w for w in (below, above) if w > 0])
    faults.append(
        f"world_size={world} is not a multiple of tensor_parallel × pipeline_parallel × context_parallel "
        f"× sequence_parallel = {' × '.join(map(str, parts))} = {mp} (dp_size would be {world / mp:.4g}): "
        f"set world_size to {world_fix}, or model-parallel sizes whose product divides {world} "
        f"(one of {_or_list(_nearest(_divisors(world), mp, 3))})"
    )
    return None


def _role_plan(
    role: str,
    cfg: BatchConfig,
    dp: int | None,
    faults: list[str],
    bad: frozenset[str] = frozenset(),
    warnings: list[str] | None = None,
) -> RolePlan | None:
    """The one rule set for a trained model; ``role`` picks the mini-batch field.

    Only relationships among valid fields are checked (``bad`` names the invalid ones), so
    one invalid field does not hide the faults between the others. Where
    ``cfg.framework`` runs a layout with waste, the waste goes to ``warnings`` instead of
    ``faults`` (each rule cites the framework code it mirrors).
    """
    warnings = [] if warnings is None else warnings
    name = _ROLE_FIELDS[role]
    if name in bad or "train_batch_size" in bad or "framework" in bad:
        return None
    mini, train, n = getattr(cfg, name), cfg.train_batch_size, cfg.n_samples_per_prompt
    start = len(faults)
    steps_per_epoch = train // mini
    if mini > train:
        faults.append(
            f"{name}={mini} exceeds train_batch_size={train} (both count prompts): a mini-batch cannot "
            f"hold more prompts than a training step; set {name} to at most {train} "
            f"(a divisor such as {_or_list(_nearest(_divisors(train), mini))}) or train_batch_size to at least {mini}"
        )
    elif train % mini:
        fix = (
            f"set {name} to {_or_list(_nearest(_divisors(train), mini))} or train_batch_size to "
            f"{_or_list([t for t in ((train // mini) * mini, (train // mini + 1) * mini) if t > 0])}"
        )
        if cfg.framework == "verl":
            # verl: DataProto.split keeps a short last chunk (protocol.py), one more step
            steps_per_epoch = -(-train // mini)
            warnings.append(
                f"train_batch_size={train} is not a multiple of {name}={mini} (prompts): verl runs "
                f"{steps_per_epoch} mini-batches per epoch, the last with {train % mini} prompts; {fix}"
            )
        else:  # SkyRL: validate_batch_sizes asserts train_batch_size % policy_mini_batch_size == 0
            faults.append(
                f"train_batch_size={train} is not a multiple of {name}={mini} (prompts): the last "
                f"mini-batch would be partial; {fix}"
            )
    if len(faults) > start:
        return None

    samples = per_gpu = micro = accumulation = None
    if bad & {"n_samples_per_prompt", "step_wise"}:
        return None
    if cfg.step_wise:
        # The micro size is known; only the count varies with the turns.
        if cfg.max_tokens_per_micro_batch is None and "micro_train_batch_size_per_gpu" not in bad:
            micro = cfg.micro_train_batch_size_per_gpu
    else:
        samples = mini * n
        if dp is not None:
            per_gpu = samples // dp
            if samples % dp:
                if not _uneven_split(role, name, cfg, dp, samples, faults, warnings):
                    return None
                per_gpu = -(-samples // dp)  # SkyRL pads the mini-batch to a multiple of dp
            if bad & {"micro_train_batch_size_per_gpu", "max_tokens_per_micro_batch"}:
                return None
            # SkyRL's validate_batch_sizes checks the micro size even with the token key
            if cfg.max_tokens_per_micro_batch is None or cfg.framework == "skyrl":
                micro = cfg.micro_train_batch_size_per_gpu
                checked = samples // dp  # SkyRL and verl both check the floored per-GPU count
                if checked % micro:
                    rule = "exceeds" if micro > checked else "does not divide"
                    faults.append(
                        f"micro_train_batch_size_per_gpu={micro} {rule} the {role}'s samples per GPU per "
                        f"mini-batch = {mini} × {n} / {dp} = {checked}: set micro_train_batch_size_per_gpu to "
                        f"{_or_list(_nearest(_divisors(checked), micro))}, or set max_tokens_per_micro_batch "
                        "to bound micro-batches by tokens"
                    )
                    return None
                if cfg.max_tokens_per_micro_batch is None:
                    accumulation = -(-per_gpu // micro)
                else:
                    micro = None
    return RolePlan(
        role=role,
        mini_batch_size=mini,
        mini_batches_per_epoch=steps_per_epoch,
        optimizer_steps_per_step=steps_per_epoch * cfg.update_epochs_per_batch,
        samples_per_mini_batch=samples,
        samples_per_mini_batch_per_gpu=per_gpu,
        micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accumulation,
    )


def _uneven_split(
    role: str, name: str, cfg: BatchConfig, dp: int, samples: int, faults: list[str], warnings: list[str]
) -> bool:
    """Samples of a mini-batch that do not split over ``dp``: a warning (padded) or a fault.

    Returns True when the framework pads the mini-batch and runs it.
    """
    mini, train, n = getattr(cfg, name), cfg.train_batch_size, cfg.n_samples_per_prompt
    if cfg.framework == "skyrl":
        # SkyRL: MeshDispatch.stage_chunks pads each mini-batch by (-size) % dp_size rows
        # (loss_mask 0) before chunking it over the ranks; validate_batch_sizes floors.
        padded = -(-samples // dp) * dp
        if samples // dp < 1:
            faults.append(
                f"{name} × n_samples_per_prompt = {mini} × {n} = {samples} samples per mini-batch are "
                f"fewer than the {role}'s dp_size={dp}: SkyRL asserts at least one sample per GPU "
                f"(validate_batch_sizes); set {name} to at least {-(-dp // n)}"
            )
            return False
        warnings.append(
            f"each {role} mini-batch of {samples} samples is padded to {padded} over {dp} GPUs: "
            f"{100 * (padded - samples) / padded:.0f}% padding rows; set {name} to a multiple of "
            f"{dp // math.gcd(n, dp)} to avoid them"
        )
        return True
    step = dp // math.gcd(n, dp)  # mini must be a multiple of this
    valid = [d for d in _divisors(train) if d % step == 0]
    fix = (
        f"set {name} to {_or_list(_nearest(valid, mini))} (divides train_batch_size={train} "
        "and gives whole per-GPU counts)"
        if valid
        else f"no divisor of train_batch_size={train} works; change n_samples_per_prompt or the GPU count"
    )
    if cfg.framework == "verl":
        # verl: fsdp_workers normalises ppo_mini_batch_size *= n; //= dp (a floor, unchecked)
        faults.append(
            f"{name} × n = {mini} × {n} = {samples} samples per mini-batch do not split over dp_size={dp}: "
            f"verl floors them to {samples // dp} per GPU, so each optimizer step trains on "
            f"{samples // dp * dp} of {samples} samples; {fix}"
        )
        return False
    faults.append(
        f"{name} × n_samples_per_prompt = {mini} × {n} = {samples} samples per mini-batch do not "
        f"split evenly over dp_size={dp} ({samples}/{dp} = {samples / dp:.4g} per GPU): {fix}; "
        "or set step_wise=true to pad mini-batches for data parallelism"
    )
    return False


def _python_ints(cfg: BatchConfig) -> BatchConfig:
    """``cfg`` with integer-like values (numpy, torch scalars) as Python ints: exact arithmetic, JSON-ready."""
    changes = {
        name: int(value)
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS
        if is_int(value := getattr(cfg, name)) and type(value) is not int
    }
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _critic_dp(cfg: BatchConfig, dp: int | None, bad: frozenset[str], faults: list[str]) -> int | None:
    """The critic's data-parallel size: the policy's, or from its own ``critic_world_size``."""
    if cfg.critic_world_size is None or "critic_world_size" in bad or dp is None:
        return dp
    mp = math.prod((cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel, cfg.sequence_parallel))
    if cfg.critic_world_size % mp:
        faults.append(
            f"critic_world_size={cfg.critic_world_size} is not a multiple of the model-parallel size {mp}: "
            f"set critic_world_size to a multiple of {mp}"
        )
        return None
    return cfg.critic_world_size // mp


def _step_faults(cfg: BatchConfig, world: int, dps: list[int], bad: frozenset[str], faults: list[str]) -> None:
    """Whole-step rules of the frameworks (not of one role)."""
    if bad & {"train_batch_size", "n_samples_per_prompt", "max_tokens_per_micro_batch"}:
        return
    train, n = cfg.train_batch_size, cfg.n_samples_per_prompt
    if cfg.framework == "skyrl":
        # SkyRL trainer._remove_tail_data keeps the largest prompt count whose samples split
        # over the lcm of the models' dp sizes; the synchronous trainer then asserts
        # num_prompts == train_batch_size (compute_prompt_mini_batch_boundaries).
        lcm_dp = math.lcm(*dps)
        stride = lcm_dp // math.gcd(lcm_dp, n)
        if train % stride:
            kept = train // stride * stride
            faults.append(
                f"train_batch_size × n_samples_per_prompt = {train} × {n} samples do not split over the "
                f"models' data-parallel sizes (lcm {lcm_dp}): SkyRL keeps {kept} of {train} prompts "
                f"(trainer._remove_tail_data) and then fails its num_prompts == train_batch_size check; "
                f"set train_batch_size to a multiple of {stride} ({_or_list(_nearest([max(stride, kept), kept + stride], train))})"
            )
    elif cfg.framework == "verl" and cfg.max_tokens_per_micro_batch is None and train * n % world:
        # verl utils/config.py validate_config (without use_dynamic_bsz): real_train_batch_size
        # = train_batch_size × n must be divisible by n_gpus
        faults.append(
            f"data.train_batch_size × rollout.n = {train} × {n} = {train * n} is not divisible by the "
            f"{world} GPUs (verl validate_config: real_train_batch_size must be divisible by the minimal "
            f"batch size); set data.train_batch_size to a multiple of {world // math.gcd(n, world)}"
        )


def _build_plan(cfg: BatchConfig, strict: bool = False) -> BatchPlan:
    cfg = _python_ints(cfg)
    faults, invalid = _type_faults(cfg)
    bad = frozenset(invalid)
    warnings: list[str] = []
    # every relationship among valid fields is checked, even when another field is invalid
    world = None if bad & {"world_size", "num_nodes", "gpus_per_node"} else _world_size(cfg, faults)
    parallel = {"tensor_parallel", "pipeline_parallel", "context_parallel", "sequence_parallel"}
    dp = _dp_size(cfg, world, faults) if world is not None and not bad & parallel else None
    critic_dp = _critic_dp(cfg, dp, bad, faults)
    policy = _role_plan("policy", cfg, dp, faults, bad, warnings)
    critic = None
    if cfg.critic_mini_batch_size is not None:
        critic = _role_plan("critic", cfg, critic_dp, faults, bad, warnings)
    if world is not None and dp is not None and critic_dp is not None and "framework" not in bad:
        _step_faults(cfg, world, [dp] + ([critic_dp] if critic is not None else []), bad, faults)
    if strict:
        faults.extend(f"{w} (a warning; --strict makes it a fault)" for w in warnings)
    if faults or world is None or dp is None or policy is None:  # without faults all three exist
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
        )
        samples = per_gpu_step = forward = None
    else:
        samples = trajectories
        per_gpu_step = samples // dp
        if policy.samples_per_mini_batch % dp:  # padded mini-batches (SkyRL)
            per_gpu_step = policy.mini_batches_per_epoch * policy.samples_per_mini_batch_per_gpu
        forward = None if tokens else -(-per_gpu_step // cfg.micro_forward_batch_size_per_gpu)
    if tokens:
        notes.append(
            f"micro-batches are bounded by max_tokens_per_micro_batch={cfg.max_tokens_per_micro_batch} "
            "tokens (batchfit.plan.packing.plan_micro_batches); micro_*_batch_size_per_gpu are not used."
        )
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
        policy=policy,
        critic=critic,
        notes=tuple(notes),
        warnings=tuple(warnings),
    )
