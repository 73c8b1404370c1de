"""``profile_model``: the token budget of a model for each RL role, and their combination.

What ``batchfit profile`` calls: builds the policy (causal LM, trained), the critic (value
head, trained) and/or the reference (causal LM, forward-only log-probs under ``no_grad``)
from a preset, a directory, a hub id, a config or a model with :mod:`batchfit.models`, runs
:func:`~batchfit.budget.budget_search.find_token_budget` on each role's probe (the trainer's own
micro-batch step, :mod:`batchfit.budget.causal_lm_probe`) as one :class:`ProfileOptions` says, and
combines them with :meth:`TokenBudget.min`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchfit.budget.budget_search import find_token_budget
from batchfit.budget.depth import DEFAULT_DEPTHS, uniform_layers
from batchfit.budget.engine import EngineReserve, given_engine_reserve
from batchfit.budget.megatron_layout import MegatronLayout
from batchfit.budget.options import ProfileOptions
from batchfit.budget.remedies import Candidate
from batchfit.budget.token_budget import TokenBudget
from batchfit.errors import BudgetError, DoesNotFitError, InvalidArgument, Phrase, Setting
from batchfit.memory.base import Backend
from batchfit.memory.cuda_untracked import UntrackedMemory, untracked_memory
from batchfit.models.attention import CudaAttention, cuda_attention_of
from batchfit.models.lora import LoraParameters, lora_parameters
from batchfit.models.moe import MoeSummary, moe_summary
from batchfit.parallel.behaviour import TorchBehaviours, torch_behaviours
from batchfit.parallel.distributed import agree
from batchfit.parallel.shard_state import shard_state
from batchfit.parallel.sharding import Sharding
from batchfit.parallel.strategies import scale_out_strategy
from batchfit.train.framework_heads import FrameworkHead
from batchfit.validation import check_choice, check_int

ROLES = ("policy", "critic", "reference", "policy_forward", "critic_forward")
"""Trained steps (``policy``, ``critic``) and forward-only passes under ``no_grad``:
``reference`` (a frozen model, no optimizer), ``policy_forward`` (old log-probs) and
``critic_forward`` (values), whose models' training state (sharded parameters and AdamW
state) stays resident, as it does between a framework's training steps."""
#: What each role's pass is, in words: the name a report gives each budget beside its role.
PASS_NAMES = {
    "policy": "update",
    "critic": "update",
    "reference": "reference log-probs",
    "policy_forward": "old log-probs",
    "critic_forward": "values",
}
TRAINED_ROLES = ("policy", "critic")
VALUE_ROLES = ("critic", "critic_forward")
#: A real cpu search of a model this large is guided by the estimate of the same step (NOTE
#: [ Estimates guide real cpu searches ]); a smaller one runs its cheap real probes unguided.
ESTIMATE_HINTS_FROM_PARAMETERS = 20_000_000


def forward_role(role: str) -> bool:
    """The role runs forward-only under ``no_grad`` (no backward, no optimizer step)."""
    return role not in TRAINED_ROLES


