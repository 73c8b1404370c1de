"""Generate batchfit's framework schemas from the frameworks' released packages.

Usage::

    python scripts/gen_framework_schemas.py \
        --skyrl /tmp/wheels/skyrl-0.4.0-py3-none-any.whl \
        --verl /tmp/wheels/verl-0.9.1-py3-none-any.whl \
        [--out src/batchfit/frameworks/defaults]

Each source is a wheel (``.whl``, read as a zip) or the directory it was unzipped into; the
version comes from its ``*.dist-info/METADATA``. Nothing is installed or imported: the
frameworks' dataclasses are read with :mod:`ast`, verl's generated configs with PyYAML.

It writes, into ``--out``:

- ``skyrl.yaml``: every key of SkyRL's config with its default, from the dataclasses of
  ``skyrl/train/config/config.py`` (``SkyRLTrainConfig`` and everything it nests), as
  ``SkyRLTrainConfig()`` would fill them before its ``__post_init__`` (which batchfit's
  reader applies where it matters: the reference model, ``max_input_length``).
- ``verl.yaml``: verl's ``verl/trainer/config/_generated_ppo_trainer.yaml`` (the config
  Hydra composes for ``main_ppo``, with its interpolations), plus the fields of the
  dataclasses its ``_target_`` sections build that the YAML leaves out, with their defaults.
- ``skyrl_schema.json`` / ``verl_schema.json``: the framework and version, the files read,
  every key (dotted, sections included), the ``open`` sections (dict-typed fields: any key
  below them is accepted) and the ``strict`` sections (the framework refuses a key it does
  not know directly below them: SkyRL everywhere, verl inside a ``_target_`` section),
  each with the class that refuses it. For verl the keys are the union of all its
  ``_generated_*.yaml`` files (FSDP, Megatron, TorchTitan, VeOmni trainers).

Run it again after bumping a framework version, review the diff, and commit the outputs.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import re
import sys
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MISSING = "???"  # OmegaConf's "must be set"


class Unresolved:
    """A default the script cannot evaluate statically (written as null, listed in the schema)."""

    def __init__(self, text: str):
        self.text = text


# ------------------------------------------------------------------ reading a package


class Package:
    """The text files of a wheel or an unzipped directory, by relative path."""

    def __init__(self, source: Path):
        self.source = source
        self.files: dict[str, str] = {}
        if source.is_file():
            with zipfile.ZipFile(source) as zf:
                for name in zf.namelist():
                    if name.endswith((".py", ".yaml", "METADATA")):
                        self.files[name] = zf.read(name).decode("utf-8", "replace")
        elif source.is_dir():
            for path in source.rglob("*"):
                if path.is_file() and path.name.endswith((".py", ".yaml", "METADATA")):
                    self.files[path.relative_to(source).as_posix()] = path.read_text("utf-8", "replace")
        else:
            raise SystemExit(f"gen_framework_schemas: {source} is neither a wheel nor a directory")

    def version(self, name: str) -> str:
        for path, text in self.files.items():
            if path.endswith(".dist-info/METADATA") and Path(path).parts[0].lower().startswith(name):
                match = re.search(r"^Version:\s*(\S+)", text, re.M)
                if match:
                    return match.group(1)
        raise SystemExit(f"gen_framework_schemas: no {name}*.dist-info/METADATA in {self.source}")


# ------------------------------------------------------------------ dataclasses by ast


@dataclass
class FieldDef:
    name: str
    annotation: ast.expr
    value: ast.expr | None


@dataclass
class ClassDef:
    name: str
    module: str
    path: str
    bases: list[str]
    fields: list[FieldDef]
    is_dataclass: bool


@dataclass
class Module:
    name: str
    path: str
    classes: dict[str, ClassDef] = field(default_factory=dict)
    constants: dict[str, ast.expr] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)
    star_imports: list[str] = field(default_factory=list)


def _module_names(path: str) -> list[str]:
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    names = [".".join(parts)]
    if len(parts) > 1 and not parts[0].isidentifier():  # e.g. skyrl-gym/skyrl_gym/...
        names.append(".".join(parts[1:]))
    return names


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass"
    )


class Index:
    """Every class of a package, its dataclass fields and the names each module imports."""

    def __init__(self, package: Package):
        self.modules: dict[str, Module] = {}
        for path, text in package.files.items():
            if not path.endswith(".py"):
                continue
            try:
                with warnings.catch_warnings():  # their strings' invalid escapes are theirs to fix
                    warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
                    tree = ast.parse(text)
            except SyntaxError:
                continue
            names = _module_names(path)
            module = Module(names[0], path)
            package_name = names[0] if path.endswith("__init__.py") else names[0].rpartition(".")[0]
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    module.classes[node.name] = _class_def(node, names[0], path)
                elif (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                ):
                    module.constants[node.targets[0].id] = node.value
                elif (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name)
                    and node.value is not None
                ):
                    module.constants[node.target.id] = node.value
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package_name.split(".")
                        anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                        base = ".".join([*anchor, base] if base else anchor)
                    for alias in node.names:
                        if alias.name == "*":
                            module.star_imports.append(base)
                        else:
                            module.imports[alias.asname or alias.name] = (base, alias.name)
            for name in names:
                self.modules.setdefault(name, module)

    def resolve(self, name: str, module: Module, seen: frozenset[str] = frozenset()) -> ClassDef | None:
        """The class ``name`` refers to inside ``module`` (own classes, imports, star imports)."""
        if module.name in seen:
            return None
        seen = seen | {module.name}
        if name in module.classes:
            return module.classes[name]
        if name in module.imports:
            source, original = module.imports[name]
            target = self.modules.get(source) or self.modules.get(f"{source}.{original}")
            if target is not None:
                found = self.resolve(original, target, seen)
                if found is not None:
                    return found
        for source in module.star_imports:
            target = self.modules.get(source)
            if target is not None:
                found = self.resolve(name, target, seen)
                if found is not None:
                    return found
        return None

    def by_target(self, target: str) -> ClassDef | None:
        """The class a Hydra ``_target_`` (``pkg.module.Class``) names."""
        module_name, _, class_name = target.rpartition(".")
        module = self.modules.get(module_name)
        return self.resolve(class_name, module) if module is not None else None

    def fields(
        self, cls: ClassDef, seen: frozenset[str] = frozenset()
    ) -> dict[str, tuple[FieldDef, ClassDef]]:
        """The dataclass fields of ``cls`` and its bases (bases first, overridden by subclasses)."""
        if cls.path + cls.name in seen:
            return {}
        seen = seen | {cls.path + cls.name}
        out: dict[str, tuple[FieldDef, ClassDef]] = {}
        module = self.modules[_module_names(cls.path)[0]]
        for base in cls.bases:
            base_cls = self.resolve(base, module)
            if base_cls is not None:
                out.update(self.fields(base_cls, seen))
        if cls.is_dataclass:
            for f in cls.fields:
                out[f.name] = (f, cls)
        return out

    def module_of(self, cls: ClassDef) -> Module:
        return self.modules[_module_names(cls.path)[0]]


def _class_def(node: ast.ClassDef, module: str, path: str) -> ClassDef:
    fields = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            text = ast.unparse(stmt.annotation)
            if text.startswith(("ClassVar", "typing.ClassVar")):
                continue
            fields.append(FieldDef(stmt.target.id, stmt.annotation, stmt.value))
    bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
    return ClassDef(
        node.name, module, path, bases, fields, any(map(_is_dataclass_decorator, node.decorator_list))
    )


# ------------------------------------------------------------------ annotations and defaults


def _strip_optional(annotation: ast.expr) -> list[ast.expr]:
    """The alternatives of an annotation, without None (``Optional[X]``, ``X | None``, ``Union``)."""
    if isinstance(annotation, ast.Subscript):
        head = ast.unparse(annotation.value).rpartition(".")[2]
        if head == "Optional":
            return _strip_optional(annotation.slice)
        if head == "Union":
            items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
            return [a for item in items for a in _strip_optional(item)]
        if head == "Annotated":
            first = annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) else annotation.slice
            return _strip_optional(first)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _strip_optional(annotation.left) + _strip_optional(annotation.right)
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # "ForwardRef"
        try:
            return _strip_optional(ast.parse(annotation.value, mode="eval").body)
        except SyntaxError:
            return []
    return [annotation]


def _head(annotation: ast.expr) -> str:
    node = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return ast.unparse(node).rpartition(".")[2]


class Schema:
    """Keys, open and strict sections, defaults, built while walking a config."""

    def __init__(self, index: Index):
        self.index = index
        self.keys: set[str] = set()
        self.open: set[str] = set()
        self.strict: dict[str, str] = {}
        self.unresolved: dict[str, str] = {}

    # -- the kind of a field ---------------------------------------------------------------

    def field_kind(self, f: FieldDef, owner: ClassDef) -> tuple[str, ClassDef | None]:
        """``("dataclass", cls)``, ``("dict", None)`` or ``("leaf", None)``."""
        module = self.index.module_of(owner)
        kinds = []
        for alt in _strip_optional(f.annotation):
            head = _head(alt)
            if head in ("dict", "Dict", "Mapping", "MutableMapping", "DictConfig"):
                kinds.append(("dict", None))
                continue
            cls = self.index.resolve(head, module)
            if cls is not None and (cls.is_dataclass or self.index.fields(cls)):
                kinds.append(("dataclass", cls))
            else:
                kinds.append(("leaf", None))
        for wanted in ("dataclass", "dict"):
            for kind in kinds:
                if kind[0] == wanted:
                    return kind
        return ("leaf", None)

    # -- defaults of a dataclass (SkyRL) -----------------------------------------------------

    def literal(self, node: ast.expr, module: Module, path: str) -> Any:
        """A default value from its expression, or :class:`Unresolved`."""
        try:
            return ast.literal_eval(node)
        except (ValueError, SyntaxError, TypeError):
            pass
        if isinstance(node, ast.Name) and node.id in module.constants:
            return self.literal(module.constants[node.id], module, path)
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("os.path.expanduser", "expanduser") and node.args:
                return self.literal(node.args[0], module, path)  # keep "~/..." (not this machine's home)
            if func in ("copy.deepcopy", "deepcopy") and node.args:
                return self.literal(node.args[0], module, path)
            if func in ("dict", "list"):
                return {} if func == "dict" else []
            cls = self.index.resolve(func.rpartition(".")[2], module)
            if cls is not None and self.index.fields(cls):
                overrides = {
                    kw.arg: self.literal(kw.value, module, f"{path}.{kw.arg}")
                    for kw in node.keywords
                    if kw.arg
                }
                return self.defaults(cls, path, overrides)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.literal(e, module, path) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {
                self.literal(k, module, path): self.literal(v, module, path)
                for k, v in zip(node.keys, node.values, strict=True)
                if k is not None
            }
        return Unresolved(ast.unparse(node))

    def default_of(self, f: FieldDef, owner: ClassDef, path: str) -> Any:
        module = self.index.module_of(owner)
        value = f.value
        if value is None:
            return MISSING
        if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
            kwargs = {kw.arg: kw.value for kw in value.keywords}
            if "default" in kwargs:
                return self.literal(kwargs["default"], module, path)
            factory = kwargs.get("default_factory")
            if factory is None:
                return MISSING
            if isinstance(factory, ast.Lambda):
                return self.literal(factory.body, module, path)
            name = ast.unparse(factory)
            if name in ("dict", "list", "set"):
                return {} if name == "dict" else []
            cls = self.index.resolve(name.rpartition(".")[2], module)
            if cls is not None:
                return self.defaults(cls, path)
            return Unresolved(name)
        if isinstance(value, ast.Name) and value.id == "MISSING":
            return MISSING
        return self.literal(value, module, path)

    def defaults(self, cls: ClassDef, path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every field of ``cls`` with its default (nested dataclasses expanded)."""
        out: dict[str, Any] = {}
        for name, (f, owner) in self.index.fields(cls).items():
            if name.startswith("_"):
                continue
            key = f"{path}.{name}" if path else name
            value = overrides[name] if overrides and name in overrides else self.default_of(f, owner, key)
            if isinstance(value, Unresolved):
                self.unresolved[key] = value.text
                value = None
            out[name] = value
        return out

    # -- keys of a dataclass (both frameworks) -------------------------------------------------

    def add_class(
        self,
        cls: ClassDef,
        path: str,
        seen: frozenset[str] = frozenset(),
        *,
        strict: bool,
        nested_strict: bool,
    ) -> None:
        """The keys of ``cls`` below ``path`` (sections, leaves; dict fields are open).

        ``strict``: the framework refuses a key below ``path`` that ``cls`` does not have;
        ``nested_strict``: so do the dataclass sections nested in it.
        """
        if cls.name in seen:
            return
        seen = seen | {cls.name}
        if strict:
            self.strict.setdefault(path, cls.name)
        for name, (f, owner) in self.index.fields(cls).items():
            if name.startswith("_"):
                continue
            key = f"{path}.{name}" if path else name
            self.keys.add(key)
            kind, nested = self.field_kind(f, owner)
            if kind == "dict":
                self.open.add(key)
            elif kind == "dataclass" and nested is not None:
                self.add_class(nested, key, seen, strict=nested_strict, nested_strict=nested_strict)


