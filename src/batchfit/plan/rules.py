"""The batch rules of each framework: what it refuses (a fault) and what it runs with waste (a warning).

A framework's rules are one :class:`BatchRules` object: :attr:`BatchRules.role` lays out one
trained model (``policy`` or ``critic``), :attr:`BatchRules.step` checks the whole step.
:meth:`BatchConfig.plan <batchfit.plan.config.BatchConfig.plan>` takes the object that
:func:`batch_rules` finds under ``cfg.framework``. Each rule names the framework code it
mirrors, at the version batchfit's schemas are generated from
(``scripts/gen_framework_schemas.py``):

- ``batchfit``: exact splits, nothing padded or floored.
- ``skyrl`` (SkyRL 0.4.0): ``validate_batch_sizes`` floors the per-GPU sizes and asserts on
  them; the trainer drops tail prompts and pads mini-batches for data parallelism at run time.
- ``verl`` (verl 0.9.1, its default V1 trainer, ``trainer.use_v1: true``): ``validate_config``
  and the actor/critic configs' ``validate`` at start-up; the engine workers assert whole
  per-GPU mini- and micro-batches; the trainer pads each step's batch with no-op rows.

Messages use :class:`~batchfit.plan.config.BatchConfig` field names; a framework config's
reader (:mod:`batchfit.frameworks`) rewrites them in the framework's keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from batchfit.plan.arith import divisors, multiples_near, nearest, or_list

ROLE_FIELDS = {"policy": "policy_mini_batch_size", "critic": "critic_mini_batch_size"}

# The code each rule mirrors (quoted in its message).
SKYRL_VALIDATE = "SkyRL 0.4.0 skyrl/train/utils/utils.py validate_batch_sizes"
SKYRL_MESH = "SkyRL 0.4.0 skyrl/backends/skyrl_train/workers/worker.py builds the (dp, sp) device mesh"
SKYRL_STAGE = "SkyRL 0.4.0 skyrl/backends/skyrl_train/distributed/dispatch.py MeshDispatch.stage_chunks"
SKYRL_TAIL = (
    "SkyRL 0.4.0 skyrl/train/trainer.py _remove_tail_data, then skyrl/train/dataset/preprocess.py "
    "compute_prompt_mini_batch_boundaries asserts that no prompt was dropped"
)
VERL_VALIDATE = "verl 0.9.1 verl/utils/config.py validate_config"
VERL_CONFIG_VALIDATE = "verl 0.9.1 verl/workers/config/{role}.py {cls}.validate"
VERL_TRAIN_MINI = "verl 0.9.1 verl/workers/engine_workers.py TrainingWorker.train_mini_batch"
VERL_MICRO = "verl 0.9.1 verl/workers/engine/utils.py prepare_micro_batches"
VERL_UPSAMPLE = (
    "verl 0.9.1 verl/trainer/ppo/v1/trainer_base.py _balance_batch: upsample_batch_to_divisible_size "
    "to a multiple of _get_required_batch_multiple"
)
VERL_MESH = "verl 0.9.1 verl/workers/engine/fsdp/transformer_impl.py builds the (dp, sp) device mesh"


class BatchSizes(Protocol):
    """The fields of a :class:`~batchfit.plan.config.BatchConfig` that the rules read.

    A Protocol, so that the rules need not import :mod:`batchfit.plan.config` (which imports
    them). The mini-batch fields are read by name through :data:`ROLE_FIELDS`.
    """

    @property
    def train_batch_size(self) -> int: ...
    @property
    def policy_mini_batch_size(self) -> int: ...
    @property
    def critic_mini_batch_size(self) -> int | None: ...
    @property
    def n_samples_per_prompt(self) -> int: ...
    @property
    def micro_train_batch_size_per_gpu(self) -> int: ...
    @property
    def micro_forward_batch_size_per_gpu(self) -> int: ...
    @property
    def max_tokens_per_micro_batch(self) -> int | None: ...
    @property
    def step_wise(self) -> bool: ...


@dataclass(frozen=True)
class RoleLayout:
    """The numbers of one trained model's layout (``None`` where step-wise counts vary)."""

    steps_per_epoch: int
    samples: int | None
    per_gpu: int | None
    micro: int | None
    accumulation: int | None


