"""The batch rules of a framework: what it refuses (a fault) and what it runs with waste (a warning).

A framework's rules are one :class:`BatchRules` object: :attr:`BatchRules.role` lays out one
trained model (``policy`` or ``critic``), :attr:`BatchRules.step` checks the whole step.
:meth:`BatchConfig.plan <batchfit.plan.config.BatchConfig.plan>` takes the object that
:func:`batch_rules` finds under ``cfg.framework``. This module holds batchfit's own rules
(``batchfit``: exact splits, nothing padded or floored) and the wording the frameworks' rules
share; SkyRL's and verl's live with the rest of what batchfit knows of them
(:mod:`batchfit.frameworks.skyrl_rules`, :mod:`batchfit.frameworks.verl_rules`) and are
registered by :mod:`batchfit.frameworks` (NOTE [ Rules registered from above ]).

Messages use :class:`~batchfit.plan.config.BatchConfig` field names; a framework config's
reader (:mod:`batchfit.frameworks`) rewrites them in the framework's keys.

NOTE [ Rules registered from above ]
``plan`` is below ``frameworks`` and imports nothing above it, yet ``BatchConfig(framework="verl")``
is public. So ``plan`` keeps a table of :class:`BatchRules` by name, holding only batchfit's
until :mod:`batchfit.frameworks` registers its frameworks' (:func:`register_batch_rules`); the
package root imports :mod:`batchfit.frameworks`, so every name is registered before any
``BatchConfig`` can be planned. ``plan`` looks a name up there and never branches on one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from batchfit.errors import InvalidArgument
from batchfit.plan.arith import divisors, nearest, or_list

ROLE_FIELDS = {"policy": "policy_mini_batch_size", "critic": "critic_mini_batch_size"}


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
        display: how the framework is written in prose (``"SkyRL"``); ``name`` when empty.
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
    display: str = ""
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


# ------------------------------------------------------------------ the rules by name

BATCHFIT = BatchRules("batchfit", role=_batchfit_role)
"""batchfit's own rules: exact splits, nothing padded or floored."""

_REGISTERED: dict[str, BatchRules] = {}


def register_batch_rules(rules: BatchRules) -> None:
    """Make ``rules`` the rules of ``BatchConfig(framework=rules.name)``; registering a name again replaces it."""
    _REGISTERED[rules.name] = rules


def framework_names() -> tuple[str, ...]:
    """The names :attr:`BatchConfig.framework` accepts, sorted (the order of registration does not show)."""
    return tuple(sorted(_REGISTERED))


def batch_rules(name: str) -> BatchRules:
    """The rules registered as ``name``.

    Raises:
        InvalidArgument: (a ``ValueError``) ``name`` is not registered; the message names it and the choices.
    """
    try:
        return _REGISTERED[name]
    except KeyError:
        raise InvalidArgument(f"framework={name!r} has no batch rules; choices: {', '.join(framework_names())}") from None


register_batch_rules(BATCHFIT)
