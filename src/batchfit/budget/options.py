"""How a model is profiled: :class:`ProfileOptions`, one object from the command line to the search.

The CLI builds one from its flags, :func:`batchfit.budget.profile_model` and
:func:`batchfit.frameworks.run_profile.profile_run` take it (or its fields as keywords), and every
role's search reads it: the same settings reach every pass of a run, and a setting cannot be
dropped on the way.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

from batchfit.budget.budget_search import check_max_seq_len
from batchfit.budget.causal_lm_probe import check_response_fraction
from batchfit.errors import KEYWORDS, InvalidArgument, Phrase, Setting, Vocabulary
from batchfit.memory import BACKEND_NAMES
from batchfit.memory.cuda_untracked import ALLOCATOR_MARGINS, ALLOCATORS, DEFAULT_ALLOCATOR
from batchfit.memory.sizes import parse_size
from batchfit.models.lora import LoraSpec, as_lora
from batchfit.models.moe import ROUTINGS, check_experts_implementation
from batchfit.parallel.sharding import Sharding, as_sharding
from batchfit.plan import COSTS
from batchfit.train.framework_heads import FrameworkHead
from batchfit.train.megatron_heads import MegatronHeads
from batchfit.train.model_outputs import check_head
from batchfit.validation import as_number, check_choice, check_number, closest, short_repr

__all__ = ["MEGATRON_ROUTER_FIELDS", "ROUTER_DTYPES", "ROUTER_LOAD_BALANCING", "ProfileOptions", "check_megatron_router"]

# NOTE [ Megatron's router settings ]
# Four ``TransformerConfig`` fields of megatron-core 0.16.1 change what a mixture of experts' router keeps for
# backward (tests/test_megatron_moe.py, tiny Qwen3-MoE at EP 2, estimate = cpu to the byte: +4,240 B for the
# auxiliary loss, +7,136 B for fp32 router logits, +268 B for the z-loss): ``moe_router_load_balancing_type`` with
# ``moe_aux_loss_coeff`` (a loss, with its fp32 scores, only where the coefficient of that type is above 0:
# ``TopKRouter.get_aux_loss_coeff``), ``moe_router_dtype`` (the gating linear and its logits in fp32 or fp64;
# ``None``: the parameters' dtype) and ``moe_z_loss_coeff`` (``None``: no z-loss). Megatron-LM's flags of the same
# names set them (``--moe-aux-loss-coeff`` ...). A profile carries them as ``ProfileOptions.megatron_router``, the
# fields set and nothing else: a field left out keeps the model's own mapping (mbridge's: no load balancing, so no
# auxiliary loss, "default None for RL"; fp32 router logits for DeepSeek-V3). Not modelled: ``sinkhorn`` (its
# routing is decided by float scores in a convergence loop, outside Megatron's top-k replay hook through which the
# probe fixes the worst case: NOTE [ Megatron's mixture of experts on CPU ranks ] in batchfit.models.moe_megatron),
# ``quantile_balancing`` (Megatron-LM's, not megatron-core 0.16.1's) and lists of several types.

#: The ``TransformerConfig`` fields ``megatron_router`` takes (NOTE [ Megatron's router settings ]).
MEGATRON_ROUTER_FIELDS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_router_dtype", "moe_z_loss_coeff")
#: The load balancing types a profile models (megatron-core 0.16.1's but ``sinkhorn``).
ROUTER_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
#: ``moe_router_dtype``'s values (``None``: the parameters' dtype).
ROUTER_DTYPES = ("fp32", "fp64")
_NOT_MODELLED = {
    "sinkhorn": (
        "is not modelled: Sinkhorn routing picks experts from float scores in a convergence loop, outside Megatron's "
        "top-k replay hook the probe fixes the worst-case routing through"
    ),
    "quantile_balancing": "is Megatron-LM's, not megatron-core 0.16.1's (the version batchfit runs)",
}


def check_megatron_router(name: str, value: Any, *, names: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """``value`` as ``megatron_router``: a dict of the :data:`MEGATRON_ROUTER_FIELDS` it sets, in that order; ``None`` for
    none (NOTE [ Megatron's router settings ]).

    ``value`` is ``None``, a mapping, or the command line's ``"field=value,field=value"``
    (``"moe_aux_loss_coeff=1e-3,moe_router_load_balancing_type=seq_aux_loss"``). A message names a field as
    ``names`` says it (a framework's flag: ``{"moe_aux_loss_coeff": "--moe-aux-loss-coeff"}``), else ``"{name} {field}"``.

    Raises:
        InvalidArgument: an unknown field (the closest named), a load balancing type not modelled or not
            Megatron's, a dtype other than fp32 or fp64, a coefficient that is not a number >= 0.

    Example:
        >>> check_megatron_router("megatron_router", "moe_router_dtype=fp32,moe_aux_loss_coeff=0.001")
        {'moe_aux_loss_coeff': 0.001, 'moe_router_dtype': 'fp32'}
    """
    if value is None:
        return None
    fix = "pass e.g. moe_aux_loss_coeff=0.001,moe_router_load_balancing_type=seq_aux_loss"
    if isinstance(value, str):
        value = _router_pairs(name, value, fix)
    if not isinstance(value, Mapping):
        raise InvalidArgument(
            f"{name} must map Megatron TransformerConfig router fields to values, but got {name}={short_repr(value)}; {fix}"
        )
    out: dict[str, Any] = {}
    for key, given in value.items():
        if key not in MEGATRON_ROUTER_FIELDS:
            near = closest(str(key), MEGATRON_ROUTER_FIELDS)
            raise InvalidArgument(
                f"{name} has no field {short_repr(key)}{f' (did you mean {near!r}?)' if near else ''}; its fields are "
                f"{', '.join(MEGATRON_ROUTER_FIELDS)}"
            )
        said = (names or {}).get(key, f"{name} {key}")
        if key == "moe_router_load_balancing_type":
            if isinstance(given, (list, tuple)):
                raise InvalidArgument(
                    f"{said}={short_repr(given)} combines several load balancing types, which is not modelled; pass one of "
                    f"{', '.join(ROUTER_LOAD_BALANCING)}"
                )
            if given in _NOT_MODELLED:
                raise InvalidArgument(f"{said}={given!r} {_NOT_MODELLED[given]}; use one of {', '.join(ROUTER_LOAD_BALANCING)}")
            out[key] = check_choice(said, given, ROUTER_LOAD_BALANCING)
        elif key == "moe_router_dtype":
            out[key] = None if given is None else check_choice(said, given, ROUTER_DTYPES)
        elif key == "moe_z_loss_coeff" and given is None:  # Megatron's default: no z-loss
            out[key] = None
        else:  # a coefficient; a YAML reader gives 1e-3 (no dot) as a string
            out[key] = check_number(said, as_number(given), low=0.0)
    return {key: out[key] for key in MEGATRON_ROUTER_FIELDS if key in out} or None


def _router_pairs(name: str, text: str, fix: str) -> dict[str, Any]:
    """``"field=value,field=value"`` → a dict, the coefficients read as numbers (checked by :func:`check_megatron_router`)."""
    out: dict[str, Any] = {}
    for pair in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, raw = (part.strip() for part in pair.partition("="))
        if not sep or not key or not raw:
            raise InvalidArgument(f"{name} takes field=value pairs, but got {name}={text!r}; {fix}")
        if key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            try:
                out[key] = float(raw)
            except ValueError:
                raise InvalidArgument(f"{name} {key} must be a number, but got {name} {key}={raw!r}; {fix}") from None
        else:
            out[key] = raw
    return out


@dataclass(frozen=True)
class ProfileOptions:
    """The settings of a profile: what is measured, on what, and how the budget is searched.

    Attributes:
        max_seq_len: the longest sequence the budgets must cover.
        backend: ``auto`` (cuda if available, else estimate), ``cpu``, ``estimate``, ``cuda``.
        memory_limit: bytes, ``"80GiB"`` or a device preset; required for cpu and estimate. Read
            once into :attr:`memory_bytes`.
        reserve_bytes: bytes of ``memory_limit`` no tracker sees (see
            :func:`batchfit.memory.get_backend`); ``None`` = the backend's default. A size is read
            into bytes.
        dtype: the dtype parameters are stored in (``bf16``, ``fp32``, …); ``None``: fp32
            under ``fsdp2`` mixed precision (fp32 master weights, bf16 compute), else bf16.
        gradient_checkpointing: non-reentrant activation checkpointing of every layer (off unless
            asked; ``batchfit profile`` asks by default, ``--no-gradient-checkpointing`` not).
        logprobs: the policy's log-prob head, one of :data:`batchfit.train.HEADS` or a
            :class:`~batchfit.train.framework_heads.FrameworkHead`, or under ``megatron`` a
            :class:`~batchfit.train.megatron_heads.MegatronHeads` (each pass's head) (``full``
            fp32 ``log_softmax`` of the whole logits, ``chunked``, ``fused``; ``trl``: TRL's own
            fused kernel, NOTE [ TRL's head ] in :mod:`batchfit.train.trl_head`, needs TRL).
        cost: ``padded`` (rows × longest) or ``packed`` (sum of lengths, counted to the token).
        safety_margin: the fraction of the usable bytes a peak may reach, in ``(0, 1]``;
            ``None``: the margin ``allocator`` needs (NOTE [ The allocator's share ] in
            :mod:`batchfit.memory.cuda_untracked`: 0.85 with expandable segments, 0.83 without).
            Read back, it is always the margin in force.
        allocator: the allocator setting the training processes run with, one of
            :data:`~batchfit.memory.cuda_untracked.ALLOCATORS`: ``"expandable_segments"``
            (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, what batchfit's emitted
            settings turn on) or ``"caching"`` (the default segments, which fragment over a run);
            ``None``: ``expandable_segments``.
        engine_reserve: bytes per GPU a rollout engine sharing the GPUs keeps on them while it
            sleeps (its CUDA context, communicators and CUDA-graph pool: :mod:`batchfit.budget.engine`),
            taken off the usable memory like the reserve; a size (``"7GiB"``), bytes, or 0.
            ``None``: none for a model profile, the config's engine for a framework run
            (:func:`batchfit.frameworks.run_profile.profile_run`); given, it replaces the config's.
        optimizer_offload: the trained roles' optimizer state lives on the host outside their
            update (verl's ``optimizer_offload``: loaded for ``update_actor``, offloaded after), so
            their forward-only passes (``policy_forward``, ``critic_forward``) run without it.
        seq_lens: lengths to probe (``None`` = :func:`batchfit.budget.default_seq_lens`).
        sharding: a :class:`~batchfit.parallel.Sharding` (a strategy name is accepted and
            converted); ``None`` = one device.
        depth_extrapolation: measure two shallow copies of the model and extrapolate to its
            depth (NOTE [ Peak memory is affine in depth ]); ``None``: on for the estimate
            backend when the layers are identical and deeper than the copies.
        suggest_world_size: when one sequence does not fit on the estimate backend, name the
            smallest ``fsdp2`` world size (with checkpointing) that fits.
        progress: ``True`` logs each probe, ``False`` is silent, a callable receives each
            :class:`~batchfit.budget.BudgetProgress` (events carry the role).
        lora: LoRA adapters for the trained models (policy, critic and their forward passes):
            a :class:`~batchfit.models.lora.LoraSpec` or a mapping of its fields
            (``{"rank": 64, "alpha": 128, "targets": "all-linear"}``); the base is frozen (no
            gradients or optimizer state), AdamW holds the adapters (NOTE [ LoRA as the
            frameworks build it ] in :mod:`batchfit.models.lora`). A ``reference`` is profiled
            without adapters. ``None``: not set (full fine-tuning, or a framework config's own
            LoRA in :func:`~batchfit.frameworks.run_profile.profile_run`); rank 0: full fine-tuning.
        response_only: the policy's and reference's head runs only on the loss tokens
            (:func:`batchfit.train.model_logprobs` with ``only_loss_tokens=True``); the budget
            gains a second cap, ``response_tokens`` (NOTE [ A budget in two dimensions ]).
        response_fraction: with ``response_only``, the share of a sequence's tokens that are
            response (loss) tokens, in ``(0, 1]`` (a 4:1 prompt:response ratio is 0.2);
            ``None``: every token but the first (the most there can be).
        activation_offload: the trained roles offload what each decoder layer saves for
            backward to host memory, as verl's ``enable_activation_offload`` does (NOTE
            [ Activation offload as verl runs it ] in :mod:`batchfit.train.activation_offload`):
            the device budget rises and the host copies are reported as host bytes.
        experts_implementation: how a mixture of experts runs its experts: ``grouped_mm``,
            ``batched_mm`` or ``eager`` (NOTE [ Experts as transformers runs them ] in
            :mod:`batchfit.models.moe`); ``None``: what the installed transformers runs
            (``grouped_mm`` in 5.x). ``eager`` is probed with the worst-case routing. Dense
            models ignore it.
        routing: the routing a mixture of experts is probed with: ``None`` (automatic: the
            router's own where memory does not depend on it, the worst case ``"skewed"``
            where it does), ``"skewed"`` or ``"balanced"`` (to compare; a budget probed with it
            does not hold for every routing).
        compare_routing: where the worst case is probed (the ``eager`` loop), also search the
            budget with balanced routing and report it beside the worst case's
            (``ModelProfile.moe.balanced_tokens``). Off by default: the loop then runs every
            expert of every layer, slowly on the estimate (minutes for 128 experts).
        megatron_router: under ``sharding="megatron"``, the router settings of a mixture of experts as
            Megatron's ``TransformerConfig`` fields (:data:`MEGATRON_ROUTER_FIELDS`: the auxiliary loss's type and
            coefficient, the router's dtype, the z-loss): a mapping, or ``"field=value,..."``; the fields set pass to
            the probe, the others keep the model's mapping (NOTE [ Megatron's router settings ]). ``None``: none set.

    Args:
        vocabulary: how a bad value's message names its setting (not a field): ``None``
            writes the keyword (``max_seq_len``), the command line passes its flags
            (``--max-seq-len``; NOTE [ Messages in the caller's vocabulary ] in :mod:`batchfit.errors`).

    Raises:
        InvalidArgument: a bad value, naming the field (in ``vocabulary``), the value and the fix.

    Example:
        >>> ProfileOptions(max_seq_len=8192, sharding="fsdp2").sharding.strategy
        'fsdp2'
    """

    max_seq_len: int
    backend: str = "auto"
    memory_limit: int | str | None = None
    reserve_bytes: int | str | None = None
    dtype: str | None = None
    gradient_checkpointing: bool = False
    logprobs: str | FrameworkHead | MegatronHeads = "full"
    cost: str = "padded"
    safety_margin: float | None = None
    seq_lens: Sequence[int] | None = None
    sharding: Sharding = field(default_factory=Sharding)
    depth_extrapolation: bool | None = None
    suggest_world_size: bool = True
    progress: bool | Callable[..., Any] = field(default=False, compare=False)
    lora: LoraSpec | None = None
    response_only: bool = False
    response_fraction: float | None = None
    activation_offload: bool = False
    experts_implementation: str | None = None
    routing: str | None = None
    compare_routing: bool = False
    allocator: str | None = None
    engine_reserve: int | str | None = None
    optimizer_offload: bool = False
    megatron_router: Mapping[str, Any] | None = None
    vocabulary: InitVar[Vocabulary | None] = None
    # the margin was left to the allocator (safety_margin=None): replace(allocator=...) derives it again
    _margin_defaulted: bool = field(default=False, init=False, repr=False, compare=False)
    # how this request's caller names its settings: replace() validates the changes in it too
    _vocabulary: Vocabulary | None = field(default=None, init=False, repr=False, compare=False)
    # memory_limit read once (NOTE [ Validated once ])
    _memory_bytes: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self, vocabulary: Vocabulary | None) -> None:
        # each value is validated here, where it enters the library, named as the caller writes it
        object.__setattr__(self, "_vocabulary", vocabulary)
        self._normalise({f.name for f in dataclasses.fields(self) if f.init})

    def _normalise(self, names: set[str]) -> None:
        """Check and normalise the fields ``names`` (frozen: set once, here), then the rules between fields.

        NOTE [ Validated once ]: a field is checked where it enters (construction, or the
        :meth:`replace` that changes it), never again: a replace checks only what it changes (the
        rules between fields are comparisons, rechecked each time), and the library's own calls
        read the normalised values (``memory_bytes``, ``reserve_bytes`` in bytes).
        """
        vocabulary = self._vocabulary
        name = (KEYWORDS if vocabulary is None else vocabulary).say
        set_ = object.__setattr__
        checks: dict[str, Callable[[Any], Any]] = {
            "max_seq_len": lambda v: check_max_seq_len(v, name(Setting("max_seq_len"))),
            "backend": lambda v: check_choice(name(Setting("backend")), v, BACKEND_NAMES),
            "logprobs": lambda v: v if isinstance(v, MegatronHeads) else check_head(name(Setting("logprobs")), v),
            "cost": lambda v: check_choice(name(Setting("cost")), v, COSTS),
            "allocator": lambda v: check_choice(name(Setting("allocator")), DEFAULT_ALLOCATOR if v is None else v, ALLOCATORS),
            "memory_limit": lambda v: v,
            "reserve_bytes": lambda v: None if v is None else parse_size(v, name=name(Setting("reserve_bytes"))),
            "engine_reserve": lambda v: None if v is None else parse_size(v, name=name(Setting("engine_reserve"))),
            "sharding": as_sharding,
            "lora": as_lora,
            "response_fraction": lambda v: check_response_fraction(v, name(Setting("response_fraction"))),
            "experts_implementation": lambda v: check_experts_implementation(name(Setting("experts_implementation")), v),
            "routing": lambda v: None if v is None else check_choice(name(Setting("routing")), v, ROUTINGS),
            "megatron_router": lambda v: check_megatron_router(name(Setting("megatron_router")), v),
        }
        if "allocator" in names:  # the margin left to the allocator follows it
            names = names | ({"safety_margin"} if self.safety_margin is None or self._margin_defaulted else set())
        for field_name in ("max_seq_len", "backend", "logprobs", "cost", "allocator"):
            if field_name in names:
                set_(self, field_name, checks[field_name](getattr(self, field_name)))
        if "safety_margin" in names:
            set_(self, "_margin_defaulted", self.safety_margin is None)
            if self.safety_margin is None:
                set_(self, "safety_margin", ALLOCATOR_MARGINS[self.allocator])
            margin = check_number(name(Setting("safety_margin")), self.safety_margin, low=0.0, high=1.0, low_open=True)
            set_(self, "safety_margin", margin)
        for field_name, check in checks.items():
            if field_name in names and field_name not in ("max_seq_len", "backend", "logprobs", "cost", "allocator"):
                set_(self, field_name, check(getattr(self, field_name)))
        if "memory_limit" in names:
            bytes_ = None if self.memory_limit is None else parse_size(self.memory_limit, name=name(Setting("memory_limit")))
            set_(self, "_memory_bytes", bytes_)
        for flag in (
            "gradient_checkpointing", "suggest_world_size", "response_only", "compare_routing", "activation_offload",
            "optimizer_offload",
        ):  # fmt: skip
            if flag in names and not isinstance(getattr(self, flag), bool):
                raise InvalidArgument(f"{flag} must be True or False, but got {flag}={getattr(self, flag)!r}")
        if self.response_fraction is not None and not self.response_only:
            raise InvalidArgument(
                f"response_fraction={self.response_fraction} is read only by the response-only head, but got "
                "response_only=False; pass response_only=True (--response-only) or drop response_fraction"
            )
        if isinstance(self.logprobs, MegatronHeads) and self.sharding.strategy != "megatron":
            raise InvalidArgument(
                Phrase(
                    "a MegatronHeads head runs on Megatron's last pipeline stage, but got ",
                    Setting("sharding", self.sharding.strategy),
                    "; use ",
                    Setting("sharding", "megatron"),
                    ", or name a head (",
                    Setting("logprobs", "full"),
                    ")",
                ).say(vocabulary)
            )
        if self.megatron_router is not None and self.sharding.strategy != "megatron":
            raise InvalidArgument(
                Phrase(
                    Setting("megatron_router", ",".join(f"{k}={v}" for k, v in self.megatron_router.items())),
                    " sets Megatron's router, read only by a Megatron profile, but got ",
                    Setting("sharding", self.sharding.strategy),
                    "; use ",
                    Setting("sharding", "megatron"),
                    ", or drop it",
                ).say(vocabulary)
            )
        if self.sharding.sequence_parallel > 1 and self.cost != "packed":
            raise InvalidArgument(
                Phrase(
                    Setting("sharding", {"sequence_parallel": self.sharding.sequence_parallel}),
                    " splits packed micro-batches over its ranks (verl and SkyRL need padding removed for it), but got ",
                    Setting("cost", self.cost),
                    "; use ",
                    Setting("cost", "packed"),
                ).say(vocabulary)
            )
        if "depth_extrapolation" in names and self.depth_extrapolation is not None and not isinstance(self.depth_extrapolation, bool):
            raise InvalidArgument(
                f"depth_extrapolation must be True, False or None (automatic), but got depth_extrapolation={self.depth_extrapolation!r}"
            )

    @property
    def caller_vocabulary(self) -> Vocabulary | None:
        """How this request's caller names its settings (``None``: keywords); messages about it use it."""
        return self._vocabulary

    @property
    def memory_bytes(self) -> int | None:
        """``memory_limit`` in bytes, read once (``None`` without a limit: the device's own)."""
        return self._memory_bytes

    def replace(self, **changes: Any) -> ProfileOptions:
        """A copy with ``changes`` applied and validated (only they: NOTE [ Validated once ]), a bad value named as
        this request's caller names it.

        Raises:
            InvalidArgument: an unknown field (the message lists the fields) or a bad value.
        """
        fields = [f.name for f in dataclasses.fields(self) if f.init]
        unknown = sorted(set(changes) - set(fields) - {"vocabulary"})
        if unknown:
            names = ", ".join(fields)
            raise InvalidArgument(f"ProfileOptions has no field {unknown[0]!r}; its fields are {names}")
        if self._margin_defaulted and "safety_margin" not in changes:
            changes["safety_margin"] = None  # still the allocator's margin, whichever allocator now
        copy = _copy.copy(self)
        set_ = object.__setattr__
        if "vocabulary" in changes:
            set_(copy, "_vocabulary", changes.pop("vocabulary"))
        for key, value in changes.items():
            set_(copy, key, value)
        copy._normalise(set(changes))
        return copy
