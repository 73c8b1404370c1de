"""``profile_model``: the token budget of a model preset for each RL role, and their combination.

What ``batchfit profile`` calls: builds the policy (causal LM, trained), the critic (value
head, trained) and/or the reference (causal LM, forward-only log-probs under ``no_grad``)
from a preset, a directory or a hub id with :mod:`batchfit.models`, runs
:func:`~batchfit.budget.find.find_token_budget` for each role on one backend and combines
them with :meth:`TokenBudget.min`.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.budget.find import ProgressCallback, find_token_budget
from batchfit.budget.token_budget import TokenBudget
from batchfit.errors import InvalidArgument
from batchfit.validation import check_choice

ROLES = ("policy", "critic", "reference")


@dataclass(frozen=True)
class ModelProfile:
    """Token budgets of one model for each role, and the budget every role can share.

    Attributes:
        model: the model spec profiled (preset, directory or hub id).
        dtype: parameter dtype name.
        gradient_checkpointing: activation checkpointing was on.
        logprobs: how log-probs were computed (``full``, ``chunked``, ``fused``).
        backend: the backend's name (``cpu``, ``estimate``, ``cuda``).
        memory_limit: device bytes (``None`` = the device's own, cuda).
        reserve_bytes: bytes of ``memory_limit`` no tracker sees.
        budgets: role -> its :class:`TokenBudget`, in the order profiled.
        combined: :meth:`TokenBudget.min` of the budgets (the one to configure).
    """

    model: str
    dtype: str
    gradient_checkpointing: bool
    logprobs: str
    backend: str
    memory_limit: int | None
    reserve_bytes: int
    budgets: dict[str, TokenBudget]
    combined: TokenBudget

    def to_dict(self) -> dict[str, Any]:
        """Settings, each role's budget and the combined budget as plain values (JSON-ready)."""
        return {
            "model": self.model,
            "dtype": self.dtype,
            "gradient_checkpointing": self.gradient_checkpointing,
            "logprobs": self.logprobs,
            "backend": self.backend,
            "memory_limit": self.memory_limit,
            "reserve_bytes": self.reserve_bytes,
            "tokens": self.combined.tokens,
            "binding_role": self.combined.binding_role,
            "roles": {role: b.to_dict() for role, b in self.budgets.items()},
        }


def check_roles(roles: str | Sequence[str]) -> tuple[str, ...]:
    """Roles from ``"policy,critic"`` or a sequence; each must be one of :data:`ROLES`, no repeats."""
    items = [r.strip() for r in roles.split(",")] if isinstance(roles, str) else list(roles)
    if not items or any(not r for r in items):
        raise InvalidArgument(f"roles must name at least one of {', '.join(ROLES)}, but got roles={roles!r}")
    for r in items:
        check_choice("--roles", r, ROLES)
    if len(set(items)) != len(items):
        raise InvalidArgument(f"roles must not repeat a role, but got roles={roles!r}; list each role once")
    return tuple(items)


def profile_model(
    model: str = "tiny",
    *,
    max_seq_len: int,
    roles: str | Sequence[str] = ("policy",),
    backend: str = "auto",
    memory_limit: int | str | None = None,
    dtype: str = "bf16",
    gradient_checkpointing: bool = False,
    logprobs: str = "full",
    cost: str = "padded",
    safety_margin: float = 0.9,
    seq_lens: Sequence[int] | None = None,
    progress: bool | ProgressCallback = False,
) -> ModelProfile:
    """Build ``model`` for each role and find its token budget; combine the roles.

    The policy and the critic train with AdamW (state initialised before measuring); the
    policy's loss is a per-token log-prob mean, the critic's a masked MSE of a value head; the
    reference runs forward-only log-probs under ``no_grad`` (its budget bounds forward
    micro-batches: reference and old log-probs). See :func:`batchfit.models.causal_lm_step`.

    Args:
        model: preset name (``tiny``, ``qwen2.5-0.5b``, …), local directory with
            ``config.json``, or hub id (config only).
        max_seq_len, cost, safety_margin, seq_lens, progress: as
            :func:`~batchfit.budget.find.find_token_budget` (``progress`` events carry the role).
        roles: any of ``"policy"``, ``"critic"``, ``"reference"`` (``"policy,critic"``).
        logprobs: ``full`` (fp32 ``log_softmax`` of the whole logits), ``chunked``
            (:func:`batchfit.logprobs.logprobs_from_logits`) or ``fused``
            (:func:`batchfit.logprobs.logprobs_from_hidden`, no ``[B, S, V]`` logits).
        backend: ``auto`` (cuda if available, else estimate), ``cpu``, ``estimate``, ``cuda``.
        memory_limit: bytes, ``"80GiB"`` or a device preset; required for cpu and estimate.
        dtype: ``bf16``, ``fp32`` (or any name :func:`batchfit.models.parse_dtype` accepts).
        gradient_checkpointing: non-reentrant activation checkpointing of every layer.

    Returns:
        :class:`ModelProfile`.

    Raises:
        InvalidArgument: bad model, memory, dtype, roles or search arguments.
        DoesNotFitError: one sequence of ``max_seq_len`` does not fit for some role.

    Example:
        >>> p = profile_model("tiny", max_seq_len=512, backend="estimate", memory_limit="1GiB")  # doctest: +SKIP
        >>> p.combined.tokens                                                                    # doctest: +SKIP
    """
    from batchfit.memory import get_backend
    from batchfit.models import build_causal_lm, causal_lm_step, load_config, parse_dtype
    from batchfit.models.step import LOGPROBS

    chosen_roles = check_roles(roles)
    logprobs = check_choice("--logprobs", logprobs, LOGPROBS)
    torch_dtype = parse_dtype(dtype)
    load_config(model)  # a bad spec fails here, before any backend work
    be = get_backend(backend, memory_limit=memory_limit)
    budgets: dict[str, TokenBudget] = {}
    for role in chosen_roles:
        net = build_causal_lm(
            model,
            backend=be,
            dtype=torch_dtype,
            gradient_checkpointing=gradient_checkpointing,
            value_head=role == "critic",
        )
        step = causal_lm_step(net, backend=be, logprobs=logprobs, forward_only=role == "reference")
        budgets[role] = find_token_budget(
            step,
            max_seq_len=max_seq_len,
            safety_margin=safety_margin,
            seq_lens=seq_lens,
            cost=cost,
            progress=progress,
            role=role,
        )
        del step, net
        gc.collect()
    return ModelProfile(
        model=str(model),
        dtype=str(torch_dtype).removeprefix("torch."),
        gradient_checkpointing=bool(gradient_checkpointing),
        logprobs=logprobs,
        backend=be.name,
        memory_limit=be.memory_limit,
        reserve_bytes=int(be.reserve_bytes or 0),
        budgets=budgets,
        combined=TokenBudget.min(*budgets.values()),
    )