#: ``(role, field, cfg, dp, bad, faults, warnings, padded)`` → the role's layout, or ``None``
#: when a fault was found or a field it needs is invalid (:func:`role_layout` documents the arguments).
RoleRule = Callable[
    [str, str, BatchSizes, int | None, frozenset[str], list[str], list[str], int | None], "RoleLayout | None"
]
#: ``(cfg, world, dps, bad, faults, warnings, padded)``: the whole step's rules (:func:`step_rules`).
StepRule = Callable[[BatchSizes, int, dict[str, int], frozenset[str], list[str], list[str], int | None], None]
#: ``(cfg, dp, bad)`` → the samples of a step after the framework's padding rows, or ``None``.
PaddedSamples = Callable[[BatchSizes, int | None, frozenset[str]], int | None]


def _no_step_rules(
    cfg: BatchSizes,
    world: int,
    dps: dict[str, int],
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None,
) -> None:
    del cfg, world, dps, bad, faults, warnings, padded


def _no_padding(cfg: BatchSizes, dp: int | None, bad: frozenset[str]) -> int | None:
    del cfg, dp, bad
    return None


@dataclass(frozen=True)
class BatchRules:
    """One framework's batch rules, as :meth:`BatchConfig.plan <batchfit.plan.config.BatchConfig.plan>` applies them.

    Faults go to the ``faults`` list each rule is given, waste the framework runs with to
    ``warnings``; every rule among valid fields runs (``bad`` names the invalid fields), so
    one fault does not hide another.

    Attributes:
        name: the value of :attr:`BatchConfig.framework` that selects these rules.
        role: the layout of one trained model (:data:`RoleRule`).
        step: the rules of a whole step, run once every model's dp size is known (:data:`StepRule`).
        padded_samples: the samples of a step after the framework's padding rows
            (:data:`PaddedSamples`); ``None`` from it when the framework adds none.
        mesh: why the framework refuses a world size the model-parallel size does not divide
            (``"; <code> and fails"``), appended to that fault; ``""`` for none.
        step_wise_note: a sentence appended to the plan's step-wise note.
        critic_note: a note when a critic is batched by samples (no token budget).
    """

    name: str
    role: RoleRule
    step: StepRule = _no_step_rules
    padded_samples: PaddedSamples = _no_padding
    mesh: str = ""
    step_wise_note: str = ""
    critic_note: str = ""


def role_layout(
    rules: BatchRules,
    role: str,
    cfg: BatchSizes,
    dp: int | None,
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None = None,
) -> RoleLayout | None:
    """The layout of ``role`` (``policy``/``critic``) under ``rules``.

    Every rule among valid fields is checked (``bad`` names the invalid fields), so one
    fault does not hide another. Faults go to ``faults``, waste the framework runs with to
    ``warnings``.

    Args:
        dp: the role's data-parallel size, ``None`` when it cannot be known.
        padded: the samples of a step after the framework's padding rows
            (:attr:`BatchRules.padded_samples`), or ``None``.

    Returns:
        The layout, or ``None`` when a fault was found or a field it needs is invalid.
    """
    name = ROLE_FIELDS[role]
    if name in bad or "train_batch_size" in bad or "framework" in bad:
        return None
    return rules.role(role, name, cfg, dp, bad, faults, warnings, padded)


# ------------------------------------------------------------------ shared wording


def exceeds_fault(name: str, mini: int, train: int, why: str) -> str:
    """The fault of a mini-batch (field ``name``) larger than the step; ``why`` cites the code that refuses it."""
    return (
        f"{name}={mini} exceeds train_batch_size={train} (both count prompts): a mini-batch cannot hold more "
        f"prompts than a training step{why}; set {name} to at most {train} (a divisor such as "
        f"{or_list(nearest(divisors(train), mini))}) or train_batch_size to at least {mini}"
    )


