"""``batchfit profile``'s flags checked and resolved: defaults, ``--config``, ``--calibration``.

:func:`resolve_settings` fails fast on bad values, before any model is built.
"""

from __future__ import annotations

import argparse
from typing import Any

from batchfit.budget.profile import check_roles
from batchfit.cli._ranks import launched_world
from batchfit.errors import InvalidArgument
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


def _reserve(value: str | None) -> int | None:
    """``--reserve`` in bytes (``0`` allowed), ``None`` when not given (the backend's default)."""
    from batchfit.memory import parse_memory

    if value is None:
        return None
    if value.strip() in ("0", "0B", "0b"):
        return 0
    return parse_memory(value, name="--reserve")
