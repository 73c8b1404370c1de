"""Write the command-line flags of OpenRLHF's and slime's trainers as data batchfit ships.

Both frameworks are configured by the flags of their launch command. batchfit reads such a
command (``profile --config run.sh``) and writes flags back (``--emit openrlhf|slime``), so it
needs each trainer's argument parser: every flag's name, destination, type, ``nargs``, action,
choices and default. This script builds the **real** parsers from the released source without
importing the frameworks (ray, deepspeed, megatron, sglang):

- OpenRLHF: ``openrlhf/cli/train_ppo_ray.py`` builds its parser in the ``if __name__ ==
  "__main__":`` block; the statements before ``args = parser.parse_args()`` are taken from the
  file's syntax tree and run with only ``argparse`` and ``datetime`` (all they use).
- slime: ``slime/utils/arguments.py`` adds its flags with ``get_slime_extra_args_provider()``
  (and ``reset_arg``, which adds the Megatron batch flags it re-defaults) onto Megatron's parser;
  those functions are taken from the syntax tree and run on an empty parser, then the flags of
  ``_pre_parse_mode`` (``--train-backend``, ``--debug-*``) are added the same way. Megatron's
  and SGLang's own flags are not part of slime's file and are not listed.

Usage (the data files in ``src/batchfit/frameworks/defaults/`` were written this way)::

    python scripts/extract_framework_flags.py openrlhf /tmp/wheels/openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl
    python scripts/extract_framework_flags.py slime /work/.mirror/THUDM+slime/repo --commit 624b824a898ab0ec1fcb4d373004c7f3852bf515

``SOURCE`` is a wheel, an unpacked tree, or (slime) a git directory read at ``--commit``.
``--out FILE`` writes elsewhere; ``--check`` compares with the shipped file instead (exit 1
when they differ). ``tests/test_openrlhf.py`` and ``tests/test_slime.py`` call :func:`build_parser`
to run the real parser on what ``--emit`` prints, when the source is on the machine.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

DEFAULTS = Path(__file__).resolve().parents[1] / "src" / "batchfit" / "frameworks" / "defaults"
FILES = {
    "openrlhf": "openrlhf/cli/train_ppo_ray.py",
    "slime": "slime/utils/arguments.py",
}


def read_source(framework: str, source: str | Path, commit: str | None = None) -> tuple[str, str]:
    """The text of the framework's argument file in ``source`` and a description of where it came from."""
    inner = FILES[framework]
    source = Path(source)
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            names = [n for n in wheel.namelist() if n.endswith(inner)]
            if not names:
                raise SystemExit(f"{source} has no {inner}")
            return wheel.read(names[0]).decode(), f"{source.name}:{names[0]}"
    if commit is not None or ((source / "HEAD").is_file() and not (source / inner).is_file()):
        rev = commit or "HEAD"
        text = subprocess.run(
            ["git", "--git-dir", str(source), "show", f"{rev}:{inner}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        full = subprocess.run(
            ["git", "--git-dir", str(source), "rev-parse", rev], check=True, capture_output=True, text=True
        ).stdout.strip()
        return text, f"{inner} at commit {full}"
    for candidate in (source / inner, *source.glob(f"*/purelib/{inner}")):
        if candidate.is_file():
            return candidate.read_text(), str(candidate)
    raise SystemExit(f"no {inner} under {source}")


def build_parser(framework: str, text: str) -> argparse.ArgumentParser:
    """The framework's real argument parser, built from the text of its argument file."""
    tree = ast.parse(text)
    if framework == "openrlhf":
        return _openrlhf_parser(tree)
    return _slime_parser(tree)


def _openrlhf_parser(tree: ast.Module) -> argparse.ArgumentParser:
    main = next(
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and ast.unparse(node.test) == "__name__ == '__main__'"
    )
    body = []
    for stmt in main.body:
        if isinstance(stmt, ast.Assign) and "parse_args" in ast.unparse(stmt.value):
            break
        body.append(stmt)
    # datetime.now() in a default (the wandb run name) is frozen, so the data does not change run to run
    namespace: dict[str, Any] = {"argparse": argparse, "datetime": _FrozenClock}
    exec(compile(ast.Module(body=body, type_ignores=[]), "train_ppo_ray.py", "exec"), namespace)
    return namespace["parser"]


class _FrozenClock(datetime.datetime):
    @classmethod
    def now(cls, tz: Any = None) -> datetime.datetime:
        return datetime.datetime(2000, 1, 1)


def _slime_parser(tree: ast.Module) -> argparse.ArgumentParser:
    wanted = {"reset_arg", "get_slime_extra_args_provider"}
    namespace: dict[str, Any] = {
        "argparse": argparse,
        "json": json,
        "os": os,
        "logging": logging,
        "logger": logging.getLogger("slime"),
    }
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    exec(compile(ast.Module(body=defs, type_ignores=[]), "arguments.py", "exec"), namespace)
    # Megatron's parse_args builds its parser with allow_abbrev=False
    parser = argparse.ArgumentParser(allow_abbrev=False)
    namespace["get_slime_extra_args_provider"]()(parser)
    pre = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_pre_parse_mode")
    adds = [
        s
        for s in pre.body
        if isinstance(s, ast.Expr)
        and isinstance(s.value, ast.Call)
        and ast.unparse(s.value.func) == "temp_parser.add_argument"
    ]
    exec(
        compile(ast.Module(body=adds, type_ignores=[]), "arguments.py", "exec"),
        {"temp_parser": parser, "argparse": argparse},
    )
    return parser


def _type_name(kind: Any) -> str | None:
    if kind is None:
        return None
    if kind in (int, float, str):
        return kind.__name__
    module = getattr(kind, "__module__", "")
    return (
        f"{module}.{kind.__name__}"
        if module and module != "builtins"
        else getattr(kind, "__name__", repr(kind))
    )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def describe(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """Every flag of ``parser`` as plain data, in the order they were added (``--help`` left out)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        out.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "action": type(action).__name__,
                "type": _type_name(action.type),
                "nargs": action.nargs,
                "const": _plain(action.const),
                "default": _plain(action.default),
                "choices": None if action.choices is None else [_plain(c) for c in action.choices],
                "required": action.required,
            }
        )
    return out


def flag_data(framework: str, text: str, where: str, version: str) -> dict[str, Any]:
    parser = build_parser(framework, text)
    return {
        "framework": framework,
        "version": version,
        "source": where,
        "source_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "generated_by": "scripts/extract_framework_flags.py",
        "allow_abbrev": parser.allow_abbrev,
        "flags": describe(parser),
    }


def render(data: dict[str, Any]) -> str:
    """The data as JSON with one flag per line (readable diffs when a release changes a flag)."""
    head = {k: v for k, v in data.items() if k != "flags"}
    lines = [json.dumps(head, indent=1)[:-2] + ',\n "flags": [']
    lines += [
        " " + json.dumps(flag) + ("," if i < len(data["flags"]) - 1 else "")
        for i, flag in enumerate(data["flags"])
    ]
    return "\n".join(lines) + "\n ]\n}\n"


def _version(framework: str, source: Path, where: str) -> str:
    if framework == "openrlhf" and source.suffix == ".whl":
        return source.name.split("-")[1]
    return where.rsplit(" ", 1)[-1][:12] if "commit" in where else "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("framework", choices=sorted(FILES))
    p.add_argument("source", help="a wheel, an unpacked tree, or a git directory")
    p.add_argument("--commit", help="with a git directory: the commit to read (default HEAD)")
    p.add_argument("--out", help=f"default {DEFAULTS}/<framework>_flags.json")
    p.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = p.parse_args(argv)
    text, where = read_source(args.framework, args.source, args.commit)
    data = flag_data(args.framework, text, where, _version(args.framework, Path(args.source), where))
    out = Path(args.out) if args.out else DEFAULTS / f"{args.framework}_flags.json"
    rendered = render(data)
    if args.check:
        same = out.is_file() and json.loads(out.read_text())["flags"] == data["flags"]
        print(f"{out}: {'up to date' if same else 'differs from ' + where}")
        return 0 if same else 1
    out.write_text(rendered)
    print(f"{out}: {len(data['flags'])} flags from {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
