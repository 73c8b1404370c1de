"""Profile the run a framework config describes: every model role, and each forward-only pass.

:func:`profile_run` turns a :class:`~batchfit.frameworks.run.RunConfig` into the calls of
:func:`batchfit.budget.profile.profile_model` that its run makes: the policy's training step
and its old-log-prob pass, the critic's training step and value pass, the reference's
log-prob pass. Models that share GPUs (the config's ``colocated``) are profiled with the
state the others keep on the device (``resident``) taken off the usable memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchfit.budget.options import ProfileOptions
from batchfit.budget.profile import ModelProfile, profile_model, resident_state_bytes
from batchfit.budget.token_budget import TokenBudget
from batchfit.errors import InvalidArgument
from batchfit.frameworks.run import RunConfig

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
    """

    run: RunConfig
    profiles: dict[str, ModelProfile]
    resident: dict[str, int] = field(default_factory=dict)

    @property
    def budgets(self) -> dict[str, TokenBudget]:
        """Every pass → its budget (``policy``, ``policy_forward``, ``critic``, ...)."""
        return {role: b for profile in self.profiles.values() for role, b in profile.budgets.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the vocabulary, what was read, each model's profile, the resident bytes."""
        run = self.run
        return {
            "vocabulary": run.vocabulary,
            "models": run.models,
            "max_seq_len": run.max_seq_len,
            "colocated": list(run.colocated),
            "resident_bytes": self.resident,
            "tokens": {role: b.tokens for role, b in self.budgets.items()},
            "profiles": {name: p.to_dict() for name, p in self.profiles.items()},
        }


def profile_run(run: RunConfig, options: ProfileOptions) -> RunProfile:
    """Profile every pass of ``run`` (its models from ``run.models``) with ``options``.

    Args:
        run: from :func:`batchfit.frameworks.read_run_config`; ``run.models`` must name
            each model (override with ``run.replace(model=...)``).
        options: as for :func:`batchfit.budget.profile_model` (``dtype`` is the trained
            models'; the reference is profiled in bf16 unless it is given).

    Returns:
        A :class:`RunProfile`.

    Raises:
        InvalidArgument: a model role without a model.
        DoesNotFitError: a pass does not fit one sequence of ``options.max_seq_len``.
    """
    models = run.models
    for role, model in models.items():
        if not model:
            raise InvalidArgument(
                f"the config names no {role} model; pass --model PRESET|DIR (a preset, or a directory with config.json)"
            )
    resident = {
        role: resident_state_bytes(
            models[role], PASSES[role][0], _for_role(role, options), kinds=run.resident.get(role, ())
        )
        for role in models
        if role in run.colocated and run.resident.get(role)
    }
    profiles = {}
    for role, model in models.items():
        others = sum(b for other, b in resident.items() if other != role)
        profiles[role] = profile_model(model, _for_role(role, options), roles=PASSES[role], resident_bytes=others)
    return RunProfile(run=run, profiles=profiles, resident=resident)


def _for_role(role: str, options: ProfileOptions) -> ProfileOptions:
    """A frozen reference is loaded in bf16 unless a dtype is given (verl fsdp_workers: fp32 only for the actor)."""
    return options.replace(dtype=REFERENCE_DTYPE) if role == "reference" and options.dtype is None else options
