"""Plain-text renderings of library results (no terminal styling; the CLI adds that).

NOTE [ Rendering reads views ]: the plans render themselves (``str(BatchPlan)``,
``MicroBatchPlan.describe()``) through this module, so it must not import them back, not even
for type hints (an import circle, tests/test_imports.py). Each function takes a read-only view
(a :class:`~typing.Protocol`) naming exactly the fields it reads; the plans' frozen dataclasses
satisfy them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from batchfit.plan.rules import batch_rules


class ConfigView(Protocol):
    """What :func:`plan_tree_text` reads of a :class:`~batchfit.plan.config.BatchConfig`."""

    @property
    def train_batch_size(self) -> int: ...
    @property
    def n_samples_per_prompt(self) -> int: ...
    @property
    def step_wise(self) -> bool: ...
    @property
    def update_epochs_per_batch(self) -> int: ...
    @property
    def micro_forward_batch_size_per_gpu(self) -> int: ...
    @property
    def max_tokens_per_micro_batch(self) -> int | None: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def pipeline_parallel(self) -> int: ...
    @property
    def context_parallel(self) -> int: ...
    @property
    def sequence_parallel(self) -> int: ...
    @property
    def framework(self) -> str: ...


class RoleView(Protocol):
    """What :func:`plan_tree_text` reads of a :class:`~batchfit.plan.config.RolePlan`."""

    @property
    def role(self) -> str: ...
    @property
    def mini_batch_size(self) -> int: ...
    @property
    def mini_batches_per_epoch(self) -> int: ...
    @property
    def optimizer_steps_per_step(self) -> int: ...
    @property
    def samples_per_mini_batch(self) -> int | None: ...
    @property
    def samples_per_mini_batch_per_gpu(self) -> int | None: ...
    @property
    def micro_batch_size_per_gpu(self) -> int | None: ...
    @property
    def gradient_accumulation_steps(self) -> int | None: ...


class BatchPlanView(Protocol):
    """What :func:`plan_tree_text` reads of a :class:`~batchfit.plan.config.BatchPlan`."""

    @property
    def config(self) -> ConfigView: ...
    @property
    def world_size(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def model_parallel_size(self) -> int: ...
    @property
    def trajectories_per_step(self) -> int: ...
    @property
    def samples_per_step(self) -> int | None: ...
    @property
    def samples_per_step_per_gpu(self) -> int | None: ...
    @property
    def forward_micro_batches_per_gpu(self) -> int | None: ...
    @property
    def micro_batching(self) -> str: ...
    @property
    def roles(self) -> Sequence[RoleView]: ...
    @property
    def notes(self) -> Sequence[str]: ...
    @property
    def warnings(self) -> Sequence[str]: ...


class MicroBatchPlanView(Protocol):
    """What :func:`micro_batch_plan_text` and :func:`split_text` read of a :class:`~batchfit.plan.packing.MicroBatchPlan`."""

    @property
    def num_micro_batches(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def token_budget(self) -> int: ...
    @property
    def cost(self) -> str: ...
    @property
    def utilization(self) -> float: ...
    @property
    def lower_bound(self) -> int: ...
    @property
    def num_padding_micro_batches(self) -> int: ...
    @property
    def oversize(self) -> Sequence[int]: ...
    @property
    def split(self) -> Sequence[tuple[int, int]]: ...
    @property
    def split_extra_forwards(self) -> int: ...


def _varies(value: int | None) -> str:
    return "varies (step-wise)" if value is None else f"{value:,}"


def _role_lines(role: RoleView, plan: BatchPlanView, last: bool) -> list[str]:
    cfg = plan.config
    lead, pad = ("└─ ", "   ") if last else ("├─ ", "│  ")
    lines = [f"{lead}{role.role}: mini-batch of {role.mini_batch_size:,} prompts"]
    items = [
        f"mini-batches per epoch: {role.mini_batches_per_epoch:,} "
        + (
            f"(= {cfg.train_batch_size:,} / {role.mini_batch_size:,})"
            if cfg.train_batch_size % role.mini_batch_size == 0
            else f"(= ⌈{cfg.train_batch_size:,} / {role.mini_batch_size:,}⌉, the last partial)"
        ),
        f"optimizer steps per training step: {role.optimizer_steps_per_step:,} "
        f"(= {role.mini_batches_per_epoch:,} × {cfg.update_epochs_per_batch} epochs)",
        f"samples per mini-batch: {_varies(role.samples_per_mini_batch)}",
        f"samples per mini-batch per GPU: {_varies(role.samples_per_mini_batch_per_gpu)}",
    ]
    if plan.micro_batching == "tokens":
        items.append(f"micro-batches: by token budget ({cfg.max_tokens_per_micro_batch:,} tokens)")
    elif role.gradient_accumulation_steps is not None:
        items.append(
            f"gradient accumulation: {role.gradient_accumulation_steps:,} micro-batches of "
            f"{role.micro_batch_size_per_gpu:,} samples per GPU"
        )
    elif role.micro_batch_size_per_gpu is not None:
        items.append(f"micro-batches of {role.micro_batch_size_per_gpu:,} samples per GPU (count varies)")
    for i, item in enumerate(items):
        lines.append(f"{pad}{'└─ ' if i == len(items) - 1 else '├─ '}{item}")
    return lines


def plan_tree_text(plan: BatchPlanView) -> str:
    """A readable tree of a :class:`~batchfit.plan.config.BatchPlan` (what ``str(plan)`` returns)."""
    cfg = plan.config
    mp = (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.context_parallel, cfg.sequence_parallel)
    lines = [
        f"training step: {cfg.train_batch_size:,} prompts × {cfg.n_samples_per_prompt} samples = "
        f"{plan.trajectories_per_step:,} trajectories"
        + (" (one sequence per turn)" if cfg.step_wise else ""),
        f"├─ GPUs: {plan.world_size} = dp {plan.dp_size} × model-parallel {plan.model_parallel_size} "
        f"(tp {mp[0]} · pp {mp[1]} · cp {mp[2]} · sp {mp[3]})",
        f"├─ samples per step: {_varies(plan.samples_per_step)}"
        + ("" if plan.samples_per_step_per_gpu is None else f" ({plan.samples_per_step_per_gpu:,} per GPU)"),
    ]
    if plan.forward_micro_batches_per_gpu is not None:
        lines.append(
            f"├─ forward passes per GPU: {plan.forward_micro_batches_per_gpu:,} micro-batches of "
            f"≤ {cfg.micro_forward_batch_size_per_gpu:,} samples"
        )
    if cfg.framework != "batchfit":
        rules = batch_rules(cfg.framework)
        lines.insert(1, f"├─ rules: {rules.display or rules.name}'s")
    roles = plan.roles
    tail = [f"warning: {w}" for w in plan.warnings] + [f"note: {n}" for n in plan.notes]
    for i, role in enumerate(roles):
        lines.extend(_role_lines(role, plan, last=i == len(roles) - 1 and not tail))
    for i, item in enumerate(tail):
        lines.append(f"{'└─ ' if i == len(tail) - 1 else '├─ '}{item}")
    return "\n".join(lines)


def split_text(plan: MicroBatchPlanView) -> str:
    """``"k sequences split into n chunks (m extra forwards)"`` of a plan made with ``oversize="split"``, or ``""``.

    Example:
        >>> from batchfit.plan.packing import plan_micro_batches
        >>> split_text(plan_micro_batches([8, 3], 4, oversize="split"))  # 8 tokens: passes of 4, 4 and 2
        '1 sequence split into 3 chunks (2 extra forwards)'
    """
    if not plan.split:
        return ""
    k, n, m = len(plan.split), sum(chunks for _, chunks in plan.split), plan.split_extra_forwards
    return f"{k} sequence{'s' if k != 1 else ''} split into {n} chunks ({m} extra forward{'s' if m != 1 else ''})"


def micro_batch_plan_text(plan: MicroBatchPlanView) -> str:
    """What ``MicroBatchPlan.describe()`` returns: counts, budget and use, one item a line."""
    lines = [
        f"{plan.num_micro_batches:,} micro-batches per rank × {plan.dp_size} rank{'s' if plan.dp_size != 1 else ''} "
        f"for {plan.num_sequences:,} sequences (token budget {plan.token_budget:,}, {plan.cost} cost)",
        f"├─ use of the budget: {plan.utilization:.1%}, lower bound {plan.lower_bound:,} micro-batches per rank",
        f"├─ padding micro-batches: {plan.num_padding_micro_batches:,}",
    ]
    alone = len(plan.oversize) - len(plan.split)
    if alone:
        lines.append(f"├─ {alone:,} sequence{'s' if alone != 1 else ''} over the budget, each alone in a micro-batch")
    if plan.split:
        lines.append(f"├─ {split_text(plan)}")
    lines[-1] = "└─" + lines[-1][2:]
    return "\n".join(lines)