@dataclass(frozen=True)
class ModelProfile:
    """Token budgets of one model for each role, and the budget every role can share.

    Every byte figure is one rank's (the largest shard's when shards are uneven).

    Attributes:
        model: the model spec profiled (preset, directory or hub id).
        dtype: dtype the parameters are stored in (fp32 master weights under ``fsdp2``
            mixed precision).
        compute_dtype: dtype the forward and backward compute in.
        gradient_checkpointing: activation checkpointing was on.
        logprobs: how log-probs were computed (``full``, ``chunked``, ``fused``, a framework's head).
        backend: the backend's name (``cpu``, ``estimate``, ``cuda``).
        memory_limit: device bytes (``None`` = the device's own, cuda).
        reserve_bytes: bytes of ``memory_limit`` no tracker sees.
        resident_bytes: bytes other models sharing the device keep on it (colocated
            roles), taken off the usable memory like the reserve.
        engine: what a rollout engine sharing the device keeps on it while the trainer steps,
            term by term (:class:`~batchfit.budget.engine.EngineReserve`), taken off the usable
            memory like the reserve; ``None`` without an engine.
        allocator: the allocator setting the budgets assume (NOTE [ The allocator's share ] in
            :mod:`batchfit.memory.cuda_untracked`).
        safety_margin: the fraction of the usable memory a peak may reach.
        budgets: role -> its :class:`TokenBudget`, in the order profiled.
        combined: :meth:`TokenBudget.min` of the budgets (the one to configure).
        sharding: the :class:`~batchfit.parallel.sharding.Sharding` profiled.
        depth: the model's number of decoder layers.
        measured_depths: the two depths measured when the peak was extrapolated to
            ``depth`` (NOTE [ Peak memory is affine in depth ]), else ``None``.
        untracked: the terms of the estimate backend's default reserve
            (:func:`batchfit.memory.cuda_untracked.untracked_memory`), else ``None``.
        torch: what the installed torch does that changes a sharded budget
            (:func:`batchfit.parallel.behaviour.torch_behaviours`), for ``fsdp2``; else ``None``.
        lora: the LoRA adapters of the trained model and what they train
            (:class:`~batchfit.models.lora.LoraParameters`; the causal LM's, or the value model's
            when only critic roles were profiled), or ``None`` without LoRA.
        activation_offload: the trained roles offloaded their layers' saved activations to
            the host (verl's ``enable_activation_offload``); their host bytes are in each
            budget's ``host_bytes``.
        moe: for a mixture of experts, its parameters (total and active), experts per layer and
            per token, the experts implementation measured and the routing assumed
            (:class:`~batchfit.models.moe.MoeSummary`; ``balanced_tokens`` beside the worst
            case's budget with ``compare_routing``); ``None`` for a dense model.
        attention: the kernel CUDA runs for the model's sdpa attention, which the budget
            assumed (:class:`~batchfit.models.attention.CudaAttention`, with a line for the
            report when it is the math path); ``None`` when the backend runs the CPU's own
            kernels or the attention is not sdpa.
    """

    model: str
    dtype: str
    gradient_checkpointing: bool
    logprobs: str | FrameworkHead
    backend: str
    memory_limit: int | None
    reserve_bytes: int
    budgets: dict[str, TokenBudget]
    combined: TokenBudget
    sharding: Sharding = field(default_factory=Sharding)
    compute_dtype: str = ""
    depth: int | None = None
    measured_depths: tuple[int, int] | None = None
    resident_bytes: int = 0
    untracked: UntrackedMemory | None = None
    torch: TorchBehaviours | None = None
    lora: LoraParameters | None = None
    activation_offload: bool = False
    moe: MoeSummary | None = None
    attention: CudaAttention | None = None
    engine: EngineReserve | None = None
    allocator: str = "expandable_segments"
    safety_margin: float = 0.85
    megatron: MegatronLayout | None = None

    @property
    def engine_bytes(self) -> int:
        """What the rollout engine keeps on each GPU while the trainer steps (0 without one)."""
        return 0 if self.engine is None else self.engine.bytes

    def device_terms(self) -> list[tuple[str, int | None]]:
        """How one rank's limit comes from its device, term by term: ``(what, bytes)``, in order.

        The device, each amount taken off it (what no tracker sees, the sleeping engine, the
        colocated models), what is left (``usable``), and the limit (``safety_margin`` × usable, the
        margin the allocator needs); a ``None`` amount is the device's own (cuda).
        """
        terms: list[tuple[str, int | None]] = [("device", self.memory_limit)]
        reserve = "reserve" + ("" if self.untracked is None else f" ({self.untracked.describe()})")
        terms.append((reserve, self.reserve_bytes))
        if self.engine is not None and (self.engine.bytes or self.engine.given_bytes is not None):
            terms.append((f"rollout engine: {self.engine.describe()}", self.engine.bytes))
        if self.resident_bytes:
            terms.append(("colocated models' state", self.resident_bytes))
        usable = None
        if self.memory_limit is not None:
            usable = self.memory_limit - self.reserve_bytes - self.engine_bytes - self.resident_bytes
        terms.append(("usable", usable))
        limit = None if usable is None else int(self.safety_margin * usable)
        terms.append((f"limit: safety margin {self.safety_margin:g} ({_allocator_words(self.allocator)})", limit))
        return terms

    def to_dict(self) -> dict[str, Any]:
        """Settings, each role's budget and the combined budget as plain values (JSON-ready).

        NOTE [ One name per figure ]
        Each budget appears once, under ``budgets.<role>`` (``policy``, ``policy_forward``,
        ``critic``, ``critic_forward``, ``reference``) with its ``pass`` in words
        (:data:`PASS_NAMES`: update, old log-probs, values, reference log-probs), and
        everything measured for it sits beside it: its ``tokens``, ``response_tokens``, the
        binding peak's ``peak_bytes``, ``breakdown`` and ``host_bytes``, its limit, points and
        probes. ``combined`` is the budget every role shares (:meth:`TokenBudget.min`): its
        ``tokens`` (and ``response_tokens``), and ``binding_role``, the role whose budget
        it is — the breakdown is that role's.
        """
        out = {
            "model": self.model,
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype or self.dtype,
            "gradient_checkpointing": self.gradient_checkpointing,
            # a framework's head (FrameworkHead) as its fields
            "logprobs": self.logprobs if isinstance(self.logprobs, str) else dataclasses.asdict(self.logprobs),
            "backend": self.backend,
            "memory_limit": self.memory_limit,
            "reserve_bytes": self.reserve_bytes,
            "resident_bytes": self.resident_bytes,
            "engine_bytes": self.engine_bytes,
            "engine": None if self.engine is None else self.engine.to_dict(),
            "allocator": self.allocator,
            "safety_margin": self.safety_margin,
            "sharding": self.sharding.to_dict(),
            "depth": self.depth,
            "measured_depths": None if self.measured_depths is None else list(self.measured_depths),
            "budgets": {role: {"pass": PASS_NAMES.get(role, role), **_budget_dict(b)} for role, b in self.budgets.items()},
            "combined": {
                "tokens": self.combined.tokens,
                "response_tokens": self.combined.response_tokens,
                "binding_role": self.combined.binding_role,
            },
            "untracked": None if self.untracked is None else self.untracked.to_dict(),
            "torch": None if self.torch is None else self.torch.to_dict(),
            "lora": None if self.lora is None else self.lora.to_dict(),
            "activation_offload": self.activation_offload,
            "moe": None if self.moe is None else self.moe.to_dict(),
            "attention": None if self.attention is None else self.attention.to_dict(),
            "megatron": None if self.megatron is None else self.megatron.to_dict(),
        }
        # NOTE [ A group's budget ]
        # Under sequence parallelism (sharding.sequence_parallel = sp > 1) the probe runs one rank's
        # share of a packed micro-batch split over the sp GPUs of its group, so a budget C counts the
        # micro-batch's tokens: the group's. Each GPU runs ⌈C / sp⌉ of them through the decoder (and
        # every one through attention for heads/sp heads). verl's *_max_token_len_per_gpu means C // sp
        # (verl multiplies it by sp, dp_actor.py); SkyRL's max_tokens_per_microbatch means C (counted
        # before the split). The JSON gives both: ``tokens`` and ``tokens_per_gpu``.
        sp = self.sharding.sequence_parallel
        if sp > 1:
            for role, b in self.budgets.items():
                out["budgets"][role]["tokens_per_gpu"] = b.tokens // sp
            out["combined"]["tokens_per_gpu"] = self.combined.tokens // sp
        return out

    @property
    def train(self) -> TokenBudget:
        """The training budget per rank: the smallest of the trained roles' (``policy``, ``critic``).

        Measured on the trainer's own step as ``sharding`` runs it, so under ``fsdp2`` it
        already holds what FSDP2 keeps during the backward (each layer's unsharded gradient
        until it is reduce-scattered, the gathered layers) and the sharded gradients resident
        between micro-batches (:func:`batchfit.train.accumulate` keeps FSDP2's sync on): no
        reserve to take off by hand.

        Raises:
            BudgetError: no trained role was profiled (pass ``roles="policy"``).
        """
        return self._min_of(TRAINED_ROLES, "trained", "roles='policy'")

    @property
    def forward(self) -> TokenBudget:
        """The forward-only budget per rank (old/reference log-probs, values): the smallest forward role's.

        Raises:
            BudgetError: no forward-only role was profiled (pass ``forward_too=True`` or
                ``roles="policy,policy_forward"``).
        """
        return self._min_of(tuple(r for r in ROLES if forward_role(r)), "forward-only", "forward_too=True")

    def _min_of(self, roles: Sequence[str], kind: str, fix: str) -> TokenBudget:
        found = [b for role, b in self.budgets.items() if role in roles]
        if not found:
            raise BudgetError(
                f"this profile has no {kind} budget: it profiled roles {', '.join(self.budgets)}; profile with {fix}"
            )
        return TokenBudget.min(*found)


def _budget_dict(budget: TokenBudget) -> dict[str, Any]:
    """One role's budget as plain values, its binding peak (bytes, breakdown, host bytes) beside its tokens."""
    point = budget.binding_point
    out = budget.to_dict()
    out.pop("parts")  # a role's own budget combines nothing
    head = {key: out.pop(key) for key in ("tokens", "response_tokens", "response_fraction")}
    peak = {
        "peak_bytes": None if point is None else point.peak_bytes,
        "breakdown": out.pop("breakdown"),
        "host_bytes": 0 if point is None else point.host_bytes,
    }
    return {**head, **peak, **out}


def check_roles(roles: str | Sequence[str], name: str = "roles") -> tuple[str, ...]:
    """Roles from ``"policy,critic"`` or a sequence; each must be one of :data:`ROLES`, no repeats."""
    items = [r.strip() for r in roles.split(",")] if isinstance(roles, str) else list(roles)
    if not items or any(not r for r in items):
        raise InvalidArgument(f"roles must name at least one of {', '.join(ROLES)}, but got roles={roles!r}")
    for r in items:
        check_choice(name, r, ROLES)
    if len(set(items)) != len(items):
        raise InvalidArgument(f"roles must not repeat a role, but got roles={roles!r}; list each role once")
    return tuple(items)


