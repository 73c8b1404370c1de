"""Reading a :class:`~batchfit.config.BatchConfig` from YAML, JSON, flat keys or SkyRL's nesting.

Flat mappings use the field names of :class:`BatchConfig`. A mapping with a ``trainer`` or
``generator`` section is read as a SkyRL config (``trainer.train_batch_size``,
``trainer.placement.policy_num_gpus_per_node``, ``generator.n_samples_per_prompt``, …);
keys batchfit does not use are ignored there, since a SkyRL config holds much more. Simple
``${a.b.c}`` references to other keys of the same file are resolved, as Hydra would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.config import BatchConfig
from batchfit.errors import BatchConfigError
from batchfit.validation import closest

# SkyRL dotted key -> BatchConfig field (first match wins when several name one field).
SKYRL_KEYS: dict[str, str] = {
    "trainer.train_batch_size": "train_batch_size",
    "trainer.policy_mini_batch_size": "policy_mini_batch_size",
    "trainer.critic_mini_batch_size": "critic_mini_batch_size",
    "trainer.micro_train_batch_size_per_gpu": "micro_train_batch_size_per_gpu",
    "trainer.micro_forward_batch_size_per_gpu": "micro_forward_batch_size_per_gpu",
    "trainer.update_epochs_per_batch": "update_epochs_per_batch",
    "trainer.max_tokens_per_micro_batch": "max_tokens_per_micro_batch",
    "trainer.max_tokens_per_microbatch": "max_tokens_per_micro_batch",
    "trainer.placement.policy_num_nodes": "num_nodes",
    "trainer.placement.policy_num_gpus_per_node": "gpus_per_node",
    "trainer.policy.sequence_parallel_size": "sequence_parallel",
    "trainer.policy.megatron_config.tensor_model_parallel_size": "tensor_parallel",
    "trainer.policy.megatron_config.pipeline_model_parallel_size": "pipeline_parallel",
    "trainer.policy.megatron_config.context_parallel_size": "context_parallel",
    "trainer.step_wise_training": "step_wise",
    "generator.step_wise_trajectories": "step_wise",
    "generator.step_wise_training": "step_wise",
    "generator.n_samples_per_prompt": "n_samples_per_prompt",
}
_CRITIC_PATH = "trainer.critic.model.path"
_REF = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


def _key_faults(data: Mapping[Any, Any], where: str = "") -> list[str]:
    """One fault per key that is not a string (YAML reads ``1:`` as an int, ``null:`` as None)."""
    faults = []
    for key, value in data.items():
        if not isinstance(key, str):
            place = f" under {where!r}" if where else ""
            faults.append(
                f"config key {key!r} ({type(key).__name__}){place} is not a name; keys are field names such as 'train_batch_size'"
            )
        elif isinstance(value, Mapping):
            faults.extend(_key_faults(value, f"{where}.{key}" if where else key))
    return faults


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _resolve(flat: dict[str, Any], key: str, seen: tuple[str, ...] = ()) -> Any:
    value = flat.get(key)
    match = _REF.match(value) if isinstance(value, str) else None
    if match is None:
        return value
    target = match.group(1)
    if target in seen or target not in flat:
        raise BatchConfigError([f"{key}={value!r} refers to {target!r}, which is missing or circular"])
    return _resolve(flat, target, (*seen, key))


def coerce(field: str, value: Any) -> Any:
    """Turn a string from the command line or a file into the field's type, where it reads as one.

    ``"1024"`` → 1024, ``"true"``/``"false"`` → bool, ``"none"``/``"null"`` → None. Anything
    else is returned unchanged, and :meth:`BatchConfig.plan` reports it as a fault.
    """
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("none", "null", "~", ""):
        return None
    if field == "step_wise" and text in ("true", "false", "yes", "no", "1", "0"):
        return text in ("true", "yes", "1")
    try:
        return int(text.replace("_", ""))
    except ValueError:
        return value


def config_from_mapping(data: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> BatchConfig:
    """Build a :class:`BatchConfig` from flat or SkyRL-nested keys, then apply ``overrides``.

    Args:
        data: flat field names, or a SkyRL config with ``trainer``/``generator`` sections
            (flat field names may sit beside them and win).
        overrides: flat field names, applied last (e.g. from ``--field value`` flags).

    Raises:
        BatchConfigError: unknown flat keys (each with the closest field name), a missing
            ``train_batch_size`` or ``policy_mini_batch_size``, or a broken ``${...}`` reference.
    """
    if not isinstance(data, Mapping):
        raise BatchConfigError(
            [f"a config must be a mapping of keys to values, but got {type(data).__name__}"]
        )
    key_faults = _key_faults(data)
    if key_faults:
        raise BatchConfigError(key_faults)
    fields = BatchConfig.fields()
    values: dict[str, Any] = {}
    faults: list[str] = []
    flat = _flatten(data)
    nested = any(isinstance(data.get(section), Mapping) for section in ("trainer", "generator"))
    if nested:
        for key, field in SKYRL_KEYS.items():
            if key in flat and field not in values:
                values[field] = _resolve(flat, key)
        critic_path = _resolve(flat, _CRITIC_PATH) if _CRITIC_PATH in flat else None
        if not critic_path and _CRITIC_PATH in flat:
            values.pop("critic_mini_batch_size", None)  # SkyRL: no critic model, no critic
    for key, value in data.items():
        if nested and (key in ("trainer", "generator") or isinstance(value, Mapping)):
            continue
        if key in fields and not isinstance(value, Mapping):
            values[key] = _resolve(flat, key)
        elif not nested:
            hint = closest(key, fields)
            faults.append(f"unknown key {key!r}" + (f"; did you mean {hint!r}?" if hint else ""))
    for key, value in (overrides or {}).items():
        if key not in fields:
            hint = closest(key, fields)
            faults.append(f"unknown field {key!r}" + (f"; did you mean {hint!r}?" if hint else ""))
        else:
            values[key] = value
    for required in ("train_batch_size", "policy_mini_batch_size"):
        if values.get(required) is None:
            where = "trainer." + required if nested else required
            faults.append(
                f"{where} is required (prompts per {'step' if 'train' in required else 'optimizer step'})"
            )
    if faults:
        raise BatchConfigError(faults)
    return BatchConfig(**{k: coerce(k, v) for k, v in values.items()})


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> BatchConfig:
    """Read a YAML (``.yaml``/``.yml``) or JSON (``.json``) config file; see :func:`config_from_mapping`.

    Raises:
        BatchConfigError: the file is missing, unreadable, not YAML/JSON, or its keys are wrong.
    """
    path = Path(path)
    if not path.is_file():
        raise BatchConfigError([f"config file {str(path)!r} does not exist"])
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = (
            "is not UTF-8 text"
            if isinstance(exc, UnicodeDecodeError)
            else f"cannot be read ({exc.strerror or exc})"
        )
        raise BatchConfigError([f"config file {str(path)!r} {reason}; pass a YAML or JSON file"]) from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # any parse error of the user's file is a bad-input error
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BatchConfigError([f"config file {str(path)!r} could not be parsed: {first}"]) from exc
    return config_from_mapping(data if data is not None else {}, overrides)
