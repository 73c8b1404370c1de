"""Speak the RL frameworks' language: read SkyRL, verl, AReaL, NeMo-RL, ROLL and prime-rl configs, OpenRLHF and slime
launch commands.

:func:`read_run_config` takes a YAML/JSON file or a mapping, tells its vocabulary from the
keys, merges it over the framework's defaults, resolves the interpolations with OmegaConf
and returns a :class:`RunConfig`: the batch sizes under the framework's rules, and what
``batchfit profile --config`` measures (model, longest sequence, GPUs, offload,
checkpointing, roles). Any other file is a launch command (a shell script or a file of
arguments, :mod:`batchfit.frameworks.flags`): OpenRLHF's or slime's, told from the command
and read by :mod:`~batchfit.frameworks.openrlhf` or :mod:`~batchfit.frameworks.slime`.
:mod:`batchfit.frameworks.emit` writes the keys (or flags) back.

Each framework is one :class:`~batchfit.frameworks.registry.FrameworkSpec`, registered by name
in :mod:`batchfit.frameworks.registry` when this package is imported; callers ask
:func:`~batchfit.frameworks.registry.get_framework` and never branch on a framework's name.

Adding a framework means adding its module, ``batchfit/frameworks/<name>.py`` (with, beside it, its
rules in ``<name>_rules.py`` where it has its own and its keys for ``--emit`` in ``<name>_emit.py``),
and registering it:

- a reader: ``read(resolved, given) → RunConfig`` for a YAML/JSON config (its defaults and schema
  in ``defaults/``, the keys only its config has in ``FrameworkSpec.markers``, which
  :func:`~batchfit.frameworks.source.detect_vocabulary` tells vocabularies apart by),
  or ``read(command) → FrameworkRun`` for a launch command (its flags in
  ``defaults/<name>_flags.json``, the tokens that launch it in ``FrameworkSpec.launchers``);
- its batch rules: a :class:`~batchfit.plan.rules.BatchRules` that ``BatchConfig.plan`` applies
  under ``framework=<name>`` (a rules module beside it, as ``verl_rules.py``), or rules of the run
  (``FrameworkRun.rules``, as OpenRLHF's and slime's) over batchfit's exact splits;
- its log-prob head by name (a head of :data:`batchfit.train.HEADS`; a new head is defined in
  :mod:`batchfit.train.framework_heads`, NOTE [ Heads stay in train ] there), the dtype of its
  reference, and why ``profile`` cannot model a training strategy it runs, if any;
- ``SPEC = FrameworkSpec(...)`` holding them, added to :data:`SPECS` below;
- for ``--emit``: an emit module, ``<name>_emit.py``, named in the spec by its dotted path
  (``FrameworkSpec.emit``, imported on first use: it imports torch, the registry does not), that
  defines ``token_keys(profile, budgets, why, max_seq_len, world)``, the keys of its token budgets,
  and ``assumption_keys(run, assumptions, same)``, the keys of every profiled setting or an
  :class:`~batchfit.frameworks.assumptions.EmitError` for one it cannot express (NOTE [ Emitted keys
  carry every assumption ]); :mod:`batchfit.frameworks.emit` and
  :mod:`batchfit.frameworks.assumptions` call them through the registry and hold the helpers they
  share (:class:`~batchfit.frameworks.assumptions.Key`, the checks and refusals).
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchfit.errors import BatchConfigError, InvalidArgument
from batchfit.frameworks import areal, nemo_rl, openrlhf, prime_rl, roll, skyrl, slime, verl
from batchfit.frameworks.flags import detect_framework, is_command_file, read_command
from batchfit.frameworks.hydra_overrides import read_overrides
from batchfit.frameworks.registry import (
    FrameworkSpec,
    command_frameworks,
    framework_names,
    framework_of,
    get_framework,
    register_framework,
)
from batchfit.frameworks.run import RunConfig, as_bool, as_int
from batchfit.frameworks.source import (
    check_mapping,
    detect_vocabulary,
    file_vocabularies,
    given_keys,
    hydra_composed,
    read_mapping,
    resolve,
)
from batchfit.plan.config import BatchConfig
from batchfit.validation import closest

__all__ = [
    "SPECS",
    "VOCABULARIES",
    "FrameworkSpec",
    "RunConfig",
    "coerce",
    "framework_names",
    "framework_of",
    "get_framework",
    "read_run_config",
    "strategy_refusal",
]

SPECS = (verl.SPEC, skyrl.SPEC, openrlhf.SPEC, slime.SPEC, areal.SPEC, nemo_rl.SPEC, roll.SPEC, prime_rl.SPEC)
"""The frameworks batchfit speaks, registered in this order (the order ``--emit`` lists them in)."""
for _spec in SPECS:
    register_framework(_spec)

VOCABULARIES = (*file_vocabularies(), *(spec.name for spec in command_frameworks()))
"""Every vocabulary a config can be written in: batchfit's flat names and each registered
framework's: verl's, SkyRL's (YAML/JSON), OpenRLHF's and slime's (launch commands)."""


