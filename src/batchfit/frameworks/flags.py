"""Launch commands as configs: OpenRLHF and slime are configured by their trainer's command-line flags.

:func:`read_command` reads a file holding the launch command — a shell script
(``python -m openrlhf.cli.train_ppo_ray --flag value \\``, slime's ``python3 train.py
${ARGS[@]} …``) or a plain file of arguments — into the argument list the trainer would get.
:func:`parse_command` parses that list with the trainer's own argument parser, rebuilt from
the flags shipped in ``defaults/<framework>_flags.json`` (written from the released source by
``scripts/extract_framework_flags.py``): flag names, types, ``nargs``, actions and choices as
the framework defines them, so a value the trainer would reject is rejected here too.

The shell is read, not run: line continuations, comments, quotes, variable assignments
(``NAME=value``, ``export``), ``${NAME}``/``$NAME``/``${NAME:-default}``, integer arithmetic
(``$((1024 * 2))``, ``$(((a + b) / sp))``, as bash evaluates it) and bash arrays
(``NAME=( … )``, ``${NAME[@]}``) defined in the file are expanded; control flow, command
substitution, sourced files and the environment are not (the last assignment of a variable in
the file wins, and the variables used are reported). A flag whose value stays unresolved is a
fault when batchfit reads it, and dropped with a note otherwise. A verl script's launch
(``python3 -m verl.trainer.main_ppo key=value …``) is read here too; its arguments are Hydra
overrides (:mod:`batchfit.frameworks.hydra_overrides`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from batchfit.errors import BatchConfigError
from batchfit.frameworks.registry import command_frameworks, get_framework, launch_frameworks
from batchfit.frameworks.run import RunConfig
from batchfit.plan.config import BatchPlan

_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)\+?=(.*)$", re.S)
_ARRAY_OPEN = re.compile(r"^([A-Za-z_]\w*)\+?=\((.*)$", re.S)
_REF = re.compile(r"\$\{(\w+)(\[[@*]\])?(?::?-((?:[^{}]|\{[^{}]*\})*))?\}|\$(\w+)")
_WHOLE_ARRAY = re.compile(r"^\$\{(\w+)\[[@*]\]\}$")


@dataclass(frozen=True)
class FlagSpec:
    """A trainer's argument parser as data (one entry per flag, as ``argparse`` defines it).

    Attributes:
        framework: ``"openrlhf"`` or ``"slime"``.
        version: the release or commit the flags were read from.
        source: the file they were read from.
        allow_abbrev: whether the trainer's parser accepts unambiguous prefixes of long flags.
        flags: ``{"flags", "dest", "action", "type", "nargs", "const", "default", "choices",
            "required"}`` per flag, in the order the trainer adds them.
    """

    framework: str
    version: str
    source: str
    allow_abbrev: bool
    flags: tuple[dict[str, Any], ...]

    @property
    def by_flag(self) -> dict[str, dict[str, Any]]:
        """Every option string (``--train.batch_size``, ``--no-offload-train``) → its entry."""
        return {name: entry for entry in self.flags for name in entry["flags"]}

    @property
    def defaults(self) -> dict[str, Any]:
        """``dest`` → the trainer's default."""
        return {entry["dest"]: entry["default"] for entry in self.flags}

    def parser(
        self, extra: tuple[dict[str, Any], ...] = (), *, suppress_defaults: bool = False
    ) -> argparse.ArgumentParser:
        """The trainer's parser rebuilt from the data; errors raise instead of exiting.

        Args:
            extra: more entries, in the same form (flags the trainer takes from another
                parser, e.g. Megatron's for slime).
            suppress_defaults: leave out flags the arguments do not set (to tell what the
                command sets from what the trainer defaults).
        """
        parser = _RaisingParser(prog=self.framework, allow_abbrev=self.allow_abbrev, add_help=False)
        for entry in (*self.flags, *extra):
            kwargs: dict[str, Any] = {"dest": entry["dest"]}
            kind = entry["action"]
            names = list(entry["flags"])
            if kind == "BooleanOptionalAction":
                kwargs["action"] = argparse.BooleanOptionalAction
                names = names[:1]
            else:
                kwargs["action"] = _ACTIONS.get(kind, "store")
            if kwargs["action"] in ("store", "append"):
                kwargs["type"] = _TYPES.get(entry["type"], str)
                if entry["nargs"] is not None:
                    kwargs["nargs"] = entry["nargs"]
                if entry["choices"] is not None:
                    kwargs["choices"] = entry["choices"]
            if kwargs["action"] == "store_const":
                kwargs["const"] = entry["const"]
            kwargs["default"] = argparse.SUPPRESS if suppress_defaults else entry["default"]
            if entry.get("required"):
                kwargs["required"] = True
            parser.add_argument(*names, **kwargs)
        return parser


