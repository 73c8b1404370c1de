"""``batchfit plan``: validate and explain a batch-size configuration."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from batchfit.errors import BatchConfigError, as_flags
from batchfit.frameworks import framework_of, read_run_config
from batchfit.frameworks.sequence_parallel import check_sequence_parallel
from batchfit.plan.config import BatchConfig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="validate and explain train / mini / micro batch sizes and the data-parallel layout",
        description=(
            "Validate a batch-size configuration (batchfit's flat keys, a SkyRL or a verl config, YAML or "
            "JSON; the vocabulary is told from the keys; or an OpenRLHF or slime launch command, a shell script "
            "or a file of its flags) under that framework's rules and print the plan "
            "with its warnings, or every fault with its fix (exit 2). Flags override the file."
        ),
    )
    p.add_argument(
        "config",
        nargs="?",
        help="YAML or JSON file (flat keys, SkyRL's or verl's sections), or an OpenRLHF/slime launch script",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--strict",
        action="store_true",
        help="treat warnings (layouts the framework runs with waste) as faults",
    )
    fields = p.add_argument_group("fields (override the file)")
    for name in BatchConfig.fields():
        fields.add_argument(
            f"--{name.replace('_', '-')}", f"--{name}", dest=f"field_{name}", metavar="VALUE", default=None
        )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = {
        name: getattr(args, f"field_{name}")
        for name in BatchConfig.fields()
        if getattr(args, f"field_{name}") is not None
    }
    run = read_run_config(args.config if args.config else {}, overrides)
    if args.config:  # a size the model's heads cannot split: no world size is offered (NOTE in frameworks.sequence_parallel)
        check_sequence_parallel(overrides.get("sequence_parallel"), overrides.get("world_size"), run, None, None)
    # a setting given as a flag is named as the flag, not as the config's key for it (issue 40)
    # (without a file every setting is a flag's, even one the fault asks for: "set --gpus-per-node")
    given = {name: f"--{name.replace('_', '-')}" for name in (overrides if args.config else BatchConfig.fields())}
    run = run.replace(key_names={k: v for k, v in run.key_names.items() if k not in overrides})
    try:
        plan = run.plan(strict=args.strict)
    except BatchConfigError as exc:
        raise BatchConfigError([as_flags(fault, given) for fault in exc.faults]) from None
    plan = dataclasses.replace(plan, warnings=tuple(as_flags(w, given) for w in plan.warnings))
    if args.json:
        json.dump({"vocabulary": run.vocabulary, **plan.to_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if args.config:
            sys.stdout.write(f"{args.config}: {_vocabulary_name(run.vocabulary)} vocabulary\n")
        sys.stdout.write(str(plan) + "\n")
    return 0


def _vocabulary_name(vocabulary: str) -> str:
    """``"batchfit's flat"``, ``"SkyRL"``, ``"OpenRLHF (launch command)"``: a config's vocabulary in prose."""
    spec = framework_of(vocabulary)
    if spec is None:
        return "batchfit's flat"
    return f"{spec.prose} (launch command)" if spec.reads_command else spec.prose
