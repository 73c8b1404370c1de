"""A framework config as a plain mapping: read the file, check its keys, say whose vocabulary it is.

Interpolations (``${a.b}``, ``${oc.select:a.b,default}``, ``${.sibling}``) are resolved by
OmegaConf, as Hydra resolves them for SkyRL and verl, after the user's file is merged over
the framework's defaults (``defaults/<framework>.yaml``): a key the file leaves out has the
value the framework would give it.

The defaults and the key vocabularies (``defaults/<framework>_schema.json``) are generated
from the frameworks' released packages by ``scripts/gen_framework_schemas.py`` (SkyRL's config
dataclasses, verl's generated trainer config and the dataclasses its ``_target_`` sections
build), never written by hand: :func:`framework_schema` loads them and
:meth:`FrameworkSchema.check_keys` judges a user's keys against them.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from batchfit.errors import BatchConfigError, InvalidArgument
from batchfit.frameworks.registry import config_frameworks, framework_of
from batchfit.validation import short_repr


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (``.yaml``/``.yml``), JSON (``.json``) or TOML (``.toml``, prime-rl's) file, keys checked.

    Raises:
        BatchConfigError: the file is missing, unreadable, not UTF-8, does not parse, is not
            a mapping, or has a key that is not a string.
    """
    from batchfit.fileio import parse_json, parse_yaml, read_text

    path = Path(path)
    what = f"config file {str(path)!r}"
    try:
        text = read_text(path, what)
        # NOTE [ Untrusted input files ]: size, aliases, depth and integers bounded
        suffix = path.suffix.lower()
        if suffix == ".toml":  # prime-rl's configs: the standard library's tomllib (Python 3.11)
            data = _parse_toml(text, what)
        else:
            data = parse_json(text, what) if suffix == ".json" else parse_yaml(text, what)
    except InvalidArgument as exc:
        message = str(exc)
        if message.endswith("is not UTF-8 text"):
            message += "; pass a YAML or JSON file"
        raise BatchConfigError([message]) from None
    data = {} if data is None else data
    check_mapping(data)
    return data


def _parse_toml(text: str, what: str) -> dict[str, Any]:
    """``text`` as TOML (prime-rl's ``rl.toml``).

    Raises:
        InvalidArgument: it does not parse (tomllib's message).
    """
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{what} is not TOML: {exc}; pass a prime-rl rl.toml") from None


def check_mapping(data: Any) -> None:
    """Raise unless ``data`` is a mapping whose keys (at every depth) are strings.

    Raises:
        BatchConfigError: one fault per key that is not a string (YAML reads ``1:`` as an
            int and ``null:`` as None), or ``data`` is not a mapping.
    """
    if not isinstance(data, Mapping):
        raise BatchConfigError(
            [f"a config must be a mapping of keys to values, but got {type(data).__name__}"]
        )
    faults = _key_faults(data)
    if faults:
        raise BatchConfigError(faults)


def _key_faults(data: Mapping[Any, Any], where: str = "") -> list[str]:
    faults = []
    for key, value in data.items():
        if not isinstance(key, str):
            place = f" under {where!r}" if where else ""
            faults.append(
                f"config key {key!r} ({type(key).__name__}){place} is not a name; keys are field names "
                "such as 'train_batch_size'"
            )
        elif isinstance(value, Mapping):
            faults.extend(_key_faults(value, f"{where}.{key}" if where else key))
    return faults


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists and scalars are leaves)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def file_vocabularies() -> tuple[str, ...]:
    """The key vocabularies a YAML/JSON config can be written in: batchfit's flat field names
    (``"flat"``) and each registered config framework's (``"verl"``, ``"skyrl"``)."""
    return ("flat", *(spec.name for spec in config_frameworks()))