def _walk_yaml(data: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{path}.{key}" if path else str(key)
            yield name, value
            yield from _walk_yaml(value, name)


# ------------------------------------------------------------------ the two frameworks


def skyrl_schema(package: Package) -> tuple[dict[str, Any], dict[str, Any]]:
    """SkyRL's defaults tree and schema, from ``SkyRLTrainConfig`` and everything it nests."""
    index = Index(package)
    config = index.modules.get("skyrl.train.config.config")
    if config is None or "SkyRLTrainConfig" not in config.classes:
        raise SystemExit(
            "gen_framework_schemas: skyrl/train/config/config.py with SkyRLTrainConfig not found"
        )
    root = config.classes["SkyRLTrainConfig"]
    schema = Schema(index)
    # validate_dict_keys_against_dataclass refuses an unknown key in every dataclass section
    schema.add_class(root, "", strict=True, nested_strict=True)
    defaults = schema.defaults(root, "")
    return defaults, {
        "framework": "skyrl",
        "version": package.version("skyrl"),
        "sources": ["skyrl/train/config/config.py (SkyRLTrainConfig and the dataclasses it nests)"],
        "keys": sorted(schema.keys),
        "open": sorted(schema.open),
        "strict": dict(sorted(schema.strict.items())),
        "unresolved_defaults": dict(sorted(schema.unresolved.items())),
    }


VERL_GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"
VERL_MAIN = "verl/trainer/config/ppo_trainer.yaml"  # the Hydra config VERL_GENERATED is composed from


def verl_schema(package: Package) -> tuple[dict[str, Any], dict[str, Any]]:
    """verl's generated trainer config, completed by the ``_target_`` dataclasses' fields."""
    index = Index(package)
    if VERL_GENERATED not in package.files:
        raise SystemExit(f"gen_framework_schemas: {VERL_GENERATED} not found")
    defaults = yaml.safe_load(package.files[VERL_GENERATED])
    composed = {key for key, _ in _walk_yaml(defaults)}  # what Hydra composes, before _complete adds fields
    generated = sorted(
        (p for p in package.files if re.fullmatch(r"verl/trainer/config/_generated_[a-z_]+\.yaml", p)),
        key=lambda p: (p != VERL_GENERATED, p),  # the FSDP trainer's classes name the strict sections
    )
    schema = Schema(index)
    for source in generated:
        data = yaml.safe_load(package.files[source])
        for key, value in _walk_yaml(data):
            schema.keys.add(key)
            if isinstance(value, dict) and isinstance(value.get("_target_"), str):
                cls = index.by_target(value["_target_"])
                if cls is None:
                    print(f"warning: {key}: _target_ {value['_target_']} not found", file=sys.stderr)
                    continue
                # hydra.utils.instantiate calls the dataclass with the section's keys: an unknown key
                # fails there; a nested section without its own _target_ is passed through unchecked
                schema.add_class(cls, key, strict=True, nested_strict=False)
                if source == VERL_GENERATED:
                    _complete(schema, cls, key, _node(defaults, key))
    return defaults, {
        "framework": "verl",
        "version": package.version("verl"),
        "sources": [*generated, "verl/**.py (the dataclasses _target_ names)"],
        "keys": sorted(schema.keys),
        "open": sorted(schema.open),
        "strict": dict(sorted(schema.strict.items())),
        "unresolved_defaults": dict(sorted(schema.unresolved.items())),
        # the Hydra defaults list VERL_GENERATED is composed from: a user's file that carries the same
        # list composes the same defaults (batchfit.frameworks.source.hydra_composed)
        "hydra_defaults": yaml.safe_load(package.files[VERL_MAIN]).get("defaults", []),
        # the keys of verl.yaml that _complete added from the dataclasses: Hydra's composed config lacks
        # them, so verl refuses an override of one without a "+" (batchfit.frameworks.verl_emit.override_prefix)
        "not_composed": sorted(key for key, _ in _walk_yaml(defaults) if key not in composed),
    }


def _node(tree: dict[str, Any], key: str) -> dict[str, Any]:
    for part in key.split("."):
        tree = tree[part]
    return tree


def _complete(schema: Schema, cls: ClassDef, path: str, section: dict[str, Any]) -> None:
    """Add to ``section`` the fields of ``cls`` it leaves out whose defaults are plain values."""
    for name, (f, owner) in schema.index.fields(cls).items():
        if name.startswith("_") or name in section:
            continue
        kind, _ = schema.field_kind(f, owner)
        if kind != "leaf":
            continue
        value = schema.default_of(f, owner, f"{path}.{name}")
        if isinstance(value, Unresolved) or value == MISSING:
            continue
        section[name] = copy.deepcopy(value)


# ------------------------------------------------------------------ output


HEADER = """\
# {framework} {version}: every key of its config with its default, generated by
# scripts/gen_framework_schemas.py from {source}. Do not edit; regenerate.
# batchfit merges a user's file over this, as the framework fills the keys a config leaves out.
"""


def write(out: Path, name: str, defaults: dict[str, Any], schema: dict[str, Any], source: str) -> None:
    text = HEADER.format(framework=schema["framework"], version=schema["version"], source=source)
    text += yaml.safe_dump(defaults, sort_keys=False, default_flow_style=False, width=120)
    (out / f"{name}.yaml").write_text(text)
    (out / f"{name}_schema.json").write_text(json.dumps(schema, indent=1) + "\n")
    print(
        f"{name}: {schema['version']}, {len(schema['keys'])} keys, {len(schema['open'])} open, "
        f"{len(schema['strict'])} strict sections, {len(schema['unresolved_defaults'])} unresolved defaults"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skyrl", type=Path, help="SkyRL wheel or unzipped directory")
    parser.add_argument("--verl", type=Path, help="verl wheel or unzipped directory")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "src" / "batchfit" / "frameworks" / "defaults",
        help="directory to write into (default: the package's defaults/)",
    )
    args = parser.parse_args(argv)
    if args.skyrl is None and args.verl is None:
        parser.error("pass --skyrl and/or --verl")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.skyrl is not None:
        defaults, schema = skyrl_schema(Package(args.skyrl))
        write(args.out, "skyrl", defaults, schema, f"skyrl {schema['version']}'s config dataclasses")
    if args.verl is not None:
        defaults, schema = verl_schema(Package(args.verl))
        write(args.out, "verl", defaults, schema, f"verl {schema['version']}'s {VERL_GENERATED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