def profile_model(
    model: Any = "tiny",
    options: ProfileOptions | None = None,
    *,
    roles: str | Sequence[str] = ("policy",),
    resident_bytes: int = 0,
    engine: EngineReserve | None = None,
    forward_too: bool = False,
    **settings: Any,
) -> ModelProfile:
    """Build ``model`` for each role and find its token budget per rank; combine the roles.

    Each role's probe is the trainer's own micro-batch step (NOTE [ One micro-batch step ] in
    :mod:`batchfit.budget.causal_lm_probe`): the policy and the critic train with AdamW (state
    initialised, gradients resident), the policy's loss is PPO's clipped surrogate over
    log-probs from the ``logprobs`` head, the critic's the clipped value loss; the reference
    runs forward-only log-probs under ``no_grad``; ``policy_forward`` (old log-probs) and
    ``critic_forward`` (values) run forward-only with their model's training state resident
    (:data:`ROLES`). Forward passes fit far more tokens than a training step: their budgets
    bound the forward micro-batches. Each role is sharded as ``options.sharding`` says, with
    PyTorch's own FSDP2 or DDP (:func:`batchfit.parallel.shard_model`): on the estimate
    backend over a simulated process group of ``sharding.world_size`` ranks, on cpu and cuda
    over the real one (every rank calls this function; ``world_size`` must be the group's size).

    Args:
        model: a preset name (``tiny``, ``qwen2.5-7b``, …), a local directory with
            ``config.json``, a hub id (config only), a ``PretrainedConfig``, or a transformers
            model (``nn.Module``, bare or wrapped), whose config is built for each role
            (NOTE [ Profiling a model object ]): the model itself is left untouched, and
            what is not set in ``options`` or ``settings`` is read from it (its parameters'
            dtype; FSDP2's or DDP's sharding, world size and FSDP2's bf16 mixed precision).
        options: the :class:`~batchfit.budget.options.ProfileOptions`; keyword ``settings``
            (its field names: ``max_seq_len=8192, backend="estimate", …``) build one, or
            override the fields of the one given.
        roles: any of :data:`ROLES` (``"policy,critic"``).
        resident_bytes: bytes other models sharing the device keep on it (colocated roles),
            taken off the usable memory like the reserve.
        engine: what a rollout engine sharing the device keeps on it while the trainer steps
            (:func:`batchfit.budget.engine.engine_reserve`), taken off like the reserve;
            ``options.engine_reserve``, when set, replaces it.
        forward_too: also profile each trained role's forward-only pass (``policy`` →
            ``policy_forward``, ``critic`` → ``critic_forward``), so one call gives the
            training budget (:attr:`ModelProfile.train`) and the forward-only one
            (:attr:`ModelProfile.forward`).

    Returns:
        :class:`ModelProfile`.

    Raises:
        InvalidArgument: bad model, options or roles, a setting that is not a field of
            :class:`ProfileOptions`, or a process group that does not match
            ``sharding.world_size``.
        DoesNotFitError: one sequence of ``max_seq_len`` does not fit for some role; on the
            estimate backend its message names the smallest ``fsdp2`` world size that would
            fit (``world_size_hint``).

    Example:
        >>> p = profile_model("tiny", max_seq_len=512, backend="estimate", memory_limit="1GiB")
        >>> p.combined.tokens > 0
        True
    """
    opts = resolve_options(options, {**module_settings(model, options, settings), **settings})
    chosen_roles = check_roles(roles)
    if not isinstance(forward_too, bool):
        raise InvalidArgument(f"forward_too must be True or False, but got forward_too={forward_too!r}")
    if forward_too:
        extra = [f"{r}_forward" for r in chosen_roles if r in TRAINED_ROLES]
        chosen_roles = tuple(dict.fromkeys([*chosen_roles, *extra]))
    cache, key = _cache_key(
        model, opts, call="profile_model", roles=chosen_roles, resident_bytes=resident_bytes, engine=engine
    )
    kept = None if key is None else cache.get(key)
    if kept is not None:  # NOTE [ A profile is a function of its inputs ]
        return kept
    profile = _profile_model(model, opts, chosen_roles, resident_bytes, engine)
    if key is not None:
        cache.put(key, profile)
    return profile


def _cache_key(model: Any, opts: ProfileOptions, **inputs: Any) -> tuple[Any, str | None]:
    """The active profile cache and the key in it of a call on ``model`` with ``opts`` and the other ``inputs``.

    ``None`` for the key: not cached (NOTE [ A profile is a function of its inputs ] in
    :mod:`batchfit.budget.profile_cache`).
    """
    import torch

    from batchfit.budget.profile_cache import active
    from batchfit.memory import backend_class
    from batchfit.parallel.distributed import is_distributed

    cache = active()
    if cache is None or isinstance(model, torch.nn.Module) or not isinstance(opts.backend, str):
        return cache, None
    if not backend_class(opts.backend).simulated:  # a device is measured: that is why it runs
        return cache, None
    if is_distributed():  # real ranks that disagreed on a hit would deadlock in the search's collectives
        return cache, None
    from batchfit.models import load_config

    config = load_config(model)  # what a name, a directory or a hub id stands for, by content
    return cache, cache.key({"model": model, "config": config, "options": opts, **inputs})


def _profile_model(
    model: Any, opts: ProfileOptions, chosen_roles: tuple[str, ...], resident_bytes: int, engine: EngineReserve | None
) -> ModelProfile:
    own = opts.sharding.spec.profiler()
    if own is not None:  # a strategy that builds its own model (Megatron-core's GPTModel)
        return own.profile_model(model, opts, roles=chosen_roles, resident_bytes=resident_bytes, engine=engine)
    session = _session_for(model, opts)
    reserve = session.backend.reserve_bytes  # what this call takes off is its own: a run's session serves several
    try:
        with session.world():
            searched = session.search(chosen_roles, resident_bytes, engine)
        if searched.failed is not None and _SCOPE is not None:
            _SCOPE.close()  # NOTE [ One simulated world per run ]: a does-not-fit hint measures other worlds
        return session.finish(searched)
    finally:
        session.backend.reserve_bytes = reserve


@dataclass
class _Searched:
    """What :meth:`_Session.search` found: each role's budget, or the role whose sequence does not fit."""

    budgets: dict[str, TokenBudget]
    failed: tuple[str, DoesNotFitError] | None
    resident_bytes: int
    engine: EngineReserve | None
    adapters: LoraParameters | None