_ACTIONS = {
    "_StoreAction": "store",
    "_StoreTrueAction": "store_true",
    "_StoreFalseAction": "store_false",
    "_StoreConstAction": "store_const",
    "_AppendAction": "append",
    "_CountAction": "count",
}
_TYPES: dict[str | None, Callable[[str], Any]] = {
    "int": int,
    "float": float,
    "str": str,
    "json.loads": json.loads,
}


class _ParseError(Exception):
    pass


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print usage and exit(2)
        raise _ParseError(message)


@cache
def flag_spec(framework: str) -> FlagSpec:
    """The shipped :class:`FlagSpec` of ``framework`` (``defaults/<framework>_flags.json``)."""
    data = json.loads(
        resources.files("batchfit.frameworks").joinpath("defaults", f"{framework}_flags.json").read_text()
    )
    return FlagSpec(
        framework=data["framework"],
        version=data["version"],
        source=data["source"],
        allow_abbrev=data["allow_abbrev"],
        flags=tuple(data["flags"]),
    )


@dataclass(frozen=True)
class Command:
    """A trainer's arguments as a launch command gives them.

    Attributes:
        path: the file read.
        launcher: the token that starts the trainer (``openrlhf.cli.train_ppo_ray``,
            ``train.py``), or ``None`` for a file of arguments only.
        args: the arguments after it, shell words expanded.
        unresolved: argument index → the shell expression it came from, for words that
            refer to variables or arrays the file does not define.
        notes: what the shell reading assumed (variables used, arrays not found).
        environment: the variables the trainer's processes get from the file: those it
            exports, the ``NAME=value`` words before the launch on its line, and the
            ``env_vars`` of a ``ray job submit --runtime-env-json`` there (values resolved).
    """

    path: str
    launcher: str | None
    args: tuple[str, ...]
    unresolved: dict[int, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict, compare=False)


def is_command_file(path: str | Path) -> bool:
    """Whether ``path`` is read as a launch command (anything but ``.yaml``/``.yml``/``.json``/``.toml``)."""
    return Path(path).suffix.lower() not in (".yaml", ".yml", ".json", ".toml")


