"""``batchfit plan``: validate and explain a batch-size configuration."""

from __future__ import annotations

import argparse
import json
import sys

from batchfit.config import BatchConfig
from batchfit.config_io import config_from_mapping, load_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="validate and explain train / mini / micro batch sizes and the data-parallel layout",
        description=(
            "Validate a batch-size configuration (flat keys or a SkyRL config, YAML or JSON) and print "
            "the plan, or every fault with its fix (exit 2). Flags override the file."
        ),
    )
    p.add_argument(
        "config", nargs="?", help="YAML or JSON file (flat keys or SkyRL's trainer/generator sections)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
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
    config = load_config(args.config, overrides) if args.config else config_from_mapping({}, overrides)
    plan = config.plan()
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(str(plan) + "\n")
    return 0