class _Session:
    """One model profiled with one set of options: its backend and builder set up once, each role's step built once.

    :func:`profile_model` makes one per call; inside :func:`one_world`, :func:`resident_state_bytes`
    and :func:`profile_model` share one per ``(model, options)`` (NOTE [ One simulated world per run ]).
    """

    def __init__(self, model: Any, opts: ProfileOptions):
        from batchfit.memory import get_backend
        from batchfit.models import load_config, parse_dtype

        self.model, self.plan = model, opts.sharding
        plan = self.plan
        self.torch_dtype = parse_dtype(default_dtype(plan) if opts.dtype is None else opts.dtype)
        self.config = config = load_config(model)  # a bad spec fails here, before any backend work
        self.backend = be = get_backend(opts.backend, memory_limit=opts.memory_limit, reserve_bytes=opts.reserve_bytes)
        # NCCL's buffers on a simulated device whose strategy talks to other ranks; "none" runs no collective
        be.expect_world_size(plan.world_size if plan.distributed else 1)
        self.parameters = check_host_memory(config, model_name(model)) if be.host_memory else 0
        self.behaviours = torch_behaviours() if plan.spec.torch_behaviours else None  # before any simulated world
        moe = moe_summary(config, opts.experts_implementation, plan.expert_parallel)
        if moe is not None:
            routing = opts.routing or (None if moe.routing == "any" else moe.routing)
            moe = dataclasses.replace(moe, routing=routing or "any")
            opts = opts.replace(experts_implementation=moe.implementation, routing=routing)
        self.moe, self.opts = moe, opts
        self.depth, extrapolate = depth_plan(config, be, opts.depth_extrapolation, plan)
        self.build = RoleBuilder(config, be, self.torch_dtype, opts, extrapolate, self.depth)
        self._steps: dict[str, Any] = {}  # role -> a step built ahead of its search (NOTE [ One simulated world per run ])
        self._states: dict[str, Any] = {}  # role -> its step's measured state

    def world(self) -> Any:
        """The process group the session's steps run in: the run's (:func:`one_world`), else its own."""
        if _SCOPE is not None and _SCOPE.holds(self):
            return _SCOPE.world(self.backend, self.plan)
        return simulated_world_for(self.backend, self.plan)

    def _build(self, role: str) -> Any:
        # NOTE [ Ranks agree or say why ]: a build that fails on one rank raises on all
        return agree(lambda: self.build.step(role), what=f"building the {role} model")

    def state(self, role: str) -> Any:
        """``role``'s step's registered state, measured once (the step is kept for ``role``'s search)."""
        if role not in self._states:
            step = self._steps[role] if role in self._steps else self._build(role)
            self._states[role] = step.measure_state()
            self._steps[role] = step
        return self._states[role]

    def search(
        self, roles: Sequence[str], resident_bytes: int = 0, engine: EngineReserve | None = None
    ) -> _Searched:
        """Find each of ``roles``' budget in turn, the other models' ``resident_bytes`` and the ``engine`` taken off.

        Stops at the first role whose one sequence does not fit (:attr:`_Searched.failed`);
        the steps of ``roles`` are dropped when it returns.
        """
        opts, be, build, plan = self.opts, self.backend, self.build, self.plan
        resident_bytes = check_int("resident_bytes", resident_bytes, minimum=0)
        if opts.engine_reserve is not None:
            engine = given_engine_reserve(opts.engine_reserve)
        if resident_bytes or (engine is not None and engine.bytes):
            take_resident(be, resident_bytes, engine)
        adapters = None
        if opts.lora is not None and opts.lora.enabled and set(roles) != {"reference"}:
            critic_only = all(role in VALUE_ROLES or role == "reference" for role in roles)
            adapters = lora_parameters(self.config, opts.lora, value_head=critic_only)  # a bad target fails here
        budgets: dict[str, TokenBudget] = {}
        failed: tuple[str, DoesNotFitError] | None = None
        try:
            # NOTE [ Probing reuses host pages ]: real cpu probes refault gigabytes each time otherwise
            with be.probing():
                for role in roles:
                    lengths, hints = opts.seq_lens, None
                    if be.estimate_is_exact and not plan.distributed and self.parameters >= ESTIMATE_HINTS_FROM_PARAMETERS:
                        lengths, hints = _estimated_hints(build, role, opts)
                    step = self._steps.pop(role, None)
                    if step is None:
                        step = self._build(role)
                    try:
                        budgets[role] = find_token_budget(
                            step,
                            max_seq_len=opts.max_seq_len,
                            safety_margin=opts.safety_margin,
                            seq_lens=lengths,
                            cost=opts.cost,
                            progress=opts.progress,
                            role=role,
                            hints=hints,
                        )
                    except DoesNotFitError as exc:
                        failed = (role, exc)
                        break
                    finally:
                        del step
                        _collect(be)
        finally:
            for role in roles:  # another call's roles may share the session (the same model and options)
                self._steps.pop(role, None)
        return _Searched(budgets, failed, resident_bytes, engine, adapters)

    def finish(self, searched: _Searched) -> ModelProfile:
        """The :class:`ModelProfile` of a search, or its role's :class:`DoesNotFitError` with the hints that fit (outside any simulated world)."""
        opts, be, build, plan, moe = self.opts, self.backend, self.build, self.plan, self.moe
        budgets, engine, resident_bytes = searched.budgets, searched.engine, searched.resident_bytes
        if searched.failed is not None:
            role, exc = searched.failed
            if opts.suggest_world_size and be.suggests_world_sizes:
                out = _with_world_size_hint(exc, role, build, opts.max_seq_len, moe)
            else:
                out = exc.replace(Phrase(f"{role}: ", *exc.message.parts))
            if moe is not None:  # the report names the mixture of experts, even when nothing fits
                out = out.replace(Phrase(f"{moe.short()}; ", *out.message.parts))
            raise out from None
        if moe is not None and moe.routing == "skewed" and opts.compare_routing:
            moe = dataclasses.replace(moe, balanced_tokens=_balanced_tokens(build, budgets, be, plan))
        torch_dtype, config = self.torch_dtype, self.config
        return ModelProfile(
            model=model_name(self.model),
            dtype=_dtype_name(torch_dtype),
            gradient_checkpointing=opts.gradient_checkpointing,
            logprobs=opts.logprobs,
            backend=be.name,
            memory_limit=be.memory_limit,
            reserve_bytes=int(be.reserve_bytes or 0) - resident_bytes - (0 if engine is None else engine.bytes),
            resident_bytes=resident_bytes,
            engine=engine,
            allocator=str(opts.allocator),
            safety_margin=float(opts.safety_margin),
            budgets=budgets,
            combined=TokenBudget.min(*budgets.values()),
            sharding=plan,
            compute_dtype=_dtype_name(compute_dtype(plan, torch_dtype)),
            depth=self.depth,
            measured_depths=tuple(DEFAULT_DEPTHS) if build.extrapolate else None,
            untracked=be.untracked,
            torch=self.behaviours,
            lora=searched.adapters,
            activation_offload=opts.activation_offload,
            moe=moe,
            attention=cuda_attention_of(config, compute_dtype(plan, torch_dtype)) if be.runs_cuda_attention else None,
        )


# NOTE [ One simulated world per run ]
# A framework run profiles several models, and each colocated model's state is taken off the others'
# memory: measured, before their searches, on the model as its own profile builds it. Built apart,
# verl's example built the policy three times (its state, its update, its old log-probs) and the
# reference twice. Inside one_world() (profile_run), on a simulated backend, resident_state_bytes and
# profile_model share one session per (model, options) — one backend, one builder — and one simulated
# world: the state is read off the very step the model's search then runs (built once, measured before
# any probe: the registered state is live all along, the same bytes as a model built apart without
# checkpointing and without a reserve, neither of which changes parameters or optimizer state). A
# does-not-fit hint measures other world sizes, each in a world of its own: the run's world is closed
# (its steps dropped) before one is sought. Backends that hold real memory keep today's separate
# builds: two real models side by side would double the host's memory.
_SCOPE: _RunScope | None = None


class _RunScope:
    """The sessions and the simulated world of one :func:`one_world` block."""

    def __init__(self) -> None:
        self.sessions: list[tuple[Any, ProfileOptions, _Session]] = []
        self._stack: contextlib.ExitStack | None = None
        self._world: tuple[bool, int] | None = None

    def session(self, model: Any, opts: ProfileOptions) -> _Session | None:
        """The run's session for ``(model, opts)``, made on first use; ``None`` where the run shares none (a real backend)."""
        for known, known_opts, session in self.sessions:
            if (known is model or (isinstance(model, (str, os.PathLike)) and known == model)) and known_opts == opts:
                return session
        session = _Session(model, opts)
        if not session.backend.simulated:
            return session  # NOTE [ One simulated world per run ]: real models are built apart
        if not self._fits(session.plan):
            self.close()  # another world size: the run's world is left, its steps dropped
        self.sessions.append((model, opts, session))
        return session

    def holds(self, session: _Session) -> bool:
        return any(s is session for _, _, s in self.sessions)

    def _fits(self, plan: Sharding) -> bool:
        return self._world is None or self._world == (plan.distributed, plan.world_size)

    def world(self, backend: Backend, plan: Sharding) -> Any:
        """Enter the run's simulated world on first use (after torch's behaviours are probed); later uses are the same world."""
        if self._stack is None:
            torch_behaviours()  # cached: probed before any simulated world, as a session alone does
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(simulated_world_for(backend, plan))
            self._world = (plan.distributed, plan.world_size)
        return contextlib.nullcontext()

    def close(self) -> None:
        """Drop every session's steps and leave the world (a later use opens a new one)."""
        for _, _, session in self.sessions:
            session._steps.clear()
        self.sessions.clear()
        if self._stack is not None:
            stack, self._stack, self._world = self._stack, None, None
            stack.close()


@contextlib.contextmanager
def one_world() -> Any:
    """Inside, the profiles of one run share their models' builds and one simulated world (NOTE [ One simulated world per run ]).

    :func:`resident_state_bytes` reads a model's state off the step :func:`profile_model` then
    searches with the same ``(model, options)``, so each model is built once per depth copy.
    Budgets and every byte are those of the calls made apart. Not re-entrant: an inner block
    is the outer one.
    """
    global _SCOPE
    if _SCOPE is not None:
        yield
        return
    _SCOPE = scope = _RunScope()
    try:
        yield
    finally:
        _SCOPE = None
        scope.close()


