"""SkyRL 0.4.0's batch rules (:class:`~batchfit.plan.rules.BatchRules`), each citing the code it mirrors.

``validate_batch_sizes`` floors the per-GPU sizes and asserts on them; the trainer drops tail
prompts and pads mini-batches for data parallelism at run time.
"""

from __future__ import annotations

import math

from batchfit.plan.arith import divisors, nearest, or_list
from batchfit.plan.rules import (
    BatchRules,
    BatchSizes,
    RoleLayout,
    exceeds_fault,
    micro_fault,
    not_multiple_fix,
)

# The code each rule mirrors (quoted in its message).
SKYRL_VALIDATE = "SkyRL 0.4.0 skyrl/train/utils/utils.py validate_batch_sizes"
SKYRL_MESH = "SkyRL 0.4.0 skyrl/backends/skyrl_train/workers/worker.py builds the (dp, sp) device mesh"
SKYRL_STAGE = "SkyRL 0.4.0 skyrl/backends/skyrl_train/distributed/dispatch.py MeshDispatch.stage_chunks"
SKYRL_TAIL = (
    "SkyRL 0.4.0 skyrl/train/trainer.py _remove_tail_data, then skyrl/train/dataset/preprocess.py "
    "compute_prompt_mini_batch_boundaries asserts that no prompt was dropped"
)


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


SKYRL = BatchRules(
    "skyrl",
    role=_skyrl_role,
    display="SkyRL",
    step=skyrl_step,
    mesh=f"; {SKYRL_MESH} and fails",
    step_wise_note=" SkyRL still asserts its per-GPU sizes with the nominal n_samples_per_prompt.",
)
"""SkyRL 0.4.0's rules."""
