"""A launch script's Hydra overrides as the config they compose: verl's recipes are shell scripts.

Every verl recipe launches its trainer from a shell script, ``python3 -m verl.trainer.main_ppo
key=value …`` (:attr:`FrameworkSpec.launchers <batchfit.frameworks.registry.FrameworkSpec.launchers>`);
:func:`batchfit.frameworks.flags.read_command` expands its shell words, and :func:`read_overrides`
reads the arguments as Hydra does (hydra-core 1.3's override grammar, the subset launch scripts
write): ``key=value`` overrides a key of the composed config, ``+key=value`` adds one it lacks,
``++key=value`` adds or overrides, ``~key`` deletes; values are Hydra's (``null``, ``True``, ``1e-6``,
``[a,b]``, ``{a: 1}``, quoted strings, ``${…}`` interpolations left to OmegaConf). The result is
the mapping a YAML file with those keys would be: :func:`batchfit.frameworks.read_run_config`
merges it over the framework's defaults as it does a file.

What verl's Hydra refuses is refused here too, in its words: with ``ppo_trainer`` (``main_ppo``'s
config), ``key=value`` for a key the composed config lacks ("Could not override"), ``+key=value``
for one it has ("Could not append"), a config group other than the defaults' (``model_engine=megatron``).
Another ``--config-name`` (a recipe's own config) is read over ``ppo_trainer``'s defaults, with a
warning; one of the wheel's other trainers (Megatron, TorchTitan, VeOmni) is refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchfit.frameworks.flags import Command
from batchfit.frameworks.source import framework_defaults, framework_schema, in_composed

__all__ = ["Overrides", "read_overrides"]

# the config each launcher composes (hydra.main(config_name=...)); a launcher not listed composes its own
_LAUNCHER_CONFIG = {"verl.trainer.main_ppo": "ppo_trainer", "recipe.dapo.main_dapo": "dapo_trainer"}
_OWN_CONFIG = "ppo_trainer"  # the composition defaults/verl.yaml holds
# the wheel's other trainers (verl/trainer/config/*.yaml): another engine's defaults, which batchfit does not hold
_OTHER_TRAINERS = ("ppo_megatron_trainer", "ppo_torchtitan_trainer", "ppo_veomni_trainer")
_OVERRIDE = re.compile(r"^(~|\+\+|\+)?([A-Za-z_][\w.@/\-]*)(?:=(.*))?$", re.S)
_CONTROL = ("|", "||", "&&", ";", "&", "|&")
_REDIRECT = re.compile(r"^\d*(?:>>?|<|>&|&>)(.*)$")  # group 1: the target when written in the same word
_FLAG_VALUE = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p")


@dataclass(frozen=True)
class Overrides:
    """A launch command's overrides, read.

    Attributes:
        config: the keys the overrides set, nested (``{"data": {"train_batch_size": 16}}``), as
            a YAML file would hold them.
        faults: what verl's Hydra would refuse, and overrides whose values the file does not set
            for keys batchfit reads.
        warnings: what the reading could not reproduce (another config than ``ppo_trainer``).
        notes: what was assumed: the config composed, arguments not read.
    """

    config: dict[str, Any]
    faults: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def read_overrides(command: Command, framework: str) -> Overrides:
    """``command``'s arguments (a config framework's launch) as the config its Hydra overrides compose.

    Args:
        command: from :func:`batchfit.frameworks.flags.read_command`; ``command.launcher`` names
            the module run (``verl.trainer.main_ppo``).
        framework: the config framework launched (``"verl"``): its defaults and schema judge the keys.

    Returns:
        The :class:`Overrides`; nothing is raised, the caller raises the faults with its own.
    """
    title = framework_schema(framework).title
    launcher = (command.launcher or "").rsplit("/", 1)[-1].removesuffix(".py")
    config_name = _config_name(command.args, _LAUNCHER_CONFIG.get(launcher))
    config: dict[str, Any] = {}
    faults: list[str] = []
    dropped: list[str] = []
    ignored: list[str] = []
    deleted: list[str] = []
    args = list(command.args)
    i = 0
    while i < len(args):
        word, index = args[i], i
        i += 1
        if word in ("$@", "$*"):
            ignored.append(f"{word} (the script's own arguments)")
            continue
        if word in _CONTROL:  # the launch ends: a pipe (| tee log), a list (&&, ;) or a background job
            ignored.append(" ".join(args[index:]))
            break
        redirect = _REDIRECT.match(word)
        if redirect is not None:  # > log, 2>&1: the shell's, not the trainer's
            i += 1 if not redirect.group(1) and i < len(args) else 0
            ignored.append(word if redirect.group(1) else " ".join(args[index:i]))
            continue
        if word.startswith("-"):
            flag, _, value = word.partition("=")
            if flag in _FLAG_VALUE and not value and i < len(args):
                value, i = args[i], i + 1
            if flag not in ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd"):
                ignored.append(word if not value or "=" in word else f"{word} {value}")
            continue
        match = _OVERRIDE.match(word)
        if match is None:
            faults.append(
                f"{word!r}: not a Hydra override (key=value, +key=value, ++key=value or ~key), which {title}'s "
                "launcher refuses; fix the argument in the script"
            )
            continue
        prefix, key, raw = match.group(1) or "", match.group(2), match.group(3)
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            ignored.append(word)  # Hydra's own settings (run directory, launcher): no key of the run
            continue
        if index in command.unresolved:
            if key.endswith("model.path"):  # the model: --model names it (profile_request), plan needs none
                _set(config, key, None)
                dropped.append(f"{command.unresolved[index]} (pass --model to profile it)")
            elif _read_by_batchfit(framework, key):
                faults.append(
                    f"{command.unresolved[index]}: the file does not set that shell variable (the environment, "
                    "command substitution and sourced files are not read); write the value in the file"
                )
            else:
                dropped.append(command.unresolved[index])
            continue
        group = _group_override(framework, key, raw)
        if group is not None:  # a config group's option: the defaults' one composes the same config
            faults += [group] if group else []
            continue
        if config_name == _OWN_CONFIG:
            refused = _refused(framework, prefix, key, word)
            if refused is not None:
                faults.append(refused)
                continue
        if prefix == "~":
            deleted.append(key)
            _delete(config, key)
            continue
        if raw is None:
            faults.append(f"{word!r}: an override needs a value ({key}=VALUE); {title}'s launcher refuses it")
            continue
        _set(config, key, parse_value(raw))
    notes: list[str] = []
    warnings: list[str] = []
    launch = str(command.launcher)
    if config_name == _OWN_CONFIG:
        notes.append(f"{launch} composes {title}'s ppo_trainer config with the script's Hydra overrides: read so")
    elif config_name in _OTHER_TRAINERS:
        faults.append(
            f"--config-name {config_name}: that trainer composes another engine's config than ppo_trainer's FSDP "
            f"engines, whose defaults batchfit holds; pass the config Hydra composes instead ({command.launcher} "
            f"--config-name {config_name} <the overrides> --cfg job > run.yaml, then --config run.yaml)"
        )
    else:
        warnings.append(
            f"{launch} composes its own config ({config_name or 'not named in the script'}), which batchfit does not "
            f"read: the script's overrides are read over {title}'s ppo_trainer defaults, so a key that config sets and "
            f"the script does not has verl's default here; for the exact config pass what Hydra composes ({launch} "
            "<the overrides> --cfg job > run.yaml, then --config run.yaml)"
        )
    if dropped:
        notes.append(f"not read (shell variables the file does not set): {', '.join(dropped)}")
    if ignored:
        notes.append(f"arguments that set no key of the run, not read: {', '.join(ignored)}")
    if deleted:
        notes.append(f"deleted with ~ (read as verl's defaults): {', '.join(deleted)}")
    return Overrides(config, tuple(faults), tuple(warnings), (*command.notes, *notes))


def _config_name(args: tuple[str, ...], default: str | None) -> str | None:
    """The config the launch composes: its last ``--config-name`` / ``-cn`` (Hydra reads the flags before the
    overrides, wherever they stand), else the launcher's ``default``."""
    name = default
    for i, word in enumerate(args):
        flag, eq, value = word.partition("=")
        if flag in ("--config-name", "-cn"):
            name = (value if eq else args[i + 1] if i + 1 < len(args) else "").removesuffix(".yaml")
    return name