def _session_for(model: Any, opts: ProfileOptions) -> _Session:
    return _Session(model, opts) if _SCOPE is None else _SCOPE.session(model, opts)  # type: ignore[return-value]


def _balanced_tokens(build: RoleBuilder, budgets: dict[str, TokenBudget], backend: Backend, plan: Sharding) -> int | None:
    """The binding role's budget with balanced routing at ``max_seq_len``, to set beside the worst case's (NOTE [ The worst case of a routing-dependent loop ]).

    ``None`` when one sequence does not fit even so.
    """
    role = TokenBudget.min(*budgets.values()).binding_role or next(iter(budgets))
    balanced = build.with_options(routing="balanced")
    opts = balanced.options
    with simulated_world_for(backend, plan), backend.probing():
        step = agree(lambda: balanced.step(role), what=f"building the {role} model")
        try:
            return find_token_budget(
                step, max_seq_len=opts.max_seq_len, safety_margin=opts.safety_margin, seq_lens=[opts.max_seq_len],
                cost=opts.cost, progress=opts.progress, role=role,
            ).tokens
        except DoesNotFitError:
            return None
        finally:
            del step
            gc.collect()


def module_settings(model: Any, options: ProfileOptions | None, settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a model object implies that neither ``options`` nor ``settings`` give.

    NOTE [ Profiling a model object ]
    A module is profiled through its config: each role's model is built again from it by
    :mod:`batchfit.models` and sharded by :func:`batchfit.parallel.shard_model`, and the
    probe runs :func:`batchfit.train.micro_batch_loss` on it: the code path the loop
    runs, on every backend (an estimate cannot run the user's real, already-allocated
    module under fake tensors, and measuring it in place would train it). What the object
    itself says about how it runs fills the settings left unset: its parameters' dtype,
    and for a model wrapped by FSDP2 (``fully_shard``) or DDP the strategy, the world size
    (FSDP2's mesh, DDP's group) and FSDP2's mixed precision (bf16 compute: ``"bf16"``).
    ``options`` given: only ``settings`` override it (the options are taken as they are).
    """
    import torch

    if options is not None or not isinstance(model, torch.nn.Module):
        return {}
    out: dict[str, Any] = {}
    params = [p for p in model.parameters() if p.is_floating_point()]
    if "dtype" not in settings and params:
        out["dtype"] = _dtype_name(params[0].dtype)
    if "sharding" not in settings:
        sharding = _module_sharding(model)
        if sharding is not None:
            out["sharding"] = sharding
    return out


def _module_sharding(model: Any) -> Sharding | None:
    """FSDP2's, DDP's or ZeRO's :class:`Sharding` of a wrapped model, else ``None``."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from batchfit.train.accumulate import data_parallel_size

    state = shard_state(model)
    if state is not None and state.zero is not None:  # ZeRO-1/2 as batchfit.parallel.shard_model applies it
        return state.sharding
    if isinstance(model, DistributedDataParallel):
        return Sharding("ddp", world_size=data_parallel_size(model))
    if isinstance(model, FSDPModule):
        policy = getattr(getattr(model, "_get_fsdp_state", lambda: None)(), "_mp_policy", None)
        import torch

        bf16 = getattr(policy, "param_dtype", None) == torch.bfloat16
        return Sharding("fsdp2", world_size=data_parallel_size(model), mixed_precision="bf16" if bf16 else "none")
    return None


def resolve_options(options: ProfileOptions | None, settings: dict[str, Any]) -> ProfileOptions:
    """``options`` with ``settings`` applied, or new options from ``settings``."""
    if options is not None:
        if not isinstance(options, ProfileOptions):
            raise InvalidArgument(
                f"options must be a ProfileOptions, but got a {type(options).__name__}; pass settings as keywords (max_seq_len=8192, …)"
            )
        return options.replace(**settings) if settings else options
    if "max_seq_len" not in settings:
        raise InvalidArgument(
            "max_seq_len is required, but got no max_seq_len; pass max_seq_len=8192 (the longest sequence you train on) or options=ProfileOptions(...)"
        )
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(ProfileOptions)})
    if unknown:
        names = ", ".join(f.name for f in dataclasses.fields(ProfileOptions))
        raise InvalidArgument(f"profile_model got an unknown setting {unknown[0]!r}; the settings are {names}")
    return ProfileOptions(**settings)


def model_name(model: Any) -> str:
    """How a profile names ``model``: the string itself, a config's ``name_or_path`` or model type, a module's class."""
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    config = getattr(getattr(model, "module", model), "config", model)
    name = getattr(config, "name_or_path", "") or getattr(config, "model_type", "")
    return str(name) if name else type(model).__name__


def depth_plan(
    config: Any, backend: Backend, depth_extrapolation: bool | None, sharding: Sharding | None = None
) -> tuple[int, bool]:
    """The model's depth, and whether it is extrapolated from two shallow copies (default: when estimating).

    Never under ``zero2``, whose gradient buffer is not affine in depth (NOTE [ The simulated
    ZeRO rank ] in :mod:`batchfit.parallel.zero`).
    """
    depth = int(config.num_hidden_layers)
    wanted = backend.extrapolates_depth if depth_extrapolation is None else bool(depth_extrapolation)
    affine = sharding is None or sharding.spec.affine_in_depth
    return depth, wanted and affine and uniform_layers(config) and depth > max(DEFAULT_DEPTHS)


def _collect(backend: Backend) -> None:
    """Free what a finished role's step held in reference cycles, before the next one allocates.

    Only where the steps held real memory: a fake step's tensors hold none, and its tracker's
    finalizers are detached when it ends, so collecting them changes no later measurement
    (the verl example's three roles spent about 1 s in these collections).
    """
    if backend.holds_memory:
        gc.collect()


def take_resident(backend: Backend, resident: int, engine: EngineReserve | None = None) -> None:
    """Count ``resident`` bytes (other models' state on the device) and the sleeping engine's like the reserve."""
    from batchfit.memory import format_bytes

    engine_bytes = 0 if engine is None else engine.bytes
    taken = resident + engine_bytes
    if backend.memory_limit is not None and backend.reserve_bytes + taken >= backend.memory_limit:
        sharing = []
        if resident:
            sharing.append(f"the models sharing this device keep {format_bytes(resident)} on it")
        if engine_bytes:
            sharing.append(f"the rollout engine keeps {format_bytes(engine_bytes)} ({engine.describe()})")
        raise DoesNotFitError(
            f"{' and '.join(sharing)}, which with the reserve of {format_bytes(backend.reserve_bytes)} leaves nothing "
            f"of {format_bytes(backend.memory_limit)}; offload their state between phases, let the engine sleep, place "
            "the models or the engine on separate GPUs, or shard over more ranks",
            needed=backend.reserve_bytes + taken,
            available=backend.memory_limit,
        )
    backend.reserve_bytes += taken


def _allocator_words(allocator: str) -> str:
    """``expandable segments`` / ``the caching allocator's default segments``, for reports."""
    return "expandable segments" if allocator == "expandable_segments" else "the caching allocator's default segments"


def resident_state_bytes(
    model: Any,
    role: str,
    options: ProfileOptions,
    *,
    kinds: Sequence[str] = ("parameters", "optimizer_state"),
) -> int:
    """Bytes per rank that ``role``'s model keeps on the device between its steps.

    Measured, not computed: the role's model (and optimizer, for a trained role) is built
    and sharded as :func:`profile_model` builds it with ``options`` (its backend, memory,
    dtype, sharding and depth extrapolation; no reserve) and its registered state is
    measured without running a step; the breakdown's ``kinds`` categories are summed
    (parameters and AdamW state are live all along and do not depend on the batch). State offloaded to the host (``offload="cpu"``) is not on the
    device and counts 0.

    Raises:
        InvalidArgument: bad model or role.
    """
    check_choice("role", role, ROLES)
    cache, key = _cache_key(model, options, call="resident_state_bytes", role=role, kinds=tuple(kinds))
    kept = None if key is None else cache.get(key)
    if kept is not None:  # NOTE [ A profile is a function of its inputs ]
        return kept
    measured = _resident_state_bytes(model, role, options, kinds)
    if key is not None:
        cache.put(key, measured)
    return measured