def detect_vocabulary(data: Mapping[str, Any]) -> str:
    """Whose vocabulary ``data`` is written in: ``"flat"``, or a registered config framework's
    (``"verl"``, ``"skyrl"``), told by the keys only its config has (``FrameworkSpec.markers``).

    Flat field names may sit beside a framework's sections (they override them).

    Raises:
        BatchConfigError: keys of two frameworks (each named), or nothing that any vocabulary has.
    """
    from batchfit.plan.config import BatchConfig

    flat_keys = flatten(data)
    frameworks = config_frameworks()
    found = {
        spec.name: [
            m for m in spec.markers if m in data or m in flat_keys or any(k.startswith(m + ".") for k in flat_keys)
        ]
        for spec in frameworks
    }
    found = {name: hits for name, hits in found.items() if hits}
    if len(found) > 1:
        mixed = " and ".join(f"{_prose(name)} keys ({', '.join(hits[:3])})" for name, hits in sorted(found.items()))
        raise BatchConfigError([f"the config mixes vocabularies: {mixed}; write it in one framework's vocabulary"])
    if found:
        return next(iter(found))
    if any(key in BatchConfig.fields() for key in data) or not data:
        return "flat"
    raise BatchConfigError(
        [
            f"cannot tell the config's vocabulary from its keys ({', '.join(list(data)[:5])}): expected "
            "batchfit's field names (train_batch_size, policy_mini_batch_size, ...)"
            + "".join(
                f"{' or' if i == len(frameworks) - 1 else ','} {spec.prose}'s ({', '.join(examples(spec))}, ...)"
                for i, spec in enumerate(frameworks)
            )
        ]
    )


def resolve(data: Mapping[str, Any], vocabulary: str) -> dict[str, Any]:
    """``data`` merged over the framework's defaults, every interpolation resolved.

    The flat vocabulary has no defaults file; its ``${a.b}`` references are resolved too.

    Raises:
        BatchConfigError: an interpolation that refers to a missing key, is circular, or
            uses a resolver OmegaConf does not have (names the key and the expression); a
            list where the framework's config has a section, or a section where it has a list
            (every such key, before OmegaConf's merge refuses the first with a bare TypeError).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if vocabulary != "flat":  # a framework's config, merged over its defaults
        clashes = _container_clashes(data, _defaults_tree(vocabulary), framework_schema(vocabulary).title)
        if clashes:
            raise BatchConfigError(clashes)
    step = "merge"
    try:
        config = OmegaConf.create(_plain(data))
        if vocabulary != "flat":
            pruned = not _mentions_unread(data, vocabulary)
            config = OmegaConf.merge(_defaults_config(vocabulary, pruned), config)
        step = "resolve"
        resolved = OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        message = " ".join(str(exc).split("\n")[0].split())
        where = f" at {key!r}" if key else ""
        if step == "merge" and vocabulary != "flat":
            name = framework_schema(vocabulary).title
            raise BatchConfigError(
                [
                    f"the config cannot be merged over {name}'s defaults{where}: {message}; give that key "
                    "the kind of value the framework's config has there (a section or a value)"
                ]
            ) from exc
        raise BatchConfigError([f"cannot resolve the interpolation{where}: {message}"]) from exc
    return _missing_as_none(resolved)


def hydra_composed(data: Mapping[str, Any], vocabulary: str) -> Mapping[str, Any]:
    """``data`` without its Hydra defaults list, which composes the framework's own defaults.

    A config Hydra composes (verl's ``ppo_trainer.yaml``, or a user's file built on it) starts
    with a top-level ``defaults:`` list of config groups. Hydra takes that list off and merges
    the groups under the file; batchfit's defaults for the framework are that composition
    (``defaults/<framework>.yaml``), so a file whose list is the framework's own is its keys
    merged over them, as Hydra would.

    Raises:
        BatchConfigError: the list composes other groups than the framework's defaults do
            (another ``model_engine``, another actor), naming the entries that differ.
    """
    listed = data.get("defaults") if vocabulary != "flat" else None
    if not isinstance(listed, list):
        return data
    schema = framework_schema(vocabulary)
    own = list(schema.hydra_defaults)
    if listed != own:
        other = [entry for entry in listed if entry not in own] or [entry for entry in own if entry not in listed]
        shown = ", ".join(short_repr(entry) for entry in other[:3])
        if not own:
            fault = f"defaults={short_repr(listed)}: {schema.title} composes its config without a Hydra defaults list; remove the 'defaults' key"
        else:
            fault = f"defaults={short_repr(listed)}: the Hydra defaults list composes other config groups ({shown}) than {schema.title}'s ppo_trainer.yaml, whose composition batchfit merges the file over; pass the config Hydra composes instead (python -m verl.trainer.main_ppo --config-name NAME --cfg job)"
        raise BatchConfigError([fault])
    return {key: value for key, value in data.items() if key != "defaults"}


def given_keys(data: Mapping[str, Any], resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The keys the user's file sets (flattened), each with its value after :func:`resolve`.

    See NOTE [ Interpolations resolve before the schema check ]. A key whose interpolation
    resolves to a section (verl's ``rollout.mtp: ${oc.select:actor_rollout_ref.model.mtp, null}``)
    stands for the keys below it, as the framework's loader sees them.

    Args:
        data: the user's file, as read.
        resolved: ``resolve(data, vocabulary)``.
    """
    flat = flatten(resolved)
    out: dict[str, Any] = {}
    for key, value in flatten(data).items():
        if key in flat:
            out[key] = flat[key]
            continue
        node: Any = resolved
        for part in key.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and node:
            out.update(flatten(node, key + "."))
        else:
            out[key] = value
    return out


