"""``batchfit demo``: run ``examples/grpo_stepwise.py`` (step-wise GRPO on a tiny model) with small sizes.

The example is the loop users copy; this command only finds it, passes the options given
(each one of the example's ``Settings`` fields) over small defaults, and runs it. Under
``torchrun --nproc-per-node 2 -m batchfit demo --sharding fsdp2`` it runs FSDP2 over gloo:
the ranks join (:mod:`batchfit.cli._ranks`), check that they were given the same options
(else every rank exits 2 naming the differing flag), rank 0 prints, and the run ends with
the ranks' parameter checksum compared (exit 1 when they differ). Bad values exit 2 before
any work.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from batchfit.errors import BatchfitError

#: The example's fields the command sets, with the small sizes it runs by default.
DEMO_DEFAULTS: dict[str, Any] = {
    "steps": 2,
    "prompts": 4,
    "mini_batch": 2,
    "samples": 4,
    "max_prompt_len": 96,
    "max_response_len": 64,
    "memory": "32MiB",
}

# (field, type, help): every field of the example's Settings (a test keeps them equal)
OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("steps", int, "training steps"),
    ("prompts", int, "prompts per training step (train_batch_size)"),
    ("mini_batch", int, "prompts per optimizer step (policy_mini_batch_size)"),
    ("samples", int, "trajectories per prompt (n_samples_per_prompt)"),
    ("epochs", int, "passes over each training batch (update_epochs_per_batch)"),
    ("max_turns", int, "turns per trajectory at most (1-5)"),
    ("max_prompt_len", int, "prompt columns (history included, left-truncated)"),
    ("max_response_len", int, "response columns"),
    ("model", str, "a batchfit preset (default tiny)"),
    ("sharding", ("none", "ddp", "fsdp2"), "ddp and fsdp2 need torchrun"),
    ("layout", ("packed", "padded"), "micro-batch layout (and budget cost)"),
    ("memory", str, "simulated accelerator memory per rank, e.g. 32MiB"),
    ("token_budget", int, "training tokens per micro-batch per rank (skips profiling)"),
    ("forward_token_budget", int, "forward-only tokens per micro-batch per rank (skips profiling)"),
    ("micro_batch_size", int, "fixed sequences per micro-batch instead of a token budget"),
    ("forward_micro_batch_size", int, "the same for the forward pass (default --micro-batch-size)"),
    ("lr", float, "AdamW learning rate"),
    ("clip_ratio", float, "PPO clip ratio"),
    ("seed", int, "seed of the rollouts and the initial weights"),
    ("quiet", bool, "no output"),
    ("timing_only", bool, "no memory tracker or collective counter (they halve tokens/s)"),
    ("response_only", bool, "run the head on the loss tokens only: budgets C and R, both caps planned"),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``demo``."""
    defaults = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in DEMO_DEFAULTS.items())
    p = sub.add_parser(
        "demo",
        help="run examples/grpo_stepwise.py: step-wise GRPO on a tiny model, token budgets, packed micro-batches",
        description=f"Step-wise GRPO on a tiny causal LM with batchfit (examples/grpo_stepwise.py). Defaults: {defaults}.",
    )
    for name, kind, text in OPTIONS:
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action="store_true", default=None, help=text)
        elif isinstance(kind, tuple):
            p.add_argument(flag, choices=kind, help=text)
        else:
            p.add_argument(flag, type=kind, metavar=name.upper(), help=text)
    p.set_defaults(func=run)


def example_path() -> Path:
    """The example: the copy a wheel ships in ``batchfit/examples/``, else the source tree's."""
    packaged = Path(__file__).resolve().parents[1] / "examples" / "grpo_stepwise.py"
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parents[3] / "examples" / "grpo_stepwise.py"


def load_example(path: Path | None = None) -> ModuleType:
    """Import the example as a module.

    Raises:
        BatchfitError: the file is not there (an installed package has no examples).
    """
    path = example_path() if path is None else path
    if not path.is_file():
        raise BatchfitError(
            f"batchfit demo runs examples/grpo_stepwise.py, but {path} does not exist; reinstall batchfit (its wheel ships the example) or run it from a source checkout"
        )
    loaded = sys.modules.get("grpo_stepwise")
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path.resolve():
        return loaded
    spec = importlib.util.spec_from_file_location("grpo_stepwise", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["grpo_stepwise"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def run(args: argparse.Namespace) -> int:
    import torch

    # a tiny model's ops only contend for cores: one thread (torchrun sets it per rank too);
    # two threads on a busy 2-core machine ran the demo 6x slower
    torch.set_num_threads(1)
    from batchfit.cli._ranks import check_same_flags, launched_world, process_group, require_torchrun
    from batchfit.errors import InvalidArgument

    example = load_example()
    values = {name: getattr(args, name) for name, _, _ in OPTIONS if getattr(args, name) is not None}
    settings = example.Settings(**{**DEMO_DEFAULTS, **values})  # every value checked before any work
    if settings.sharding != "none":
        require_torchrun(f"--sharding {settings.sharding}", "demo")
    elif launched_world() > 1:
        raise InvalidArgument(
            f"batchfit demo runs under torchrun (WORLD_SIZE={launched_world()}) with --sharding none, so every rank "
            "would train alone; pass --sharding fsdp2 or ddp, or run it without torchrun"
        )
    with process_group("cpu"):
        check_same_flags(args, [name for name, _, _ in OPTIONS], "demo")
        return example.run_settings(settings)
