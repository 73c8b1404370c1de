"""OpenRLHF's flags before its rename, read as OpenRLHF 0.11.2's.

OpenRLHF renamed every flag of ``train_ppo_ray`` to a dotted name in commit ed62d0e2
(2026-04-19: ``--micro_train_batch_size`` became ``--train.micro_batch_size``, ``--pretrain``
``--actor.model_name_or_path``) after five smaller renames since v0.8.0 (``--bf16`` became
``--param_dtype bf16``, ``--flash_attn`` ``--attn_implementation flash_attention_2``,
``--prompt_max_len`` and ``--generate_max_len`` ``--max_len`` and ``--max_new_tokens``, …).
``defaults/openrlhf_renames.json`` holds each old flag's 0.11.2 flags, the commit and the code
it was read from (written by ``scripts/extract_openrlhf_renames.py`` from OpenRLHF's history).

# NOTE [ Old OpenRLHF flags are translated ]
A script written for OpenRLHF < 0.11 is read, not refused: every rename in the table is exact
(the same value under a new name, read by the same code), so the sizes batchfit answers do not
depend on which names the script uses, and refusing would make a user rewrite thirty flags
before seeing one number. Each translation is reported (old → new, with the commit), so the
user can rename the script (0.11.2's parser refuses the old names); ``--emit openrlhf`` writes
the new names. Flags OpenRLHF removed are dropped with what replaced them; defaults of renamed
flags that changed since (``--micro_train_batch_size`` 4 → 1) are reported when the script
leaves them unset.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from importlib import resources
from typing import Any

from batchfit.frameworks.flags import Command, flag_spec

# d0e088b6: max_len = args.max_len if args.max_len else args.prompt_max_len + args.generate_max_len
_PROMPT, _GENERATE, _OLD_MAX_LEN = "--prompt_max_len", "--generate_max_len", "--max_len"


@cache
def renames() -> dict[str, Any]:
    """The shipped table (``defaults/openrlhf_renames.json``): ``renamed`` and ``changed_defaults``."""
    text = resources.files("batchfit.frameworks").joinpath("defaults", "openrlhf_renames.json").read_text()
    return json.loads(text)


def new_flags(old: str) -> tuple[str, ...]:
    """OpenRLHF 0.11.2's flags for the pre-0.11 flag ``old`` (empty: removed or not an old flag).

    >>> new_flags("--micro_train_batch_size")
    ('--train.micro_batch_size',)
    """
    row = renames()["renamed"].get(old)
    return tuple(row["flags"]) if row else ()


@dataclasses.dataclass(frozen=True)
class Translated:
    """A command with its old flags renamed.

    Attributes:
        command: the command as OpenRLHF 0.11.2 would take it (unresolved words re-indexed).
        renamed: ``(old, new flags, commit)`` per old flag met, in the order met.
        notes: what the translation did, in words (empty when no old flag was met).
    """

    command: Command
    renamed: tuple[tuple[str, tuple[str, ...], str], ...]
    notes: tuple[str, ...]


def translate(command: Command, *, known: frozenset[str], read: frozenset[str]) -> Translated:
    """``command`` with every pre-0.11 flag in :func:`renames` rewritten as 0.11.2's (see the NOTE).

    Args:
        command: the launch command's arguments.
        known: OpenRLHF 0.11.2's option strings (a word that is one is never translated).
        read: the 0.11.2 ``dest`` names batchfit reads (changed defaults are reported for those).

    A flag's values are the words after it up to the next word starting with ``--`` (or the
    value after ``=``); a switch that became a flag with a value (``--bf16``) gets that value.
    """
    table = renames()["renamed"]
    words = [(w, command.unresolved.get(i)) for i, w in enumerate(command.args)]
    out: list[tuple[str, str | None]] = []
    renamed: list[tuple[str, tuple[str, ...], str]] = []
    removed: list[str] = []
    lengths: dict[
        str, tuple[str, str | None]
    ] = {}  # --prompt_max_len / --generate_max_len / --max_len -> value
    i = 0
    while i < len(words):
        word, expression = words[i]
        flag, _, inline = word.partition("=")
        row = table.get(flag) if word.startswith("--") and flag not in known else None
        if row is None:
            out.append(words[i])
            i += 1
            continue
        j = i + 1
        while j < len(words) and not words[j][0].startswith("--"):
            j += 1
        values = [(inline, expression)] if inline else words[i + 1 : j]
        i = j
        if flag in (_PROMPT, _GENERATE, _OLD_MAX_LEN) and values:
            lengths[flag] = values[-1]
            renamed.append((flag, tuple(row["flags"]), row["commit"]))
            continue
        if not row["flags"]:
            removed.append(
                f"{flag} ({row['commit']}: {row['why'].removeprefix('removed (').removesuffix(')')})"
            )
            continue
        if "value" in row:
            values = [(row["value"], None)]
        shown = tuple(f"{f} {row['value']}" for f in row["flags"]) if "value" in row else tuple(row["flags"])
        renamed.append((flag, shown, row["commit"]))
        for new in row["flags"]:
            out.append((new, None))
            out.extend(values)
    notes: list[str] = []
    if lengths:
        out.extend(_lengths(lengths, notes))
    if renamed:
        listed = ", ".join(f"{old} → {' and '.join(new) or '(none)'}" for old, new, _ in renamed)
        commits = sorted({c for _, _, c in renamed})
        notes.insert(
            0,
            f"the script uses OpenRLHF's flags from before 0.11 (renamed in {', '.join(commits)}; "
            f"defaults/openrlhf_renames.json); read as 0.11.2's: {listed}. OpenRLHF 0.11.2 refuses the old names: "
            "rename them in the script",
        )
    if removed:
        notes.append("flags OpenRLHF removed, not read: " + "; ".join(removed))
    if renamed or removed:
        given = {w.partition("=")[0] for w, _ in out if w.startswith("--")}
        notes.extend(_changed_defaults(given, read))
    command = dataclasses.replace(
        command,
        args=tuple(w for w, _ in out),
        unresolved={k: e for k, (_, e) in enumerate(out) if e is not None},
    )
    return Translated(command, tuple(renamed), tuple(notes))


def _lengths(given: dict[str, tuple[str, str | None]], notes: list[str]) -> list[tuple[str, str | None]]:
    """``--data.max_len`` (and ``--rollout.max_new_tokens``) from the old length flags (commit d0e088b6)."""
    out: list[tuple[str, str | None]] = []
    default = renames()["renamed"][_PROMPT]["old_default"]  # 1024 for each of the two
    generate = given.get(_GENERATE)
    if _OLD_MAX_LEN in given:
        out += [("--data.max_len", None), given[_OLD_MAX_LEN]]
    else:
        prompt, response = given.get(_PROMPT, (str(default), None)), generate or (str(default), None)
        try:
            total: tuple[str, str | None] = (str(int(prompt[0]) + int(response[0])), None)
        except ValueError:  # an unresolved shell word, or not an integer: OpenRLHF's parser says which
            total = (f"{prompt[0]}+{response[0]}", prompt[1] or response[1] or f"{prompt[0]} + {response[0]}")
        out += [("--data.max_len", None), total]
        notes.append(
            f"--data.max_len={total[0]}: the old --prompt_max_len + --generate_max_len ({prompt[0]} + {response[0]}, "
            f"{default} each when not given; OpenRLHF d0e088b6 made --max_len the whole sequence)"
        )
    if generate is not None:
        out += [("--rollout.max_new_tokens", None), generate]
    return out


def _changed_defaults(given: set[str], read: frozenset[str]) -> list[str]:
    """Notes for renamed flags batchfit reads that the script leaves unset and whose default changed."""
    dests = {name: entry["dest"] for entry in flag_spec("openrlhf").flags for name in entry["flags"]}
    out = []
    for flag, row in renames()["changed_defaults"].items():
        if flag in given or dests.get(flag) not in read or row["old_default"] is None:
            continue
        out.append(
            f"the script leaves {row['old_flag']} unset: OpenRLHF defaulted it to {row['old_default']} before "
            f"{row['changed_in']}, 0.11.2's {flag} to {row['default']}; batchfit reads {row['default']} (set it to "
            "what the script ran with)"
        )
    return out
