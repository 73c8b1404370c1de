"""The LoRA keys of a config: which adapters a framework would give a model.

:func:`read_lora` reads a flattened config (``{"a.b": value}``, defaults merged or not) in
batchfit's flat vocabulary or a registered framework's: each framework's keys are in its spec
(``FrameworkSpec.lora_keys``, with where the framework defines them: verl's in
:mod:`batchfit.frameworks.verl`, SkyRL's in :mod:`batchfit.frameworks.skyrl`). Every framework
gives rank 0 (off), alpha 16 and ``all-linear`` targets by default; batchfit's flat names are
``lora_rank``, ``lora_alpha``, ``lora_targets`` (the policy's; the command line's names) and
``critic_lora_rank``, ``critic_lora_alpha``, ``critic_lora_targets``.

``exclude_modules`` and ``dropout`` are not modelled (NOTE [ LoRA as the frameworks build it ]
in :mod:`batchfit.models.lora`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.frameworks.registry import framework_names, framework_of
from batchfit.frameworks.run import as_int
from batchfit.models.lora import ALL_LINEAR, LoraSpec, lora_spec
from batchfit.validation import as_number, check_choice

__all__ = ["FLAT_LORA_KEYS", "LORA_ROLES", "as_lora_spec", "lora_keys", "read_lora"]

#: The model roles a framework gives LoRA adapters of their own.
LORA_ROLES = ("policy", "critic")

#: role -> (rank key, alpha key, targets key) in batchfit's flat vocabulary.
FLAT_LORA_KEYS: dict[str, tuple[str, str, str]] = {
    "policy": ("lora_rank", "lora_alpha", "lora_targets"),
    "critic": ("critic_lora_rank", "critic_lora_alpha", "critic_lora_targets"),
}


def lora_keys(vocabulary: str) -> Mapping[str, tuple[str, str, str]]:
    """Role → (rank key, alpha key, targets key) of ``vocabulary``: ``"flat"`` or a registered
    framework's name whose spec has LoRA keys.

    Raises:
        InvalidArgument: a vocabulary with no LoRA keys (the choices listed).
    """
    if vocabulary == "flat":
        return FLAT_LORA_KEYS
    specs = (framework_of(name) for name in framework_names())
    known = {spec.name: spec.lora_keys for spec in specs if spec is not None and spec.lora_keys}
    check_choice("vocabulary", vocabulary, ("flat", *known))
    return known[vocabulary]


def read_lora(flat: Mapping[str, Any], vocabulary: str, *, role: str = "policy") -> LoraSpec | None:
    """The LoRA adapters ``flat`` gives ``role``'s model, or ``None`` without LoRA (rank 0 or unset).

    Args:
        flat: the config flattened to dotted keys (lists are values); a missing key has the
            framework's default (rank 0, alpha 16, ``all-linear``). Strings from command-line
            overrides (``"64"``) are read as numbers.
        vocabulary: ``"flat"`` or a framework's name with LoRA keys (``"verl"``, ``"skyrl"``).
        role: ``"policy"`` (default) or ``"critic"``.

    Returns:
        A :class:`~batchfit.models.lora.LoraSpec` with ``rank > 0``, or ``None``.

    Raises:
        InvalidArgument: an unknown vocabulary or role; a bad value, named by its key (a
            negative rank, a non-positive alpha, targets that are neither ``all-linear`` nor
            module names, such as a regular expression).

    Example:
        >>> read_lora({"actor_rollout_ref.model.lora_rank": 64, "actor_rollout_ref.model.lora_alpha": 128}, "verl")
        LoraSpec(rank=64, alpha=128, targets='all-linear')
        >>> read_lora({"trainer.policy.model.lora.rank": 0}, "skyrl") is None
        True
    """
    keys = lora_keys(vocabulary)
    check_choice("role", role, LORA_ROLES)
    rank_key, alpha_key, targets_key = keys[role]
    rank = as_int(flat.get(rank_key, 0))
    if rank is None:  # YAML null: the field's default
        rank = 0
    alpha = _number(flat.get(alpha_key))
    targets = _targets(flat.get(targets_key), targets_key, peft_string=vocabulary != "flat")
    spec = lora_spec(
        rank,
        alpha,
        targets,
        names={"rank": rank_key, "alpha": alpha_key, "targets": targets_key},
    )
    return spec if spec.enabled else None


def as_lora_spec(value: Any, name: str = "lora") -> LoraSpec | None:
    """A run's LoRA as a spec: a :class:`~batchfit.models.lora.LoraSpec`, or the mapping a config reader gives.

    Args:
        value: ``None``, a ``LoraSpec``, or a mapping with ``rank`` and optionally ``alpha`` and
            ``target_modules`` (or ``targets``); other keys (``exclude_modules``) are ignored.
        name: how messages name it (``"run.lora"``).

    Returns:
        The spec, or ``None`` for ``None`` or rank 0.

    Raises:
        InvalidArgument: another type, or a bad value (named ``name.field``).

    Example:
        >>> as_lora_spec({"rank": 32, "alpha": None, "target_modules": ["q_proj"]})
        LoraSpec(rank=32, alpha=16, targets=('q_proj',))
    """
    if value is None or isinstance(value, LoraSpec):
        return value if value is None or value.enabled else None
    if not isinstance(value, Mapping):
        raise InvalidArgument(
            f"{name} must be a LoraSpec or a mapping with 'rank', but got {name}={value!r} ({type(value).__name__})"
        )
    # "targets" is batchfit's field (comma-separated names); "target_modules" the frameworks' (PEFT's)
    native = "targets" in value
    key = "targets" if native else "target_modules"
    rank = as_int(value.get("rank", 0))
    names = {"rank": f"{name}.rank", "alpha": f"{name}.alpha", "targets": f"{name}.{key}"}
    targets = _targets(value.get(key), names["targets"], peft_string=not native)
    spec = lora_spec(0 if rank is None else rank, _number(value.get("alpha")), targets, names=names)
    return spec if spec.enabled else None


def _number(value: Any) -> Any:
    """``"128"`` / ``"0.5"`` (command-line overrides) as numbers; ``None`` stays (the default)."""
    return as_number(as_int(value))


def _targets(value: Any, key: str, *, peft_string: bool = True) -> Any:
    """A config's ``target_modules``: ``all-linear`` or a list of names; another string is PEFT's regular expression.

    With ``peft_string=False`` (batchfit's own keys) a string is comma-separated names, as
    ``--lora-targets``.
    """
    if value is None or isinstance(value, (list, tuple)) or not peft_string:
        return value
    if isinstance(value, str) and value.strip() != ALL_LINEAR:
        raise InvalidArgument(
            f"{key}={value!r}: PEFT reads a string other than {ALL_LINEAR!r} as a regular expression over module paths, "
            f"which batchfit does not model; write {key} as a list of module names (e.g. [q_proj, v_proj]) or {ALL_LINEAR!r}"
        )
    return value
