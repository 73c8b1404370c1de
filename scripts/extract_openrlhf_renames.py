"""Write OpenRLHF's renamed launch flags (old name -> its 0.11.2 name) as data batchfit ships.

OpenRLHF renamed every flag of ``train_ppo_ray`` to a dotted name in commit ed62d0e2
(2026-04-19, "dotted config hierarchy"), after five smaller renames since v0.8.0. A launch
script written for an older release is read by batchfit through this table
(``defaults/openrlhf_renames.json``, read by :mod:`batchfit.frameworks.openrlhf_renames`).

How the table is derived, from OpenRLHF's git history (``fetch github:OpenRLHF/OpenRLHF``):

1. For every commit since v0.8.0 that touches ``openrlhf/cli/train_ppo_ray.py``, the real
   parser before and after it is built (``extract_framework_flags.build_parser``); the flags it
   removes are what must be mapped.
2. For ed62d0e2 (142 flags), three witnesses of that same commit, in this order: how the code
   reads each value (a changed line ``args.micro_train_batch_size`` -> ``args.train.micro_batch_size``,
   every ``.py`` file of the PPO path, line pairs of equal length), how its example launch
   scripts were rewritten (``--train_batch_size 128`` -> ``--train.batch_size 128``), and the
   parser's own text (the ``add_argument`` lines paired in place, accepted only when action,
   type, ``nargs``, choices and default agree). A pair is kept only when its new flag is a flag
   of OpenRLHF 0.11.2 (the wheel batchfit mirrors).
3. The defaults of renamed flags that changed since v0.8.0 (``changed_defaults``: a script
   that leaves ``--micro_train_batch_size`` unset ran with 4 before a2978694, 0.11.2 uses 1).
4. What no witness decides — the optimizer flags that became one per model, the smaller
   renames before ed62d0e2 (a switch that became a value) and flags removed — is :data:`HAND`,
   each entry with the commit and the line of code it was read from.

Usage (the shipped file was written this way)::

    python scripts/extract_openrlhf_renames.py /work/.mirror/OpenRLHF+OpenRLHF/repo \
        /tmp/wheels/openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl

``--check`` compares with the shipped file instead (exit 1 when they differ).
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_framework_flags import DEFAULTS, build_parser, describe, read_source

RENAME = "ed62d0e20dea08397251eba5e010ee9dabc4d048"
SINCE = "v0.8.0"
FILE = "openrlhf/cli/train_ppo_ray.py"
# files of the rename commit that belong to other trainers (SFT, DPO, RM): their flags are other parsers'
OTHER_TRAINERS = (
    "train_sft",
    "train_dpo",
    "train_rm",
    "serve_rm",
    "sft_trainer",
    "dpo_trainer",
    "rm_trainer",
    "lora_combiner",
)

#: old flag -> (its 0.11.2 flags, value or None, commit, the code it was read from). A value: the old
#: flag was a switch that became a flag with a value. No flags: removed, ``why`` says what replaced it.
HAND: dict[str, dict[str, Any]] = {
    # ed62d0e2: DeepSpeed's own options moved under --ds.* (strategy/deepspeed/deepspeed.py reads args.ds.*)
    "--zpg": {"flags": ["--ds.zpg"], "commit": RENAME, "why": "parser: --ds.zpg, same type and default"},
    "--adam_offload": {"flags": ["--ds.adam_offload"], "commit": RENAME, "why": "parser: --ds.adam_offload"},
    "--grad_accum_dtype": {
        "flags": ["--ds.grad_accum_dtype"],
        "commit": RENAME,
        "why": "parser: --ds.grad_accum_dtype",
    },
    "--overlap_comm": {
        "flags": ["--ds.overlap_comm"],
        "commit": RENAME,
        "why": "README: --overlap_comm -> --ds.overlap_comm",
    },
    "--train_batch_size": {
        "flags": ["--train.batch_size"],
        "commit": RENAME,
        "why": "examples/scripts/*.sh: --train_batch_size 128 -> --train.batch_size 128",
    },
    # ed62d0e2: one optimizer and scheduler per model (--actor.* and --critic.*), built in the strategy
    "--actor_learning_rate": {
        "flags": ["--actor.adam.lr"],
        "commit": RENAME,
        "why": "examples: --actor_learning_rate 5e-7 -> --actor.adam.lr 5e-7",
    },
    "--critic_learning_rate": {
        "flags": ["--critic.adam.lr"],
        "commit": RENAME,
        "why": "examples: --critic_learning_rate 9e-6 -> --critic.adam.lr 9e-6",
    },
    "--adam_betas": {
        "flags": ["--actor.adam.betas", "--critic.adam.betas"],
        "commit": RENAME,
        "why": "parser: one per model",
    },
    "--l2": {
        "flags": ["--actor.adam.weight_decay", "--critic.adam.weight_decay"],
        "commit": RENAME,
        "why": "parser: the weight decay, one per model",
    },
    "--max_norm": {
        "flags": ["--actor.max_norm", "--critic.max_norm"],
        "commit": RENAME,
        "why": "parser: one per model",
    },
    "--lr_warmup_ratio": {
        "flags": ["--actor.lr_warmup_ratio", "--critic.lr_warmup_ratio"],
        "commit": RENAME,
        "why": "parser: one per model",
    },
    "--lr_scheduler": {
        "flags": ["--actor.lr_scheduler", "--critic.lr_scheduler"],
        "commit": RENAME,
        "why": "parser: one per model",
    },
    "--kl_target": {
        "flags": ["--algo.kl.target"],
        "commit": RENAME,
        "why": "parser: --algo.kl.target, same type and default",
    },
    "--kl_horizon": {
        "flags": ["--algo.kl.horizon"],
        "commit": RENAME,
        "why": "parser: --algo.kl.horizon, same type and default",
    },
    "--ptx_coef": {
        "flags": [],
        "commit": RENAME,
        "why": "removed (a dead flag: no code of ed62d0e2^ read args.ptx_coef)",
    },
    "--actor_init_on_gpu": {
        "flags": [],
        "commit": RENAME,
        "why": "removed (a dead flag: no code of ed62d0e2^ read it)",
    },
    "--perf": {"flags": [], "commit": RENAME, "why": "removed (a dead flag: no code of ed62d0e2^ read it)"},
    # 0.11.2 replaced ed62d0e2's switch and type of the importance-sampling correction by level / mode / gating
    # (train_ppo_ray.py: "TIS = token clip, ICEPOP = token mask, seq-mask-tis = seq mask")
    "--enable_vllm_is_correction": {
        "flags": [],
        "commit": RENAME,
        "why": "replaced in 0.11.2 by --algo.advantage.is_correction_level token|seq (with --algo.advantage.is_correction_mode)",
    },
    "--vllm_is_correction_type": {
        "flags": [],
        "commit": RENAME,
        "why": "replaced in 0.11.2 by --algo.advantage.is_correction_level and --algo.advantage.is_correction_mode "
        "(tis = token clip, icepop = token mask, seq-mask-tis = seq mask)",
    },
    # before ed62d0e2
    "--max_tokens_per_gpu": {
        "flags": ["--train.max_tokens_per_gpu"],
        "commit": "f9a1676b",
        "why": "split into --train_max_tokens_per_gpu and --rollout_max_tokens_per_gpu, which defaults to the train one",
    },
    "--flash_attn": {
        "flags": ["--ds.attn_implementation"],
        "value": "flash_attention_2",
        "commit": "c250c21a",
        "why": '--flash_attn ("Enable FlashAttention2") -> --attn_implementation, default flash_attention_2',
    },
    "--bf16": {
        "flags": ["--ds.param_dtype"],
        "value": "bf16",
        "commit": "cd7a434f",
        "why": '--bf16 ("Enable bfloat16") -> --param_dtype bf16|fp16, default bf16',
    },
    "--use_icepop": {
        "flags": [],
        "commit": "8b78539c",
        "why": "replaced by --vllm_is_correction_type icepop, in 0.11.2 --algo.advantage.is_correction_level token "
        "--algo.advantage.is_correction_mode mask",
    },
    # d0e088b6: max_len = args.max_len if args.max_len else args.prompt_max_len + args.generate_max_len
    "--prompt_max_len": {
        "flags": ["--data.max_len"],
        "commit": "d0e088b6",
        "why": "--data.max_len counts prompt + response: the old code took prompt_max_len + generate_max_len "
        "(defaults 1024 each) when --max_len was not given",
        "sum_with": "--generate_max_len",
        "old_default": 1024,
    },
    "--generate_max_len": {
        "flags": ["--rollout.max_new_tokens"],
        "commit": "d0e088b6",
        "why": "--generate_max_len -> --max_new_tokens; --data.max_len = --prompt_max_len + --generate_max_len",
        "sum_with": "--prompt_max_len",
        "old_default": 1024,
    },
}


def _git(repo: str, *args: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", repo, *args], check=True, capture_output=True, text=True
    ).stdout


def _flags(repo: str, commit: str) -> list[dict[str, Any]]:
    text, _ = read_source("openrlhf", repo, commit)
    return describe(build_parser("openrlhf", text))


_ARGS = re.compile(r"\bargs\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_FLAG = re.compile(r"(--[A-Za-z][\w.\-]*)")
_PARSER_FLAG = re.compile(r'"(--[A-Za-z][\w.\-]*)"')


def _line_pairs(old: list[str], new: list[str]) -> list[tuple[str, str]]:
    """Changed lines of equal-length replaced blocks, paired in place."""
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag == "replace" and i2 - i1 == j2 - j1:
            out.extend(zip(old[i1:i2], new[j1:j2]))
    return out


def witnesses(repo: str) -> dict[str, collections.Counter[str]]:
    """old dest or flag -> Counter of the new names ed62d0e2's code and example scripts put in its place."""
    votes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    files = _git(repo, "show", "--name-only", "--format=", RENAME).split()
    for path in files:
        if any(s in path for s in OTHER_TRAINERS):
            continue
        if path.endswith(".py"):
            pattern, prefix = _ARGS, "args:"
        elif path.startswith("examples/") and path.endswith(".sh"):
            pattern, prefix = _FLAG, "flag:"
        else:
            continue
        try:
            old = _git(repo, "show", f"{RENAME}^:{path}").splitlines()
        except subprocess.CalledProcessError:
            continue
        new = _git(repo, "show", f"{RENAME}:{path}").splitlines()
        for a, b in _line_pairs(old, new):
            ra, rb = pattern.findall(a), pattern.findall(b)
            if len(ra) == len(rb):
                for x, y in zip(ra, rb):
                    votes[prefix + x][y] += 1
    return votes