def _resident_state_bytes(model: Any, role: str, options: ProfileOptions, kinds: Sequence[str]) -> int:
    from batchfit.memory import get_backend
    from batchfit.models import load_config, parse_dtype

    plan = options.sharding
    own = plan.spec.profiler()
    if own is not None:  # a strategy that builds its own model
        return own.resident_state_bytes(model, role, options, kinds=kinds)
    if _SCOPE is not None:  # NOTE [ One simulated world per run ]: the state of the step its profile searches
        session = _SCOPE.session(model, options)
        if session is not None and _SCOPE.holds(session):
            with session.world():
                measured = session.state(role)
            return int(sum(measured.breakdown.get(kind, 0) for kind in kinds))
    torch_dtype = parse_dtype(default_dtype(plan) if options.dtype is None else options.dtype)
    config = load_config(model)
    be = get_backend(options.backend, memory_limit=options.memory_limit, reserve_bytes=0)
    depth, extrapolate = depth_plan(config, be, options.depth_extrapolation, plan)
    build = RoleBuilder(config, be, torch_dtype, options.replace(gradient_checkpointing=False), extrapolate, depth)
    with simulated_world_for(be, plan):
        step = agree(lambda: build.step(role), what=f"building the {role} model")
        try:
            measured = step.measure_state()
        finally:
            del step
            _collect(be)
    return int(sum(measured.breakdown.get(kind, 0) for kind in kinds))


def _estimated_hints(build: RoleBuilder, role: str, options: ProfileOptions) -> tuple[Any, dict[int, int] | None]:
    """The estimate backend's answer for the same step, as hints for a real cpu search.

    NOTE [ Estimates guide real cpu searches ]
    The estimate equals the cpu run to the byte (same tracker, fake tensors), so the cpu
    search then measures about two real steps per length instead of a dozen: the predicted
    answer (fits) and the one above (does not). A fake probe costs a fixed ~0.3 s of
    dispatch on this project's machines whatever the model's size, a real one grows with it:
    below :data:`ESTIMATE_HINTS_FROM_PARAMETERS` parameters the real probes are the cheaper
    ones (the tiny preset: 0.12 s each) and run unguided. ``(lengths, hints)``;
    ``(seq_lens, None)`` when the estimate fails (the cpu search then runs unguided).
    """
    from batchfit.memory.estimate import EstimateBackend

    be = build.backend
    twin = EstimateBackend(
        memory_limit=be.memory_limit,
        reserve_bytes=be.reserve_bytes or 0,
        round_to=be.round_to,
        attention_kernels=be.attention_kernels,  # the kernels the cpu search runs
    )
    estimate = build.with_backend(twin)
    try:
        budget = find_token_budget(
            estimate.step(role),
            max_seq_len=options.max_seq_len,
            safety_margin=options.safety_margin,
            seq_lens=options.seq_lens,
            cost=options.cost,
            progress=False,
        )
    except (DoesNotFitError, InvalidArgument):
        return options.seq_lens, None
    finally:
        gc.collect()
    # the search's unit: rows (padded) or tokens (packed)
    answers = {p.seq_len: p.max_batch_size if options.cost == "padded" else p.tokens for p in budget.points}
    return [p.seq_len for p in budget.points], answers


def check_host_memory(config: Any, model: str) -> int:
    """The model's parameters; the cpu backend builds real models: refuse one whose training state alone exceeds half this host's memory."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        host = None
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if host is None:  # pragma: no cover - not POSIX
        return params
    needed = params * 16  # fp32 parameters, gradients and AdamW's two moments
    if needed > host // 2:
        from batchfit.memory import format_bytes

        raise InvalidArgument(
            f"backend='cpu' runs {model!r} for real: its {params / 1e9:.2f}B parameters need about {format_bytes(needed)} "
            f"for training state alone, more than half of this host's {format_bytes(host)}; use backend='estimate' "
            "(fake tensors, no memory) or a smaller model"
        )
    return params


def default_dtype(sharding: Sharding) -> str:
    """The parameter dtype when none is given: fp32 master weights under bf16 mixed precision, else bf16."""
    return "fp32" if sharding.mixed_precision == "bf16" else "bf16"


def compute_dtype(sharding: Sharding, dtype: Any) -> Any:
    """The dtype the model computes in: bf16 under bf16 mixed precision, else the parameter dtype."""
    import torch

    return torch.bfloat16 if sharding.mixed_precision == "bf16" else dtype


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def simulated_world_for(backend: Backend, sharding: Sharding) -> Any:
    """The process group a sharded profile needs without real ranks: simulated ranks (estimate), or one rank (cpu).

    FSDP2, FSDP1 or DDP over one rank never communicates, so a one-rank cpu profile (a framework
    config for one GPU, which the framework still wraps in FSDP with mixed precision) runs in
    this process over a simulated group of one. Real ranks (torchrun) bring their own group.
    """
    import torch.distributed as dist

    from batchfit.parallel.distributed import simulated_world

    if not sharding.distributed:
        return contextlib.nullcontext()
    if backend.simulated:
        return simulated_world(sharding.world_size)
    if backend.simulates_one_rank and sharding.world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return simulated_world(1)
    return contextlib.nullcontext()


class RoleBuilder:
    """Builds the probe of one role: full depth, or two shallow copies to extrapolate from."""

    def __init__(self, config: Any, backend: Backend, dtype: Any, options: ProfileOptions, extrapolate: bool, depth: int):
        self.config, self.backend, self.dtype, self.options = config, backend, dtype, options
        self.extrapolate, self.depth = extrapolate, depth

    @property
    def sharding(self) -> Sharding:
        return self.options.sharding

    def with_options(self, **changes: Any) -> RoleBuilder:
        """The same builder with some options changed (another sharding, checkpointing)."""
        return RoleBuilder(
            self.config, self.backend, self.dtype, self.options.replace(**changes), self.extrapolate, self.depth
        )

    def with_backend(self, backend: Backend) -> RoleBuilder:
        """The same builder on another backend."""
        return RoleBuilder(self.config, backend, self.dtype, self.options, self.extrapolate, self.depth)

    def step(self, role: str) -> Any:
        from batchfit.budget.causal_lm_probe import causal_lm_step
        from batchfit.budget.depth import build_depth_steps
        from batchfit.models import build_causal_lm

        options = self.options

        def make(n_layers: int) -> Any:
            overrides = {} if n_layers == self.depth else {"num_hidden_layers": n_layers}
            net = build_causal_lm(
                self.config,
                backend=self.backend,
                dtype=self.dtype,
                gradient_checkpointing=options.gradient_checkpointing,
                value_head=role in VALUE_ROLES,
                sharding=options.sharding,
                lora=None if role == "reference" else options.lora,  # a reference is the frozen base
                experts_implementation=options.experts_implementation,
                routing=options.routing,
                **overrides,
            )
            return causal_lm_step(
                net,
                backend=self.backend,
                logprobs=options.logprobs,
                cost=options.cost,
                forward_only=forward_role(role),
                optimizer=_optimizer(role, options),
                only_loss_tokens=options.response_only and role not in VALUE_ROLES,
                response_fraction=options.response_fraction if options.response_only else None,
                activation_offload=options.activation_offload,
            )

        return build_depth_steps(make, self.depth, backend=self.backend) if self.extrapolate else make(self.depth)


def _optimizer(role: str, options: ProfileOptions) -> str | None:
    """The optimizer a role's probe holds: none for a frozen reference, none for a forward pass whose optimizer state is offloaded."""
    if role == "reference":
        return "auto"
    if forward_role(role) and options.optimizer_offload:
        return None  # verl's optimizer_offload: compute_log_prob and compute_values load the parameters only
    return "adamw"