def parse_value(text: str) -> Any:
    """A Hydra override's value: ``null``, a bool, an int or float, a list ``[…]``, a dict ``{…}`` or a string.

    Quotes (``'token-mean'``) make a string; ``${…}`` stays a string for OmegaConf to resolve.

    >>> parse_value("1e-6"), parse_value("True"), parse_value("[console,'wandb']"), parse_value("{a: 1, b: null}")
    (1e-06, True, ['console', 'wandb'], {'a': 1, 'b': None})
    >>> parse_value("22528"), parse_value("'1024'"), parse_value("fsdp2"), parse_value("")
    (22528, '1024', 'fsdp2', '')
    """
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [parse_value(item) for item in _split(text[1:-1])]
    if text.startswith("{") and text.endswith("}") and not text.startswith("${"):
        out = {}
        for item in _split(text[1:-1]):
            key, _, value = item.partition(":")
            out[key.strip()] = parse_value(value)
        return out
    lowered = text.lower()
    if lowered == "null":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    if re.fullmatch(r"[+-]?(0|[1-9][\d_]*)", text):
        return int(text.replace("_", ""))
    if re.fullmatch(r"[+-]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][+-]?\d+)?|[+-]?(inf|nan)", lowered) and re.search(
        r"[.eE]|inf|nan", lowered
    ):
        return float(text.replace("_", ""))
    return text


