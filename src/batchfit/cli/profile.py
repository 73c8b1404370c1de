"""``batchfit profile``: the token budget of a model on a (real or estimated) device.

Parses flags, calls :func:`batchfit.budget.profile.profile_model`, renders a table per role,
the budget and the memory model (or ``--json``), a rich progress bar while probing, and
``--plot`` (matplotlib, imported only then). ``--confirm`` calls
:func:`batchfit.budget.confirm.plan_confirm` and :func:`~batchfit.budget.confirm.run_confirm`
(the estimate before any process group is joined, the real runs on the ranks) and renders the
estimate and then the confirm table per role; ``--calibration FILE`` writes (with ``--confirm``)
or reads a :class:`~batchfit.memory.calibration.Calibration`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from batchfit.budget.profile import ROLES, check_roles
from batchfit.cli._ranks import launched_world, process_group
from batchfit.errors import InvalidArgument, Vocabulary
from batchfit.memory import DEFAULT_ESTIMATE_TARGET, DEFAULT_SAFETY_MARGIN

# The main job's default: a 7B policy at 8k on one 8-GPU node, sharded the way SkyRL and verl
# train it (FSDP2, fp32 master weights with bf16 compute, activation checkpointing).
DEFAULT_MODEL = "qwen2.5-7b"
# The cpu backend really runs the model on this host: its default is the toy preset.
DEFAULT_CPU_MODEL = "tiny"
DEFAULT_MAX_SEQ_LEN = 8192
DEFAULT_ESTIMATE_WORLD_SIZE = 8
# The most ranks the estimate backend simulates (torch's process groups count ranks in a C int;
# a million GPUs is beyond any run).
MAX_ESTIMATE_WORLD_SIZE = 2**20

#: The library's keyword names → this command's flags: the settings its errors name are written
#: as these flags (NOTE [ Messages in the caller's vocabulary ] in :mod:`batchfit.errors`).
FLAGS = {
    "max_seq_len": "--max-seq-len",
    "memory_limit": "--memory",
    "reserve_bytes": "--reserve",
    "safety_margin": "--safety-margin",
    "backend": "--backend",
    "sharding": "--sharding",
    "world_size": "--world-size",
    "offload": "--offload",
    "mixed_precision": "--mixed-precision",
    "dtype": "--dtype",
    "gradient_checkpointing": "--gradient-checkpointing",
    "roles": "--roles",
    "logprobs": "--logprobs",
    "response_only": "--response-only",
    "response_fraction": "--response-fraction",
    "cost": "--cost",
    "depth_extrapolation": "--depth-extrapolation",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``batchfit profile`` on the dispatcher's subparsers."""
    p = sub.add_parser(
        "profile",
        help="find the token budget per rank: the largest micro-batch cost that fits in memory",
        description=(
            "Probe a training step (forward, backward, AdamW step) at several sequence lengths, longest first, "
            "and report the token budget C per rank: any micro-batch with cost <= C fits. Models are sharded "
            "with PyTorch's own FSDP2 or DDP. Without a GPU the estimate backend predicts a target device in "
            f"seconds by simulating the ranks (default: {DEFAULT_MODEL} at {DEFAULT_MAX_SEQ_LEN} tokens, fsdp2 "
            f"over {DEFAULT_ESTIMATE_WORLD_SIZE} × {DEFAULT_ESTIMATE_TARGET}, gradient checkpointing). With "
            "--backend cpu or cuda under torchrun every rank measures for real and rank 0 prints."
        ),
    )
    p.add_argument(
        "--model",
        metavar="PRESET|DIR|ID",
        help=f"default {DEFAULT_MODEL} ({DEFAULT_CPU_MODEL} with --backend cpu, which runs it for real)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a SkyRL or verl config (YAML/JSON), or an OpenRLHF or slime launch command (a shell script, or a "
        "file of its flags): the model, max sequence length, GPUs, sharding, offload, "
        "checkpointing and the roles it runs come from it; flags override",
    )
    p.add_argument(
        "--emit",
        metavar="verl|skyrl|openrlhf|slime",
        help="with --config: print the keys to set in that framework's config (YAML, a comment per key; "
        "openrlhf and slime: the flags to add to the launch command)",
    )
    p.add_argument(
        "--emit-format", default="yaml", metavar="yaml|overrides", help="yaml (default) or Hydra overrides"
    )
    p.add_argument(
        "--max-seq-len", type=int, metavar="N", help=f"default {DEFAULT_MAX_SEQ_LEN} (or the config's)"
    )
    p.add_argument(
        "--backend",
        default="auto",
        metavar="NAME",
        help="auto (cuda if available, else estimate), cpu, estimate, cuda",
    )
    p.add_argument(
        "--memory",
        metavar="SIZE",
        help=f"device memory per rank: 80GiB, 80GB or a preset (h100-80gb, a100-40gb, l4); estimate default {DEFAULT_ESTIMATE_TARGET}, cuda default the device's",
    )
    p.add_argument(
        "--reserve",
        metavar="SIZE",
        help="memory per rank no tracker sees (CUDA context, NCCL, workspaces), taken off --memory: estimate default the CUDA context, cuBLAS workspaces and NCCL buffers (593.75 MiB sharded, 337.75 MiB on one GPU), cpu 0, cuda measured; 0 for none",
    )
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help=f"data-parallel ranks: simulated with --backend estimate (default {DEFAULT_ESTIMATE_WORLD_SIZE}); with cpu/cuda the torchrun group's size (the default)",
    )
    p.add_argument(
        "--sharding",
        metavar="none|ddp|fsdp1|fsdp2",
        help="how the model is spread over the ranks (default fsdp2 when estimating or under torchrun, else none; "
        "fsdp1: FullyShardedDataParallel as verl's strategy fsdp wraps it)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        help="fsdp2: keep every layer's gathered parameters from forward to backward",
    )
    p.add_argument(
        "--mixed-precision",
        metavar="bf16|none",
        help="fsdp2: bf16 = fp32 sharded parameters, bf16 compute, fp32 gradient reduction (the default with fsdp2)",
    )
    p.add_argument(
        "--offload",
        metavar="none|cpu",
        help="fsdp2: cpu = parameters, gradients, optimizer on the host (default none)",
    )
    p.add_argument(
        "--dtype",
        metavar="bf16|fp32",
        help="dtype parameters are stored in (default fp32 under --mixed-precision bf16, else bf16)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="activation checkpointing of every layer (default on, or the config's)",
    )
    p.add_argument(
        "--roles",
        metavar="R,R",
        help=f"{','.join(ROLES)} (default policy; with --config every pass the run makes)",
    )
    p.add_argument(
        "--logprobs",
        metavar="full|chunked|fused|verl|skyrl",
        help="log-prob computation of the policy/reference step (default full: fp32 log_softmax of all logits; "
        "verl, skyrl: the head that framework runs; with --config the framework's head as its keys set it)",
    )
    p.add_argument(
        "--response-only",
        action="store_true",
        help="run the policy's and reference's head only on the loss (response) tokens "
        "(batchfit.train.model_logprobs(only_loss_tokens=True)): the budget gets a second cap R on the "
        "response tokens of a micro-batch",
    )
    p.add_argument(
        "--response-fraction",
        type=float,
        metavar="F",
        help="with --response-only: the share of a sequence's tokens that are response tokens, in (0, 1] "
        "(4:1 prompt:response = 0.2; default the config's max response / (max prompt + max response), "
        "else 1: every token)",
    )
    p.add_argument(
        "--cost",
        metavar="padded|packed",
        help="micro-batch cost (default padded; with --config packed when the framework removes padding)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        metavar="N",
        help="train LoRA adapters of rank N on a frozen base, built with PEFT (pip install 'batchfit[lora]'); "
        "0 = full fine-tuning (default 0, or the config's policy LoRA)",
    )
    p.add_argument(
        "--lora-alpha",
        type=float,
        metavar="A",
        help="with --lora-rank: lora_alpha (default 16, as verl and SkyRL)",
    )
    p.add_argument(
        "--lora-targets",
        metavar="all-linear|NAME,NAME",
        help="with --lora-rank: the modules to adapt (default all-linear: every linear layer but the LM head)",
    )
    p.add_argument(
        "--safety-margin",
        type=float,
        metavar="F",
        help=f"fraction of usable memory (default {DEFAULT_SAFETY_MARGIN:g}, or the --calibration file's)",
    )
    p.add_argument(
        "--depth-extrapolation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure two shallow copies and extrapolate to the model's depth (default: on when estimating)",
    )
    p.add_argument(
        "--confirm",
        action="store_true",
        help="estimate first, then run the real step once at each role's budget on the device (--backend cpu "
        "or cuda) and report estimate vs measured per category; exit 1 when a run does not fit",
    )
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="with --confirm: write what the runs measured on this device (JSON); without: read such a file and "
        "profile with its memory, reserve and safety margin",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot peak memory vs. tokens per probed length")
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress (a bar on a terminal; else a line per probe on stderr)",
    )
    p.set_defaults(func=run, vocabulary=Vocabulary(FLAGS))


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Backend, memory, world and sharding after defaults; fails fast on bad values (before building models).

    Raises:
        InvalidArgument: bad backend, memory, world size, sharding, roles or dtype (one
            line each, exit 2), or a world size that is not the torchrun group's.
    """
    from batchfit.budget.token_budget import check_cost
    from batchfit.memory import BACKEND_NAMES, backend_name, parse_memory
    from batchfit.models import load_config, parse_dtype
    from batchfit.parallel.sharding import STRATEGIES, Sharding
    from batchfit.train.logprobs import check_head
    from batchfit.validation import check_choice, check_int, check_number, check_positive_int

    for flag, value in (("--memory", args.memory), ("--reserve", args.reserve)):
        check_size_text(flag, value)
    backend = backend_name(check_choice("--backend", args.backend, BACKEND_NAMES))
    run = _apply_config(args, backend)
    limits = _calibration(args, backend)
    memory = args.memory
    if memory is None and limits is not None:
        memory = limits.memory_limit  # the calibrated device
    defaulted = memory is None and backend == "estimate"
    if defaulted:
        memory = DEFAULT_ESTIMATE_TARGET
    reserve = _reserve(args.reserve) if limits is None else limits.reserve_bytes
    if memory is not None:
        parse_memory(memory, name="--memory")
    elif backend == "cpu":
        raise InvalidArgument(
            "--memory is required with --backend cpu (the host has no device limit to fit), but got no "
            "--memory; pass e.g. --memory 2GiB, or use --backend estimate to predict a GPU"
        )
    if args.model is None:
        args.model = DEFAULT_CPU_MODEL if backend == "cpu" else DEFAULT_MODEL
    launched = launched_world()
    if backend == "estimate":
        if launched > 1:
            raise InvalidArgument(
                f"--backend estimate simulates --world-size ranks in one process, but this process is one of "
                f"WORLD_SIZE={launched} torchrun ranks; run it without torchrun, or use --backend cpu or cuda"
            )
        world = DEFAULT_ESTIMATE_WORLD_SIZE if args.world_size is None else args.world_size
        check_int("--world-size", world, minimum=1, maximum=MAX_ESTIMATE_WORLD_SIZE)
    else:
        world = launched if args.world_size is None else check_positive_int("--world-size", args.world_size)
        if world != launched:
            raise InvalidArgument(
                f"--world-size must equal the number of launched ranks with --backend {backend} "
                f"(WORLD_SIZE={launched}), but got --world-size {world}; launch with torchrun --nproc-per-node "
                f"{world} (or drop --world-size), or use --backend estimate to simulate {world} ranks"
            )
    strategy = args.sharding
    if strategy is None:
        strategy = "fsdp2" if backend == "estimate" or world > 1 else "none"
    strategy = check_choice("--sharding", strategy, STRATEGIES)
    if memory is not None:
        check_reserve_fits(memory, reserve, backend, world if strategy != "none" else 1)
    sharding = Sharding(
        strategy,
        world_size=world,
        reshard_after_forward=args.reshard_after_forward,
        mixed_precision=args.mixed_precision,
        offload=args.offload,
    )
    # a one-rank cpu profile runs over a simulated group of one (budget.profile.simulated_world_for);
    # cuda, and a confirm's real step, need the ranks torchrun starts
    if strategy != "none" and backend != "estimate" and world == 1 and launched == 1 and (backend == "cuda" or args.confirm):
        raise InvalidArgument(
            f"--sharding {strategy} with --backend {backend} runs on real ranks: launch with torchrun "
            f"--nproc-per-node N batchfit profile ..., or use --backend estimate --world-size N"
        )
    from batchfit.budget.find import check_max_seq_len

    check_max_seq_len(args.max_seq_len, "--max-seq-len")
    if args.safety_margin is None:
        args.safety_margin = DEFAULT_SAFETY_MARGIN if limits is None else limits.safety_margin
    check_number("--safety-margin", args.safety_margin, low=0.0, high=1.0, low_open=True)
    check_roles(args.roles, "--roles")
    check_head("--logprobs", args.logprobs)
    check_cost(args.cost)
    _check_response_flags(args)
    if args.dtype is not None:
        parse_dtype(args.dtype)
    if run is None:
        load_config(args.model)
    else:
        for role, model in run.models.items():
            _check_config_model(role, model, run)
    lora = _lora(args, run)
    if args.plot:
        from batchfit.cli.render_budget import require_matplotlib

        require_matplotlib(args.plot)
    return {
        "backend": backend,
        "memory": memory,
        "reserve": reserve,
        "memory_defaulted": defaulted,
        "sharding": sharding,
        "launched": launched,
        "run": run,
        "calibration": limits,
        "lora": lora,
    }


MAX_SIZE_TEXT = 64
"""Longest ``--memory``/``--reserve`` text read as a size: ``80GiB`` is 5 characters, a preset about 12."""


def check_size_text(flag: str, value: Any) -> None:
    """Refuse a ``--memory``/``--reserve`` string too long to be a size (5,000 digits overflow a float).

    Raises:
        InvalidArgument: naming the flag, the start of the value and what a size looks like.
    """
    from batchfit.validation import short_repr

    if isinstance(value, str) and len(value) > MAX_SIZE_TEXT:
        raise InvalidArgument(
            f"{flag} is not a memory size: got {len(value):,} characters ({short_repr(value, 20)}); pass bytes, "
            "a size such as 80GiB, or a device preset such as h100-80gb"
        )


def check_reserve_fits(memory: Any, reserve: int | None, backend: str, world: int) -> None:
    """Refuse a ``--memory`` the reserve leaves nothing of, naming a default reserve as the default it is.

    Args:
        memory: ``--memory`` as given (a size or a preset), or a calibrated byte count.
        reserve: ``--reserve`` in bytes, ``None`` for the backend's default (the estimate backend:
            CUDA context, workspaces and, over more than one rank, NCCL's buffers; cpu: 0).
        backend: the backend's name.
        world: the ranks the model is sharded over (NCCL's buffers when > 1).

    Raises:
        InvalidArgument: the reserve is at least ``memory``; a default reserve is said to be the
            default, with ``--reserve`` to change it (never a byte count the user did not pass).
    """
    from batchfit.memory import format_bytes, parse_memory, untracked_memory

    total = parse_memory(memory, name="--memory")
    if reserve is not None:
        if reserve >= total:
            raise InvalidArgument(
                f"--memory {memory} leaves nothing once --reserve {format_bytes(reserve)} is taken off; raise "
                "--memory or lower --reserve (e.g. --reserve 0)"
            )
        return
    if backend != "estimate":
        return  # cpu: no reserve; cuda: measured on the device
    untracked = untracked_memory(str(memory), world_size=world, total_bytes=total)
    if untracked.reserve_bytes >= total:
        ranks = f" over {world} ranks" if world > 1 else ""
        raise InvalidArgument(
            f"--memory {memory} ({format_bytes(total)}) leaves nothing once the default reserve of "
            f"{format_bytes(untracked.reserve_bytes)} is taken off (what no tracker sees on a GPU{ranks}: "
            f"{untracked.describe()}); raise --memory, or pass --reserve SIZE (e.g. --reserve 0) to set it yourself"
        )


def _lora(args: argparse.Namespace, run: Any) -> Any:
    """``--lora-rank/--lora-alpha/--lora-targets`` as a :class:`~batchfit.models.lora.LoraSpec` (``None`` without them).

    The targets are checked against the policy's model now (built on the meta device), before
    any probe.

    Raises:
        InvalidArgument: a bad value, ``--lora-alpha``/``--lora-targets`` without ``--lora-rank``,
            targets that match no module, or PEFT not installed (one line each).
    """
    from batchfit.models import load_config
    from batchfit.models.lora import lora_parameters, lora_spec

    if args.lora_rank is None:
        for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets)):
            if value is not None:
                raise InvalidArgument(
                    f"{flag} needs --lora-rank N (the adapters' rank), but got {flag} without it"
                )
        return None
    names = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets"}
    spec = lora_spec(args.lora_rank, args.lora_alpha, args.lora_targets, names=names)
    if spec.enabled:
        model = args.model if run is None else run.models.get("policy")
        lora_parameters(load_config(model), spec, name="--lora-targets")
    return spec


def _calibration(args: argparse.Namespace, backend: str) -> Any:
    """Check ``--confirm`` and ``--calibration``; read the calibration when profiling with it.

    Returns:
        The :class:`~batchfit.memory.calibration.CalibratedLimits` of ``--calibration FILE``
        without ``--confirm``, else ``None``.

    Raises:
        InvalidArgument: ``--confirm`` with ``--config`` or without a real device, a
            ``--calibration`` folder that does not exist (with ``--confirm``), ``--reserve`` or
            ``--safety-margin`` beside a calibration to read, or a bad calibration file (one line each).
    """
    from pathlib import Path

    from batchfit.memory.calibration import calibrated_limits, load_calibration

    path = args.calibration
    if args.confirm:
        if args.config is not None:
            raise InvalidArgument(
                "--confirm runs one model's step and cannot be combined with --config; confirm each model with "
                "--model and the config's settings as flags"
            )
        if backend not in ("cpu", "cuda"):
            chose = " (auto chose estimate: no GPU here)" if args.backend == "auto" else ""
            raise InvalidArgument(
                f"--confirm runs the real step on a device, but got --backend {args.backend}{chose}; use "
                "--backend cpu --memory SIZE (real CPU tensors) or --backend cuda on a GPU"
            )
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise InvalidArgument(
                f"--calibration {path!r}: the folder {str(Path(path).parent)!r} does not exist; create it or write "
                "the calibration elsewhere"
            )
        return None
    if path is None:
        return None
    for flag, value in (("--reserve", args.reserve), ("--safety-margin", args.safety_margin)):
        if value is not None:
            raise InvalidArgument(
                f"{flag} cannot be combined with --calibration {path} (the calibration sets the reserve and the "
                f"safety margin); drop {flag}, or drop --calibration to set them by hand"
            )
    from batchfit.fileio import parse_json, read_text

    what = f"calibration file {str(path)!r}"
    if Path(path).exists():  # bounded first (NOTE [ Untrusted input files ]); the loader names a missing file
        parse_json(read_text(path, what), what)
    limits = calibrated_limits(load_calibration(path))
    cal = limits.calibration
    if backend not in (cal.backend, "estimate"):
        raise InvalidArgument(
            f"--calibration {path} was measured on {cal.backend} and does not apply to --backend {backend}; use "
            f"--backend {cal.backend} or estimate, or calibrate this device with --confirm --backend {backend} "
            f"--calibration FILE"
        )
    return limits


def _apply_config(args: argparse.Namespace, backend: str) -> Any:
    """Fill the flags the user left out from ``--config`` (a :class:`RunConfig`), then the defaults.

    Returns:
        The :class:`~batchfit.frameworks.RunConfig`, or ``None`` without ``--config``.

    Raises:
        InvalidArgument: ``--emit`` without ``--config``, ``--roles`` with it, a bad
            ``--emit``/``--emit-format``, a training strategy batchfit does not model.
        BatchConfigError: the config cannot be read (one line per fault).
    """
    from batchfit.frameworks.emit import FORMATS, TARGETS
    from batchfit.validation import check_choice

    check_choice("--emit-format", args.emit_format, FORMATS)
    run = None
    if args.config is None:
        if args.emit is not None:
            raise InvalidArgument(
                "--emit needs --config (the framework config whose keys to write); pass --config FILE"
            )
    else:
        from batchfit.frameworks import read_run_config
        from batchfit.frameworks.step import framework_step

        if args.emit is not None:
            check_choice("--emit", args.emit, TARGETS)
        if args.roles is not None:
            raise InvalidArgument(
                "--roles cannot be combined with --config: the config says which models run (drop --roles)"
            )
        run = read_run_config(args.config)
        _check_run_settings(run)
        if args.emit == "skyrl":
            _check_emit_plan(run)
        if args.model is not None:
            run = run.replace(model=args.model)
        if args.max_seq_len is None:
            args.max_seq_len = run.max_seq_len
        elif run.max_seq_len and args.max_seq_len < run.max_seq_len:
            # budgets for shorter sequences than the config's own: its plan refuses them as they are
            run = run.replace(warnings=(*run.warnings, (
                f"--max-seq-len {args.max_seq_len:,} is below the config's longest sequence ({run.max_seq_len:,} "
                "tokens, prompt and response): the budgets hold sequences up to the former, so the config's plan "
                "refuses them as they are; drop --max-seq-len, or lower the config's prompt and response lengths"
            )))
        if args.world_size is None and backend == "estimate":
            args.world_size = run.world_size
        if args.sharding is None:
            args.sharding = _strategy(run)
        if args.offload is None:
            args.offload = run.offload
        if str(args.sharding).lower() in ("fsdp1", "fsdp2"):  # FSDP's options, as the config sets them
            if args.mixed_precision is None:
                args.mixed_precision = run.mixed_precision
            if run.reshard_after_forward is False:
                args.reshard_after_forward = False
        if args.gradient_checkpointing is None and run.gradient_checkpointing is not None:
            args.gradient_checkpointing = bool(run.gradient_checkpointing)
        step = framework_step(run)  # the head and layout of the framework's own micro-batch
        args.step_notes = list(step.notes) if step is not None else []
        if args.emit is not None and args.emit != run.vocabulary and args.logprobs is None:
            from batchfit.frameworks.emit import target_head, target_reference_dtype

            args.logprobs = target_head(args.emit)  # the head the emitted run computes log-probs with
            run = run.replace(reference_dtype=target_reference_dtype(args.emit))  # and the reference it loads
            args.step_notes = [f"the budgets' probe runs {args.emit}'s log-prob head, the one the emitted run uses"]
        if step is not None and args.logprobs is None:
            args.logprobs = step.head
        config_cost = step.cost if step is not None else ("packed" if getattr(run, "remove_padding", False) else "padded")
        if args.emit is not None:
            _packed_for_emit(args, config_cost)  # every framework counts a micro-batch's tokens
        elif args.cost is None and (step is not None or config_cost == "packed"):
            args.cost = config_cost  # OpenRLHF (--ds.packing_samples, on with dynamic batches) and slime pack rows
    if args.max_seq_len is None:
        args.max_seq_len = DEFAULT_MAX_SEQ_LEN
    if args.offload is None:
        args.offload = "none"
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = True
    if args.roles is None:
        args.roles = "policy"
    if args.logprobs is None:
        args.logprobs = "full"
    if args.cost is None:
        args.cost = "padded"
    return run


def _check_response_flags(args: argparse.Namespace) -> None:
    """``--response-fraction`` needs ``--response-only`` and a share in ``(0, 1]``."""
    from batchfit.budget.step import check_response_fraction

    if args.response_fraction is None:
        return
    if not args.response_only:
        raise InvalidArgument(
            f"--response-fraction {args.response_fraction:g} is read only by the response-only head; add --response-only"
        )
    check_response_fraction(args.response_fraction, "--response-fraction")


# the keys a config's node and GPU counts are read from, for messages
_GPU_KEYS = {
    "verl": {"num_nodes": "trainer.nnodes", "gpus_per_node": "trainer.n_gpus_per_node"},
    "skyrl": {
        "num_nodes": "trainer.placement.policy_num_nodes",
        "gpus_per_node": "trainer.placement.policy_num_gpus_per_node",
    },
}


def _check_run_settings(run: Any) -> None:
    """The config's values profile reads (GPUs, strategy) must be of their kind, checked before they are used.

    ``plan`` judges a config's batch sizes; ``profile`` needs fewer keys but needs them right:
    a GPU count of ``"x"`` or a strategy of ``-1`` is named here with its key, not met as a
    TypeError later.

    Raises:
        InvalidArgument: a node or GPU count that is set but not an integer >= 1, or a strategy
            that is not a name (one line each, naming the config's key).
    """
    from batchfit.validation import is_int, short_repr

    batch = run.batch
    names = {**_GPU_KEYS.get(run.vocabulary, {}), **(getattr(run, "key_names", {}) or {})}
    for field in ("world_size", "num_nodes", "gpus_per_node"):
        value = getattr(batch, field, None)
        if value is not None and not (is_int(value) and value >= 1):
            key = names.get(field, field)
            raise InvalidArgument(
                f"the config's {key}={short_repr(value)} must be an integer >= 1 (GPUs and nodes count from 1); "
                "fix it in the config"
            )
    if run.strategy is not None and not isinstance(run.strategy, str):
        raise InvalidArgument(
            f"the config's training strategy={short_repr(run.strategy)} must be a name (fsdp, fsdp2, megatron, ...); "
            "fix it in the config, or pass --sharding fsdp2"
        )


def _check_emit_plan(run: Any) -> None:
    """The batch plan ``--emit skyrl`` derives its micro sizes from must hold, checked before any probe.

    Raises:
        BatchConfigError: the plan's faults in the config's own key names (e.g. ``update_epochs_per_batch:
            null``), now rather than after minutes of probing.
    """
    from batchfit.errors import BatchConfigError

    try:
        run.batch.replace(max_tokens_per_micro_batch=None, micro_train_batch_size_per_gpu=1).plan()
    except BatchConfigError as exc:
        raise BatchConfigError([run.in_own_words(f) for f in exc.faults]) from None


def _packed_for_emit(args: argparse.Namespace, config_cost: str) -> None:
    """``--emit`` writes packed-row budgets: verl and SkyRL count a micro-batch's valid tokens, OpenRLHF and slime pack.

    The emitted keys turn padding removal on (:mod:`batchfit.frameworks.emit`); a config that
    keeps padding is profiled packed and a note says so.

    Raises:
        InvalidArgument: ``--cost padded`` with it.
    """
    if args.cost == "padded":
        raise InvalidArgument(
            f"--emit {args.emit} writes token budgets {args.emit} counts in valid tokens, which bound packed rows "
            "only (the emitted keys turn padding removal on): drop --cost padded"
        )
    if config_cost == "padded":
        args.step_notes.append(
            "the config keeps each micro-batch's padding, which no token budget bounds: the keys below turn "
            "padding removal on, and the budgets are for packed rows"
        )
    args.cost = "packed"


def _strategy(run: Any) -> str | None:
    """The sharding that models the config's training strategy: verl's ``fsdp`` is FSDP1, SkyRL's ``fsdp`` FSDP2."""
    from batchfit.parallel.sharding import STRATEGIES

    strategy = (run.strategy or "fsdp").lower()
    if strategy in ("fsdp", "fsdp2"):
        # one GPU too: the framework still wraps the model (fp32 master weights, bf16 compute)
        if strategy == "fsdp" and run.vocabulary == "verl":  # FullyShardedDataParallel
            if "fsdp1" in STRATEGIES:
                return "fsdp1"
            raise InvalidArgument(
                "the config trains with verl's strategy=fsdp (FSDP1, FullyShardedDataParallel), which batchfit "
                "does not model: set actor_rollout_ref.actor.strategy=fsdp2, or pass --sharding fsdp2 to profile it as FSDP2"
            )
        return "fsdp2"
    from batchfit.frameworks import strategy_refusal

    refusal = strategy_refusal(run)  # OpenRLHF's DeepSpeed stages, slime's Megatron: the framework's own hint
    if refusal is not None:
        raise InvalidArgument(refusal)
    raise InvalidArgument(
        f"the config trains with strategy={run.strategy!r}, which batchfit does not model; pass "
        "--sharding fsdp2 to profile it as FSDP2 (an upper bound for tensor/pipeline parallelism)"
    )


def _check_config_model(role: str, model: Any, run: Any) -> None:
    """The config's model must load: name the key it came from and the override."""
    from batchfit.models import load_config

    if not model:
        raise InvalidArgument(f"the config names no {role} model; pass --model PRESET|DIR")
    try:
        load_config(model)
    except InvalidArgument as exc:
        if role == "critic":  # --model replaces the policy's model (and so the reference's) only
            where = "read from the critic's model path in the config; --model sets the policy's model only: set the critic's path there"
        else:
            where = f"read from {run.source.get('model', 'the config')}; --model overrides it"
        raise InvalidArgument(f"{exc} ({where})") from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from batchfit.budget.profile import profile_model

    settings = resolve_settings(args)
    if args.confirm:
        return _run_confirm(args, settings)
    with _process_group(settings) as rank:
        console = Console(soft_wrap=True)
        err = Console(stderr=True)
        show_progress = args.progress and not args.json and rank == 0  # a bar, or lines when not a terminal
        if settings["run"] is not None:
            return _run_config(args, settings, console, err, show_progress, rank)
        with _progress(err, show_progress) as callback:
            profile = profile_model(args.model, _profile_options(args, settings, callback), roles=args.roles)
        if rank != 0:
            return 0
        if args.plot:
            from batchfit.cli.render_budget import plot_budget

            plot_budget(profile.budgets, args.plot)
        if args.json:
            from batchfit.frameworks.emit import provenance

            data = profile.to_dict()
            data["memory_defaulted"] = settings["memory_defaulted"]
            data["budget"] = provenance(profile.backend)  # estimated (estimate backend) or measured
            if settings["calibration"] is not None:
                data["calibration"] = {"path": args.calibration, **settings["calibration"].to_dict()}
            json.dump(data, sys.stdout, indent=2)
            sys.stdout.write("\n")
            return 0
        _render(console, profile, settings, args)
    return 0


def _run_confirm(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    """``--confirm``: estimate (before joining any ranks), run the real step at each budget, render, save the calibration.

    The estimate simulates the ranks, so under torchrun it runs before the process group is
    joined (:func:`~batchfit.budget.confirm.plan_confirm`); the runs then happen on the real
    ranks (:func:`~batchfit.budget.confirm.run_confirm`), and rank 0 prints.
    """
    from rich.console import Console

    from batchfit.budget.confirm import plan_confirm, run_confirm

    err = Console(stderr=True)
    first = os.environ.get("RANK", "0") == "0"
    show_progress = args.progress and not args.json and first  # a bar, or lines when not a terminal
    _select_device(settings)  # cuda: plan_confirm reads this rank's device
    with _progress(err, show_progress) as callback:
        plan = plan_confirm(args.model, _profile_options(args, settings, callback), roles=args.roles)
    with _process_group(settings) as rank:
        report = run_confirm(plan, check=False)
    error = report.error()
    if rank != 0:
        return 0 if error is None else 1
    calibration = report.calibration() if args.calibration else None
    if calibration is not None:
        from batchfit.fileio import replacing

        with replacing(args.calibration) as tmp:  # NOTE [ Writes replace, never truncate ]
            calibration.save(tmp)
    if args.plot:
        from batchfit.cli.render_budget import plot_budget

        plot_budget(report.profile.budgets, args.plot)
    if args.json:
        data = report.profile.to_dict()
        data["memory_defaulted"] = settings["memory_defaulted"]
        data["confirm"] = report.to_dict()
        if args.calibration:
            data["calibration"] = {"path": args.calibration, "written": calibration is not None}
            if calibration is not None:
                data["calibration"].update(calibration.to_dict())
        if error is not None:
            data["error"] = {"type": type(error).__name__, "faults": [str(error)]}
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
        if error is not None:
            sys.stderr.write(f"batchfit profile: error: {error}\n")
            return 1
        return 0
    from batchfit.cli.render_budget import confirm_lines, confirm_table

    console = Console(soft_wrap=True)
    _render(console, report.profile, settings, args)
    console.print()
    head, *rest = confirm_lines(report)
    console.print(head, highlight=False)
    for line in rest:
        console.print(f"  {line}", highlight=False)
    for role, confirmation in report.roles.items():
        console.print()
        console.print(confirm_table(confirmation, report.backend))
        for line in confirm_lines(report, role):
            console.print(line, highlight=False)
    if args.calibration:
        console.print()
        if calibration is None:
            console.print(
                f"no calibration written to {args.calibration}: no confirm run ran to the end",
                highlight=False,
            )
        else:
            from batchfit.memory.calibration import calibrated_limits

            console.print(f"calibration written to {args.calibration}", highlight=False)
            console.print(
                f"  profiling with it (--calibration {args.calibration}): {calibrated_limits(calibration).describe()}",
                highlight=False,
            )
    if error is not None:
        raise error
    return 0


def _profile_options(args: argparse.Namespace, settings: dict[str, Any], progress: Any) -> Any:
    """The :class:`~batchfit.budget.ProfileOptions` of this run, from the flags and resolved settings."""
    from batchfit.budget.options import ProfileOptions

    return ProfileOptions(
        max_seq_len=args.max_seq_len,
        sharding=settings["sharding"],
        backend=settings["backend"],
        memory_limit=settings["memory"],
        reserve_bytes=settings["reserve"],
        dtype=args.dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        logprobs=args.logprobs,
        cost=args.cost,
        safety_margin=args.safety_margin,
        depth_extrapolation=args.depth_extrapolation,
        progress=progress,
        lora=settings.get("lora"),
        response_only=args.response_only,
        response_fraction=args.response_fraction,
    )


def _run_config(
    args: argparse.Namespace, settings: dict[str, Any], console: Any, err: Any, show_progress: bool, rank: int
) -> int:
    """``--config``: profile every pass of the run; render it, or emit the framework's keys."""
    from batchfit.frameworks.emit import FLAG_TARGETS, check_emit, emit_keys, provenance, render_keys
    from batchfit.frameworks.older_torch import older_torch_notes
    from batchfit.frameworks.profile import profile_run
    from batchfit.memory import format_bytes

    run = settings["run"]
    if args.emit is not None:  # what the target cannot carry is refused before any probe
        check_emit(run, _profile_options(args, settings, False), args.emit)
    with _progress(err, show_progress) as callback:
        result = profile_run(run, _profile_options(args, settings, callback))
    if rank != 0:
        return 0
    notes = list(getattr(args, "step_notes", [])) + older_torch_notes(result) + list(result.notes)
    keys = None
    if args.emit is not None:
        keys = emit_keys(result, args.emit, max_seq_len=args.max_seq_len, margin=args.safety_margin)
    if args.plot:
        from batchfit.cli.render_budget import plot_budget

        plot_budget(result.budgets, args.plot)
    if args.json:
        data = result.to_dict()
        data["memory_defaulted"] = settings["memory_defaulted"]
        data["older_torch"] = older_torch_notes(result)
        data["notes"] = notes  # the framework step's, the older torch's and the run's
        data["budget"] = provenance(settings["backend"])  # estimated (estimate backend) or measured
        data["run_notes"] = list(getattr(run, "notes", ()))
        data["warnings"] = list(run.warnings)  # what the config sets that the budgets do not model
        if keys is not None:
            data["emit"] = {k.path: list(k.value) if isinstance(k.value, tuple) else k.value for k in keys if k.path}
            data["emit_notes"] = [k.comment for k in keys if not k.path]  # what no key can say
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if keys is not None:
        target = settings["memory"] if settings["memory"] is not None else "the device"
        header = [
            f"batchfit profile --config {args.config} --emit {args.emit}"
            + (" --response-only" if args.response_only else ""),
            f"{', '.join(sorted(set(filter(None, run.models.values()))))}, max_seq_len {args.max_seq_len:,}, "
            f"{settings['sharding'].describe()}, {target} per GPU, safety margin {args.safety_margin:g}, "
            f"budgets {provenance(settings['backend'])} ({settings['backend']} backend)",
        ]
        if result.resident:
            shared = ", ".join(f"{role} {format_bytes(b)}" for role, b in result.resident.items())
            header.append(f"colocated models' state taken off each budget: {shared}")
        header += [f"note: {note}" for note in (*notes, *getattr(run, "notes", ()))]
        header += [f"warning: {warning}" for warning in run.warnings]
        text = render_keys(keys, args.emit, header, args.emit_format)
        sys.stdout.write(text)
        if args.emit_format == "overrides" and args.emit not in FLAG_TARGETS:  # no comments: the notes on stderr
            sys.stderr.write("".join(f"note: {k.comment}\n" for k in keys if not k.path))
        return 0
    console.print(
        f"config {args.config}: {run.vocabulary} vocabulary; models "
        + ", ".join(f"{role} {model}" for role, model in run.models.items())
        + (f"; colocated {', '.join(run.colocated)}" if run.colocated else ""),
        highlight=False,
    )
    for note in (*notes, *getattr(run, "notes", ())):
        console.print(f"note: {note}", highlight=False)
    for warning in run.warnings:
        console.print(f"warning: {warning}", highlight=False)
    for role, profile in result.profiles.items():
        console.print()
        console.rule(f"{role} model", style="dim")
        _render(console, profile, settings, args)
        if profile.resident_bytes:
            console.print(
                f"colocated models keep {format_bytes(profile.resident_bytes)} per GPU on the device; "
                "taken off the usable memory above",
                highlight=False,
            )
    return 0


def _reserve(value: str | None) -> int | None:
    """``--reserve`` in bytes (``0`` allowed), ``None`` when not given (the backend's default)."""
    from batchfit.memory import parse_memory

    if value is None:
        return None
    if value.strip() in ("0", "0B", "0b"):
        return 0
    return parse_memory(value, name="--reserve")


@contextlib.contextmanager
def _process_group(settings: dict[str, Any]) -> Iterator[int]:
    """Under torchrun with cpu/cuda: join the ranks (gloo/nccl) for the run; yields this rank."""
    import torch.distributed as dist

    if settings["launched"] == 1 or settings["backend"] == "estimate" or dist.is_initialized():
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    with process_group(settings["backend"]) as rank:  # LOCAL_RANK's GPU for cuda; the one collective timeout
        yield rank


def _select_device(settings: dict[str, Any]) -> None:
    """Under torchrun with cuda: this rank's GPU (``LOCAL_RANK``) becomes the current device."""
    if settings["backend"] == "cuda" and settings["launched"] > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _render(console: Any, profile: Any, settings: dict[str, Any], args: argparse.Namespace) -> None:
    from batchfit.cli.render_budget import breakdown_table, budget_lines, budget_table, pass_title
    from batchfit.memory import format_bytes

    target = settings["memory"] if settings["memory"] is not None else "the device"
    if isinstance(target, int):  # the calibrated device's bytes
        target = format_bytes(target)
    if settings["memory_defaulted"]:
        target = f"{target} (default target without a GPU; set --memory)"
    limit = f"{format_bytes(profile.memory_limit)}" if profile.memory_limit else "device total"
    depth = f"{profile.depth} layers"
    if profile.measured_depths:
        depth += f", extrapolated from {profile.measured_depths[0]} and {profile.measured_depths[1]}"
    precision = (
        f"{profile.dtype} params, {profile.compute_dtype} compute"
        if profile.compute_dtype != profile.dtype
        else profile.dtype
    )
    console.print(
        f"batchfit profile: model {profile.model} ({depth}; {precision}"
        f"{', gradient checkpointing' if profile.gradient_checkpointing else ''}, AdamW, "
        f"{profile.logprobs} log-probs), max_seq_len {args.max_seq_len:,}, cost {args.cost}",
        highlight=False,
    )
    if profile.lora is not None:
        from batchfit.cli.render_budget import lora_text

        console.print(lora_text(profile), highlight=False)
    console.print(f"sharding: {profile.sharding.describe()}", highlight=False)
    if profile.torch is not None:
        for b in profile.torch.behaviours:
            console.print(
                f"torch {profile.torch.torch_version} ({b.detected_by}): {b.meaning}", highlight=False
            )
    terms = "" if profile.untracked is None else f" ({profile.untracked.describe()})"
    console.print(
        f"backend {profile.backend} → {target} per rank: {limit}, reserve {format_bytes(profile.reserve_bytes)}{terms}, "
        f"safety margin {args.safety_margin:g}",
        highlight=False,
    )
    if settings.get("calibration") is not None:
        console.print(
            f"calibration {args.calibration}: {settings['calibration'].describe()}", highlight=False
        )
    if args.confirm:
        console.print(
            f"--confirm: the budgets estimated against the {settings['backend']} device's memory and reserve; "
            "its real runs follow",
            highlight=False,
        )
    for role, budget in profile.budgets.items():
        console.print()
        console.print(budget_table(budget, title=pass_title(role)))
        for line in budget_lines(budget):
            console.print(line, highlight=False)
    console.print()
    console.print(breakdown_table(profile))
    if len(profile.budgets) > 1:
        combined = profile.combined
        console.print()
        console.print(
            f"combined budget (every role fits): C = {combined.tokens:,} tokens per rank, set by "
            f"{pass_title(combined.binding_role)}",
            highlight=False,
        )
    if args.plot:
        console.print(f"plot written to {args.plot}", highlight=False)


class _progress:
    """Progress fed by :class:`~batchfit.budget.BudgetProgress` events: a rich bar on a terminal, else lines.

    When stderr is not a terminal (a log file, a CI job, a pipe) each probe and each finished
    length is one flushed line on stderr, the finished lengths with the time so far and, from
    the first finished length on, the time left for that role (elapsed per length × lengths
    left; lengths are probed longest first, so it errs long). A probe is said in tokens, as the
    sequences it holds (:meth:`~batchfit.budget.Probe.shape`: ``3×32,768 + 1,234 = 99,538
    tokens``), so packed probes of one length never read as the same batch; a finished length
    gives the largest probe measured to fit there.
    """

    def __init__(self, console: Any, enabled: bool):
        self.console, self.enabled = console, enabled
        self.bar: Any = None
        self.tasks: dict[Any, Any] = {}
        self.started: dict[Any, float] = {}
        self.last = 0.0
        self.largest: dict[tuple[Any, int], Any] = {}  # (role, seq_len) -> the largest probe that fitted

    def __enter__(self) -> Any:
        if not self.enabled:
            return False
        if not self.console.is_terminal:
            import time

            self.last = time.monotonic()
            return self.line
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),  # from the lengths done so far (longest first: it errs long)
            console=self.console,
            transient=True,
        )
        self.bar.__enter__()
        return self.update

    def line(self, event: Any) -> None:
        """One line per event on stderr, flushed (see the class docstring)."""
        import time

        role = event.role or "probing"
        now = time.monotonic()
        start = self.started.setdefault(role, self.last)  # a role starts when the one before it ended
        self.last = now
        if event.probe is not None:
            text = f"{role}: probe {event.probes}: {self._probe_text(event)}"
        else:
            done = event.length_index + 1
            total = max(event.n_lengths, done)
            elapsed = now - start
            left = elapsed / done * (total - done)
            largest = self.largest.get((event.role, event.seq_len))
            if largest is not None:
                best = f", largest fitting {largest.shape()}"
            else:
                best = "" if event.max_batch_size is None else f", largest batch {event.max_batch_size:,}"
            eta = f", about {_duration(left)} left" if total > done else ""
            text = f"{role}: length {done}/{total} done (s={event.seq_len:,}{best}); {_duration(elapsed)} so far{eta}"
        with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr full or closed
            sys.stderr.write(f"batchfit profile: {text}\n")
            sys.stderr.flush()

    def _probe_text(self, event: Any) -> str:
        """``3×32,768 + 1,234 = 99,538 tokens does not fit``; remembers the largest probe that fitted at its length."""
        p = event.probe
        if p.fits:
            key = (event.role, p.seq_len)
            if key not in self.largest or p.total_tokens > self.largest[key].total_tokens:
                self.largest[key] = p
        return f"{p.shape()} {'fits' if p.fits else 'does not fit'}"

    def update(self, event: Any) -> None:
        key = event.role
        if key not in self.tasks:
            self.tasks[key] = self.bar.add_task(f"{key or 'probing'}", total=event.n_lengths)
        task = self.tasks[key]
        if event.probe is not None:
            self.bar.update(task, description=f"{key or 'probing'}: {self._probe_text(event)}")
        else:
            self.bar.update(
                task, total=max(event.n_lengths, event.length_index + 1), completed=event.length_index + 1
            )

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def _duration(seconds: float) -> str:
    """``"42 s"``, ``"3 min 5 s"``."""
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"