# NOTE [ Interpolations resolve before the schema check ]
# Hydra and OmegaConf resolve a framework's config before its dataclasses see it, so a key the
# schema has as a section may hold an interpolation that resolves to a section (verl 0.9.1's
# generated config: ``actor_rollout_ref.rollout.mtp: ${oc.select:actor_rollout_ref.model.mtp, null}``).
# The keys judged against the schema (FrameworkSchema.check_keys) and compared with the defaults
# are therefore the user's keys after resolution (given_keys), never the expressions as written.


# NOTE [ Sections no rule reads ]
# verl's defaults hold ~120 interpolations, most in its profiler sections; resolving them all
# costs more than everything else a read does. These sections (top-level names, and any
# section named "profiler") feed no key batchfit reads, and no interpolation outside them
# refers to them (tests/test_framework_rules_keys.py checks both), so they are left out of the
# merge unless the user's file names one of them.
_UNREAD = {
    "verl": ("global_profiler", "distillation", "transfer_queue", "skip", "ray_kwargs", "reward", "profiler")
}


def _mentions_unread(data: Mapping[str, Any], vocabulary: str) -> bool:
    """The user's file sets a key in, or interpolates from, a section of :data:`_UNREAD`."""
    names = _UNREAD.get(vocabulary, ())
    if not names:
        return True
    for key, value in flatten(data).items():
        parts = key.split(".")
        if parts[0] in names or "profiler" in parts[:-1]:
            return True
        if isinstance(value, str) and "${" in value and any(name in value for name in names):
            return True
    return False


def _without_unread(tree: dict[str, Any], names: tuple[str, ...], top: bool = True) -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if (top and key in names) or key == "profiler":
            continue
        out[key] = _without_unread(value, names, top=False) if isinstance(value, dict) else value
    return out


def _container_clashes(data: Mapping[str, Any], defaults: Mapping[str, Any], title: str, where: str = "") -> list[str]:
    """One fault per key of ``data`` that is a list where ``defaults`` has a section, or a section where it has a list.

    OmegaConf merges anything else (a value over a section is judged later by
    :meth:`FrameworkSchema.check_keys`), but refuses these two with ``TypeError: Cannot merge
    incompatible container types``, naming no key.
    """
    faults = []
    for key, value in data.items():
        name = f"{where}.{key}" if where else str(key)
        default = defaults.get(key)
        if isinstance(default, Mapping) and isinstance(value, list):
            below = f" (such as {name}.{next(iter(default))})" if default else ""
            faults.append(
                f"{name}={short_repr(value)}: {name!r} is a section of {title}'s config, not a list; set the keys below it instead{below}"
            )
        elif isinstance(default, list) and isinstance(value, Mapping):
            faults.append(
                f"{name}={short_repr(value)}: {name!r} is a list in {title}'s config, not a section; write it as a list ([...])"
            )
        elif isinstance(default, Mapping) and isinstance(value, Mapping):
            faults.extend(_container_clashes(value, default, title, name))
    return faults