# The largest world size the does-not-fit hint names.
_MAX_HINT_WORLD = 4096


def smallest_fitting_world_size(
    build: RoleBuilder, role: str, seq_len: int, limit: int, start: int = 1, breakdowns: dict[int, dict[str, int]] | None = None
) -> int | None:
    """The smallest ``fsdp2`` world size (checkpointing on) at which one sequence of ``seq_len`` fits under ``limit``.

    World sizes are 1, 2, 4, 8 and then whole 8-GPU nodes (16, 24, …): shard padding makes
    the peak wiggle between neighbouring sizes, and clusters come in nodes.

    One rank's peak is ``A + B/N`` over ``N`` ranks: ``B`` the state FSDP2 shards
    (parameters, gradients, optimizer state), ``A`` what it does not (activations, the
    gathered layers, the head). Two measured world sizes give ``A`` and ``B``; if ``A``
    alone exceeds the limit no world size fits, else ``N = ceil(B / (limit - A))`` is
    checked by measuring it (and ``N - 1``), stepping until the answer is verified.
    Estimate backend only: each size is measured in its own simulated world, without a
    memory limit (the peaks must be exact). About four measurements.

    Args:
        breakdowns: filled with each measured world size's breakdown (one rank's bytes by category).

    Returns:
        The smallest world size measured to fit (its predecessor measured not to), or
        ``None`` when none up to :data:`_MAX_HINT_WORLD` fits.
    """
    peaks: dict[int, int] = {}

    def peak(world: int) -> int:
        if world not in peaks:
            measured = _hint_measure(build, role, seq_len, world)
            peaks[world] = measured.peak_bytes
            if breakdowns is not None:
                breakdowns[world] = dict(measured.breakdown)
        return peaks[world]

    n1 = max(2, start)
    n2 = 2 * n1
    p1, p2 = peak(n1), peak(n2)
    sharded = (p1 - p2) / (1 / n1 - 1 / n2)
    fixed = p1 - sharded / n1
    if fixed >= limit:
        return None
    world = _world_at_least(min(math.ceil(sharded / (limit - fixed)), _MAX_HINT_WORLD))
    for _ in range(8):  # the model is exact up to shard padding: a step or two at most
        if peak(world) > limit:
            if world >= _MAX_HINT_WORLD:
                return None
            world = _world_at_least(world + 1)
        elif world > 1 and peak(_world_below(world)) <= limit:
            world = _world_below(world)
        else:
            return world
    return world if peak(world) <= limit else None


#: The Ulysses sizes a "does not fit" hint tries, smallest first.
_HINT_SEQUENCE_PARALLEL = (2, 4, 8, 16, 32, 64)