def parser_pairs(repo: str) -> dict[str, str]:
    """ed62d0e2's ``add_argument`` lines paired in place (old flag -> new flag)."""

    def main_block(text: str) -> list[str]:
        return text[text.index('if __name__ == "__main__":') :].splitlines()

    old = main_block(read_source("openrlhf", repo, f"{RENAME}^")[0])
    new = main_block(read_source("openrlhf", repo, RENAME)[0])
    pairs: dict[str, str] = {}
    for _, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        o = [f for line in old[i1:i2] for f in _PARSER_FLAG.findall(line)]
        n = [f for line in new[j1:j2] for f in _PARSER_FLAG.findall(line)]
        if len(o) == len(n):
            pairs.update(zip(o, n))
    return pairs


def build(repo: str, wheel: str) -> dict[str, Any]:
    target = {
        f: e
        for e in describe(build_parser("openrlhf", read_source("openrlhf", wheel)[0]))
        for f in e["flags"]
    }
    commits = _git(repo, "log", "--reverse", "--format=%H", f"{SINCE}^..{RENAME}", "--", FILE).split()
    gone: dict[str, tuple[str, dict[str, Any]]] = {}  # old flag -> (the commit that removed it, its entry)
    history: dict[str, list[tuple[str, Any]]] = collections.defaultdict(list)  # old flag -> (commit, default)
    previous = None
    for commit in commits:
        entries = _flags(repo, commit)
        for e in entries:
            history[e["flags"][0]].append((commit, e["default"]))
        if previous is not None:
            now = {f for e in entries for f in e["flags"]}
            for flag, entry in previous.items():
                if flag not in now and flag not in gone:
                    gone[flag] = (commit, entry)
        previous = {f: e for e in entries for f in e["flags"]}
    votes = witnesses(repo)
    pairs = parser_pairs(repo)
    new_at_rename = {f: e for e in _flags(repo, RENAME) for f in e["flags"]}

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        keys = ("action", "type", "nargs", "choices", "default")
        return all(a[k] == b[k] for k in keys)

    table: dict[str, dict[str, Any]] = {}
    undecided = []
    for flag, (commit, entry) in sorted(gone.items()):
        if flag in HAND:
            table[flag] = dict(HAND[flag])
            continue
        found: list[str] = []
        how = ""
        by_code = votes.get("args:" + entry["dest"])
        by_example = votes.get("flag:" + flag)
        if commit != RENAME:
            pass
        elif by_code:
            # every name the code reads in its place (--ref_reward_offload became --ref.offload and --reward.offload)
            found = ["--" + name for name in by_code]
            how = "the code reads it as " + " and ".join(f"args.{name}" for name in by_code)
        elif by_example:
            found, how = [by_example.most_common(1)[0][0]], "the example scripts were rewritten with it"
        elif flag in pairs and pairs[flag] in new_at_rename and same(entry, new_at_rename[pairs[flag]]):
            found, how = [pairs[flag]], "the parser line, same action, type, nargs, choices and default"
        if not found or any(f not in target for f in found):
            undecided.append((flag, commit[:8], found))
            continue
        table[flag] = {"flags": found, "commit": commit, "why": how}
    if undecided:
        raise SystemExit(f"no witness for {undecided}: add them to HAND")
    for flag, row in table.items():
        missing = [f for f in row["flags"] if f not in target]
        if missing:
            raise SystemExit(f"{flag} -> {missing}: not flags of OpenRLHF 0.11.2")
        row["commit"] = row["commit"][:8]
    changed = {}
    for flag, row in table.items():
        if len(row["flags"]) != 1 or "value" in row or "sum_with" in row:
            continue
        now = target[row["flags"][0]]["default"]
        # the last default before the one 0.11.2 keeps, and the commit that changed it
        for (_, before), (commit, after) in zip(history[flag], history[flag][1:]):
            if before != after and after == now:
                changed[row["flags"][0]] = {
                    "old_flag": flag,
                    "old_default": before,
                    "changed_in": commit[:8],
                    "default": now,
                }
    return {
        "framework": "openrlhf",
        "to_version": Path(wheel).name.split("-")[1],
        "since": SINCE,
        "rename_commit": RENAME,
        "generated_by": "scripts/extract_openrlhf_renames.py",
        "renamed": table,
        "changed_defaults": changed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo", help="OpenRLHF's git directory")
    p.add_argument("wheel", help="the openrlhf wheel batchfit mirrors")
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    data = build(args.repo, args.wheel)
    out = DEFAULTS / "openrlhf_renames.json"
    rendered = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    if args.check:
        same = out.is_file() and json.loads(out.read_text())["renamed"] == data["renamed"]
        print(f"{out}: {'up to date' if same else 'differs'}")
        return 0 if same else 1
    out.write_text(rendered)
    print(f"{out}: {len(data['renamed'])} old flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