@functools.cache
def _defaults_tree(vocabulary: str) -> dict[str, Any]:
    """The framework's defaults file as plain data, read once (never modified)."""
    import yaml

    text = resources.files("batchfit.frameworks").joinpath("defaults", f"{vocabulary}.yaml").read_text()
    return yaml.safe_load(text)


@functools.cache
def _defaults_config(vocabulary: str, pruned: bool = False) -> Any:
    """The framework's defaults as an OmegaConf config, read once (merging does not change it);
    ``pruned``: without the sections of NOTE [ Sections no rule reads ]."""
    from omegaconf import OmegaConf

    tree = _defaults_tree(vocabulary)
    if pruned and vocabulary in _UNREAD:
        tree = _without_unread(tree, _UNREAD[vocabulary])
    return OmegaConf.create(tree)


@functools.cache
def framework_defaults(vocabulary: str) -> dict[str, Any]:
    """The framework's defaults, resolved and flattened (``{"trainer.train_batch_size": 1024, ...}``)."""
    return flatten(resolve({}, vocabulary))


def in_composed(framework: str, key: str) -> bool:
    """``key`` (dotted) is a value or a section of the config the framework's Hydra composes.

    That config is ``defaults/<framework>.yaml`` less the dataclass fields the generator added to it
    (:attr:`FrameworkSchema.not_composed`): Hydra refuses to override a key it lacks without a ``+``
    (``Could not override …``), and to add one it has with a ``+`` (``Could not append …``).
    """
    if key in _not_composed(framework):
        return False
    node: Any = _defaults_tree(framework)
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


@functools.cache
def _not_composed(framework: str) -> frozenset[str]:
    return framework_schema(framework).not_composed