def smallest_fitting_sequence_parallel(
    build: RoleBuilder, role: str, seq_len: int, limit: int, start: int = 1
) -> tuple[int, int] | None:
    """The smallest Ulysses size ``sp`` (and its world size) at which one sequence of ``seq_len`` fits under ``limit``.

    Each size the model's attention can be split over (:func:`batchfit.models.ulysses.check_ulysses`)
    is measured, smallest first, with ``fsdp2`` over ``max(start, sp)`` ranks (a whole number of
    groups), checkpointing on, one packed sequence split over the group: the step that trains.
    Estimate backend only, each in its own simulated world, without a memory limit. At most
    :data:`_HINT_SEQUENCE_PARALLEL`'s six measurements.

    Returns:
        ``(sp, world_size)``, or ``None`` when no size up to 64 fits (or the attention cannot be split).
    """
    from batchfit.models.ulysses import check_ulysses

    for sp in _HINT_SEQUENCE_PARALLEL:
        if sp <= build.sharding.sequence_parallel:
            continue
        try:
            check_ulysses(build.config, sp)
        except InvalidArgument:
            continue
        world = -(-max(start, sp) // sp) * sp
        if world > _MAX_HINT_WORLD:
            return None
        if _hint_peak(build, role, seq_len, world, sequence_parallel=sp) <= limit:
            return sp, world
    return None


def _hint_peak(build: RoleBuilder, role: str, seq_len: int, world: int, sequence_parallel: int = 1) -> int:
    """One sequence of ``seq_len``'s peak for a "does not fit" hint (:func:`_hint_measure`)."""
    return _hint_measure(build, role, seq_len, world, sequence_parallel).peak_bytes


def _hint_measure(build: RoleBuilder, role: str, seq_len: int, world: int, sequence_parallel: int = 1) -> Any:
    """One sequence of ``seq_len``'s measurement for a "does not fit" hint: ``fsdp2`` over ``world`` simulated ranks
    (``sequence_parallel`` of them splitting it, packed), checkpointing on, the estimate without a limit.

    The hint's flags keep ``fsdp2``'s precision and offload where the run has them, else its defaults
    (bf16 compute over fp32 master weights, no offload).
    """
    from batchfit.memory import get_backend
    from batchfit.models import parse_dtype
    from batchfit.parallel.distributed import simulated_world

    base = build.sharding
    fsdp2 = base.spec.scale_out  # already the strategy suggested: its own options kept
    unlimited = get_backend("estimate", reserve_bytes=build.backend.reserve_bytes or 1, round_to=build.backend.round_to)
    sharding = Sharding(
        scale_out_strategy().name,
        world_size=world,
        mixed_precision=base.mixed_precision if fsdp2 else "bf16",
        offload=base.offload if fsdp2 else "none",
        sequence_parallel=sequence_parallel,
    )
    changes: dict[str, Any] = {"sharding": sharding, "gradient_checkpointing": True}
    if sequence_parallel > 1:
        changes["cost"] = "packed"
    builder = build.with_options(**changes).with_backend(unlimited)
    if not fsdp2:  # the hint's flags keep fsdp2's default: fp32 master weights
        builder = RoleBuilder(
            builder.config, unlimited, parse_dtype(default_dtype(sharding)), builder.options,
            builder.extrapolate, builder.depth,
        )
    with simulated_world(world):
        step = builder.step(role)
        try:
            return step.measure([seq_len])
        finally:
            del step
            _collect(unlimited)


def _candidate_peak(build: RoleBuilder, role: str, seq_len: int, **changes: Any) -> int:
    """One sequence of ``seq_len``'s peak with the run's own options but ``changes``, over its own simulated world,
    the estimate without a limit: how a remedy that changes the run (CPU offload, LoRA) is verified."""
    from batchfit.memory import get_backend

    unlimited = get_backend("estimate", reserve_bytes=build.backend.reserve_bytes or 1, round_to=build.backend.round_to)
    builder = build.with_options(**changes).with_backend(unlimited)
    with simulated_world_for(unlimited, builder.sharding):
        step = builder.step(role)
        try:
            return step.measure([seq_len]).peak_bytes
        finally:
            del step
            _collect(unlimited)


def _world_at_least(n: int) -> int:
    """The smallest world size >= ``n`` that clusters have: 1, 2, 4, 8, then whole 8-GPU nodes."""
    if n <= 8:
        return next(w for w in (1, 2, 4, 8) if w >= n)
    return -(-n // 8) * 8


def _world_below(n: int) -> int:
    """The world size before ``n`` in the sequence of :func:`_world_at_least`."""
    return n - 8 if n > 8 else max(1, n // 2)


#: The LoRA rank a "does not fit" hint measures (verl's and SkyRL's examples train rank 32–64 adapters).
_HINT_LORA_RANK = 64


def _state_candidates(build: RoleBuilder, role: str) -> list[Candidate]:
    """The remedies that change the run's state, each to be measured (NOTE [ Remedies are measured ]).

    CPU offload of FSDP2's sharded state (parameters, gradients, optimizer state on the host), and LoRA
    adapters on the frozen base for a trained role (no gradients or optimizer state for the base).
    """
    from batchfit.models.lora import LoraSpec

    out = []
    sharding = build.sharding
    if sharding.spec.scale_out and sharding.offload != "cpu":
        state = {"strategy": sharding.strategy, "world_size": sharding.world_size, "offload": "cpu"}
        out.append(
            Candidate(
                Phrase("offload the sharded state to the CPU (", Setting("sharding", state), ")"),
                {"sharding": dataclasses.replace(sharding, offload="cpu")},
            )
        )
    lora = build.options.lora
    if role in TRAINED_ROLES and (lora is None or not lora.enabled):
        out.append(
            Candidate(
                Phrase(
                    f"train LoRA adapters of rank {_HINT_LORA_RANK} on the frozen base instead of every parameter (",
                    Setting("lora_rank", _HINT_LORA_RANK),
                    "; another run: the base keeps no gradients or optimizer state)",
                ),
                {"lora": LoraSpec(_HINT_LORA_RANK)},
            )
        )
    return out


# NOTE [ Remedies are measured ]
# A "does not fit" refusal on the estimate backend names the term of the peak that is too large
# (batchfit.budget.remedies) and offers only what would make one sequence fit: the remedies that change the
# run's state (CPU offload, LoRA, more GPUs, sequence parallelism) each measured at max_seq_len with the run's
# own options but that one change, the step's own remedies kept only where the terms they remove could bring
# the peak under the limit, and the memory that would fit it computed from the peak. Mixtral-8x7B on 16 × H100
# (8,192 tokens): 113.95 GiB per rank, 85.5 of it sharded state that more ranks do not shrink (8 experts in
# one tensor per layer, sharded on its first dimension, give 8 ranks at most a share); CPU offload measures
# 28.5 GiB and LoRA 42.7 GiB against a 67.2 GiB limit, activation offload (6.4 GiB) cannot help.


def _candidate_fits(build: RoleBuilder, role: str, seq_len: int, candidate: Candidate, limit: int) -> bool:
    """Whether one sequence fits with ``candidate``'s change: measured; a change this run cannot take (LoRA under
    FSDP1 where it is not modelled, PEFT not installed) is not offered."""
    try:
        return _candidate_peak(build, role, seq_len, **candidate.change) <= limit
    except (InvalidArgument, ImportError):
        return False


def _floor_words(breakdowns: dict[int, dict[str, int]], moe: MoeSummary | None) -> str:
    """Why no world size fits, from the two smallest measured: the term that does not shrink with more ranks."""
    from batchfit.budget.remedies import term_bytes

    worlds = sorted(breakdowns)[:2]
    if len(worlds) < 2:
        return ""
    n1, n2 = worlds
    small, large = term_bytes(breakdowns[n1]), term_bytes(breakdowns[n2])
    term, nbytes = next(iter(large.items()))
    words = f"at {n2} ranks the {term} alone is {_fmt_bytes(nbytes)} per rank ({_fmt_bytes(small.get(term, 0))} at {n1})"
    if moe is not None and moe.experts < n2 and nbytes > 0.75 * small.get(term, 0):
        if term == "sharded state":
            words += (
                f": FSDP2 shards each tensor along its first dimension, and {moe.experts} experts held in one tensor "
                f"per layer give at most {moe.experts} ranks a share"
            )
        elif term == "gathered layers":
            words += (
                f": FSDP2 pads each tensor's first dimension to a multiple of the ranks, so {moe.experts} experts held "
                f"in one tensor per layer gather as {n2} over {n2} ranks"
            )
    return words


def _fmt_bytes(n: int) -> str:
    from batchfit.memory.sizes import format_bytes

    return format_bytes(n)


def _memory_remedy(exc: DoesNotFitError, build: RoleBuilder) -> Phrase | None:
    """"give more memory", with the memory that would fit the sequence (computed from its peak)."""
    from batchfit.budget.remedies import memory_needed

    if exc.needed is None or exc.usable_bytes is None:
        return None
    margin = float(build.options.safety_margin)
    if margin <= 0:
        return None
    # the reserve holds what other models keep too (colocated roles, an engine): NOTE [ Remedies are measured ]
    memory = memory_needed(exc.needed, margin, int(exc.reserve_bytes or 0))
    return Phrase(
        "give more memory (", Setting("memory_limit", memory), " or more at ",
        Setting("safety_margin", margin), ")",
    )


def _with_world_size_hint(
    exc: DoesNotFitError, role: str, build: RoleBuilder, seq_len: int, moe: MoeSummary | None = None
) -> DoesNotFitError:
    from batchfit.budget.remedies import pertinent, term_words

    limit = exc.available if exc.available is not None else 0
    needed = exc.needed if exc.needed is not None else 0
    world_limit = limit
    untracked = build.backend.untracked
    if untracked is not None and not untracked.nccl_bytes:  # the suggested world has NCCL's buffers too
        world_limit -= untracked_memory(world_size=2).nccl_bytes
    start = build.sharding.spec.search_start(build.sharding.world_size)
    breakdowns: dict[int, dict[str, int]] = {}
    world = smallest_fitting_world_size(build, role, seq_len, world_limit, start=start, breakdowns=breakdowns)
    split = None if world is not None else smallest_fitting_sequence_parallel(build, role, seq_len, world_limit, start=start)
    # NOTE [ Remedies are measured ]: the state-changing remedies that fit, the step's that could
    measured = [c.remedy for c in _state_candidates(build, role) if _candidate_fits(build, role, seq_len, c, limit)]
    too_large = term_words(exc.breakdown, needed, limit, _fmt_bytes) if exc.breakdown and needed else ""
    said = Phrase(f"{role}: ", *exc.message.parts, f"; {too_large}" if too_large else "")
    memory = _memory_remedy(exc, build)
    own = [
        r for r in pertinent(exc.remedies, exc.breakdown, needed, limit)
        if not any(getattr(p, "name", None) in ("sharding", "memory_limit") for p in r.parts)
    ]
    own += [memory] if memory is not None else []
    if split is not None:
        # NOTE [ A group's budget ]: one sequence fits once it is split over sp GPUs
        sp, split_world = split
        fits_split = Phrase(
            "it fits with ",
            (
                Setting("sharding", {"strategy": "fsdp2", "world_size": split_world, "sequence_parallel": sp}),
                Setting("cost", "packed"),
                Setting("gradient_checkpointing", True),
            ),
            f" (Ulysses: each GPU holds 1/{sp} of the sequence; verl ulysses_sequence_parallel_size, "
            "SkyRL sequence_parallel_size)",
        )
        no_world = said + Phrase(
            f"; no fsdp2 world size up to {_MAX_HINT_WORLD} fits it unsplit, sequence parallelism {sp} over "
            f"{split_world} GPUs does"
        )
        out = exc.replace(no_world, remedies=(*measured, fits_split, *own))
    elif world is None:
        floor = _floor_words(breakdowns, moe)
        no_world = said + Phrase(
            f"; no fsdp2 world size up to {_MAX_HINT_WORLD} fits it either" + (f" ({floor})" if floor else "")
        )
        out = exc.replace(no_world, remedies=(*measured, *own))
    else:
        fits_with = Phrase(
            "it fits with ",
            (Setting("sharding", {"strategy": "fsdp2", "world_size": world}), Setting("gradient_checkpointing", True)),
            " (one sequence per rank; sequence parallelism splits longer ones)",
        )
        out = exc.replace(said, remedies=(fits_with, *measured, *own))
    out.world_size_hint = world if split is None else split[1]
    out.sequence_parallel_hint = None if split is None else split[0]
    return out
