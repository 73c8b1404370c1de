"""The frameworks batchfit speaks, one :class:`FrameworkSpec` each, registered by name.

Callers ask :func:`get_framework` by name and never branch on a framework's name (STYLE.md
item 11, after torchtitan's ``TrainSpec``). :mod:`batchfit.frameworks` registers SkyRL's,
verl's, OpenRLHF's and slime's specs when it is imported; the package root imports it, so the
registry is full before any caller can ask (NOTE [ Rules registered from above ] in
:mod:`batchfit.plan.rules`). Registering a spec also registers its batch rules with the plan.

This module imports nothing that imports torch: a spec holds what reading and planning need
(``import batchfit`` stays light), and names the module that writes its keys for ``--emit``
(``<name>_emit.py``, which imports torch) by its dotted path, imported on first use
(:meth:`FrameworkSpec.emit_module`); :mod:`batchfit.frameworks.emit` and
:mod:`batchfit.frameworks.assumptions` call it there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.plan.rules import BatchRules, register_batch_rules
from batchfit.validation import closest

__all__ = [
    "FrameworkSpec",
    "command_frameworks",
    "config_frameworks",
    "framework_names",
    "framework_of",
    "get_framework",
    "launch_frameworks",
    "register_framework",
]


@dataclass(frozen=True)
class FrameworkSpec:
    """Everything batchfit knows of one framework that is not tied to torch.

    Attributes:
        name: the framework's vocabulary name (``"verl"``), the key of the registry, the value
            of ``RunConfig.vocabulary`` for its configs and of ``--emit``.
        title: the framework and the version batchfit mirrors, for messages (``"verl 0.9.1"``).
        display: how the framework is written in prose (``"SkyRL"``); ``name`` when empty.
        markers: keys only its config has (dotted paths; a section name stands for itself), which
            tell its vocabulary from the others' (:func:`~batchfit.frameworks.source.detect_vocabulary`),
            for a config reader (required); for a command reader, two flags only its trainer has,
            named in messages.
        launchers: the tokens that launch its trainer in a shell script, its flags following them
            (``"train.py"``, or a module run with ``python -m``); a command reader's spec has some.
            A config reader's may have some too (verl's ``verl.trainer.main_ppo``): its script's
            arguments are Hydra overrides, read as the config they compose
            (:mod:`batchfit.frameworks.hydra_overrides`).
        lora_keys: model role (``"policy"``, ``"critic"``) → the config keys of its LoRA rank, alpha
            and target modules (:func:`~batchfit.frameworks.lora_keys.read_lora`); empty when
            batchfit reads no LoRA keys of the framework.
        read_config: its YAML/JSON config reader, ``(resolved, given) → RunConfig`` (verl,
            SkyRL), or ``None``.
        read_command: its launch-command reader, ``Command → RunConfig`` (OpenRLHF, slime), or
            ``None``. Exactly one of the two readers is set.
        batch_rules: the batch rules :meth:`BatchConfig.plan` applies under
            ``framework=name`` (:class:`~batchfit.plan.rules.BatchRules`), or ``None`` when its
            runs take batchfit's exact splits and check their own rules
            (:class:`~batchfit.frameworks.flags.FrameworkRun`).
        head: the log-prob head it runs by default, a name of :data:`batchfit.train.HEADS`
            (``"verl"``, ``"skyrl"``: :class:`~batchfit.train.framework_heads.FrameworkHead`;
            ``"full"``: log-probs from the whole logits). NOTE [ Heads stay in train ] in
            :mod:`batchfit.train.framework_heads`.
        reference_dtype: the dtype its reference model loads in by default (``fp32``, ``bf16``).
        strategy_refusal: ``run → why profile cannot model the run's training strategy`` (with
            the flags that can), or ``None`` when the CLI judges the strategy itself.
        fsdp: the :class:`~batchfit.parallel.Sharding` strategy the config's strategy name
            ``fsdp`` means: ``"fsdp1"`` for verl (``FullyShardedDataParallel``), ``"fsdp2"``
            (``fully_shard``) for SkyRL, whose ``fsdp`` and ``fsdp2`` are the same.
        gpu_keys: the :class:`~batchfit.plan.config.BatchConfig` fields ``num_nodes`` and
            ``gpus_per_node`` → the config keys they are read from (for messages).
        emit_needs_plan: ``--emit`` derives keys from the config's batch plan (SkyRL's micro
            sizes), so the plan must hold before any probe.
        lora_reference: with a LoRA policy, the framework computes the reference log-probs with
            the actor, adapters disabled, and loads no reference model: the note that says so
            (verl's ``ref_in_actor``); ``None`` when a reference model is loaded all the same.
        compiled_entropy: the framework compiles its full entropy, which the probe runs eagerly
            (an upper bound): the note that says so; ``None`` when it runs eagerly too.
        emit: the dotted name of the module that writes its keys for ``--emit``
            (``"batchfit.frameworks.verl_emit"``), imported on first use by :meth:`emit_module`
            (it imports torch; the spec does not); ``None`` when ``--emit`` cannot target it.

    Raises:
        InvalidArgument: not exactly one reader; a config reader without markers, or a command
            reader without launchers.
    """

    name: str
    title: str
    display: str = ""
    markers: tuple[str, ...] = ()
    launchers: tuple[str, ...] = ()
    lora_keys: Mapping[str, tuple[str, str, str]] = field(default_factory=dict, compare=False)
    read_config: Callable[[dict[str, Any], dict[str, Any]], Any] | None = None
    read_command: Callable[[Any], Any] | None = None
    batch_rules: BatchRules | None = None
    head: str = "full"
    reference_dtype: str = "bf16"
    strategy_refusal: Callable[[Any], str | None] | None = None
    fsdp: str = "fsdp2"
    gpu_keys: Mapping[str, str] = field(default_factory=dict, compare=False)
    emit_needs_plan: bool = False
    lora_reference: str | None = None
    compiled_entropy: str | None = None
    emit: str | None = None

    def __post_init__(self) -> None:
        if (self.read_config is None) == (self.read_command is None):
            raise InvalidArgument(
                f"FrameworkSpec {self.name!r} must set exactly one of read_config (a YAML/JSON config reader) and "
                "read_command (a launch-command reader)"
            )
        if self.read_config is not None and not self.markers:
            raise InvalidArgument(
                f"FrameworkSpec {self.name!r} reads a config but has no markers; name the keys only its config has"
            )
        if self.read_command is not None and not self.launchers:
            raise InvalidArgument(
                f"FrameworkSpec {self.name!r} reads a launch command but has no launchers; name the tokens that "
                "launch its trainer"
            )

    @property
    def prose(self) -> str:
        """How the framework is written in prose: :attr:`display`, else :attr:`name`."""
        return self.display or self.name

    @property
    def reads_command(self) -> bool:
        """The framework is configured by a launch command (its flags), not a YAML/JSON file."""
        return self.read_command is not None

    def emit_module(self) -> ModuleType:
        """The module named by :attr:`emit`, imported now if it was not yet.

        It defines ``token_keys(profile, budgets, why, max_seq_len, world) → list[Key]``, the
        token budgets' keys for :func:`batchfit.frameworks.emit.emit_keys` (``budgets``: role →
        tokens per GPU; ``why(role, what)``: the comment naming a role's budget and its
        provenance; ``world``: the GPUs profiled), and ``assumption_keys(run, assumptions, same)
        → list[Key]``, the keys of every profiled setting for
        :func:`batchfit.frameworks.assumptions.setting_keys` (``same``: ``run`` is written in this
        framework's own vocabulary), raising :class:`~batchfit.frameworks.assumptions.EmitError`
        for a setting it cannot express.

        Raises:
            InvalidArgument: the spec names no emit module.
        """
        if self.emit is None:
            raise InvalidArgument(
                f"framework {self.name!r} has no emit module (FrameworkSpec.emit is None); --emit cannot write its keys"
            )
        return importlib.import_module(self.emit)


_SPECS: dict[str, FrameworkSpec] = {}


def register_framework(spec: FrameworkSpec) -> None:
    """Register ``spec`` under ``spec.name`` (and its batch rules with the plan).

    Raises:
        InvalidArgument: another spec is registered under that name.
    """
    known = _SPECS.get(spec.name)
    if known is not None and known is not spec:
        raise InvalidArgument(f"framework {spec.name!r} is registered already; register each framework once")
    _SPECS[spec.name] = spec
    if spec.batch_rules is not None:
        register_batch_rules(spec.batch_rules)


def framework_of(vocabulary: str) -> FrameworkSpec | None:
    """The spec of the framework whose vocabulary a config is written in; ``None`` for batchfit's own (``"flat"``)."""
    return _SPECS.get(vocabulary)


def config_frameworks() -> tuple[FrameworkSpec, ...]:
    """The registered frameworks configured by a YAML/JSON file, in the order they were registered."""
    return tuple(spec for spec in _SPECS.values() if not spec.reads_command)


def command_frameworks() -> tuple[FrameworkSpec, ...]:
    """The registered frameworks configured by a launch command, in the order they were registered."""
    return tuple(spec for spec in _SPECS.values() if spec.reads_command)


def launch_frameworks() -> tuple[FrameworkSpec, ...]:
    """The registered frameworks a shell script can launch (with :attr:`FrameworkSpec.launchers`), in registration order."""
    return tuple(spec for spec in _SPECS.values() if spec.launchers)


def framework_names() -> tuple[str, ...]:
    """The registered frameworks' names, in the order they were registered."""
    return tuple(_SPECS)


def get_framework(name: str) -> FrameworkSpec:
    """The spec registered as ``name``.

    Raises:
        InvalidArgument: (a ``ValueError``) ``name`` is not registered; the message names it, the
            choices and the closest one.
    """
    spec = _SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        hint = closest(name, tuple(_SPECS)) if isinstance(name, str) else None
        raise InvalidArgument(
            f"framework={name!r} is not one batchfit knows; choices: {', '.join(_SPECS)}"
            + (f"; did you mean {hint!r}?" if hint else "")
        )
    return spec