def read_run_config(
    source: str | Path | Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> RunConfig:
    """Read a config in batchfit's, SkyRL's, verl's, OpenRLHF's or slime's vocabulary.

    Args:
        source: a YAML (``.yaml``/``.yml``) or JSON file, or the mapping itself; any other
            file holds an OpenRLHF or slime launch command (a shell script) or its arguments,
            or a verl launch script (``python3 -m verl.trainer.main_ppo key=value …``), whose
            Hydra overrides are read as the config they compose.
        overrides: :class:`~batchfit.plan.config.BatchConfig` field names (e.g. from ``--field
            value`` flags), applied last; strings are read as numbers or booleans.

    Returns:
        A :class:`RunConfig`; ``.plan()`` checks it under the framework's rules.

    Raises:
        BatchConfigError: the file cannot be read or parsed; a key that is not a string;
            keys of two frameworks, or of none; an interpolation that cannot be resolved;
            an unknown flat key or override (with the closest name); a misspelt batch key;
            a missing required flat field; for a launch command, what the trainer's parser
            refuses, a misspelt flag, or neither trainer's flags.
    """
    if not isinstance(source, Mapping):
        _check_size(source)
    if not isinstance(source, Mapping) and is_command_file(source):
        command = read_command(source)
        spec = get_framework(detect_framework(command))
        if spec.reads_command:
            run = spec.read_command(command)
            return _apply_flat(run, {}, overrides or {}, top_level_only=True)
        return _read_launch(command, spec.name, overrides)
    data = source if isinstance(source, Mapping) else read_mapping(source)
    return _read_mapping(data, overrides)


def _read_launch(command: Any, framework: str, overrides: Mapping[str, Any] | None) -> RunConfig:
    """A config framework's launch script (verl's ``python3 -m verl.trainer.main_ppo key=value …``): its Hydra
    overrides read as the config they compose (:mod:`batchfit.frameworks.hydra_overrides`)."""
    launch = read_overrides(command, framework)
    try:
        run = _read_mapping(launch.config, overrides, vocabulary=framework)
    except BatchConfigError as exc:
        raise BatchConfigError([*launch.faults, *exc.faults]) from None
    if launch.faults:
        raise BatchConfigError([*launch.faults, *run.faults])
    return run.replace(warnings=(*launch.warnings, *run.warnings), notes=(*launch.notes, *run.notes))


def _read_mapping(data: Mapping[str, Any], overrides: Mapping[str, Any] | None, vocabulary: str | None = None) -> RunConfig:
    """A YAML/JSON config's mapping (``vocabulary``: told from its keys when ``None``) as a :class:`RunConfig`."""
    check_mapping(data)
    vocabulary = vocabulary or detect_vocabulary(data)
    data = hydra_composed(data, vocabulary)
    resolved = resolve(data, vocabulary)
    given = given_keys(data, resolved)  # NOTE [ Interpolations resolve before the schema check ]
    if vocabulary != "flat":
        run = get_framework(vocabulary).read_config(resolved, given)
    else:
        run = RunConfig(
            vocabulary="flat", batch=BatchConfig(train_batch_size=None, policy_mini_batch_size=None)
        )
    return _apply_flat(run, resolved, overrides or {}, top_level_only=vocabulary != "flat")


def _check_size(path: str | Path) -> None:
    """Refuse at once a pipe, a device or a file larger than any config (NOTE [ Untrusted input files ] in
    :mod:`batchfit.fileio`)."""
    from batchfit.fileio import MAX_INPUT_BYTES, read_text

    try:
        info = Path(path).stat()
    except OSError:
        return  # missing or unreadable: the reader says so
    if stat.S_ISFIFO(info.st_mode) or stat.S_ISCHR(info.st_mode) or stat.S_ISSOCK(info.st_mode):
        raise BatchConfigError(  # reading /dev/zero never ends, a FIFO without a writer blocks
            [f"config file {str(path)!r} is not a regular file (a pipe or a device); pass a YAML or JSON file or a launch script"]
        )
    if info.st_size > MAX_INPUT_BYTES:
        try:
            read_text(path, f"config file {str(path)!r}")
        except InvalidArgument as exc:
            raise BatchConfigError([str(exc)]) from None


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


def strategy_refusal(run: RunConfig) -> str | None:
    """Why ``profile`` cannot model the training strategy of a launch-command run, with the flags that can.

    ``None`` when batchfit models it, or for SkyRL, verl and flat configs (the CLI judges those).
    """
    if run.vocabulary not in framework_names():  # batchfit's flat vocabulary
        return None
    refusal = get_framework(run.vocabulary).strategy_refusal
    return None if refusal is None else refusal(run)