def read_command(path: str | Path) -> Command:
    """The trainer's arguments in a shell script or arguments file (see the module docstring).

    The launch is the first line with a token of a command framework's ``FrameworkSpec.launchers``
    (a shell script); a
    file with no launch whose words start with a flag is the arguments themselves.

    Raises:
        BatchConfigError: the file is missing, unreadable, not UTF-8, has an unclosed quote or
            array, or holds neither a launch command nor arguments.
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
        raise BatchConfigError([f"config file {str(path)!r} {reason}"]) from exc
    variables: dict[str, str | None] = {}
    arrays: dict[str, list[tuple[str, str | None]]] = {}
    used: dict[str, str] = {}
    plain: list[str] = []
    exported: set[str] = set()
    for words in _logical_lines(text, str(path)):
        launch = _launch_index(words)
        if launch is not None:
            expanded, unresolved, notes = _expand(words[launch + 1 :], variables, arrays, used)
            if used:
                notes.append(
                    "shell variables taken from the file (control flow is not evaluated; the last assignment wins): "
                    + ", ".join(f"{k}={v}" for k, v in used.items())
                )
            environment = _environment(words[:launch], variables, exported)
            return Command(str(path), words[launch], tuple(expanded), unresolved, tuple(notes), environment)
        if words[0] == "export":
            exported.update(m.group(1) for w in words[1:] if (m := re.match(r"([A-Za-z_]\w*)", w)))
        if _assign(words, variables, arrays, used):
            continue
        plain.extend(words)
    if plain and plain[0].startswith("--"):
        expanded, unresolved, notes = _expand(plain, variables, arrays, used)
        return Command(str(path), None, tuple(expanded), unresolved, tuple(notes))
    specs = launch_frameworks()
    launchers = ", ".join(
        f"{'or ' if i == len(specs) - 1 else ''}{spec.prose} ({' or '.join(spec.launchers)}"
        + (" key=value ...: Hydra overrides)" if not spec.reads_command else " --flag value ...)")
        for i, spec in enumerate(specs)
    )
    raise BatchConfigError(
        [
            f"config file {str(path)!r} holds no launch command and no flags: expected a shell script that "
            f"runs {launchers}, or a file of {' or '.join(s.prose for s in command_frameworks())}'s arguments "
            "(--flag value ...); YAML and JSON configs end in .yaml, .yml or .json"
        ]
    )


def _environment(prefix: list[str], variables: Mapping[str, str | None], exported: set[str]) -> dict[str, str]:
    """What the trainer's processes get from the file: exported variables, ``NAME=value`` before the launch, Ray's ``env_vars``."""
    env = {name: value for name in exported if (value := variables.get(name)) is not None}
    for i, word in enumerate(prefix):
        scalar = _ASSIGN.match(word)
        if scalar is not None and i == len([w for w in prefix[:i] if _ASSIGN.match(w)]):  # leading NAME=value words
            value, resolved = _substitute(scalar.group(2), variables, {})
            if resolved:
                env[scalar.group(1)] = value
        text = None
        if word == "--runtime-env-json" and i + 1 < len(prefix):
            text = prefix[i + 1]
        elif word.startswith("--runtime-env-json="):
            text = word.split("=", 1)[1]
        if text is not None:
            try:
                given = json.loads(_substitute(text, variables, {})[0]).get("env_vars", {})
            except (ValueError, AttributeError):
                continue
            env.update({str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {})
    return env


def _logical_lines(text: str, where: str) -> list[list[str]]:
    """Shell words per command: continuations joined, comments dropped, quotes and arrays closed."""
    text = _squeeze_arithmetic(re.sub(r"\\\r?\n", " ", text))
    out, buffer = [], ""
    for line in text.splitlines():
        buffer = f"{buffer}\n{line}" if buffer else line
        try:
            words = shlex.split(buffer, comments=True)
        except ValueError:  # an open quote: the command continues on the next line
            continue
        if words and _ARRAY_OPEN.match(words[0]) and not any(w.endswith(")") for w in words):
            continue  # an array assignment continues until its ")"
        if words:
            out.append(words)
        buffer = ""
    if buffer.strip():
        raise BatchConfigError(
            [f"config file {where!r}: an unclosed quote or array from {buffer.strip()[:60]!r}"]
        )
    return out


def _squeeze_arithmetic(text: str) -> str:
    """``text`` with the blanks inside each ``$(( … ))`` removed, so that shell words keep it whole.

    Bash reads an arithmetic expansion as one word whatever its blanks (``$((1024 * 2))``);
    :func:`shlex.split` would split it. Blanks never change an integer expression's value.
    """
    out, i = [], 0
    while (start := text.find("$((", i)) >= 0:
        end = _arithmetic_end(text, start)
        if end is None:
            break
        out += [text[i:start], re.sub(r"\s+", "", text[start:end])]
        i = end
    return "".join(out) + text[i:]


def _arithmetic_end(text: str, start: int) -> int | None:
    """The index after the ``))`` closing the ``$((`` at ``start``, or ``None`` when it is not closed."""
    depth = 0
    for i in range(start + 1, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1 if text[i - 1] == ")" else None
        elif text[i] == "\n":
            return None
    return None


_ARITH_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    # bash divides integers towards zero (C), not towards minus infinity
    ast.Div: lambda a, b: abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1),
    ast.Mod: lambda a, b: a - b * _ARITH_OPS[ast.Div](a, b),
    ast.Pow: lambda a, b: a**b,
}


def _arithmetic(expression: str, variables: Mapping[str, str | None], used: dict[str, str]) -> int | None:
    """Bash's value of an integer expression (``+ - * / % **``, parentheses, variables with or without ``$``).

    ``None`` when a variable is not set in the file or is not an integer, or the expression is
    anything else (a comparison, an assignment, a division by zero).
    """
    text, ok = _substitute(expression, variables, used)
    if not ok:
        return None

    def name(match: re.Match[str]) -> str:
        value = variables.get(match.group(0))
        if value is None or not re.fullmatch(r"\s*-?\d+\s*", value):
            raise ValueError(match.group(0))
        used[match.group(0)] = value
        return f"({value.strip()})"

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            return _ARITH_OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(ast.dump(node))

    try:
        text = re.sub(r"[A-Za-z_]\w*", name, text)
        return value(ast.parse(text.replace("//", "/ /"), mode="eval").body)  # "//" is no bash operator
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return None


def _launch_index(words: list[str]) -> int | None:
    for i, word in enumerate(words):
        for spec in launch_frameworks():
            if any(word == name or word.endswith("/" + name) for name in spec.launchers):
                return i
    return None


def _assign(
    words: list[str],
    variables: dict[str, str | None],
    arrays: dict[str, list[tuple[str, str | None]]],
    used: dict[str, str],
) -> bool:
    """Record ``NAME=value``, ``export NAME=value`` or ``NAME=( ... )``; False for other commands."""
    if words[0] == "export" and len(words) > 1:
        words = words[1:]
    array = _ARRAY_OPEN.match(words[0])
    if array is not None:
        elements = [array.group(2), *words[1:]]
        elements[-1] = elements[-1][:-1] if elements[-1].endswith(")") else elements[-1]
        expanded, unresolved, _ = _expand([e for e in elements if e], variables, arrays, used)
        arrays[array.group(1)] = [(w, unresolved.get(i)) for i, w in enumerate(expanded)]
        return True
    scalar = _ASSIGN.match(words[0])
    if scalar is None or len(words) > 1:
        return False
    value, resolved = _substitute(scalar.group(2), variables, used)
    substituted = re.search(r"\$\((?!\()", scalar.group(2)) or "`" in scalar.group(2)  # $(( … )) is arithmetic
    variables[scalar.group(1)] = value if resolved and not substituted else None
    return True


def _substitute(word: str, variables: Mapping[str, str | None], used: dict[str, str]) -> tuple[str, bool]:
    """``word`` with ``$(( … ))``, ``${NAME}``, ``$NAME`` and ``${NAME:-default}`` replaced; False if one is unknown."""
    ok = True
    while (start := word.find("$((")) >= 0 and (end := _arithmetic_end(word, start)) is not None:
        number = _arithmetic(word[start + 3 : end - 2], variables, used)
        if number is None:
            return word, False
        word = f"{word[:start]}{number}{word[end:]}"

    def one(match: re.Match[str]) -> str:
        nonlocal ok
        name = match.group(1) or match.group(4)
        value = variables.get(name)
        if value is not None and (value != "" or match.group(3) is None):
            used[name] = value
            return value
        if match.group(3) is not None:
            default, resolved = _substitute(match.group(3), variables, used)
            ok = ok and resolved
            return default
        ok = False
        return match.group(0)

    return _REF.sub(one, word), ok


def _expand(
    words: list[str],
    variables: Mapping[str, str | None],
    arrays: Mapping[str, list[tuple[str, str | None]]],
    used: dict[str, str],
) -> tuple[list[str], dict[int, str], list[str]]:
    out: list[str] = []
    unresolved: dict[int, str] = {}
    notes: list[str] = []
    for word in words:
        whole = _WHOLE_ARRAY.match(word)
        if whole is not None:
            if whole.group(1) in arrays:
                for element, expression in arrays[whole.group(1)]:
                    if expression is not None:
                        unresolved[len(out)] = expression
                    out.append(element)
            else:
                notes.append(
                    f"{word}: the array {whole.group(1)} is not defined in the file (sourced files are not read), so its flags are not seen"
                )
            continue
        value, resolved = _substitute(word, variables, used)
        if not resolved:
            unresolved[len(out)] = word
        out.append(value)
    return out, unresolved, notes


def detect_framework(command: Command) -> str:
    """The framework a command launches (``"openrlhf"``, ``"slime"``, ``"verl"``): from the launcher, else from which
    trainer (OpenRLHF or slime) knows more of the flags.

    Raises:
        BatchConfigError: a file of arguments whose flags neither trainer has.
    """
    frameworks = command_frameworks()
    if command.launcher is not None:
        return next(s.name for s in launch_frameworks() if any(command.launcher.endswith(n) for n in s.launchers))
    flags = [a.split("=", 1)[0] for a in command.args if a.startswith("--")]
    counts = {s.name: sum(flag in flag_spec(s.name).by_flag for flag in flags) for s in frameworks}
    best = max(counts, key=counts.get)
    if counts[best] == 0 or list(counts.values()).count(counts[best]) > 1:
        raise BatchConfigError(
            [
                f"cannot tell the trainer of {command.path!r} from its flags ({', '.join(flags[:4])}): expected "
                + " or ".join(f"{s.prose}'s ({', '.join(s.markers)}, ...)" for s in frameworks)
                + "; or put the launch command in the file"
            ]
        )
    return best


@dataclass(frozen=True)
class Parsed:
    """A command parsed by the trainer's parser.

    Attributes:
        values: every ``dest`` → its value (the trainer's default when not given).
        given: the ``dest`` values the command sets.
        unknown: arguments the parser does not have (kept when the trainer ignores them).
        notes: flags left out because their values are unresolved shell words.
    """

    values: dict[str, Any]
    given: frozenset[str]
    unknown: tuple[str, ...]
    notes: tuple[str, ...] = ()


def parse_command(
    command: Command,
    spec: FlagSpec,
    *,
    read: frozenset[str],
    extra: tuple[dict[str, Any], ...] = (),
    ignore_unknown: bool = False,
) -> Parsed:
    """Parse ``command`` as the trainer does.

    Args:
        command: from :func:`read_command`.
        spec: the trainer's flags.
        read: the ``dest`` values batchfit reads; an unresolved shell word given to one of
            them is a fault, to any other flag it is dropped.
        extra: flags the trainer takes from another parser (same form as ``spec.flags``).
        ignore_unknown: the trainer ignores unknown flags (slime); else they are faults
            naming the closest flag, as ``argparse`` refuses them.

    Raises:
        BatchConfigError: every fault: unresolved values of flags batchfit reads, and what the
            trainer's parser refuses (unknown flags, bad values, wrong counts).
    """
    by_flag = {**spec.by_flag, **{n: e for e in extra for n in e["flags"]}}
    faults: list[str] = []
    dropped: list[str] = []
    args: list[str] = []
    for i, word in enumerate(command.args):
        if i not in command.unresolved:
            args.append(word)
            continue
        flag = args.pop() if args and args[-1].startswith("-") else ""
        entry = by_flag.get(flag)
        said = f"{flag} {command.unresolved[i]}".strip()
        if entry is not None and entry["dest"] in read:
            faults.append(
                f"{said}: the file does not set that shell variable (the environment, command substitution and "
                "sourced files are not read); write the value in the file"
            )
        else:
            dropped.append(said)
    parser = spec.parser(extra, suppress_defaults=True)
    unknown: list[str] = []
    try:
        if ignore_unknown:
            namespace, unknown = parser.parse_known_args(args)
        else:
            namespace = parser.parse_args(args)
    except _ParseError as exc:
        faults.append(_parse_fault(str(exc), spec, by_flag))
        namespace = argparse.Namespace()
    if faults:
        raise BatchConfigError(faults)
    given = vars(namespace)
    values = {**spec.defaults, **{e["dest"]: e["default"] for e in extra}, **given}
    notes = (f"not read (shell variables the file does not set): {', '.join(dropped)}",) if dropped else ()
    return Parsed(values=values, given=frozenset(given), unknown=tuple(unknown), notes=notes)


def _parse_fault(message: str, spec: FlagSpec, by_flag: Mapping[str, Any]) -> str:
    name = f"{get_framework(spec.framework).prose} {spec.version}"
    if message.startswith("unrecognized arguments:"):
        words = message.split(":", 1)[1].split()
        parts = []
        for word in words:
            if not word.startswith("-"):
                continue
            near = difflib.get_close_matches(word.split("=", 1)[0], list(by_flag), n=1, cutoff=0.75)
            parts.append(f"{word}" + (f" (did you mean {near[0]}?)" if near else ""))
        listed = ", ".join(parts) or ", ".join(words)
        return (
            f"{name} has no flag {listed}: its trainer refuses unknown flags (argparse); flags as of this release "
            f"are listed in batchfit/frameworks/defaults/{spec.framework}_flags.json"
        )
    return f"{name} refuses the command: {message}"


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Verdict:
    """What a framework's own rules say about a run: faults (refused or silently changed), warnings, notes."""

    faults: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrameworkRun(RunConfig):
    """A :class:`RunConfig` whose plan follows rules :attr:`BatchConfig.framework` has no name for.

    :meth:`plan` applies :attr:`rules` to the run as it is then (overrides included) and
    reports their faults, together with those found while reading (:attr:`faults`); only when
    there are none is the batch layout planned (the rules cover what that plan checks, in
    the framework's words). The rules' warnings and notes join the plan's.

    Attributes:
        rules: the framework's rules, a function of the run.
        values: every flag's value (``dest`` → value), for the rules.
    """

    rules: Callable[[FrameworkRun], Verdict] | None = field(default=None, compare=False)
    values: dict[str, Any] = field(default_factory=dict, compare=False)

    def plan(self, *, strict: bool = False) -> BatchPlan:
        """The batch plan under the framework's rules.

        Raises:
            BatchConfigError: every fault at once (with ``strict``, the warnings too).
        """
        verdict = self.rules(self) if self.rules is not None else Verdict()
        faults = [*self.faults, *verdict.faults]
        if strict:
            faults.extend(f"{w} (a warning; --strict makes it a fault)" for w in verdict.warnings)
        if faults:
            raise BatchConfigError(faults)
        plan = RunConfig.plan(self, strict=strict)
        return dataclasses.replace(
            plan,
            warnings=(*plan.warnings, *verdict.warnings),
            notes=(*plan.notes, *verdict.notes, *self.notes),
        )
