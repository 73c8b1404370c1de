"""Speak the RL frameworks' language: read SkyRL and verl configs (and batchfit's flat keys).

:func:`read_run_config` takes a YAML/JSON file or a mapping, tells its vocabulary from the
keys, merges it over the framework's defaults, resolves the interpolations with OmegaConf
and returns a :class:`RunConfig`: the batch sizes under the framework's rules, and what
``batchfit profile --config`` measures (model, longest sequence, GPUs, offload,
checkpointing, roles). :mod:`batchfit.frameworks.emit` writes the keys back.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.errors import BatchConfigError
from batchfit.frameworks import skyrl, verl
from batchfit.frameworks.run import RunConfig, as_bool, as_int
from batchfit.frameworks.source import (
    VOCABULARIES,
    check_mapping,
    detect_vocabulary,
    flatten,
    read_mapping,
    resolve,
)
from batchfit.plan.config import BatchConfig
from batchfit.validation import closest

__all__ = ["VOCABULARIES", "RunConfig", "coerce", "read_run_config"]


def read_run_config(
    source: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> RunConfig:
    """Read a config in batchfit's, SkyRL's or verl's vocabulary.

    Args:
        source: a YAML (``.yaml``/``.yml``) or JSON file, or the mapping itself.
        overrides: :class:`~batchfit.plan.config.BatchConfig` field names (e.g. from ``--field
            value`` flags), applied last; strings are read as numbers or booleans.

    Returns:
        A :class:`RunConfig`; ``.plan()`` checks it under the framework's rules.

    Raises:
        BatchConfigError: the file cannot be read or parsed; a key that is not a string;
            keys of two frameworks, or of none; an interpolation that cannot be resolved;
            an unknown flat key or override (with the closest name); a misspelt batch key;
            a missing required flat field.
    """
    data = source if isinstance(source, Mapping) else read_mapping(source)
    check_mapping(data)
    vocabulary = detect_vocabulary(data)
    resolved = resolve(data, vocabulary)
    given = flatten(data)
    if vocabulary == "skyrl":
        run = skyrl.read(resolved, given)
    elif vocabulary == "verl":
        run = verl.read(resolved, given)
    else:
        run = RunConfig(
            vocabulary="flat", batch=BatchConfig(train_batch_size=None, policy_mini_batch_size=None)
        )
    return _apply_flat(run, resolved, overrides or {}, top_level_only=vocabulary != "flat")


def _apply_flat(
    run: RunConfig, resolved: Mapping[str, Any], overrides: Mapping[str, Any], *, top_level_only: bool
) -> RunConfig:
    """Flat field names in the file (beside a framework's sections they win) and the overrides."""
    fields = BatchConfig.fields()
    values: dict[str, Any] = {}
    faults: list[str] = []
    for key, value in resolved.items():
        if key in fields and not isinstance(value, Mapping):
            values[key] = value
        elif not top_level_only:
            hint = closest(key, fields)
            faults.append(f"unknown key {key!r}" + (f"; did you mean {hint!r}?" if hint else ""))
    for key, value in overrides.items():
        if key not in fields:
            hint = closest(key, fields)
            faults.append(f"unknown field {key!r}" + (f"; did you mean {hint!r}?" if hint else ""))
        else:
            values[key] = value
    batch = run.batch.replace(**{k: coerce(k, v) for k, v in values.items()})
    if run.vocabulary == "flat":
        for required in ("train_batch_size", "policy_mini_batch_size"):
            if getattr(batch, required) is None:
                faults.append(
                    f"{required} is required (prompts per {'step' if 'train' in required else 'optimizer step'})"
                )
    if faults:
        raise BatchConfigError([*run.faults, *faults])
    return run.replace(batch=batch)


def coerce(field: str, value: Any) -> Any:
    """Turn a string from the command line or a file into the field's type, where it reads as one.

    ``"1024"`` → 1024, ``"true"``/``"false"`` → bool (``step_wise``), ``"none"``/``"null"`` →
    None. Anything else is returned unchanged, and :meth:`BatchConfig.plan` reports it.
    """
    if not isinstance(value, str):
        return value
    if value.strip().lower() in ("none", "null", "~", ""):
        return None
    if field == "step_wise":
        return as_bool(value)
    if field == "framework":
        return value.strip().lower()
    return as_int(value)
