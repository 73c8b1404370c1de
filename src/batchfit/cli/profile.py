"""``batchfit profile``: the token budget of a model on a (real or estimated) device.

Parses flags, calls :func:`batchfit.budget.profile.profile_model`, renders a table per role,
the budget and the memory model (or ``--json``), a rich progress bar while probing, and
``--plot`` (matplotlib, imported only then).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from batchfit.budget.profile import ROLES, check_roles
from batchfit.errors import InvalidArgument

DEFAULT_MODEL = "tiny"
DEFAULT_MAX_SEQ_LEN = 4096
# Without a GPU and without --memory the estimate targets this device (stated in the header).
DEFAULT_ESTIMATE_TARGET = "h100-80gb"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``batchfit profile`` on the dispatcher's subparsers."""
    p = sub.add_parser(
        "profile",
        help="find the token budget: the largest micro-batch cost that fits in memory",
        description=(
            "Probe a training step (forward, backward, AdamW step) at several sequence lengths, longest first, "
            "and report the token budget C: any micro-batch with cost <= C fits. Without a GPU the estimate "
            f"backend predicts a target device in seconds (default target {DEFAULT_ESTIMATE_TARGET})."
        ),
    )
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="PRESET|DIR|ID", help=f"default {DEFAULT_MODEL}")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN, metavar="N", help="default 4096")
    p.add_argument(
        "--backend",
        default="auto",
        metavar="NAME",
        help="auto (cuda if available, else estimate), cpu, estimate, cuda",
    )
    p.add_argument(
        "--memory",
        metavar="SIZE",
        help=f"device memory: 80GiB, 80GB or a preset (h100-80gb, a100-40gb, l4); estimate default {DEFAULT_ESTIMATE_TARGET}, cuda default the device's",
    )
    p.add_argument("--dtype", default="bf16", metavar="bf16|fp32", help="parameter dtype (default bf16)")
    p.add_argument(
        "--gradient-checkpointing", action="store_true", help="activation checkpointing of every layer"
    )
    p.add_argument("--roles", default="policy", metavar="R,R", help=f"{','.join(ROLES)} (default policy)")
    p.add_argument(
        "--logprobs",
        default="full",
        metavar="full|chunked|fused",
        help="log-prob computation of the policy/reference step (default full: fp32 log_softmax of all logits)",
    )
    p.add_argument(
        "--cost", default="padded", metavar="padded|packed", help="micro-batch cost (default padded)"
    )
    p.add_argument(
        "--safety-margin",
        type=float,
        default=0.9,
        metavar="F",
        help="fraction of usable memory (default 0.9)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot peak memory vs. tokens per probed length")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=run)


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Backend and memory after defaults; fails fast on bad values (before building models).

    Raises:
        InvalidArgument: bad backend, memory, roles or dtype (one line each, exit 2).
    """
    from batchfit.budget.token_budget import check_cost
    from batchfit.memory import BACKEND_NAMES, parse_memory
    from batchfit.models import load_config, parse_dtype
    from batchfit.models.step import LOGPROBS
    from batchfit.validation import check_choice, check_number, check_positive_int

    backend = check_choice("--backend", args.backend, BACKEND_NAMES)
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "estimate"
    memory = args.memory
    defaulted = memory is None and backend == "estimate"
    if defaulted:
        memory = DEFAULT_ESTIMATE_TARGET
    if memory is not None:
        parse_memory(memory, name="--memory")
    elif backend == "cpu":
        raise InvalidArgument(
            "--memory is required with --backend cpu (the host has no device limit to fit), but got no "
            "--memory; pass e.g. --memory 2GiB, or use --backend estimate to predict a GPU"
        )
    check_positive_int("--max-seq-len", args.max_seq_len)
    check_number("--safety-margin", args.safety_margin, low=0.0, high=1.0, low_open=True)
    check_roles(args.roles)
    check_choice("--logprobs", args.logprobs, LOGPROBS)
    check_cost(args.cost)
    parse_dtype(args.dtype)
    load_config(args.model)
    if args.plot:
        from batchfit.cli.render_budget import require_matplotlib

        require_matplotlib(args.plot)
    return {"backend": backend, "memory": memory, "memory_defaulted": defaulted}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from batchfit.budget.profile import profile_model

    settings = resolve_settings(args)
    console = Console(soft_wrap=True)
    err = Console(stderr=True)
    show_progress = args.progress and not args.json and err.is_terminal
    with _progress(err, show_progress) as callback:
        profile = profile_model(
            args.model,
            max_seq_len=args.max_seq_len,
            roles=args.roles,
            backend=settings["backend"],
            memory_limit=settings["memory"],
            dtype=args.dtype,
            gradient_checkpointing=args.gradient_checkpointing,
            logprobs=args.logprobs,
            cost=args.cost,
            safety_margin=args.safety_margin,
            progress=callback,
        )
    if args.plot:
        from batchfit.cli.render_budget import plot_budget

        plot_budget(profile.budgets, args.plot)
    if args.json:
        data = profile.to_dict()
        data["memory_defaulted"] = settings["memory_defaulted"]
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _render(console, profile, settings, args)
    return 0


def _render(console: Any, profile: Any, settings: dict[str, Any], args: argparse.Namespace) -> None:
    from batchfit.cli.render_budget import budget_lines, budget_table
    from batchfit.memory import format_bytes

    target = settings["memory"] if settings["memory"] is not None else "the device"
    if settings["memory_defaulted"]:
        target = f"{target} (default target without a GPU; set --memory)"
    limit = f"{format_bytes(profile.memory_limit)}" if profile.memory_limit else "device total"
    console.print(
        f"batchfit profile: model {profile.model} ({profile.dtype}"
        f"{', gradient checkpointing' if profile.gradient_checkpointing else ''}, AdamW, "
        f"{profile.logprobs} log-probs), "
        f"max_seq_len {args.max_seq_len:,}, cost {args.cost}",
        highlight=False,
    )
    console.print(
        f"backend {profile.backend} → {target}: {limit}, reserve {format_bytes(profile.reserve_bytes)}, "
        f"safety margin {args.safety_margin:g}",
        highlight=False,
    )
    for role, budget in profile.budgets.items():
        console.print()
        console.print(budget_table(budget, title=f"{role}"))
        for line in budget_lines(budget):
            console.print(line, highlight=False)
    if len(profile.budgets) > 1:
        combined = profile.combined
        console.print()
        console.print(
            f"combined budget (every role fits): C = {combined.tokens:,} tokens, set by "
            f"{combined.binding_role}",
            highlight=False,
        )
    if args.plot:
        console.print(f"plot written to {args.plot}", highlight=False)


class _progress:
    """A rich progress bar fed by :class:`~batchfit.budget.BudgetProgress` events (or nothing)."""

    def __init__(self, console: Any, enabled: bool):
        self.console, self.enabled = console, enabled
        self.bar: Any = None
        self.tasks: dict[Any, Any] = {}

    def __enter__(self) -> Any:
        if not self.enabled:
            return False
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self.bar.__enter__()
        return self.update

    def update(self, event: Any) -> None:
        key = event.role
        if key not in self.tasks:
            self.tasks[key] = self.bar.add_task(f"{key or 'probing'}", total=event.n_lengths)
        task = self.tasks[key]
        if event.probe is not None:
            p = event.probe
            verdict = "fits" if p.fits else "does not fit"
            self.bar.update(
                task, description=f"{key or 'probing'}: s={p.seq_len:,} b={p.batch_size:,} {verdict}"
            )
        else:
            self.bar.update(
                task, total=max(event.n_lengths, event.length_index + 1), completed=event.length_index + 1
            )

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