def _split(text: str) -> list[str]:
    """``text`` split at its top-level commas (outside brackets, braces and quotes); empty → ``[]``."""
    items, depth, quote, current = [], 0, "", []
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append("".join(current))
            current = []
            continue
        current.append(char)
    if current or items:
        items.append("".join(current))
    return [item for item in items if item.strip()]


def _set(config: dict[str, Any], key: str, value: Any) -> None:
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def _delete(config: dict[str, Any], key: str) -> None:
    node: Any = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(leaf, None)


def _refused(framework: str, prefix: str, key: str, word: str) -> str | None:
    """What Hydra says of ``word`` over the composed config, or ``None`` when it composes."""
    exists = in_composed(framework, key)
    title = framework_schema(framework).title
    if prefix == "" and not exists:
        return (
            f"{word}: {title}'s Hydra refuses it (Could not override {key!r}: its composed ppo_trainer config has no "
            f"such key); write +{word} to add it, or fix the key"
        )
    if prefix == "+" and exists:
        return (
            f"{word}: {title}'s Hydra refuses it (Could not append to config: {key!r} is already in its composed "
            f"ppo_trainer config); write {word[1:]} to override it, or +{word} to add or override"
        )
    if prefix == "~" and not exists:
        return f"{word}: {title}'s Hydra refuses it (Could not delete {key!r}: no such key); remove the argument"
    return None


def _group_override(framework: str, key: str, raw: str | None) -> str | None:
    """The fault of an override that picks another option of a config group (``model_engine=megatron``), ``""``
    for the option the defaults list picks, ``None`` for an override of a value.

    Hydra reads a key without dots that names a group of the defaults list (``critic``, ``model_engine``),
    or a ``group@package`` key, as the group's option; the option the defaults list picks composes the
    same config, any other one another.
    """
    if "." in key and "@" not in key:
        return None  # a value's key
    options: dict[str, Any] = {}
    for entry in framework_schema(framework).hydra_defaults:
        if isinstance(entry, Mapping):
            for name, option in entry.items():
                options[name] = option
                options.setdefault(name.split("@", 1)[0], option)
    group = key.split("@", 1)[0]
    if key not in options and group not in options and "@" not in key and "/" not in key:
        return None
    default = options.get(key, options.get(group))
    if isinstance(default, str) and raw == default.replace("${model_engine}", str(options.get("model_engine", ""))):
        return ""
    title = framework_schema(framework).title
    return (
        f"{key}={raw}: picks another option of the config group {group!r} than {title}'s ppo_trainer defaults list "
        f"({group}: {default}), which batchfit composes the defaults from; pass the config Hydra composes instead "
        "(python3 -m verl.trainer.main_ppo <the overrides> --cfg job > run.yaml, then --config run.yaml)"
    )


def _read_by_batchfit(framework: str, key: str) -> bool:
    """``key`` is one a run's plan or profile reads: a number or a switch of the framework's defaults, a
    model's path, dtype or strategy (a path, a name or a file elsewhere is not read)."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf in ("path", "strategy") or leaf.endswith("_dtype") or leaf.startswith(("lora_", "target_modules")):
        return True
    value = framework_defaults(framework).get(key)
    return isinstance(value, (bool, int, float))