def not_multiple_fix(name: str, mini: int, train: int) -> str:
    """The fix when ``train`` is not a multiple of the mini-batch ``mini``: the nearest divisors or multiples."""
    trains = [t for t in ((train // mini) * mini, (train // mini + 1) * mini) if t > 0]
    return f"set {name} to {or_list(nearest(divisors(train), mini))} or train_batch_size to {or_list(trains)}"


def _even_split_fix(name: str, train: int, n: int, dp: int, mini: int) -> str:
    """A mini-batch size that divides ``train`` and whose samples split over ``dp``."""
    step = dp // math.gcd(n, dp)  # mini must be a multiple of this
    valid = [d for d in divisors(train) if d % step == 0]
    if valid:
        return (
            f"set {name} to {or_list(nearest(valid, mini))} (divides train_batch_size={train} "
            "and gives whole per-GPU counts)"
        )
    return f"no divisor of train_batch_size={train} works; change n_samples_per_prompt or the GPU count"


def _skyrl_mini_fix(name: str, train: int, n: int, dp: int, mini: int) -> str:
    """A mini-batch size SkyRL's floored per-GPU counts accept (validate_batch_sizes)."""
    train_per = train * n // dp
    valid = [d for d in divisors(train) if d * n // dp >= 1 and train_per % (d * n // dp) == 0]
    if valid:
        return (
            f"set {name} to {or_list(nearest(valid, mini))} (divides train_batch_size={train}, and its floored "
            f"per-GPU count divides the step's, {train_per})"
        )
    return f"no divisor of train_batch_size={train} works; change n_samples_per_prompt or the GPU count"


def micro_fault(role: str, micro: int, per_gpu: int, how: str, why: str) -> str:
    """The fault of a micro size that exceeds or does not divide the per-GPU mini-batch ``per_gpu`` (``how``
    shows its arithmetic, ``why`` cites the code)."""
    rule = "exceeds" if micro > per_gpu else "does not divide"
    return (
        f"micro_train_batch_size_per_gpu={micro} {rule} the {role}'s samples per GPU per mini-batch = {how} = "
        f"{per_gpu}{why}: set micro_train_batch_size_per_gpu to {or_list(nearest(divisors(per_gpu), micro))}, "
        "or set max_tokens_per_micro_batch to bound micro-batches by tokens"
    )


# ------------------------------------------------------------------ batchfit: exact splits


def _batchfit_role(
    role: str,
    name: str,
    cfg: BatchSizes,
    dp: int | None,
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None,
) -> RoleLayout | None:
    del warnings, padded  # batchfit runs nothing with waste
    mini, train, n = getattr(cfg, name), cfg.train_batch_size, cfg.n_samples_per_prompt
    start = len(faults)
    if mini > train:
        faults.append(exceeds_fault(name, mini, train, ""))
    elif train % mini:
        faults.append(
            f"train_batch_size={train} is not a multiple of {name}={mini} (prompts): the last mini-batch "
            f"would be partial; {not_multiple_fix(name, mini, train)}"
        )
    if bad & {"n_samples_per_prompt", "step_wise"}:
        return None
    tokens = cfg.max_tokens_per_micro_batch is not None
    samples = per_gpu = micro = accumulation = None
    if cfg.step_wise:
        if not tokens and "micro_train_batch_size_per_gpu" not in bad:
            micro = cfg.micro_train_batch_size_per_gpu  # the size is known; only the count varies
    else:
        samples = mini * n
        if dp is not None and samples % dp:
            faults.append(
                f"{name} × n_samples_per_prompt = {mini} × {n} = {samples} samples per mini-batch do not "
                f"split evenly over dp_size={dp} ({samples}/{dp} = {samples / dp:.4g} per GPU): "
                f"{_even_split_fix(name, train, n, dp, mini)}; or set step_wise=true to pad mini-batches "
                "for data parallelism"
            )
        elif dp is not None:
            per_gpu = samples // dp
            if not tokens and not bad & {"micro_train_batch_size_per_gpu", "max_tokens_per_micro_batch"}:
                micro = cfg.micro_train_batch_size_per_gpu
                if per_gpu % micro:
                    faults.append(micro_fault(role, micro, per_gpu, f"{mini} × {n} / {dp}", ""))
                else:
                    accumulation = per_gpu // micro
    if len(faults) > start:
        return None
    return RoleLayout(train // mini, samples, per_gpu, micro, accumulation)


# ------------------------------------------------------------------ SkyRL 0.4.0


def _skyrl_role(
    role: str,
    name: str,
    cfg: BatchSizes,
    dp: int | None,
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None,
) -> RoleLayout | None:
    """validate_batch_sizes, for the policy and (with its own dp size) the critic.

    SkyRL floors ``mini × n // dp`` and ``train × n // dp`` and asserts: train ≥ mini,
    train % mini == 0, at least one sample per GPU, the micro size divides the floored
    per-GPU mini-batch, and the floored per-GPU step is a multiple of it. It asserts these
    in step-wise training too (with the nominal ``n``). A mini-batch whose samples do not
    split over dp is then padded at run time (``stage_chunks``): a warning.
    """
    del padded
    mini, train, n = getattr(cfg, name), cfg.train_batch_size, cfg.n_samples_per_prompt
    start = len(faults)
    why = f" ({SKYRL_VALIDATE} asserts it)"
    if mini > train:
        faults.append(exceeds_fault(name, mini, train, why))
    elif train % mini:
        faults.append(
            f"train_batch_size={train} is not a multiple of {name}={mini} (prompts){why}: the last mini-batch "
            f"would be partial; {not_multiple_fix(name, mini, train)}"
        )
    if bad & {"n_samples_per_prompt", "step_wise"}:
        return None
    if dp is not None:
        per = mini * n // dp
        if per < 1:
            faults.append(
                f"{name} × n_samples_per_prompt = {mini} × {n} = {mini * n} samples per mini-batch are fewer than "
                f"the {role}'s dp_size={dp}: {SKYRL_VALIDATE} asserts at least one sample per GPU "
                f"({mini} × {n} // {dp} = 0); set {name} to at least {-(-dp // n)}"
            )
        else:
            micro = cfg.micro_train_batch_size_per_gpu
            if "micro_train_batch_size_per_gpu" not in bad and per % micro:
                how = f"{name} × n_samples_per_prompt // dp_size = {mini} × {n} // {dp}"
                faults.append(
                    micro_fault(role, micro, per, how, f" ({SKYRL_VALIDATE} floors it and asserts)")
                )
            train_per = train * n // dp
            if train_per % per:
                faults.append(
                    f"the {role}'s samples per GPU per step, train_batch_size × n_samples_per_prompt // dp_size = "
                    f"{train} × {n} // {dp} = {train_per}, are not a multiple of its samples per GPU per mini-batch, "
                    f"{name} × n_samples_per_prompt // dp_size = {mini} × {n} // {dp} = {per} ({SKYRL_VALIDATE} "
                    f"floors both and asserts it): {_skyrl_mini_fix(name, train, n, dp, mini)}"
                )
    if len(faults) > start:
        return None
    tokens = cfg.max_tokens_per_micro_batch is not None
    micro_ok = not tokens and not bad & {"micro_train_batch_size_per_gpu", "max_tokens_per_micro_batch"}
    micro = cfg.micro_train_batch_size_per_gpu if micro_ok else None
    if cfg.step_wise:
        return RoleLayout(train // mini, None, None, micro, None)
    samples = mini * n
    if dp is None:
        return RoleLayout(train // mini, samples, None, None, None)
    per_gpu = -(-samples // dp)
    if samples % dp:
        padded_size = per_gpu * dp
        warnings.append(
            f"each {role} mini-batch of {samples} samples is padded to {padded_size} over {dp} GPUs ({SKYRL_STAGE} "
            f"adds rows that train nothing): {100 * (padded_size - samples) / padded_size:.0f}% padding rows; "
            f"set {name} to a multiple of {dp // math.gcd(n, dp)} to avoid them"
        )
    accumulation = -(-per_gpu // micro) if micro else None
    return RoleLayout(train // mini, samples, per_gpu, micro, accumulation)


# ------------------------------------------------------------------ verl 0.9.1 (V1 trainer)


def verl_padded_samples(cfg: BatchSizes, dp: int | None, bad: frozenset[str]) -> int | None:
    """The samples of a verl step after its padding rows, or ``None`` when a field it needs is invalid.

    verl 0.9.1's V1 trainer pads each step's ``train_batch_size × n`` samples up to a
    multiple of ``lcm(dp, policy_mini × n, critic_mini × n)`` (``_get_required_batch_multiple``;
    the actor's mini-batch joins once ``trainer.critic_warmup`` steps are over, from the
    first step by default).
    """
    needed = {"train_batch_size", "policy_mini_batch_size", "n_samples_per_prompt", "critic_mini_batch_size"}
    if dp is None or bad & needed:
        return None
    multiple = _verl_multiple(cfg, dp)
    return -(-cfg.train_batch_size * cfg.n_samples_per_prompt // multiple) * multiple


def _verl_role(
    role: str,
    name: str,
    cfg: BatchSizes,
    dp: int | None,
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None,
) -> RoleLayout | None:
    """The actor's and critic's rules in verl 0.9.1.

    Start-up (``ActorConfig.validate``/``CriticConfig.validate``, without dynamic batch
    sizes): train ≥ mini. Run time: ``train_mini_batch`` asserts ``mini × n % dp == 0``
    (no floor), the actor's ``prepare_micro_batches`` that the micro size divides the
    per-GPU mini-batch. A train size that is not a multiple of the mini-batch is padded
    (:func:`step_rules`). The critic's engine always batches by tokens
    (``trainer_base.py`` gives it only token budgets; ``EngineConfig.use_dynamic_bsz``
    defaults to true), so no micro size applies to it.
    """
    del warnings
    mini, train, n = getattr(cfg, name), cfg.train_batch_size, cfg.n_samples_per_prompt
    start = len(faults)
    dynamic = cfg.max_tokens_per_micro_batch is not None
    if mini > train and not dynamic:
        cls = "ActorConfig" if role == "policy" else "CriticConfig"
        why = f" ({VERL_CONFIG_VALIDATE.format(role='actor' if role == 'policy' else 'critic', cls=cls)} refuses it)"
        faults.append(exceeds_fault(name, mini, train, why))
    if bad & {"n_samples_per_prompt", "step_wise"}:
        return None
    steps = -(-train // mini)
    if cfg.step_wise:
        return RoleLayout(steps, None, None, None, None) if len(faults) == start else None
    samples = mini * n
    per_gpu = micro = accumulation = None
    if dp is not None and samples % dp:
        step = dp // math.gcd(n, dp)
        faults.append(
            f"{name} × n_samples_per_prompt = {mini} × {n} = {samples} samples per mini-batch do not split over "
            f"dp_size={dp} ({samples}/{dp} = {samples / dp:.4g} per GPU): {VERL_TRAIN_MINI} asserts "
            f"mini_batch_size % dp_size == 0 at the first update; set {name} to a multiple of {step} "
            f"({or_list(multiples_near(step, mini))})"
        )
    elif dp is not None:
        per_gpu = samples // dp
        micro_ok = not dynamic and "micro_train_batch_size_per_gpu" not in bad
        if role == "policy" and micro_ok:
            micro = cfg.micro_train_batch_size_per_gpu
            if per_gpu % micro:
                how = f"{name} × n_samples_per_prompt / dp_size = {mini} × {n} / {dp}"
                faults.append(micro_fault(role, micro, per_gpu, how, f" ({VERL_MICRO} asserts it divides)"))
            else:
                accumulation = per_gpu // micro
    if len(faults) > start:
        return None
    if padded is not None:
        steps = padded // samples
    return RoleLayout(steps, samples, per_gpu, micro, accumulation)


# ------------------------------------------------------------------ whole-step rules


def step_rules(
    rules: BatchRules,
    cfg: BatchSizes,
    world: int,
    dps: dict[str, int],
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None = None,
) -> None:
    """The rules of a whole step (not of one model), under ``rules``.

    Args:
        world: the policy's GPUs.
        dps: model role (``policy``, ``critic``, ``reference``) → its data-parallel size,
            for the models that run.
        padded: :attr:`BatchRules.padded_samples`.
    """
    if bad & {"train_batch_size", "n_samples_per_prompt", "max_tokens_per_micro_batch"}:
        return
    rules.step(cfg, world, dps, bad, faults, warnings, padded)


def skyrl_step(
    cfg: BatchSizes,
    world: int,
    dps: dict[str, int],
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None,
) -> None:
    """SkyRL 0.4.0's rules of a whole step: ``validate_batch_sizes``' lcm and the trainer's tail prompts."""
    del world, bad, warnings, padded
    _skyrl_step(cfg.train_batch_size, cfg.n_samples_per_prompt, dps, faults)


def verl_step(
    cfg: BatchSizes,
    world: int,
    dps: dict[str, int],
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None,
) -> None:
    """verl 0.9.1's rules of a whole step: ``validate_config``, the padding rows, the log-prob pass's micro size."""
    _verl_step(cfg, world, dps["policy"], bad, faults, warnings, padded)


def _skyrl_step(train: int, n: int, dps: dict[str, int], faults: list[str]) -> None:
    # validate_batch_sizes: train × n >= lcm of the policy's and the reference's dp sizes
    # (the critic is not part of this check)
    checked = {role: dp for role, dp in dps.items() if role in ("policy", "reference")}
    lcm_checked = math.lcm(*checked.values())
    if train * n < lcm_checked:
        sizes = ", ".join(f"{role} {dp}" for role, dp in checked.items())
        faults.append(
            f"train_batch_size × n_samples_per_prompt = {train} × {n} = {train * n} samples are fewer than the "
            f"least common multiple of the data-parallel sizes ({sizes}: {lcm_checked}) ({SKYRL_VALIDATE} asserts "
            f"at least that many); set train_batch_size to at least {-(-lcm_checked // n)}"
        )
    # trainer._remove_tail_data keeps the largest prompt count whose samples split over the
    # lcm of every model's dp size (WorkerDispatch.get_lcm_dp_size: policy, critic, reference);
    # the synchronous trainer then asserts num_prompts == train_batch_size
    lcm_all = math.lcm(*dps.values())
    stride = lcm_all // math.gcd(lcm_all, n)
    if train % stride:
        kept = train // stride * stride
        sizes = ", ".join(f"{role} {dp}" for role, dp in dps.items())
        faults.append(
            f"train_batch_size × n_samples_per_prompt = {train} × {n} samples do not split over the models' "
            f"data-parallel sizes ({sizes}: lcm {lcm_all}): SkyRL keeps {kept} of {train} prompts and then fails "
            f"({SKYRL_TAIL}); set train_batch_size to a multiple of {stride} "
            f"({or_list(nearest([max(stride, kept), kept + stride], train))})"
        )


def _verl_step(
    cfg: BatchSizes,
    world: int,
    dp: int,
    bad: frozenset[str],
    faults: list[str],
    warnings: list[str],
    padded: int | None,
) -> None:
    train, n = cfg.train_batch_size, cfg.n_samples_per_prompt
    dynamic = cfg.max_tokens_per_micro_batch is not None
    if not dynamic and train * n % world:
        # validate_config (FSDP, without use_dynamic_bsz): real_train_batch_size % n_gpus == 0
        faults.append(
            f"train_batch_size × n_samples_per_prompt = {train} × {n} = {train * n} is not divisible by the "
            f"{world} GPUs ({VERL_VALIDATE}: real_train_batch_size must be divisible by the minimal batch size, "
            f"n_gpus); set train_batch_size to a multiple of {world // math.gcd(n, world)}"
        )
    if padded is None:
        return
    samples = train * n
    if padded > samples:
        multiple = _verl_multiple(cfg, dp)
        stride = multiple // math.gcd(multiple, n)
        warnings.append(
            f"verl pads each step's train_batch_size × n_samples_per_prompt = {train} × {n} = {samples} samples "
            f"with {padded - samples} rows that train nothing, to {padded}, a multiple of lcm(dp_size, samples "
            f"per mini-batch) = {multiple} ({VERL_UPSAMPLE}): {100 * (padded - samples) / padded:.0f}% of each "
            f"step's work is padding; set train_batch_size to a multiple of {stride} "
            f"({or_list(multiples_near(stride, train))}) to avoid it"
        )
    forward = cfg.micro_forward_batch_size_per_gpu
    if not dynamic and "micro_forward_batch_size_per_gpu" not in bad:
        share = padded // dp
        if share % forward:
            faults.append(
                f"micro_forward_batch_size_per_gpu={forward} does not divide each GPU's share of a step, "
                f"{padded} samples / dp_size {dp} = {share} ({VERL_MICRO} asserts it in the log-prob pass); set "
                f"micro_forward_batch_size_per_gpu to {or_list(nearest(divisors(share), forward))}"
            )


def _verl_multiple(cfg: BatchSizes, dp: int) -> int:
    n = cfg.n_samples_per_prompt
    minis = [cfg.policy_mini_batch_size] + (
        [cfg.critic_mini_batch_size] if cfg.critic_mini_batch_size else []
    )
    return math.lcm(dp, *(m * n for m in minis))


# ------------------------------------------------------------------ the rules by name

BATCHFIT = BatchRules("batchfit", role=_batchfit_role)
"""batchfit's own rules: exact splits, nothing padded or floored."""

SKYRL = BatchRules(
    "skyrl",
    role=_skyrl_role,
    step=skyrl_step,
    mesh=f"; {SKYRL_MESH} and fails",
    step_wise_note=" SkyRL still asserts its per-GPU sizes with the nominal n_samples_per_prompt.",
)
"""SkyRL 0.4.0's rules."""

VERL = BatchRules(
    "verl",
    role=_verl_role,
    step=verl_step,
    padded_samples=verl_padded_samples,
    mesh=f"; {VERL_MESH} and fails",
    critic_note=(
        "verl 0.9.1's critic batches by tokens whatever its micro sizes (trainer_base.py gives its engine only "
        "critic.ppo_infer_max_token_len_per_gpu; EngineConfig.use_dynamic_bsz defaults to true)."
    ),
)
"""verl 0.9.1's rules (its V1 trainer)."""

_REGISTERED: dict[str, BatchRules] = {}


def register_batch_rules(rules: BatchRules) -> None:
    """Make ``rules`` the rules of ``BatchConfig(framework=rules.name)``; registering a name again replaces it."""
    _REGISTERED[rules.name] = rules


def framework_names() -> tuple[str, ...]:
    """The names :attr:`BatchConfig.framework` accepts, in the order they were registered."""
    return tuple(_REGISTERED)


def batch_rules(name: str) -> BatchRules:
    """The rules registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered (the message names it and the choices).
    """
    try:
        return _REGISTERED[name]
    except KeyError:
        raise ValueError(f"framework={name!r} has no batch rules; choices: {', '.join(_REGISTERED)}") from None


for _rules in (BATCHFIT, SKYRL, VERL):
    register_batch_rules(_rules)