@dataclass(frozen=True)
class FrameworkSchema:
    """A framework's key vocabulary, generated from its released package (``defaults/<name>_schema.json``).

    Attributes:
        framework: ``"skyrl"`` or ``"verl"``.
        version: the framework version the schema was generated from.
        keys: every key of its config, dotted, sections included.
        open: sections below which any key is accepted (dict-typed fields such as
            ``model_config_kwargs``).
        strict: sections in which the framework refuses a key it does not know → the class
            that refuses it (SkyRL: every dataclass section; verl: the ``_target_`` sections).
        hydra_defaults: the Hydra defaults list the framework's defaults are composed from
            (verl: ``ppo_trainer.yaml``'s); empty when it has none (SkyRL 0.4.0).
        not_composed: keys of the defaults file that the generator added from the dataclasses
            and Hydra's composed config lacks (verl: ``critic.ppo_infer_max_token_len_per_gpu``),
            so an override of one needs a ``+``; empty for SkyRL.
    """

    framework: str
    version: str
    keys: frozenset[str]
    open: tuple[str, ...]
    strict: Mapping[str, str]
    hydra_defaults: tuple[Any, ...] = ()
    not_composed: frozenset[str] = frozenset()

    @property
    def title(self) -> str:
        """``"SkyRL 0.4.0"``, ``"verl 0.9.1"``."""
        return f"{_prose(self.framework)} {self.version}"

    def knows(self, key: str) -> bool:
        """``key`` is in the schema, or below one of its open sections."""
        return key in self.keys or any(key.startswith(p + ".") for p in self.open)

    def _is_open(self, key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in self.open)

    def children(self, section: str) -> list[str]:
        """The names of the keys directly below ``section`` (``""`` = the top level)."""
        prefix = section + "." if section else ""
        return sorted(
            {k[len(prefix) :].split(".")[0] for k in self.keys if k.startswith(prefix) and k != section}
        )

    def check_keys(
        self, given: Mapping[str, Any], ignore: Collection[str] = ()
    ) -> tuple[list[str], list[str]]:
        """Judge the keys of a user's file (flattened) against the schema.

        A key in the schema (or below an open section) is accepted. A key that is not is a
        fault when it is a close misspelling of a key the framework has there (the fault
        names the key, its value and the key meant); otherwise a warning when the framework
        refuses unknown keys in that section (SkyRL everywhere, verl in the sections it
        builds a dataclass from), and nothing when it accepts them (verl's other sections).

        Args:
            given: the user's keys, dotted (:func:`flatten`), with their values.
            ignore: top-level names that are not the framework's (batchfit's flat fields).

        Returns:
            ``(faults, warnings)``, one message per key.
        """
        faults: list[str] = []
        warnings: list[str] = []
        for key, value in given.items():
            if key.split(".")[0] in ignore:
                continue
            if self.knows(key):
                children = self.children(key) if key in self.keys else []
                if children and value is not None and not self._is_open(key):
                    faults.append(
                        f"{key}={short_repr(value)}: {key!r} is a section of {self.title}'s config, not a value; set the keys "
                        f"below it instead (such as {key}.{'path' if 'path' in children else children[0]})"
                    )
                continue
            parts = key.split(".")
            depth = next(i for i in range(len(parts)) if not self.knows(".".join(parts[: i + 1])))
            parent, name, rest = ".".join(parts[:depth]), parts[depth], parts[depth + 1 :]
            strict = self.strict.get(parent)
            siblings = self.children(parent)
            if parent and not siblings:
                faults.append(
                    f"{key}={short_repr(value)}: {parent!r} is a value in {self.title}'s config, not a section; set {parent} "
                    "to a value"
                )
                continue
            near = difflib.get_close_matches(name, siblings, n=1, cutoff=0.8 if strict else 0.9)
            if near:
                meant = ".".join([p for p in (parent, near[0]) if p] + rest)
                faults.append(
                    f"unknown key {key!r} (set to {short_repr(value)}): {self.title}'s config has no such key; "
                    f"did you mean {meant!r}? Rename it"
                )
            elif strict is not None:
                where = f"{parent!r} ({strict})" if parent else f"the top level ({strict})"
                warnings.append(
                    f"{key!r} (set to {short_repr(value)}) is not a key of {self.title}'s config: {where} has no "
                    f"{name!r}, and {_prose(self.framework)} refuses unknown keys there at "
                    "start-up unless your own config class adds it; batchfit ignores it"
                )
        return faults, warnings


@functools.cache
def examples(spec: Any) -> list[str]:
    """Two of a config framework's marker keys, dotted ones first, for messages."""
    return sorted(spec.markers, key=lambda m: "." not in m)[:2]


def _prose(framework: str) -> str:
    """How ``framework`` is written in prose (``"SkyRL"``), its name when not registered."""
    spec = framework_of(framework)
    return framework if spec is None else spec.prose


def framework_schema(framework: str) -> FrameworkSchema:
    """The :class:`FrameworkSchema` of ``"skyrl"`` or ``"verl"``, read once from the package data."""
    text = resources.files("batchfit.frameworks").joinpath("defaults", f"{framework}_schema.json").read_text()
    data = json.loads(text)
    return FrameworkSchema(
        framework=data["framework"],
        version=data["version"],
        keys=frozenset(data["keys"]),
        open=tuple(data["open"]),
        strict=dict(data["strict"]),
        hydra_defaults=tuple(data.get("hydra_defaults", ())),
        not_composed=frozenset(data.get("not_composed", ())),
    )


def _plain(value: Any) -> Any:
    """Numpy and torch scalars as Python values (OmegaConf holds only primitives)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _missing_as_none(value: Any) -> Any:
    """OmegaConf's ``???`` (a value that must be set) becomes ``None``: not given."""
    if isinstance(value, dict):
        return {k: _missing_as_none(v) for k, v in value.items()}
    return None if value == "???" else value
