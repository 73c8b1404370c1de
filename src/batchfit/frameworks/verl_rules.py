"""verl 0.9.1's batch rules (:class:`~batchfit.plan.rules.BatchRules`; its default V1 trainer,
``trainer.use_v1: true``), each citing the code it mirrors.

``validate_config`` and the actor/critic configs' ``validate`` at start-up; the engine
workers assert whole per-GPU mini- and micro-batches; the trainer pads each step's batch
with no-op rows.
"""

from __future__ import annotations

import math

from batchfit.plan.arith import divisors, multiples_near, nearest, or_list
from batchfit.plan.rules import (
    BatchRules,
    BatchSizes,
    RoleLayout,
    exceeds_fault,
    micro_fault,
)

# The code each rule mirrors (quoted in its message).
VERL_VALIDATE = "verl 0.9.1 verl/utils/config.py validate_config"
VERL_CONFIG_VALIDATE = "verl 0.9.1 verl/workers/config/{role}.py {cls}.validate"
VERL_TRAIN_MINI = "verl 0.9.1 verl/workers/engine_workers.py TrainingWorker.train_mini_batch"
VERL_MICRO = "verl 0.9.1 verl/workers/engine/utils.py prepare_micro_batches"
VERL_UPSAMPLE = (
    "verl 0.9.1 verl/trainer/ppo/v1/trainer_base.py _balance_batch: upsample_batch_to_divisible_size "
    "to a multiple of _get_required_batch_multiple"
)
VERL_MESH = "verl 0.9.1 verl/workers/engine/fsdp/transformer_impl.py builds the (dp, sp) device mesh"


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
    # Megatron (tensor × pipeline × context parallel): validate_config's minimal batch is megatron_dp ×
    # ppo_micro_batch_size_per_gpu instead, checked by the config's reader (batchfit.frameworks.verl)
    megatron = _model_parallel(cfg) > 1
    if not dynamic and not megatron and train * n % world:
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


def _model_parallel(cfg: BatchSizes) -> int:
    """tp · pp · cp of a Megatron actor (1 under FSDP, whose only model-parallel axis is Ulysses)."""
    sizes = [getattr(cfg, name, 1) for name in ("tensor_parallel", "pipeline_parallel", "context_parallel")]
    return math.prod(s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0)


def _verl_multiple(cfg: BatchSizes, dp: int) -> int:
    n = cfg.n_samples_per_prompt
    minis = [cfg.policy_mini_batch_size] + (
        [cfg.critic_mini_batch_size] if cfg.critic_mini_batch_size else []
    )
    return math.lcm(dp, *(m * n for m in minis))


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
